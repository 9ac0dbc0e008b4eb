"""Checkpoints as people run them, served: tiny random models with Llama 3.1's and Qwen3's real
rope settings (llama3 scaling at theta 500000; YaRN x4 over 32768, written the transformers-v5
way; dynamic NTK) behind `hetero up`. A prompt long enough to bridge gets the decoder's own
answer: verdict complete, the decoder's usage shows every prompt token but the last cached, and
the text equals the decoder's native answer to the same request. A Mistral-style model with sliding-window
layers is served the same way, past its window too: a cold prompt is bridged (`hetero verify`: the
sliding layer's window and the full layers' rows the decoder's bit for bit), a warm tail from past
the window is left to the decoder, and the verdict says why. Past a dynamic rope's max_position_embeddings every decoder call ropes its rows
with a base of its own: a cold prompt is bridged with the calls the seam reports (and `hetero
verify` finds its cache the decoder's bit for bit on both of mlx-lm's prefill paths); a warm tail
there is left to the decoder, whose earlier calls set the rest.

Needs HETERO_TOKENIZER (the checkpoints are random; the tokenizer is real) and the binary.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from frontstack import (HETERO, ROOT, Decoder, answer, chat, kill_with_children, need,
                        openai_chat, start_up, text)

pytest.importorskip("mlx_lm")

from hetero_mlx.tiny import TinyShape, make_tiny_llama  # noqa: E402

MODELS = {
    "llama31": TinyShape(
        "llama", 2, 128, 2, 1, 64, 256, tie=True, rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=json.dumps({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192,
                                 "rope_type": "llama3"})),
    "qwen3-yarn": TinyShape(
        "qwen3", 2, 96, 4, 1, 32, 192, tie=True, rope_theta=1000000.0,
        max_position_embeddings=131072, rope_parameters=True,
        rope_scaling=json.dumps({"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 32768})),
    # Dynamic NTK over a short max_position_embeddings, so a prompt can go past it.
    "llama-dynamic": TinyShape(
        "llama", 2, 64, 4, 2, 16, 128, tie=True, max_position_embeddings=1500,
        rope_scaling=json.dumps({"type": "dynamic", "factor": 2.0})),
    # Layer 1 of 3 attends over the last 1,500 positions only (RotatingKVCache); layer 2's rows
    # show what it computed.
    "mistral-sliding": TinyShape(
        "mistral", 3, 64, 4, 2, 16, 128, tie=False, sliding_window=1500),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, tmp_path_factory, tokenizer_dir):
    tmp = tmp_path_factory.mktemp(request.param)
    model = tmp / "model"
    make_tiny_llama(tokenizer_dir, model, seed=31, shape=MODELS[request.param])
    up, _, (port, dport, _) = start_up(tmp, model)
    try:
        secret = (tmp / "work" / "secret").read_text().strip()
        yield request.param, port, Decoder(dport, secret)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=30)
        except Exception:
            kill_with_children(up)


def test_bridged_answer_is_the_decoders_own(served) -> None:
    name, port, decoder = served
    body = chat(text(f"rope-{name}", 400), max_tokens=24)
    native = decoder.native(body)
    assert native["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    got, v, usage = openai_chat(SimpleNamespace(port=port), body, stream=False)
    T = native["usage"]["prompt_tokens"]
    assert T >= 300, T  # past the front's bridge-min-tokens default (256)
    assert v["verdict"] == "complete" and (v["B"], v["T"]) == (T - 1, T), v
    assert usage.prompt_tokens_details.cached_tokens == T - 1
    assert got == answer(native), (got, answer(native))


@pytest.mark.parametrize("served", ["mistral-sliding"], indirect=True)
def test_past_the_sliding_window_a_cold_prompt_is_bridged_and_a_warm_tail_is_not(served):
    name, port, decoder = served
    front = SimpleNamespace(port=port)
    body = chat(text("slide-cold", 1600), max_tokens=24)
    got, v, usage = openai_chat(front, body, stream=False)
    T = v["T"]
    assert T > 1500, v
    # (From the decoder's entry for the template's system part, if an earlier request left it:
    # rows before the window are the same however the decoder made them.)
    assert v["verdict"] == "complete" and v["B"] == T - 1 and v.get("start", 0) < 1500, v
    assert usage.prompt_tokens_details.cached_tokens == T - 1
    # The next turn: the decoder holds the first and its answer, whose rows its one-token calls
    # made past the window, summing it in its rotating cache's order. (Its cache past the window
    # cannot be trimmed, so the decoder's own cold answer comes last, from the same turns.)
    cold = warm_turn_left_to_decoder(front, decoder, body, got, "slide-warm",
                                     "past the decoder's sliding window of 1500")
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, cold["usage"]
    assert got == answer(cold), (got, answer(cold))


def warm_turn_left_to_decoder(front, decoder, body: dict, got: str, key: str, why: str) -> dict:
    """The turn after body (whose bridged answer was got): left to the decoder, the verdict
    saying `why`, and answered as the decoder's own two turns answer it, the second warm from
    the first. Returns the decoder's own reply to body (cold)."""
    turn = dict(body, messages=body["messages"] + [
        {"role": "assistant", "content": got}, {"role": "user", "content": text(key, 400)}])
    got2, v2, _ = openai_chat(front, turn, stream=False)
    assert v2["verdict"] != "complete" and not v2.get("B"), v2
    assert why in json.dumps(v2), v2
    decoder.clear()
    cold = decoder.post("/v1/chat/completions", body, timeout=600)
    warm = decoder.post("/v1/chat/completions", turn, timeout=600)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 1500, warm["usage"]
    assert got2 == answer(warm), (got2, answer(warm))
    return cold


