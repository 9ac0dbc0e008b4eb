#!/usr/bin/env python
"""Bit-exact numpy emulation of the DeepSeek-V4 cache arithmetic of mlx-vlm 0.7.10 on MLX 0.32.4's
CPU backend: the compressor pooling (ratio 128 "simple", ratio 4 "overlap"), DeepseekV4RoPE's
frequencies (with YaRN) and its interleaved rope with +inf no-rope pairs, MLX's CPU quantized
matmul (mxfp8, mxfp4, affine), and the quantized shapes mlx-vlm's deepseek_v4 uses on top of it:
gather_qmm as SwitchGLU calls it (unsorted and sorted indices), singleton_quantized_linear's
gather_qmm, QuantizedMultiLinear's batched quantized_matmul, and mx.mean (HISA). Builds on the
primitives of mlx_cpu_numerics_check.py.

Run: .venv/bin/python docs/findings/dsv4_numerics_check.py [seed]
Every PASS compares an emulation with MLX bit for bit; every CONTROL runs a wrong recipe that
must differ, which shows the data can tell the recipes apart. See dsv4-mlx-numerics.md.
"""

import ctypes
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_cpu_numerics_check import mlx_exp, mlx_sincos, rb  # noqa: E402
from mlx_vlm.models.deepseek_v4.language import (  # noqa: E402
    DeepseekV4RoPE,
    _overlap_compress_kv,
    _simple_compress_kv,
)

f32 = np.float32
FAILS = []
_libm = ctypes.CDLL("libm.so.6")
_libm.powf.restype = ctypes.c_float
_libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]


def bits(a):
    a = np.ascontiguousarray(np.asarray(a, f32))
    return a.view(np.uint32)


def from_mx(a):
    return np.array(a.astype(mx.float32))


def check(name, ref, got):
    n = int((bits(ref) != bits(got)).sum())
    print(("PASS" if n == 0 else "FAIL"), name, f"{n} differing")
    if n:
        FAILS.append(name)


def control(name, ref, got):
    n = int((bits(ref) != bits(got)).sum())
    print(("CONTROL ok" if n else "CONTROL FAILED (no difference)"), name, f"{n} differing")
    if not n:
        FAILS.append("control " + name)


def col_sum(p, axis):
    """Sequential f32 sum along `axis` in index order (MLX CPU reduce of bf16 or f32)."""
    p = np.moveaxis(p, axis, 0)
    acc = np.zeros(p.shape[1:], f32)
    for row in p:
        acc = (acc + row).astype(f32)
    return acc


def softmax_rows(g, exp=mlx_exp, divide=True):
    """Composed softmax over axis -2: max, exp(x - max), f32 row-order sum, f32 division."""
    m = g.max(axis=-2, keepdims=True)
    with np.errstate(all="ignore"):
        e = exp((g - m).astype(f32))
    s = col_sum(e, -2)[..., None, :]
    return (e / s).astype(f32) if divide else (e * (f32(1) / s)).astype(f32)


def pool_simple(kv, gate, ape, **kw):
    w = rb(softmax_rows((gate + ape).astype(f32), **kw))
    return rb(col_sum(rb(kv * w), -2))


def pool_overlap(kv, gate, ape, hd, round_ape=True, **kw):
    B, W, R, _ = kv.shape
    g = rb(gate + (rb(ape) if round_ape else ape))
    kva = np.concatenate([np.zeros((B, 1, R, hd), f32), kv[:, :-1, :, :hd]], 1)
    ga = np.concatenate([np.full((B, 1, R, hd), -np.inf, f32), g[:, :-1, :, :hd]], 1)
    K = np.concatenate([kva, kv[..., hd:]], 2)
    G = np.concatenate([ga, g[..., hd:]], 2)
    w = rb(softmax_rows(G, **kw))
    return rb(col_sum(rb(K * w), -2))


