#!/usr/bin/env python3
"""hetero bench cold: time to first token, native vs bridged, for cold prompts of several sizes.

Each request gets a fresh random prompt (a prompt the decoder has seen is not cold), both legs
go through the same front door — native forced with `X-PD-Bridge-Mode: native`, bridged with
`X-PD-Bridge-Mode: bridge` — after a warm-up request on each leg. Every verdict is recorded; a
bridged time whose verdict is not `complete` is reported as such, never as a bridged number.
Writes JSON lines, a markdown table and a PNG plot under bench/results/.

Starts its own stack (`hetero up`) on free ports unless --url names a running front door.
On a CPU machine quote the ratio, not absolute times (STYLE.md).

usage: hetero bench cold [--sizes 256,1024,4096] [--repeat 1] [--max-tokens 32] [--url URL]
"""

import argparse
import json
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river copper lantern orbit meadow cipher harbor velvet glacier summit ember quartz "
         "tundra falcon prism willow canyon beacon marble thistle anchor saffron comet delta "
         "juniper basalt cobalt raven maple solstice").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_prompt(n_words: int, rng: random.Random) -> str:
    nonce = f"{rng.getrandbits(64):016x}"
    words = " ".join(rng.choice(WORDS) for _ in range(n_words))
    return f"[{nonce}] Read this list and say which word appears most often: {words}"


def stream(url: str, prompt: str, mode: str, max_tokens: int) -> dict:
    # The stream's header verdict is a prediction; the confirmed one (the decoder's own
    # cached_tokens) comes in the usage event the front adds it to when usage is asked for.
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "stream": True,
                       "stream_options": {"include_usage": True},
                       "max_tokens": max_tokens, "temperature": 0.0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json", "X-PD-Bridge-Mode": mode})
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage = {}
    with urllib.request.urlopen(req, timeout=3600) as resp:
        verdict = json.loads(resp.headers.get("X-PD-Bridge", "{}"))
        verdict["verdict"] = f"unconfirmed: {verdict.get('verdict')} (no usage event)"
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if not event.get("choices"):
                verdict = event.get("x_pd_bridge", verdict)
                usage = event.get("usage") or usage
                continue
            delta = event["choices"][0].get("delta", {})
            if delta.get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    return {"ttft_s": (first or time.perf_counter()) - t0, "total_s": time.perf_counter() - t0,
            "decode_tok_s": (chunks - 1) / (last - first) if chunks > 1 and last > first else None,
            "verdict": verdict.get("verdict"), "T": verdict.get("T"), "B": verdict.get("B"),
            "bytes": verdict.get("bytes"), "timings_ms": verdict.get("timings_ms"),
            "confirmed": verdict.get("confirmed"), "chunks_out": chunks,
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "prompt_tokens": usage.get("prompt_tokens")}


def post(url: str, body: dict, headers: dict, secret: str = "") -> tuple:
    """(status, headers, parsed body) of a JSON POST; an HTTP error's body as text. secret:
    signed with the stack's secret (the decoder's port takes only signed requests)."""
    data = json.dumps(body).encode()
    if secret:
        headers = {**headers, **seam_auth(secret, "POST", url, data)}
    req = urllib.request.Request(url, data=data,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=7200) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode(errors="replace")


def seam_auth(secret: str, method: str, url: str, data: bytes = b"") -> dict:
    """The Authorization header of a request to the decoder's port (docs/design/auth.md)."""
    sys.path.insert(0, str(ROOT / "python"))
    from hetero_mlx.access import signed_headers

    target = "/" + url.split("://", 1)[-1].split("/", 1)[1]
    return signed_headers(secret, method, target, data)


def start_stack(model: str, work: Path = None, prefill_model: str = "") -> tuple:
    """`hetero up` on free ports: (process, front url, decoder url, decoder secret). The
    benchmark forces its routes (X-PD-Bridge-Mode), so the stack honours a forced bridge from
    it (--forced-bridges anyone; docs/design/auth.md)."""
    ports = [free_port() for _ in range(3)]
    work = work or Path(os.environ.get("TMPDIR", "/tmp")) / f"hetero-bench-{os.getpid()}"
    extra = ["--prefill-model", prefill_model] if prefill_model else []
    proc = subprocess.Popen([str(ROOT / "build" / "hetero"), "up", "--model", model,
                             "--port", str(ports[0]), "--decoder-port", str(ports[1]),
                             "--prefill-port", str(ports[2]), "--work-dir", str(work),
                             "--forced-bridges", "anyone"] + extra,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    work.mkdir(parents=True, exist_ok=True)
    log = (work / "up.log").open("w")  # the front's log and the stack's own lines
    for line in proc.stdout:
        log.write(line)
        if "hetero is up" in line:
            # Its later output is read into the log, so a full pipe never blocks it.
            def drain() -> None:
                for rest in proc.stdout:
                    log.write(rest)
                    log.flush()
                log.close()
            threading.Thread(target=drain, daemon=True).start()
            secret = (work / "secret").read_text().strip()
            return proc, f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}", secret
    raise SystemExit("hetero up did not come up; see " + str(work))


def git_rev() -> str:
    # A copy of the tree without .git (the GPU machine's) names its revision in HETERO_REVISION.
    if os.environ.get("HETERO_REVISION"):
        return os.environ["HETERO_REVISION"]
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                       text=True)
    return r.stdout.strip() or "unknown"


