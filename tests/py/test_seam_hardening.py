"""The decoder seam's hardening (issue 50) on a real mlx-lm server with the tiny model: signed
requests on every path of the decoder's port (auth.md), completion bodies that killed mlx-lm's
generation thread refused, a dead generation thread reported, a caller that hangs up stops its
generation, the port's bounds (deadline, per-client connections, body size, chunked, header
limits, deep JSON, loopback), tenants' partitions of the prompt cache, the clear epoch, and the
dump files' modes. Unit tests of the same mechanisms: test_access.py.
"""

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from seam_server import REPO, get, info, ok, post, request, seam_server, signed, wait_cached

from hetero_mlx.access import signed_headers

requests = pytest.importorskip("requests")

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


@pytest.fixture(scope="module")
def model_dir() -> str:
    path = os.environ.get("HETERO_TEST_MODEL")
    if not path or not (Path(path) / "config.json").exists():
        pytest.skip("HETERO_TEST_MODEL is not set to a model directory (e.g. tiny-llama)")
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # Short prefill steps: a long prompt is many model calls, so a hang-up lands mid-prefill.
    args = ("--test-faults", "--max-body-mb", "1", "--prefill-step-size", "64")
    with seam_server(model_dir, tmp_path_factory, "/health", 120, extra_args=args) as srv:
        yield srv


def port_of(server) -> int:
    return int(server["url"].rsplit(":", 1)[1])


def raw_request(server, head: bytes, body: bytes = b"", source: str = "127.0.0.1",
                timeout: float = 10) -> bytes:
    """Sends bytes as they are on a new connection; returns everything the server sends back
    until it closes or `timeout` passes."""
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=timeout,
                                  source_address=(source, 0)) as s:
        s.sendall(head + body)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and _complete(out):
                    break
        except socket.timeout:
            pass
        return out


def _complete(reply: bytes) -> bool:
    head, _, body = reply.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def json_of(reply: bytes) -> dict:
    return json.loads(reply.partition(b"\r\n\r\n")[2])


def head_of(server, method: str, path: str, body: bytes = b"", extra: str = "",
            sign: bool = True) -> bytes:
    auth = signed(server, method, path, body)["Authorization"] if sign else None
    lines = [f"{method} {path} HTTP/1.1", "Host: seam", "Content-Type: application/json",
             f"Content-Length: {len(body)}"]
    if auth:
        lines.append(f"Authorization: {auth}")
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


def alive(server) -> bool:
    return get(server, "/health").json() == {"status": "ok"}


# ---- every request on the decoder's port is signed ------------------------------------------


def test_every_path_needs_a_signature_mlx_lms_own_included(server):
    calls = [("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/hetero/info", None),
             ("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
             ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
             ("POST", "/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
             ("POST", "/hetero/clear", {}), ("OPTIONS", "/v1/chat/completions", None),
             ("POST", "/nowhere", {})]
    for method, path, body in calls:
        data = json.dumps(body).encode() if body is not None else b""
        r = requests.request(method, server["url"] + path, data=data, timeout=30,
                             headers={"Content-Type": "application/json"})
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "unauthorized", path
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], path
        r = request(server, method, path, body, timeout=60)
        assert r.status_code == (404 if path == "/nowhere" else 204 if method == "OPTIONS"
                                 else 200), (path, r.text)


def test_clock_skew_replay_and_signature_failures(server):
    body = json.dumps({"ids": [1, 2, 3]}).encode()
    path = "/hetero/cached_prefix"
    for skew in (-400, 400):
        headers = signed_headers(server["secret"], "POST", path, body, t=int(time.time()) + skew)
        r = requests.post(server["url"] + path, data=body, timeout=10,
                          headers={"Content-Type": "application/json", **headers})
        assert (r.status_code, r.json()["error"]["code"]) == (401, "clock_skew"), skew
        assert abs(int(r.headers["X-Hetero-Time"]) - time.time()) < 5
    headers = {"Content-Type": "application/json", **signed(server, "POST", path, body)}
    r = requests.post(server["url"] + path, data=body + b" ", headers=headers, timeout=10)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "bad_signature")
    # The failed try was not remembered: the same signature over the right body goes through,
    # once.
    assert requests.post(server["url"] + path, data=body, headers=headers, timeout=10).ok
    r = requests.post(server["url"] + path, data=body, headers=headers, timeout=10)
    assert (r.status_code, r.json()["error"]["code"]) == (401, "replayed")