def test_pooling(rng):
    def r(shape, s=1.0):
        return rb((rng.standard_normal(shape) * s).astype(f32))

    # 48 windows: enough data that the controls below differ after bf16 rounding.
    kv, gate, ape = r((1, 48, 128, 64)), r((1, 48, 128, 64), 2.0), r((128, 64), 0.5)
    for dt in (mx.float32, mx.bfloat16):
        got = from_mx(_simple_compress_kv(mx.array(kv).astype(mx.bfloat16),
                                          mx.array(gate).astype(mx.bfloat16),
                                          mx.array(ape).astype(dt), 64))
        check(f"pool ratio 128, ape {dt}", pool_simple(kv, gate, ape), got)
    # The f32 weights themselves (what the bf16 rounding above mostly hides): mx.softmax over
    # axis -2 is composed ops with an f32 division.
    logits = (gate + ape).astype(f32)
    w = np.array(mx.softmax(mx.array(logits), axis=-2))
    check("softmax over axis -2 (f32 weights)", softmax_rows(logits), w)
    control("softmax by reciprocal multiply", softmax_rows(logits, divide=False), w)
    control("softmax with numpy exp", softmax_rows(logits, exp=lambda v: np.exp(v).astype(f32)), w)
    kv, gate, ape = r((1, 9, 4, 128)), r((1, 9, 4, 128), 2.0), r((4, 128), 0.5)
    ape32 = (rng.standard_normal((4, 128)) * 0.5).astype(f32)
    got = from_mx(_overlap_compress_kv(mx.array(kv).astype(mx.bfloat16),
                                       mx.array(gate).astype(mx.bfloat16), mx.array(ape32), 64))
    check("pool ratio 4 with overlap, f32 ape", pool_overlap(kv, gate, ape32, 64), got)
    control("pool 4: ape added unrounded", pool_overlap(kv, gate, ape32, 64, round_ape=False), got)


