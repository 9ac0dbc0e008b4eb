"""The front door end to end on real processes: `hetero prefill` (with and without injected
faults), the MLX decoder with its seam, and `hetero front`, each started on free ports.

What is checked: the official `openai` client gets the decoder's own native answer through the
front (short and bridged, streaming and not); every response carries an X-PD-Bridge verdict;
every prefill-host failure (killed, corrupt, truncated, stalled, gap, wrong T, down,
fingerprint mismatch) still ends in the native answer with a truthful verdict; concurrent
clients; bad input refused with a JSON 4xx while serving continues; SSE relayed unbuffered;
/metrics; `hetero up` and `hetero doctor`.

"Native answer" = the same request sent straight to the decoder port, temperature 0, on a cold
prompt cache (/hetero/clear before and after, so the front's request is cold too).
Needs build/hetero, models/tiny-llama and (for the answer-quality checks and a tokenizer)
models/smollm2-135m-instruct; skips with a reason when one is missing.
"""

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List

import pytest
from frontstack import (CHUNK, ENV, HETERO, MIN_TOKENS, MODEL_NAME, PY, REAL, ROOT, TINY, Proc,
                        Stack, answer, cached_tokens, chat, children_of, export_weights, free_port,
                        kill_with_children, metrics, need, openai_chat, post_front, requests,
                        running_stack, start_up, text, verdict_of)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with running_stack(TINY, tmp_path_factory.mktemp("tiny"), "tiny test model") as stack:
        yield stack


@pytest.fixture(scope="module")
def main_front(tiny) -> Proc:
    """The healthy front: prefill host without faults, chunk 64."""
    return tiny.front(tiny.prefill(chunk=64).port)


# ---------------------------------------------------------------- 1. the openai client


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_client_short_prompt_gets_native_answer(tiny, main_front, stream) -> None:
    body = chat("Say hello.", max_tokens=16)
    native = tiny.native(body)
    got, v, usage = openai_chat(main_front, body, stream)
    assert v["verdict"].startswith("skipped: short"), v
    assert v["T"] == native["usage"]["prompt_tokens"] < MIN_TOKENS and v["B"] == 0
    assert got == answer(native)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_client_bridged_prompt_gets_native_answer(tiny, main_front, stream) -> None:
    body = chat(text(f"openai-bridged-{stream}", 120), max_tokens=24)
    native = tiny.native(body)
    T = native["usage"]["prompt_tokens"]
    assert T >= MIN_TOKENS
    got, v, usage = openai_chat(main_front, body, stream)
    assert v["verdict"] == "complete", v
    assert (v["B"], v["T"]) == (T - 1, T) and v["bytes"] > 0
    assert v["arith"] == "exact", v  # the CPU backend computes the decoder's own arithmetic
    assert got == answer(native)
    if not stream:
        assert usage.prompt_tokens == T
        assert usage.prompt_tokens_details.cached_tokens == T - 1


def test_completions_endpoint_bridged(tiny, main_front) -> None:
    body = {"model": MODEL_NAME, "prompt": text("completions", 120), "max_tokens": 16,
            "temperature": 0.0}
    native = tiny.native(body, "/v1/completions")
    r = post_front(main_front, body, "/v1/completions")
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    T = native["usage"]["prompt_tokens"]
    assert v["verdict"] == "complete" and v["B"] == T - 1, v
    assert answer(r.json()) == answer(native) and cached_tokens(r.json()) == T - 1


# ---------------------------------------------------------------- 2. verdict header everywhere


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/chat/completions", chat("hi", 4), 200),
    ("POST", "/v1/chat/completions", chat("hi", 4, stream=True), 200),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4}, 200),
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", chat("hi", 4, model="no-such-model"), 404),
    ("GET", "/v1/models", None, 200),
    ("GET", "/health", None, 200),
    ("GET", "/metrics", None, 200),
    ("GET", "/no/such/route", None, 404),
], ids=["chat", "chat-stream", "completions", "bad-json", "unknown-model", "models", "health",
        "metrics", "unknown-route"])
def test_every_response_has_a_verdict_header(main_front, method, path, body, status) -> None:
    if method == "GET":
        r = requests.get(Stack.url(main_front.port, path), timeout=60)
    else:
        r = post_front(main_front, body, path)
    assert r.status_code == status, r.text
    v = verdict_of(r.headers)
    if status >= 400:
        assert "error" in r.json()
        assert v["verdict"].startswith(("skipped", "declined")), v


