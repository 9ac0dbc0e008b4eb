"""Several cold bridges at once, on real processes (frontstack.py): eight clients send eight
different cold prompts at the same moment. Every one is bridged whole, its verdict confirmed by
the decoder's own usage, and every answer equals the decoder's own for that prompt. (The front
door runs one bridge at a time and queues the rest, `bridge_queue` in each verdict's timings; the
decoder answers them as they come.)"""

import threading

from frontstack import (TINY, answer, cached_tokens, chat, post_front, running_stack, text,
                        verdict_of)

import pytest

N = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with running_stack(TINY, tmp_path_factory.mktemp("concurrent"), "tiny test model") as stack:
        yield stack


def test_eight_cold_bridges_at_once_are_each_confirmed_and_answer_as_the_decoder(tiny) -> None:
    bodies = [chat(text(f"concurrent-{i}", 300 + 40 * i), max_tokens=12) for i in range(N)]
    native = [answer(tiny.native(b)) for b in bodies]  # each computed cold; the cache left empty
    front = tiny.front(tiny.prefill(chunk=128).port)
    replies = [None] * N

    def one(i: int) -> None:
        replies[i] = post_front(front, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queued = 0
    for i, r in enumerate(replies):
        assert r is not None and r.status_code == 200, (i, r.text if r is not None else None)
        v = verdict_of(r.headers)
        assert v["verdict"] == "complete" and v["confirmed"], (i, v)
        assert cached_tokens(r.json()) == v["B"] == v["T"] - 1, (i, v)
        assert answer(r.json()) == native[i], i
        queued += v["timings_ms"]["bridge_queue"] > 0
    assert queued >= 1  # they did arrive together: some waited for the running bridge