def yarn_freqs(dims, base, yarn):
    ar = (np.arange(0, dims, 2).astype(f32) / f32(dims)).astype(f32)
    inv = (f32(1) / np.array([_libm.powf(f32(base), a) for a in ar], f32)).astype(f32)
    if yarn:
        factor, omax, bf, bs = yarn
        corr = lambda n: dims * math.log(omax / (n * 2 * math.pi)) / (2 * math.log(base))  # noqa
        low, high = max(math.floor(corr(bf)), 0), min(math.ceil(corr(bs)), dims - 1)
        if low == high:
            high += 0.001
        ramp = ((np.arange(dims // 2).astype(f32) - f32(low)) / f32(high - low)).astype(f32)
        smooth = (f32(1) - np.clip(ramp, f32(0), f32(1))).astype(f32)
        inv = ((inv / f32(factor)) * (f32(1) - smooth) + inv * smooth).astype(f32)
    return (f32(1) / inv).astype(f32)


def rope(x, freqs, offset, scale_r=1, inverse=False, sincos=mlx_sincos):
    B, H, L, D = x.shape
    f = (freqs / f32(scale_r)).astype(f32)
    f = -f if inverse else f
    f = np.concatenate([np.full(D // 2 - len(f), np.inf, f32), f])
    inv = (f32(1) / f).astype(f32)
    pos = (np.arange(L).astype(f32) + f32(offset // scale_r)).astype(f32)
    th = (pos[:, None] * inv[None, :]).astype(f32)
    c, s = rb(sincos(th, False)), rb(sincos(th, True))
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = rb(rb(x1 * c) - rb(x2 * s))
    out[..., 1::2] = rb(rb(x1 * s) + rb(x2 * c))
    return out


def test_rope(rng):
    cases = [(10000, None), (160000, (16, 65536, 32, 1)), (160000, (4, 4096, 32, 1)),
             (50000, (40, 8192, 16, 2))]
    for base, yarn in cases:
        cfg = None if yarn is None else {"type": "yarn", "factor": yarn[0],
                                         "original_max_position_embeddings": yarn[1],
                                         "beta_fast": yarn[2], "beta_slow": yarn[3]}
        check(f"_freqs base {base} yarn {yarn}", yarn_freqs(64, base, yarn),
              np.array(DeepseekV4RoPE(64, base, cfg)._freqs))
    yarn = (16, 65536, 32, 1)
    cfg = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
           "beta_fast": 32, "beta_slow": 1}
    x = rb(rng.standard_normal((1, 4, 37, 128)).astype(f32))
    x[0, 0, 0, :8] = -0.0  # signed zeros in the no-rope half go through the arithmetic too
    for sc, off, inv in ((1, 129, False), (1, 5000, True), (4, 1200, False), (128, 896, False),
                         (1, 1_000_000, False)):
        r = DeepseekV4RoPE(64, 160000, cfg, freq_scale=sc)
        got = from_mx(r(mx.array(x).astype(mx.bfloat16), offset=off, inverse=inv))
        check(f"rope r={sc} offset={off} inverse={inv}", rope(x, yarn_freqs(64, 160000, yarn),
                                                              off, sc, inv), got)
    got = from_mx(DeepseekV4RoPE(64, 160000, cfg)(mx.array(x).astype(mx.bfloat16), offset=5000))
    control("rope without YaRN", rope(x, yarn_freqs(64, 160000, None), 5000), got)

    # The f32 angles' sin/cos (bf16 rounding hides most differences in the rope output).
    th = (rng.uniform(-2e5, 2e5, 200000)).astype(f32)
    for sine in (False, True):
        got = np.array((mx.sin if sine else mx.cos)(mx.array(th)))
        check(f"{'sin' if sine else 'cos'} (Cephes)", mlx_sincos(th, sine), got)
        control(f"numpy {'sin' if sine else 'cos'}", (np.sin(th) if sine else np.cos(th)), got)


def qmm_mx(X, Q, S, gs):
    M, K = X.shape
    out = np.zeros((M, Q.shape[0]), f32)
    for m in range(M):
        total = np.zeros(Q.shape[0], f32)
        for g in range(K // gs):
            gsum = np.zeros(Q.shape[0], f32)
            for k in range(g * gs, (g + 1) * gs):
                gsum = rb(gsum + rb(X[m, k] * Q[:, k]))
            total = rb(total + rb(S[:, g] * gsum))
        out[m] = total
    return out


def qmm_affine(X, Q, S, Bi, gs):
    M, K = X.shape
    out = np.zeros((M, Q.shape[0]), f32)
    for m in range(M):
        total = np.zeros(Q.shape[0], f32)
        for k in range(K):
            w = rb(rb(S[:, k // gs] * Q[:, k]) + Bi[:, k // gs])
            total = rb(total + rb(X[m, k] * w))
        out[m] = total
    return out


def test_quantized(rng):
    for mode, gs, b in (("mxfp8", 32, 8), ("mxfp4", 32, 4), ("affine", 64, 4), ("affine", 32, 8)):
        lin = nn.Linear(256, 64, bias=False)
        lin.weight = mx.array((rng.standard_normal((64, 256)) * 0.05).astype(f32)).astype(
            mx.bfloat16)
        ql = nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=b, mode=mode)
        x = mx.array(rng.standard_normal((1, 3, 256)).astype(f32)).astype(mx.bfloat16)
        got = from_mx(ql(x))[0]
        X = from_mx(x)[0]
        if mode == "affine":
            one = mx.ones(ql.scales.shape, dtype=mx.float32)
            Q = np.array(mx.dequantize(ql.weight, one, one * 0, group_size=gs, bits=b, mode=mode))
            ref = qmm_affine(X, Q, from_mx(ql.scales), from_mx(ql.biases), gs)
        else:
            unit = mx.full(ql.scales.shape, 127, dtype=mx.uint8)
            Q = from_mx(mx.dequantize(ql.weight, unit, group_size=gs, bits=b, mode=mode))
            sc = np.array(ql.scales).astype(np.int32)
            S = np.where(sc == 0, f32(2.0**-127), np.ldexp(f32(1), sc - 127)).astype(f32)
            ref = qmm_mx(X, Q, S, gs)
        check(f"quantized matmul {mode} gs{gs} {b}-bit", ref, got)
        W = from_mx(mx.dequantize(ql.weight, ql.scales, ql.get("biases"), group_size=gs, bits=b,
                                  mode=mode))
        acc = np.zeros((3, 64), f32)
        for k in range(256):
            acc = (acc + X[:, k, None] * W[None, :, k]).astype(f32)
        control(f"{mode}: dequantized weight + f32 matmul", rb(acc), got)


def mx_parts(w, scales, bits):
    """Element values (unit scales) and power-of-two scales of an mx weight [..., n, k]."""
    unit = mx.full(scales.shape, 127, dtype=mx.uint8)
    Q = from_mx(mx.dequantize(w, unit, group_size=32, bits=bits, mode=f"mxfp{bits}"))
    sc = np.array(scales).astype(np.int32)
    S = np.where(sc == 0, f32(2.0**-127), np.ldexp(f32(1), sc - 127)).astype(f32)
    return Q, S


def test_gather_qmm(rng):
    """mlx-vlm's quantized MoE and projection shapes on the CPU: every output row is the
    quantized matmul recipe of its own input row and selected weight (qmm_mx with M = 1). The
    row order, the sorting, the batch layout and how many rows share a call change nothing."""
    E, H, I, L, K = 8, 256, 128, 40, 2
    for bits in (4, 8):
        W = mx.array((rng.standard_normal((E, I, H)) * 0.05).astype(f32)).astype(mx.bfloat16)
        w, scales = mx.quantize(W, group_size=32, bits=bits, mode=f"mxfp{bits}")
        Q, S = mx_parts(w, scales, bits)
        x = mx.array(rng.standard_normal((1, L, H)).astype(f32)).astype(mx.bfloat16)
        X = from_mx(x)[0]
        inds = np.stack([rng.permutation(E)[:K] for _ in range(L)])[None].astype(np.uint32)
        ref = np.stack([np.stack([qmm_mx(X[t:t + 1], Q[e], S[e], 32)[0] for e in inds[0, t]])
                        for t in range(L)])
        kw = dict(transpose=True, group_size=32, bits=bits, mode=f"mxfp{bits}")
        # SwitchGLU, fewer than 64 selections: x [1, L, 1, 1, H], indices [1, L, K].
        got = from_mx(mx.gather_qmm(mx.expand_dims(x, (-2, -3)), w, scales,
                                    rhs_indices=mx.array(inds), **kw))[0, :, :, 0]
        check(f"gather_qmm mxfp{bits}, unsorted (SwitchGLU, L*K < 64)", ref, got)
        # SwitchGLU, 64 selections or more: _gather_sort, sorted_indices=True, _scatter_unsort.
        flat = inds.reshape(-1)
        order = np.argsort(flat, kind="stable")
        xs = mx.expand_dims(x, (-2, -3)).flatten(0, -3)[mx.array(order // K)]
        out = mx.gather_qmm(xs, w, scales, rhs_indices=mx.array(flat[order]),
                            sorted_indices=True, **kw)
        inv = np.argsort(order)
        got = from_mx(out[mx.array(inv)])[:, 0].reshape(L, K, I)
        check(f"gather_qmm mxfp{bits}, sorted indices (SwitchGLU, L*K >= 64)", ref, got)
        # The down projection of the 2..8-token path: per-expert inputs [1, L, K, 1, I].
        y = mx.array(rng.standard_normal((1, L, K, 1, H)).astype(f32)).astype(mx.bfloat16)
        Y = from_mx(y)[0, :, :, 0]
        ref_sel = np.stack([np.stack([qmm_mx(Y[t, j:j + 1], Q[inds[0, t, j]], S[inds[0, t, j]],
                                             32)[0] for j in range(K)]) for t in range(L)])
        got = from_mx(mx.gather_qmm(y, w, scales, rhs_indices=mx.array(inds), **kw))[0, :, :, 0]
        check(f"gather_qmm mxfp{bits}, per-expert inputs (exact_quantized_selected_linear)",
              ref_sel, got)
        acc = np.zeros((L, K, I), f32)
        Wd = (Q * np.repeat(S, 32, axis=-1)).astype(f32)
        for k in range(H):
            acc = (acc + X[:, None, k, None] * Wd[inds[0]][..., k]).astype(f32)
        control(f"gather_qmm mxfp{bits}: dequantized weight + f32 sum", rb(acc), ref)

    # singleton_quantized_linear (2..8-token calls when the input width is a multiple of 512):
    # gather_qmm of each position against expert 0 of the weight with a batch axis.
    W = mx.array((rng.standard_normal((64, 512)) * 0.05).astype(f32)).astype(mx.bfloat16)
    w, scales = mx.quantize(W, group_size=32, bits=8, mode="mxfp8")
    Q, S = mx_parts(w, scales, 8)
    x = mx.array(rng.standard_normal((1, 5, 512)).astype(f32)).astype(mx.bfloat16)
    got = from_mx(mx.gather_qmm(mx.expand_dims(x, (-2, -3)), w[None], scales[None],
                                rhs_indices=mx.zeros((1, 5, 1), dtype=mx.int32), transpose=True,
                                group_size=32, bits=8, mode="mxfp8")).reshape(5, 64)
    check("gather_qmm mxfp8 singleton (singleton_quantized_linear)", qmm_mx(from_mx(x)[0], Q, S,
                                                                           32), got)

    # A prefill-sized call: rows do not interact (M = 300 in one quantized_matmul).
    x = mx.array(rng.standard_normal((1, 300, 512)).astype(f32)).astype(mx.bfloat16)
    got = from_mx(mx.quantized_matmul(x, w, scales=scales, transpose=True, group_size=32, bits=8,
                                      mode="mxfp8"))[0]
    check("quantized_matmul mxfp8, M = 300 in one call", qmm_mx(from_mx(x)[0], Q, S, 32), got)

    # QuantizedMultiLinear (wo_a): quantized_matmul of x [1, G, L, f] against w [G, R, f].
    G, R, F, L = 2, 64, 256, 7
    W = mx.array((rng.standard_normal((G, R, F)) * 0.05).astype(f32)).astype(mx.bfloat16)
    w, scales = mx.quantize(W, group_size=32, bits=8, mode="mxfp8")
    Q, S = mx_parts(w, scales, 8)
    x = mx.array(rng.standard_normal((1, G, L, F)).astype(f32)).astype(mx.bfloat16)
    got = from_mx(mx.quantized_matmul(x, w, scales=scales, transpose=True, group_size=32, bits=8,
                                      mode="mxfp8"))[0]
    X = from_mx(x)[0]
    check("quantized_matmul mxfp8 batched weight (QuantizedMultiLinear)",
          np.stack([qmm_mx(X[g], Q[g], S[g], 32) for g in range(G)]), got)


def test_mean(rng):
    """mx.mean over an axis (HISA's block means): the dtype's sum times 1/n in that dtype."""
    for n in (10, 48, 64):
        x = rb((rng.standard_normal((1, 20, n, 128)) * 3).astype(f32))
        s = col_sum(np.moveaxis(x, 2, 0), 0)
        for dt in (mx.bfloat16, mx.float32):
            got = from_mx(mx.array(x).astype(dt).mean(axis=2))
            if dt == mx.bfloat16:
                ref, alt = rb(rb(s) * rb(f32(1.0 / n))), rb(rb(s) / f32(n))
            else:
                ref, alt = (s * f32(1.0 / n)).astype(f32), (s / f32(n)).astype(f32)
            check(f"mean over {n} rows, {dt}", ref, got)
            if n != 64:
                control(f"mean over {n} rows by division, {dt}", alt, got)


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 20261130
    rng = np.random.default_rng(seed)
    test_pooling(rng)
    test_rope(rng)
    test_quantized(rng)
    test_gather_qmm(rng)
    test_mean(rng)
    print(f"{'ALL PASS' if not FAILS else 'FAILED: ' + ', '.join(FAILS)} (seed {seed})")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
