"""`tiny-dsv4`: deterministic tiny DeepSeek-V4 checkpoints for tests on machines without one.

Writes three sibling directories:

  fp8/    the layout DeepSeek publishes for DeepSeek-V4-Flash: official tensor names
          (`embed.weight`, `layers.N.attn.wq_a.weight` + `.scale`, `mtp.0.*`, ...) in sharded
          safetensors with an index; attention and shared-expert projections in
          float8_e4m3fn with UE8M0 (float8_e8m0fnu) scales over 128x128 blocks, routed experts in
          FP4 e2m1 packed two per int8 with UE8M0 scales per 32 inputs, control tensors in float32,
          the rest in bf16.
  bf16/   mlx-vlm's own converter run on fp8/ with --dequantize --dtype bfloat16.
  mxfp4/  the same converter with -q --q-mode mxfp4 (group size 32, 4 bits: the mode's only one).

The tokenizer files are copied from a real model (SmolLM2's by default), so vocab_size is that
tokenizer's. Every feature is present and not trivial: random norm weights, attention sinks,
compressor position biases (ape), router correction biases, hash-routing tables,
hyper-connection parameters that mix the copies visibly without blowing activations up, and an
expert channel that the swiglu limit clamps. Top logits stand well clear of bf16 noise, so
greedy answers do not hinge on last-bit ties.

The same seed and shape give byte-identical fp8/ files; bf16/ and mxfp4/ are functions of fp8/
through the pinned mlx-vlm.
"""

import json
import shutil
import struct
import sys
from contextlib import contextmanager, redirect_stdout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .tiny import TOKENIZER_FILES, _vocab_size

FP8_BLOCK = 128  # official FP8 weights: one UE8M0 scale per 128x128 block
FP4_GROUP = 32  # official FP4 experts: one UE8M0 scale per 32 inputs of a row
E4M3_MAX = 448.0
UE8M0_BIAS = 127
VARIANTS = ("fp8", "bf16", "mxfp4", "native")

# Logit margins. Random logits over a 49k vocabulary tie at bf16 precision on ~10% of positions
# whatever their scale, so the head is not random: its row for token successor(t) is token t's
# embedding plus HEAD_NOISE times as much noise, scaled to logits of std HEAD_STD. The current
# token thus votes for one successor; EMBED_STD sets how loud that vote is against what the layers
# add. At 1.3 the median top-2 margin is ~5 (~40 bf16 steps) and the context still overrides the
# vote at ~1 position in 10 (measured on a license text), so the layers decide some answers.
EMBED_STD = 1.3
HEAD_STD = 4.0
HEAD_NOISE = 1.0
# Norm weights 1 + N(0, NORM_STD); attention sinks N(0, SINK_STD) (logits of the same order as
# q.k / sqrt(d)); ape N(0, APE_STD) on top of gate logits of order 1; router correction biases
# N(0, BIAS_STD), enough to change some top-k choices of sqrtsoftplus scores (order 1).
NORM_STD = 0.1
SINK_STD = 1.0
APE_STD = 0.5
BIAS_STD = 0.1
# Hyper-connections: mixes = rmsnorm(h) @ fn.T are N(0, 1) with fn rows of norm 1; scales near
# HC_SCALE and bases N(0, HC_BASE_STD) keep pre/post gates and the Sinkhorn mixing matrix away
# from both uniform (trivial) and one-hot (saturated).
HC_SCALE = 0.5
HC_SCALE_STD = 0.1
HC_BASE_STD = 0.5
# Swiglu limit (10): expert gate/up outputs are N(0, 1) and never reach it, except in one hot
# intermediate channel per expert whose N(0, HOT_GAIN^2) values pass it on some tokens.
HOT_CHANNEL = 0
HOT_GAIN = 6.0
HOT_DAMP = 16.0


def default_ratios(layers: int) -> Tuple[int, ...]:
    """The official Flash pattern: two local layers, then ratio 4 and 128 alternating."""
    return tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(layers))


YARN_ORIGINAL = 65536  # the checkpoint's rope_scaling.original_max_position_embeddings


