"""A client that hangs up mid-bridge stops its prefill (issue 17), on real processes
(frontstack.py) with the default model, whose prefill on this machine's CPU takes many seconds.

The front door watches the client's socket while the prefill streams (HttpServer::
client_gone, asked every 100 ms); on a hang-up it shuts its connection to the prefill host, whose
worker sees its own receiver gone before its next chunk, stops, and frees the host for the next
request. The decoder is not asked.
"""

import json
import socket
import time

import pytest
from frontstack import REAL, answer, chat, post_front, running_stack, text, verdict_of

STOPPED = "the receiver went away: stopped after "


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    with running_stack(REAL, tmp_path_factory.mktemp("disconnect"), "the default model") as stack:
        yield stack


def wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_client_that_hangs_up_mid_bridge_stops_its_prefill_within_a_second(real) -> None:
    prefill = real.prefill(chunk=32)  # the host notices a hang-up between chunks
    front = real.front(prefill.port)
    body = json.dumps(chat(text("hang-up", 5000), max_tokens=16)).encode()
    client = socket.create_connection(("127.0.0.1", front.port))
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: front\r\n"
                   b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                   + body)
    time.sleep(4)  # mid-prefill: tokenized, routed, and a few chunks streamed
    assert STOPPED not in prefill.log(), "the prefill ended before the client hung up"
    client.close()
    hung_up = time.monotonic()
    assert wait_for(lambda: STOPPED in prefill.log(), 10), prefill.log()[-2000:]
    stopped_after = time.monotonic() - hung_up
    line = next(l for l in prefill.log().splitlines() if STOPPED in l)
    print(f"stopped {stopped_after:.3f} s after the hang-up: {line}")
    assert stopped_after < 1.0, (stopped_after, line)
    done, of = (int(w) for w in line.split(STOPPED)[1].split(" tokens")[0].split(" of "))
    assert 0 < done < of, line  # it stopped part-way
    assert wait_for(lambda: "the client went away" in front.log(), 5), front.log()[-2000:]
    # The host is free: the next request is bridged whole and answered as the decoder would.
    short = chat(text("after-hang-up", 300), max_tokens=8)
    native = real.native(short)
    r = post_front(front, short)
    assert r.status_code == 200, r.text
    assert verdict_of(r.headers)["verdict"] == "complete"
    assert answer(r.json()) == answer(native)