@pytest.mark.parametrize("served", ["llama-dynamic"], indirect=True)
def test_past_a_dynamic_ropes_reach_a_cold_prompt_is_bridged_and_a_warm_tail_is_not(served):
    name, port, decoder = served
    front = SimpleNamespace(port=port)
    body = chat(text("dyn-cold", 1600), max_tokens=24)
    native = decoder.native(body)
    T = native["usage"]["prompt_tokens"]
    assert T > 1500, native["usage"]
    got, v, usage = openai_chat(front, body, stream=False)
    assert v["verdict"] == "complete" and (v["B"], v["T"]) == (T - 1, T), v
    assert usage.prompt_tokens_details.cached_tokens == T - 1
    assert got == answer(native), (got, answer(native))
    # The next turn: the decoder holds the first; its tail's rows past the reach would need the
    # ropes of calls made before, which no request names.
    warm_turn_left_to_decoder(front, decoder, body, got, "dyn-warm",
                              "past the reach of the decoder's rope")


def verify_report(model: Path, prompt: Path, work: Path) -> dict:
    need(HETERO, "hetero binary")
    cmd = [str(HETERO), "verify", "--model", str(model), "--prompt-file", str(prompt),
           "--max-tokens", "16", "--python", sys.executable, "--work-dir", str(work)]
    env = {"PYTHONPATH": str(ROOT / "python")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **env})
    try:
        return dict(json.loads(proc.stdout), rc=proc.returncode)
    except json.JSONDecodeError:
        pytest.fail(f"verify printed no JSON (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


@pytest.mark.parametrize("system", [False, True])
def test_past_the_sliding_window_the_cache_is_the_decoders_bit_for_bit(tokenizer_dir, tmp_path,
                                                                       system) -> None:
    """`hetero verify` on a prompt of ~3,800 tokens over a window of 1,500: the sliding layer's
    cache is the decoder's window, the full layers' every row, all bit-exact; the decoder
    continues from the mount as from its own prefill. (The single path keeps no entry at B to
    compare with past the window: its cache is stored after the answer and cannot be cut back.)"""
    model = tmp_path / "model"
    make_tiny_llama(tokenizer_dir, model, seed=31, shape=MODELS["mistral-sliding"])
    messages = [{"role": "user", "content": text("slide-verify", 3400)}]
    if system:
        messages.insert(0, {"role": "system", "content": "You are terse. " * 40})
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps({"messages": messages}))
    r = verify_report(model, prompt, tmp_path / "work")
    assert r["rc"] == 0 and r["pass"], r.get("failures") or r.get("error")
    assert r["T"] > 2 * 1500, r["T"]
    assert r["arrays"]["bit_exact"] == r["arrays"]["count"] == 6 and r["arrays"]["max_ulp"] == 0
    assert r["continuation"]["identical"]
    assert r["decoder_accounting"]["bridged"]["processed"] == 1


@pytest.mark.parametrize("path", ["batch", "batch-with-system", "single"])
def test_past_a_dynamic_ropes_reach_the_cache_is_the_decoders_bit_for_bit(tokenizer_dir, tmp_path,
                                                                        path) -> None:
    """`hetero verify` on a prompt of ~3,800 tokens over max_position_embeddings 1,500: two
    prefill calls past it, each with its own base (MLX float32 on the batch path, Python doubles
    on the single one, which a request with "seed" takes), every cache array bit-exact."""
    model = tmp_path / "model"
    # Factor 3 at theta 10,000: the first call's base (its end 2,048) in MLX float32 and in
    # Python doubles differ by enough to change its inverse frequencies, so taking the wrong
    # path's arithmetic misses bits (bench/past_reach_verify.py's control: 1 of 4 arrays).
    shape = dataclasses.replace(MODELS["llama-dynamic"], rope_theta=10000.0,
                                rope_scaling=json.dumps({"type": "dynamic", "factor": 3.0}))
    make_tiny_llama(tokenizer_dir, model, seed=31, shape=shape)
    messages = [{"role": "user", "content": text("dyn-verify", 3400)}]
    if path == "batch-with-system":
        messages.insert(0, {"role": "system", "content": "You are terse. " * 40})
    request = {"messages": messages, **({"seed": 5} if path == "single" else {})}
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(request))
    r = verify_report(model, prompt, tmp_path / "work")
    assert r["rc"] == 0 and r["pass"], r.get("failures") or r.get("error")
    assert r["T"] > 3 * 1024, r["T"]  # calls of 2,048: two end past 1,500
    assert r["arrays"]["bit_exact"] == r["arrays"]["count"] == 4 and r["arrays"]["max_ulp"] == 0
    assert r["continuation"]["identical"]
    assert r["decoder_accounting"]["bridged"]["processed"] == 1
