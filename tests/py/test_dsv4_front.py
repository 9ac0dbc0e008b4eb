"""DeepSeek-V4 through the front door, on real processes: the mlx-vlm decoder with its seam
(the `native` variant of the tiny checkpoint), `hetero prefill` on the official FP8 layout
(`fp8/`) with the decoder's export, and `hetero front`.

A bridged chat request must come back with verdict `complete`, B = T - 1, and the decoder's own
accounting (`usage.prompt_tokens_details.cached_tokens`) must show that only the last token was
processed. The answer must equal the decoder's native answer to the same request, computed
cold. A prefill host whose export disagrees with its checkpoint (a wrong YaRN factor) must be
refused before it serves. A stream that breaks mounts its longest verified prefix (the state at
each segment's end travels with it) and the answer is the decoder's own; one that breaks too
early is declined with its reason, and the answer is still the decoder's. A prompt whose state
would pass the prefill host's memory budget is sealed at the longest prefix of whole chunks that
fits, mounted there, and answered by the decoder from it, as its own.

Needs HETERO_DSV4_MODEL (models/dsv4-tiny) and build/hetero.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

requests = pytest.importorskip("requests")

from frontstack import Decoder, warm_turn  # noqa: E402
from test_front import (  # noqa: E402
    ENV,
    HETERO,
    PY,
    ROOT,
    Stack,
    answer,
    chat,
    export_weights,
    need,
    post_front,
    text,
    verdict_of,
)

DSV4 = Path(os.environ.get("HETERO_DSV4_MODEL", ROOT / "models" / "dsv4-tiny"))


# The decoder prefills in calls of this many tokens (its --prefill-step-size), so a ~170-token
# prompt takes several calls: the bridge must follow that schedule (and its 2..8-token tail,
# which the decoder runs token by token), and a truncated stream has segments to lose.
DECODER_STEP = 32


class Dsv4Stack(Stack):
    def __init__(self, model: Path, tmp: Path):
        self.model, self.tmp = model, tmp
        self.store = tmp / "store"
        self.store.mkdir()
        self.weights = export_weights(model, tmp / "weights")
        self.procs, self._cache = [], {}
        self.decoder = self._start("decoder", [PY, "-m", "hetero_mlx", "serve", "--model", model,
                                               "--store", self.store, "--prefill-step-size",
                                               DECODER_STEP], "/hetero/info", 300)
        self.info = requests.get(self.url(self.decoder.port, "/hetero/info"), timeout=10).json()
        assert self.info["prefill"]["step"] == DECODER_STEP, self.info["prefill"]

    def native(self, body: dict, path: str = "/v1/chat/completions") -> dict:
        """The decoder's own answer, cold. mlx-vlm checkpoints the prompt (not the reply) before
        answering, so clearing after the reply leaves the prefix cache empty."""
        self.clear()
        r = requests.post(self.url(self.decoder.port, path), json=body, timeout=600)
        assert r.status_code == 200, r.text
        self.clear()
        return r.json()


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    need(HETERO, "hetero binary")
    for variant in ("native", "fp8"):
        need(DSV4 / variant / "config.json", f"DeepSeek-V4 tiny checkpoint ({variant})")
    stack = Dsv4Stack(DSV4 / "native", tmp_path_factory.mktemp("dsv4"))
    try:
        yield stack
    finally:
        stack.stop()


def served(stack: Stack, content: str, max_tokens: int = 16) -> dict:
    body = chat(content, max_tokens=max_tokens)
    body["model"] = stack.info["forward_model"]
    return body


# chunk 32: one decoder call per engine chunk; 128: the served host groups four calls into a
# chunk and runs each inside it as the decoder did.
@pytest.mark.parametrize("chunk", [32, 128])
def test_front_bridges_deepseek_v4_complete(dsv4, chunk) -> None:
    front = dsv4.front(dsv4.prefill(chunk=chunk, model=DSV4 / "fp8").port)
    body = served(dsv4, text("dsv4-bridge", 120))
    native = dsv4.native(body)
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    reply = r.json()
    T = reply["usage"]["prompt_tokens"]
    assert v["verdict"] == "complete", v
    assert v["B"] == T - 1 and v["T"] == T, v
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == T - 1, reply["usage"]
    assert v["bytes"] > 0
    assert answer(reply) == answer(native), (answer(reply), answer(native))


# A stream that breaks after its second segment (chunks of 64: two of the decoder's 32-token
# calls each) mounts the first 128 rows with the state at their end; the decoder goes on natively
# from there, in its calls from row 128, which are those of its own cold run of the prompt (its
# steps count from 128, a multiple of 32). So the answer must be the decoder's own, cold.
@pytest.mark.parametrize("fault", ["truncate-after:2", "corrupt:2", "exit-after:2"])
def test_broken_stream_mounts_its_longest_verified_prefix(dsv4, fault) -> None:
    front = dsv4.front(dsv4.prefill(chunk=64, model=DSV4 / "fp8", fault=fault, fresh=True).port,
                       **{"partial-min-fraction": 0.05})
    body = served(dsv4, text("dsv4-broken", 120))
    native = dsv4.native(body)
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    T = r.json()["usage"]["prompt_tokens"]
    assert v["verdict"] == f"partial 128/{T}" and v["B"] == 128, v
    assert v["confirmed"] and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    assert answer(r.json()) == answer(native), (answer(r.json()), answer(native))


# The tiny model's CPU engine counts 260 bytes of state a token beside ~1.1 MiB of window rows
# and a 64-token chunk's buffers (Dsv4CpuEngine::reserve_bytes): 2 MiB hold ~3,590 tokens, so a
# ~4,600-token prompt is sealed at a chunk boundary past half of it.
@pytest.mark.slow
def test_a_prompt_over_the_host_budget_is_sealed_and_answered_by_the_decoder(dsv4) -> None:
    prefill = dsv4.prefill(chunk=64, model=DSV4 / "fp8", fresh=True,
                           extra=("--host-memory-budget-mb", 2))
    front = dsv4.front(prefill.port)
    body = served(dsv4, text("dsv4-memory-floor", 4200))
    native = dsv4.native(body)
    T = native["usage"]["prompt_tokens"]
    assert T - 1 > 3590 + 64, T  # the whole prompt does not fit, and more than a chunk is left
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    print("dsv4-memory-floor", json.dumps(v))
    B = v["B"]
    assert v["verdict"] == f"partial {B}/{T}" and B % 64 == 0 and (T - 1) / 2 <= B < T - 64, v
    assert f"sealed at the memory floor: {B} of {T - 1} tokens fit" in v["reason"], v
    assert "the budget is 2.0 MiB" in v["reason"], v
    assert v["confirmed"] and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == B, v
    assert answer(r.json()) == answer(native), (answer(r.json()), answer(native))
    # Nothing was killed, and a prompt that fits is bridged whole by the same host.
    assert prefill.popen.poll() is None
    short = served(dsv4, text("dsv4-memory-floor-short", 120))
    native = dsv4.native(short)
    r = post_front(front, short)
    assert r.status_code == 200, r.text
    assert verdict_of(r.headers)["verdict"] == "complete", verdict_of(r.headers)
    assert answer(r.json()) == answer(native)


def test_a_break_before_the_partial_minimum_is_declined(dsv4) -> None:
    # One segment of ~170 rows is under --partial-min-fraction 0.5: the native answer, and why.
    front = dsv4.front(dsv4.prefill(chunk=64, model=DSV4 / "fp8", fault="truncate-after:1",
                                    fresh=True).port)
    body = served(dsv4, text("dsv4-truncated", 120))
    native = dsv4.native(body)
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    assert v["verdict"].startswith("declined") and "(verified 64/" in v["verdict"], v
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert answer(r.json()) == answer(native)


def test_wrong_yarn_factor_is_refused_before_serving(dsv4, tmp_path) -> None:
    # The prefill host's checkpoint with a different YaRN factor than the decoder's.
    bad = tmp_path / "fp8-wrong-yarn"
    shutil.copytree(DSV4 / "fp8", bad)
    config = json.loads((bad / "config.json").read_text())
    config["rope_scaling"]["factor"] = 8
    (bad / "config.json").write_text(json.dumps(config))
    run = subprocess.run([str(HETERO), "prefill", "--model", str(bad), "--weights",
                          str(dsv4.weights), "--port", "0"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env=ENV)
    assert run.returncode != 0
    assert "rope_scaling.factor is 16 in the decoder's export and 8 in the prefill model" in \
        run.stderr, run.stderr
    assert "before any cache is written" in run.stderr


def test_prefill_without_the_decoder_schedule_makes_no_cache(dsv4, tmp_path) -> None:
    # The decoder's cache depends on its call schedule; a request that does not carry it is
    # refused by the cache program instead of guessed.
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(100, 140))))
    run = subprocess.run([str(HETERO), "prefill", "--model", str(DSV4 / "fp8"), "--weights",
                          str(dsv4.weights), "--ids-file", str(ids), "--out",
                          str(tmp_path / "out.safetensors")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env=ENV)
    assert run.returncode != 0
    assert "needs 'decoder_calls'" in run.stderr, run.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_warm_turns_bridge_only_their_tail_and_answer_as_the_decoder(dsv4) -> None:
    """A conversation: the decoder's own, warm as it goes, is the truth. Through the front door
    from a cold decoder, the first turn is bridged whole; each later one only from what the
    decoder holds (its checkpoint of the previous prompt), resumed from the prefill host's own
    checkpoints of that prompt, and every answer is the decoder's own."""
    turns = 4
    decoder = Decoder(dsv4.decoder.port)

    def body_of(messages: list) -> dict:
        return {"model": dsv4.info["forward_model"], "messages": messages, "max_tokens": 12,
                "temperature": 0.0}

    def turn_text(k: int) -> str:
        return text(f"dsv4-turn-{k}", 60 + 35 * k)

    decoder.clear()
    native, messages = [], []
    for k in range(turns):
        messages.append({"role": "user", "content": turn_text(k)})
        native.append(answer(decoder.post("/v1/chat/completions", body_of(messages), timeout=600)))
        messages.append({"role": "assistant", "content": native[-1]})

    front = dsv4.front(dsv4.prefill(chunk=64, model=DSV4 / "fp8", fresh=True).port,
                       **{"bridge-min-tail": 16})
    decoder.clear()
    messages = []
    for k in range(turns):
        messages.append({"role": "user", "content": turn_text(k)})
        ids, held, r, v = warm_turn(decoder, front, body_of(messages))
        T, B = len(ids), len(ids) - 1
        print("turn", k + 1, json.dumps({"T": T, "held": held, "verdict": v["verdict"],
                                         "start": v.get("start", 0), "computed": v.get("computed"),
                                         "bytes": v["bytes"]}))
        assert v["verdict"] == "complete" and v["B"] == B, v
        assert v["confirmed"] and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == B
        if k == 0:
            assert held == 0 and "start" not in v and v["computed"] == B, v
        else:
            # The decoder holds the previous prompt (its checkpoint); only the tail is computed.
            assert held > 0 and v["start"] == held and v["computed"] == B - held, (held, v)
            assert "reason" not in v, v  # not the whole prefix after a refused tail
        assert answer(r.json()) == native[k], (k, v)
        messages.append({"role": "assistant", "content": answer(r.json())})