# ---------------------------------------------------------------- 3. faults


def run_fault(tiny, front: Proc, tag: str) -> tuple:
    """A cold bridged request through front: (verdict, reply, native reply)."""
    body = chat(text(tag, 110), max_tokens=16)
    native = tiny.native(body)
    r = post_front(front, body)
    assert r.status_code == 200, r.text
    v = verdict_of(r.headers)
    print(tag, json.dumps(v))
    assert v["T"] == native["usage"]["prompt_tokens"]
    assert answer(r.json()) == answer(native), (v, answer(r.json()), answer(native))
    return v, r.json(), native


def assert_declined(v: dict, reply: dict, *needles: str) -> None:
    assert v["verdict"].startswith("declined: "), v
    assert v["B"] == 0, v
    for n in needles:
        assert n in v["verdict"], v
    # The decoder ran natively on a cold cache: it reused no bridged rows.
    assert cached_tokens(reply) == 0


def assert_partial(v: dict, reply: dict, rows: int) -> None:
    T = v["T"]
    assert v["verdict"] == f"partial {rows}/{T}" and v["B"] == rows, v
    assert cached_tokens(reply) == rows  # the decoder reused exactly the verified rows


def test_fault_prefill_killed_mid_stream(tiny) -> None:
    prefill = tiny.prefill("exit-after:1", fresh=True)
    front = tiny.front(prefill.port, **{"stall-ms": 5000})
    v, reply, _ = run_fault(tiny, front, "fault-exit")
    assert_declined(v, reply, f"verified {CHUNK}/{v['T'] - 1} rows")
    assert "closed" in v["verdict"] or "stalled" in v["verdict"]
    prefill.popen.wait(timeout=10)  # it really died mid-stream
    assert prefill.popen.returncode != 0


@pytest.mark.parametrize("fraction,expect", [(0.05, "partial"), (0.9, "declined")])
def test_fault_corrupt_segment(tiny, fraction, expect) -> None:
    # Segment 1 (0-based) has a flipped payload byte: segment 0 (CHUNK rows) verifies.
    front = tiny.front(tiny.prefill("corrupt:1").port, **{"partial-min-fraction": fraction})
    v, reply, _ = run_fault(tiny, front, f"fault-corrupt-{fraction}")
    if expect == "partial":
        assert_partial(v, reply, CHUNK)
    else:
        assert_declined(v, reply, "checksum", f"verified {CHUNK}/")


@pytest.mark.parametrize("fraction,expect", [(0.1, "partial"), (0.5, "declined")])
def test_fault_truncated_stream(tiny, fraction, expect) -> None:
    front = tiny.front(tiny.prefill("truncate-after:2").port, **{"partial-min-fraction": fraction})
    v, reply, _ = run_fault(tiny, front, f"fault-truncate-{fraction}")
    if expect == "partial":
        assert_partial(v, reply, 2 * CHUNK)
    else:
        assert_declined(v, reply, "manifest", f"verified {2 * CHUNK}/")


def test_fault_stalled_prefill(tiny) -> None:
    prefill = tiny.prefill("stall-after:1", fresh=True)
    front = tiny.front(prefill.port, **{"stall-ms": 2000})
    try:
        v, reply, _ = run_fault(tiny, front, "fault-stall")
    finally:
        prefill.kill()  # a stalled host stays stalled (and does not stop on SIGTERM)
    assert_declined(v, reply, f"verified {CHUNK}/")
    assert "stall" in v["verdict"] or "deadline" in v["verdict"], v
    assert v["timings_ms"]["prefill"] >= 2000  # it waited out the stall, then fell back


@pytest.mark.parametrize("fraction,expect", [(0.05, "partial"), (0.5, "declined")])
def test_fault_gap(tiny, fraction, expect) -> None:
    front = tiny.front(tiny.prefill("gap:1").port, **{"partial-min-fraction": fraction})
    v, reply, _ = run_fault(tiny, front, f"fault-gap-{fraction}")
    if expect == "partial":
        assert_partial(v, reply, CHUNK)
    else:
        assert_declined(v, reply, f"verified {CHUNK}/")


