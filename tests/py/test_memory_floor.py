"""The memory floor, on real processes (frontstack.py): a prompt whose cache would pass the
prefill host's budget is not refused and nothing is killed. The host prefills the longest
prefix of whole chunks that fits and seals its stream there; the front mounts that prefix
(`partial B/T`, with the reason beside it) and the decoder computes the rest natively, so the
answer is the decoder's own.

On the decode side, the seam declines a mount whose arrays would pass the decoder's budget
(`serve --mount-budget-mb`), with both numbers, and the answer is still the decoder's own.

The tiny test model's cache is 256 bytes a token (2 layers, K and V, 2 kv heads of 16, bf16),
held in blocks of 256 tokens: a 1 MiB budget holds exactly 4,096 tokens, 8 chunks of 512.
"""

import json

import pytest
from frontstack import (TINY, answer, cached_tokens, chat, post_front, requests, running_stack,
                        text, verdict_of)

BUDGET_MB = 1
FITS = 4096  # tokens of the tiny model's cache in BUDGET_MB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with running_stack(TINY, tmp_path_factory.mktemp("floor"), "tiny test model") as stack:
        yield stack


def test_a_prompt_over_the_host_budget_is_sealed_and_answered_by_the_decoder(tiny) -> None:
    prefill = tiny.prefill(chunk=512, extra=("--host-memory-budget-mb", BUDGET_MB))
    front = tiny.front(prefill.port)
    body = chat(text("memory-floor", 5000), max_tokens=16)
    native = tiny.native(body)
    T = native["usage"]["prompt_tokens"]
    assert T - 1 > FITS + 512, T  # the whole prompt does not fit, and more than a chunk is left
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    print("memory-floor", json.dumps(v))
    assert v["verdict"] == f"partial {FITS}/{T}" and v["B"] == FITS, v
    assert "sealed at the memory floor" in v["reason"], v
    assert f"{FITS} of {T - 1} tokens fit" in v["reason"] and "the budget is 1.0 MiB" in v["reason"]
    assert v["confirmed"] and cached_tokens(r.json()) == FITS, v  # the decoder reused the prefix
    assert answer(r.json()) == answer(native)
    # Nothing was killed, and a prompt that fits is still bridged whole by the same host.
    assert prefill.popen.poll() is None
    assert "sealed at the memory floor" in prefill.log()
    short = chat(text("memory-floor-short", 400), max_tokens=8)
    native = tiny.native(short)
    r = post_front(front, short)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    assert v["verdict"] == "complete", v
    assert answer(r.json()) == answer(native)


def test_with_the_floor_off_a_prompt_over_the_budget_gets_the_decoders_answer(tiny) -> None:
    prefill = tiny.prefill(chunk=512, extra=("--host-memory-budget-mb", BUDGET_MB,
                                             "--memory-floor", "refuse"))
    front = tiny.front(prefill.port)
    body = chat(text("memory-floor-refuse", 5000), max_tokens=16)
    native = tiny.native(body)
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    assert v["verdict"].startswith("declined: ") and "budget is 1.0 MiB" in v["verdict"], v
    assert answer(r.json()) == answer(native)
    assert prefill.popen.poll() is None
    assert requests.get(f"http://127.0.0.1:{prefill.port}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def tight_decoder(tmp_path_factory):
    with running_stack(TINY, tmp_path_factory.mktemp("floor-seam"), "tiny test model",
                       decoder_args=("--mount-budget-mb", BUDGET_MB)) as stack:
        yield stack


def test_the_seam_declines_a_mount_over_the_decoders_budget(tight_decoder) -> None:
    front = tight_decoder.front(tight_decoder.prefill(chunk=512).port)
    body = chat(text("mount-budget", 5000), max_tokens=16)
    native = tight_decoder.native(body)
    T = native["usage"]["prompt_tokens"]
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    print("mount-budget", json.dumps(v))
    assert v["verdict"].startswith("declined: mount failed: "), v
    assert f"mounting {T - 1} tokens needs" in v["verdict"], v
    assert f"(--mount-budget-mb) is {BUDGET_MB << 20} bytes" in v["verdict"], v
    assert cached_tokens(r.json()) == 0
    assert answer(r.json()) == answer(native)
    # Under the budget, the same decoder mounts.
    short = chat(text("mount-budget-short", 400), max_tokens=8)
    native = tight_decoder.native(short)
    r = post_front(front, short)
    assert verdict_of(r.headers)["verdict"] == "complete"
    assert answer(r.json()) == answer(native)
