"""The llama family port, decoder side (dense GQA: Llama, Mistral, Qwen2, Qwen3, SmolLM).

Data plus a few functions: describe the loaded model and fingerprint it, export the weights
the cache program needs, build the decoder's own cache objects from store arrays, and read
them back out. Everything is read from the model as mlx-lm loaded it, not from config.json,
because the loaded modules are what the decoder actually computes with.

Cache arrays, in the store and in truth dumps: per layer `layers.{i}.keys` and
`layers.{i}.values`, shape [kv_heads, B, head_dim], in the decoder's cache dtype.
"""

import hashlib
import json
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from .quantized import linear_weights

FAMILY = "llama"

# mlx-lm model types whose attention is q/k/v projections (+ optional k_norm, biases) and RoPE.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _cache_dtype(layer: nn.Module) -> mx.Dtype:
    """The dtype of the decoder's cache: its k projection's output. A dense projection outputs in
    its weight's dtype and an affine-quantized one in its scales'; an mx-quantized one (mxfp4,
    mxfp8: uint8 scales) in its input's, the attention norm's output."""
    linear = layer.self_attn.k_proj
    if isinstance(linear, nn.QuantizedLinear):
        if mx.issubdtype(linear.scales.dtype, mx.floating):
            return linear.scales.dtype
        return layer.input_layernorm.weight.dtype
    return linear.weight.dtype


def rope_params(rope: nn.Module, args: Any) -> Dict[str, Any]:
    """The rope parameters the attention module was built with.

    Rope classes that bake the base into precomputed frequencies (llama3, yarn, longrope,
    proportional) carry no `base`; the config's rope_theta plus the scaling dict then pin them
    down, and the frequencies themselves travel in the export (`rope.freqs`, see kv_weights) so
    the prefill host can check its own against them. A scaled rope also names what else its
    module computes with: max_position_embeddings (longrope) and the factor it multiplies its
    input by (yarn's mscale, longrope's scale). An unscaled rope's dict is what it always was,
    so its fingerprint stays.
    """
    dims = getattr(rope, "dims", None) or getattr(rope, "dim")
    out = {
        "dims": int(dims),
        "base": float(getattr(rope, "base", None) or args.rope_theta),
        "scale": float(getattr(rope, "scale", 1.0)),
        "traditional": bool(getattr(rope, "traditional", getattr(args, "rope_traditional", False))),
        "scaling": getattr(args, "rope_scaling", None),
    }
    if out["scaling"] is not None:
        mpe = getattr(args, "max_position_embeddings", None)
        out["max_position_embeddings"] = int(mpe) if mpe is not None else None
        input_scale = getattr(rope, "_scale", getattr(rope, "mscale", 1.0))
        out["input_scale"] = float(input_scale)
    return out


def context_window(args: Any) -> Optional[int]:
    """The longest prompt the front door lets through to this decoder: max_position_embeddings,
    or for a dynamic NTK rope (whose point is to run past it, recomputing its base per call)
    factor times that. None when the config names none."""
    mpe = getattr(args, "max_position_embeddings", None)
    scaling = getattr(args, "rope_scaling", None) or {}
    kind = scaling.get("type") or scaling.get("rope_type", "default")
    if mpe is None or kind != "dynamic":
        return mpe
    return int(mpe * max(float(scaling["factor"]), 1.0))


def _setting(module: nn.Module) -> Dict[str, Any]:
    return {
        "mode": str(getattr(module, "mode", "affine")),
        "bits": int(module.bits),
        "group_size": int(module.group_size),
    }


def quantization(model: nn.Module) -> Optional[Dict[str, Any]]:
    """How the loaded model is quantized, read from its modules (what the decoder computes with,
    whatever its config says; mlx-lm also infers per-layer settings from the weights).

    None when no module is quantized. Otherwise the most common setting {mode, bits,
    group_size}, `modules` (how many modules are quantized) and `overrides`: module path -> its
    own setting where it differs, or None for a quantizable module left dense.
    """
    settings: Dict[str, Dict[str, Any]] = {}
    dense: List[str] = []
    for path, module in model.named_modules():
        if "scales" in module and hasattr(module, "bits") and hasattr(module, "group_size"):
            settings[path] = _setting(module)
        elif hasattr(module, "to_quantized"):
            dense.append(path)
    if not settings:
        return None
    counts = Counter(json.dumps(s, sort_keys=True) for s in settings.values())
    # Most common first; ties broken by the setting's text, so the choice is deterministic.
    common = min(counts, key=lambda text: (-counts[text], text))
    overrides: Dict[str, Any] = {p: None for p in dense}
    overrides.update({p: s for p, s in settings.items() if json.dumps(s, sort_keys=True) != common})
    out = json.loads(common)
    out["modules"] = len(settings)
    out["overrides"] = dict(sorted(overrides.items()))
    return out