def test_fault_wrong_t_is_declined(tiny) -> None:
    # Every segment verifies but the manifest claims another T: the stream answered some other
    # request, so none of it is trusted (the issue: wrong T -> declined).
    front = tiny.front(tiny.prefill("wrong-t").port)
    v, reply, _ = run_fault(tiny, front, "fault-wrong-t")
    assert_declined(v, reply, "T=")


def test_prefill_host_out_of_memory_falls_back_with_the_reason(tiny) -> None:
    # The prefill host refuses a request its memory cannot take (HTTP 507, JSON) before any
    # byte streams; the front answers natively and says why. The host keeps serving.
    prefill = tiny.prefill("refuse-memory")
    r = requests.post(Stack.url(prefill.port, "/v1/prefill"),
                      json={"ids": [1, 2, 3], "fingerprint": tiny.info["fingerprint"]}, timeout=30)
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "resource_exhausted", r.text
    front = tiny.front(prefill.port)
    for tag in ("fault-oom-1", "fault-oom-2"):
        v, reply, _ = run_fault(tiny, front, tag)
        assert_declined(v, reply, "HTTP 507", "out of device memory")
    assert prefill.popen.poll() is None


def test_prefill_host_down(tiny) -> None:
    front = tiny.front(free_port())  # nothing listens there
    v, reply, _ = run_fault(tiny, front, "fault-down")
    assert_declined(v, reply, "prefill host")
    assert v["bytes"] == 0


@pytest.fixture(scope="module")
def other_prefill(tiny, tmp_path_factory) -> Proc:
    """A prefill host for another model (another seed and shape): another fingerprint."""
    need(REAL / "tokenizer.json", "a tokenizer (SmolLM2's)")
    tmp = tmp_path_factory.mktemp("other")
    subprocess.run([PY, "-m", "hetero_mlx", "tiny-llama", "--tokenizer", str(REAL), "--out",
                    str(tmp / "model"), "--seed", "1", "--hidden", "128"],
                   check=True, env=ENV, capture_output=True, cwd=ROOT)
    weights = export_weights(tmp / "model", tmp / "weights")
    p = tiny.prefill(model=tmp / "model", weights=weights)
    p.model_dir, p.weights_dir = tmp / "model", weights
    return p


