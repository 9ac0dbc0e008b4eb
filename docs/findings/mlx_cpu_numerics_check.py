#!/usr/bin/env python
"""Bit-exact numpy emulation of MLX-CPU bf16 numerics (mlx==0.32.4 / mlx-cpu==0.32.4,
Linux x86-64, mlx_lm==0.32.2 llama).  Run:  /tmp/probe-venv/bin/python mlx_cpu_numerics_check.py

Every line "PASS"/"FAIL" compares an emulation against MLX bit for bit.
"CONTROL" lines run a deliberately *wrong* recipe and expect it to DIFFER from MLX;
they show that the test data is able to tell the candidate recipes apart.
See mlx-cpu-numerics.md next to this file for the prose.
"""
import ctypes
import sys
import time

import numpy as np
import mlx.core as mx
import mlx.nn as nn

f32 = np.float32
FAILS = []


# ----------------------------------------------------------------------------- primitives
def rb(x):
    """float32 -> bfloat16 exactly as mlx::core::_MLX_BFloat16(float):
    u += ((u >> 16) & 1) + 0x7FFF; keep high 16 bits (RNE); NaN -> 0x7FC0.
    Returned as float32 holding the bf16 value."""
    x = np.ascontiguousarray(np.asarray(x, dtype=f32))
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + ((u >> 16) & 1) + 0x7FFF) & 0xFFFF0000
    out = u.astype(np.uint32).view(f32).copy()
    out[np.isnan(x)] = np.uint32(0x7FC00000).view(f32)
    return out


def fmaf(a, b, c):
    """Correctly rounded float32 fma (glibc fmaf): exact product in double,
    TwoSum, round-to-odd in double, then one rounding to float."""
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64); c = np.asarray(c, np.float64)
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    shape = np.broadcast(p, c).shape
    s = np.broadcast_to(s, shape).copy(); e = np.broadcast_to(e, shape)
    fix = (e != 0) & ((s.view(np.int64) & 1) == 0) & np.isfinite(s)
    s = np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(f32)


def mlx_exp(xin):
    """mlx/backend/cpu/simd/math.h exp() (base_simd, N=1), float32 in/out."""
    x_init = np.asarray(xin, f32)
    with np.errstate(all="ignore"):
        x = x_init * f32(1.442695)
        ipart = np.floor(x.astype(np.float64) + 0.5).astype(f32)  # 0.5 is a double literal
        fpart = x - ipart
    p = np.full(x.shape, f32(1.535336188319500e-4))
    for c in (1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
              2.402264791363012e-1, 6.931472028550421e-1, 1.0):
        p = fmaf(p, fpart, f32(c))
    with np.errstate(all="ignore"):
        ip = np.where(np.isfinite(ipart), ipart, 0).astype(np.int64)
        two = (((ip + 127) << 23) & 0xFFFFFFFF).astype(np.uint32).view(f32)  # 2^ipart via bits
        res = two * p
    res = np.where(np.isnan(x_init), x_init, res)
    res = np.where(x_init > f32(88.0), f32(np.inf), res)
    res = np.where(x_init < f32(-88.0), f32(0), res)
    return res.astype(f32)


def mlx_sincos(xin, sine):
    """mlx/backend/cpu/simd/math.h sincos<Sine>() (Cephes), float32, valid for |x| <= 2^23
    (beyond that MLX calls libm sinf/cosf)."""
    xin = np.asarray(xin, f32)
    sign_sin = xin < 0
    x = np.abs(xin)
    y = x * f32(1.27323954473516)
    emm2 = y.astype(np.uint32)
    emm2 = (emm2 + np.uint32(1)) & np.uint32(0xFFFFFFFE)
    y = emm2.astype(f32)
    poly = (emm2 & np.uint32(2)) != 0
    x = fmaf(y, f32(-0.78515625), x)
    x = fmaf(y, f32(-2.4187564849853515625e-4), x)
    x = fmaf(y, f32(-3.77489497744594108e-8), x)
    sign_sin = sign_sin ^ ((emm2 & np.uint32(4)) != 0)
    sign_cos = ((emm2 - np.uint32(2)) & np.uint32(4)) != 0
    z = x * x
    y1 = fmaf(z, f32(2.443315711809948e-5), f32(-1.388731625493765e-3))
    y2 = fmaf(z, f32(-1.9515295891e-4), f32(8.3321608736e-3))
    y1 = fmaf(y1, z, f32(4.166664568298827e-2))
    y2 = fmaf(y2, z, f32(-1.6666654611e-1))
    y1 = y1 * z; y2 = y2 * z; y1 = y1 * z
    y2 = fmaf(x, y2, x)
    y1 = fmaf(z, f32(-0.5), y1)
    y1 = y1 + f32(1.0)
    if sine:
        ys = np.where(poly, y1, y2)
        return np.where(sign_sin, -ys, ys).astype(f32)
    yc = np.where(poly, y2, y1)
    return np.where(sign_cos, yc, -yc).astype(f32)


