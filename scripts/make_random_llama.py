#!/usr/bin/env python3
"""A llama-family checkpoint with seeded random weights, for machines the real weights cannot reach.

The GPU machine gets the default model's config and tokenizer (a few MB) but not its 269 MB of
weights; this writes the rest there: model.safetensors in bf16 with the default model's tensor
names, shapes and file order, filled with seeded random values. `--scale` picks bigger llama
shapes (the tokenizer and vocabulary stay the default model's), so the served stack can be timed
on models the size of real ones. Needs only numpy; the file is written by hand in the
safetensors layout (8-byte header length, JSON header, raw little-endian data).

Random weights make the text meaningless, not the timing or the checks: `hetero verify` compares
the bridged cache and continuation with the decoder's own run on the same checkpoint. The scale
rules follow python/hetero_mlx/tiny.py: norms 1 + N(0, 0.1^2) (so a skipped norm shows), linear
weights N(0, 1/in) (q and k: see QK_SCALE), embeddings N(0, 0.2^2).

usage: python3 scripts/make_random_llama.py --out DIR [--scale 135m|1b|3b|8b] [--seed 0]
           [--tokenizer models/smollm2-135m-instruct] [--layers N --hidden N ...]
           [--rope-theta X] [--rope-scaling JSON] [--max-position-embeddings N]
(e.g. Llama 3.1's rope: --rope-theta 500000 --max-position-embeddings 131072 --rope-scaling
 '{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
 "original_max_position_embeddings": 8192}')
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# Copied when present; config.json is rewritten, never copied.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)

# Shapes (hidden, layers, heads, kv_heads, intermediate). 135m is the default model's own shape;
# the others are the public Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B shapes with this vocab.
SCALES = {
    "135m": None,
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192),
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
}

EMBED_STD = 0.2
NORM_STD = 0.1
# q and k projections 3x the other linears: attention then picks positions instead of averaging
# them, so the continuation follows the prompt; at 1x the random model repeats one token for
# every prompt and the continuation check of `hetero verify` says little.
QK_SCALE = 3.0
BLOCK_ELEMS = 1 << 24  # values generated per step: bounds memory for any tensor size


def shape_config(base: dict, a: argparse.Namespace) -> dict:
    """The base config with the chosen scale and any explicit overrides applied."""
    cfg = dict(base)
    dims = dict(SCALES[a.scale] or {})
    for key in ("hidden", "layers", "heads", "kv_heads", "intermediate"):
        if getattr(a, key) is not None:
            dims[key] = getattr(a, key)
    names = {"hidden": "hidden_size", "layers": "num_hidden_layers",
             "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "intermediate": "intermediate_size"}
    for key, value in dims.items():
        cfg[names[key]] = value
    h, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    # transformers' LlamaConfig (which mlx-lm's load goes through) refuses hidden % heads != 0.
    if h % nh or nh % nkv:
        raise SystemExit(f"hidden {h} must be a multiple of heads {nh}, heads of kv_heads {nkv}")
    if dims:
        cfg["head_dim"] = h // nh
    if a.rope_theta is not None:
        cfg["rope_theta"] = a.rope_theta
    if a.rope_scaling:
        cfg["rope_scaling"] = json.loads(a.rope_scaling)
    if a.max_position_embeddings is not None:
        cfg["max_position_embeddings"] = a.max_position_embeddings
    if cfg.get("model_type") not in ("llama", "mistral"):
        raise SystemExit(f"model_type {cfg.get('model_type')!r}: only the llama layout is written")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise SystemExit("biases are not written; the base config asks for them")
    return cfg


def tensor_plan(cfg: dict) -> list:
    """(name, shape, kind) in the default checkpoint's file order."""
    h, ffn, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    plan = [("model.embed_tokens.weight", (v, h), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        plan += [
            (p + "self_attn.q_proj.weight", (q, h), "qk"),
            (p + "self_attn.k_proj.weight", (kv, h), "qk"),
            (p + "self_attn.v_proj.weight", (kv, h), "linear"),
            (p + "self_attn.o_proj.weight", (h, q), "linear"),
            (p + "mlp.gate_proj.weight", (ffn, h), "linear"),
            (p + "mlp.up_proj.weight", (ffn, h), "linear"),
            (p + "mlp.down_proj.weight", (h, ffn), "linear"),
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
        ]
    plan.append(("model.norm.weight", (h,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        plan.append(("lm_head.weight", (v, h), "linear"))
    return plan


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; inputs here are finite."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def write_tensor(f, rng: np.random.Generator, shape: tuple, kind: str) -> None:
    n = int(np.prod(shape))
    if kind == "norm":
        std, mean = NORM_STD, 1.0
    elif kind == "embed":
        std, mean = EMBED_STD, 0.0
    else:
        std, mean = (QK_SCALE if kind == "qk" else 1.0) / np.sqrt(shape[1]), 0.0
    for start in range(0, n, BLOCK_ELEMS):
        x = rng.standard_normal(min(BLOCK_ELEMS, n - start), dtype=np.float32)
        x *= np.float32(std)
        if mean:
            x += np.float32(mean)
        f.write(to_bf16(x).tobytes())


def write_safetensors(path: Path, plan: list, seed: int) -> int:
    header, offset = {}, 0
    for name, shape, _ in plan:
        nbytes = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    rng = np.random.Generator(np.random.PCG64(seed))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, shape, kind in plan:
            write_tensor(f, rng, shape, kind)
    tmp.rename(path)  # a half-written file never looks like a checkpoint
    return offset


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--tokenizer", type=Path, default=ROOT / "models" / "smollm2-135m-instruct",
                   help="dir with config.json and the tokenizer files (the default model's)")
    p.add_argument("--scale", choices=sorted(SCALES), default="135m",
                   help="135m: the default model's shape; others: llama shapes of that size")
    p.add_argument("--seed", type=int, default=0, help="same seed and shape, same bytes")
    for key in ("hidden", "layers", "heads", "kv_heads", "intermediate"):
        p.add_argument("--" + key.replace("_", "-"), type=int, help="override the scale's value")
    p.add_argument("--rope-theta", type=float, help="override the config's rope_theta")
    p.add_argument("--rope-scaling", help="the config's rope_scaling, as JSON")
    p.add_argument("--max-position-embeddings", type=int)
    p.add_argument("--force", action="store_true", help="rewrite an existing checkpoint")
    a = p.parse_args()

    base = json.loads((a.tokenizer / "config.json").read_text())
    cfg = shape_config(base, a)
    plan = tensor_plan(cfg)
    stamp = {"generator": "scripts/make_random_llama.py", "scale": a.scale, "seed": a.seed,
             "rules": {"embed_std": EMBED_STD, "norm_std": NORM_STD, "qk_scale": QK_SCALE},
             "config": cfg, "tensors": len(plan)}
    stamp_path = a.out / "random_checkpoint.json"
    if (not a.force and stamp_path.exists() and (a.out / "model.safetensors").exists()
            and json.loads(stamp_path.read_text()) == stamp):
        print(f"{a.out}: up to date ({a.scale}, seed {a.seed})")
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    stamp_path.unlink(missing_ok=True)  # no stamp while the files disagree
    for name in TOKENIZER_FILES:
        if (a.tokenizer / name).exists():
            shutil.copyfile(a.tokenizer / name, a.out / name)
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    t0 = time.time()
    nbytes = write_safetensors(a.out / "model.safetensors", plan, a.seed)
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    print(f"{a.out}: {a.scale}, {nbytes // 2 / 1e6:.0f}M parameters, "
          f"{nbytes / 2**20:.0f} MiB bf16, {len(plan)} tensors, seed {a.seed}, "
          f"{time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
