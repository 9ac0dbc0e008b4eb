"""End to end on real processes: `hetero verify` bridges real chat prompts into the pinned
MLX decoder and compares against its native run (every cache array, the greedy continuation,
the decoder's own prompt-token accounting); the prefill host's HTTP interface refuses bad
input with a JSON 4xx and keeps serving.

Needs the default model (HETERO_MODEL, made by `make model`) and the tiny test model
(HETERO_TEST_MODEL, made by `make tiny`); skips with a reason when they are missing.
"""

import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import xxhash

ROOT = Path(__file__).resolve().parents[2]
HETERO = Path(os.environ.get("HETERO_BIN", ROOT / "build" / "hetero"))
MODEL = Path(os.environ.get("HETERO_MODEL", ROOT / "models" / "smollm2-135m-instruct"))
TINY = Path(os.environ.get("HETERO_TEST_MODEL", ROOT / "models" / "tiny-llama"))
PROMPTS = ROOT / "prompts" / "chat"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"))


def need(path: Path, what: str) -> None:
    if not path.exists():
        pytest.skip(f"{what} missing at {path} (run: make model tiny build)")


def verify(prompt: Path, chunk: int, tmp_path: Path, max_tokens: int = 64,
           secret: bool = False) -> dict:
    """hetero verify's report; with secret, the decoder and the prefill host it starts require
    a fresh shared secret (--secret-file), which verify's own calls carry."""
    need(HETERO, "hetero binary")
    need(MODEL / "config.json", "default model")
    cmd = [str(HETERO), "verify", "--model", str(MODEL), "--prompt-file", str(prompt),
           "--chunk", str(chunk), "--max-tokens", str(max_tokens), "--python", sys.executable,
           "--work-dir", str(tmp_path)]
    if secret:
        path = tmp_path / "secret"
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
        cmd += ["--secret-file", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=3000)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"verify printed no JSON (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    report["rc"] = proc.returncode
    return report


# Five real chat prompts; chunk sizes cut the prompts unevenly. The first runs the processes
# with a shared secret (as hetero up does), the others open.
CASES = [
    ("01-capital.json", 7, True),
    ("02-code.json", 512, False),
    ("03-system-multiturn.json", 13, False),
    ("04-notes.json", 100, False),
    pytest.param("05-long-license.json", 1000, False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,chunk,secret", CASES)
def test_bridge_matches_native(name: str, chunk: int, secret: bool, tmp_path: Path) -> None:
    prompt = PROMPTS / name
    need(prompt, "prompt (05 is made by scripts/make_long_prompt.py)")
    r = verify(prompt, chunk, tmp_path, secret=secret)
    summary = {k: r.get(k) for k in ("T", "B", "arrays", "continuation", "decoder_accounting",
                                      "failures")}
    summary.get("arrays", {}).pop("per_layer", None)
    print(json.dumps(summary))
    assert r["rc"] == 0 and r["pass"], r.get("failures") or r.get("error")
    # Every mounted array is bit-identical to the decoder's own native array.
    assert r["arrays"]["bit_exact"] == r["arrays"]["count"] == 60
    assert r["arrays"]["max_ulp"] == 0
    # The decoder continued identically and processed only the tail.
    assert r["continuation"]["identical"] and r["continuation"]["native"]
    acc = r["decoder_accounting"]
    assert acc["native"]["cached_tokens"] == 0
    assert acc["bridged"]["cached_tokens"] == r["B"] == r["T"] - 1
    assert acc["bridged"]["processed"] == 1
    if name.startswith("05"):
        assert r["T"] >= 4000
    # The seam wrote both dumps in its own dump directory, where verify read them.
    dumps = (tmp_path / "store" / "dumps").resolve()
    assert {Path(p).parent for p in r["dumps"].values()} == {dumps}


def test_verify_refuses_an_empty_prompt(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    r = verify(empty, 64, tmp_path / "w")
    assert r["rc"] == 2 and not r["pass"]
    assert "empty" in r["error"]["message"]


def test_verify_refuses_a_json_prompt_without_messages(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"mesages": []}))
    r = verify(bad, 64, tmp_path / "w")
    assert r["rc"] == 2 and "messages" in r["error"]["message"]


# ---------------------------------------------------------------- prefill host interface

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: bytes):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def prefill_host(tmp_path_factory):
    need(HETERO, "hetero binary")
    need(TINY / "config.json", "tiny test model")
    export = tmp_path_factory.mktemp("export")
    subprocess.run([sys.executable, "-m", "hetero_mlx", "export", "--model", str(TINY), "--out",
                    str(export)], check=True, env=ENV, capture_output=True)
    fingerprint = json.loads((export / "decoder.json").read_text())["fingerprint"]
    port = free_port()
    proc = subprocess.Popen([str(HETERO), "prefill", "--model", str(TINY), "--weights",
                             str(export), "--port", str(port), "--chunk", "5"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("prefill host did not start: " + proc.stderr.read().decode())
    yield port, fingerprint
    proc.terminate()
    proc.wait(timeout=20)


@pytest.mark.parametrize("body,code,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1,2,3]", 400, "JSON object"),
    (json.dumps({"ids": [], "fingerprint": "x"}).encode(), 400, "empty"),
    (json.dumps({"ids": [1, 2, 10**9], "fingerprint": "x"}).encode(), 400, "outside the vocabulary"),
    (json.dumps({"ids": [1, -1], "fingerprint": "x"}).encode(), 400, "outside the vocabulary"),
    (json.dumps({"ids": ["a"], "fingerprint": "x"}).encode(), 400, "not an integer"),
    (json.dumps({"ids": [1, 2]}).encode(), 400, "fingerprint"),
    (json.dumps({"ids": [1, 2], "fingerprint": "FP", "chunk": 0}).encode(), 400, "chunk"),
])
def test_prefill_host_refuses_bad_input(prefill_host, body, code, needle) -> None:
    port, fingerprint = prefill_host
    body = body.replace(b'"FP"', json.dumps(fingerprint).encode())
    status, reply = post(port, "/v1/prefill", body)
    assert status == code, reply
    err = json.loads(reply)["error"]
    assert needle in err["message"] and err["code"]
    # ...and it keeps serving.
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        assert json.loads(r.read())["fingerprint"] == fingerprint


