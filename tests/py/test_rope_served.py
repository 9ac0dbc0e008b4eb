"""Checkpoints as people run them, served: tiny random models with Llama 3.1's and Qwen3's real
rope settings (llama3 scaling at theta 500000; YaRN x4 over 32768, written the transformers-v5
way; dynamic NTK) behind `hetero up`. A prompt long enough to bridge gets the decoder's own
answer: verdict complete, the decoder's usage shows every prompt token but the last cached, and
the text equals the decoder's native answer to the same request. A Mistral-style model with sliding-window
layers is served the same way. A prompt past a dynamic rope's max_position_embeddings, or past
the sliding window, is left to the decoder, and the verdict says why.

Needs HETERO_TOKENIZER (the checkpoints are random; the tokenizer is real) and the binary.
"""

import json
import signal
from types import SimpleNamespace

import pytest

from frontstack import Decoder, answer, chat, kill_with_children, openai_chat, start_up, text

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
    # Every other layer attends over the last 1,500 positions only (RotatingKVCache).
    "mistral-sliding": TinyShape(
        "mistral", 2, 64, 4, 2, 16, 128, tie=False, sliding_window=1500),
}

# What a prompt past each model's reach is refused for, with its reach.
PAST_REACH = {
    "llama-dynamic": "past max_position_embeddings (1500)",
    "mistral-sliding": "past the decoder's sliding window of 1500 tokens",
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


@pytest.mark.parametrize("served", sorted(PAST_REACH), indirect=True)  # the others reach any length
def test_a_prompt_past_the_models_reach_is_the_decoders(served) -> None:
    name, port, decoder = served
    body = chat(text(f"past-{name}", 1600), max_tokens=24)
    got, v, usage = openai_chat(SimpleNamespace(port=port), body, stream=False)
    native = decoder.native(body, settle=False)  # the module's last request: cold, then left
    T = native["usage"]["prompt_tokens"]
    assert T > 1500, native["usage"]
    assert v["verdict"] != "complete" and not v.get("B"), v
    assert f"a prompt of {T} tokens is {PAST_REACH[name]}" in v["verdict"], v
    assert got == answer(native), (got, answer(native))
