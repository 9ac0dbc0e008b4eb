"""The stack's shared secret on real processes. `hetero up` (tiny model, free ports) makes one
secret and hands every process the file's path; the stack serves a bridged request (the front
door authenticates to the seam and to the prefill host); the seam and POST /v1/prefill refuse
calls without the secret, or with a wrong one, and the refusals change nothing; `hetero front`
and `hetero doctor` authenticate with --secret-file. The seam's own access rules endpoint by
endpoint (secret, JSON bodies, CORS, dump directory, served model): test_seam.py and
test_vlm_seam.py.
"""

import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from frontstack import (HETERO, PY, ROOT, TINY, Proc, chat, free_port, need, post_front, text,
                        verdict_of)

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
    r = post_front(front, chat(text("auth-up", 120), 8), mode="bridge")
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    assert v["verdict"] == "complete" and v["confirmed"] is True, v
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == v["B"]


def test_seam_refuses_calls_without_the_secret_and_changes_nothing(up):
    port, good = up["decoder-port"], bearer(secret_of(up))
    body = chat(text("auth-seam", 60), 2)
    ids = requests.post(url(port, "/hetero/tokenize"), json=body, headers=good,
                        timeout=60).json()["ids"]
    assert requests.post(url(port, "/v1/chat/completions"), json=body, timeout=120).ok
    cached = requests.post(url(port, "/hetero/cached_prefix"), json={"ids": ids}, headers=good,
                           timeout=30).json()
    assert cached["cached_tokens"] > 0
    for headers in ({}, bearer("0" * 64), bearer(secret_of(up)[:-1]), {"Authorization": "x"}):
        for method, path in (("GET", "/hetero/info"), ("POST", "/hetero/clear"),
                             ("POST", "/hetero/cached_prefix"), ("POST", "/hetero/tokenize")):
            r = requests.request(method, url(port, path), json=body | {"ids": ids},
                                 headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "unauthorized"
    after = requests.post(url(port, "/hetero/cached_prefix"), json={"ids": ids}, headers=good,
                          timeout=30).json()
    assert after == cached  # the refused clear cleared nothing


def test_prefill_host_refuses_calls_without_the_secret(up):
    port, secret = up["prefill-port"], secret_of(up)
    health = requests.get(url(port, "/health"), timeout=10)
    assert health.status_code == 200  # open: the front's pairing check and doctor read it
    body = {"ids": list(range(1, 40)), "fingerprint": health.json()["fingerprint"]}
    for headers in ({}, bearer("0" * 64), bearer(secret + "0"), {"Authorization": secret}):
        r = requests.post(url(port, "/v1/prefill"), json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "unauthorized"
        assert r.headers["WWW-Authenticate"] == "Bearer"
    r = requests.post(url(port, "/v1/prefill"), json=body, headers=bearer(secret), timeout=120)
    assert r.status_code == 200 and len(r.content) > 0
    assert r.headers["Content-Type"] == "application/x-hetero-segments"


def test_front_and_doctor_authenticate_with_the_secret_file(up, tmp_path):
    ports = ["--decoder-port", str(up["decoder-port"]), "--prefill-port", str(up["prefill-port"])]
    store = ["--store", str(up["work"] / "store")]
    port = free_port()
    front = Proc("front", [HETERO, "front", *ports, *store, "--secret-file", up["secret_file"],
                           "--port", port], tmp_path, port, "/health")
    try:
        front.wait_ready(60)
        r = post_front(front, chat(text("auth-front", 120), 4), mode="bridge")
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
        assert r.status_code == 503 and r.json()["decoder"] == "error", r.text
    finally:
        open_front.stop()

    doctor = [str(HETERO), "doctor", "--port", str(up["port"]), *ports, "--bridge-words", "150"]
    ok = subprocess.run(doctor + ["--secret-file", str(up["secret_file"])], capture_output=True,
                        text=True, timeout=300, cwd=ROOT)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = subprocess.run(doctor, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert refused.returncode != 0
    assert re.search(r"\[FAIL\] decoder seam .*HTTP 401", refused.stdout), refused.stdout
