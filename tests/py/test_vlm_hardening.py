"""The DeepSeek-V4 decoder seam's hardening (issue 50) on mlx-vlm's own server with the tiny
checkpoint: every request on the port signed (mlx-vlm's own paths included), the body that
crashed mlx-vlm refused, bodies bounded and never chunked, the port's bounds on uvicorn
(request deadline, waiting connections per client, header bytes; vlm_port.py), a caller that
hangs up stops its generation (vlm_cancel.py), tenants' salts as mlx-vlm's own APC tenants, and
a dead generation thread reported instead of waited on. The mlx-lm seam's counterpart:
test_seam_hardening.py.
"""

import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from seam_server import REPO, get, info, ok, post, request, seam_server, signed

from hetero_mlx.access import signed_headers

mx = pytest.importorskip("mlx.core")
requests = pytest.importorskip("requests")
pytest.importorskip("mlx_vlm")

SERVER_ENV = {"APC_CHECKPOINT_INTERVAL_TOKENS": "32", "APC_CHECKPOINT_ENTRIES": "4"}
SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
SHORT = "Why is the sky blue? Explain it like I am five years old, please, in plain words. " * 3


@pytest.fixture(scope="module")
def model_dir() -> str:
    root = os.environ.get("HETERO_DSV4_MODEL")
    if not root:
        pytest.skip("HETERO_DSV4_MODEL is not set (e.g. models/dsv4-tiny from tiny-dsv4)")
    path = Path(root)
    if not (path / "config.json").exists():
        variant = "bf16" if mx.metal.is_available() else "native"
        path = path / os.environ.get("HETERO_DSV4_VARIANT", variant)
    if not (path / "config.json").exists():
        pytest.skip(f"no DeepSeek-V4 checkpoint at {path}")
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with seam_server(model_dir, tmp_path_factory, "/hetero/info", 180, extra_env=SERVER_ENV,
                     extra_args=("--max-body-mb", "1")) as srv:
        yield srv


def chat_body(server, text, **extra):
    body = {"model": server["model"], "messages": [SYSTEM, {"role": "user", "content": text}]}
    body.update({"max_tokens": 4, "temperature": 0, **extra})
    return body


def cached_of(reply) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_every_path_needs_a_signature(server):
    for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                               ("POST", "/v1/chat/completions", chat_body(server, "hi")),
                               ("POST", "/unload", {}), ("GET", "/hetero/info", None)):
        data = json.dumps(body).encode() if body is not None else b""
        r = requests.request(method, server["url"] + path, data=data, timeout=30,
                             headers={"Content-Type": "application/json"})
        assert (r.status_code, r.json()["error"]["code"]) == (401, "unauthorized"), path
    assert get(server, "/health").json()["status"] == "healthy"
    # Clock skew says the server's time; a replayed signature is refused.
    path, data = "/hetero/cached_prefix", json.dumps({"ids": [1, 2, 3]}).encode()
    skewed = signed_headers(server["secret"], "POST", path, data, t=int(time.time()) - 1000)
    r = requests.post(server["url"] + path, data=data, timeout=10,
                      headers={"Content-Type": "application/json", **skewed})
    assert (r.status_code, r.json()["error"]["code"]) == (401, "clock_skew")
    assert abs(int(r.headers["X-Hetero-Time"]) - time.time()) < 5
    headers = {"Content-Type": "application/json", **signed(server, "POST", path, data)}
    assert requests.post(server["url"] + path, data=data, headers=headers, timeout=10).ok
    r = requests.post(server["url"] + path, data=data, headers=headers, timeout=10)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "replayed")