def sigmoid_bf16(x, round_exp=True):
    """detail::Sigmoid on bfloat16: y = 1/(1 + bf16(exp(|x|))); x<0 ? y : 1-y; -> bf16."""
    e = mlx_exp(np.abs(x))
    if round_exp:
        e = rb(e)  # simd::exp returns Simd<bfloat16_t>, i.e. rounded
    y = f32(1.0) / (f32(1.0) + e)
    return rb(np.where(x < 0, y, f32(1.0) - y))


def silu_bf16(x):
    return rb(x * sigmoid_bf16(x))


# ----------------------------------------------------------------------------- ops
def matmul_bf16(x, w, bias=None):
    """x[M,K] @ w[N,K].T: simd_gemm<bf16,float>: acc=0.0f; for k=0..K-1: acc += x*w (fp32,
    product exact); out = bf16(acc) or bf16(acc + bias) (addmm, alpha=beta=1)."""
    M, K = x.shape
    acc = np.zeros((M, w.shape[0]), f32)
    for k in range(K):
        acc = acc + x[:, k, None] * w[None, :, k]
    if bias is not None:
        acc = acc + bias[None, :]
    return rb(acc)


def rms_norm_bf16(x, w, eps):
    """fast::rms_norm fallback: x32=float(x); s=sequential fp32 sum(x32*x32) from 0;
    mean = s * float(1/N); r = 1.0f/sqrtf(mean + float(eps)); y = bf16(x32*r); out = bf16(y*w)."""
    N = x.shape[-1]
    sq = x * x
    s = np.zeros(x.shape[:-1], f32)
    for i in range(N):
        s = s + sq[..., i]
    r = f32(1.0) / np.sqrt(s * f32(1.0 / N) + f32(eps))
    return rb(rb(x * r[..., None]) * w)


def rope_inv_freq(dims, base=None, freqs=None):
    half = dims // 2
    if freqs is not None:
        return (f32(1.0) / np.asarray(freqs, f32)).astype(f32)
    c = f32(np.float32(np.log(np.float32(base))) / f32(half))  # (float)logf(base) / half
    return mlx_exp(np.arange(0, -half, -1, dtype=f32) * c)       # MLX fast exp, not libm


def rope_bf16(x, dims, offset, base=None, scale=1.0, freqs=None):
    """fast::rope fallback, traditional=False. x [B,H,L,D] bf16."""
    L = x.shape[-2]; half = dims // 2
    pos = (np.arange(L, dtype=f32) + f32(offset)) * f32(scale)
    theta = pos[:, None] * rope_inv_freq(dims, base, freqs)[None, :]
    c = rb(mlx_sincos(theta, False)); s = rb(mlx_sincos(theta, True))
    x1 = x[..., :half]; x2 = x[..., half:dims]
    o1 = rb(rb(x1 * c) - rb(x2 * s))
    o2 = rb(rb(x1 * s) + rb(x2 * c))
    return np.concatenate([o1, o2, x[..., dims:]], -1)


BF16_LOWEST = np.uint32(0xFF7F0000).view(f32)  # finfo(bfloat16).min = -3.3895e38


