#!/usr/bin/env python3
"""Soak: many concurrent OpenAI clients on the whole CPU stack (`hetero up`) for minutes.

Starts `hetero up` on a model (default: the built-in default), then runs --clients threads, each
with its own official `openai` client (no retries: a refusal counts as an error), for --minutes,
in two phases: through the front door (bridges run), then, as the reference in the same run,
the same clients straight at the decoder (mlx-lm alone: no bridge, long prompts prefilled by the
decoder itself). Clients take turns by index: long prompts (cold) and short ones, each streamed
or not. Every request is checked: HTTP 200, an answer, for streams a usage event, and through
the front door a verdict header. Each process's resident memory is sampled every --rss-every
seconds. The stack runs with two API keys; well-behaved clients alternate between them.

Beside them, --abusive clients (through the front door; issue 50's findings as traffic) loop
over: a `stop` of another shape than strings (must be 400 naming stop), a non-streaming request
of 4,000 tokens abandoned after 1.5 s, a request line trickled one byte every 2 s at the front
door and at the decoder's port (must be cut by the deadline), a chunked body of up to 600 MiB
(must be 413 before 200 MiB went), and a request without a valid API key (must be 401). What
must hold: no error on any well-behaved request, every abuse refused as stated, the stack never
exits and no child is restarted (hetero_child_restarts_total stays 0).

Reports per phase: errors (must be 0), requests and verdicts per kind, latency percentiles per
kind, and each process's RSS over the phase (first and last minute, and the largest). Raw
lines: bench/results/soak-<rev>.jsonl (one per request, per RSS sample, and the summary).

usage: .venv/bin/python bench/soak.py [--minutes 10] [--clients 64] [--abusive 16]
                                      [--model DIR] [--phases front,decoder]
"""

import argparse
import collections
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "py"))

import openai  # noqa: E402
from frontstack import children_of, free_port, text  # noqa: E402
from seam_server import openai_http_client  # noqa: E402

KINDS = ("long", "long-stream", "short", "short-stream")
ABUSES = ("bad-stop", "abandon", "trickle-front", "trickle-decoder", "chunked-bomb", "bad-key")
KEYS = ("soak-tenant-a-" + "a" * 20, "soak-tenant-b-" + "b" * 20)
STOPS = (5, [1], [["x"]], [{}], {"a": "b"}, True, [None], [1.5], [[]])