def test_bodies_that_crash_mlx_vlm_are_refused(server):
    # scripts/explore_decoder_killers.py --vlm: logit_bias {"2**40": 1} was a segfault.
    vocab = info(server)["vocab_size"]
    for extra, code in (({"logit_bias": {str(2**40): 1}}, "bad_logit_bias"),
                        ({"logit_bias": {str(vocab): 1}}, "bad_logit_bias"),
                        ({"messages": [{"role": "user", "content": [
                            {"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]},
                         "remote_image_refused")):
        status, reply = post(server, "/v1/chat/completions", chat_body(server, "hi", **extra))
        assert (status, reply["error"]["code"]) == (400, code), reply
    assert ok(server, "/v1/chat/completions", chat_body(server, "hi"))["usage"]["prompt_tokens"]


def port_of(server) -> int:
    return int(server["url"].rsplit(":", 1)[1])


def raw_exchange(server, data: bytes, timeout: float = 10) -> tuple:
    """Sends bytes as they are on a new connection from 127.0.0.1; (everything the server sent
    back, whether it then closed the connection) after it closes or `timeout` passes."""
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except socket.timeout:
            return out, False
        except ConnectionError:
            pass
        return out, True


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_bodies_are_bounded_and_never_chunked(server):
    for path in ("/v1/chat/completions", "/hetero/tokenize"):
        auth = signed(server, "POST", path)["Authorization"]
        for framing, code in ((b"Content-Length: 2000000", 413),
                              (b"Transfer-Encoding: chunked", 411)):
            # Refused from the header, before any body byte is sent; the connection, its body
            # unread, is closed at once.
            start = time.monotonic()
            reply, closed = raw_exchange(server, b"POST " + path.encode() +
                                         b" HTTP/1.1\r\nHost: x\r\n" + framing +
                                         b"\r\nAuthorization: " + auth.encode() + b"\r\n\r\n")
            assert status_of(reply) == code, (path, reply[:200])
            assert closed and time.monotonic() - start < 5, (path, reply[:200])
    # Chunks on their way are refused the same way.
    path = "/v1/chat/completions"
    auth = signed(server, "POST", path)["Authorization"]
    reply, closed = raw_exchange(server, b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                                 b"Transfer-Encoding: chunked\r\nAuthorization: " +
                                 auth.encode() + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert status_of(reply) == 411 and closed
    assert get(server, "/health").json()["status"] == "healthy"


def test_request_heads_are_bounded(server):
    # uvicorn's h11 answered a head over 16 KiB only while it was still arriving (a 400), and
    # any head that came in one read went through; now both are 431, and the connection closes.
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 20000 + b"\r\n\r\n"
    reply, closed = raw_exchange(server, head)
    assert status_of(reply) == 431 and closed, reply[:200]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "headers_too_large"
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as s:
        s.sendall(head[:10000])
        time.sleep(0.2)
        s.sendall(head[10000:])
        reply = s.recv(65536)
    assert status_of(reply) == 431, reply[:200]
    line = b"GET /" + b"y" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    assert status_of(raw_exchange(server, line)[0]) == 431
    assert get(server, "/health").json()["status"] == "healthy"


def test_one_client_holds_at_most_64_waiting_connections(server):
    # The 65th waiting connection from one address takes the place of its oldest: a client that
    # trickles loses its connections, one that sends its request at once (the front door, on
    # the same address) is always served.
    before = info(server)["connections"]["evicted"]
    held = [socket.create_connection(("127.0.0.1", port_of(server)), timeout=5,
                                     source_address=("127.0.0.9", 0)) for _ in range(70)]
    try:
        time.sleep(1.0)
        closed = []
        for i, s in enumerate(held):
            s.settimeout(0.05)
            try:
                if s.recv(1) == b"":
                    closed.append(i)
            except socket.timeout:
                pass
            except ConnectionError:
                closed.append(i)
        assert closed == list(range(6))  # the oldest six
        assert info(server)["connections"]["evicted"] - before >= 6
        # The same address, a whole request at once, with 64 of its connections waiting: served.
        path, body = "/hetero/cached_prefix", b'{"ids": [1, 2]}'
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10,
                                      source_address=("127.0.0.9", 0)) as s:
            s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                      b"\r\nAuthorization: " + signed(server, "POST", path, body)[
                          "Authorization"].encode() + b"\r\n\r\n" + body)
            reply = s.recv(65536)
        assert status_of(reply) == 200, reply[:300]
    finally:
        for s in held:
            s.close()


def test_slowloris_never_locks_out_the_front_door(server):
    # Regression (issue 50): uvicorn let a client hold any number of connections by sending a
    # byte every few seconds. 300 connections from 127.0.0.1, the front door's own address, each
    # trickling one header byte every 2 s: all closed (the oldest as newer ones come, past 64
    # waiting; the rest by the 10 s deadline), while a signed /hetero/info from 127.0.0.1 is
    # answered within 3 s each time. Five more, from another address, send a whole signed head
    # at once and trickle its body: the deadline covers the body too.
    before = info(server)["connections"]
    head = b"GET /health HTTP/1.1\r\nHost: seam\r\nX-Slow: " + b"y" * 64
    socks = [socket.create_connection(("127.0.0.1", port_of(server)), timeout=5)
             for _ in range(300)]
    payloads = [head] * 300
    path, body = "/hetero/cached_prefix", b'{"ids": [1, 2, 3]}' + b" " * 982
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", port_of(server)), timeout=5,
                                     source_address=("127.0.0.2", 0))
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: seam\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 1000\r\nAuthorization: " +
                  signed(server, "POST", path, body)["Authorization"].encode() + b"\r\n\r\n")
        socks.append(s)
        payloads.append(body)
    start, closed_at, stop = time.monotonic(), {}, threading.Event()

    def trickle():
        at = 0
        while not stop.is_set() and len(closed_at) < len(socks):
            for i, s in enumerate(socks):
                if i in closed_at:
                    continue
                try:
                    payload = payloads[i]
                    s.sendall(payload[at % len(payload):at % len(payload) + 1])
                    s.setblocking(False)
                    if s.recv(1) == b"":
                        closed_at[i] = time.monotonic() - start
                except BlockingIOError:
                    pass
                except OSError:
                    closed_at[i] = time.monotonic() - start
            at += 1
            stop.wait(2.0)

    thread = threading.Thread(target=trickle)
    thread.start()
    try:
        for _ in range(3):
            t0 = time.monotonic()
            assert get(server, "/hetero/info", timeout=10).status_code == 200
            assert time.monotonic() - t0 < 3
            time.sleep(1)
        thread.join(30)
        assert len(closed_at) == 305, f"{305 - len(closed_at)} still open"
        assert max(closed_at.values()) < 15
        assert all(closed_at[i] >= 9 for i in range(300, 305)), closed_at
        late = [t for t in closed_at.values() if t >= 9]  # those the deadline closed
        assert len(late) >= 55, sorted(closed_at.values())[-70:]
        after = info(server)["connections"]
        assert after["evicted"] - before["evicted"] >= 300 - 64
        assert after["closed_late"] - before["closed_late"] >= len(late)
    finally:
        stop.set()
        thread.join()
        for s in socks:
            s.close()


# ---- a caller that hangs up stops its generation (vlm_cancel.py) -----------------------------


def open_completion(server, body: dict, path: str = "/v1/chat/completions") -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port_of(server)), timeout=60)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: seam\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\nAuthorization: "
              f"{signed(server, 'POST', path, data)['Authorization']}\r\n\r\n".encode() + data)
    return s


