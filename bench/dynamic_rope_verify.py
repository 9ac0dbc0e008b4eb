#!/usr/bin/env python3
"""hetero bench dynamic-rope-verify: `hetero verify` past a dynamic rope's reach.

A tiny random llama with mlx-lm's `dynamic` rope (factor 3) over max_position_embeddings 1,500
(tokenizer: the default model's), and a ~3,800-token prompt three ways: one user message (the
server's batch path), a system message before it (the batch path cut at the segment), and with
"seed" (the single path). Each row's key is roped with the base of the decoder call that makes
it; the report says whether every cache array is the decoder's bit for bit. Writes JSON lines to
bench/results/verify-dynamic-rope-<rev>.jsonl.

usage: python3 bench/dynamic_rope_verify.py [--tokenizer DIR] [--words 3400]
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--words", type=int, default=3400)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hetero-dynamic-"))
    model = work / "model"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    # Factor 3 at theta 10,000: the first call's base (its end 2,048) differs between MLX
    # float32 and Python doubles by enough to change its inverse frequencies, so a program that
    # took the wrong path would miss bits.
    scaling = json.dumps({"type": "dynamic", "factor": 3.0})
    subprocess.run([sys.executable, "-m", "hetero_mlx", "tiny-llama", "--tokenizer",
                    args.tokenizer, "--out", str(model), "--seed", "31", "--layers", "2",
                    "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                    "--intermediate", "128", "--rope-theta", "10000", "--rope-scaling", scaling,
                    "--max-position-embeddings", "1500"],
                   check=True, env=env)
    user = {"role": "user", "content": text("dyn-verify", args.words)}
    system = {"role": "system", "content": "You are terse. " * 40}
    cases = {"batch": {"messages": [user]}, "batch-with-system": {"messages": [system, user]},
             "single": {"messages": [user], "seed": 5}}
    rev = git_rev()
    out = ROOT / "bench" / "results" / f"verify-dynamic-rope-{rev}.jsonl"
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
            row = {"bench": "dynamic_rope_verify", "rev": rev, "case": name, "rc": r.returncode,
                   "mpe": 1500, "report": report}
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
