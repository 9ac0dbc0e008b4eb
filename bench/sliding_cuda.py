#!/usr/bin/env python3
"""hetero bench sliding-cuda: the CUDA engine's caches past a sliding window, against the decoder.

A tiny random llama (3 layers, head_dim 64 as the CUDA attention needs, layer 1 sliding over 300
positions; the default model's tokenizer) and prompts of 1,000 and 2,500 tokens, in three steps:

  prep     here: the model, its export, the ids, and the decoder's own caches (mlx-lm prefilling
           in its server's steps of 2,048) into DIR (the model and ids travel to the GPU machine;
           the truths stay in DIR/truth, which is ignored)
  device   on the GPU machine, from the repository root (device tool: carry .devkit/lib and
           build/hetero; DIR must be a folder that travels, e.g. devrun/):
             source bench/gpu/devkit_libs.sh; devkit_libs /tmp/hetero-lib build/hetero
             for T in 1000 2500; do for a in exact fast; do build/hetero prefill --backend cuda \\
               --arith $a --model DIR/hf --weights DIR/export --ids-file DIR/ids-$T.json \\
               --out $OUT/cuda-$a-$T.safetensors; done; done
  compare  here: each of those (and this machine's CPU engine) against the truth, the sliding
           layer's window as the decoder holds it; JSON lines to
           bench/results/sliding-window-cuda-<rev>.jsonl

usage: python3 bench/sliding_cuda.py prep --dir devrun
       python3 bench/sliding_cuda.py compare --dir devrun --got /work/.device/N
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from cold import ROOT, git_rev

sys.path.insert(0, str(ROOT / "python"))

LENGTHS = (1000, 2500)
STEP = 2048  # mlx-lm server's prefill_step_size


def prep(d: Path) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from hetero_mlx.export import export
    from hetero_mlx.llama import cache_arrays
    from hetero_mlx.tiny import TinyShape, make_tiny_llama

    shape = TinyShape("llama", 3, 128, 2, 1, 64, 256, sliding_window=300)
    make_tiny_llama(ROOT / "models" / "smollm2-135m-instruct", d / "hf", 29, shape)
    export(str(d / "hf"), d / "export")
    model, _ = load(str(d / "hf"))
    (d / "truth").mkdir(parents=True, exist_ok=True)
    (d / ".gitignore").write_text("truth/\n")
    for T in LENGTHS:
        ids = np.random.default_rng([29, T]).integers(0, model.args.vocab_size, size=T).tolist()
        cache = make_prompt_cache(model)
        for s in range(0, T, STEP):
            model(mx.array(ids[s : s + STEP])[None], cache=cache)
            mx.eval([c.state for c in cache])
        (d / f"ids-{T}.json").write_text(json.dumps(ids))
        mx.save_safetensors(str(d / "truth" / f"native-{T}.safetensors"), cache_arrays(cache, T))
    print(f"prepared {d}")


def compare(d: Path, got_dir: Path) -> int:
    import mlx.core as mx
    import numpy as np

    rev = git_rev()
    out = ROOT / "bench" / "results" / f"sliding-window-cuda-{rev}.jsonl"
    ok = True
    with out.open("w") as f:
        for T in LENGTHS:
            want_path = d / "truth" / f"native-{T}.safetensors"
            want = mx.load(str(want_path))
            cpu = d / "truth" / f"cpu-{T}.safetensors"
            subprocess.run([str(ROOT / "build" / "hetero"), "prefill", "--model", str(d / "hf"),
                            "--weights", str(d / "export"), "--ids-file",
                            str(d / f"ids-{T}.json"), "--out", str(cpu)],
                           check=True, capture_output=True)
            for source, path in (("cpu", cpu), ("cuda-exact", got_dir / f"cuda-exact-{T}.safetensors"),
                                 ("cuda-fast", got_dir / f"cuda-fast-{T}.safetensors")):
                got = mx.load(str(path))
                equal = total = 0
                num = den = 0.0
                exact = 0
                for name, w in want.items():  # a sliding layer: the last rows, as it holds them
                    g = got[name][:, got[name].shape[1] - w.shape[1] :, :]
                    gb, wb = np.array(g.view(mx.uint16)), np.array(w.view(mx.uint16))
                    equal, total = equal + int((gb == wb).sum()), total + gb.size
                    exact += int(np.array_equal(gb, wb))
                    gf, wf = np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
                    num, den = num + float(((gf - wf) ** 2).sum()), den + float((wf**2).sum())
                row = {"bench": "sliding_cuda", "rev": rev, "T": T, "window": 300,
                       "source": source, "arrays_bit_exact": exact, "arrays": len(want),
                       "equal_fraction": equal / total, "rel_rms": (num / den) ** 0.5}
                f.write(json.dumps(row) + "\n")
                print(json.dumps(row))
                if source != "cuda-fast":
                    ok &= exact == len(want)
    print(f"wrote {out}")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("prep", "compare"))
    p.add_argument("--dir", type=Path, default=ROOT / "devrun")
    p.add_argument("--got", type=Path, help="compare: the folder the device run's files came to")
    args = p.parse_args()
    if args.step == "prep":
        prep(args.dir)
        return 0
    if not args.got:
        p.error("compare needs --got")
    return compare(args.dir, args.got)


if __name__ == "__main__":
    sys.exit(main())
