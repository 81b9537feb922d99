"""The Triton mHC projection kernel: compensated BF16x3 stats, optionally with the collapse + norm
(``mhc_pre``) or the preceding post (``mhc_boundary``), one read of the residual (numerics: ``mhc``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...tuning import tactic
from ..mhc_weights import NUM_SLICES, slice_geometry
from ..mhc_weights import NP_DEFAULT as NP
from .common import INTERPRET, pairwise_row_sum, pdl_available
from .common import gdc_launch_dependents as _gdc_launch_dependents
from .common import gdc_wait as _gdc_wait
from .mhc_common import (
    _NMIX,
    _NP,
    _S,
    LAUNCH_OPTIONS,
    NMIX,
    _combine,
    _norm_block,
    _normalize_cols,
    _normalize_rows,
    _round_bf16,
    check_split,
    unsupported,
    untuned_config,
)

# ----------------------------------------------------------------------------- stats / pre / boundary
# inline PTX only where a GPU compiles the kernel (tests may run the GPU code path in the interpreter)
_PTX = tl.constexpr(not INTERPRET)


@triton.jit
def _add_rn(x, y):
    """``x + y`` rounded to nearest, opaque to Triton: it cannot fold the add into the MMA's accumulator
    (which would accumulate in the MMA instead, see ``_dot3``)."""
    if _PTX:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return x + y


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
        # from zero and is added in fp32 registers (``_add_rn``: Triton would fold a plain ``+=`` of a
        # zero-started dot into the MMA chain; the ``acc * 0`` start used before cost 16 FMULs a dot).
        # The mid and lo parts are below 2^-8 and 2^-16 of it, so their chains accumulate in the MMA
        # over the whole slice (error ~2^-8 smaller again; no fresh-accumulator adds, no waits).
        acc_hi = _add_rn(acc_hi, tl.dot(a, w_hi))
        acc_mid = tl.dot(a, w_mid, acc_mid)
        acc_lo = tl.dot(a, w_lo, acc_lo)
    return acc_hi, acc_mid, acc_lo


@triton.jit
def _partial_group(ws_ptr, slot0, rr, rmask, c0, BM: tl.constexpr, FB: tl.constexpr, NPART: tl.constexpr,
                   NP2: tl.constexpr):
    """Sum over the NPART partials of mix columns ``[c0, c0 + 4)`` for the FB rows ``rr`` of a row block:
    one tile load ``[FB, NP2, 4]`` (16-byte vectors), then a pairwise tree over the partials."""
    sp = tl.arange(0, NP2)
    c4 = tl.arange(0, 4)
    off = ((slot0 + sp[None, :, None]) * BM + rr[:, None, None]) * _NMIX + c0 + c4[None, None, :]
    ok = rmask[:, None, None] & (sp[None, :, None] < NPART)  # broadcast over the 4 columns
    t = tl.permute(tl.load(ws_ptr + off, mask=ok, other=0.0, cache_modifier=".cg"), (0, 2, 1))
    return tl.reshape(pairwise_row_sum(tl.reshape(t, (FB * 4, NP2)), FB * 4, NP2), (FB, 4))


@triton.jit
def _norm_sumsq(xss_ptr, slot0, r, rmask, BM: tl.constexpr, NPART: tl.constexpr, CACHE: tl.constexpr,
                R: tl.constexpr):
    """The norm's sum of squares of the R rows ``r`` of a BM-row block: its NPART partials in slice order,
    the order ``mhc_collapse`` and the TileLang ``mhc_pre`` sum them in."""
    xs = tl.zeros((R,), tl.float32)
    for s2 in tl.static_range(NPART):
        xs += tl.load(xss_ptr + (slot0 + s2) * BM + r, mask=rmask, other=0.0, cache_modifier=CACHE)
    return xs


def stats_rows(bm: int, npart: int) -> int:
    """Rows a stats program of the finish takes (FB): its partial tiles stay <= 2048 values each."""
    np2 = triton.next_power_of_2(npart)
    return max(1, min(bm, 2048 // (4 * np2)))


@triton.jit
def _finish_stats(
    ws_ptr, ss_ptr, rb, rr, M, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, mix_ptr,
    iters, hc_eps, norm_eps, K: tl.constexpr, BM: tl.constexpr, FB: tl.constexpr, MIXES: tl.constexpr,
    NPART: tl.constexpr, NP2: tl.constexpr,
):
    """For FB rows of row block ``rb`` (``rr``: their index in the block; all its partials are in): the sum
    of the NPART partials (a pairwise tree over them, ``_partial_group``), rsqrt, pre/post, softmax +
    Sinkhorn. The partials are read as a few wide tiles, masked to the live rows: the loads of one
    partial at a time had ~20 in flight and made the latency of the program (M = 1: 9.7 us for 32)."""
    slot0 = rb * NPART
    rows = rb * BM + rr
    rmask = rows < M
    c4 = tl.arange(0, 4)
    t_pre = _partial_group(ws_ptr, slot0, rr, rmask, 0, BM, FB, NPART, NP2)
    t_post = _partial_group(ws_ptr, slot0, rr, rmask, 4, BM, FB, NPART, NP2)
    t_c0 = _partial_group(ws_ptr, slot0, rr, rmask, 8, BM, FB, NPART, NP2)
    t_c1 = _partial_group(ws_ptr, slot0, rr, rmask, 12, BM, FB, NPART, NP2)
    t_c2 = _partial_group(ws_ptr, slot0, rr, rmask, 16, BM, FB, NPART, NP2)
    t_c3 = _partial_group(ws_ptr, slot0, rr, rmask, 20, BM, FB, NPART, NP2)
    sp = tl.arange(0, NP2)
    sso = (slot0 + sp[None, :]) * BM + rr[:, None]
    ss = pairwise_row_sum(tl.load(ss_ptr + sso, mask=rmask[:, None] & (sp[None, :] < NPART), other=0.0,
                                  cache_modifier=".cg"), FB, NP2)
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
    # comb as 16 column vectors [FB]: every reduction of the Sinkhorn is then elementwise in registers
    # (row sums of [FB, 4] tiles went through shared memory: two barriers each, 8 an iteration). The
    # sums keep pairwise_row_sum's tree, so the bits are those of the tile form.
    c00, c01, c02, c03 = _softmax_cols(m_c0 * sc2 + tl.load(b4 + 8), hc_eps, FB)
    c10, c11, c12, c13 = _softmax_cols(m_c1 * sc2 + tl.load(b4 + 12), hc_eps, FB)
    c20, c21, c22, c23 = _softmax_cols(m_c2 * sc2 + tl.load(b4 + 16), hc_eps, FB)
    c30, c31, c32, c33 = _softmax_cols(m_c3 * sc2 + tl.load(b4 + 20), hc_eps, FB)
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps)
    for _ in range(iters - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, hc_eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, hc_eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, hc_eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, hc_eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, hc_eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, hc_eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, hc_eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, hc_eps)
    tl.store(pre_ptr + o4, pre, mask=m2)
    tl.store(post_ptr + o4, post, mask=m2)
    cb = comb_ptr + rows * 16
    _store4(cb, c00, c01, c02, c03, rmask)
    _store4(cb + 4, c10, c11, c12, c13, rmask)
    _store4(cb + 8, c20, c21, c22, c23, rmask)
    _store4(cb + 12, c30, c31, c32, c33, rmask)


@triton.jit
def _norm4(a, b, c, d, eps):
    """``v / (sum(v) + eps)`` for four same-shape vectors, summed as ``pairwise_row_sum`` sums 4."""
    t = ((a + b) + (c + d)) + eps
    return a / t, b / t, c / t, d / t


@triton.jit
def _softmax_cols(z, hc_eps, BM: tl.constexpr):
    """Row softmax of a [BM, 4] tile, plus ``hc_eps``, as its four columns [BM] (the sum as
    ``pairwise_row_sum`` sums 4)."""
    lo, hi = tl.split(tl.reshape(z, (BM, 2, 2)))  # columns (0, 2) and (1, 3)
    z0, z2 = tl.split(lo)
    z1, z3 = tl.split(hi)
    mx = tl.maximum(tl.maximum(z0, z1), tl.maximum(z2, z3))
    e0, e1, e2, e3 = tl.exp(z0 - mx), tl.exp(z1 - mx), tl.exp(z2 - mx), tl.exp(z3 - mx)
    t = (e0 + e1) + (e2 + e3)
    return e0 / t + hc_eps, e1 / t + hc_eps, e2 / t + hc_eps, e3 / t + hc_eps


@triton.jit
def _store4(p, a, b, c, d, mask):
    tl.store(p, a, mask=mask)
    tl.store(p + 1, b, mask=mask)
    tl.store(p + 2, c, mask=mask)
    tl.store(p + 3, d, mask=mask)


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
    FINISH: tl.constexpr, SPLIT: tl.constexpr, FB: tl.constexpr, NP2: tl.constexpr, PDL: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One (row block, K slice, piece) per program; the last program of a row block to finish reduces it
    (FINISH; otherwise ``_finish_kernel``, launched next, does). SPLIT: each K slice is cut into SPLIT
    pieces of whole chunks with a partial each (fewer instructions a program at decode sizes; the
    partials are summed in (slice, piece) order, so SPLIT > 1 rounds differently from SPLIT = 1).

    BOUNDARY: h is ``post(y, res, post_in, comb_in)``, computed here and written once to new_ptr.
    COLLAPSE: also ``x = bf16(sum_j pre_prev_j h_j)`` (NORM: then RMSNorm of x, finished in place).
    """
    if PDL:  # the finish kernel (launched with PDL) may start now; it waits for this grid's writes
        _gdc_launch_dependents()
    DS: tl.constexpr = D // _S
    K: tl.constexpr = 4 * D
    NPART: tl.constexpr = _S * SPLIT
    CPP: tl.constexpr = DS // BK // SPLIT  # chunks a piece
    pid = tl.program_id(0).to(tl.int64)
    rb = pid // NPART
    s = pid % NPART // SPLIT
    piece = pid % SPLIT
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
    if COLLAPSE:  # the collapse weights, loaded once (inside the loop each load stalled its chunk)
        p0 = tl.load(pre_prev_ptr + rows * 4, mask=rmask, other=0.0)[:, None]
        p1 = tl.load(pre_prev_ptr + rows * 4 + 1, mask=rmask, other=0.0)[:, None]
        p2 = tl.load(pre_prev_ptr + rows * 4 + 2, mask=rmask, other=0.0)[:, None]
        p3 = tl.load(pre_prev_ptr + rows * 4 + 3, mask=rmask, other=0.0)[:, None]
    for c in range(CPP):
        cols = s * DS + (piece * CPP + c) * BK + tl.arange(0, BK)
        hb = h_ptr + rr * stride_h + cols[None, :]
        if BOUNDARY:
            yv = tl.load(y_ptr + rr * stride_y + cols[None, :], mask=m2, other=0.0).to(tl.float32)
            r0 = tl.load(hb, mask=m2, other=0.0).to(tl.float32)
            r1 = tl.load(hb + D, mask=m2, other=0.0).to(tl.float32)
            r2 = tl.load(hb + 2 * D, mask=m2, other=0.0).to(tl.float32)
            r3 = tl.load(hb + 3 * D, mask=m2, other=0.0).to(tl.float32)
        for k in tl.static_range(4):
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
                if k == 0:
                    xc = p0 * hk
                elif k == 1:
                    xc += p1 * hk
                elif k == 2:
                    xc += p2 * hk
                else:
                    xc += p3 * hk
        if COLLAPSE:
            xb, xc = _round_bf16(xc, INTERP)
            tl.store(x_ptr + rr * stride_x + cols[None, :], xb, mask=m2)
            xsq = tl.fma(xc, xc, xsq)
    # this slice's partials -> workspace slot pid ([BM, NMIX] mixes, [BM] sums of squares)
    n = tl.arange(0, _NP)
    tl.store(ws_ptr + (pid * BM + r[:, None]) * _NMIX + n[None, :], (acc_hi + acc_mid) + acc_lo,
             mask=n[None, :] < _NMIX)
    tl.store(ss_ptr + pid * BM + r, pairwise_row_sum(ssq, BM, BK))
    if NORM:
        tl.store(xss_ptr + pid * BM + r, pairwise_row_sum(xsq, BM, BK))
    if not FINISH:
        return
    # the last program of this row block to get here reduces it (all its partials are then visible)
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + rb, 1, sem="acq_rel", scope="gpu")
    if arrived == NPART - 1:
        slot0 = rb * NPART
        for q in tl.static_range(BM // FB):
            rq = q * FB + tl.arange(0, FB)
            _finish_stats(ws_ptr, ss_ptr, rb, rq, M, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, mix_ptr,
                          iters, hc_eps, norm_eps, K, BM, FB, MIXES, NPART, NP2)
        if NORM:
            xs = _norm_sumsq(xss_ptr, slot0, r, rmask, BM, NPART, ".cg", BM)
            _normalize_rows(x_ptr, w_ptr, rows, rmask, stride_x, xs, eps, D, XB, ".cg", INTERP)


@triton.jit(do_not_specialize=["M", "iters"])
def _finish_kernel(
    x_ptr, w_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, mix_ptr, ws_ptr, ss_ptr, xss_ptr,
    M, stride_x, iters, hc_eps, norm_eps, eps,
    D: tl.constexpr, BM: tl.constexpr, XB: tl.constexpr, NC: tl.constexpr, NORM: tl.constexpr,
    MIXES: tl.constexpr, NPART: tl.constexpr, PARTS: tl.constexpr, FB: tl.constexpr, NP2: tl.constexpr,
    PDL: tl.constexpr, RX: tl.constexpr, INTERP: tl.constexpr,
):
    """The reduction of ``_proj_kernel`` (FINISH=False) as its own launch; the same arithmetic as the
    last-arriver path, spread over more programs (the serial tail of one program per row block is gone).

    RX = 0 (grid (row block, part)): program part < PARTS normalizes NC * XB columns of its block's x,
    programs part >= PARTS finish the stats of FB rows each. RX > 0 (a 1-D grid, prefill sizes): the
    first programs finish the stats of FB rows each, then each of the others normalizes RX rows x XB
    columns of x, in row-major order (long contiguous runs, as the post kernel reads: a 64 x 64 tile a
    step read 128 bytes a row)."""
    if PDL:  # launched before the projection kernel ended: wait for its writes (all of them visible after)
        _gdc_wait()
    if RX > 0:
        pid = tl.program_id(0).to(tl.int64)
        nstats = tl.cdiv(M, BM) * (BM // FB)
        if pid < nstats:
            rb = pid // (BM // FB)
            rq = pid % (BM // FB) * FB + tl.arange(0, FB)
            _finish_stats(ws_ptr, ss_ptr, rb, rq, M, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, mix_ptr,
                          iters, hc_eps, norm_eps, 4 * D, BM, FB, MIXES, NPART, NP2)
        elif NORM:
            q = pid - nstats
            xrows = q // (D // XB) * RX + tl.arange(0, RX)  # RX divides BM: rows of one row block
            xs = _norm_sumsq(xss_ptr, xrows // BM * NPART, xrows % BM, xrows < M, BM, NPART, "", RX)
            _normalize_cols(x_ptr, w_ptr, xrows, xrows < M, stride_x, xs, eps, q % (D // XB) * XB, 1, D, XB, "",
                            INTERP)
        return
    rb = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    r = tl.arange(0, BM)
    rows = rb * BM + r
    rmask = rows < M
    slot0 = rb * NPART
    if part >= PARTS:  # stats of rows [q * FB, (q + 1) * FB) of the block
        rq = (part - PARTS) * FB + tl.arange(0, FB)
        _finish_stats(ws_ptr, ss_ptr, rb, rq, M, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, mix_ptr,
                      iters, hc_eps, norm_eps, 4 * D, BM, FB, MIXES, NPART, NP2)
    elif NORM:
        xs = _norm_sumsq(xss_ptr, slot0, r, rmask, BM, NPART, "", BM)
        _normalize_cols(x_ptr, w_ptr, rows, rmask, stride_x, xs, eps, part * NC * XB, NC, D, XB, "", INTERP)


@functools.lru_cache(maxsize=None)
def _sm_count(dev: torch.device) -> int:
    """Multiprocessors of ``dev`` (a fixed 132 off CUDA: the interpreter's programs run one by one)."""
    if dev.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(dev).multi_processor_count


# Rows a norm program of the finish takes at prefill sizes (config key ``norm_rows``), with ``norm_cols``
# columns: the post kernel's tile (4 x 1024), which reads at 97% of the copy bandwidth (run 24).
NORM_ROWS = 4


def norm_cols(d: int, rows: int) -> int:
    """Columns of a row-major norm program of ``rows`` rows: the largest power of two dividing ``d``,
    <= 1024 and <= 4096 elements a tile."""
    return max(1, min(d & -d, 1024, 4096 // rows))


def _finish_parts(d: int, xb: int) -> int:
    """Column parts of ``_finish_kernel``: the most parts up to 16 that split the XB-chunks evenly."""
    chunks = d // xb
    return max(p for p in range(1, 17) if chunks % p == 0)


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
    cfg = config or tactic(op, m, dict(d=d, n=n), untuned_config(op, m, d, batch_invariant),
                           batch_invariant=batch_invariant)
    bm = cfg["BLOCK_M"]
    nblocks = triton.cdiv(m, bm)
    split = check_split(op, cfg, d)
    npart = NUM_SLICES * split
    ws = torch.empty(nblocks * npart * bm * NMIX, **f32)
    ss = torch.empty(nblocks * npart * bm, **f32)
    norm = collapse and weight is not None
    xss = torch.empty_like(ss) if norm else ss
    # finish: "last" = the last slice program of a row block reduces it (arrival counters);
    # "kernel" = a second launch does (no counters to zero)
    finish = cfg.get("finish", "last")
    if finish not in ("last", "kernel"):
        raise ValueError(f"Triton {op}: finish must be 'last' or 'kernel', got {finish!r}")
    finish_last = finish == "last"
    count = torch.zeros(nblocks if finish_last else 0, dtype=torch.int32, device=dev)
    _, bk = slice_geometry(d)
    fb = int(cfg.get("finish_rows", stats_rows(bm, npart)))  # rows a stats program takes
    if fb < 1 or fb > bm or bm % fb or fb & (fb - 1):
        raise ValueError(f"Triton {op}: finish_rows must be a power of two dividing BLOCK_M {bm}, got {fb}")
    # pdl (finish="kernel"): the finish is launched while the projection runs (its launch latency hidden)
    # and waits in the kernel for the projection's writes
    pdl = finish == "kernel" and bool(cfg.get("pdl", False)) and pdl_available(dev)
    dummy = out["pre"]
    new_res = out.get("new_res", dummy)
    x = out.get("x", dummy)
    _proj_kernel[(nblocks * npart,)](
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
        FINISH=finish_last, SPLIT=split, FB=fb, NP2=triton.next_power_of_2(npart), PDL=pdl, INTERP=INTERPRET,
        num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 3),
        **LAUNCH_OPTIONS,
    )
    if finish == "kernel":
        # norm layout: (row block, column part) programs when few row blocks (decode: one column block a
        # program, one load latency), else ``norm_rows`` rows x a wide column block a program, row-major
        wide = nblocks * 16 >= _sm_count(dev)
        rx = int(cfg.get("norm_rows", NORM_ROWS if wide else 0)) if norm else 0
        if rx and (rx > bm or bm % rx or rx & (rx - 1)):
            raise ValueError(f"Triton {op}: norm_rows must be a power of two dividing BLOCK_M {bm}, got {rx}")
        if rx:  # 1-D: the stats programs, then the norm programs
            xb, parts_n = norm_cols(d, rx), 0
            grid = (nblocks * (bm // fb) + triton.cdiv(m, rx) * (d // xb),)
        else:  # (row block, part): PARTS norm parts, then the stats programs
            xb = _norm_block(d, bm)
            parts_n = 0 if not norm else _finish_parts(d, xb) if wide else d // xb
            grid = (nblocks, parts_n + bm // fb)
        _finish_kernel[grid](
            x, weight.contiguous() if norm else dummy, scale.contiguous(), base.contiguous(),
            out["pre"], out["post"], out["comb"], out.get("mixes", dummy), ws, ss, xss,
            m, x.stride(0) if collapse else 0, int(iters), float(hc_eps), float(norm_eps), float(eps),
            D=d, BM=bm, XB=xb, NC=d // xb // max(parts_n, 1), NORM=norm, MIXES=mixes, NPART=npart, PARTS=parts_n,
            FB=fb, NP2=triton.next_power_of_2(npart), PDL=pdl, RX=rx, INTERP=INTERPRET,
            num_warps=cfg.get("finish_warps", 4), **LAUNCH_OPTIONS, **({"launch_pdl": True} if pdl else {}),
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


def boundary_fused(y, res, post, comb, pre_prev, parts, scale, base, weight, iters, hc_eps, norm_eps, eps, *,
                   batch_invariant: bool, config: dict | None = None):
    """``mhc_boundary``'s ``fused`` form: the projection kernel also computes the post (``mhc.mhc_boundary``
    checks the inputs)."""
    o = _launch_proj("mhc_boundary", res, parts, scale, base, iters, hc_eps, norm_eps,
                     batch_invariant=batch_invariant, config=config, y=y, post_in=post, comb_in=comb,
                     pre_prev=pre_prev, weight=weight, eps=eps)
    return o["new_res"], o["x"], o["pre"], o["post"], o["comb"]