def generations(server, since: int) -> tuple:
    """mlx-vlm's log after byte `since`: ({request: max_tokens} queued, set of requests its
    generation thread cancelled)."""
    text = server["log"].read_bytes()[since:].decode(errors="replace")
    queued = {m[0]: int(m[1]) for m in
              re.findall(r"Generation queued: request=(\w+) .*max_tokens=(\d+)", text)}
    return queued, set(re.findall(r"Generation cancelled: request=(\w+)", text))


def test_callers_that_hang_up_stop_their_generations(server):
    # Regression (issue 50): a non-streaming completion ran on to max_tokens after its caller
    # closed the connection (mlx-vlm generates it on a worker thread and looks at the connection
    # only to send the reply).
    since = server["log"].stat().st_size
    before = info(server)["requests"]
    socks = [open_completion(server, chat_body(server, f"{i} Tell me a long story.",
                                                max_tokens=4000)) for i in range(10)]
    time.sleep(1.0)
    assert wait_until(lambda: info(server)["requests"]["in_flight"] == 10, 30)
    for s in socks:
        s.close()
    # The watch closes every generation at the hang-up.
    assert wait_until(lambda: info(server)["requests"]["in_flight"] == 0, 3)
    after = info(server)["requests"]
    assert after["stopped_on_hang_up"] - before["stopped_on_hang_up"] == 10
    # mlx-vlm's generation thread drops them at its next step (a batched prefill chunk can
    # take seconds on a loaded CPU), long before 4,000 tokens.
    long = lambda: {r for r, n in generations(server, since)[0].items() if n == 4000}  # noqa
    assert wait_until(lambda: len(long()) == 10 and long() <= generations(server, since)[1], 60)
    reply = ok(server, "/v1/chat/completions", chat_body(server, "hi"))
    assert reply["usage"]["completion_tokens"] == 4
    assert info(server)["requests"]["in_flight"] == 0