def git_rev() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                       text=True)
    return r.stdout.strip() or "unknown"


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def process_name(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    text_argv = " ".join(a.decode(errors="replace") for a in argv)
    if "hetero_mlx" in text_argv:
        return "decoder"
    if " prefill " in f" {text_argv} ":
        return "prefill"
    return "front"


def percentile(values, q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def one_request(client, model: str, kind: str, tag: str, long_words: int,
                want_verdict: bool) -> dict:
    """One request of a kind; returns what was observed (an "error" key when it failed)."""
    long_prompt = kind.startswith("long")
    content = text(tag, long_words) if long_prompt else f"Say hello to {tag}."
    args = dict(model=model, messages=[{"role": "user", "content": content}],
                max_tokens=12 if long_prompt else 6, temperature=0.0)
    t0 = time.monotonic()
    row = {"kind": kind, "tag": tag}
    try:
        if kind.endswith("stream"):
            with client.chat.completions.with_streaming_response.create(
                    stream=True, stream_options={"include_usage": True}, **args) as resp:
                verdict = resp.headers.get("X-PD-Bridge")
                first, parts, usage = None, [], None
                for chunk in resp.parse():
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first if first is not None else time.monotonic() - t0
                        parts.append(chunk.choices[0].delta.content)
                    if chunk.usage is not None:
                        usage = chunk.usage
            row.update(first_token_s=first, answer_chars=len("".join(parts)))
            if usage is None:
                row["error"] = "stream ended without a usage event"
        else:
            raw = client.chat.completions.with_raw_response.create(**args)
            verdict = raw.headers.get("X-PD-Bridge")
            reply = raw.parse()
            usage = reply.usage
            row["answer_chars"] = len(reply.choices[0].message.content or "")
        if verdict is None and want_verdict:
            row["error"] = "no X-PD-Bridge header"
        elif verdict is not None:
            v = json.loads(verdict)
            row["verdict"] = v["verdict"].split(":")[0].split(" ")[0]
        if usage is not None:
            row["prompt_tokens"] = usage.prompt_tokens
    except Exception as e:  # any failure of any kind is an error of the soak
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    row["latency_s"] = time.monotonic() - t0
    return row


def raw_exchange(port: int, head: bytes, piece: bytes = b"", limit: int = 0,
                 every_s: float = 0.0, timeout_s: float = 30.0) -> tuple:
    """Sends head, then piece after piece (every_s apart) until the server closes or limit bytes
    went; returns (bytes of pieces sent, the server's status line or "", seconds until closed)."""
    t0 = time.monotonic()
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sent = 0
    try:
        s.sendall(head)
        while sent < limit:
            s.sendall(piece)
            sent += len(piece)
            if every_s:
                time.sleep(every_s)
    except OSError:
        pass
    reply = b""
    try:
        s.settimeout(timeout_s)
        while chunk := s.recv(65536):
            reply += chunk
            if len(reply) > 4096:
                break
    except OSError:
        pass
    s.close()
    return sent, reply.split(b"\r\n", 1)[0].decode(errors="replace"), time.monotonic() - t0


def one_abuse(kind: str, port: int, dport: int, rng: random.Random) -> dict:
    """One abusive request; an "error" key when the stack did not refuse it as it must."""
    row = {"kind": kind}
    key = f"Authorization: Bearer {KEYS[0]}\r\n".encode()
    try:
        if kind == "bad-stop":
            body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                               "stop": rng.choice(STOPS)}).encode()
            _, status, _ = raw_exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\n"
                                        + key + b"Content-Type: application/json\r\n"
                                        b"Connection: close\r\nContent-Length: " +
                                        str(len(body)).encode() + b"\r\n\r\n" + body)
            if " 400 " not in status + " ":
                row["error"] = f"a bad stop answered {status!r}"
        elif kind == "abandon":
            body = json.dumps({"messages": [{"role": "user", "content": "tell a long story"}],
                               "max_tokens": 4000, "temperature": 1.0}).encode()
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\n" + key +
                      b"Content-Type: application/json\r\nContent-Length: " +
                      str(len(body)).encode() + b"\r\n\r\n" + body)
            time.sleep(1.5)
            s.close()
        elif kind in ("trickle-front", "trickle-decoder"):
            target, deadline_s = (port, 60) if kind == "trickle-front" else (dport, 10)
            _, _, closed_s = raw_exchange(target, b"POST /v1/chat/completions HTTP/1.1\r\n", b"X",
                                          limit=10**6, every_s=2.0, timeout_s=5)
            row["closed_s"] = round(closed_s, 1)
            if closed_s > deadline_s + 15:
                row["error"] = f"a trickler held its connection {closed_s:.0f} s"
        elif kind == "chunked-bomb":
            piece = b"100000\r\n" + b"x" * 0x100000 + b"\r\n"
            sent, status, _ = raw_exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: s"
                                           b"\r\n" + key + b"Transfer-Encoding: chunked\r\n\r\n",
                                           piece, limit=600 << 20)
            row["sent_mib"] = sent >> 20
            if " 413 " not in status + " " or sent >= 200 << 20:
                row["error"] = f"a chunked bomb answered {status!r} after {sent >> 20} MiB"
        elif kind == "bad-key":
            _, status, _ = raw_exchange(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: s\r\n"
                                        b"Authorization: Bearer not-a-key-of-this-stack\r\n"
                                        b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            if " 401 " not in status + " ":
                row["error"] = f"an unknown key answered {status!r}"
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def run_phase(phase: str, port: int, up_pid: int, args, rev: str, dport: int = 0,
              secret: str = ""):
    """--clients closed-loop clients at one port for --minutes; RSS sampled until the last
    client's last request has ended. Returns (request rows, RSS rows)."""
    model = Path(args.model).name if phase == "front" else "default_model"
    rows, rss_rows = [], []
    lock = threading.Lock()
    t_start = time.monotonic()
    stop_at = t_start + args.minutes * 60
    clients_done = threading.Event()

    def client_loop(i: int) -> None:
        # Through the front door each client is a tenant's (two keys); straight at the decoder,
        # its requests are signed as the front door signs them.
        signing = openai_http_client(secret) if phase == "decoder" else None
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEYS[i % 2],
                               max_retries=0, timeout=900, http_client=signing)
        kind, n = KINDS[i % len(KINDS)], 0
        while time.monotonic() < stop_at:
            tag = f"soak-{rev}-{phase}-{i}-{n}"
            row = one_request(client, model, kind, tag, args.long_words, phase == "front")
            row.update(phase=phase, client=i, t_s=round(time.monotonic() - t_start, 2))
            with lock:
                rows.append(row)
            n += 1

    def sample_rss() -> None:
        while not clients_done.is_set():
            t = round(time.monotonic() - t_start, 1)
            for pid in [up_pid] + children_of(up_pid):
                rss_rows.append({"phase": phase, "rss": process_name(pid), "pid": pid, "t_s": t,
                                 "rss_mib": round(rss_mib(pid), 1)})
            clients_done.wait(args.rss_every)

    def abuse_loop(i: int) -> None:
        rng, n = random.Random(i), 0
        while time.monotonic() < stop_at:
            kind = ABUSES[(i + n) % len(ABUSES)]
            row = one_abuse(kind, port, dport, rng)
            row.update(phase=phase, client=f"abusive-{i}", abusive=True,
                       t_s=round(time.monotonic() - t_start, 2))
            with lock:
                rows.append(row)
            n += 1

    sampler = threading.Thread(target=sample_rss)
    sampler.start()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.clients)]
    if phase == "front":
        threads += [threading.Thread(target=abuse_loop, args=(i,)) for i in range(args.abusive)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clients_done.set()
    sampler.join()
    return rows, rss_rows


def summarize(phase: str, rows, rss_rows, args, rev: str) -> dict:
    end = max([r["t_s"] for r in rss_rows] + [0.0])
    abuse = [r for r in rows if r.get("abusive")]
    rows = [r for r in rows if not r.get("abusive")]
    lat = {k: [r["latency_s"] for r in rows if r["kind"] == k and "error" not in r] for k in KINDS}
    verdicts = collections.Counter((r["kind"], r.get("verdict")) for r in rows if "error" not in r)
    rss = {}
    for name in sorted({r["rss"] for r in rss_rows}):
        mine = [r for r in rss_rows if r["rss"] == name]
        rss[name] = {"first_min_max_mib": max(r["rss_mib"] for r in mine if r["t_s"] <= 60),
                     "last_min_max_mib": max(r["rss_mib"] for r in mine if r["t_s"] >= end - 60),
                     "max_mib": max(r["rss_mib"] for r in mine)}
    return {
        "bench": "soak", "phase": phase, "rev": rev, "model": Path(args.model).name,
        "clients": args.clients, "minutes_of_requests": args.minutes,
        "minutes": round(end / 60, 2), "requests": len(rows),
        "errors": sum("error" in r for r in rows),
        "abusive_clients": args.abusive if phase == "front" else 0,
        "abuses": dict(collections.Counter(r["kind"] for r in abuse)),
        "abuses_not_refused": sum("error" in r for r in abuse),
        "trickle_closed_s_max": {k: max([r["closed_s"] for r in abuse if r["kind"] == k
                                         and "closed_s" in r] or [None], key=lambda x: x or 0)
                                 for k in ("trickle-front", "trickle-decoder")},
        "by_kind": dict(collections.Counter(r["kind"] for r in rows)),
        "verdicts": {f"{k}/{v}": n for (k, v), n in sorted(verdicts.items()) if v},
        "latency_s": {k: {"p50": round(percentile(v, 0.5), 2),
                          "p99": round(percentile(v, 0.99), 2),
                          "max": round(max(v), 2) if v else None} for k, v in lat.items()},
        "rss": rss, "machine": os.uname().nodename, "cpus": os.cpu_count(),
        # What the line needs to stand alone (issue 53): one run of each phase, and its command.
        "gpu": "none (CPU backend)", "n": 1,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--abusive", type=int, default=16,
                    help="abusive clients beside --clients, through the front door")
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--long-words", type=int, default=300)
    ap.add_argument("--rss-every", type=float, default=5.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--phases", default="front,decoder",
                    help="front: through the front door; decoder: straight at mlx-lm")
    args = ap.parse_args()
    rev = git_rev()
    out_path = Path(args.out or ROOT / "bench" / "results" / f"soak-{rev}.jsonl")
    work = Path(tempfile.mkdtemp(prefix="hetero-soak-"))
    port, dport = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"),
               # Room for every client at once: the soak measures serving, not refusals.
               HETERO_FRONT_COMPLETIONS=str(args.clients + args.abusive),
               HETERO_FRONT_BRIDGE_QUEUE=str(args.clients))
    env.pop("HETERO_SECRET_FILE", None)
    keys = work / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    keys.chmod(0o600)
    log = open(work / "up.log", "wb")
    up = subprocess.Popen([str(ROOT / "build" / "hetero"), "up", "--model", args.model,
                           "--work-dir", str(work / "up"), "--port", str(port), "--decoder-port",
                           str(dport), "--prefill-port", str(free_port()), "--api-key-file",
                           str(keys)],
                          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while "hetero is up" not in (work / "up.log").read_text(errors="replace"):
        if up.poll() is not None or time.monotonic() > deadline:
            print((work / "up.log").read_text(errors="replace")[-3000:])
            return 1
        time.sleep(0.5)
    ports = {"front": port, "decoder": dport}
    secret = (work / "up" / "secret").read_text().strip()
    summaries, all_rows = [], []
    for phase in args.phases.split(","):
        rows, rss_rows = run_phase(phase, ports[phase], up.pid, args, rev, dport, secret)
        summary = summarize(phase, rows, rss_rows, args, rev)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        summary["child_restarts"] = sum(
            float(line.split()[-1]) for line in metrics.decode().splitlines()
            if line.startswith("hetero_child_restarts_total"))
        summary["stack_running"] = up.poll() is None
        summaries.append(summary)
        all_rows += rows + rss_rows
    up.terminate()
    try:
        up.wait(timeout=60)
    except subprocess.TimeoutExpired:
        up.kill()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w") as f:
        for r in all_rows + summaries:
            f.write(json.dumps(r) + "\n")
    errors = [r for r in all_rows if "error" in r]
    failed = errors or any(s["child_restarts"] or not s["stack_running"] for s in summaries)
    for summary in summaries:
        print(json.dumps(summary, indent=1))
    for e in errors[:10]:
        print("error:", e)
    print(f"raw lines: {out_path}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
