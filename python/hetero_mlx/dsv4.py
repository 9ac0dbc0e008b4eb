"""The DeepSeek-V4 family port, decoder side (mlx-vlm 0.7.10's `deepseek_v4`).

Describe and fingerprint the loaded model, export the weights the cache program needs, build
the decoder's own cache objects from store arrays, read them back out, and run the decoder over
a prompt with a chosen call schedule while recording each layer's attention input (the truth
the exactness tests compare against).

Store and dump arrays, per layer i (B = 1 kept, as the decoder holds them):
  layers.{i}.window          bf16 [1, 1, S, head_dim]  the rotating window, in slot order
  layers.{i}.pool.buf_kv     bf16 [1, rem, out_dim]    ratio > 0: the incomplete window's rows
  layers.{i}.pool.buf_gate   bf16 [1, rem, out_dim]
  layers.{i}.pool.pooled     bf16 [1, P, head_dim]     compressed rows
  layers.{i}.index.*         the same for the ratio-4 indexer's compressor (index_head_dim)
plus one integer, the window's slot index (`_idx`), the same for every layer.
"""

import hashlib
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .llama import dtype_name, quantization
from .quantized import linear_weights

FAMILY = "deepseek_v4"
MODEL_TYPES = ("deepseek_v4",)
# Calls of 2..8 tokens run one token at a time in the decoder (mlx_vlm.models.linear).
TOKENWISE_MAX = 8


def language_model(model: nn.Module) -> nn.Module:
    """The text model inside mlx-vlm's wrapper (or the model itself)."""
    return getattr(model, "language_model", model)


def rope_params(args: Any) -> Dict[str, Any]:
    scaling = getattr(args, "rope_scaling", None)
    return {
        "qk_rope_head_dim": int(args.qk_rope_head_dim),
        "rope_theta": float(args.rope_theta),
        "compress_rope_theta": float(args.compress_rope_theta),
        "rope_scaling": dict(scaling) if scaling else None,
    }