def test_the_hang_up_watch_on_mlx_vlm_s_kind_of_app():
    # No model: vlm_cancel.watched on a FastAPI app with mlx-vlm's kind of middleware
    # (@app.middleware("http"), which runs the endpoint in a task group) and its kind of
    # endpoint (the generation read on a worker thread). A generation running at the hang-up
    # is closed and its worker returns; one asked for after the hang-up is never made (the
    # ClientGone that says so comes out of the middleware grouped); both count as stopped.
    import asyncio
    import queue

    from fastapi import FastAPI

    from hetero_mlx.cancel import Liveness
    from hetero_mlx.vlm_cancel import WATCH, watched

    class FakeTokens:  # mlx-vlm's _TokenIterator: a queue its generation thread fills
        def __init__(self):
            self.queue, self.closed = queue.Queue(), False

        def __iter__(self):
            return self

        def __next__(self):
            item = self.queue.get(timeout=10)
            if item is None:
                raise StopIteration
            return item

        def close(self):
            self.closed = True
            self.queue.put(None)  # the generation thread ends a cancelled request's queue

    made = []
    app = FastAPI()

    @app.middleware("http")
    async def server_header(request, call_next):
        response = await call_next(request)
        response.headers["Server"] = "fake"
        return response

    @app.post("/generate")
    async def generate(late: bool = False):
        def blocking():
            if late:
                time.sleep(0.5)  # the caller hangs up before the generation is asked for
            WATCH.get().check()
            inner = FakeTokens()
            made.append(inner)
            return sum(1 for _ in WATCH.get().track(inner))

        return {"tokens": await asyncio.to_thread(blocking)}

    async def serve(late: bool) -> tuple:
        async def receive():  # the caller hangs up 0.1 s in
            await asyncio.sleep(0.1)
            return {"type": "http.disconnect"}

        sent, liveness = [], Liveness()

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "POST", "scheme": "http", "path": "/generate",
                 "raw_path": b"/generate", "query_string": b"late=1" if late else b"",
                 "root_path": "", "headers": [(b"content-length", b"0")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
        await asyncio.wait_for(watched(app, scope, b"", receive, send, liveness), 5)
        return sent, liveness.stats()

    sent, stats = asyncio.run(serve(late=False))
    assert len(made) == 1 and made[0].closed
    assert stats == {"in_flight": 0, "stopped_on_hang_up": 1}
    made.clear()
    sent, stats = asyncio.run(serve(late=True))
    assert made == [] and sent == []
    assert stats == {"in_flight": 0, "stopped_on_hang_up": 1}


def test_a_streaming_caller_that_hangs_up_stops_its_generation(server):
    since = server["log"].stat().st_size
    before = info(server)["requests"]["stopped_on_hang_up"]
    s = open_completion(server, chat_body(server, "Tell me a long story.", max_tokens=4000,
                                          stream=True))
    got = b""
    while got.count(b"data:") < 3:
        chunk = s.recv(65536)
        assert chunk, got
        got += chunk
    assert info(server)["requests"]["in_flight"] == 1
    s.close()
    assert wait_until(lambda: info(server)["requests"]["in_flight"] == 0, 3)
    assert info(server)["requests"]["stopped_on_hang_up"] == before + 1
    queued = lambda: generations(server, since)  # noqa: E731
    assert wait_until(lambda: set(queued()[0]) and set(queued()[0]) <= queued()[1], 30)


def test_tenants_are_mlx_vlm_s_own_apc_tenants(server):
    body = chat_body(server, SHORT + " Tenants.")
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    a, b = dict(body, hetero_cache_salt="aa"), dict(body, hetero_cache_salt="bb")
    assert cached_of(ok(server, "/v1/chat/completions", a)) == 0
    cached = lambda salt: ok(server, "/hetero/cached_prefix",  # noqa: E731
                             {"ids": ids, "hetero_cache_salt": salt})["cached_tokens"]
    assert cached("aa") == len(ids) - 1
    assert cached("bb") == 0
    assert ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"] == 0
    assert cached_of(ok(server, "/v1/chat/completions", b)) == 0
    assert cached_of(ok(server, "/v1/chat/completions", a)) == len(ids) - 1
    # A caller's own tenant header changes nothing: only the signed body's salt counts.
    r = request(server, "POST", "/v1/chat/completions", body, headers={"X-APC-Tenant": "hetero-aa"})
    assert cached_of(r.json()) == 0
    status, reply = post(server, "/v1/chat/completions", dict(body, hetero_cache_salt="AA"))
    assert (status, reply["error"]["code"]) == (400, "bad_cache_salt")


@pytest.fixture(scope="module")
def killable(model_dir, tmp_path_factory):
    """A seam whose mlx-vlm generation thread ends (a BaseException) once a marker file exists."""
    hook = tmp_path_factory.mktemp("killable")
    marker = hook / "kill"
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "from mlx_vlm.server import generation\n"
        "apply = generation.ResponseGenerator._apply_cancellations\n"
        "def dying(self, *args):\n"
        f"    if os.path.exists({str(marker)!r}):\n"
        "        raise SystemExit('test: the generation thread dies')\n"
        "    return apply(self, *args)\n"
        "generation.ResponseGenerator._apply_cancellations = dying\n")
    env = dict(SERVER_ENV, PYTHONPATH=f"{hook}{os.pathsep}{REPO / 'python'}")
    with seam_server(model_dir, tmp_path_factory, "/hetero/info", 180, extra_env=env) as srv:
        yield srv, marker


