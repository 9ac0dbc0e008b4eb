#!/usr/bin/env python3
"""Run `hetero verify` on every chat prompt in prompts/chat/ and record each report.

Each run bridges the prompt into the decoder and compares against the decoder's native run:
every cache array, the greedy continuation, the decoder's own prompt-token accounting.
Writes bench/results/verify-<revision>.jsonl and prints a markdown table.

usage: python bench/verify_prompts.py [--chunks 7,512,13,100,1000] [--max-tokens 64]
       python bench/verify_prompts.py --model models/dsv4-tiny/native \
           --prefill-model models/dsv4-tiny/fp8 --max-tokens 32 --tag dsv4
       python bench/verify_prompts.py --quantize 4 --tag q4   # mlx-lm's own 4-bit conversion
       python bench/verify_prompts.py --quantize 4,32,mxfp4 --tag mxfp4

--quantize BITS[,GROUP[,MODE]] first converts --model with mlx-lm's converter (`mlx_lm.convert
-q`, affine, group 64 unless given; MODE mxfp4 or mxfp8 with group 32) into out/quantized/ (kept;
converted once) and verifies that: the decoder and the prefill host then both run the quantized
checkpoint.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", default="7,512,13,100,1000", help="one chunk size per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    p.add_argument("--prefill-model", default="", help="the prefill host's checkpoint")
    p.add_argument("--tag", default="", help="results file: verify-[<tag>-]<revision>.jsonl")
    p.add_argument("--quantize", default="",
                   help="BITS[,GROUP[,MODE]]: verify mlx-lm's conversion")
    p.add_argument("--prompts", default="", help="only these, by name prefix: e.g. 01,02,03")
    p.add_argument("--verify-args", default="",
                   help="more `hetero verify` options, e.g. \"--timeout-ms 10800000\" where the "
                        "decoder's native run of a prompt takes longer than the default 30 min")
    p.add_argument("--hetero", default=str(ROOT / "build" / "hetero"),
                   help="the hetero binary (a copy in a sibling of build/, e.g. build-verify/, keeps a long "
                        "run apart from rebuilds; it finds python/ beside its parent)")
    a = p.parse_args()
    if a.quantize:
        given = a.quantize.split(",")
        bits, group, mode = given + ["64", "affine"][len(given) - 1:] if len(given) < 3 else given[:3]
        bits, group = int(bits), int(group)
        name = f"{Path(a.model).name}-q{bits}-g{group}" + ("" if mode == "affine" else f"-{mode}")
        out = ROOT / "out" / "quantized" / name
        if not (out / "config.json").exists():
            from mlx_lm import convert  # the decoder's own converter, from the pinned venv

            convert(a.model, str(out), quantize=True, q_bits=bits, q_group_size=group,
                    q_mode=mode)
        a.model = str(out)
    prompts = sorted((ROOT / "prompts" / "chat").glob("*.json"))
    if a.prompts:
        prompts = [p for p in prompts if any(p.name.startswith(w) for w in a.prompts.split(","))]
    chunks = [int(c) for c in a.chunks.split(",")]
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    rows = []
    for prompt, chunk in zip(prompts, chunks * len(prompts)):
        argv = [a.hetero, "verify", "--model", a.model,
                "--prompt-file", str(prompt), "--chunk", str(chunk),
                "--max-tokens", str(a.max_tokens), "--python", sys.executable]
        if a.prefill_model:
            argv += ["--prefill-model", a.prefill_model]
        argv += a.verify_args.split()
        proc = subprocess.run(argv, capture_output=True, text=True)
        r = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
        if "arrays" not in r:  # verify failed before comparing: say why, keep nothing
            print(f"{prompt.name}: verify failed (rc {proc.returncode}): "
                  f"{(proc.stdout + proc.stderr)[-2000:]}", file=sys.stderr)
            return 1
        r["arrays"].pop("per_layer", None)
        r.update(prompt=prompt.name, rc=proc.returncode, revision=rev)
        # What the line needs to stand alone (issue 53): the machine, its GPU, the command.
        from cold import provenance
        r.update({k: v for k, v in provenance().items() if k not in ("rev", "prefill_backend",
                                                                      "prefill_arith")},
                 verify_command=" ".join(argv))
        rows.append(r)
        name = f"verify-{a.tag}-{rev}.jsonl" if a.tag else f"verify-{rev}.jsonl"
        with open(ROOT / "bench" / "results" / name, "a") as f:
            f.write(json.dumps(r) + "\n")
    print("| prompt | T | chunk | arrays bit-exact | continuation | decoder processed | "
          "native request (s) | bridge prefill (s) | pass |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---|")
    for r in rows:
        acc = r["decoder_accounting"]["bridged"]
        print(f"| {r['prompt']} | {r['T']} | {r['chunk']} | "
              f"{r['arrays']['bit_exact']}/{r['arrays']['count']} | "
              f"{'identical' if r['continuation']['identical'] else 'differs at ' + str(r['continuation']['diverges_at'])} | "
              f"{acc['processed']} | {r['timings_ms']['native_request'] / 1000:.1f} | "
              f"{r['timings_ms']['bridge_prefill'] / 1000:.1f} | {r['pass']} |")
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
