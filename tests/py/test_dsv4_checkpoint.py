"""The tiny DeepSeek-V4 checkpoints (python/hetero_mlx/dsv4_tiny.py) against the official layout
and against mlx-vlm, which converts and loads them.

HETERO_DSV4_MODEL names the standard set (`make tiny-dsv4` writes models/dsv4-tiny); without it
the tests that read the set skip. The determinism test builds its own small set from
HETERO_TOKENIZER.
"""

import json
import math
import os
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx
import numpy as np
import pytest

from hetero_mlx.dsv4_tiny import (
    VARIANTS,
    Dsv4Shape,
    deepseek_fp8_loading,
    fp4_dequantize,
    fp8_block_dequantize,
    make_tiny_dsv4,
    safetensors_header,
)

E4M3_NAN = (0x7F, 0xFF)
E8M0_NAN = 0xFF


@pytest.fixture(scope="module")
def dsv4() -> Path:
    path = os.environ.get("HETERO_DSV4_MODEL")
    if not path:
        pytest.skip("HETERO_DSV4_MODEL is not set (make tiny-dsv4 writes models/dsv4-tiny)")
    if not (Path(path) / "fp8" / "config.json").exists():
        pytest.skip(f"HETERO_DSV4_MODEL={path} has no fp8/config.json")
    return Path(path)


def _config(variant_dir: Path) -> Dict:
    return json.loads((variant_dir / "config.json").read_text())


def _headers(variant_dir: Path) -> Dict[str, Dict]:
    index = json.loads((variant_dir / "model.safetensors.index.json").read_text())
    headers: Dict[str, Dict] = {}
    for shard in sorted(set(index["weight_map"].values())):
        headers.update(safetensors_header(variant_dir / shard))
    assert set(headers) == set(index["weight_map"]), "index and shards disagree"
    return headers


def _tensors(variant_dir: Path) -> Dict[str, mx.array]:
    tensors: Dict[str, mx.array] = {}
    for shard in sorted(variant_dir.glob("*.safetensors")):
        tensors.update(mx.load(str(shard)))
    return tensors


@pytest.fixture(scope="module")
def fp8(dsv4) -> Dict[str, mx.array]:
    return _tensors(dsv4 / "fp8")