def test_a_dead_generation_thread_is_reported_not_waited_on(killable):
    server, marker = killable
    assert ok(server, "/v1/chat/completions", chat_body(server, "hi"))["usage"]["prompt_tokens"]
    marker.touch()
    deadline = time.monotonic() + 10
    while get(server, "/hetero/info").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    r = get(server, "/hetero/info")
    assert (r.status_code, r.json()["error"]["code"]) == (503, "generation_dead")
    start = time.monotonic()
    status, reply = post(server, "/v1/chat/completions", chat_body(server, "hi"))
    assert (status, reply["error"]["code"]) == (503, "generation_dead")
    assert time.monotonic() - start < 5


def test_clear_is_not_undone_by_a_late_checkpoint(server):
    # Regression (issue 50): a request in flight during /hetero/clear stored its checkpoints
    # afterwards. Now none is stored while a request admitted before the clear is in flight.
    import threading

    body = chat_body(server, SHORT * 10, max_tokens=2)
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    before = info(server)["partitions"]["dropped_inserts"]
    done = []
    thread = threading.Thread(target=lambda: done.append(
        ok(server, "/v1/chat/completions", body)))
    start = time.monotonic()
    thread.start()
    while info(server)["partitions"]["in_flight"] == 0 and time.monotonic() - start < 30:
        time.sleep(0.01)
    ok(server, "/hetero/clear")
    cleared_at = time.monotonic() - start
    thread.join(300)
    print(f"cleared {cleared_at:.2f} s into a {time.monotonic() - start:.2f} s request")
    assert done and done[0]["usage"]["prompt_tokens"] == len(ids)
    assert ok(server, "/hetero/cached_prefix", {"ids": ids})["cached_tokens"] == 0
    assert info(server)["prompt_cache"]["sequences"] == 0
    assert info(server)["partitions"]["dropped_inserts"] > before
