#!/usr/bin/env python3
"""CPU prefill, side by side in one run: the decoder's own prefill (mlx-lm on MLX's CPU backend,
the way its server prefills: make_prompt_cache, steps of prefill_step_size) against `hetero
prefill` (our CPU engine with the tap, the llama cache program, the wire and the verifier, offline)
on the same token ids. Both legs are warmed on a short prompt first; each size runs --repeat
times, alternating legs, and the median and spread are reported. With --refcheck the two caches
are compared with `hetero compare` (bit-exact). Writes JSON lines and prints a markdown table.

On a CPU machine quote the ratio, not absolute times (STYLE.md).

usage: python bench/prefill_cpu.py --model models/smollm2-135m-instruct \
           --prompt-file prompts/chat/05-long-license.json --sizes 512,2048,4096 --refcheck
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))


def mlx_prefill(model, ids, step):
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    for s in range(0, len(ids), step):
        model(mx.array(ids[s:s + step])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - t0, cache


def hetero_prefill(hetero, model_dir, weights, ids, chunk, out=None, gemm="ordered"):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    cmd = [str(hetero), "prefill", "--model", str(model_dir), "--weights", str(weights),
           "--ids-file", f.name, "--chunk", str(chunk), "--gemm", gemm]
    if out:
        cmd += ["--out", str(out)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def git_rev():
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                       text=True)
    return r.stdout.strip() or "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--prompt-file", required=True, help="JSON chat request or plain text")
    p.add_argument("--sizes", default="512,2048,4096", help="prompt prefixes to time (tokens)")
    p.add_argument("--chunk", type=int, default=512, help="hetero prefill chunk")
    p.add_argument("--step", type=int, default=2048, help="mlx-lm prefill_step_size")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--refcheck", action="store_true")
    p.add_argument("--blas", action="store_true", help="also time --gemm blas (not bit-exact)")
    p.add_argument("--hetero", default=str(ROOT / "build" / "hetero"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "prefill_cpu.jsonl"))
    a = p.parse_args()

    from hetero_mlx.export import export

    model, tok = load(a.model)
    text = Path(a.prompt_file).read_text()
    try:
        req = json.loads(text)
        ids = tok.apply_chat_template(req["messages"], add_generation_prompt=True)
    except (json.JSONDecodeError, KeyError, TypeError):
        ids = tok.encode(text)
    work = Path(tempfile.mkdtemp(prefix="hetero-bench-"))
    weights = work / "decoder-weights"
    export(a.model, weights)

    # Warm both legs.
    mlx_prefill(model, ids[:64], a.step)
    hetero_prefill(a.hetero, a.model, weights, ids[:64], a.chunk)

    rows = []
    for n in [int(s) for s in a.sizes.split(",")]:
        if n > len(ids):
            print(f"skip {n}: prompt has {len(ids)} tokens", file=sys.stderr)
            continue
        sub = ids[:n]
        t_mlx, t_het, t_blas = [], [], []
        for r in range(a.repeat):
            t, cache = mlx_prefill(model, sub, a.step)
            t_mlx.append(t)
            out = work / f"hetero-{n}.safetensors" if (a.refcheck and r == 0) else None
            t_het.append(hetero_prefill(a.hetero, a.model, weights, sub, a.chunk, out))
            if a.blas:
                t_blas.append(hetero_prefill(a.hetero, a.model, weights, sub, a.chunk,
                                             gemm="blas"))
        row = {
            "bench": "prefill_cpu", "tokens": n, "chunk": a.chunk, "mlx_step": a.step,
            "mlx_s": statistics.median(t_mlx), "hetero_s": statistics.median(t_het),
            "mlx_spread_s": max(t_mlx) - min(t_mlx), "hetero_spread_s": max(t_het) - min(t_het),
            "mlx_runs_s": t_mlx, "hetero_runs_s": t_het, "n": a.repeat,
            "gpu": "none", "arith": "ordered (exact; --gemm blas: OpenBLAS order, not exact)",
            "command": " ".join([Path(sys.executable).name] + sys.argv),
            "repeat": a.repeat, "model": Path(a.model).name, "machine": platform.node(),
            "cpu_count": __import__("os").cpu_count(), "revision": git_rev(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        row["speedup"] = row["mlx_s"] / row["hetero_s"]
        if t_blas:
            row["hetero_blas_s"] = statistics.median(t_blas)
        if a.refcheck:
            native = {}
            for i, c in enumerate(cache):
                k, v = c.state[:2]
                native[f"layers.{i}.keys"] = k[0, :, :n]
                native[f"layers.{i}.values"] = v[0, :, :n]
            ref = work / f"native-{n}.safetensors"
            mx.save_safetensors(str(ref), native)
            cmp = subprocess.run([a.hetero, "compare", str(out), str(ref)], capture_output=True,
                                 text=True)
            row["refcheck"] = json.loads(cmp.stdout)["pass"] if cmp.stdout else False
        rows.append(row)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), file=sys.stderr)

    print("| tokens | mlx-lm prefill (s) | hetero prefill + program (s) | ratio | bit-exact "
          "| hetero --gemm blas (s) |")
    print("|---:|---:|---:|---:|:---:|---:|")
    for r in rows:
        blas = f"{r['hetero_blas_s']:.2f}" if "hetero_blas_s" in r else "n/a"
        print(f"| {r['tokens']} | {r['mlx_s']:.2f} | {r['hetero_s']:.2f} | "
              f"{r['speedup']:.2f}x | {r.get('refcheck', 'n/a')} | {blas} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
