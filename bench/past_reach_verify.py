#!/usr/bin/env python3
"""hetero bench past-reach-verify: `hetero verify` where a llama's cache depends on more than
its rows' positions.

Tiny random llamas (tokenizer: the default model's) and a ~3,800-token prompt, each written to
bench/results/verify-<variant>-<rev>.jsonl with whether every cache array is the decoder's bit for
bit and the continuation identical:

- dynamic: mlx-lm's `dynamic` rope (factor 3) over max_position_embeddings 1,500, three ways:
  one user message (the server's batch path), a system message before it (the batch path cut at
  the segment), and with "seed" (the single path). Each row's key is roped with the base of the
  decoder call that makes it.
- sliding: a Mistral-style model whose layer 1 of 3 attends over its last 1,500 positions, with
  and without a system message (the batch path; the single path keeps no entry at B to compare
  with past the window). The sliding layer's cache is its window.

usage: python3 bench/past_reach_verify.py [--variant dynamic|sliding] [--tokenizer DIR]
       [--words 3400]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from cold import ROOT, git_rev

sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "tests" / "py"))
from frontstack import text  # noqa: E402  (the tests' deterministic filler)


VARIANTS = {
    # Factor 3 at theta 10,000: the first call's base (its end 2,048) differs between MLX
    # float32 and Python doubles by enough to change its inverse frequencies, so a program that
    # took the wrong path would miss bits.
    "dynamic": {
        "model": ["--layers", "2", "--rope-theta", "10000", "--rope-scaling",
                  json.dumps({"type": "dynamic", "factor": 3.0}),
                  "--max-position-embeddings", "1500"],
        "words_key": "dyn-verify", "cases": ("batch", "batch-with-system", "single"),
        "out": "verify-dynamic-rope", "reach": {"mpe": 1500}},
    # Layer 1 slides (TinyShape: the odd layers); layer 2's rows show what it computed.
    "sliding": {
        "model": ["--model-type", "mistral", "--layers", "3", "--no-tie",
                  "--sliding-window", "1500"],
        "words_key": "slide-verify", "cases": ("batch", "batch-with-system"),
        "out": "verify-sliding-window", "reach": {"sliding_window": 1500}},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--words", type=int, default=3400)
    p.add_argument("--variant", choices=sorted(VARIANTS), default="dynamic")
    args = p.parse_args()
    variant = VARIANTS[args.variant]
    work = Path(tempfile.mkdtemp(prefix=f"hetero-{args.variant}-"))
    model = work / "model"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    subprocess.run([sys.executable, "-m", "hetero_mlx", "tiny-llama", "--tokenizer",
                    args.tokenizer, "--out", str(model), "--seed", "31", "--hidden", "64",
                    "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--intermediate",
                    "128"] + variant["model"], check=True, env=env)
    user = {"role": "user", "content": text(variant["words_key"], args.words)}
    system = {"role": "system", "content": "You are terse. " * 40}
    cases = {"batch": {"messages": [user]}, "batch-with-system": {"messages": [system, user]},
             "single": {"messages": [user], "seed": 5}}
    cases = {k: cases[k] for k in variant["cases"]}
    rev = git_rev()
    out = ROOT / "bench" / "results" / f"{variant['out']}-{rev}.jsonl"
    ok = True
    with out.open("w") as f:
        for name, request in cases.items():
            prompt = work / f"{name}.json"
            prompt.write_text(json.dumps(request))
            r = subprocess.run([str(ROOT / "build" / "hetero"), "verify", "--model", str(model),
                                "--prompt-file", str(prompt), "--max-tokens", "16",
                                "--python", sys.executable, "--work-dir", str(work / name)],
                               capture_output=True, text=True, env=env)
            report = json.loads(r.stdout)
            report.get("arrays", {}).pop("per_layer", None)
            row = {"bench": "past_reach_verify", "variant": args.variant, "rev": rev,
                   "case": name, "rc": r.returncode, **variant["reach"], "report": report}
            f.write(json.dumps(row) + "\n")
            a = report.get("arrays", {})
            print(f"{name}: T={report.get('T')} pass={report.get('pass')} arrays "
                  f"{a.get('bit_exact')}/{a.get('count')} max_ulp={a.get('max_ulp')} continuation "
                  f"identical={report.get('continuation', {}).get('identical')}", flush=True)
            ok &= r.returncode == 0 and bool(report.get("pass"))
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