def test_prefill_host_refuses_a_fingerprint_mismatch_naming_both(prefill_host) -> None:
    port, fingerprint = prefill_host
    status, reply = post(port, "/v1/prefill", json.dumps({"ids": [1, 2, 3],
                                                          "fingerprint": "deadbeef"}).encode())
    assert status == 409
    msg = json.loads(reply)["error"]["message"]
    assert "deadbeef" in msg and fingerprint in msg


def test_prefill_host_streams_segments_then_a_manifest(prefill_host) -> None:
    port, fingerprint = prefill_host
    status, reply = post(port, "/v1/prefill", json.dumps({"ids": list(range(1, 13)),
                                                          "fingerprint": fingerprint}).encode())
    assert status == 200
    # Frames: "HSG2" | u32 header | u64 payload | header | payload | u64 checksum, the checksum
    # XXH3-64 of the 1 MiB pieces' XXH3-64s (docs/design/wire.md), checked here independently.
    kinds, pos = [], 0
    while pos < len(reply):
        assert reply[pos:pos + 4] == b"HSG2"
        hb = int.from_bytes(reply[pos + 4:pos + 8], "little")
        pb = int.from_bytes(reply[pos + 8:pos + 16], "little")
        body = reply[pos + 16:pos + 16 + hb + pb]
        sums = [xxhash.xxh3_64(body[at:at + (1 << 20)]).intdigest()
                for at in range(0, len(body), 1 << 20)]
        want = xxhash.xxh3_64(struct.pack(f"<{len(sums)}Q", *sums)).intdigest()
        assert int.from_bytes(reply[pos + 16 + hb + pb:pos + 24 + hb + pb], "little") == want
        header = json.loads(reply[pos + 16:pos + 16 + hb])
        assert header["v"] == 2
        kinds.append((header["kind"], header.get("pos0"), header.get("n_tokens")))
        pos += 16 + hb + pb + 8
    # chunk 5 over 12 tokens: segments at 0, 5, 10, then the manifest.
    assert kinds == [("segment", 0, 5), ("segment", 5, 5), ("segment", 10, 2),
                     ("manifest", None, None)]
