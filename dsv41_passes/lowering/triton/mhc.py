"""Triton kernels of the mHC family (hc_mult 4, bf16 residual): post and collapse here, the
projection kernel (stats, pre, boundary) in ``mhc_projection``; configs in ``mhc_common``.

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
  ``(hi + mid) + lo``; the 16 partials summed by a pairwise tree (adjacent slices first).
  ``BLOCK_M >= 16 * num_warps`` in every config batch-invariant mode runs, so Hopper always lowers
  the dots to the same wgmma chain.
* Sums of squares (of the residual, and of the rounded collapse for the norm):
  fp32 elementwise accumulation per chunk position (explicit ``tl.fma``, which
  rounds once on the GPU and in the interpreter alike), then a fixed pairwise tree
  over the BK positions (``pairwise_row_sum``; ``tl.sum`` is avoided because its tree
  follows the register layout, which changes with the config), then the slice
  sums: the residual's by the mixes' pairwise tree, the collapse's in slice order
  (as the TileLang ``mhc_pre`` sums them).
* Sinkhorn: 16 column vectors of a few rows at once, explicit reduction trees
  (elementwise, in registers).

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
from ..mhc_weights import slice_geometry
from .common import INTERPRET, pairwise_row_sum, rne_bf16
from .mhc_common import (  # noqa: F401  (the family's configs, re-exported)
    CANDIDATES,
    DEFAULTS,
    HC,
    INTERPRETER_DEFAULTS,
    LAUNCH_OPTIONS,
    NMIX,
    NP,
    NUM_SLICES,
    _collapse,
    _combine,
    _norm_block,
    _normalize_rows,
    _round_bf16,
    _S,
    check_split,
    default_config,
    unsupported,
    untuned_config,
)
from .mhc_projection import _proj_kernel, mhc_boundary, mhc_pre, mhc_stats, stats_mixes  # noqa: F401

# ----------------------------------------------------------------------------- post
@triton.jit(do_not_specialize=["M"])
def _post_kernel(
    y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, M,
    stride_y, stride_r, stride_o,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROW_MAJOR: tl.constexpr, INTERP: tl.constexpr,
):
    if ROW_MAJOR:  # 1D grid, column blocks of a row block back to back: consecutive programs stream one span
        NCB: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
        pid = tl.program_id(0).to(tl.int64)
        rb, cb = pid // NCB, pid % NCB
    else:  # (row block, column block) grid: consecutive programs read the same columns of successive rows
        rb, cb = tl.program_id(0).to(tl.int64), tl.program_id(1)
    rows = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = cb * BLOCK_D + tl.arange(0, BLOCK_D)
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
    row_major = cfg.get("order", "row") == "row"
    rblocks, cblocks = triton.cdiv(m, cfg["BLOCK_R"]), triton.cdiv(d, block_d)
    grid = (rblocks * cblocks,) if row_major else (rblocks, cblocks)
    _post_kernel[grid](
        y, res, post, comb, out, m, y.stride(0), res.stride(0), out.stride(0),
        D=d, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=block_d, ROW_MAJOR=row_major, INTERP=INTERPRET,
        num_warps=cfg["num_warps"],
        **LAUNCH_OPTIONS,
    )
    return out


# ----------------------------------------------------------------------------- collapse (+ norm)
@triton.jit(do_not_specialize=["M"])
def _collapse_kernel(
    h_ptr, pre_ptr, w_ptr, x_ptr, M, stride_h, stride_x, eps,
    D: tl.constexpr, BK: tl.constexpr, BLOCK_R: tl.constexpr, XB: tl.constexpr,
    NORM: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr,
):
    """The norm's sum of squares is summed per (K slice, piece) like the projection kernel's (SPLIT)."""
    DS: tl.constexpr = D // _S
    CPP: tl.constexpr = DS // BK // SPLIT
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    m2 = rmask[:, None]
    p0 = tl.load(pre_ptr + rows * 4, mask=rmask, other=0.0)[:, None]
    p1 = tl.load(pre_ptr + rows * 4 + 1, mask=rmask, other=0.0)[:, None]
    p2 = tl.load(pre_ptr + rows * 4 + 2, mask=rmask, other=0.0)[:, None]
    p3 = tl.load(pre_ptr + rows * 4 + 3, mask=rmask, other=0.0)[:, None]
    sumsq = tl.zeros((BLOCK_R,), tl.float32)
    for q in range(_S * SPLIT):
        xsq = tl.zeros((BLOCK_R, BK), tl.float32)
        for c in range(CPP):
            cols = q * (CPP * BK) + c * BK + tl.arange(0, BK)
            hb = h_ptr + rows[:, None] * stride_h + cols[None, :]
            h0 = tl.load(hb, mask=m2, other=0.0).to(tl.float32)
            h1 = tl.load(hb + D, mask=m2, other=0.0).to(tl.float32)
            h2 = tl.load(hb + 2 * D, mask=m2, other=0.0).to(tl.float32)
            h3 = tl.load(hb + 3 * D, mask=m2, other=0.0).to(tl.float32)
            xb, xc = _round_bf16(_collapse(h0, h1, h2, h3, p0, p1, p2, p3), INTERP)
            tl.store(x_ptr + rows[:, None] * stride_x + cols[None, :], xb, mask=m2)
            xsq = tl.fma(xc, xc, xsq)
        sumsq += pairwise_row_sum(xsq, BLOCK_R, BK)
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
    cfg = config or tactic("mhc_collapse", m, dict(d=d, n=n),
                           untuned_config("mhc_collapse", m, d, batch_invariant),
                           batch_invariant=batch_invariant)
    w = weight.contiguous() if weight is not None else pre
    _collapse_kernel[(triton.cdiv(m, cfg["BLOCK_R"]),)](
        h, pre, w, x, m, h.stride(0), x.stride(0), float(eps),
        D=d, BK=bk, BLOCK_R=cfg["BLOCK_R"], XB=_norm_block(d, cfg["BLOCK_R"]), NORM=weight is not None,
        SPLIT=check_split("mhc_collapse", cfg, d), INTERP=INTERPRET, num_warps=cfg["num_warps"],
        **LAUNCH_OPTIONS,
    )
    return x

