#!/usr/bin/env python
"""Past a sliding window, do the decoder's one-token calls give the rows the engine computes?

A tiny random llama (3 layers, layer 1 sliding over 300 positions, the default model's
tokenizer) prefilled by mlx-lm itself in the calls given, against `hetero prefill` (the CPU
engine: every query sums its window in temporal order). Multi-token calls sum the window in
temporal order too; a one-token call past the window sums it in its RotatingKVCache's slot
order (newest rows first). Prints, per layer, how many of the decoder's rows differ.
Run from the repository root after `make build`:

    PYTHONPATH=python .venv/bin/python docs/findings/sliding_rotated_sum_check.py
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from hetero_mlx.export import export
from hetero_mlx.llama import cache_arrays
from hetero_mlx.tiny import TinyShape, make_tiny_llama

CASES = {  # name: the decoder's calls
    "calls of 2,048 and 452": [2048, 452],
    "2,048 then 600 one-token calls (decode steps)": [2048] + [1] * 600,
}


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="sliding-rotated-"))
    shape = TinyShape("llama", 3, 64, 4, 2, 16, 128, sliding_window=300)
    make_tiny_llama(Path("models/smollm2-135m-instruct"), root / "hf", 29, shape)
    export(str(root / "hf"), root / "export")
    model, _ = load(str(root / "hf"))
    differs = {}
    for name, calls in CASES.items():
        T = sum(calls)
        ids = np.random.default_rng([29, T]).integers(0, model.args.vocab_size, size=T).tolist()
        cache, pos = make_prompt_cache(model), 0
        for n in calls:
            model(mx.array(ids[pos : pos + n])[None], cache=cache)
            mx.eval([c.state for c in cache])
            pos += n
        want = cache_arrays(cache, T)
        (root / "ids.json").write_text(json.dumps(ids))
        got_path = root / "got.safetensors"
        # The engine's rows, which are the same for any cut into calls of more than one token:
        # named as one call (the decoder's real ones here include the one-token calls measured).
        subprocess.run(["build/hetero", "prefill", "--model", str(root / "hf"), "--weights",
                        str(root / "export"), "--ids-file", str(root / "ids.json"),
                        "--decoder-calls", str(T), "--out", str(got_path)],
                       check=True, capture_output=True)
        got = mx.load(str(got_path))
        for layer in range(shape.layers):
            rows = set()
            for kind in ("keys", "values"):
                w = np.array(want[f"layers.{layer}.{kind}"].view(mx.uint16))
                g = np.array(got[f"layers.{layer}.{kind}"].view(mx.uint16))[:, -w.shape[1] :, :]
                rows |= set((np.argwhere(g != w)[:, 1] + T - w.shape[1]).tolist())
            differs[(name, layer)] = len(rows)
            print(f"{name}: layer {layer}: {len(rows)} of the decoder's rows differ "
                  f"{sorted(rows)[:6]}")
    return 0 if all(v == 0 for (n, _), v in differs.items() if n == "calls of 2,048 and 452") else 1


if __name__ == "__main__":
    sys.exit(main())