def test_front_refuses_to_start_on_another_models_prefill_host(tiny, other_prefill) -> None:
    theirs = requests.get(Stack.url(other_prefill.port, "/health"), timeout=10).json()
    ours = tiny.info["fingerprint"]
    assert theirs["fingerprint"] != ours
    r = subprocess.run([HETERO, "front", "--port", "0", "--decoder-port", str(tiny.decoder.port),
                        "--prefill-port", str(other_prefill.port), "--store", str(tiny.store)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=ENV)
    assert r.returncode != 0, r.stdout + r.stderr
    assert ours in r.stderr and theirs["fingerprint"] in r.stderr, r.stderr


def test_fingerprint_mismatch_after_start_is_declined_naming_both(tiny, other_prefill) -> None:
    # The front checks the pairing when both hosts answer at its start; a prefill host that
    # comes up later is checked per request: the host refuses (409) and the answer is native.
    port = free_port()
    front = tiny.front(port)  # nothing listens there yet: the pairing cannot be checked
    late = tiny.prefill(model=other_prefill.model_dir, weights=other_prefill.weights_dir,
                        port=port)
    try:
        theirs = requests.get(Stack.url(late.port, "/health"), timeout=10).json()["fingerprint"]
        health = requests.get(Stack.url(front.port, "/health"), timeout=10).json()
        assert health["fingerprints_agree"] is False, health
        v, reply, _ = run_fault(tiny, front, "fault-fingerprint")
        assert_declined(v, reply, "409", tiny.info["fingerprint"], theirs)
    finally:
        late.stop()


# ---------------------------------------------------------------- 4. concurrency


def test_concurrent_clients_short_not_blocked_by_bridges(tiny, main_front) -> None:
    bridged = [chat(text(f"concurrent-long-{i}", 3500), max_tokens=12) for i in range(4)]
    short = [chat(f"Name a colour, number {i}.", max_tokens=12) for i in range(4)]
    natives = [tiny.native(b) for b in bridged + short]
    results: Dict[int, tuple] = {}

    def worker(i: int, body: dict) -> None:
        r = post_front(main_front, body)
        results[i] = (time.monotonic(), r.status_code, dict(r.headers), r.json())

    threads = [threading.Thread(target=worker, args=(i, b)) for i, b in enumerate(bridged)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(0.2)  # the bridged ones are in (tokenizing or queued for the one bridge slot)
    threads += [threading.Thread(target=worker, args=(4 + i, b)) for i, b in enumerate(short)]
    for t in threads[4:]:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert len(results) == 8
    for i in sorted(results):
        print(i, f"{results[i][0] - t0:.3f}s", results[i][2].get("X-PD-Bridge"))
    for i, native in enumerate(natives):
        done, status, headers, reply = results[i]
        assert status == 200, reply
        v = verdict_of(headers)
        T = native["usage"]["prompt_tokens"]
        assert v["T"] == T
        if i < 4:
            assert v["verdict"] == "complete" and v["B"] == T - 1, v
            assert cached_tokens(reply) == T - 1
        else:
            assert v["verdict"].startswith("skipped: short"), v
        assert answer(reply) == answer(native), (i, v)
    # Bridges run one at a time (the later ones queued) ...
    assert max(verdict_of(results[i][2])["timings_ms"]["bridge_queue"] for i in range(4)) > 0
    # ... and requests that do not bridge never wait for one.
    assert max(results[i][0] for i in range(4, 8)) < max(results[i][0] for i in range(4))


def test_full_queues_refuse_with_retry_after_and_health_always_answers(tiny) -> None:
    # Regression (hardening issue): each queued bridge held one of the front's worker threads;
    # with enough of them a 2-token request waited 400 s and /health had no thread left. A
    # bridge past the queue is answered natively; completions past their slots get 503.
    stalled = tiny.prefill("stall-after:1", fresh=True)
    front = tiny.front(stalled.port, **{"completions": 4, "bridge-queue": 1, "stall-ms": 4000})
    results: Dict[int, requests.Response] = {}

    def worker(i: int) -> None:
        results[i] = post_front(front, chat(text(f"queue-{i}", 110), max_tokens=4))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
            time.sleep(0.5)  # in order: the first bridges, the second waits, the third is past
        health = requests.get(Stack.url(front.port, "/health"), timeout=5)
        assert health.status_code == 200, health.text
        for t in threads:
            t.join(timeout=120)
    finally:
        stalled.kill()
    # Past the bridge queue the decoder answers natively, saying why (issue 50, finding 8: it
    # was a 503 where the decoder could have answered).
    assert [results[i].status_code for i in range(3)] == [200, 200, 200]
    full = verdict_of(results[2].headers)
    assert full["verdict"].startswith("declined: bridge queue full"), full
    assert results[2].json()["choices"][0]["message"]["content"] is not None
    # Completion slots: --completions 1 here; more at once get 503 busy, /metrics still answers.
    slow = tiny.prefill("stall-after:1", fresh=True)
    busy_front = tiny.front(slow.port, **{"completions": 1, "bridge-queue": 8, "stall-ms": 4000})
    got: Dict[int, requests.Response] = {}

    def busy(i: int) -> None:
        got[i] = post_front(busy_front, chat(text(f"busy-{i}", 110), max_tokens=4))

    workers = [threading.Thread(target=busy, args=(i,)) for i in range(2)]
    try:
        for t in workers:
            t.start()
            time.sleep(0.5)
        assert requests.get(Stack.url(busy_front.port, "/metrics"), timeout=5).status_code == 200
        for t in workers:
            t.join(timeout=120)
    finally:
        slow.kill()
    codes = sorted(r.status_code for r in got.values())
    assert codes == [200, 503], codes
    refused = next(r for r in got.values() if r.status_code == 503)
    assert refused.json()["error"]["code"] == "busy" and refused.headers["Retry-After"] == "1"


def test_a_decoder_dying_mid_stream_ends_the_stream_properly(tmp_path) -> None:
    # Regression (hardening issue): a decoder that died mid-stream ended the SSE stream
    # silently: no error event, no finish_reason, no [DONE]. A decoder of its own: it dies here.
    with running_stack(TINY, tmp_path, "tiny test model") as stack:
        front = stack.front(stack.prefill().port)
        body = chat("Count from one to a million.", max_tokens=4000, stream=True)
        r = requests.post(Stack.url(front.port, "/v1/chat/completions"), json=body, stream=True,
                          timeout=120)
        assert r.status_code == 200, r.text
        events = r.iter_lines()
        first = next(e for e in events if e.startswith(b"data:"))
        assert b"[DONE]" not in first
        stack.decoder.kill()
        rest = [e for e in events if e.startswith(b"data:")]
    assert rest and rest[-1] == b"data: [DONE]", rest[-3:]
    error = json.loads(rest[-2][len(b"data:"):])
    assert error["error"]["code"] == "decoder_unavailable", error
    assert "stream broke" in error["error"]["message"], error


def test_a_front_stops_with_a_stream_waiting_on_the_decoder(tmp_path) -> None:
    # Regression: a front door's stop waited for each request in flight as long as its decoder
    # call (up to --decoder-timeout-ms, 30 minutes). Its decoder calls are cut at the stop: the
    # stream ends with its error event and [DONE], and the front exits. A decoder of its own:
    # it is stopped (SIGSTOP) mid-answer here.
    with running_stack(TINY, tmp_path, "tiny test model") as stack:
        front = stack.front(stack.prefill().port)
        body = chat("Count from one to a million.", max_tokens=4000, stream=True)
        r = requests.post(Stack.url(front.port, "/v1/chat/completions"), json=body, stream=True,
                          headers={"X-PD-Bridge-Mode": "native"}, timeout=120)
        assert r.status_code == 200, r.text
        events = r.iter_lines()
        next(e for e in events if e.startswith(b"data:"))  # the decoder is answering
        os.kill(stack.decoder.pid, signal.SIGSTOP)
        try:
            time.sleep(1)
            front.popen.send_signal(signal.SIGTERM)
            rc = front.popen.wait(timeout=30)  # before the fix: the decoder's timeout
            rest = [e for e in events if e.startswith(b"data:")]
        finally:
            os.kill(stack.decoder.pid, signal.SIGCONT)
    assert rc == 0, front.log()[-2000:]
    assert rest and rest[-1] == b"data: [DONE]", rest[-3:]
    error = json.loads(rest[-2][len(b"data:"):])
    assert error["error"]["code"] == "decoder_unavailable", error


def test_trickling_clients_do_not_starve_health(tiny, main_front) -> None:
    # Regression (hardening issue): connections that send their headers a byte at a time each
    # held one of a fixed pool's threads; 8 of them starved the prefill host's /health, 32 the
    # front door's /metrics, for as long as they trickled.
    prefill = tiny.prefill()
    socks = []
    stop = threading.Event()
    try:
        for port in (main_front.port, prefill.port):
            for _ in range(48):
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                socks.append(s)

        def trickle() -> None:
            while not stop.is_set():
                for s in socks:
                    try:
                        s.sendall(b"X")
                    except OSError:
                        pass
                stop.wait(1.0)

        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        time.sleep(1.5)
        for url in (Stack.url(main_front.port, "/health"), Stack.url(main_front.port, "/metrics"),
                    Stack.url(prefill.port, "/health")):
            t0 = time.monotonic()
            r = requests.get(url, timeout=5)
            assert r.status_code == 200 and time.monotonic() - t0 < 2, (url, r.status_code)
        # And real work goes on beside them.
        r = post_front(main_front, chat("Hi!", max_tokens=2))
        assert r.status_code == 200, r.text
    finally:
        stop.set()
        for s in socks:
            s.close()


def test_a_request_sent_too_slowly_is_cut_at_the_deadline(tiny) -> None:
    # Regression (hardening issue): cpp-httplib's timeout is per read, so a client sending a
    # header byte every second held its connection (and its thread) for as long as it liked.
    prefill = tiny.prefill()
    front = tiny.front(prefill.port, **{"request-deadline-s": 2})
    s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
    s.settimeout(0.5)
    t0 = time.monotonic()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    closed = False
    while not closed and time.monotonic() - t0 < 10:
        try:
            s.sendall(b"X")
            closed = s.recv(4096) == b""
        except socket.timeout:
            pass
        except OSError:
            closed = True
    elapsed = time.monotonic() - t0
    s.close()
    assert closed and 1.5 < elapsed < 4, elapsed
    assert "no whole request in 2000 ms" in front.log()
    # A request sent in time is served as ever on the same front door.
    assert requests.get(Stack.url(front.port, "/health"), timeout=5).status_code == 200
    r = post_front(front, chat("Hi!", max_tokens=2))
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- 5. bad input


@pytest.mark.parametrize("body,status,code", [
    (b"{\"messages\": [", 400, "invalid_json"),
    (chat("hi", 4, model="gpt-17-ultra"), 404, "model_not_found"),
    ({"model": MODEL_NAME, "messages": "hi", "max_tokens": 4}, 400, "invalid_field"),
    ({**chat("hi", 4), "max_tokens": "4"}, 400, "invalid_field"),
    (chat("hi", 4, stream="yes"), 400, "invalid_field"),
    (chat("x " * 34000, 4), 400, "context_length_exceeded"),
    # Regression (hardening issue): 100k nested levels in 200 KB crashed the front door.
    (b"[" * 100000 + b"]" * 100000, 400, "invalid_json"),
], ids=["malformed-json", "unknown-model", "messages-not-list", "max-tokens-string",
        "stream-string", "beyond-context-window", "nested-100k-deep"])
def test_bad_input_gets_json_4xx_and_serving_continues(tiny, main_front, body, status,
                                                       code) -> None:
    if code == "context_length_exceeded":
        assert json.loads((TINY / "config.json").read_text())["max_position_embeddings"] < 34000
    r = post_front(main_front, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"], err
    v = verdict_of(r.headers)
    assert not v["verdict"].startswith(("complete", "partial")), v
    ok = post_front(main_front, chat("Still there?", 4))
    assert ok.status_code == 200 and answer(ok.json()), ok.text


def test_body_over_the_limit_is_refused_before_it_is_read(tiny) -> None:
    front = tiny.front(tiny.prefill(chunk=64).port, **{"max-body-mb": 1})
    r = post_front(front, chat("y " * 700000, 4))  # ~1.4 MB
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["code"] == "payload_too_large"
    assert "1 MiB" in r.json()["error"]["message"]
    ok = post_front(front, chat("Still there?", 4))
    assert ok.status_code == 200 and answer(ok.json()), ok.text


# ---------------------------------------------------------------- 6. streaming is unbuffered


def test_stream_first_chunk_arrives_before_last(main_front) -> None:
    body = chat(text("stream-timing", 20), max_tokens=64, stream=True)
    events = []  # (read index, arrival ns) of each SSE data event, by the read that completed it
    inflight_after_first = None
    buf = b""
    with requests.post(Stack.url(main_front.port, "/v1/chat/completions"), json=body,
                       stream=True, timeout=600) as r:
        assert r.status_code == 200
        verdict_of(r.headers)
        for n_read, data in enumerate(r.iter_content(chunk_size=None)):  # as the bytes arrive
            now = time.perf_counter_ns()
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                    events.append((n_read, now))
            if events and inflight_after_first is None:
                # The front still relays this stream while its first event is in our hands.
                inflight_after_first = metrics(main_front)["hetero_inflight_requests"]
    print(f"{len(events)} events in {len({n for n, _ in events})} reads over "
          f"{(events[-1][1] - events[0][1]) / 1e6:.1f} ms; inflight {inflight_after_first}")
    assert len(events) >= 32, len(events)
    assert events[0][1] < events[-1][1]
    assert events[0][0] < events[-1][0]  # different reads: not one buffered block
    assert len({n for n, _ in events}) > len(events) // 4
    assert inflight_after_first >= 1


# ---------------------------------------------------------------- 7. metrics


def test_metrics_count_verdicts(tiny, main_front) -> None:
    down = tiny.front(free_port())
    before_ok, before_down = metrics(main_front), metrics(down)
    body = chat(text("metrics", 110), max_tokens=4)
    tiny.clear()
    assert verdict_of(post_front(main_front, body).headers)["verdict"] == "complete"
    body = chat(text("metrics-down", 110), max_tokens=4)
    assert verdict_of(post_front(down, body).headers)["verdict"].startswith("declined")
    after_ok, after_down = metrics(main_front), metrics(down)
    key = 'hetero_requests_total{verdict="%s"}'
    assert after_ok[key % "complete"] == before_ok[key % "complete"] + 1
    assert after_down[key % "declined"] == before_down[key % "declined"] + 1
    assert after_ok["hetero_bridge_bytes_total"] > before_ok["hetero_bridge_bytes_total"]


# ---------------------------------------------------------------- 8. hetero up / doctor


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_exit_when_ready(tmp_path) -> None:
    need(HETERO, "hetero binary")
    need(TINY / "config.json", "tiny test model")
    port = free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen(
            [str(HETERO), "up", "--exit-when-ready", "--port", str(port), "--decoder-port",
             str(free_port()), "--prefill-port", str(free_port()), "--work-dir",
             str(tmp_path / "work"), "--model", str(TINY), "--python", PY],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=ENV)
        try:
            rc = up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_with_children(up)
            pytest.fail("hetero up --exit-when-ready did not exit within 60 s after printing:\n"
                        + log_path.read_text(errors="replace"))
    out = log_path.read_text(errors="replace")
    assert rc == 0, out
    assert f"http://127.0.0.1:{port}/v1" in out, out


def wait_gone(pids: List[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(alive(k) for k in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(k) for k in pids), pids


def test_doctor_all_green_then_sigint_stops_up(tmp_path) -> None:
    up, log_path, (port, dport, pport) = start_up(tmp_path)
    try:
        kids = children_of(up.pid)
        assert len(kids) >= 2, kids  # decoder and prefill host
        # hetero up makes the stack's secret; doctor needs it for the seam.
        doc = subprocess.run([str(HETERO), "doctor", "--port", str(port), "--decoder-port",
                              str(dport), "--prefill-port", str(pport), "--secret-file",
                              str(tmp_path / "work" / "secret")],
                             capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
        print(doc.stdout)
        assert doc.returncode == 0, doc.stdout + doc.stderr
        assert "all green" in doc.stdout
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0, log_path.read_text()
        wait_gone(kids, 10)
    finally:
        kill_with_children(up)


def test_sigint_stops_up_with_a_request_in_flight(tmp_path) -> None:
    # Regression: Ctrl-C stopped the front door first, which waits for its requests in flight,
    # each as long as its decoder call (up to --decoder-timeout-ms, 30 minutes). A decoder that
    # never answers (stopped here) holds such a request; the stack must still stop promptly.
    up, log_path, (port, _, _) = start_up(tmp_path)
    try:
        kids = children_of(up.pid)
        decoder = [k for k in kids if "hetero_mlx" in Path(f"/proc/{k}/cmdline").read_text()]
        assert len(decoder) == 1, kids
        os.kill(decoder[0], signal.SIGSTOP)
        got = {}

        def ask() -> None:
            try:
                r = requests.post(Stack.url(port, "/v1/chat/completions"),
                                  json=chat("Hello there.", max_tokens=4),
                                  headers={"X-PD-Bridge-Mode": "native"}, timeout=120)
                got["status"] = r.status_code
            except requests.RequestException as e:  # the front went away: also an end
                got["error"] = repr(e)

        client = threading.Thread(target=ask)
        client.start()
        time.sleep(2)  # the request is in flight, waiting on the stopped decoder
        assert client.is_alive(), got
        up.send_signal(signal.SIGINT)
        rc = up.wait(timeout=60)  # before the fix: the decoder's 30-minute timeout
        client.join(timeout=30)
        assert not client.is_alive()
        assert got.get("status", 503) != 200, got
        assert rc == 0, log_path.read_text()
        wait_gone(kids, 10)
    finally:
        kill_with_children(up)


def test_children_die_with_a_killed_up(tmp_path) -> None:
    # Regression (hardening issue): a `hetero up` that died left its decoder and prefill host
    # running, holding their ports.
    up, _, _ = start_up(tmp_path)
    try:
        kids = children_of(up.pid)
        assert len(kids) >= 2, kids
        up.kill()  # no chance to stop its children itself
        up.wait(timeout=30)
        wait_gone(kids, 15)
    finally:
        kill_with_children(up)


def test_up_restarts_a_dead_child_and_stops_only_when_restarts_keep_failing(tmp_path) -> None:
    # Regression (issue 50, finding 6): a killed prefill host stopped the whole stack, though
    # the decoder could have gone on answering. Now it is started again; only a child whose
    # restarts keep failing (its decoder weights gone here) stops the stack, saying which and why.
    up, log_path, (port, _, _) = start_up(tmp_path)
    try:
        def prefill_pid() -> int:
            kids = [k for k in children_of(up.pid)
                    if " prefill " in Path(f"/proc/{k}/cmdline").read_text().replace("\0", " ")]
            assert len(kids) == 1, kids
            return kids[0]

        def kill_and_wait(pid: int) -> None:
            os.kill(pid, signal.SIGKILL)  # its sockets close once it has exited
            while True:
                try:
                    if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                        return
                except OSError:
                    return
                time.sleep(0.01)

        first = prefill_pid()
        kill_and_wait(first)
        deadline = time.monotonic() + 60
        while "hetero_child_restarts_total{child=\"prefill host\"} 1" not in requests.get(
                Stack.url(port, "/metrics"), timeout=10).text:
            assert up.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        assert prefill_pid() != first
        r = requests.post(Stack.url(port, "/v1/chat/completions"), json=chat("Hi.", 4),
                          timeout=120)
        assert r.status_code == 200, r.text
        # Its decoder weights gone, every restart fails: the stack stops after the sixth failure.
        weights = tmp_path / "work" / "decoder-weights"
        weights.rename(tmp_path / "work" / "weights-moved-away")
        kill_and_wait(prefill_pid())
        assert up.wait(timeout=180) == 1, log_path.read_text()
        out = log_path.read_text(errors="replace")
        assert "up: the prefill host failed 6 times" in out, out
        assert "prefill.log" in out, out
    finally:
        kill_with_children(up)


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    with running_stack(REAL, tmp_path_factory.mktemp("real"), "SmolLM2-135M-Instruct") as stack:
        # The chat template alone is ~30 tokens: a greeting stays short, a question bridges.
        front = stack.front(stack.prefill(chunk=32).port,
                            **{"bridge-min-tokens": 40, "bridge-min-tail": 40})
        yield stack, front


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_real_model_answers_through_openai_client(real, stream) -> None:
    stack, front = real
    q = "What is the capital of France? Answer in one sentence."
    bridged = chat(q, max_tokens=24 if not stream else 12)
    short = chat("Hi!", max_tokens=8)
    for body, kind in ((bridged, "complete"), (short, "skipped: short")):
        native = stack.native(body)
        got, v, usage = openai_chat(front, body, stream)
        assert v["verdict"].startswith(kind), v
        assert got == answer(native), (v, got, answer(native))
        if kind == "complete" and not stream:
            assert "Paris" in got
            assert usage.prompt_tokens_details.cached_tokens == v["T"] - 1


@pytest.mark.slow
def test_real_model_long_prompt_bridged(real) -> None:
    stack, front = real
    prompt = ROOT / "prompts" / "chat" / "04-notes.json"
    need(prompt, "prompt")
    body = {"model": MODEL_NAME, "max_tokens": 32, "temperature": 0.0,
            **json.loads(prompt.read_text())}
    native = stack.native(body)
    got, v, usage = openai_chat(front, body, stream=False)
    T = native["usage"]["prompt_tokens"]
    assert v["verdict"] == "complete" and (v["B"], v["T"]) == (T - 1, T), v
    assert usage.prompt_tokens_details.cached_tokens == T - 1
    assert got == answer(native)


# ---------------------------------------------------------------- last: the advertised model id


def test_model_id_from_v1_models_is_served(tiny, main_front) -> None:
    """Regression: the id /v1/models lists was forwarded as is; mlx-lm then tried to fetch a
    model of that name from a hub and dropped its own, breaking every later request. A client
    that lists /v1/models and uses that id gets the decoder's own answer, and the stack keeps
    serving. (Runs last: when it fails it may leave the decoder unloaded, so the finalizer
    reloads it with a direct default-model request.)"""
    model_id = requests.get(Stack.url(main_front.port, "/v1/models"), timeout=10).json()
    model_id = model_id["data"][0]["id"]
    body = chat("Say hello.", max_tokens=8)
    native = tiny.native(body)
    try:
        r = post_front(main_front, dict(body, model=model_id))
        assert r.status_code == 200, (model_id, r.text)
        assert answer(r.json()) == answer(native)
        after = post_front(main_front, body)  # the decoder still serves afterwards
        assert after.status_code == 200, after.text
        assert answer(after.json()) == answer(native)
    finally:
        requests.post(Stack.url(tiny.decoder.port, "/v1/chat/completions"),
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                      timeout=120)