def test_a_tail_the_prefill_host_holds_no_checkpoint_for_is_bridged_whole(dsv4) -> None:
    # A prefill host that never saw the first turn: it refuses the tail (409
    # prefix_state_missing) and the front asks for the whole prefix, which the decoder mounts in
    # place of its own; the answer is still the decoder's.
    # The whole prefix is computed in the decoder's calls for a cold prompt, so the answer to
    # compare with is the decoder's own to the same prompt, cold.
    decoder = Decoder(dsv4.decoder.port)
    body = served(dsv4, text("dsv4-first", 90))
    decoder.clear()
    first = decoder.post("/v1/chat/completions", body, timeout=600)
    body["messages"] += [{"role": "assistant", "content": answer(first)},
                         {"role": "user", "content": text("dsv4-second", 80)}]
    native = dsv4.native(body)
    decoder.post("/v1/chat/completions", dict(body, messages=body["messages"][:1]), timeout=600)
    ids = decoder.post("/hetero/tokenize", body)["ids"]
    held = decoder.cached(ids)
    assert held > 0
    front = dsv4.front(dsv4.prefill(chunk=64, model=DSV4 / "fp8", fresh=True).port,
                       **{"bridge-min-tail": 16})
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    assert v["verdict"] == "complete" and "start" not in v and v["B"] == len(ids) - 1, v
    assert "no checkpoint of exactly the first" in v["reason"], v
    assert answer(r.json()) == answer(native)
