"""Triton kernels of the mHC family (hc_mult 4, bf16 residual).

Numerics shared by every kernel, so that one op's bits are the other ops' bits
and never depend on M, the launch grid or the config:

* K partition: hidden is cut into 16 slices of ``DS = D / 16`` columns; slice s
  of a flattened ``[4 * D]`` row holds the four streams' columns
  ``[s * DS, (s + 1) * DS)``. A slice is walked in chunks of ``BK`` columns
  (``mhc_weights.slice_geometry``), streams 0..3 inside a chunk,
  so one loaded chunk feeds the projection, the sums of squares and the
  collapse.
* Projection: compensated BF16x3, three ``tl.dot`` per (chunk, stream) into
  separate fp32 accumulators (hi: a fresh MMA chain per dot, added in fp32
  registers; mid, lo: MMA chains over the slice, see ``_dot3``); slice partial =
  ``(hi + mid) + lo``; the 16 partials summed in slice order. ``BLOCK_M >= 16 * num_warps`` in every config,
  so Hopper always lowers the dots to the same wgmma chain.
* Sums of squares (of the residual, and of the rounded collapse for the norm):
  fp32 elementwise accumulation per chunk position (explicit ``tl.fma``, which
  rounds once on the GPU and in the interpreter alike), then a fixed pairwise tree
  over the BK positions (``_row_sum``; ``tl.sum`` is avoided because its tree
  follows the register layout, which changes with the config), then the slice
  sums in slice order.
* Sinkhorn: a row block at once as [BM, 4] tiles per comb row, explicit reduction trees.

Kernels upcast right after loading (the CPU interpreter computes bf16 on raw
bits) and round with ``rne_bf16`` before bf16 stores. Every launch passes
``LAUNCH_OPTIONS`` (``enable_fp_fusion=False``): products and sums round one by
one, as in eager torch and the interpreter, and no compile variant (a config, a
constexpr flag) can contract a different product into an FMA than another. M is a runtime argument
(``do_not_specialize``), offsets are int64. Launch configs come from
``dsv41_passes.tuning.tactic``; the defaults are M-independent and
``CANDIDATES`` lists what a tuner may time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import tactic
from ..mhc_weights import NUM_SLICES, slice_geometry
from ..mhc_weights import NP_DEFAULT as NP
from .common import INTERPRET, rne_bf16

HC = 4
NMIX = (2 + HC) * HC  # 24 mix columns: pre[4], post[4], comb[4][4]

_S = tl.constexpr(NUM_SLICES)
_NMIX = tl.constexpr(NMIX)
_NP = tl.constexpr(NP)

# Every projection config keeps BLOCK_M >= 16 * num_warps: on Hopper each warpgroup then owns 64 rows
# and the dots lower to the same wgmma m64n32k16 chain, so a row's bits do not depend on the config.
# Defaults: the configs the H200 tuning run of 2026-11-29 picked at M = 65536, 4096 and 128 alike
# (benchmarks/results/mhc-tune-NVIDIA_H200-2026-11-29.json).
DEFAULTS: dict[str, dict] = {
    "mhc_post": dict(BLOCK_R=1, BLOCK_D=1024, num_warps=8),
    "mhc_collapse": dict(BLOCK_R=32, num_warps=4),
    "mhc_stats": dict(BLOCK_M=64, num_warps=4, num_stages=3),
    "mhc_pre": dict(BLOCK_M=64, num_warps=4, num_stages=3),
    "mhc_boundary": dict(BLOCK_M=64, num_warps=4, num_stages=4),
}
# Under the CPU interpreter every program costs milliseconds: fewer, larger tiles. Every config computes
# the same bits (see the module docstring), so this changes the speed of the tests, not their results.
INTERPRETER_DEFAULTS: dict[str, dict] = {
    "mhc_post": dict(BLOCK_R=64, BLOCK_D=1024, num_warps=4),
    "mhc_collapse": dict(BLOCK_R=256, num_warps=4),
    "mhc_stats": dict(BLOCK_M=512, num_warps=8, num_stages=1),
    "mhc_pre": dict(BLOCK_M=512, num_warps=8, num_stages=1),
    "mhc_boundary": dict(BLOCK_M=512, num_warps=8, num_stages=1),
}


# Compile options of every launch (see the module docstring: no FMA contraction).
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)


def default_config(op: str) -> dict:
    """The op's fixed, M-independent launch config (the only one batch-invariant mode uses)."""
    return (INTERPRETER_DEFAULTS if INTERPRET else DEFAULTS)[op]


