"""The stack's shared secret on real processes. `hetero up` (tiny model, free ports) makes one
secret and hands every process the file's path; the stack serves a bridged request (the front
door signs its calls to the seam and to the prefill host, whose frames carry tags keyed by the
secret, so a spoofed prefill host's stream is refused and mounts nothing); the decoder's port
and POST /v1/prefill refuse calls that are not signed (Hetero-HMAC-SHA256, docs/design/auth.md)
or are signed with a wrong key, and the refusals change nothing; `hetero front` and `hetero
doctor` authenticate with --secret-file. The seam's own access rules endpoint by
endpoint (secret, JSON bodies, CORS, dump directory, served model): test_seam.py and
test_vlm_seam.py.
"""

import http.server
import json
import os
import re
import signal
import stat
import struct
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import xxhash
from frontstack import (HETERO, PY, ROOT, TINY, Proc, chat, free_port, need, post_front, text,
                        verdict_of)

from hetero_mlx.access import signed_headers

requests = pytest.importorskip("requests")

UP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    """`hetero up` on the tiny model; yields its ports, work dir and secret file."""
    need(HETERO, "hetero binary")
    need(TINY / "config.json", "tiny model")
    work = tmp_path_factory.mktemp("up")
    ports = {"port": free_port(), "decoder-port": free_port(), "prefill-port": free_port()}
    argv = [str(HETERO), "up", "--model", str(TINY), "--python", PY, "--work-dir", str(work)]
    for flag, port in ports.items():
        argv += [f"--{flag}", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "HETERO_SECRET_FILE"}
    env["PYTHONPATH"] = str(ROOT / "python")
    log_path = work / "up.out"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while "hetero is up" not in log_path.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"hetero up did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield {"proc": proc, "work": work, "secret_file": work / "secret", **ports}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def url(port: int, path: str) -> str:
    return f"http://127.0.0.1:{port}{path}"


def secret_of(up) -> str:
    return up["secret_file"].read_text().strip()


def bearer(secret: str) -> dict:
    return {"Authorization": f"Bearer {secret}"}


def call(method: str, port: int, path: str, body=None, secret: str = "", headers=None,
         timeout: float = 30):
    """A request with a JSON body, signed with `secret` (unless headers are given instead)."""
    data = json.dumps(body).encode() if body is not None else b""
    sent = {"Content-Type": "application/json"}
    if headers is not None:
        sent.update(headers)
    elif secret:
        sent.update(signed_headers(secret, method, path, data))
    return requests.request(method, url(port, path), data=data, headers=sent, timeout=timeout)


def bad_headers(secret: str, method: str, path: str, body) -> list:
    """(headers, the 401 code they get) for a request to `path` that must be refused."""
    data = json.dumps(body).encode() if body is not None else b""
    return [({}, "unauthorized"), (bearer(secret), "unauthorized"), ({"Authorization": "x"},
                                                                    "unauthorized"),
            (signed_headers("0" * 64, method, path, data), "bad_signature"),
            (signed_headers(secret[:-1], method, path, data), "bad_signature")]


