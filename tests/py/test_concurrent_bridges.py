"""Several cold bridges at once, on real processes (frontstack.py): eight clients send eight
different cold prompts at the same moment. Every one is bridged whole, its verdict confirmed by
the decoder's own usage, and every answer equals the decoder's own for that prompt. (The front
door runs them side by side; the prefill host runs one prefill at a time and queues the rest,
`bridge_queue` in each verdict's timings.) The prefill host's queue is bounded: beyond it a
request is answered 503 with Retry-After, which the front turns into the decoder's own answer,
and a waiting request whose sender hangs up leaves the queue."""

import json
import socket
import threading
import time

from frontstack import (TINY, Stack, answer, cached_tokens, chat, post_front, requests,
                        running_stack, text, verdict_of)

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


def raw_post(port: int, path: str, body: dict) -> socket.socket:
    """A POST whose answer is left unread: the socket stays open until closed."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST %s HTTP/1.1\r\nHost: prefill\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (path.encode(), len(data)) + data)
    return s


def wait_for(predicate, timeout: float) -> float:
    """Seconds until predicate() held; fails past timeout."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_the_prefill_hosts_queue_is_bounded_and_a_waiter_that_hangs_up_leaves_it(tiny) -> None:
    # A host whose streams stall after their first frame, so the first request holds its turn.
    host = tiny.prefill("stall-after:1", fresh=True, extra=("--queue", "1"))
    health = lambda: requests.get(Stack.url(host.port, "/health"), timeout=5).json()
    queue = lambda: (health()["queue"]["running"], health()["queue"]["waiting"])
    body = {"ids": [(i * 7919) % 40000 + 1 for i in range(150)],
            "fingerprint": health()["fingerprint"]}
    first = raw_post(host.port, "/v1/prefill", body)
    wait_for(lambda: queue() == (1, 0), 10)
    second = raw_post(host.port, "/v1/prefill", body)
    wait_for(lambda: queue() == (1, 1), 10)
    assert health()["queue"]["max_waiting"] == 1
    # Beyond the queue: 503, a Retry-After in whole seconds, and why in a JSON body.
    full = requests.post(Stack.url(host.port, "/v1/prefill"), json=body, timeout=30)
    assert full.status_code == 503, full.text
    assert int(full.headers["Retry-After"]) >= 1
    assert full.json()["error"]["code"] == "queue_full", full.text
    assert "--queue 1" in full.json()["error"]["message"]
    # Through a front door the refused bridge is the decoder's own answer, saying why.
    front = tiny.front(host.port)
    prompt = chat(text("queue-full", 300), max_tokens=8)
    native = answer(tiny.native(prompt))
    r = post_front(front, prompt)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    assert v["verdict"].startswith("declined") and "queue is full" in v["verdict"], v
    assert answer(r.json()) == native
    # The waiting one hangs up: it leaves the queue within a second; the running one, its turn.
    second.close()
    left = wait_for(lambda: queue() == (1, 0), 5)
    print(f"a waiter that hung up left the queue after {left:.3f} s")
    assert left < 1.0
    first.close()
    wait_for(lambda: queue() == (0, 0), 5)