_PROJ_CANDIDATES = [
    dict(BLOCK_M=bm, num_warps=w, num_stages=st) for bm, w in ((64, 4), (128, 4), (128, 8)) for st in (2, 3, 4)
]
# 256 rows halve the L2 traffic of the weight parts per row; the boundary's extra tiles do not fit there
_WIDE = [dict(BLOCK_M=256, num_warps=8, num_stages=st) for st in (2, 3)]
# the four streams of a chunk as one dot operand: the sm_90 build issues 3 wgmma groups a chunk and
# waits once (12 and 10 unstacked); the hi part's MMA chains grow from BK to 4 BK products
_STACKED = [dict(c, STACK=True) for c in _PROJ_CANDIDATES + _WIDE]
CANDIDATES: dict[str, list[dict]] = {
    "mhc_post": [
        dict(BLOCK_R=r, BLOCK_D=b, num_warps=w)
        for r in (1, 2, 4)
        for b in (512, 1024, 2048)
        for w in (4, 8)
        if r * b <= 4096
    ],
    "mhc_collapse": [dict(BLOCK_R=r, num_warps=w) for r in (16, 32, 64) for w in (4, 8)],
    "mhc_stats": _PROJ_CANDIDATES + _WIDE + _STACKED,
    "mhc_pre": _PROJ_CANDIDATES + _WIDE + _STACKED,
    "mhc_boundary": _PROJ_CANDIDATES,
}


def unsupported(res: torch.Tensor) -> str | None:
    """Why the kernels cannot take a residual ``[M, n, d]`` (None when they can)."""
    if res.dtype != torch.bfloat16:
        return f"residual dtype {res.dtype} (kernels are bf16)"
    if res.dim() != 3 or res.shape[1] != HC:
        return f"hc_mult {res.shape[1] if res.dim() == 3 else '?'} (kernels are written for {HC})"
    d = res.shape[2]
    if d % NUM_SLICES:
        return f"hidden {d} is not a multiple of {NUM_SLICES}"
    if res.device.type == "cuda" and slice_geometry(d)[1] < 16:
        return f"hidden {d}: tensor-core chunks need hidden/16 divisible by 16"
    if res.stride(2) != 1 or res.stride(1) != d:
        return "residual streams are not contiguous (need strides [*, hidden, 1])"
    return None