def test_the_header_is_judged_before_the_body_is_read(server):
    # A refused header is answered at once: the seam never waits for (or reads) a body that an
    # unauthenticated caller announces.
    body = b"x" * 500_000
    for t in (None, int(time.time()) - 1000):
        head = head_of(server, "POST", "/v1/completions", body, sign=False)
        if t is not None:
            auth = signed_headers(server["secret"], "POST", "/v1/completions", body, t=t)
            head = head.replace(b"\r\n\r\n", f"\r\nAuthorization: {auth['Authorization']}"
                                             "\r\n\r\n".encode())
        start = time.monotonic()
        reply = raw_request(server, head, timeout=5)
        assert status_of(reply) == 401, reply[:200]
        assert time.monotonic() - start < 2


# ---- bodies that killed the generation thread ------------------------------------------------

KILLERS = [
    # scripts/explore_decoder_killers.py on mlx-lm 0.32.2 (issue 50): each of these ended the
    # generation thread (or, for logit_bias 2**40, the process) when it reached mlx-lm.
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": 5}, "bad_stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop": [1]}, "bad_stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": [["x"]]}, "bad_stop"),
    ("/chat/completions", {"messages": MESSAGES, "stop": [{}]}, "bad_stop"),
    ("/v1/completions", {"prompt": PROMPT, "stop": True}, "bad_stop"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {str(2**70): 1}},
     "bad_logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {str(2**40): 1}},
     "bad_logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "min_p": float("nan"), "temperature": 1},
     "bad_number"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs":
                              {"return_tensors": "np"}}, "bad_chat_template_kwargs"),
    ("/v1/completions", {"prompt": ""}, "bad_prompt"),
    ("/hetero/tokenize", {"messages": MESSAGES, "stop": 5}, "bad_stop"),
    ("/hetero/tokenize", {"prompt": PROMPT, "logit_bias": {"99999999": 1}}, "bad_logit_bias"),
]