@dataclass(frozen=True)
class Dsv4Shape:
    """Dimensions of a tiny checkpoint; the defaults are the standard set `make test` builds."""

    layers: int = 6
    ratios: Tuple[int, ...] = field(default_factory=lambda: default_ratios(6))
    hidden: int = 256
    heads: int = 4
    head_dim: int = 128
    rope_dim: int = 64
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 128
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 128
    shared_experts: int = 1
    hash_layers: int = 2
    index_heads: int = 4
    index_head_dim: int = 128
    index_topk: int = 16
    sliding_window: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    mtp_layers: int = 1
    # YaRN over the original 65,536 positions: 16 is DeepSeek-V4-Flash's own (1,048,576
    # positions); 32 the 2,097,152-token context the original system ran it at.
    yarn_factor: int = 16

    def fp8_dims(self) -> Dict[str, int]:
        """Every dimension of an FP8 weight, which mlx-vlm maps 128x128 blocks onto rows."""
        return {
            "hidden": self.hidden,
            "q_lora_rank": self.q_lora_rank,
            "heads * head_dim": self.heads * self.head_dim,
            "heads * head_dim / o_groups": self.heads * self.head_dim // self.o_groups,
            "o_groups * o_lora_rank": self.o_groups * self.o_lora_rank,
            "index_heads * index_head_dim": self.index_heads * self.index_head_dim,
            "moe_intermediate * shared_experts": self.moe_intermediate * self.shared_experts,
        }

    def check(self) -> None:
        dims = {k: v for k, v in asdict(self).items() if k not in ("ratios", "mtp_layers")}
        if min(dims.values()) <= 0:
            raise ValueError(f"every dimension must be positive: {dims}")
        if len(self.ratios) != self.layers:
            raise ValueError(f"{len(self.ratios)} ratios for {self.layers} layers")
        if any(r not in (0, 4, 128) for r in self.ratios):
            raise ValueError(f"ratios {list(self.ratios)} must each be 0, 4 or 128")
        if self.heads % self.o_groups:
            raise ValueError(f"heads {self.heads} is not a multiple of o_groups {self.o_groups}")
        if not self.rope_dim < self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim {self.rope_dim} must be even and below head_dim")
        if self.rope_dim > self.index_head_dim:
            raise ValueError("the indexer ropes the last rope_dim dims of index_head_dim")
        if not 0 < self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..experts ({self.experts})")
        if self.hash_layers > self.layers:
            raise ValueError(f"hash_layers {self.hash_layers} exceeds layers {self.layers}")
        if self.shared_experts != 1:
            raise ValueError("DeepSeek-V4 has exactly one shared expert")
        if self.mtp_layers not in (0, 1):
            raise ValueError("mtp_layers must be 0 or 1")
        bad = {k: v for k, v in self.fp8_dims().items() if v % FP8_BLOCK}
        if bad:
            raise ValueError(f"FP8 weight dims must be multiples of {FP8_BLOCK}: {bad}")
        if self.moe_intermediate % FP4_GROUP or self.hidden % FP4_GROUP:
            raise ValueError(f"expert dims must be multiples of {FP4_GROUP}")