def fingerprint(desc: Dict[str, Any]) -> str:
    """The model identity both ends must agree on before a bridge-written cache is trusted.

    A stale rope factor or a missing k_norm silently corrupts every cached row, so everything
    the cache program depends on is in here, and so is the decoder's quantization: a quantized
    model and its bf16 original compute different caches. An unquantized model's fingerprint
    leaves the key out (it is the one it had before quantization was covered). Used by serve
    (/hetero/info) and export alike.
    """
    keys = ("family", "layers", "kv_heads", "head_dim", "rope", "qk_norm", "kv_bias")
    ident = {k: desc[k] for k in keys}
    for optional in ("quantization", "sliding_window"):  # absent: the fingerprint it always had
        if desc.get(optional) is not None:
            ident[optional] = desc[optional]
    text = json.dumps(ident, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def describe(model: nn.Module) -> Dict[str, Any]:
    """Layout and identity of a loaded llama-family model; raises ValueError for other models."""
    args = model.args
    if args.model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {args.model_type!r} is not in the llama family {MODEL_TYPES}")
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if not kinds <= {"KVCache", "RotatingKVCache"}:
        # Other cache kinds need their own mount; refuse instead of guessing.
        raise ValueError(f"llama family needs KVCache layers, model makes {sorted(kinds)}")
    # Sliding-window layers (mlx-lm's llama "sliding_attention"): RotatingKVCache(sliding_window).
    # Within the window their cache is every row in order, past it the window's (_window_state).
    sliding = getattr(getattr(model, "model", None), "sliding_window", None)
    if "RotatingKVCache" not in kinds:
        sliding = None
    attn = model.layers[0].self_attn
    head_dim = (
        getattr(attn, "head_dim", None)
        or getattr(args, "head_dim", None)
        or args.hidden_size // args.num_attention_heads
    )
    desc = {
        "family": FAMILY,
        "model_type": args.model_type,
        "layers": len(model.layers),
        "kv_heads": int(attn.n_kv_heads),
        "head_dim": int(head_dim),
        "hidden": int(args.hidden_size),
        "rms_norm_eps": float(args.rms_norm_eps),
        "vocab_size": int(args.vocab_size),
        "rope": rope_params(attn.rope, args),
        "qk_norm": "k_norm" in attn,
        "kv_bias": "bias" in attn.k_proj,
        "dtype": dtype_name(_cache_dtype(model.layers[0])),
        "quantization": quantization(model),
        "sliding_window": int(sliding) if sliding is not None else None,
    }
    desc["fingerprint"] = fingerprint(desc)
    return desc


def kv_weights(model: nn.Module) -> Dict[str, mx.array]:
    """Exactly the weights the llama cache program needs, per layer, as the decoder uses them:
    k/v projections dense or as a quantized module's element values and scales (quantized.py),
    biases, k_norm, and the rope's own frequencies when it has them."""
    out = {}
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            proj = getattr(attn, name)
            linear_weights(f"layers.{i}.{name}.", proj, out)
            if "bias" in proj:
                out[f"layers.{i}.{name}.bias"] = proj.bias
        if "k_norm" in attn:
            out[f"layers.{i}.k_norm.weight"] = attn.k_norm.weight
    freqs = getattr(model.layers[0].self_attn.rope, "_freqs", None)
    if freqs is not None:
        out["rope.freqs"] = freqs.astype(mx.float32)
    return out


def array_names(layers: int) -> List[str]:
    return [f"layers.{i}.{kind}" for i in range(layers) for kind in ("keys", "values")]


def _in_order(layer_cache: RotatingKVCache) -> Tuple[mx.array, mx.array]:
    """A rotating cache's rows in temporal order: all `offset` of them within its window, at
    least its window's past it."""
    keys = layer_cache._temporal_order(layer_cache.keys)
    values = layer_cache._temporal_order(layer_cache.values)
    if layer_cache.offset < layer_cache.max_size:
        keys, values = keys[..., : layer_cache.offset, :], values[..., : layer_cache.offset, :]
    return keys, values


def _window_state(layer_cache: RotatingKVCache, keys: mx.array, values: mx.array,
                  n_tokens: int) -> tuple:
    """The state a sliding layer's RotatingKVCache has after n_tokens, from those rows' last ones
    in temporal order ([1, kv_heads, >= min(n_tokens, window), head_dim]).

    Within the window: every row, in order. Past it the decoder's own buffer after a
    multi-token call holds its window's last W - 1 rows plus the call's, but every later use
    reads only the last W of them, in order (a one-token call cuts the buffer to them, a longer
    one keeps their last W - 1, the batch cache's merge takes min(offset, W)): the window alone
    is the same cache to every reader (docs/findings/mlx-lm-sliding-window-cache.md).
    """
    window = layer_cache.max_size
    if layer_cache.keep != 0:
        raise ValueError(f"a rotating cache that keeps {layer_cache.keep} rows is not llama's")
    rows = min(n_tokens, window)
    if keys.shape[2] < rows:
        raise ValueError(f"{keys.shape[2]} rows for a window that holds {rows}")
    keys, values = keys[..., keys.shape[2] - rows :, :], values[..., values.shape[2] - rows :, :]
    return keys, values, n_tokens, 0, window, rows


def build_cache(model: nn.Module, arrays: Dict[str, mx.array], n_tokens: int) -> List[KVCache]:
    """The decoder's own cache objects holding `arrays` ([kv_heads, n, head_dim] per layer);
    a sliding layer keeps its window of them (_window_state).

    Evaluated here: the arrays were made on the calling (HTTP) thread and must not be left as
    lazy graphs for the generation thread to evaluate.
    """
    cache = make_prompt_cache(model)
    for i, layer_cache in enumerate(cache):
        keys = arrays[f"layers.{i}.keys"][None]
        values = arrays[f"layers.{i}.values"][None]
        if isinstance(layer_cache, RotatingKVCache):
            layer_cache.state = _window_state(layer_cache, keys, values, n_tokens)
        else:
            layer_cache.state = (keys, values, n_tokens)
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    return cache


def extend_cache(prefix: List[Any], arrays: Dict[str, mx.array], n_tokens: int) -> List[KVCache]:
    """The decoder's own cache objects for a prefix (a copy the caller owns), extended by a
    tail's rows ([kv_heads, n, head_dim] per layer) to n_tokens, the way the decoder appends
    rows itself (KVCache.update_and_fetch; a sliding layer keeps its window of the prefix's
    rows and the tail's). Evaluated here, as build_cache is."""
    for i, layer_cache in enumerate(prefix):
        keys = arrays[f"layers.{i}.keys"][None]
        values = arrays[f"layers.{i}.values"][None]
        if type(layer_cache) is RotatingKVCache:
            if layer_cache.offset + keys.shape[2] != n_tokens:
                raise ValueError(f"layer {i} holds {layer_cache.offset} rows, not "
                                 f"{n_tokens - keys.shape[2]}")
            held_k, held_v = _in_order(layer_cache)
            layer_cache.state = _window_state(
                layer_cache, mx.concatenate([held_k, keys], axis=2),
                mx.concatenate([held_v, values], axis=2), n_tokens)
            continue
        if type(layer_cache) is not KVCache:
            raise ValueError(f"layer {i} holds a {type(layer_cache).__name__}, not a KVCache")
        layer_cache.update_and_fetch(keys, values)
        if layer_cache.offset != n_tokens:
            raise ValueError(f"layer {i} holds {layer_cache.offset} rows, not {n_tokens}")
    mx.eval([c.keys for c in prefix] + [c.values for c in prefix])
    return prefix


def cache_arrays(cache: List[Any], n_tokens: int) -> Dict[str, mx.array]:
    """Store-layout arrays of the first n_tokens rows of the decoder's cache objects.

    KVCache grows its buffers in steps of 256 rows, so the buffers are sliced to n_tokens; a
    RotatingKVCache that has not filled its window holds its rows in order the same way. One
    past its window gives the rows every later use reads, its window's in temporal order
    (_window_state), and only for exactly its offset: it cannot be cut back.
    """
    out = {}
    for i, layer_cache in enumerate(cache):
        if isinstance(layer_cache, RotatingKVCache) and layer_cache.offset >= layer_cache.max_size:
            if layer_cache.offset != n_tokens:
                raise ValueError(f"layer {i} slides past its window at {layer_cache.offset} rows "
                                 f"and cannot be cut back to {n_tokens}")
            keys, values, _, _, _, _ = _window_state(layer_cache, *_in_order(layer_cache),
                                                     n_tokens)
            out[f"layers.{i}.keys"] = mx.contiguous(keys[0])
            out[f"layers.{i}.values"] = mx.contiguous(values[0])
            continue
        in_order = isinstance(layer_cache, (KVCache, RotatingKVCache))
        if not in_order or layer_cache.offset < n_tokens:
            raise ValueError(f"layer {i} cache does not hold {n_tokens} rows in order")
        out[f"layers.{i}.keys"] = mx.contiguous(layer_cache.keys[0, :, :n_tokens, :])
        out[f"layers.{i}.values"] = mx.contiguous(layer_cache.values[0, :, :n_tokens, :])
    mx.eval(list(out.values()))
    return out
