#!/usr/bin/env python3
"""hetero bench past-reach-cuda: the CUDA engine's llama caches where they depend on more than the
rows' positions, against the decoder's own.

Tiny random llamas (3 layers, head_dim 64 as the CUDA attention needs; the default model's
tokenizer), each prefilled here by mlx-lm itself in its server's steps of 2,048 (in process: the
cache's offset is a Python int, so a dynamic rope takes the server's single path), then by
`hetero prefill --backend cuda` on the GPU machine with the same calls:

  sliding   layer 1 slides over 300 positions; T 1,000 and 2,500
  dynamic   a `dynamic` rope (factor 3, theta 10,000) over max_position_embeddings 1,500, so
            each call past it ropes its rows with its own base; T 3,000 and 4,500

Three steps:

  prep     here: each variant's model, export, ids and decoder calls into DIR/<variant>/ (they
           travel), the decoder's own caches into DIR/<variant>/truth/ (ignored: they stay)
  device   on the GPU machine (device tool, carry .devkit/lib and build/hetero; DIR a folder
           that travels, e.g. devrun/): bench/gpu/past_reach_device.sh DIR
  compare  here: each result (and this machine's CPU engine) against the truth, a sliding
           layer's window as the decoder holds it; JSON lines to
           bench/results/past-reach-cuda-<rev>.jsonl

usage: python3 bench/past_reach_cuda.py prep --dir devrun
       python3 bench/past_reach_cuda.py compare --dir devrun --got /work/.device/N
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from cold import ROOT, git_rev

sys.path.insert(0, str(ROOT / "python"))

STEP = 2048  # mlx-lm server's prefill_step_size
VARIANTS = {
    "sliding": {"shape": {"sliding_window": 300}, "lengths": (1000, 2500)},
    "dynamic": {"shape": {"rope_theta": 10000.0, "max_position_embeddings": 1500,
                          "rope_scaling": json.dumps({"type": "dynamic", "factor": 3.0})},
                "lengths": (3000, 4500)},
}


def calls_of(T: int) -> list:
    return [min(STEP, T - s) for s in range(0, T, STEP)]


def prep(d: Path) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from hetero_mlx.export import export
    from hetero_mlx.llama import cache_arrays
    from hetero_mlx.tiny import TinyShape, make_tiny_llama

    for name, v in VARIANTS.items():
        vd = d / name
        shape = TinyShape("llama", 3, 128, 2, 1, 64, 256, **v["shape"])
        make_tiny_llama(ROOT / "models" / "smollm2-135m-instruct", vd / "hf", 29, shape)
        export(str(vd / "hf"), vd / "export")
        model, _ = load(str(vd / "hf"))
        (vd / "truth").mkdir(parents=True, exist_ok=True)
        (vd / ".gitignore").write_text("truth/\n")
        for T in v["lengths"]:
            ids = np.random.default_rng([29, T]).integers(0, model.args.vocab_size, size=T)
            cache, pos = make_prompt_cache(model), 0
            for n in calls_of(T):
                model(mx.array(ids[pos : pos + n].tolist())[None], cache=cache)
                mx.eval([c.state for c in cache])
                pos += n
            (vd / f"ids-{T}.json").write_text(json.dumps(ids.tolist()))
            (vd / f"calls-{T}.txt").write_text(",".join(map(str, calls_of(T))) + "\n")
            mx.save_safetensors(str(vd / "truth" / f"native-{T}.safetensors"),
                                cache_arrays(cache, T))
    print(f"prepared {d}")


def judge(want: dict, got: dict) -> dict:
    import mlx.core as mx
    import numpy as np

    equal = total = exact = 0
    num = den = 0.0
    for name, w in want.items():  # a sliding layer: its last rows, as the decoder holds them
        if got[name].shape[1] < w.shape[1]:
            raise ValueError(f"{name}: {got[name].shape[1]} rows, the decoder holds {w.shape[1]}")
        g = got[name][:, got[name].shape[1] - w.shape[1] :, :]
        gb, wb = np.array(g.view(mx.uint16)), np.array(w.view(mx.uint16))
        equal, total = equal + int((gb == wb).sum()), total + gb.size
        exact += int(np.array_equal(gb, wb))
        gf, wf = np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
        num, den = num + float(((gf - wf) ** 2).sum()), den + float((wf**2).sum())
    return {"arrays_bit_exact": exact, "arrays": len(want), "equal_fraction": equal / total,
            "rel_rms": (num / den) ** 0.5}


def compare(d: Path, got_dir: Path) -> int:
    import mlx.core as mx

    rev = git_rev()
    out = ROOT / "bench" / "results" / f"past-reach-cuda-{rev}.jsonl"
    ok = True
    with out.open("w") as f:
        for name, v in VARIANTS.items():
            vd = d / name
            for T in v["lengths"]:
                want = mx.load(str(vd / "truth" / f"native-{T}.safetensors"))
                cpu = vd / "truth" / f"cpu-{T}.safetensors"
                subprocess.run([str(ROOT / "build" / "hetero"), "prefill", "--model",
                                str(vd / "hf"), "--weights", str(vd / "export"), "--ids-file",
                                str(vd / f"ids-{T}.json"), "--decoder-calls",
                                ",".join(map(str, calls_of(T))), "--decoder-path", "single",
                                "--out", str(cpu)], check=True, capture_output=True)
                for source, path in (("cpu", cpu),
                                     ("cuda-exact", got_dir / f"{name}-exact-{T}.safetensors"),
                                     ("cuda-fast", got_dir / f"{name}-fast-{T}.safetensors")):
                    if not path.exists():
                        row = {"missing": str(path)}
                        ok = False
                    else:
                        row = judge(want, mx.load(str(path)))
                        ok &= source == "cuda-fast" or row["arrays_bit_exact"] == row["arrays"]
                    row = {"bench": "past_reach_cuda", "rev": rev, "variant": name, "T": T,
                           "calls": calls_of(T), "source": source, **row}
                    f.write(json.dumps(row) + "\n")
                    print(json.dumps(row))
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