def test_bodies_that_killed_the_generation_thread_are_refused(server):
    for path, body, code in KILLERS:
        status, reply = post(server, path, dict(body, max_tokens=2))
        assert (status, reply["error"]["code"]) == (400, code), (path, body, reply)
        assert alive(server), (path, body)
    reply = ok(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert reply["usage"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def unguarded(model_dir, tmp_path_factory):
    """A seam whose body checks are switched off (sitecustomize), to reproduce the killers."""
    hook = tmp_path_factory.mktemp("unguarded")
    (hook / "sitecustomize.py").write_text(
        "import hetero_mlx.seam as seam\nseam.check_completion_body = lambda body, vocab: None\n")
    env = {"PYTHONPATH": f"{hook}{os.pathsep}{REPO / 'python'}"}
    with seam_server(model_dir, tmp_path_factory, "/health", 120, extra_env=env) as srv:
        yield srv


def test_a_dead_generation_thread_is_a_dead_decoder(unguarded):
    # Reproduces the finding on the seam without its checks: "stop": 5 makes _make_state_machine
    # raise TypeError on the generation thread, which dies for good.
    status, reply = post(unguarded, "/v1/completions", {"prompt": PROMPT, "stop": 5})
    assert status != 200, reply
    deadline = time.monotonic() + 10
    while alive(unguarded) and time.monotonic() < deadline:
        time.sleep(0.1)
    health = get(unguarded, "/health")
    assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
    r = get(unguarded, "/hetero/info")
    assert (r.status_code, r.json()["error"]["code"]) == (503, "generation_dead")
    # A completion is answered at once (an error), not left waiting.
    start = time.monotonic()
    status, _ = post(unguarded, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert status != 200 and time.monotonic() - start < 5


# ---- a caller that hangs up ------------------------------------------------------------------


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def goes_idle(server, within_s: float = 3.0) -> bool:
    """Whether the model stops being called (serve --test-faults records its calls) within
    `within_s`: a stopped request leaves mlx-lm's batch at the end of its current time budget
    (0.5 s of steps), not at once."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        ok(server, "/hetero/calls")
        time.sleep(0.5)
        if not ok(server, "/hetero/calls")["calls"]:
            return True
    return False


def open_completion(server, body: dict, path: str = "/v1/completions") -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port_of(server)), timeout=30)
    s.sendall(head_of(server, "POST", path, data) + data)
    return s


def test_callers_that_hang_up_stop_their_generations(server):
    # Regression (issue 50): a non-streaming completion ran on to max_tokens after its caller
    # closed the connection, and the decoder served nobody else meanwhile.
    before = info(server)["requests"]
    socks = [open_completion(server, {"prompt": f"{i} {PROMPT}", "max_tokens": 4000})
             for i in range(20)]
    time.sleep(1.0)
    assert info(server)["requests"]["in_flight"] == 20
    for s in socks:
        s.close()
    start = time.monotonic()
    reply = ok(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert reply["usage"]["completion_tokens"] == 4
    assert time.monotonic() - start < 3, "the decoder was still busy"
    # Each handler looks at its caller's socket every 0.1 s.
    assert wait_until(lambda: info(server)["requests"]["in_flight"] == 0, 2)
    after = info(server)["requests"]
    assert after["stopped_on_hang_up"] - before["stopped_on_hang_up"] == 20
    assert goes_idle(server)  # the model is no longer called for anybody
    assert server["log"].read_text().count("the caller hung up") >= 20


def test_a_streaming_caller_that_hangs_up_stops_its_generation(server):
    body = {"messages": MESSAGES, "max_tokens": 4000, "stream": True}
    s = open_completion(server, body, "/v1/chat/completions")
    got = b""
    while got.count(b"data:") < 3:
        got += s.recv(65536)
    s.close()
    assert wait_until(lambda: info(server)["requests"]["in_flight"] == 0, 2)
    assert goes_idle(server)


@pytest.mark.parametrize("stream", [True, False])
def test_a_caller_that_hangs_up_during_prompt_processing_stops_it(server, stream):
    # mlx-lm alone: a streaming handler notices at its second failed keepalive write (one per
    # prefill step); a non-streaming one never does. The seam notices within 0.1 s either way.
    words = " ".join(f"w{i}" for i in range(12000))
    body = {"messages": [{"role": "user", "content": words}], "max_tokens": 8, "stream": stream}
    ok(server, "/hetero/calls")
    s = open_completion(server, body, "/v1/chat/completions")
    deadline = time.monotonic() + 30
    seen = []
    while len(seen) < 3 and time.monotonic() < deadline:  # prefill under way
        seen += ok(server, "/hetero/calls")["calls"]
        time.sleep(0.05)
    s.close()
    assert len(seen) >= 3 and all(n == 64 for n in seen), seen
    assert goes_idle(server)
    prefilled = len(seen) + len(ok(server, "/hetero/calls")["calls"])
    assert prefilled < 12000 // 64 / 2, prefilled  # stopped well before the prompt's end
    assert wait_until(lambda: info(server)["requests"]["in_flight"] == 0, 2)


# ---- bounds on the port ----------------------------------------------------------------------


def test_bodies_are_bounded_and_framed(server):
    for path in ("/v1/completions", "/v1/chat/completions", "/hetero/tokenize", "/hetero/mount"):
        # Larger than --max-body-mb 1: refused from the header, before any body byte is sent.
        head = head_of(server, "POST", path).replace(b"Content-Length: 0",
                                                     b"Content-Length: 2000000")
        reply = raw_request(server, head, timeout=5)
        assert status_of(reply) == 413 and json_of(reply)["error"]["code"] == "body_too_large"
        # Chunked bodies are refused on every path, mlx-lm's included.
        head = head_of(server, "POST", path).replace(b"Content-Length: 0",
                                                     b"Transfer-Encoding: chunked")
        reply = raw_request(server, head + b"2\r\n{}\r\n0\r\n\r\n", timeout=5)
        assert status_of(reply) == 411 and json_of(reply)["error"]["code"] == "length_required"
    assert alive(server)


def test_header_limits_stay_python_s(server):
    # BaseHTTPRequestHandler: at most 100 header lines of at most 65,536 bytes each.
    many = "".join(f"X-{i}: y\r\n" for i in range(101))
    assert status_of(raw_request(server, head_of(server, "GET", "/health", extra=many))) == 431
    long = f"X-Long: {'y' * 70000}\r\n"
    assert status_of(raw_request(server, head_of(server, "GET", "/health", extra=long))) == 431
    line = f"GET /{'y' * 70000} HTTP/1.1\r\n\r\n".encode()
    assert status_of(raw_request(server, line)) == 414


def test_deep_json_is_a_400_on_every_path(server):
    # Regression (issue 50): nested JSON made /hetero/mount answer 500 (RecursionError).
    deep = b"[" * 100_000 + b"]" * 100_000
    nested = json.dumps({"ids": [1, 2], "entry": "x", "x": json.loads("[" * 70 + "]" * 70)})
    paths = ("/hetero/mount", "/hetero/tokenize", "/hetero/cached_prefix", "/hetero/cache",
             "/hetero/unpin", "/hetero/clear", "/v1/completions", "/v1/chat/completions")
    for path in paths:
        for raw in (deep, nested.encode()):
            status, reply = post(server, path, raw=raw)
            assert (status, reply["error"]["code"]) == (400, "bad_json"), (path, reply)
    assert alive(server)


def test_one_client_holds_at_most_64_waiting_connections(server):
    # The 65th waiting connection from one address takes the place of its oldest: a client that
    # trickles loses its connections, one that sends its request at once (the front door, on
    # the same address) is always served.
    held = [socket.create_connection(("127.0.0.1", port_of(server)), timeout=5,
                                     source_address=("127.0.0.9", 0)) for _ in range(70)]
    try:
        time.sleep(0.5)
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
        assert info(server)["connections"]["evicted"] >= 6
        # The same address, a whole request at once, with 64 of its connections waiting: served.
        body = b'{"ids": [1, 2]}'
        reply = raw_request(server, head_of(server, "POST", "/hetero/cached_prefix", body), body,
                            source="127.0.0.9")
        assert status_of(reply) == 200, reply
    finally:
        for s in held:
            s.close()


def test_slowloris_connections_are_closed_by_the_deadline(server):
    # 300 connections, from five addresses (so that the per-client bound does not close them
    # first), each sending one header byte every 2 s: every one is closed by the 10 s deadline,
    # and a signed request is answered meanwhile.
    head = b"GET /health HTTP/1.1\r\nHost: seam\r\nX-Slow: " + b"y" * 64
    socks = [socket.create_connection(("127.0.0.1", port_of(server)), timeout=5,
                                      source_address=(f"127.0.0.{10 + i % 5}", 0))
             for i in range(300)]
    start, closed_at, stop = time.monotonic(), {}, threading.Event()

    def trickle():
        at = 0
        while not stop.is_set() and len(closed_at) < len(socks):
            for i, s in enumerate(socks):
                if i in closed_at:
                    continue
                try:
                    s.sendall(head[at % len(head):at % len(head) + 1])
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
        assert len(closed_at) == 300, f"{300 - len(closed_at)} still open"
        assert max(closed_at.values()) < 15 and min(closed_at.values()) >= 9
        assert info(server)["connections"]["closed_late"] >= 300
    finally:
        stop.set()
        thread.join()
        for s in socks:
            s.close()


def test_serve_refuses_a_non_loopback_host_and_a_weak_secret(model_dir, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    base = [sys.executable, "-m", "hetero_mlx", "serve", "--model", model_dir, "--port", "1"]
    r = subprocess.run(base + ["--host", "0.0.0.0"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "--allow-remote" in r.stderr, r.stderr[-2000:]
    secret = tmp_path / "secret"
    secret.write_text("0" * 64)
    secret.chmod(0o644)
    r = subprocess.run(base + ["--secret-file", str(secret)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "0644" in r.stderr and "chmod 600" in r.stderr
    secret.chmod(0o600)
    secret.write_text("0" * 16)
    r = subprocess.run(base + ["--secret-file", str(secret)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "at least 32" in r.stderr


# ---- tenants ---------------------------------------------------------------------------------


def cached_of(reply) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def cached_prefix(server, ids, salt=None) -> int:
    body = {"ids": ids} if salt is None else {"ids": ids, "hetero_cache_salt": salt}
    return ok(server, "/hetero/cached_prefix", body)["cached_tokens"]


def test_tenants_do_not_share_the_prompt_cache(server):
    body = {"prompt": PROMPT + "Tenants.", "max_tokens": 2, "temperature": 0}
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    a, b = dict(body, hetero_cache_salt="aa"), dict(body, hetero_cache_salt="0b")
    assert cached_of(ok(server, "/v1/completions", a)) == 0
    wait_cached(lambda i: cached_prefix(server, i, "aa"), ids)
    assert cached_prefix(server, ids, "aa") > 0
    # Tenant B, the same prompt: nothing of A's is reused or visible.
    assert cached_prefix(server, ids, "0b") == 0 and cached_prefix(server, ids) == 0
    assert ok(server, "/hetero/tokenize", b)["cached_tokens"] == 0
    assert cached_of(ok(server, "/v1/completions", b)) == 0
    wait_cached(lambda i: cached_prefix(server, i, "0b"), ids)
    # A again: its own hit; the tokenize dry run predicts it.
    predicted = ok(server, "/hetero/tokenize", a)["cached_tokens"]
    assert predicted > 0 and cached_of(ok(server, "/v1/completions", a)) == predicted
    # No salt: one partition of its own, as before salts.
    assert cached_of(ok(server, "/v1/completions", body)) == 0
    wait_cached(lambda i: cached_prefix(server, i), ids)
    assert cached_of(ok(server, "/v1/completions", body)) > 0


def test_a_chat_with_a_salt_keeps_its_segments_in_its_partition(server):
    body = {"messages": [{"role": "system", "content": "Be brief."}] + MESSAGES,
            "max_tokens": 2, "temperature": 0}
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    ok(server, "/v1/chat/completions", dict(body, hetero_cache_salt="c0"))
    wait_cached(lambda i: cached_prefix(server, i, "c0"), ids)
    assert cached_prefix(server, ids) == 0 and cached_prefix(server, ids, "c1") == 0
    assert info(server)["prompt_cache"]["sequences"] >= 1


def test_a_bad_salt_is_refused(server):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": MESSAGES}),
                       ("/hetero/tokenize", {"prompt": PROMPT}),
                       ("/hetero/cached_prefix", {"ids": [1, 2]})):
        for salt in ("", "AB", "g", "0" * 65, 7, None):
            status, reply = post(server, path, dict(body, hetero_cache_salt=salt))
            assert (status, reply["error"]["code"]) == (400, "bad_cache_salt"), (path, salt)


def test_a_mount_and_a_dump_stay_in_their_partition(server):
    body = {"prompt": PROMPT + "Mounted.", "max_tokens": 2, "temperature": 0}
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    ok(server, "/v1/completions", dict(body, hetero_cache_salt="d0"))
    wait_cached(lambda i: cached_prefix(server, i, "d0"), ids)
    n = len(ids) - 3
    dump = {"ids": ids, "B": n, "out": "tenant.safetensors"}
    status, reply = post(server, "/hetero/cache", dump)
    assert (status, reply["error"]["code"]) == (404, "not_cached")
    path = Path(ok(server, "/hetero/cache", dict(dump, hetero_cache_salt="d0"))["path"])
    # Dumps are the seam's own: 0600 files in a 0700 directory.
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    entry = server["store"] / "tenant-entry"
    entry.mkdir()
    meta = {"format": "hetero-store-v1", "family": "llama", "fingerprint":
            info(server)["fingerprint"], "B": n, "T": len(ids), "layers": info(server)["layers"],
            "ids": ids[:n]}
    (entry / "entry.json").write_text(json.dumps(meta))
    (entry / "cache.safetensors").write_bytes(path.read_bytes())
    ok(server, "/hetero/clear")
    mounted = ok(server, "/hetero/mount", {"entry": str(entry), "ids": ids,
                                          "hetero_cache_salt": "d1"})
    assert mounted["mounted"] == n
    assert cached_prefix(server, ids, "d1") == n
    assert cached_prefix(server, ids) == 0 and cached_prefix(server, ids, "d0") == 0
    assert cached_of(ok(server, "/v1/completions", dict(body, hetero_cache_salt="d1"))) == n


def test_clear_is_not_undone_by_a_late_insert(server):
    # Regression (issue 50): a generation in flight during /hetero/clear inserted its cache
    # afterwards, so the cache was not empty after clear had answered.
    body = {"prompt": PROMPT + "Late insert.", "max_tokens": 1500, "temperature": 0}
    ids = ok(server, "/hetero/tokenize", body)["ids"]
    ok(server, "/hetero/clear")
    dropped = info(server)["partitions"]["dropped_inserts"]
    done = []
    thread = threading.Thread(target=lambda: done.append(ok(server, "/v1/completions", body)))
    thread.start()
    deadline = time.monotonic() + 30
    while info(server)["requests"]["in_flight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    ok(server, "/hetero/clear")
    thread.join(120)
    assert done and done[0]["usage"]["completion_tokens"] > 0
    time.sleep(0.5)  # the final insert comes after the reply
    assert cached_prefix(server, ids + [0]) == 0 and cached_prefix(server, ids) == 0
    assert info(server)["prompt_cache"]["sequences"] == 0
    assert info(server)["partitions"]["dropped_inserts"] > dropped
