"""The DeepSeek-V4 decoder seam's hardening (issue 50) on mlx-vlm's own server with the tiny
checkpoint: every request on the port signed (mlx-vlm's own paths included), the body that
crashed mlx-vlm refused, bodies bounded and never chunked, tenants' salts as mlx-vlm's own APC
tenants, and a dead generation thread reported instead of waited on. The mlx-lm seam's
counterpart: test_seam_hardening.py.
"""

import json
import os
import socket
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


def test_bodies_are_bounded_and_never_chunked(server):
    port = int(server["url"].rsplit(":", 1)[1])
    for path in ("/v1/chat/completions", "/hetero/tokenize"):
        auth = signed(server, "POST", path)["Authorization"]
        for framing, code in ((b"Content-Length: 2000000", 413),
                              (b"Transfer-Encoding: chunked", 411)):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + framing +
                          b"\r\nAuthorization: " + auth.encode() + b"\r\n\r\n")
                reply = s.recv(65536)
            assert int(reply.split(b" ", 2)[1]) == code, (path, reply[:200])


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