def _config(shape: Dsv4Shape, vocab_size: int, bos: Optional[int], eos: Optional[int]) -> Dict:
    """The official DeepSeek-V4-Flash config.json fields, with the tiny dims."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        # The trailing entry is the MTP layer's; mlx-vlm cuts the list to num_hidden_layers.
        "compress_ratios": list(shape.ratios) + [0] * shape.mtp_layers,
        "compress_rope_theta": 160000,
        "expert_dtype": "fp4",
        "hc_eps": 1e-6,
        "hc_mult": shape.hc_mult,
        "hc_sinkhorn_iters": shape.hc_sinkhorn_iters,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "index_head_dim": shape.index_head_dim,
        "index_n_heads": shape.index_heads,
        "index_topk": shape.index_topk,
        "max_position_embeddings": YARN_ORIGINAL * shape.yarn_factor,
        "moe_intermediate_size": shape.moe_intermediate,
        "n_routed_experts": shape.experts,
        "n_shared_experts": shape.shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": shape.heads,
        "num_experts_per_tok": shape.top_k,
        "num_hash_layers": shape.hash_layers,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": 1,
        "num_nextn_predict_layers": shape.mtp_layers,
        "o_groups": shape.o_groups,
        "o_lora_rank": shape.o_lora_rank,
        "q_lora_rank": shape.q_lora_rank,
        "qk_rope_head_dim": shape.rope_dim,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        },
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": shape.yarn_factor,
            "original_max_position_embeddings": YARN_ORIGINAL,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "sliding_window": shape.sliding_window,
        "swiglu_limit": 10.0,
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "vocab_size": vocab_size,
    }


# --- tensors in their official encodings ---------------------------------------------------------

# One stored tensor: safetensors dtype name, shape, little-endian bytes.
Stored = Tuple[str, Tuple[int, ...], bytes]


def _bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def fp8_block_quantize(w: mx.array) -> Tuple[mx.array, mx.array]:
    """[out, in] float32 -> (e4m3 codes uint8 [out, in], UE8M0 scales uint8 [out/128, in/128]).

    Each 128x128 block gets the smallest power of two 2^e with amax / 2^e <= 448, stored as the
    biased exponent e + 127; the codes are the block divided by 2^e, rounded to e4m3.
    """
    rows, cols = w.shape
    blocks = w.reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    amax = np.array(mx.abs(blocks).max(axis=(1, 3)), dtype=np.float32)
    mantissa, exponent = np.frexp(np.maximum(amax, np.float32(1e-30)) / np.float32(E4M3_MAX))
    e = np.where(mantissa == 0.5, exponent - 1, exponent).astype(np.int32)
    scale = mx.array((e + UE8M0_BIAS).astype(np.uint8))
    step = mx.array(np.ldexp(np.float32(1.0), -e).astype(np.float32))
    codes = mx.to_fp8(blocks * step[:, None, :, None]).reshape(rows, cols)
    return codes, scale


def fp8_block_dequantize(codes: mx.array, scale: mx.array) -> mx.array:
    """The exact float32 values an FP8 weight and its UE8M0 block scales stand for."""
    rows, cols = codes.shape
    w = mx.from_fp8(codes, dtype=mx.float32).reshape(
        rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK
    )
    step = mx.power(2.0, scale.astype(mx.float32) - UE8M0_BIAS)
    return (w * step[:, None, :, None]).reshape(rows, cols)


def fp4_quantize(w: mx.array) -> Tuple[mx.array, mx.array]:
    """[out, in] float32 -> (e2m1 pairs int8 [out, in/2], UE8M0 scales uint8 [out, in/32]).

    Element 2k sits in the low nibble of byte k, as in torch's float4_e2m1fn_x2 and in MLX's
    mxfp4, which is the same format: MLX's quantizer makes the codes.
    """
    packed, scales = mx.quantize(w, group_size=FP4_GROUP, bits=4, mode="mxfp4")
    return packed.view(mx.int8).reshape(w.shape[0], w.shape[1] // 2), scales


def fp4_dequantize(packed: mx.array, scales: mx.array) -> mx.array:
    """The exact float32 values an FP4 expert weight stands for."""
    w = packed.view(mx.uint32)
    return mx.dequantize(w, scales, group_size=FP4_GROUP, bits=4, mode="mxfp4", dtype=mx.float32)


class _Tensors:
    """Draws random weights in a fixed order and stores each in its official encoding."""

    def __init__(self) -> None:
        self.stored: Dict[str, Stored] = {}

    def _put(self, name: str, dtype: str, a: mx.array) -> None:
        assert name not in self.stored, name
        mx.eval(a)
        self.stored[name] = (dtype, tuple(a.shape), _bytes(a))

    def bf16(self, name: str, a: mx.array) -> None:
        self._put(name, "BF16", a.astype(mx.bfloat16))

    def f32(self, name: str, a: mx.array) -> None:
        self._put(name, "F32", a.astype(mx.float32))

    def norm(self, name: str, dim: int) -> None:
        self.bf16(name, 1.0 + NORM_STD * mx.random.normal((dim,)))

    def linear_bf16(self, name: str, out_dim: int, in_dim: int) -> None:
        self.bf16(name, mx.random.normal((out_dim, in_dim)) / in_dim**0.5)

    def linear_fp8(self, prefix: str, out_dim: int, in_dim: int, w: Optional[mx.array] = None):
        if w is None:
            w = mx.random.normal((out_dim, in_dim)) / in_dim**0.5
        codes, scale = fp8_block_quantize(w)
        self._put(prefix + ".weight", "F8_E4M3", codes)
        self._put(prefix + ".scale", "F8_E8M0", scale)

    def linear_fp4(self, prefix: str, out_dim: int, in_dim: int, w: Optional[mx.array] = None):
        if w is None:
            w = mx.random.normal((out_dim, in_dim)) / in_dim**0.5
        packed, scales = fp4_quantize(w)
        self._put(prefix + ".weight", "I8", packed)
        self._put(prefix + ".scale", "F8_E8M0", scales)

    def expert(self, prefix: str, hidden: int, inter: int, fp4: bool) -> None:
        """w1 (gate), w2 (down), w3 (up) of one expert, with a hot channel that the swiglu
        limit clamps: its gate and up rows are HOT_GAIN times larger, its down column
        HOT_DAMP times smaller, so the clamp changes outputs without dominating them."""
        hot = mx.arange(inter) == HOT_CHANNEL
        gain = mx.where(hot, HOT_GAIN, 1.0)[:, None]
        w1 = gain * mx.random.normal((inter, hidden)) / hidden**0.5
        w2 = mx.where(hot, 1 / HOT_DAMP, 1.0) * mx.random.normal((hidden, inter)) / inter**0.5
        w3 = gain * mx.random.normal((inter, hidden)) / hidden**0.5
        put = self.linear_fp4 if fp4 else self.linear_fp8
        put(prefix + "w1", inter, hidden, w1)
        put(prefix + "w2", hidden, inter, w2)
        put(prefix + "w3", inter, hidden, w3)

    def hyper(self, prefix: str, n_mix: int, n_scale: int, width: int) -> None:
        """`{prefix}_fn` [n_mix, width], `_base` [n_mix], `_scale` [n_scale], all float32."""
        self.f32(prefix + "_fn", mx.random.normal((n_mix, width)) / width**0.5)
        self.f32(prefix + "_base", HC_BASE_STD * mx.random.normal((n_mix,)))
        self.f32(prefix + "_scale", HC_SCALE + HC_SCALE_STD * mx.random.normal((n_scale,)))


def _compressor(t: _Tensors, p: str, s: Dsv4Shape, ratio: int, head_dim: int) -> None:
    out_dim = head_dim * (2 if ratio == 4 else 1)  # ratio 4 pools overlapping windows
    t.linear_bf16(p + "wkv.weight", out_dim, s.hidden)
    t.linear_bf16(p + "wgate.weight", out_dim, s.hidden)
    t.f32(p + "ape", APE_STD * mx.random.normal((ratio, out_dim)))
    t.norm(p + "norm.weight", head_dim)


def _block(t: _Tensors, p: str, s: Dsv4Shape, ratio: int, hashed: bool, vocab: int) -> None:
    """One transformer block under prefix `p` (`layers.N.` or `mtp.0.`)."""
    n_mix = (2 + s.hc_mult) * s.hc_mult
    t.hyper(p + "hc_attn", n_mix, 3, s.hc_mult * s.hidden)
    t.hyper(p + "hc_ffn", n_mix, 3, s.hc_mult * s.hidden)
    t.norm(p + "attn_norm.weight", s.hidden)
    t.norm(p + "ffn_norm.weight", s.hidden)

    a = p + "attn."
    t.linear_fp8(a + "wq_a", s.q_lora_rank, s.hidden)
    t.norm(a + "q_norm.weight", s.q_lora_rank)
    t.linear_fp8(a + "wq_b", s.heads * s.head_dim, s.q_lora_rank)
    t.linear_fp8(a + "wkv", s.head_dim, s.hidden)
    t.norm(a + "kv_norm.weight", s.head_dim)
    # wo_a is stored 2-D, [o_groups * o_lora_rank, heads * head_dim / o_groups]; readers view it
    # as one [o_lora_rank, group width] matrix per group.
    t.linear_fp8(a + "wo_a", s.o_groups * s.o_lora_rank, s.heads * s.head_dim // s.o_groups)
    t.linear_fp8(a + "wo_b", s.hidden, s.o_groups * s.o_lora_rank)
    t.f32(a + "attn_sink", SINK_STD * mx.random.normal((s.heads,)))
    if ratio:
        _compressor(t, a + "compressor.", s, ratio, s.head_dim)
    if ratio == 4:
        t.linear_fp8(a + "indexer.wq_b", s.index_heads * s.index_head_dim, s.q_lora_rank)
        t.linear_bf16(a + "indexer.weights_proj.weight", s.index_heads, s.hidden)
        _compressor(t, a + "indexer.compressor.", s, ratio, s.index_head_dim)

    f = p + "ffn."
    t.linear_bf16(f + "gate.weight", s.experts, s.hidden)
    if hashed:
        # Distinct experts per token: the first top_k of a random permutation of the experts.
        order = mx.argsort(mx.random.uniform(shape=(vocab, s.experts)), axis=-1)
        t._put(f + "gate.tid2eid", "I64", order[:, : s.top_k].astype(mx.int64))
    else:
        t.f32(f + "gate.bias", BIAS_STD * mx.random.normal((s.experts,)))
    for e in range(s.experts):
        t.expert(f + f"experts.{e}.", s.hidden, s.moe_intermediate, fp4=True)
    t.expert(f + "shared_experts.", s.hidden, s.moe_intermediate * s.shared_experts, fp4=False)


def _tensors(s: Dsv4Shape, vocab: int) -> List[Dict[str, Stored]]:
    """The checkpoint as shards: top level, one per layer, then the MTP layer."""
    shards: List[Dict[str, Stored]] = []
    t = _Tensors()
    embed = mx.random.normal((vocab, s.hidden))
    t.bf16("embed.weight", EMBED_STD * embed)
    # The head's row for successor[t] is token t's embedding (plus noise): see EMBED_STD.
    successor = mx.random.permutation(vocab)
    rows = mx.zeros_like(embed).at[successor].add(embed)
    head = (rows + HEAD_NOISE * mx.random.normal((vocab, s.hidden))) / (1 + HEAD_NOISE**2) ** 0.5
    t.bf16("head.weight", HEAD_STD * head / s.hidden**0.5)
    t.norm("norm.weight", s.hidden)
    t.hyper("hc_head", s.hc_mult, 1, s.hc_mult * s.hidden)
    shards.append(t.stored)
    for i, ratio in enumerate(s.ratios):
        t = _Tensors()
        _block(t, f"layers.{i}.", s, ratio, i < s.hash_layers, vocab)
        shards.append(t.stored)
    for k in range(s.mtp_layers):
        t = _Tensors()
        m = f"mtp.{k}."
        t.linear_fp8(m + "e_proj", s.hidden, s.hidden)
        t.linear_fp8(m + "h_proj", s.hidden, s.hidden)
        t.norm(m + "enorm.weight", s.hidden)
        t.norm(m + "hnorm.weight", s.hidden)
        t.norm(m + "norm.weight", s.hidden)
        t.hyper(m + "hc_head", s.hc_mult, 1, s.hc_mult * s.hidden)
        _block(t, m, s, 0, s.layers + k < s.hash_layers, vocab)
        shards.append(t.stored)
    return shards


def write_safetensors(path: Path, tensors: Dict[str, Stored]) -> int:
    """Writes a safetensors file with names in sorted order; returns the data size in bytes.

    Written by hand because the FP8 dtypes have no numpy or MLX writer, and so the bytes depend
    on nothing but the tensors.
    """
    header: Dict[str, Dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        end = offset + len(data)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in sorted(tensors):
            f.write(tensors[name][2])
    return offset


def safetensors_header(path: Path) -> Dict[str, Dict]:
    """The JSON header of a safetensors file: name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _write_fp8(out: Path, shape: Dsv4Shape, vocab: int, bos, eos) -> None:
    shards = _tensors(shape, vocab)
    weight_map: Dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / name, shard)
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = _config(shape, vocab, bos, eos)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