def sdpa_bf16(q, k, v, scale, causal, round_scale=True, exp=mlx_exp, round_scores=True):
    """fast::scaled_dot_product_attention fallback (CPU never has a fused kernel)."""
    B, Hq, L, D = q.shape; Hkv = k.shape[1]; S = k.shape[2]; rep = Hq // Hkv
    sc = rb(np.array([scale], f32))[0] if round_scale else f32(scale)
    qs = rb(q * sc)                                     # multiply(array(scale, bf16), q)
    kk = np.repeat(k, rep, axis=1); vv = np.repeat(v, rep, axis=1)  # q head h -> kv head h//rep
    s = np.zeros((B, Hq, L, S), f32)
    for d in range(D):                                  # bf16 matmul: sequential fp32 over D
        s = s + qs[:, :, :, d, None] * kk[:, :, None, :, d]
    if round_scores:
        s = rb(s)
    if causal:
        off = S - L
        m = np.arange(off, off + L)[:, None] >= np.arange(S)[None, :]
        s = np.where(m, s, BF16_LOWEST).astype(f32)
    mxv = s.max(-1, keepdims=True)                      # softmax(precise=True): fp32 inside
    e = exp(s - mxv)
    tot = np.zeros((B, Hq, L), f32)
    for j in range(S):
        tot = tot + e[..., j]
    p = rb(e * (f32(1.0) / tot)[..., None])
    o = np.zeros((B, Hq, L, D), f32)
    for j in range(S):                                  # bf16 matmul: sequential fp32 over S
        o = o + p[:, :, :, j, None] * vv[:, :, None, j, :]
    return rb(o)


# ----------------------------------------------------------------------------- harness
def to_mx(x):
    return mx.array(np.asarray(x, dtype=f32)).astype(mx.bfloat16)


def from_mx(a):
    return np.array(a.astype(mx.float32))


def rand_bf16(rng, shape, scale=1.0):
    return rb((rng.standard_normal(shape) * scale).astype(f32))


def ndiff(ref, got):
    ref = np.asarray(ref, f32); got = np.asarray(got, f32)
    same = (ref.view(np.uint32) == got.view(np.uint32)) | (np.isnan(ref) & np.isnan(got))
    n = int((~same).sum())
    if n == 0:
        return 0, 0
    ri = ref.view(np.int32).astype(np.int64); gi = got.view(np.int32).astype(np.int64)
    return n, int(np.abs(ri - gi)[~same].max() >> 16)


def check(name, ref, got):
    n, u = ndiff(ref, got)
    if n == 0:
        print(f"PASS     {name}  [{np.size(ref)} values bit-identical]")
    else:
        print(f"FAIL     {name}  [{n}/{np.size(ref)} differ, max {u} bf16 ulp]")
        FAILS.append(name)


def control(name, ref, got):
    n, u = ndiff(ref, got)
    if n:
        print(f"CONTROL  {name}: wrong recipe differs as expected [{n}/{np.size(ref)}]")
    else:
        print(f"CONTROL? {name}: wrong recipe NOT distinguished by this data")


