"""Triton kernels of the mHC family (hc_mult 4, bf16 residual): post, collapse, the boundary's post +
collapse kernel and ``mhc_boundary``'s forms here, the projection kernel (stats, pre, the fused boundary)
in ``mhc_projection`` with its finish in ``mhc_finish``; configs in ``mhc_common``.

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
from .mhc_projection import _proj_kernel, boundary_fused, mhc_pre, mhc_stats, stats_mixes  # noqa: F401

# ----------------------------------------------------------------------------- post
@triton.jit
def _post_inputs(y_ptr, res_ptr, rr, stride_y, stride_r, cols, mask, D: tl.constexpr, POLICY: tl.constexpr):
    """The post's inputs at rows ``rr`` and columns ``cols``: y and the four residual streams, as fp32 (loaded with the
    L2 eviction ``POLICY``; "" for the normal one)."""
    rb = res_ptr + rr * stride_r + cols
    return (tl.load(y_ptr + rr * stride_y + cols, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32),
            tl.load(rb, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32),
            tl.load(rb + D, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32),
            tl.load(rb + 2 * D, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32),
            tl.load(rb + 3 * D, mask=mask, other=0.0, eviction_policy=POLICY).to(tl.float32))


@triton.jit(do_not_specialize=["M"])
def _post_kernel(
    y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, M,
    stride_y, stride_r, stride_o,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ROW_MAJOR: tl.constexpr, INTERP: tl.constexpr,
    POLICY: tl.constexpr,
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
    yv, r0, r1, r2, r3 = _post_inputs(y_ptr, res_ptr, rr, stride_y, stride_r, cols[None, :], mask, D, POLICY)
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
    # the loads' L2 policy ("evict_first", the default, or "normal"; the same bits. On an H100 "normal" was 2-3%
    # faster in an interleaved probe, run 236, but 6.5% and 14% slower at M = 16384 in the bench, runs 237 and 239)
    loads = cfg.get("loads", "evict_first")
    if loads not in ("evict_first", "normal"):
        raise ValueError(f"mhc_post: loads {loads!r}: evict_first or normal")
    rblocks, cblocks = triton.cdiv(m, cfg["BLOCK_R"]), triton.cdiv(d, block_d)
    grid = (rblocks * cblocks,) if row_major else (rblocks, cblocks)
    _post_kernel[grid](
        y, res, post, comb, out, m, y.stride(0), res.stride(0), out.stride(0),
        D=d, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=block_d, ROW_MAJOR=row_major, INTERP=INTERPRET,
        POLICY="evict_first" if loads == "evict_first" else "",
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



# ----------------------------------------------------------------------------- boundary: post, then collapse (+ norm)
@triton.jit
def _row_coefs(ptr, rmask):
    """Four consecutive fp32 values of each row, as ``[rows, 1]`` columns."""
    return (tl.load(ptr, mask=rmask, other=0.0)[:, None], tl.load(ptr + 1, mask=rmask, other=0.0)[:, None],
            tl.load(ptr + 2, mask=rmask, other=0.0)[:, None], tl.load(ptr + 3, mask=rmask, other=0.0)[:, None])


@triton.jit(do_not_specialize=["M"])
def _post_collapse_kernel(
    y_ptr, res_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, new_ptr, x_ptr, M, stride_y, stride_r, stride_n, stride_x,
    eps, D: tl.constexpr, BK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    NORM: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr,
):
    """The post of whole rows, then the collapse (+ norm) of the new residual as written, with
    ``_post_kernel``'s and ``_collapse_kernel``'s arithmetic (and so their bits):

    1. post and collapse on ``[rows, BLOCK_D]`` tiles (the post kernel's), new_res and the plain x stored;
    2. x read back (L2) as ``[rows, pieces, BK]`` tiles, chunk c of every piece a step: the sums of squares
       in the collapse kernel's order (a step stores nothing, so every step's loads are issued at once);
    3. x read back once more on the tiles of 1., normalized, stored."""
    DS: tl.constexpr = D // _S
    CPP: tl.constexpr = DS // BK // SPLIT  # chunks a piece
    NPC: tl.constexpr = _S * SPLIT  # pieces a row
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < M
    m2 = rmask[:, None]
    rr = rows[:, None]
    p0, p1, p2, p3 = _row_coefs(pre_ptr + rows * 4, rmask)
    q0, q1, q2, q3 = _row_coefs(post_ptr + rows * 4, rmask)
    c00, c01, c02, c03 = _row_coefs(comb_ptr + rows * 16, rmask)  # c_jk = comb[:, j, k]
    c10, c11, c12, c13 = _row_coefs(comb_ptr + rows * 16 + 4, rmask)
    c20, c21, c22, c23 = _row_coefs(comb_ptr + rows * 16 + 8, rmask)
    c30, c31, c32, c33 = _row_coefs(comb_ptr + rows * 16 + 12, rmask)
    for j in range(D // BLOCK_D):
        cols = j * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        yv, r0, r1, r2, r3 = _post_inputs(y_ptr, res_ptr, rr, stride_y, stride_r, cols, m2, D, "evict_first")
        nb = new_ptr + rr * stride_n + cols
        h0b, h0 = _round_bf16(_combine(yv, r0, r1, r2, r3, q0, c00, c10, c20, c30), INTERP)
        h1b, h1 = _round_bf16(_combine(yv, r0, r1, r2, r3, q1, c01, c11, c21, c31), INTERP)
        h2b, h2 = _round_bf16(_combine(yv, r0, r1, r2, r3, q2, c02, c12, c22, c32), INTERP)
        h3b, h3 = _round_bf16(_combine(yv, r0, r1, r2, r3, q3, c03, c13, c23, c33), INTERP)
        tl.store(nb, h0b, mask=m2)
        tl.store(nb + D, h1b, mask=m2)
        tl.store(nb + 2 * D, h2b, mask=m2)
        tl.store(nb + 3 * D, h3b, mask=m2)
        xb, _ = _round_bf16(_collapse(h0, h1, h2, h3, p0, p1, p2, p3), INTERP)
        tl.store(x_ptr + rr * stride_x + cols, xb, mask=m2)
    if NORM:
        tl.debug_barrier()  # x as written by the other threads of the program
        piece = tl.arange(0, NPC)[None, :, None] * (CPP * BK) + tl.arange(0, BK)[None, None, :]
        xp = x_ptr + rows[:, None, None] * stride_x + piece
        m3 = rmask[:, None, None]
        xsq = tl.zeros((BLOCK_R, NPC, BK), tl.float32)
        for c in tl.static_range(CPP):
            xc = tl.load(xp + c * BK, mask=m3, other=0.0).to(tl.float32)
            xsq = tl.fma(xc, xc, xsq)
        # each piece's positions by the pairwise tree, then the pieces in order (a sum with one nonzero
        # term is that term exactly)
        part = tl.reshape(pairwise_row_sum(tl.reshape(xsq, (BLOCK_R * NPC, BK)), BLOCK_R * NPC, BK), (BLOCK_R, NPC))
        idx = tl.arange(0, NPC)[None, :]
        sumsq = tl.zeros((BLOCK_R,), tl.float32)
        for i in tl.static_range(NPC):
            sumsq += tl.sum(tl.where(idx == i, part, 0.0), axis=1)
        # ``_normalize_rows``'s arithmetic on phase 1's tile layout (the helper, on ``rows``, adds a layout
        # change through shared memory and two barriers to this kernel's sm_90 build)
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(sumsq, D * 1.0) + eps))[:, None]
        for j in range(D // BLOCK_D):
            cols = j * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
            ptrs = x_ptr + rr * stride_x + cols
            xv = tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + cols).to(tl.float32)
            tl.store(ptrs, rne_bf16(wv * (xv * rstd), INTERP).to(x_ptr.dtype.element_ty), mask=m2)


def post_collapse(y, res, post, comb, pre_prev, weight, eps: float, *, rows: int, cols: int, warps: int,
                  split: int):
    """(new_res, x): ``mhc_post`` then ``mhc_collapse`` of its output (split ``split``), one kernel."""
    m, n, d = res.shape
    new_res = torch.empty((m, n, d), dtype=res.dtype, device=res.device)
    x = torch.empty((m, d), dtype=res.dtype, device=res.device)
    if m == 0:
        return new_res, x
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"Triton mhc_boundary: post_rows must be a power of two, got {rows}")
    cols = min(cols, d & -d)
    if cols < 1 or cols & (cols - 1):
        raise ValueError(f"Triton mhc_boundary: post_cols must be a power of two, got {cols}")
    if split not in (1, 2):
        raise ValueError(f"Triton mhc_boundary: the post_collapse form takes split 1 or 2, got {split}")
    _, bk = slice_geometry(d)
    w = weight.contiguous() if weight is not None else pre_prev
    _post_collapse_kernel[(triton.cdiv(m, rows),)](
        y, res, post.contiguous(), comb.contiguous(), pre_prev.contiguous(), w, new_res, x, m,
        y.stride(0), res.stride(0), new_res.stride(0), x.stride(0), float(eps),
        D=d, BK=bk, BLOCK_R=rows, BLOCK_D=cols, NORM=weight is not None, SPLIT=split,
        INTERP=INTERPRET, num_warps=warps, **LAUNCH_OPTIONS,
    )
    return new_res, x


# the boundary's forms (config key ``form``); every one gives the same bits for the same projection config
BOUNDARY_FORMS = ("fused", "post_pre", "post_collapse")
_BOUNDARY_KEYS = ("form", "post_rows", "post_cols", "post_warps")


def mhc_boundary(y, res, post, comb, pre_prev, parts, scale, base, weight, iters, hc_eps, norm_eps, eps, *,
                 batch_invariant: bool, config: dict | None = None):
    """(new_res, x, pre, post, comb) of post then pre. Forms: ``fused`` (one projection kernel also
    computes the post: the new residual is never re-read), ``post_pre`` (the post kernel, then
    ``mhc_pre``), ``post_collapse`` (one kernel for the post and the collapse + norm of whole rows, then
    ``mhc_stats``: the new residual is read once more, by the stats). The rest of the config is the
    projection's."""
    why = unsupported(res)
    if why:
        raise ValueError(f"Triton mhc_boundary: {why}")
    if y.stride(-1) != 1:
        raise ValueError("Triton mhc_boundary: y must be contiguous along hidden")
    m, n, d = res.shape
    cfg = config or tactic("mhc_boundary", m, dict(d=d, n=n), untuned_config("mhc_boundary", m, d, batch_invariant),
                           batch_invariant=batch_invariant)
    form = cfg.get("form", "fused")
    if form not in BOUNDARY_FORMS:
        raise ValueError(f"Triton mhc_boundary: form must be one of {BOUNDARY_FORMS}, got {form!r}")
    proj = {k: v for k, v in cfg.items() if k not in _BOUNDARY_KEYS}
    kw = dict(batch_invariant=batch_invariant, config=proj)
    if form == "fused":
        return boundary_fused(y, res, post, comb, pre_prev, parts, scale, base, weight, iters, hc_eps, norm_eps, eps,
                              **kw)
    if form == "post_pre":
        new_res = mhc_post(y, res, post, comb, batch_invariant=batch_invariant)
        return (new_res, *mhc_pre(new_res, pre_prev, parts, scale, base, weight, iters, hc_eps, norm_eps, eps, **kw))
    split = check_split("mhc_boundary", proj, d)
    dflt = default_config("mhc_boundary")  # the launch shape a config without the post_* keys takes
    new_res, x = post_collapse(y, res, post, comb, pre_prev, weight, eps, split=split,
                               **{k[5:]: int(cfg.get(k, dflt[k])) for k in ("post_rows", "post_cols", "post_warps")})
    return (new_res, x, *mhc_stats(new_res, parts, scale, base, iters, hc_eps, norm_eps, **kw))