def _special_ids(tokenizer_dir: Path) -> Tuple[Optional[int], Optional[int]]:
    from transformers import AutoTokenizer  # only this dev command needs it directly

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return tok.bos_token_id, tok.eos_token_id


@contextmanager
def deepseek_fp8_loading() -> Iterator[None]:
    """Lets pinned mlx-vlm (0.7.10) load the official FP8 checkpoint, for the duration.

    Its load_model first asks the generic block-FP8 transform (mlx_vlm/fp8.py), which accepts any
    config with quant_method fp8, fmt e4m3 and weight_block_size [128, 128], i.e. the official
    DeepSeek-V4 one, and answers one mxfp8 setting for every module. That skips the DeepSeek-V4
    per-module setting (mlx_vlm/models/deepseek_v4/language.py make_quantization_config: experts
    mxfp4, attention and shared experts mxfp8), so the FP4 experts are read as mxfp8 and loading
    fails with a shape mismatch. Inside this context the generic transform declines official
    DeepSeek-V4 FP8 checkpoints, and load_model falls through to that per-module setting, as its
    own comment intends. The weights themselves go through mlx-vlm's sanitize() unchanged. Other
    checkpoints (bf16/, mxfp4/, other families) load exactly as without it.
    """
    import mlx_vlm.fp8 as fp8  # load_model imports transform_fp8_weights from here per call

    generic = fp8.transform_fp8_weights

    def transform(weights, config, target_quantization=None):
        # Official FP8 checkpoints hold UE8M0 `.scale` tensors; a converted one (bf16/ keeps the
        # fp8 quantization_config) has none and goes the generic way, which quantizes nothing.
        if config.get("model_type") == "deepseek_v4" and any(
            k.endswith(".scale") and v.dtype == mx.uint8 for k, v in weights.items()
        ):
            return weights, None
        return generic(weights, config, target_quantization)

    fp8.transform_fp8_weights = transform
    try:
        yield
    finally:
        fp8.transform_fp8_weights = generic