# ----------------------------------------------------------------------------- tests
def test_matmul(rng):
    print("== 1. matmul / addmm (bf16)")
    shapes = [(1, 576, 192), (3, 576, 192), (129, 576, 192), (129, 1536, 192), (1, 1536, 576),
              (129, 576, 1536), (2, 576, 576), (17, 33, 19), (1, 64, 5), (300, 64, 40)]
    for (M, K, N) in shapes:
        x = rand_bf16(rng, (M, K)); w = rand_bf16(rng, (N, K), 0.05); b = rand_bf16(rng, (N,))
        X, W, Bm = to_mx(x), to_mx(w), to_mx(b)
        ref = matmul_bf16(x, w); refb = matmul_bf16(x, w, b)
        check(f"x@w.T        M={M} K={K} N={N}", ref, from_mx(X @ W.T))
        check(f"x[1,M,K]@w.T M={M} K={K} N={N}", ref[None], from_mx(X[None] @ W.T))
        check(f"addmm(b,x,w.T)      M={M} K={K} N={N}", refb, from_mx(mx.addmm(Bm, X, W.T)))
        check(f"addmm(b,x[1],w.T)   M={M} K={K} N={N}", refb[None], from_mx(mx.addmm(Bm, X[None], W.T)))
        check(f"nn.Linear(bias) 3-D M={M} K={K} N={N}", refb[None],
              from_mx(_linear(w, b)(X[None])))
    # controls
    M, K, N = 129, 1536, 192
    x = rand_bf16(rng, (M, K)); w = rand_bf16(rng, (N, K), 0.05); b = rand_bf16(rng, (N,))
    got = from_mx(to_mx(x) @ to_mx(w).T)
    control("fp64 accumulation", rb((x.astype(np.float64) @ w.T.astype(np.float64)).astype(f32)), got)
    acc = np.zeros((M, N), f32)
    for k in reversed(range(K)):
        acc = acc + x[:, k, None] * w[None, :, k]
    control("reversed-k fp32 accumulation", rb(acc), got)
    # adversarial order probe: columns come in pairs whose products cancel exactly
    # (x_k' = -x_k, w[:,k'] = w[:,k]) at random positions, so the exact result is 0 and what
    # MLX returns is purely the fp32 rounding residue of its summation order.
    for (M, K, N) in [(1, 576, 192), (3, 1536, 64), (129, 576, 192)]:
        xh = rb(rng.standard_normal((M, K // 2)) * 4096); wh = rb(rng.standard_normal((N, K // 2)))
        perm = rng.permutation(K)
        xa = np.concatenate([xh, -xh], 1)[:, perm]; wa = np.concatenate([wh, wh], 1)[:, perm]
        got = from_mx(to_mx(xa) @ to_mx(wa).T)
        check(f"x@w.T cancellation probe M={M} K={K} N={N}", matmul_bf16(xa, wa), got)
        acc4 = np.zeros((M, 4, N), f32)            # 4 interleaved accumulators (newer MLX gemv)
        for k in range(0, K, 4):
            acc4 = acc4 + xa[:, k:k + 4, None] * wa[:, k:k + 4].T[None]
        control(f"4 interleaved accumulators M={M} K={K}",
                rb(((acc4[:, 0] + acc4[:, 1]) + acc4[:, 2]) + acc4[:, 3]), got)
        acc = np.zeros((M, N), f32)
        for k0 in range(0, K, 16):                 # per-16 partial sums added to the total
            part = np.zeros((M, N), f32)
            for k in range(k0, min(k0 + 16, K)):
                part = part + xa[:, k, None] * wa[None, :, k]
            acc = acc + part
        control(f"16-blocked partial sums M={M} K={K}", rb(acc), got)
        control(f"numpy f32 matmul M={M} K={K}", rb(xa @ wa.T), got)
    control("addmm as bf16(bf16(x@w.T)+b)", rb(matmul_bf16(x, w) + b),
            from_mx(mx.addmm(to_mx(b), to_mx(x), to_mx(w).T)))


def _linear(w, b):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    lin.weight = to_mx(w)
    if b is not None:
        lin.bias = to_mx(b)
    return lin


def test_rms(rng):
    print("== 2. fast.rms_norm")
    for shape, sc in [((1, 576), 1.0), ((3, 576), 1.0), ((1, 129, 576), 1.0), ((1, 129, 576), 0.01),
                      ((1, 7, 576), 30.0), ((2, 5, 1536), 1.0)]:
        x = rand_bf16(rng, shape, sc); w = rb(rand_bf16(rng, (shape[-1],), 0.3) + f32(1.0))
        check(f"rms_norm bf16 {shape} x-scale {sc}", rms_norm_bf16(x, w, 1e-5),
              from_mx(mx.fast.rms_norm(to_mx(x), to_mx(w), 1e-5)))
    rn = nn.RMSNorm(576, eps=1e-5); w = rb(rand_bf16(rng, (576,), 0.3) + f32(1)); rn.weight = to_mx(w)
    x = rand_bf16(rng, (1, 129, 576))
    check("nn.RMSNorm(576) bf16 [1,129,576]", rms_norm_bf16(x, w, 1e-5), from_mx(rn(to_mx(x))))
    # fp32 input exposes the fp32 intermediate (no bf16 rounding hides it)
    x = rng.standard_normal((4000, 576)).astype(f32)
    got = np.array(mx.fast.rms_norm(mx.array(x), mx.ones((576,)), 1e-5))
    sq = x * x; s = np.zeros(4000, f32)
    for i in range(576):
        s = s + sq[:, i]
    r = f32(1) / np.sqrt(s * f32(1.0 / 576) + f32(1e-5))
    check("rms_norm fp32 intermediate x*r (seq sum, *f32(1/N), 1/sqrt)", x * r[:, None], got)
    control("mean = sum / N", x * (f32(1) / np.sqrt(s / f32(576) + f32(1e-5)))[:, None], got)
    control("numpy pairwise sum", x * (f32(1) / np.sqrt(sq.sum(-1) * f32(1.0 / 576) + f32(1e-5)))[:, None], got)
    control("rsqrt in double", x * (1 / np.sqrt((s * f32(1.0 / 576) + f32(1e-5)).astype(np.float64))).astype(f32)[:, None], got)


def _powf():
    libm = ctypes.CDLL("libm.so.6")
    libm.powf.restype = ctypes.c_float
    libm.powf.argtypes = [ctypes.c_float, ctypes.c_float]
    return libm.powf


def llama3_freqs(dims, base, factor, lf, hf, old):
    """Llama3RoPE._freqs (mlx_lm rope_utils) in fp32; power = glibc powf (NOT numpy's)."""
    powf = _powf()
    ex = (np.arange(0, dims, 2) / np.float32(dims)).astype(f32)
    freqs = np.array([powf(float(f32(base)), float(e)) for e in ex], f32)
    wav = (f32(2 * np.pi) * freqs).astype(f32)
    freqs2 = np.where(wav > f32(old / lf), freqs * f32(factor), freqs).astype(f32)
    med = (wav > f32(old / hf)) & (wav < f32(old / lf))
    sm = ((f32(old) / wav - f32(lf)) / f32(hf - lf)).astype(f32)
    smf = (freqs2 / ((f32(1) - sm) / f32(factor) + sm)).astype(f32)
    return np.where(med, smf, freqs2).astype(f32)


def test_rope(rng):
    print("== 3. fast.rope (traditional=False)")
    for (B, H, L) in [(1, 9, 1), (1, 3, 1), (1, 9, 3), (1, 3, 129), (1, 9, 129), (2, 3, 17)]:
        for off in (0, 5, 2047, 100000):
            x = rand_bf16(rng, (B, H, L, 64), 2.0)
            got = from_mx(mx.fast.rope(to_mx(x), 64, traditional=False, base=100000.0, scale=1.0, offset=off))
            check(f"rope base=1e5 [B{B},H{H},L{L},64] offset={off}", rope_bf16(x, 64, off, base=100000.0), got)
    for base in (10000.0, 500000.0, 1e6):
        x = rand_bf16(rng, (1, 2, 4096, 64), 2.0)
        got = from_mx(mx.fast.rope(to_mx(x), 64, traditional=False, base=base, scale=1.0, offset=0))
        check(f"rope base={base:g} L=4096", rope_bf16(x, 64, 0, base=base), got)
    x = rand_bf16(rng, (1, 2, 4096, 64), 2.0)
    got = from_mx(mx.fast.rope(to_mx(x), 64, traditional=False, base=100000.0, scale=1.0, offset=0))
    inv_pow = (f32(1) / np.power(np.float64(100000.0), np.arange(0, 64, 2) / 64.0)).astype(f32)
    control("inv_freq = 1/base^(2i/d) (exact pow)", rope_bf16(x, 64, 0, freqs=f32(1) / inv_pow), got)
    theta = (np.arange(4096, dtype=f32)[:, None] * rope_inv_freq(64, 100000.0)[None, :])
    c = rb(np.cos(theta.astype(np.float64)).astype(f32)); s = rb(np.sin(theta.astype(np.float64)).astype(f32))
    x1, x2 = x[..., :32], x[..., 32:]
    control("libm-accurate cos/sin", np.concatenate([rb(rb(x1 * c) - rb(x2 * s)), rb(rb(x1 * s) + rb(x2 * c))], -1), got)
    # llama3 scaling: freqs path
    from mlx_lm.models.rope_utils import initialize_rope
    for base, factor in [(500000.0, 32.0), (500000.0, 8.0)]:
        cfg = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
        r = initialize_rope(64, base, False, cfg, 131072)
        fr = np.array(r._freqs)
        check(f"Llama3RoPE._freqs recomputed (powf) base={base:g} factor={factor:g}",
              llama3_freqs(64, base, factor, 1.0, 4.0, 8192), fr)
        for L, off in [(1, 0), (1, 2047), (129, 0), (129, 2047), (2048, 30000)]:
            x = rand_bf16(rng, (1, 9, L, 64), 2.0)
            check(f"rope llama3 freqs factor={factor:g} L={L} offset={off}",
                  rope_bf16(x, 64, off, freqs=fr), from_mx(r(to_mx(x), offset=off)))


def test_elementwise(rng):
    print("== 4. elementwise bf16")
    allb = (np.arange(65536, dtype=np.uint32) << 16).view(f32)
    fin = allb[np.isfinite(allb)]
    X = to_mx(fin)
    check("exp (all finite bf16)", rb(mlx_exp(fin)), from_mx(mx.exp(X)))
    check("sigmoid (all finite bf16)", sigmoid_bf16(fin), from_mx(mx.sigmoid(X)))
    check("nn.silu compiled (all finite bf16)", silu_bf16(fin), from_mx(nn.silu(X)))
    check("x*mx.sigmoid(x) eager (all finite bf16)", silu_bf16(fin), from_mx(X * mx.sigmoid(X)))
    control("sigmoid without bf16 rounding of exp", sigmoid_bf16(fin, round_exp=False), from_mx(mx.sigmoid(X)))
    with np.errstate(over="ignore"):
        lib = rb((1 / (1 + np.exp(-fin.astype(np.float64)))).astype(f32))
    control("sigmoid = bf16(1/(1+exp(-x))) libm", lib, from_mx(mx.sigmoid(X)))
    xf = np.concatenate([rng.uniform(-90, 90, 1_000_000), rng.standard_normal(500_000) * 1e-3]).astype(f32)
    check("exp fp32 (1.5M random)", mlx_exp(xf), np.array(mx.exp(mx.array(xf))))
    xs = np.concatenate([rng.uniform(-5000, 5000, 1_000_000), rng.uniform(-10, 10, 500_000)]).astype(f32)
    check("sin fp32 (1.5M random)", mlx_sincos(xs, True), np.array(mx.sin(mx.array(xs))))
    check("cos fp32 (1.5M random)", mlx_sincos(xs, False), np.array(mx.cos(mx.array(xs))))
    a = rand_bf16(rng, (1000, 1000)); b = rand_bf16(rng, (1000, 1000), 1e-3)
    A, Bm = to_mx(a), to_mx(b)
    check("add bf16", rb(a + b), from_mx(A + Bm))
    check("subtract bf16", rb(a - b), from_mx(A - Bm))
    check("multiply bf16", rb(a * b), from_mx(A * Bm))
    from mlx_lm.models.activations import swiglu
    g = rand_bf16(rng, (1, 129, 1536), 2.0); u = rand_bf16(rng, (1, 129, 1536))
    check("mlx_lm swiglu(gate,up) compiled", rb(silu_bf16(g) * u), from_mx(swiglu(to_mx(g), to_mx(u))))


def test_embedding(rng):
    print("== 5. embedding")
    E = rand_bf16(rng, (1000, 576))
    emb = nn.Embedding(1000, 576); emb.weight = to_mx(E)
    ids = rng.integers(0, 1000, (1, 129))
    check("nn.Embedding gather", E[ids], from_mx(emb(mx.array(ids))))


def test_sdpa(rng):
    print("== 6. fast.scaled_dot_product_attention")
    cases = [(9, 3, 1, 1, 64, None), (9, 3, 1, 300, 64, None), (9, 3, 1, 300, 64, "causal"),
             (9, 3, 7, 7, 64, "causal"), (9, 3, 129, 129, 64, "causal"), (9, 3, 5, 2052, 64, "causal"),
             (9, 3, 129, 400, 64, "causal"), (9, 3, 3, 10, 64, None), (9, 9, 3, 10, 64, "causal"),
             (8, 2, 9, 40, 128, "causal")]
    for (Hq, Hkv, L, S, D, mask) in cases:
        q = rand_bf16(rng, (1, Hq, L, D), 2.0); k = rand_bf16(rng, (1, Hkv, S, D), 2.0); v = rand_bf16(rng, (1, Hkv, S, D))
        scale = D ** -0.5
        got = from_mx(mx.fast.scaled_dot_product_attention(to_mx(q), to_mx(k), to_mx(v), scale=scale, mask=mask))
        check(f"sdpa Hq={Hq} Hkv={Hkv} L={L} S={S} D={D} mask={mask}", sdpa_bf16(q, k, v, scale, mask == "causal"), got)
    # the softmax inside (mx.softmax(..., precise=True) on bf16) on its own, many rows
    xs = rand_bf16(rng, (4000, 300), 3.0)
    e = mlx_exp(xs - xs.max(-1, keepdims=True)); tot = np.zeros(4000, f32)
    for j in range(300):
        tot = tot + e[:, j]
    got = from_mx(mx.softmax(to_mx(xs), axis=-1, precise=True))
    check("softmax(bf16, precise=True) [4000,300]", rb(e * (f32(1) / tot)[:, None]), got)
    e2 = np.exp((xs - xs.max(-1, keepdims=True)).astype(np.float64)).astype(f32); tot2 = np.zeros(4000, f32)
    for j in range(300):
        tot2 = tot2 + e2[:, j]
    control("softmax with libm-accurate exp", rb(e2 * (f32(1) / tot2)[:, None]), got)
    control("softmax as bf16(e / sum) (divide, not *1/sum)", rb(e / tot[:, None]), got)
    Hq, Hkv, L, S, D = 8, 2, 64, 300, 128
    q = rand_bf16(rng, (1, Hq, L, D), 2.0); k = rand_bf16(rng, (1, Hkv, S, D), 2.0); v = rand_bf16(rng, (1, Hkv, S, D))
    got = from_mx(mx.fast.scaled_dot_product_attention(to_mx(q), to_mx(k), to_mx(v), scale=D ** -0.5, mask="causal"))
    control("D=128 scale kept fp32 (not rounded to bf16)", sdpa_bf16(q, k, v, D ** -0.5, True, round_scale=False), got)
    control("scores kept fp32 (no bf16 rounding)", sdpa_bf16(q, k, v, D ** -0.5, True, round_scores=False), got)


# ----------------------------------------------------------------------------- end to end
def np_llama_step(W, cfg, ids, kc, vc, offset, freqs):
    """One mlx_lm llama forward chunk (B=1) in numpy; kc/vc: per-layer lists of [1,Hkv,S,D]."""
    H, Hkv, D, eps = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["eps"]
    L = ids.shape[1]
    h = W["model.embed_tokens.weight"][ids[0]]
    taps = []
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        xn = rms_norm_bf16(h, W[p + "input_layernorm.weight"], eps)
        taps.append(xn)
        bq = W.get(p + "self_attn.q_proj.bias"); bk = W.get(p + "self_attn.k_proj.bias")
        bv = W.get(p + "self_attn.v_proj.bias"); bo = W.get(p + "self_attn.o_proj.bias")
        q = matmul_bf16(xn, W[p + "self_attn.q_proj.weight"], bq).reshape(L, H, D).transpose(1, 0, 2)[None]
        k = matmul_bf16(xn, W[p + "self_attn.k_proj.weight"], bk).reshape(L, Hkv, D).transpose(1, 0, 2)[None]
        v = matmul_bf16(xn, W[p + "self_attn.v_proj.weight"], bv).reshape(L, Hkv, D).transpose(1, 0, 2)[None]
        if freqs is None:
            q = rope_bf16(q, D, offset, base=cfg["theta"]); k = rope_bf16(k, D, offset, base=cfg["theta"])
        else:
            q = rope_bf16(q, D, offset, freqs=freqs); k = rope_bf16(k, D, offset, freqs=freqs)
        kc[i] = k if kc[i] is None else np.concatenate([kc[i], k], 2)
        vc[i] = v if vc[i] is None else np.concatenate([vc[i], v], 2)
        o = sdpa_bf16(q, kc[i], vc[i], D ** -0.5, causal=L > 1)
        o = o[0].transpose(1, 0, 2).reshape(L, H * D)
        h = rb(h + matmul_bf16(o, W[p + "self_attn.o_proj.weight"], bo))
        xn2 = rms_norm_bf16(h, W[p + "post_attention_layernorm.weight"], eps)
        g = matmul_bf16(xn2, W[p + "mlp.gate_proj.weight"]); u = matmul_bf16(xn2, W[p + "mlp.up_proj.weight"])
        h = rb(h + matmul_bf16(rb(silu_bf16(g) * u), W[p + "mlp.down_proj.weight"]))
    h = rms_norm_bf16(h, W["model.norm.weight"], eps)
    return matmul_bf16(h, W["model.embed_tokens.weight"]), taps


def test_end_to_end(rng, attention_bias, rope_scaling):
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache
    tag = f"bias={attention_bias} rope={'llama3' if rope_scaling else 'default'}"
    print(f"== 7. end-to-end tiny llama (SmolLM-135M geometry, 2 layers) {tag}")
    args = llama.ModelArgs(model_type="llama", hidden_size=576, num_hidden_layers=2, intermediate_size=1536,
                           num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=512,
                           rope_theta=100000.0, tie_word_embeddings=True, attention_bias=attention_bias,
                           rope_scaling=rope_scaling, max_position_embeddings=8192)
    mx.random.seed(int(rng.integers(1 << 30)))
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    newp = []
    for name, p in tree_flatten(model.parameters()):   # make norms / biases non-trivial
        if name.endswith("norm.weight"):
            p = (1.0 + 0.3 * mx.random.normal(p.shape)).astype(mx.bfloat16)
        elif name.endswith("bias"):
            p = (0.5 * mx.random.normal(p.shape)).astype(mx.bfloat16)
        newp.append((name, p))
    model.load_weights(newp)
    mx.eval(model.parameters())
    W = {k: from_mx(v) for k, v in tree_flatten(model.parameters())}
    freqs = np.array(model.layers[0].self_attn.rope._freqs) if rope_scaling else None
    cache = make_prompt_cache(model)
    taps_mx = []
    for li, layer in enumerate(model.layers):            # record the attention input (the "tap")
        orig = layer.input_layernorm

        class Tap(nn.Module):
            def __init__(self, inner):
                super().__init__(); self.inner = inner

            def __call__(self, x):
                y = self.inner(x); taps_mx.append(y); return y
        layer.input_layernorm = Tap(orig)
    cfg = dict(heads=9, kv_heads=3, head_dim=64, eps=1e-5, layers=2, theta=100000.0)
    kc = [None, None]; vc = [None, None]
    ids_all = rng.integers(0, 512, (1, 131))
    offset = 0
    for chunk in [(0, 100), (100, 129), (129, 130), (130, 131)]:    # prefill 100, prefill 29, decode, decode
        ids = ids_all[:, chunk[0]:chunk[1]]
        taps_mx.clear()
        logits = from_mx(model(mx.array(ids), cache=cache))[0]
        ref, taps = np_llama_step(W, cfg, ids, kc, vc, offset, freqs)
        L = ids.shape[1]
        check(f"e2e logits   offset={offset:3d} L={L:3d} {tag}", ref, logits)
        for li in range(2):
            check(f"e2e attn-input tap layer{li} offset={offset} L={L}", taps[li], from_mx(taps_mx[li])[0])
        offset += L
    for li in range(2):
        kx = from_mx(cache[li].keys[..., :offset, :]); vx = from_mx(cache[li].values[..., :offset, :])
        check(f"e2e KV cache keys   layer{li} (T={offset}) {tag}", kc[li], kx)
        check(f"e2e KV cache values layer{li} (T={offset}) {tag}", vc[li], vx)


def main():
    t0 = time.time()
    print(f"mlx {mx.__version__}  device {mx.default_device()}")
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 20240607
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    test_matmul(rng)
    test_rms(rng)
    test_rope(rng)
    test_elementwise(rng)
    test_embedding(rng)
    test_sdpa(rng)
    test_end_to_end(rng, attention_bias=False, rope_scaling=None)
    test_end_to_end(rng, attention_bias=True,
                    rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"})
    print(f"\n{'ALL PASS' if not FAILS else 'FAILURES: ' + ', '.join(FAILS)}   ({time.time() - t0:.1f}s)")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