def _norm_block(d: int, rows: int) -> int:
    """Columns per step of the in-place normalisation: <= 4096 elements a tile (no spills)."""
    return max(1, min(d & -d, 4096 // rows))


# ----------------------------------------------------------------------------- shared arithmetic
@triton.jit
def _round_bf16(x, INTERP: tl.constexpr):
    """fp32 -> (bf16 RNE value as bf16, the same value as fp32): for values that are stored AND reused.

    ``rne_bf16`` alone is the identity on GPU (the store rounds), so a reused value must go through
    an explicit bf16 conversion to be the rounded one on both platforms."""
    b = rne_bf16(x, INTERP).to(tl.bfloat16)
    return b, b.to(tl.float32)


@triton.jit
def _combine(yv, r0, r1, r2, r3, pk, c0k, c1k, c2k, c3k):
    """post: ``pk * y + sum_j cjk * r_j`` (streams in order) in fp32."""
    acc = c0k * r0
    acc += c1k * r1
    acc += c2k * r2
    acc += c3k * r3
    return pk * yv + acc


@triton.jit
def _collapse(h0, h1, h2, h3, p0, p1, p2, p3):
    """collapse: ``sum_j p_j * h_j`` (streams in order) in fp32."""
    acc = p0 * h0
    acc += p1 * h1
    acc += p2 * h2
    acc += p3 * h3
    return acc


@triton.jit
def _halve(t, R: tl.constexpr, W: tl.constexpr):
    a, b = tl.split(tl.reshape(t, (R, W // 2, 2)))
    return a + b


@triton.jit
def _row_sum(t, R: tl.constexpr, W: tl.constexpr):
    """``[R, W] -> [R]``: pairwise tree over adjacent columns, independent of the register layout."""
    if W >= 64:
        t = _halve(t, R, 64)
    if W >= 32:
        t = _halve(t, R, 32)
    if W >= 16:
        t = _halve(t, R, 16)
    if W >= 8:
        t = _halve(t, R, 8)
    if W >= 4:
        t = _halve(t, R, 4)
    if W >= 2:
        t = _halve(t, R, 2)
    return tl.reshape(t, (R,))


@triton.jit
def _softmax4(z, R: tl.constexpr):
    e = tl.exp(z - tl.max(z, axis=1)[:, None])
    return e / _row_sum(e, R, 4)[:, None]


@triton.jit
def _normalize_rows(x_ptr, w_ptr, rows, rmask, stride_x, sumsq, eps,
                    D: tl.constexpr, XB: tl.constexpr, CACHE: tl.constexpr, INTERP: tl.constexpr):
    """x <- bf16(w * (x * rsqrt(sumsq / D + eps))) in place (x was written by this launch; CACHE ".cg"
    reads it from L2 when other programs wrote parts of it)."""
    rstd = (1.0 / tl.sqrt_rn(sumsq / D + eps))[:, None]
    for c in range(D // XB):
        cols = c * XB + tl.arange(0, XB)
        ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
        xv = tl.load(ptrs, mask=rmask[:, None], other=0.0, cache_modifier=CACHE).to(tl.float32)
        wv = tl.load(w_ptr + cols).to(tl.float32)
        out = rne_bf16(wv[None, :] * (xv * rstd), INTERP)
        tl.store(ptrs, out.to(x_ptr.dtype.element_ty), mask=rmask[:, None])


# ----------------------------------------------------------------------------- post
@triton.jit(do_not_specialize=["M"])
def _post_kernel(
    y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, M,
    stride_y, stride_r, stride_o,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    rr = rows[:, None]
    yv = tl.load(y_ptr + rr * stride_y + cols[None, :], mask=mask, other=0.0,
                 eviction_policy="evict_first").to(tl.float32)
    rbase = res_ptr + rr * stride_r + cols[None, :]
    r0 = tl.load(rbase, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    r1 = tl.load(rbase + D, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    r2 = tl.load(rbase + 2 * D, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    r3 = tl.load(rbase + 3 * D, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    rm = rows < M
    cb = comb_ptr + rows * 16
    pb = post_ptr + rows * 4
    obase = out_ptr + rr * stride_o + cols[None, :]
    for k in tl.static_range(4):
        out = _combine(
            yv, r0, r1, r2, r3,
            tl.load(pb + k, mask=rm, other=0.0)[:, None],
            tl.load(cb + k, mask=rm, other=0.0)[:, None],
            tl.load(cb + 4 + k, mask=rm, other=0.0)[:, None],
            tl.load(cb + 8 + k, mask=rm, other=0.0)[:, None],
            tl.load(cb + 12 + k, mask=rm, other=0.0)[:, None],
        )
        tl.store(obase + k * D, rne_bf16(out, INTERP).to(out_ptr.dtype.element_ty), mask=mask)


def mhc_post(y, res, post, comb, *, batch_invariant: bool, config: dict | None = None) -> torch.Tensor:
    m, n, d = res.shape
    if n != HC:
        raise ValueError(f"the Triton mhc_post kernel is written for hc_mult {HC}, got {n}")
    if res.stride(2) != 1 or res.stride(1) != d or y.stride(-1) != 1:
        raise ValueError("mhc_post: y and the residual streams must be contiguous along hidden")
    post, comb = post.contiguous(), comb.contiguous()
    out = torch.empty((m, n, d), dtype=res.dtype, device=res.device)
    if m == 0:
        return out
    cfg = config or tactic("mhc_post", m, dict(d=d, n=n), default_config("mhc_post"), batch_invariant=batch_invariant)
    block_d = min(cfg["BLOCK_D"], triton.next_power_of_2(d))
    grid = (triton.cdiv(m, cfg["BLOCK_R"]), triton.cdiv(d, block_d))
    _post_kernel[grid](
        y, res, post, comb, out, m, y.stride(0), res.stride(0), out.stride(0),
        D=d, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=block_d, INTERP=INTERPRET, num_warps=cfg["num_warps"],
        **LAUNCH_OPTIONS,
    )
    return out


# ----------------------------------------------------------------------------- collapse (+ norm)
@triton.jit(do_not_specialize=["M"])
def _collapse_kernel(
    h_ptr, pre_ptr, w_ptr, x_ptr, M, stride_h, stride_x, eps,
    D: tl.constexpr, BK: tl.constexpr, BLOCK_R: tl.constexpr, XB: tl.constexpr,
    NORM: tl.constexpr, INTERP: tl.constexpr,
):
    DS: tl.constexpr = D // _S
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    m2 = rmask[:, None]
    p0 = tl.load(pre_ptr + rows * 4, mask=rmask, other=0.0)[:, None]
    p1 = tl.load(pre_ptr + rows * 4 + 1, mask=rmask, other=0.0)[:, None]
    p2 = tl.load(pre_ptr + rows * 4 + 2, mask=rmask, other=0.0)[:, None]
    p3 = tl.load(pre_ptr + rows * 4 + 3, mask=rmask, other=0.0)[:, None]
    sumsq = tl.zeros((BLOCK_R,), tl.float32)
    for s in range(_S):
        xsq = tl.zeros((BLOCK_R, BK), tl.float32)
        for c in range(DS // BK):
            cols = s * DS + c * BK + tl.arange(0, BK)
            hb = h_ptr + rows[:, None] * stride_h + cols[None, :]
            h0 = tl.load(hb, mask=m2, other=0.0).to(tl.float32)
            h1 = tl.load(hb + D, mask=m2, other=0.0).to(tl.float32)
            h2 = tl.load(hb + 2 * D, mask=m2, other=0.0).to(tl.float32)
            h3 = tl.load(hb + 3 * D, mask=m2, other=0.0).to(tl.float32)
            xb, xc = _round_bf16(_collapse(h0, h1, h2, h3, p0, p1, p2, p3), INTERP)
            tl.store(x_ptr + rows[:, None] * stride_x + cols[None, :], xb, mask=m2)
            xsq = tl.fma(xc, xc, xsq)
        sumsq += _row_sum(xsq, BLOCK_R, BK)
    if NORM:
        tl.debug_barrier()
        _normalize_rows(x_ptr, w_ptr, rows, rmask, stride_x, sumsq, eps, D, XB, "", INTERP)


def mhc_collapse(h, pre, weight, eps: float, *, batch_invariant: bool, config: dict | None = None) -> torch.Tensor:
    why = unsupported(h)
    if why:
        raise ValueError(f"Triton mhc_collapse: {why}")
    m, n, d = h.shape
    pre = pre.contiguous()
    x = torch.empty((m, d), dtype=h.dtype, device=h.device)
    if m == 0:
        return x
    _, bk = slice_geometry(d)
    cfg = config or tactic("mhc_collapse", m, dict(d=d, n=n), default_config("mhc_collapse"),
                           batch_invariant=batch_invariant)
    w = weight.contiguous() if weight is not None else pre
    _collapse_kernel[(triton.cdiv(m, cfg["BLOCK_R"]),)](
        h, pre, w, x, m, h.stride(0), x.stride(0), float(eps),
        D=d, BK=bk, BLOCK_R=cfg["BLOCK_R"], XB=_norm_block(d, cfg["BLOCK_R"]), NORM=weight is not None,
        INTERP=INTERPRET, num_warps=cfg["num_warps"], **LAUNCH_OPTIONS,
    )
    return x


# ----------------------------------------------------------------------------- stats / pre / boundary
@triton.jit
def _dot3(a, parts_ptr, krows, acc_hi, acc_mid, acc_lo, K: tl.constexpr, INTERP: tl.constexpr):
    """acc_p += a @ part_p[krows, :] for the hi, mid and lo bf16 parts ([3, K, NP])."""
    off = krows[:, None] * _NP + tl.arange(0, _NP)[None, :]
    w_hi = tl.load(parts_ptr + off)
    w_mid = tl.load(parts_ptr + K * _NP + off)
    w_lo = tl.load(parts_ptr + 2 * K * _NP + off)
    if INTERP:  # the interpreter multiplies bf16 raw bits; the fp32 products are exact anyway
        acc_hi = tl.dot(a, w_hi.to(tl.float32), acc_hi, input_precision="ieee")
        acc_mid = tl.dot(a, w_mid.to(tl.float32), acc_mid, input_precision="ieee")
        acc_lo = tl.dot(a, w_lo.to(tl.float32), acc_lo, input_precision="ieee")
    else:
        # Hopper's in-MMA accumulation is not IEEE round-to-nearest: over a 1280-long chain its error
        # reached ~1.3e-6 normwise. Only the hi part carries that weight: each of its dots starts
        # from zero (``acc * 0``, a zero the compiler cannot fold) and is added in fp32 registers.
        # The mid and lo parts are below 2^-8 and 2^-16 of it, so their chains accumulate in the MMA
        # over the whole slice (error ~2^-8 smaller again; no fresh-accumulator adds, no waits).
        z = acc_hi * 0.0
        acc_hi += tl.dot(a, w_hi, z)
        acc_mid = tl.dot(a, w_mid, acc_mid)
        acc_lo = tl.dot(a, w_lo, acc_lo)
    return acc_hi, acc_mid, acc_lo


@triton.jit
def _finish_stats(
    ws_ptr, ss_ptr, slot0, rows, rmask, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, mix_ptr,
    iters, hc_eps, norm_eps, K: tl.constexpr, BM: tl.constexpr, MIXES: tl.constexpr,
):
    """Ordered slice sum, rsqrt, pre/post, softmax + Sinkhorn for one row block (all rows' partials are in)."""
    r = tl.arange(0, BM)
    c4 = tl.arange(0, 4)
    t_pre = tl.zeros((BM, 4), tl.float32)
    t_post = tl.zeros((BM, 4), tl.float32)
    t_c0 = tl.zeros((BM, 4), tl.float32)
    t_c1 = tl.zeros((BM, 4), tl.float32)
    t_c2 = tl.zeros((BM, 4), tl.float32)
    t_c3 = tl.zeros((BM, 4), tl.float32)
    ss = tl.zeros((BM,), tl.float32)
    for s in range(_S):
        p = ws_ptr + ((slot0 + s) * BM + r[:, None]) * _NMIX + c4[None, :]
        t_pre += tl.load(p, cache_modifier=".cg")
        t_post += tl.load(p + 4, cache_modifier=".cg")
        t_c0 += tl.load(p + 8, cache_modifier=".cg")
        t_c1 += tl.load(p + 12, cache_modifier=".cg")
        t_c2 += tl.load(p + 16, cache_modifier=".cg")
        t_c3 += tl.load(p + 20, cache_modifier=".cg")
        ss += tl.load(ss_ptr + (slot0 + s) * BM + r, cache_modifier=".cg")
    rstd = (1.0 / tl.sqrt_rn(ss / K + norm_eps))[:, None]
    m_pre = t_pre * rstd
    m_post = t_post * rstd
    m_c0 = t_c0 * rstd
    m_c1 = t_c1 * rstd
    m_c2 = t_c2 * rstd
    m_c3 = t_c3 * rstd
    m2 = rmask[:, None]
    o4 = rows[:, None] * 4 + c4[None, :]
    if MIXES:  # pre-Sinkhorn mixes, for numerics tests
        mo = rows[:, None] * _NMIX + c4[None, :]
        tl.store(mix_ptr + mo, m_pre, mask=m2)
        tl.store(mix_ptr + mo + 4, m_post, mask=m2)
        tl.store(mix_ptr + mo + 8, m_c0, mask=m2)
        tl.store(mix_ptr + mo + 12, m_c1, mask=m2)
        tl.store(mix_ptr + mo + 16, m_c2, mask=m2)
        tl.store(mix_ptr + mo + 20, m_c3, mask=m2)
    sc0 = tl.load(scale_ptr)
    sc1 = tl.load(scale_ptr + 1)
    sc2 = tl.load(scale_ptr + 2)
    b4 = base_ptr + c4[None, :]
    pre = tl.sigmoid(m_pre * sc0 + tl.load(b4)) + hc_eps
    post = 2.0 * tl.sigmoid(m_post * sc1 + tl.load(b4 + 4))
    c0 = _softmax4(m_c0 * sc2 + tl.load(b4 + 8), BM) + hc_eps
    c1 = _softmax4(m_c1 * sc2 + tl.load(b4 + 12), BM) + hc_eps
    c2 = _softmax4(m_c2 * sc2 + tl.load(b4 + 16), BM) + hc_eps
    c3 = _softmax4(m_c3 * sc2 + tl.load(b4 + 20), BM) + hc_eps
    col = ((c0 + c1) + (c2 + c3)) + hc_eps
    c0, c1, c2, c3 = c0 / col, c1 / col, c2 / col, c3 / col
    for _ in range(iters - 1):
        c0 = c0 / (_row_sum(c0, BM, 4)[:, None] + hc_eps)
        c1 = c1 / (_row_sum(c1, BM, 4)[:, None] + hc_eps)
        c2 = c2 / (_row_sum(c2, BM, 4)[:, None] + hc_eps)
        c3 = c3 / (_row_sum(c3, BM, 4)[:, None] + hc_eps)
        col = ((c0 + c1) + (c2 + c3)) + hc_eps
        c0, c1, c2, c3 = c0 / col, c1 / col, c2 / col, c3 / col
    tl.store(pre_ptr + o4, pre, mask=m2)
    tl.store(post_ptr + o4, post, mask=m2)
    o16 = rows[:, None] * 16 + c4[None, :]
    tl.store(comb_ptr + o16, c0, mask=m2)
    tl.store(comb_ptr + o16 + 4, c1, mask=m2)
    tl.store(comb_ptr + o16 + 8, c2, mask=m2)
    tl.store(comb_ptr + o16 + 12, c3, mask=m2)


@triton.jit(do_not_specialize=["M", "iters"])
def _proj_kernel(
    h_ptr, y_ptr, post_in_ptr, comb_in_ptr, new_ptr,
    pre_prev_ptr, x_ptr, w_ptr,
    parts_ptr, scale_ptr, base_ptr,
    pre_ptr, post_ptr, comb_ptr, mix_ptr,
    ws_ptr, ss_ptr, xss_ptr, count_ptr,
    M, stride_h, stride_y, stride_n, stride_x,
    iters, hc_eps, norm_eps, eps,
    D: tl.constexpr, BK: tl.constexpr, BM: tl.constexpr, XB: tl.constexpr,
    BOUNDARY: tl.constexpr, COLLAPSE: tl.constexpr, NORM: tl.constexpr, MIXES: tl.constexpr,
    STACK: tl.constexpr, INTERP: tl.constexpr,
):
    """One (row block, K slice) per program; the last slice program of a row block to finish reduces it.

    BOUNDARY: h is ``post(y, res, post_in, comb_in)``, computed here and written once to new_ptr.
    COLLAPSE: also ``x = bf16(sum_j pre_prev_j h_j)`` (NORM: then RMSNorm of x, finished in place).
    STACK (not with BOUNDARY): the projection takes a chunk's four streams as one K = 4 BK operand,
    so the hi part's MMA chains are 4 BK long instead of BK; everything else is bit-identical.
    """
    DS: tl.constexpr = D // _S
    K: tl.constexpr = 4 * D
    pid = tl.program_id(0).to(tl.int64)
    rb = pid // _S
    s = pid % _S
    r = tl.arange(0, BM)
    rows = rb * BM + r
    rmask = rows < M
    m2 = rmask[:, None]
    rr = rows[:, None]
    acc_hi = tl.zeros((BM, _NP), tl.float32)
    acc_mid = tl.zeros((BM, _NP), tl.float32)
    acc_lo = tl.zeros((BM, _NP), tl.float32)
    ssq = tl.zeros((BM, BK), tl.float32)
    xsq = tl.zeros((BM, BK), tl.float32)
    if STACK and COLLAPSE:
        p0 = tl.load(pre_prev_ptr + rows * 4, mask=rmask, other=0.0)[:, None]
        p1 = tl.load(pre_prev_ptr + rows * 4 + 1, mask=rmask, other=0.0)[:, None]
        p2 = tl.load(pre_prev_ptr + rows * 4 + 2, mask=rmask, other=0.0)[:, None]
        p3 = tl.load(pre_prev_ptr + rows * 4 + 3, mask=rmask, other=0.0)[:, None]
    for c in range(DS // BK):
        cols = s * DS + c * BK + tl.arange(0, BK)
        hb = h_ptr + rr * stride_h + cols[None, :]
        if STACK:
            # the chunk's four streams as one [BM, 4 BK] operand: three dots a chunk, not twelve
            j = tl.arange(0, 4 * BK)
            kcol = (j // BK) * D + s * DS + c * BK + j % BK
            a = tl.load(h_ptr + rr * stride_h + kcol[None, :], mask=m2, other=0.0)
            hf = a.to(tl.float32)
            if INTERP:
                a = hf
            acc_hi, acc_mid, acc_lo = _dot3(a, parts_ptr, kcol, acc_hi, acc_mid, acc_lo, K, INTERP)
            # streams back out of the stacked tile: [BM, BK, 2, 2] with stream = 2 * a + b
            e, o = tl.split(tl.permute(tl.reshape(hf, (BM, 2, 2, BK)), (0, 3, 1, 2)))
            h0, h2 = tl.split(e)
            h1, h3 = tl.split(o)
            ssq = tl.fma(h0, h0, ssq)
            ssq = tl.fma(h1, h1, ssq)
            ssq = tl.fma(h2, h2, ssq)
            ssq = tl.fma(h3, h3, ssq)
            if COLLAPSE:
                xc = _collapse(h0, h1, h2, h3, p0, p1, p2, p3)
        if BOUNDARY:
            yv = tl.load(y_ptr + rr * stride_y + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            r0 = tl.load(hb, mask=m2, other=0.0).to(tl.float32)
            r1 = tl.load(hb + D, mask=m2, other=0.0).to(tl.float32)
            r2 = tl.load(hb + 2 * D, mask=m2, other=0.0).to(tl.float32)
            r3 = tl.load(hb + 3 * D, mask=m2, other=0.0).to(tl.float32)
        for k in tl.static_range(0 if STACK else 4):
            if BOUNDARY:  # stream k of the new residual: written once, then used from registers
                cb = comb_in_ptr + rows * 16 + k
                ak, hk = _round_bf16(_combine(
                    yv, r0, r1, r2, r3,
                    tl.load(post_in_ptr + rows * 4 + k, mask=rmask, other=0.0)[:, None],
                    tl.load(cb, mask=rmask, other=0.0)[:, None],
                    tl.load(cb + 4, mask=rmask, other=0.0)[:, None],
                    tl.load(cb + 8, mask=rmask, other=0.0)[:, None],
                    tl.load(cb + 12, mask=rmask, other=0.0)[:, None],
                ), INTERP)
                tl.store(new_ptr + rr * stride_n + k * D + cols[None, :], ak, mask=m2)
            else:
                ak = tl.load(hb + k * D, mask=m2, other=0.0)
                hk = ak.to(tl.float32)
            if INTERP:
                ak = hk
            acc_hi, acc_mid, acc_lo = _dot3(ak, parts_ptr, k * D + cols, acc_hi, acc_mid, acc_lo, K, INTERP)
            ssq = tl.fma(hk, hk, ssq)
            if COLLAPSE:
                pk = tl.load(pre_prev_ptr + rows * 4 + k, mask=rmask, other=0.0)[:, None]
                if k == 0:
                    xc = pk * hk
                else:
                    xc += pk * hk
        if COLLAPSE:
            xb, xc = _round_bf16(xc, INTERP)
            tl.store(x_ptr + rr * stride_x + cols[None, :], xb, mask=m2)
            xsq = tl.fma(xc, xc, xsq)
    # this slice's partials -> workspace slot pid ([BM, NMIX] mixes, [BM] sums of squares)
    n = tl.arange(0, _NP)
    tl.store(ws_ptr + (pid * BM + r[:, None]) * _NMIX + n[None, :], (acc_hi + acc_mid) + acc_lo,
             mask=n[None, :] < _NMIX)
    tl.store(ss_ptr + pid * BM + r, _row_sum(ssq, BM, BK))
    if NORM:
        tl.store(xss_ptr + pid * BM + r, _row_sum(xsq, BM, BK))
    # the 16th slice program of this row block to get here reduces it (all 16 partials are then visible)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + rb, 1, sem="acq_rel", scope="gpu")
    if arrived == _S - 1:
        slot0 = rb * _S
        _finish_stats(ws_ptr, ss_ptr, slot0, rows, rmask, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
                      mix_ptr, iters, hc_eps, norm_eps, K, BM, MIXES)
        if NORM:
            xs = tl.zeros((BM,), tl.float32)
            for s2 in range(_S):
                xs += tl.load(xss_ptr + (slot0 + s2) * BM + r, cache_modifier=".cg")
            _normalize_rows(x_ptr, w_ptr, rows, rmask, stride_x, xs, eps, D, XB, ".cg", INTERP)


def _launch_proj(
    op: str, h, parts, scale, base, iters, hc_eps, norm_eps, *, batch_invariant: bool, config: dict | None,
    y=None, post_in=None, comb_in=None, pre_prev=None, weight=None, eps: float = 0.0, mixes: bool = False,
):
    """Run the fused projection kernel; returns a dict of the outputs it wrote."""
    why = unsupported(h)
    if why:
        raise ValueError(f"Triton {op}: {why}")
    m, n, d = h.shape
    if tuple(parts.shape) != (3, n * d, NP) or parts.dtype != torch.bfloat16:
        raise ValueError(f"Triton {op}: parts must be bf16 [3, {n * d}, {NP}], got {parts.dtype} {tuple(parts.shape)}")
    dev = h.device
    f32 = dict(dtype=torch.float32, device=dev)
    out = {
        "pre": torch.empty((m, n), **f32),
        "post": torch.empty((m, n), **f32),
        "comb": torch.empty((m, n, n), **f32),
    }
    boundary, collapse = y is not None, pre_prev is not None
    if boundary:
        out["new_res"] = torch.empty((m, n, d), dtype=h.dtype, device=dev)
    if collapse:
        out["x"] = torch.empty((m, d), dtype=h.dtype, device=dev)
    if mixes:
        out["mixes"] = torch.empty((m, NMIX), **f32)
    if m == 0:
        return out
    cfg = config or tactic(op, m, dict(d=d, n=n), default_config(op), batch_invariant=batch_invariant)
    bm = cfg["BLOCK_M"]
    nblocks = triton.cdiv(m, bm)
    ws = torch.empty(nblocks * NUM_SLICES * bm * NMIX, **f32)
    ss = torch.empty(nblocks * NUM_SLICES * bm, **f32)
    norm = collapse and weight is not None
    xss = torch.empty_like(ss) if norm else ss
    count = torch.zeros(nblocks, dtype=torch.int32, device=dev)
    _, bk = slice_geometry(d)
    stack = bool(cfg.get("STACK", False))
    if stack and boundary:
        raise ValueError(f"Triton {op}: STACK configs are for the projection of a stored residual, not the boundary")
    dummy = out["pre"]
    new_res = out.get("new_res", dummy)
    x = out.get("x", dummy)
    _proj_kernel[(nblocks * NUM_SLICES,)](
        h, y if boundary else dummy, post_in.contiguous() if boundary else dummy,
        comb_in.contiguous() if boundary else dummy, new_res,
        pre_prev.contiguous() if collapse else dummy, x, weight.contiguous() if norm else dummy,
        parts, scale.contiguous(), base.contiguous(),
        out["pre"], out["post"], out["comb"], out.get("mixes", dummy),
        ws, ss, xss, count,
        m, h.stride(0), y.stride(0) if boundary else 0, new_res.stride(0) if boundary else 0,
        x.stride(0) if collapse else 0,
        int(iters), float(hc_eps), float(norm_eps), float(eps),
        D=d, BK=bk, BM=bm, XB=_norm_block(d, bm), BOUNDARY=boundary, COLLAPSE=collapse, NORM=norm, MIXES=mixes,
        STACK=stack, INTERP=INTERPRET, num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3),
        **LAUNCH_OPTIONS,
    )
    return out


def mhc_stats(h, parts, scale, base, iters, hc_eps, norm_eps, *, batch_invariant: bool, config: dict | None = None):
    o = _launch_proj("mhc_stats", h, parts, scale, base, iters, hc_eps, norm_eps,
                     batch_invariant=batch_invariant, config=config)
    return o["pre"], o["post"], o["comb"]


def stats_mixes(h, parts, scale, base, iters, hc_eps, norm_eps, *, batch_invariant: bool = True,
                config: dict | None = None) -> torch.Tensor:
    """The pre-Sinkhorn mixes ``[M, 24]`` (projection * rsqrt) exactly as ``mhc_stats`` computes them."""
    o = _launch_proj("mhc_stats", h, parts, scale, base, iters, hc_eps, norm_eps,
                     batch_invariant=batch_invariant, config=config, mixes=True)
    return o["mixes"]


def mhc_pre(h, pre_prev, parts, scale, base, weight, iters, hc_eps, norm_eps, eps, *, batch_invariant: bool,
            config: dict | None = None):
    o = _launch_proj("mhc_pre", h, parts, scale, base, iters, hc_eps, norm_eps, batch_invariant=batch_invariant,
                     config=config, pre_prev=pre_prev, weight=weight, eps=eps)
    return o["x"], o["pre"], o["post"], o["comb"]


def mhc_boundary(y, res, post, comb, pre_prev, parts, scale, base, weight, iters, hc_eps, norm_eps, eps, *,
                 batch_invariant: bool, config: dict | None = None):
    if y.stride(-1) != 1:
        raise ValueError("Triton mhc_boundary: y must be contiguous along hidden")
    o = _launch_proj("mhc_boundary", res, parts, scale, base, iters, hc_eps, norm_eps,
                     batch_invariant=batch_invariant, config=config, y=y, post_in=post, comb_in=comb,
                     pre_prev=pre_prev, weight=weight, eps=eps)
    return o["new_res"], o["x"], o["pre"], o["post"], o["comb"]