def mlx_vlm_convert(src: Path, dst: Path, variant: str) -> None:
    """Runs mlx-vlm's own converter (the API behind `mlx_vlm.convert`) from fp8/ into `dst`.

    bf16: --dequantize --dtype bfloat16; mxfp4: -q --q-mode mxfp4 (group 32, 4 bits).
    native: -q with nothing newly quantized: the checkpoint's own quantization is kept as
    mlx-vlm maps it (experts mxfp4 with the FP4 codes, attention and shared experts mxfp8 with
    the FP8 codes; make_quantization_config) and everything else is bf16. This is the variant
    that runs on MLX's CPU backend with the official weights' values (bf16/ cannot: the CPU
    gather_mm takes float32 only).
    """
    from mlx_vlm.convert import convert

    if dst.exists():
        shutil.rmtree(dst)
    # The converter reports progress on stdout; the command's stdout is its JSON summary.
    with deepseek_fp8_loading(), redirect_stdout(sys.stderr):
        if variant == "bf16":
            convert(str(src), str(dst), dequantize=True, dtype="bfloat16")
        elif variant == "mxfp4":
            convert(str(src), str(dst), quantize=True, q_mode="mxfp4", q_group_size=32, q_bits=4)
        elif variant == "native":
            convert(str(src), str(dst), quantize=True, q_mode="mxfp4", q_group_size=32, q_bits=4,
                    quant_predicate=lambda path, module: False)
        else:
            raise ValueError(f"unknown variant {variant!r}")


def make_tiny_dsv4(
    tokenizer_dir: Path,
    out: Path,
    seed: int = 0,
    shape: Dsv4Shape = Dsv4Shape(),
    variants: Sequence[str] = VARIANTS,
) -> Dict:
    """Writes out/fp8 (always; the others are converted from it), then the MLX variants."""
    shape.check()
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
    vocab_size = _vocab_size(tokenizer_dir)
    bos, eos = _special_ids(tokenizer_dir)
    fp8 = out / "fp8"
    if fp8.exists():
        shutil.rmtree(fp8)
    fp8.mkdir(parents=True)
    _copy_tokenizer(tokenizer_dir, fp8)
    mx.random.seed(seed)
    _write_fp8(fp8, shape, vocab_size, bos, eos)
    for variant in variants:
        if variant != "fp8":
            mlx_vlm_convert(fp8, out / variant, variant)
    made = {**asdict(shape), "ratios": list(shape.ratios)}
    variants = sorted(set(variants) | {"fp8"})
    return {"seed": seed, "vocab_size": vocab_size, "variants": variants, **made}