def fingerprint(desc: Dict[str, Any]) -> str:
    """Identity both ends must agree on: every input of the cache program's arithmetic, and the
    decoder's quantization (mlx-vlm's conversions of one checkpoint, native/ and mxfp4/, compute
    different caches). As for llama, an unquantized model's fingerprint leaves that key out."""
    keys = ("family", "layers", "hidden", "head_dim", "index_head_dim", "window", "ratios")
    keys += ("rope", "rms_norm_eps")
    ident = {k: desc[k] for k in keys}
    if desc.get("quantization") is not None:
        ident["quantization"] = desc["quantization"]
    text = json.dumps(ident, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def describe(model: nn.Module) -> Dict[str, Any]:
    """Layout and identity of a loaded DeepSeek-V4 model; raises ValueError for other models."""
    lm = language_model(model)
    args = lm.args
    if args.model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {args.model_type!r} is not deepseek_v4")
    layers = lm.layers
    ratios = [int(layer.attn.compress_ratio) for layer in layers]
    attn = layers[0].attn
    desc = {
        "family": FAMILY,
        "model_type": args.model_type,
        "layers": len(layers),
        "hidden": int(args.hidden_size),
        "head_dim": int(args.head_dim),
        "index_head_dim": int(args.index_head_dim),
        "window": int(args.sliding_window),
        "ratios": ratios,
        "rope": rope_params(args),
        "rms_norm_eps": float(args.rms_norm_eps),
        "vocab_size": int(args.vocab_size),
        "kv_heads": 1,
        # The cache's dtype: the window rows come out of kv_norm (a quantized wkv's scales may
        # be uint8, which says nothing about the activations).
        "dtype": dtype_name(attn.kv_norm.weight.dtype),
        "quantization": quantization(lm),
    }
    desc["fingerprint"] = fingerprint(desc)
    return desc


def _compressor_weights(prefix: str, comp: nn.Module, out: Dict[str, mx.array]) -> None:
    linear_weights(prefix + "wkv.", comp.wkv, out)
    linear_weights(prefix + "wgate.", comp.wgate, out)
    out[prefix + "ape"] = comp.ape
    out[prefix + "norm.weight"] = comp.norm.weight


def cache_weights(model: nn.Module) -> Dict[str, mx.array]:
    """Exactly what the cache program needs, as the decoder uses it, plus the decoder's own rope
    frequencies (the program recomputes them and refuses to run if they differ)."""
    lm = language_model(model)
    out: Dict[str, mx.array] = {}
    local_rope = compressed_rope = None
    for i, layer in enumerate(lm.layers):
        attn = layer.attn
        p = f"layers.{i}.attn."
        linear_weights(p + "wkv.", attn.wkv, out)
        out[p + "kv_norm.weight"] = attn.kv_norm.weight
        if attn.compress_ratio:
            compressed_rope = attn.rope
            _compressor_weights(p + "compressor.", attn.compressor, out)
            if "indexer" in attn:
                _compressor_weights(p + "indexer.compressor.", attn.indexer.compressor, out)
        else:
            local_rope = attn.rope
    args = lm.args
    if local_rope is None:
        from mlx_vlm.models.deepseek_v4.language import DeepseekV4RoPE

        local_rope = DeepseekV4RoPE(args.qk_rope_head_dim, args.rope_theta, None)
    if compressed_rope is None:
        from mlx_vlm.models.deepseek_v4.language import DeepseekV4RoPE

        compressed_rope = DeepseekV4RoPE(
            args.qk_rope_head_dim, args.compress_rope_theta, args.rope_scaling
        )
    out["rope.local.freqs"] = local_rope._freqs
    out["rope.compressed.freqs"] = compressed_rope._freqs
    return out


def array_names(desc: Dict[str, Any], n_tokens: int = 0) -> List[str]:
    names = []
    for i, ratio in enumerate(desc["ratios"]):
        names.append(f"layers.{i}.window")
        pools = ("pool", "index") if ratio == 4 else ("pool",) if ratio else ()
        for pool in pools:
            names += [f"layers.{i}.{pool}.{k}" for k in ("buf_kv", "buf_gate", "pooled")]
    return names


def array_shapes(
    desc: Dict[str, Any], n_tokens: int, window_idx: int, start: int = 0
) -> Dict[str, List[int]]:
    """Expected shape of every store array for a prefix of n_tokens (window rows: see S below).

    start > 0: a tail's entry, whose pooled arrays hold only the rows of the windows completed
    from start on (the decoder's own cache of the first start tokens holds the others).
    """
    del window_idx
    hd, ihd, win = desc["head_dim"], desc["index_head_dim"], desc["window"]
    shapes: Dict[str, List[int]] = {}
    for i, ratio in enumerate(desc["ratios"]):
        shapes[f"layers.{i}.window"] = [1, 1, -1, hd]  # S depends on the call schedule
        if ratio:
            width = 2 * hd if ratio == 4 else hd
            rem = n_tokens % ratio
            shapes[f"layers.{i}.pool.buf_kv"] = [1, rem, width]
            shapes[f"layers.{i}.pool.buf_gate"] = [1, rem, width]
            shapes[f"layers.{i}.pool.pooled"] = [1, n_tokens // ratio - start // ratio, hd]
        if ratio == 4:
            rem = n_tokens % 4
            shapes[f"layers.{i}.index.buf_kv"] = [1, rem, 2 * ihd]
            shapes[f"layers.{i}.index.buf_gate"] = [1, rem, 2 * ihd]
            shapes[f"layers.{i}.index.pooled"] = [1, n_tokens // 4 - start // 4, ihd]
    del win
    return shapes


def _pool_arrays(prefix: str, pool: Any, out: Dict[str, mx.array]) -> None:
    rem = int(pool.remainder)
    if pool.buf_kv is None:
        raise ValueError(f"{prefix}: pooling cache was never filled")
    out[prefix + "buf_kv"] = mx.contiguous(pool.buf_kv[:, :rem])
    out[prefix + "buf_gate"] = mx.contiguous(pool.buf_gate[:, :rem])
    if pool.pooled is None:
        width = pool.buf_kv.shape[-1] // (2 if pool.ratio == 4 else 1)
        out[prefix + "pooled"] = mx.zeros((1, 0, width), dtype=pool.buf_kv.dtype)
    else:
        out[prefix + "pooled"] = mx.contiguous(pool.pooled)


def cache_arrays(cache: Sequence[Any], n_tokens: int) -> Tuple[Dict[str, mx.array], int]:
    """Store-layout arrays of the decoder's cache objects after n_tokens, and the window _idx."""
    out: Dict[str, mx.array] = {}
    idx: Optional[int] = None
    for i, layer_cache in enumerate(cache):
        parts = list(layer_cache.caches) if hasattr(layer_cache, "caches") else [layer_cache]
        local = parts[0]
        if local.offset != n_tokens:
            raise ValueError(f"layer {i} cache holds {local.offset} tokens, not {n_tokens}")
        keys, _ = local.state
        out[f"layers.{i}.window"] = mx.contiguous(keys)
        if idx is None:
            idx = int(local._idx)
        elif idx != int(local._idx):
            raise ValueError(f"layer {i} window index {local._idx} differs from layer 0's {idx}")
        if len(parts) > 1:
            _pool_arrays(f"layers.{i}.pool.", parts[1], out)
        if len(parts) > 2:
            _pool_arrays(f"layers.{i}.index.", parts[2], out)
    mx.eval(list(out.values()))
    return out, int(idx or 0)


def _fill_pool(pool: Any, ratio: int, prefix: str, arrays: Dict[str, mx.array]) -> None:
    buf_kv, buf_gate = arrays[prefix + "buf_kv"], arrays[prefix + "buf_gate"]
    pooled = arrays[prefix + "pooled"]
    rem = buf_kv.shape[1]
    full_kv = mx.zeros((1, ratio, buf_kv.shape[-1]), dtype=buf_kv.dtype)
    full_gate = mx.zeros((1, ratio, buf_gate.shape[-1]), dtype=buf_gate.dtype)
    if rem:
        full_kv[:, :rem] = buf_kv
        full_gate[:, :rem] = buf_gate
    pool.ratio = ratio
    pool.buf_kv, pool.buf_gate, pool.remainder = full_kv, full_gate, rem
    pool.pooled = pooled if pooled.shape[1] else None


def build_cache(
    model: nn.Module, arrays: Dict[str, mx.array], n_tokens: int, window_idx: int
) -> List[Any]:
    """The decoder's own cache objects (model.make_cache()) holding the store arrays.

    Fields are assigned directly, as the decoder's own update methods leave them: the window's
    keys in slot order with zero-width f32 values, offset n_tokens and _idx; each pooling cache
    with a full-size zero-padded buffer, its remainder and its pooled rows.
    """
    lm = language_model(model)
    cache = lm.make_cache()
    ratios = [int(layer.attn.compress_ratio) for layer in lm.layers]
    for i, (layer_cache, ratio) in enumerate(zip(cache, ratios)):
        parts = list(layer_cache.caches) if hasattr(layer_cache, "caches") else [layer_cache]
        local = parts[0]
        keys = arrays[f"layers.{i}.window"]
        local.keys = keys
        local.values = mx.zeros((1, 1, keys.shape[2], 0))
        local.offset = n_tokens
        local._idx = window_idx
        if len(parts) > 1:
            _fill_pool(parts[1], ratio, f"layers.{i}.pool.", arrays)
        if len(parts) > 2:
            _fill_pool(parts[2], ratio, f"layers.{i}.index.", arrays)
    mx.eval([a for a in arrays.values()])
    return cache


def run_with_schedule(
    model: nn.Module, ids: Sequence[int], calls: Sequence[int], capture: bool = True
) -> Tuple[List[Any], Optional[Dict[str, mx.array]], mx.array]:
    """Runs the decoder's own forward over `ids` in calls of the given lengths on a fresh cache.

    Returns (cache, attention inputs {layers.{i}.x: [T, hidden] bf16} or None, last logits).
    The attention input is recorded by wrapping each block's attn_norm module: the decoder's
    arithmetic is unchanged, the wrapper only keeps a reference to the norm's output.
    """
    if sum(calls) != len(ids) or any(c <= 0 for c in calls):
        raise ValueError(f"calls {list(calls)} do not cover {len(ids)} ids")
    lm = language_model(model)
    if lm.training:
        # The decoder loads in eval mode; in training mode short calls take another path.
        raise ValueError("the model is in training mode; call model.eval() as the loader does")
    cache = lm.make_cache()
    records: List[List[mx.array]] = [[] for _ in lm.layers]
    originals = []
    if capture:
        for i, layer in enumerate(lm.layers):
            originals.append(layer.attn_norm)
            layer.attn_norm = _Recorder(layer.attn_norm, records[i])
    try:
        pos, logits = 0, None
        for n in calls:
            out = lm(mx.array([list(ids[pos : pos + n])]), cache=cache)
            logits = out.logits[:, -1]
            mx.eval(logits, [c.state for c in cache])
            pos += n
    finally:
        for layer, norm in zip(lm.layers, originals):
            layer.attn_norm = norm
    xs = None
    if capture:
        xs = {f"layers.{i}.x": mx.concatenate(r, axis=1)[0] for i, r in enumerate(records)}
        mx.eval(list(xs.values()))
    return cache, xs, logits


class _Recorder(nn.Module):
    """Calls the wrapped norm and keeps its output (one entry per call)."""

    def __init__(self, inner: nn.Module, sink: List[mx.array]):
        super().__init__()
        self._inner = [inner]  # a list, so the wrapped module's parameters are not re-registered
        self._sink = sink

    def __call__(self, x: mx.array) -> mx.array:
        y = self._inner[0](x)
        self._sink.append(y)
        return y