def official_tensors(cfg: Dict) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Name -> (safetensors dtype, shape) of every tensor DeepSeek-V4-Flash's checkpoint holds,
    derived from a config.json alone (not from the generator)."""
    D, V, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    H, hd, q = cfg["num_attention_heads"], cfg["head_dim"], cfg["q_lora_rank"]
    groups, rank = cfg["o_groups"], cfg["o_lora_rank"]
    E, k, ffn = cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]
    ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
    n_mix = (2 + hc) * hc
    want: Dict[str, Tuple[str, Tuple[int, ...]]] = {}

    def fp8(name, out_dim, in_dim):  # e4m3 with a UE8M0 scale per 128x128 block
        want[name + ".weight"] = ("F8_E4M3", (out_dim, in_dim))
        want[name + ".scale"] = ("F8_E8M0", (math.ceil(out_dim / 128), math.ceil(in_dim / 128)))

    def fp4(name, out_dim, in_dim):  # e2m1 pairs in int8, a UE8M0 scale per 32 inputs
        want[name + ".weight"] = ("I8", (out_dim, in_dim // 2))
        want[name + ".scale"] = ("F8_E8M0", (out_dim, in_dim // 32))

    def hyper(prefix, n, n_scale):
        want[prefix + "_fn"] = ("F32", (n, hc * D))
        want[prefix + "_base"] = ("F32", (n,))
        want[prefix + "_scale"] = ("F32", (n_scale,))

    def compressor(p, ratio, dim):
        out_dim = dim * (2 if ratio == 4 else 1)
        want[p + "wkv.weight"] = ("BF16", (out_dim, D))
        want[p + "wgate.weight"] = ("BF16", (out_dim, D))
        want[p + "ape"] = ("F32", (ratio, out_dim))
        want[p + "norm.weight"] = ("BF16", (dim,))

    def block(p, ratio, hashed):
        hyper(p + "hc_attn", n_mix, 3)
        hyper(p + "hc_ffn", n_mix, 3)
        want[p + "attn_norm.weight"] = ("BF16", (D,))
        want[p + "ffn_norm.weight"] = ("BF16", (D,))
        fp8(p + "attn.wq_a", q, D)
        want[p + "attn.q_norm.weight"] = ("BF16", (q,))
        fp8(p + "attn.wq_b", H * hd, q)
        fp8(p + "attn.wkv", hd, D)
        want[p + "attn.kv_norm.weight"] = ("BF16", (hd,))
        fp8(p + "attn.wo_a", groups * rank, H * hd // groups)
        fp8(p + "attn.wo_b", D, groups * rank)
        want[p + "attn.attn_sink"] = ("F32", (H,))
        if ratio:
            compressor(p + "attn.compressor.", ratio, hd)
        if ratio == 4:
            fp8(p + "attn.indexer.wq_b", ih * ihd, q)
            want[p + "attn.indexer.weights_proj.weight"] = ("BF16", (ih, D))
            compressor(p + "attn.indexer.compressor.", ratio, ihd)
        want[p + "ffn.gate.weight"] = ("BF16", (E, D))
        if hashed:
            want[p + "ffn.gate.tid2eid"] = ("I64", (V, k))
        else:
            want[p + "ffn.gate.bias"] = ("F32", (E,))
        for e in range(E):
            fp4(p + f"ffn.experts.{e}.w1", ffn, D)
            fp4(p + f"ffn.experts.{e}.w2", D, ffn)
            fp4(p + f"ffn.experts.{e}.w3", ffn, D)
        fp8(p + "ffn.shared_experts.w1", ffn, D)
        fp8(p + "ffn.shared_experts.w2", D, ffn)
        fp8(p + "ffn.shared_experts.w3", ffn, D)

    want["embed.weight"] = ("BF16", (V, D))
    want["head.weight"] = ("BF16", (V, D))
    want["norm.weight"] = ("BF16", (D,))
    hyper("hc_head", hc, 1)
    L, ratios = cfg["num_hidden_layers"], cfg["compress_ratios"]
    for i in range(L):
        block(f"layers.{i}.", ratios[i], i < cfg["num_hash_layers"])
    for m in range(cfg["num_nextn_predict_layers"]):
        p = f"mtp.{m}."
        fp8(p + "e_proj", D, D)
        fp8(p + "h_proj", D, D)
        for norm in ("enorm", "hnorm", "norm"):
            want[p + norm + ".weight"] = ("BF16", (D,))
        hyper(p + "hc_head", hc, 1)
        block(p, ratios[L + m], L + m < cfg["num_hash_layers"])
    return want


def _assert_official_layout(variant_dir: Path) -> None:
    want = official_tensors(_config(variant_dir))
    got = {k: (h["dtype"], tuple(h["shape"])) for k, h in _headers(variant_dir).items()}
    assert sorted(set(want) - set(got)) == [], "missing official tensors"
    assert sorted(set(got) - set(want)) == [], "tensors the official checkpoint does not have"
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert wrong == {}, "dtype/shape (got, want)"


def assert_bit_exact(got: mx.array, want: mx.array, what: str) -> None:
    """Same shape, same dtype, same bits; on failure the first differing index and values."""
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    view = {2: mx.uint16, 4: mx.uint32, 1: mx.uint8}[got.dtype.size]
    diff = np.array(got.view(view)) != np.array(want.view(view))
    if diff.any():
        i = tuple(int(j) for j in np.argwhere(diff)[0])
        g, w = np.array(got.astype(mx.float32))[i], np.array(want.astype(mx.float32))[i]
        pytest.fail(f"{what}: {int(diff.sum())} elements differ; first at {i}: {g} != {w}")


# --- fp8/: the official layout -------------------------------------------------------------------


def test_fp8_has_the_official_names_dtypes_and_shapes(dsv4):
    _assert_official_layout(dsv4 / "fp8")


def test_fp8_config_is_the_official_one_with_tiny_dims(dsv4):
    cfg = _config(dsv4 / "fp8")
    assert cfg["model_type"] == "deepseek_v4"
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    # One trailing entry for the MTP layer, as the official config has (44 for 43 layers).
    assert len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    assert cfg["compress_ratios"] == [0, 0, 4, 128, 4, 128, 0]
    assert cfg["rope_scaling"] == {
        "type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
        "beta_fast": 32, "beta_slow": 1,
    }
    assert cfg["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
    }
    assert cfg["expert_dtype"] == "fp4"
    standard = {
        "num_hidden_layers": 6, "hidden_size": 256, "num_attention_heads": 4, "head_dim": 128,
        "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "n_shared_experts": 1, "num_hash_layers": 2, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "index_n_heads": 4,
        "index_head_dim": 128, "index_topk": 16, "sliding_window": 128, "hc_mult": 4,
        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rope_theta": 10000,
        "compress_rope_theta": 160000, "rms_norm_eps": 1e-6, "vocab_size": 49152,
        "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "topk_method": "noaux_tc",
        "norm_topk_prob": True, "tie_word_embeddings": False,
    }
    assert {k: cfg.get(k) for k in standard} == standard


def test_fp8_codes_and_scales_are_valid_and_tight(dsv4, fp8):
    headers = _headers(dsv4 / "fp8")
    n_fp8 = 0
    for name, h in headers.items():
        if h["dtype"] == "F8_E8M0":
            scale = np.array(fp8[name])
            assert not (scale == E8M0_NAN).any(), f"{name}: NaN scale"
        if h["dtype"] != "F8_E4M3":
            continue
        n_fp8 += 1
        codes = np.array(fp8[name])
        assert not np.isin(codes, E4M3_NAN).any(), f"{name}: NaN code"
        # The scale is the smallest power of two that fits the block: its largest code is at
        # least half of e4m3's top (448; rounding may land exactly on 224) and at most the top.
        w = mx.from_fp8(fp8[name], dtype=mx.float32)
        r, c = w.shape
        amax = np.array(mx.abs(w.reshape(r // 128, 128, c // 128, 128)).max(axis=(1, 3)))
        assert (amax >= 224).all() and (amax <= 448).all(), f"{name}: block scales not tight"
    assert n_fp8 > 0


def test_every_feature_is_present_and_not_trivial(dsv4, fp8):
    cfg = _config(dsv4 / "fp8")

    def f32(name):
        return np.array(fp8[name].astype(mx.float32))

    norms = [k for k in fp8 if k.endswith("norm.weight")]
    assert len(norms) > 20
    for k in norms:
        w = f32(k)
        assert abs(w.mean() - 1) < 0.1 and w.std() > 0.05, f"{k} looks like ones"
    sinks = [k for k in fp8 if k.endswith("attn_sink")]
    assert len(sinks) == cfg["num_hidden_layers"] + 1
    biases = [k for k in fp8 if k.endswith(".ape") or k.endswith(".gate.bias")]
    for k in sinks + biases:
        assert np.abs(f32(k)).min() > 0 and f32(k).std() > 0.05, f"{k} looks trivial"
    for i in range(cfg["num_hidden_layers"]):
        hashed = i < cfg["num_hash_layers"]
        assert (f"layers.{i}.ffn.gate.tid2eid" in fp8) == hashed
        assert (f"layers.{i}.ffn.gate.bias" in fp8) == (not hashed)
    for i in range(cfg["num_hash_layers"]):
        table = np.array(fp8[f"layers.{i}.ffn.gate.tid2eid"])
        assert table.min() >= 0 and table.max() < cfg["n_routed_experts"]
        assert (table[:, 0] != table[:, 1]).all(), "a token routed twice to one expert"
        assert len(np.unique(table, axis=0)) > 20, "tid2eid is not random"

    # Hyper-connections of layer 0 on three embedded tokens, as in the decoder: pre and post gates
    # away from 0 and 1, and a Sinkhorn mixing matrix that is neither uniform nor one-hot.
    hc, eps = cfg["hc_mult"], cfg["hc_eps"]
    emb = f32("embed.weight")[[100, 2000, 30000]]
    h = np.repeat(emb[:, None, :], hc, axis=1).reshape(3, -1)
    z = h / np.sqrt((h**2).mean(-1, keepdims=True) + cfg["rms_norm_eps"])
    fn, base, scale = (f32(f"layers.0.hc_attn_{p}") for p in ("fn", "base", "scale"))
    mix = z @ fn.T
    pre = 1 / (1 + np.exp(-(mix[:, :hc] * scale[0] + base[:hc])))
    post = 2 / (1 + np.exp(-(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])))
    comb = (mix[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(3, hc, hc)
    comb = np.exp(comb - comb.max(-1, keepdims=True))
    comb = comb / comb.sum(-1, keepdims=True) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(cfg["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    assert 0.1 < pre.min() and pre.max() < 0.9, pre
    assert 0.2 < post.min() and post.max() < 1.8, post
    assert np.abs(comb - 1 / hc).max() > 0.1, "mixing is uniform"
    assert comb.max() < 0.8, "mixing is one-hot"


# --- bf16/ and mxfp4/: mlx-vlm's conversions -----------------------------------------------------


def _bf16_name(layer: int, rest: str) -> str:
    return f"language_model.model.layers.{layer}.{rest}"


def test_bf16_is_the_fp8_checkpoint_dequantized(dsv4, fp8):
    """Bit-exact: e4m3 and e2m1 values times powers of two are all bf16 numbers, and mlx-vlm's
    dequantize writes bf16."""
    bf16 = _tensors(dsv4 / "bf16")
    cfg = _config(dsv4 / "fp8")

    def fp8_weight(name):
        return fp8_block_dequantize(fp8[name + ".weight"], fp8[name + ".scale"]).astype(mx.bfloat16)

    def fp4_weight(name):
        return fp4_dequantize(fp8[name + ".weight"], fp8[name + ".scale"]).astype(mx.bfloat16)

    checks = {
        _bf16_name(2, "attn.wq_a.weight"): fp8_weight("layers.2.attn.wq_a"),
        _bf16_name(3, "attn.wkv.weight"): fp8_weight("layers.3.attn.wkv"),
        _bf16_name(4, "attn.indexer.wq_b.weight"): fp8_weight("layers.4.attn.indexer.wq_b"),
        _bf16_name(5, "ffn.shared_experts.down_proj.weight"): fp8_weight(
            "layers.5.ffn.shared_experts.w2"
        ),
        # wo_a: stored 2-D, one [o_lora_rank, group width] matrix per group in MLX.
        _bf16_name(1, "attn.wo_a.weight"): fp8_weight("layers.1.attn.wo_a").reshape(
            cfg["o_groups"], cfg["o_lora_rank"], -1
        ),
        # Routed experts: per-expert FP4 tensors stacked into one [experts, out, in] weight.
        _bf16_name(0, "ffn.switch_mlp.gate_proj.weight"): mx.stack(
            [fp4_weight(f"layers.0.ffn.experts.{e}.w1") for e in range(cfg["n_routed_experts"])]
        ),
        _bf16_name(3, "ffn.switch_mlp.down_proj.weight"): mx.stack(
            [fp4_weight(f"layers.3.ffn.experts.{e}.w2") for e in range(cfg["n_routed_experts"])]
        ),
        # bf16 in the checkpoint: carried over unchanged.
        "language_model.model.embed_tokens.weight": fp8["embed.weight"],
        "language_model.lm_head.weight": fp8["head.weight"],
        _bf16_name(2, "attn.compressor.wkv.weight"): fp8["layers.2.attn.compressor.wkv.weight"],
        _bf16_name(2, "attn.indexer.weights_proj.weight"): fp8[
            "layers.2.attn.indexer.weights_proj.weight"
        ],
        _bf16_name(4, "ffn.gate.weight"): fp8["layers.4.ffn.gate.weight"],
        # float32 kept float32 by mlx-vlm's cast_predicate ...
        _bf16_name(2, "attn.attn_sink"): fp8["layers.2.attn.attn_sink"],
        _bf16_name(2, "ffn.gate.e_score_correction_bias"): fp8["layers.2.ffn.gate.bias"],
        _bf16_name(0, "attn_hc.fn"): fp8["layers.0.hc_attn_fn"],
        "language_model.model.hc_head.base": fp8["hc_head_base"],
        # ... except ape, which it casts to bf16 (it is not in the predicate).
        _bf16_name(3, "attn.compressor.ape"): fp8["layers.3.attn.compressor.ape"].astype(
            mx.bfloat16
        ),
        # tid2eid: int64 in the checkpoint, int32 in MLX.
        _bf16_name(1, "ffn.gate.tid2eid"): fp8["layers.1.ffn.gate.tid2eid"].astype(mx.int32),
    }
    for name, want in checks.items():
        assert_bit_exact(bf16[name], want, name)
    assert not any(k.endswith(".scales") for k in bf16), "bf16 still holds quantized modules"
    assert not any("mtp" in k for k in bf16), "mlx-vlm drops the MTP layer"


def test_mxfp4_is_quantized_and_keeps_the_checkpoint_codes(dsv4, fp8):
    cfg = _config(dsv4 / "mxfp4")
    q = cfg["quantization"]
    assert {k: q[k] for k in ("group_size", "bits", "mode")} == {
        "group_size": 32, "bits": 4, "mode": "mxfp4",
    }
    mx4 = _tensors(dsv4 / "mxfp4")
    # Modules bf16 in the checkpoint are quantized to mxfp4 now.
    for name in (
        "language_model.model.embed_tokens",
        "language_model.lm_head",
        _bf16_name(2, "attn.compressor.wkv"),
    ):
        assert q[name]["mode"] == "mxfp4" and mx4[name + ".weight"].dtype == mx.uint32
        assert mx4[name + ".scales"].dtype == mx.uint8
    # The checkpoint's own FP4 experts and FP8 projections pass through as mxfp4 and mxfp8 with
    # the same element codes; only FP8's 128x128 block scales are spread to one per 32 inputs.
    n = cfg["n_routed_experts"]
    experts = mx.stack([fp8[f"layers.0.ffn.experts.{e}.w1.weight"] for e in range(n)])
    assert q[_bf16_name(0, "ffn.switch_mlp.gate_proj")]["mode"] == "mxfp4"
    assert_bit_exact(
        mx4[_bf16_name(0, "ffn.switch_mlp.gate_proj.weight")].view(mx.int8).reshape(experts.shape),
        experts,
        "expert codes",
    )
    codes = fp8["layers.2.attn.wq_a.weight"]
    assert q[_bf16_name(2, "attn.wq_a")]["mode"] == "mxfp8"
    assert_bit_exact(
        mx4[_bf16_name(2, "attn.wq_a.weight")].view(mx.uint8).reshape(codes.shape),
        codes,
        "wq_a codes",
    )


# --- mlx-vlm loads and generates -----------------------------------------------------------------


def test_pinned_mlx_vlm_reads_the_official_fp8_config_as_all_mxfp8(dsv4):
    """Why deepseek_fp8_loading exists: mlx-vlm 0.7.10's generic block-FP8 path claims the
    official config and reads the FP4 experts as mxfp8. When this starts to load, drop the shim."""
    from mlx_vlm.utils import load_model

    with pytest.raises(ValueError, match="switch_mlp"):
        load_model(dsv4 / "fp8")


@pytest.mark.parametrize("variant", ["fp8", "bf16", "mxfp4", "native"])
def test_mlx_vlm_loads_and_generates(dsv4, variant):
    from mlx_vlm import apply_chat_template, generate, load

    with deepseek_fp8_loading():
        model, processor = load(str(dsv4 / variant))
    assert model.config.model_type == "deepseek_v4"
    prompt = apply_chat_template(processor, model.config, "What is the capital of France?")
    if variant == "bf16" and mx.default_device() == mx.cpu:
        # mlx-vlm runs bf16 experts through gather_mm, which MLX's CPU backend has for float32
        # only; the quantized variants use gather_qmm and run.
        with pytest.raises(RuntimeError, match="GatherMM"):
            generate(model, processor, prompt, max_tokens=4, temperature=0.0)
        return
    result = generate(model, processor, prompt, max_tokens=8, temperature=0.0)
    assert result.generation_tokens == 8 and result.prompt_tokens > 10
    assert result.text.strip()


# --- the generator --------------------------------------------------------------------------------

SMALL = Dsv4Shape(
    layers=3, ratios=(0, 4, 128), hidden=128, heads=2, experts=4, hash_layers=1, index_heads=2,
)


def test_same_seed_same_bytes(tokenizer_dir, tmp_path):
    """Byte identity of the files is the property here (tests elsewhere compare tensors)."""
    for run in ("a", "b"):
        make_tiny_dsv4(tokenizer_dir, tmp_path / run, seed=7, shape=SMALL)
    def files(run):
        root = tmp_path / run
        return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())

    assert files("a") == files("b")
    assert {f.parts[0] for f in files("a")} == set(VARIANTS)
    for f in files("a"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    _assert_official_layout(tmp_path / "a" / "fp8")

    make_tiny_dsv4(tokenizer_dir, tmp_path / "c", seed=8, shape=SMALL, variants=("fp8",))
    a, c = _tensors(tmp_path / "a" / "fp8"), _tensors(tmp_path / "c" / "fp8")
    assert set(a) == set(c)
    assert not mx.array_equal(a["layers.1.attn.wq_a.weight"], c["layers.1.attn.wq_a.weight"])


def test_shape_check_refuses_what_the_formats_cannot_hold():
    with pytest.raises(ValueError, match="multiples of 128"):
        Dsv4Shape(hidden=192).check()
    with pytest.raises(ValueError, match="ratios"):
        Dsv4Shape(layers=3, ratios=(0, 4, 64)).check()
    with pytest.raises(ValueError, match="ratios for"):
        Dsv4Shape(layers=4).check()


def test_swiglu_limit_is_reached(dsv4, monkeypatch):
    """Each expert has a hot channel whose gate/up pass swiglu_limit on some tokens, so a decoder
    that skips the clamp (routed or shared) changes its outputs."""
    from mlx_vlm.models.deepseek_v4 import language
    from mlx_vlm.utils import load_model

    clamped = []
    limited = language._limited_swiglu

    def counting(gate, up, limit):
        clamped.append(int(mx.sum((gate > limit) | (mx.abs(up) > limit)).item()))
        return limited(gate, up, limit)

    monkeypatch.setattr(language, "_limited_swiglu", counting)
    with deepseek_fp8_loading():
        model = load_model(dsv4 / "fp8")
    ids = mx.arange(1000, 1064)[None]  # distinct tokens, so hash routing spreads over the experts
    mx.eval(model.language_model(ids).logits)
    cfg = _config(dsv4 / "fp8")
    assert len(clamped) == 2 * cfg["num_hidden_layers"]  # routed and shared, every layer
    assert all(n > 0 for n in clamped), clamped


def test_native_keeps_the_checkpoint_quantization(dsv4):
    """native/: experts mxfp4 and attention/shared experts mxfp8 with fp8/'s own codes, and the
    compressors, norms and head dense, as mlx-vlm maps the official checkpoint."""
    t = _tensors(dsv4 / "native")
    p = "language_model.model.layers.2."
    assert t[p + "ffn.switch_mlp.up_proj.scales"].dtype == mx.uint8
    assert t[p + "ffn.switch_mlp.up_proj.weight"].shape[-1] * 8 == 256  # 4-bit codes of hidden
    assert t[p + "attn.wkv.weight"].shape[-1] * 4 == 256  # 8-bit codes of hidden
    assert t[p + "ffn.shared_experts.up_proj.scales"].dtype == mx.uint8
    dense_weights = ("attn.compressor.wkv.weight", "attn.kv_norm.weight",
                     "attn.indexer.weights_proj.weight")
    for dense in dense_weights:
        assert t[p + dense].dtype == mx.bfloat16, dense
    assert p + "attn.compressor.wkv.scales" not in t
