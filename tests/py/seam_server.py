"""One seam-wrapped decoder server for a test module: started on a free port, waited for, and
stopped by its pid. Shared by the seam tests of both decoders (mlx-lm and mlx-vlm). The server
requires a shared secret (serve --secret-file): every request on its port is signed
(Hetero-HMAC-SHA256, docs/design/auth.md) by the request helpers below."""

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python"))

from hetero_mlx.access import signed_headers  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float,
                  headers: Callable[[], Dict[str, str]]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(url, headers=headers(), timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"server not healthy after {timeout_s}s:\n{log.read_text()[-3000:]}")


@contextmanager
def seam_server(model_dir: str, tmp_path_factory, health: str, timeout_s: float,
                extra_env: Optional[Dict[str, str]] = None,
                extra_args: Sequence[str] = ()) -> Iterator[dict]:
    """`python -m hetero_mlx serve` on model_dir with a fresh secret (and extra_args); yields
    {"url", "store", "log", "model", "secret", "proc"}."""
    store = tmp_path_factory.mktemp("store")
    log = tmp_path_factory.mktemp("log") / "server.log"
    secret_file = tmp_path_factory.mktemp("secret") / "secret"
    secret = secrets.token_hex(32)
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "hetero_mlx", "serve", "--model", model_dir]
    cmd += ["--port", str(port), "--store", str(store), "--secret-file", str(secret_file)]
    cmd += list(extra_args)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    server = {"url": url, "store": store, "log": log, "model": model_dir, "secret": secret,
              "proc": proc}
    try:
        _wait_healthy(url + health, proc, log, timeout_s, lambda: signed(server, "GET", health))
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- requests to a seam server (the dict seam_server yields) ---------------------------------


def signed(server, method: str, target: str, body: bytes = b"") -> Dict[str, str]:
    """The Authorization header of one request to this server (a fresh nonce each time)."""
    return signed_headers(server["secret"], method, target, body)


def get(server, path, timeout=10, **kwargs):
    """A signed GET."""
    return requests.get(server["url"] + path, headers=signed(server, "GET", path),
                        timeout=timeout, **kwargs)


def request(server, method, path, body=None, headers=None, timeout=30, **kwargs):
    """A signed request with a JSON body (None: no body); headers are added to the signature."""
    data = json.dumps(body).encode() if body is not None else b""
    extra = {"Content-Type": "application/json"} if body is not None else {}
    extra.update(headers or {})
    return requests.request(method, server["url"] + path, data=data, timeout=timeout,
                            headers={**extra, **signed(server, method, path, data)}, **kwargs)


def post(server, path, body=None, raw=None, headers=None):
    """(status, JSON reply) of a signed JSON POST; raw sends bytes as they are (for malformed
    bodies); headers replace the default ones (JSON type, the signature)."""
    data = raw if raw is not None else json.dumps(body if body is not None else {})
    data = data.encode() if isinstance(data, str) else data
    if headers is None:
        headers = {"Content-Type": "application/json", **signed(server, "POST", path, data)}
    r = requests.post(server["url"] + path, data=data, headers=headers, timeout=120)
    return r.status_code, r.json()


class SignedAuth(requests.auth.AuthBase):
    """requests' auth hook: signs each request as sent (for sessions and streams)."""

    def __init__(self, secret: str):
        self.secret = secret

    def __call__(self, r):
        body = r.body or b""
        body = body.encode() if isinstance(body, str) else body
        r.headers.update(signed_headers(self.secret, r.method, r.path_url, body))
        return r


def openai_http_client(secret: str):
    """An HTTP client for the openai package (httpx2 in openai 3, httpx before) that signs each
    request as sent."""
    try:
        import httpx2 as httpx
    except ImportError:
        import httpx

    class HeteroAuth(httpx.Auth):
        requires_request_body = True

        def auth_flow(self, r):
            target = r.url.raw_path.decode("latin-1")
            r.headers.update(signed_headers(secret, r.method, target, r.content))
            yield r

    return httpx.Client(auth=HeteroAuth())


def ok(server, path, body=None):
    status, reply = post(server, path, body)
    assert status == 200, (path, reply)
    return reply


def info(server):
    r = get(server, "/hetero/info")
    assert r.status_code == 200, r.text
    return r.json()


def wait_cached(cached: Callable[[List[int]], int], ids: List[int]) -> None:
    """Waits for the decoder's last prompt-cache insert of a request whose prompt was ids;
    cached: the decoder's count of cached tokens for some ids (Stack.cached, Decoder.cached)."""
    # mlx-lm stores prompt + completion in its prompt cache after the reply has gone out (and
    # the prompt's segments before it). An entry at least as long as the prompt is the last one:
    # ids plus one probe token then reuse all of ids (two probes, in case one is the first
    # generated token).
    deadline = time.monotonic() + 60
    while max(cached(ids + [0]), cached(ids + [1])) < len(ids):
        assert time.monotonic() < deadline, "the decoder never cached the request"
        time.sleep(0.02)