def gpu_name() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def provenance() -> dict:
    """What a raw line needs to stand alone (issue 53): revision, machine, GPU, the prefill's
    backend and arithmetic (the cache program's is always the decoder's, exact), the command."""
    backend = os.environ.get("HETERO_PREFILL_BACKEND", "cpu")
    return {"rev": git_rev(), "machine": platform.node(), "cpus": os.cpu_count(),
            "gpu": gpu_name() or "none", "prefill_backend": backend,
            # cuda: "fast" caches agree with the native one within a tolerance, "exact" ones bit
            # for bit (docs/design/prefill-cuda.md); the CPU backend is always exact ("ordered").
            "prefill_arith": (os.environ.get("HETERO_PREFILL_ARITH", "exact") if backend == "cuda"
                              else "ordered"),
            "program_arith": "exact (the decoder's)",
            "command": shlex.join([Path(sys.executable).name] + sys.argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def rate(tok_s) -> str:
    # None: the answer had a single content chunk, so no decode rate can be measured.
    return f"{tok_s:.1f}" if tok_s else "n/a"


def plot(rows: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = [r["T"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(sizes, [r["native_ttft_s"] for r in rows], "o-", label="native (decoder prefill)")
    ax.plot(sizes, [r["bridged_ttft_s"] for r in rows], "s-", label="bridged (hetero prefill)")
    for r in rows:
        if r["bridged_verdict"] != "complete":
            ax.annotate(r["bridged_verdict"], (r["T"], r["bridged_ttft_s"]), fontsize=7)
    ax.set_xlabel("prompt tokens (T)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"cold prompts, {rows[0]['model']}, {rows[0]['machine']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256,512,1024,2048,4096", help="approx. prompt tokens")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--url", help="a running front door (started with --forced-bridges anyone: "
                   "the benchmark forces its routes); default: start one with hetero up")
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--seed", type=int, default=int(time.time()))
    a = p.parse_args()
    rng = random.Random(a.seed)
    proc = None
    url = a.url
    if not url:
        proc, url, *_ = start_stack(a.model)
    try:
        stream(url, fresh_prompt(20, rng), "native", 4)  # warm both legs
        stream(url, fresh_prompt(20, rng), "bridge", 4)
        rows = []
        for size in [int(s) for s in a.sizes.split(",")]:
            words = max(1, int(size / 1.45))  # about 1.45 tokens per list word with this tokenizer
            nat, bri = [], []
            for _ in range(a.repeat):
                nat.append(stream(url, fresh_prompt(words, rng), "native", a.max_tokens))
                bri.append(stream(url, fresh_prompt(words, rng), "bridge", a.max_tokens))
            med = lambda xs, k: statistics.median(x[k] for x in xs)  # noqa: E731
            row = {
                "bench": "cold", "T": bri[-1]["T"], "repeat": a.repeat,
                "native_ttft_s": med(nat, "ttft_s"), "bridged_ttft_s": med(bri, "ttft_s"),
                "native_ttft_runs_s": [x["ttft_s"] for x in nat],
                "bridged_ttft_runs_s": [x["ttft_s"] for x in bri],
                "native_ttft_spread_s": max(x["ttft_s"] for x in nat) - min(x["ttft_s"] for x in nat),
                "bridged_ttft_spread_s": max(x["ttft_s"] for x in bri) - min(x["ttft_s"] for x in bri),
                "native_decode_tok_s": nat[-1]["decode_tok_s"],
                "bridged_decode_tok_s": bri[-1]["decode_tok_s"],
                "native_verdicts": [x["verdict"] for x in nat],
                "bridged_verdicts": [x["verdict"] for x in bri],
                "bridged_verdict": bri[-1]["verdict"], "bytes": bri[-1]["bytes"],
                "bridged_timings_ms": bri[-1]["timings_ms"], "max_tokens": a.max_tokens,
                "model": Path(a.model).name, "machine": platform.node(),
                "cpus": os.cpu_count(), "gpu": gpu_name(),
                "prefill_backend": os.environ.get("HETERO_PREFILL_BACKEND", "cpu"),
                # cuda: "fast" caches agree with the native one within a tolerance, "exact" ones
                # bit for bit (docs/design/prefill-cuda.md); the CPU backend is always exact.
                "prefill_arith": (os.environ.get("HETERO_PREFILL_ARITH", "exact")
                                  if os.environ.get("HETERO_PREFILL_BACKEND") == "cuda"
                                  else "ordered"),
                "revision": git_rev(), "seed": a.seed,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "n": a.repeat, "command": provenance()["command"],
            }
            row["ttft_ratio"] = row["native_ttft_s"] / row["bridged_ttft_s"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        if proc:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cold-{rows[0]['revision']}"
    with open(f"{stem}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    table = ["| T | native TTFT (s) | bridged TTFT (s) | native/bridged | bridged verdicts | "
             "decode tok/s native / bridged |", "|---:|---:|---:|---:|---|---|"]
    for r in rows:
        table.append(f"| {r['T']} | {r['native_ttft_s']:.2f} | {r['bridged_ttft_s']:.2f} | "
                     f"{r['ttft_ratio']:.2f}x | {', '.join(r['bridged_verdicts'])} | "
                     f"{rate(r['native_decode_tok_s'])} / {rate(r['bridged_decode_tok_s'])} |")
    Path(f"{stem}.md").write_text("\n".join(table) + "\n")
    plot(rows, Path(f"{stem}.png"))
    print("\n".join(table))
    print(f"\nwrote {stem}.jsonl, {stem}.md, {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
