"""The prefill host alone, on real processes: memory admission on the CPU backend. With
--memory-floor refuse, a prompt the host cannot hold is refused before any byte streams (HTTP
507, JSON, the bytes asked and what is left), the host keeps serving, and the longest prompt it
takes follows from the machine's memory; with the floor (the default; test_memory_floor.py
seals through the whole stack) it takes prompts up to 2,097,152 tokens."""

import re
import subprocess
import time
from pathlib import Path

import pytest
from frontstack import ENV, HETERO, REAL, ROOT, export_weights, free_port, need, requests


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    need(HETERO, "hetero binary")
    need(REAL / "config.json", "SmolLM2-135M-Instruct")
    return export_weights(REAL, tmp_path_factory.mktemp("prefill-host") / "weights")


def start(weights: Path, tmp: Path, *extra: str):
    port = free_port()
    log = open(tmp / f"prefill-{port}.log", "w")
    proc = subprocess.Popen([str(HETERO), "prefill", "--model", str(REAL), "--weights",
                             str(weights), "--port", str(port), "--chunk", "256", *extra],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / f"prefill-{port}.log").read_text()
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                return proc, port, tmp / f"prefill-{port}.log"
        except requests.RequestException:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail("prefill host did not come up")


def prefill(port: int, n: int, fingerprint: str):
    return requests.post(f"http://127.0.0.1:{port}/v1/prefill",
                         json={"ids": [(i * 7919) % 40000 + 1 for i in range(n)],
                               "fingerprint": fingerprint}, timeout=600)


def test_a_prompt_the_host_cannot_hold_is_refused_and_the_host_serves_on(exported, tmp_path):
    # Regression (hardening issue): the default --max-tokens 2097152 needed 48 GB of cache for
    # this model on a 23 GB machine, and the engine aborted on std::bad_alloc.
    proc, port, log = start(exported, tmp_path, "--max-tokens", "2097152", "--memory-floor",
                            "refuse")
    try:
        fingerprint = requests.get(f"http://127.0.0.1:{port}/health", timeout=10).json()[
            "fingerprint"]
        r = prefill(port, 2_000_000, fingerprint)
        assert r.status_code == 507, r.text[:500]
        err = r.json()["error"]
        assert err["code"] == "resource_exhausted", err
        assert re.search(r"asked [0-9.]+ GiB for the cache of 2000000 tokens; .* available",
                         err["message"]), err
        ok = prefill(port, 300, fingerprint)
        assert ok.status_code == 200 and b'"kind":"manifest"' in ok.content
        assert b'"complete":true' in ok.content
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_longest_prompt_a_refusing_host_takes_follows_from_the_machine(exported, tmp_path):
    # With the memory floor (the default), a prompt past memory is sealed, not refused, so the
    # host takes prompts up to 2,097,152 tokens; a host that refuses instead knows its limit.
    proc, port, log = start(exported, tmp_path, "--memory-floor", "refuse")
    try:
        lines = [l for l in log.read_text().splitlines() if "longest prompt" in l]
        assert lines, log.read_text()
        longest = int(re.search(r"longest prompt: (\d+) tokens", lines[0]).group(1))
        per_token = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M: K and V, bf16
        meminfo = Path("/proc/meminfo").read_text()
        total = int(re.search(r"MemTotal:\s+(\d+)", meminfo).group(1)) * 1024
        assert 1 <= longest <= min(2_097_152, total // 2 // per_token), (longest, total)
        fingerprint = requests.get(f"http://127.0.0.1:{port}/health", timeout=10).json()[
            "fingerprint"]
        r = prefill(port, longest + 1, fingerprint)
        assert r.status_code == 400 and "more than the limit" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_sealing_host_takes_the_longest_context_this_project_serves(exported, tmp_path):
    proc, port, log = start(exported, tmp_path)
    try:
        assert "longest prompt: 2097152 tokens" in log.read_text(), log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_second_host_cannot_take_a_served_port(exported, tmp_path):
    # Regression (hardening issue): SO_REUSEPORT let two prefill hosts share one port.
    proc, port, _ = start(exported, tmp_path)
    try:
        second = subprocess.run([str(HETERO), "prefill", "--model", str(REAL), "--weights",
                                 str(exported), "--port", str(port)],
                                capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
        assert second.returncode != 0, second.stdout + second.stderr
        assert f"cannot bind 127.0.0.1:{port}" in second.stderr, second.stderr
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
