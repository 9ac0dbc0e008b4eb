#!/usr/bin/env python3
"""hetero bench memory: peak resident memory of each process of a bridge, against the cache.

Starts `hetero up` (the front door in its process, the decoder and the prefill host as its
children), then for each size sends one fresh bridged request (`X-PD-Bridge-Mode: bridge`) and
reads each process's peak RSS over that request (VmHWM, reset before it through
/proc/PID/clear_refs); then a native request of the same size, for the decoder's own peak. The cache's size is the decoder's own (the verdict's wire bytes are within
a frame header of it). A process that holds one copy of the cache grows by about 1x of it; two
copies, 2x. Linux only (procfs). Writes JSON lines to bench/results/memory-<rev>.jsonl.

usage: python3 bench/memory.py [--sizes 2048,8000] [--model DIR] [--no-native]
"""

import argparse
import json
import platform
import random
import signal
import sys
import time
from pathlib import Path

from cold import ROOT, fresh_prompt, git_rev, provenance, start_stack, stream


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def processes(up_pid: int) -> dict:
    """{role: pid} of the stack: the front (hetero up itself), the decoder and the prefill host."""
    roles = {"front": up_pid}
    children = Path(f"/proc/{up_pid}/task/{up_pid}/children").read_text().split()
    for c in map(int, children):
        cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "hetero_mlx" in cmd:
            roles["decoder"] = c
        elif " prefill " in cmd:
            roles["prefill"] = c
    if set(roles) != {"front", "decoder", "prefill"}:
        raise SystemExit(f"could not find the stack's processes: {roles}")
    return roles


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2048,8000", help="approx. prompt tokens")
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--no-native", action="store_true",
                   help="bridged requests only (the decoder's own prefill of a long prompt on a CPU "
                        "takes long)")
    a = p.parse_args()
    rng = random.Random(a.seed)
    proc, url, *_ = start_stack(a.model)
    rows = []
    try:
        roles = processes(proc.pid)
        stream(url, fresh_prompt(20, rng), "bridge", 4)  # warm
        for size in [int(s) for s in a.sizes.split(",")]:
            before = {}
            for role, pid in roles.items():
                reset_peak(pid)
                before[role] = status_kib(pid, "VmRSS")
            r = stream(url, fresh_prompt(max(1, int(size / 1.45)), rng), "bridge", 4)
            cache = r["bytes"]
            after = {role: status_kib(pid, "VmHWM") * 1024 for role, pid in roles.items()}
            # The same size, native: what the decoder itself holds for a prompt of this length.
            native_growth = None
            if not a.no_native:
                decoder = roles["decoder"]
                reset_peak(decoder)
                native_before = status_kib(decoder, "VmRSS") * 1024
                stream(url, fresh_prompt(max(1, int(size / 1.45)), rng), "native", 4)
                native_growth = status_kib(decoder, "VmHWM") * 1024 - native_before
            row = {"bench": "memory", "T": r["T"], "verdict": r["verdict"], "cache_bytes": cache,
                   "model": Path(a.model).name, "revision": git_rev(), "machine": platform.node(),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "n": 1, **{k: v for k, v in provenance().items() if k not in ("rev", "date")}}
            row["decoder_native_growth_over_cache"] = (
                None if native_growth is None else round(native_growth / cache, 2))
            row["bridged_timings_ms"], row["B"] = r["timings_ms"], r["B"]
            # The decoder's own word: the prompt tokens it reused, and that it went on to answer.
            for k in ("confirmed", "cached_tokens", "prompt_tokens", "chunks_out"):
                row[k] = r[k]
            row["ttft_s"] = r["ttft_s"]
            for role, pid in roles.items():
                peak = after[role]
                row[f"{role}_rss_before"] = before[role] * 1024
                row[f"{role}_peak_rss"] = peak
                row[f"{role}_growth_over_cache"] = round((peak - before[role] * 1024) / cache, 2)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"memory-{rows[0]['revision']}.jsonl"
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("| T | cache | verdict | front | decoder | prefill host | decoder, native request |\n"
          "|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['T']} | {r['cache_bytes'] / 2**20:.0f} MiB | {r['verdict']} | "
              + " | ".join(f"{r[k + '_growth_over_cache']:.2f}x" for k in
                           ("front", "decoder", "prefill"))
              + " | " + ("-" if r["decoder_native_growth_over_cache"] is None
                         else f"{r['decoder_native_growth_over_cache']:.2f}x") + " |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