def cmdlines():
    """Every readable process command line on this machine, as argv lists."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            out.append([a.decode(errors="replace") for a in raw.split(b"\0") if a])
    return out


def test_up_makes_one_secret_and_hands_out_its_path_only(up):
    path = up["secret_file"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = secret_of(up)
    assert re.fullmatch(r"[0-9a-f]{64}", secret), secret
    argvs = cmdlines()
    assert not [a for a in argvs if any(secret in arg for arg in a)]
    given = [a for a in argvs if "--secret-file" in a
             and a[a.index("--secret-file") + 1] == str(path)]
    assert any("hetero_mlx" in a and "serve" in a for a in given), given
    assert any(Path(a[0]).name == "hetero" and "prefill" in a for a in given), given


def test_up_serves_a_bridged_request(up):
    front = SimpleNamespace(port=up["port"])
    r = post_front(front, chat(text("auth-up", 120), 8), mode="bridge", secret=secret_of(up))
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    assert v["verdict"] == "complete" and v["confirmed"] is True, v
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == v["B"]


def test_seam_refuses_unsigned_calls_and_changes_nothing(up):
    port, secret = up["decoder-port"], secret_of(up)
    body = chat(text("auth-seam", 60), 2)
    ids = call("POST", port, "/hetero/tokenize", body, secret, timeout=60).json()["ids"]
    assert call("POST", port, "/v1/chat/completions", body, secret, timeout=120).ok
    cached = call("POST", port, "/hetero/cached_prefix", {"ids": ids}, secret).json()
    assert cached["cached_tokens"] > 0
    for method, path in (("GET", "/hetero/info"), ("POST", "/hetero/clear"),
                         ("POST", "/hetero/cached_prefix"), ("POST", "/hetero/tokenize"),
                         ("POST", "/v1/chat/completions"), ("GET", "/health")):
        sent = body | {"ids": ids} if method == "POST" else None
        for headers, code in bad_headers(secret, method, path, sent):
            r = call(method, port, path, sent, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == code, (path, headers)
    after = call("POST", port, "/hetero/cached_prefix", {"ids": ids}, secret).json()
    assert after == cached  # the refused clear cleared nothing


def test_prefill_host_refuses_calls_without_the_secret(up):
    port, secret = up["prefill-port"], secret_of(up)
    health = requests.get(url(port, "/health"), timeout=10)
    assert health.status_code == 200  # open: the front's pairing check and doctor read it
    body = {"ids": list(range(1, 40)), "fingerprint": health.json()["fingerprint"],
            "stream_nonce": "0123456789abcdef" * 2}
    for headers, code in bad_headers(secret, "POST", "/v1/prefill", body):
        r = call("POST", port, "/v1/prefill", body, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == code
        assert r.headers["WWW-Authenticate"] == "Hetero-HMAC-SHA256"
    r = call("POST", port, "/v1/prefill", body, secret, timeout=120)
    assert r.status_code == 200 and len(r.content) > 0
    assert r.headers["Content-Type"] == "application/x-hetero-segments"
    assert r.headers["X-Hetero-Frame-Tags"] == "poly1305-pieces-v3"
    # With the secret, frames are tagged: a request without a nonce to key them is refused.
    del body["stream_nonce"]
    r = call("POST", port, "/v1/prefill", body, secret, timeout=120)
    assert r.status_code == 400 and "stream_nonce" in r.json()["error"]["message"], r.text


def wire_checksum(body: bytes) -> int:
    """A frame's checksum (docs/design/wire.md): XXH3-64 of its 1 MiB pieces' XXH3-64s."""
    piece = 1 << 20
    sums = [xxhash.xxh3_64(body[at:at + piece]).intdigest() for at in range(0, len(body), piece)]
    return xxhash.xxh3_64(struct.pack(f"<{len(sums)}Q", *sums)).intdigest()


class SpoofedPrefillHost:
    """A prefill host that does not hold the stack's secret: it answers every request with
    rows of garbage in well-formed frames whose checksums are right (anyone can compute those).
    forge_tags: it also claims tagged frames and appends 32 random bytes (salt, tag) to each;
    scheme: the tag scheme it claims (another one is what an older release's host sends).
    It keeps every request's headers and body (seen_headers, seen_bodies): what a fake host
    learns."""

    def __init__(self, info: dict, forge_tags: bool, scheme: str = "poly1305-pieces-v3"):
        host = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                host.reply(self, 200, json.dumps({"status": "ok", **host.health}).encode())

            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                host.seen_headers.append(dict(self.headers.items()))
                host.seen_bodies.append(raw.decode(errors="replace"))
                req = json.loads(raw)
                host.requests += 1
                host.reply(self, 200, host.stream(req), scheme=host.scheme if forge_tags else "")

            def log_message(self, *args):
                pass

        self.info, self.requests = info, 0
        self.seen_headers, self.seen_bodies = [], []
        self.health = {k: info[k] for k in ("family", "fingerprint", "layers")}
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.forge_tags, self.scheme = forge_tags, scheme
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @staticmethod
    def reply(handler, status: int, data: bytes, scheme: str = "") -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/x-hetero-segments" if scheme or status
                            == 200 and data[:4] == b"HSG2" else "application/json")
        if scheme:
            handler.send_header("X-Hetero-Frame-Tags", scheme)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def frame(self, header: dict, payload: bytes = b"") -> bytes:
        h = json.dumps(header).encode()
        out = b"HSG2" + struct.pack("<IQ", len(h), len(payload)) + h + payload
        out += struct.pack("<Q", wire_checksum(h + payload))
        return out + (os.urandom(32) if self.forge_tags else b"")

    def stream(self, req: dict) -> bytes:
        n, info = len(req["ids"]), self.info
        shape = [info["kv_heads"], n, info["head_dim"]]
        size = 2 * info["kv_heads"] * n * info["head_dim"]
        arrays, payload = [], b""
        for layer in range(info["layers"]):
            for which in ("keys", "values"):
                arrays.append({"name": f"layers.{layer}.{which}", "dtype": "BF16", "shape": shape,
                               "offset": len(payload), "bytes": size})
                payload += os.urandom(size)
        segment = {"v": 2, "kind": "segment", "seq": 0, "family": info["family"],
                   "fingerprint": req["fingerprint"], "pos0": 0, "n_tokens": n, "arrays": arrays}
        manifest = {"v": 2, "kind": "manifest", "fingerprint": req["fingerprint"],
                    "requested_tokens": n, "covered_tokens": n, "segments": 1, "complete": True,
                    "reason": "", "arith": "exact"}
        return self.frame(segment, payload) + self.frame(manifest)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("kind", ["untagged", "forged-tags", "older-wire"])
def test_a_spoofed_prefill_host_is_refused_and_poisons_nothing(up, tmp_path, kind):
    # Regression (hardening issue): a fake prefill host's garbage, framed with correct
    # checksums, was answered as "complete, exact" and stayed in the decoder's prompt cache.
    # "older-wire": a host claiming the first wire's tag scheme is named as another release.
    dport, secret = up["decoder-port"], secret_of(up)
    info = call("GET", dport, "/hetero/info", secret=secret, timeout=10).json()
    forge_tags = kind != "untagged"
    spoof = SpoofedPrefillHost(info, forge_tags,
                               "poly1305-v1" if kind == "older-wire" else "poly1305-pieces-v3")
    port = free_port()
    front = Proc("front", [HETERO, "front", "--decoder-port", dport, "--prefill-port", spoof.port,
                           "--store", up["work"] / "store", "--secret-file", up["secret_file"],
                           "--port", port], tmp_path, port, "/health")
    try:
        front.wait_ready(60)
        body = chat(text(f"spoof-{kind}", 120), 8)
        call("POST", dport, "/hetero/clear", {}, secret)
        cold = call("POST", dport, "/v1/chat/completions", body, secret, timeout=300).json()
        call("POST", dport, "/hetero/clear", {}, secret)

        r = post_front(front, body, mode="bridge", secret=secret_of(up))
        assert r.status_code == 200, r.text
        v = verdict_of(r.headers)
        assert spoof.requests == 1
        assert v["verdict"].startswith("declined") and v["B"] == 0, v
        assert {"untagged": "does not tag its frames", "forged-tags": "no valid tag",
                "older-wire": "different wire versions"}[kind] in v["verdict"], v
        assert r.json()["choices"][0]["message"] == cold["choices"][0]["message"]
        # Nothing of the garbage was mounted: the decoder, asked again, still answers as cold.
        again = call("POST", dport, "/v1/chat/completions", body, secret, timeout=300).json()
        assert again["choices"][0]["message"] == cold["choices"][0]["message"]
    finally:
        front.stop()
        spoof.stop()


def test_front_and_doctor_authenticate_with_the_secret_file(up, tmp_path):
    ports = ["--decoder-port", str(up["decoder-port"]), "--prefill-port", str(up["prefill-port"])]
    store = ["--store", str(up["work"] / "store")]
    port = free_port()
    front = Proc("front", [HETERO, "front", *ports, *store, "--secret-file", up["secret_file"],
                           "--port", port], tmp_path, port, "/health")
    try:
        front.wait_ready(60)
        r = post_front(front, chat(text("auth-front", 120), 4), mode="bridge",
                       secret=secret_of(up))
        assert r.status_code == 200, r.text
        assert verdict_of(r.headers)["verdict"] == "complete"
    finally:
        front.stop()
    # Without the secret the front door cannot reach the seam: its health says so.
    port = free_port()
    open_front = Proc("front", [HETERO, "front", *ports, *store, "--port", port], tmp_path, port,
                      "/health")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                r = requests.get(url(open_front.port, "/health"), timeout=5)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, open_front.log()
                time.sleep(0.1)
        assert r.status_code == 503 and r.json()["decoder"] == "unauthorized", r.text
    finally:
        open_front.stop()

    doctor = [str(HETERO), "doctor", "--port", str(up["port"]), *ports, "--bridge-words", "150"]
    ok = subprocess.run(doctor + ["--secret-file", str(up["secret_file"])], capture_output=True,
                        text=True, timeout=300, cwd=ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = subprocess.run(doctor, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert refused.returncode != 0
    assert re.search(r"\[FAIL\] decoder seam .*HTTP 401", refused.stdout), refused.stdout
