"""The finish of the Triton mHC projection (``mhc_projection``): the slice partials of a row block reduced in a fixed
order, rsqrt, pre / post sigmoids, softmax + Sinkhorn (``_finish_stats``), and the RMSNorm of the collapse from its
norm partials; run by the projection kernel's last program of a row block or as a launch of its own
(``_finish_kernel``). The TileLang ``mhc_pre``'s stats are ``_stats_kernel`` (``finish_stats``): the same sums and
operations, one row a thread. Numerics: ``mhc``.

The stats' divisions and exponentials are pinned to PTX instructions on a GPU (``_div``: div.full, ``_div_rn``,
``_exp2``: ex2.approx; the launches keep ``a * b + c`` uncontracted, ``LAUNCH_OPTIONS``): what ``/``, ``tl.exp`` and
``tl.sigmoid`` become otherwise depends on the Triton and LLVM versions (Triton 3.9 divides the sums of squares by K
as a product with an approximate reciprocal; here ``div.rn``), and the TileLang ``mhc_pre``'s fused finish
(``tilelang.mhc_pre_finish``) repeats these instructions in CUDA to give the same bits."""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .common import INTERPRET, pairwise_row_sum, pdl_available
from .common import gdc_wait as _gdc_wait
from .mhc_common import _NMIX, _normalize_cols

_PTX = tl.constexpr(not INTERPRET)  # inline PTX only where a GPU compiles the kernel
_LOG2E = tl.constexpr(1.4426950408889634)  # (0x3FB8AA3B in fp32)


@triton.jit
def _div(x, y):
    """``x / y`` by ``div.full.f32`` (what Triton's fp32 division has been), whatever the compiler would pick."""
    if _PTX:
        return tl.inline_asm_elementwise("div.full.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return x / y


@triton.jit
def _div_rn(x, y):
    """``x / y`` rounded to nearest (``div.rn.f32``)."""
    if _PTX:
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return x / y


@triton.jit
def _exp2(x):
    """``2^x`` by ``ex2.approx.f32`` (``tl.exp(z)`` is this of ``z * log2(e)``, the product rounded)."""
    if _PTX:
        return tl.inline_asm_elementwise("ex2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _sigmoid(z):
    """``1 / (1 + e^-z)``: ``2^(z * -log2(e))``, plus one, divided into one (``_div``)."""
    return _div(tl.full(z.shape, 1.0, tl.float32), _exp2(z * -_LOG2E) + 1.0)


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
    _stats_out(t_pre, t_post, t_c0, t_c1, t_c2, t_c3, ss, rows, rmask, scale_ptr, base_ptr, pre_ptr, post_ptr,
               comb_ptr, mix_ptr, iters, hc_eps, norm_eps, K, FB, MIXES)


@triton.jit
def _stats_out(t_pre, t_post, t_c0, t_c1, t_c2, t_c3, ss, rows, rmask, scale_ptr, base_ptr, pre_ptr, post_ptr,
               comb_ptr, mix_ptr, iters, hc_eps, norm_eps, K: tl.constexpr, FB: tl.constexpr, MIXES: tl.constexpr):
    """From the FB rows' summed partials (``t_*`` [FB, 4] mix columns, ``ss`` [FB] sums of squares): rsqrt,
    pre / post, softmax + Sinkhorn, stored at ``rows``."""
    c4 = tl.arange(0, 4)
    k_f = tl.full(ss.shape, K, tl.float32)
    rstd = _div(tl.full(ss.shape, 1.0, tl.float32), tl.sqrt_rn(_div_rn(ss, k_f) + norm_eps))[:, None]
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
    pre = _sigmoid(m_pre * sc0 + tl.load(b4)) + hc_eps
    post = 2.0 * _sigmoid(m_post * sc1 + tl.load(b4 + 4))
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
def _sum16(ptr, off, STRIDE: tl.constexpr):
    """``sum(ptr[off + s * STRIDE] for s in range(16))`` in ``pairwise_row_sum``'s order (adjacent pairs, then
    pairs of those, ...)."""
    p0 = tl.load(ptr + off)
    p1 = tl.load(ptr + off + STRIDE)
    p2 = tl.load(ptr + off + 2 * STRIDE)
    p3 = tl.load(ptr + off + 3 * STRIDE)
    p4 = tl.load(ptr + off + 4 * STRIDE)
    p5 = tl.load(ptr + off + 5 * STRIDE)
    p6 = tl.load(ptr + off + 6 * STRIDE)
    p7 = tl.load(ptr + off + 7 * STRIDE)
    p8 = tl.load(ptr + off + 8 * STRIDE)
    p9 = tl.load(ptr + off + 9 * STRIDE)
    p10 = tl.load(ptr + off + 10 * STRIDE)
    p11 = tl.load(ptr + off + 11 * STRIDE)
    p12 = tl.load(ptr + off + 12 * STRIDE)
    p13 = tl.load(ptr + off + 13 * STRIDE)
    p14 = tl.load(ptr + off + 14 * STRIDE)
    p15 = tl.load(ptr + off + 15 * STRIDE)
    q0 = ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))
    q1 = ((p8 + p9) + (p10 + p11)) + ((p12 + p13) + (p14 + p15))
    return q0 + q1


@triton.jit
def _sum4(ptr, off, STRIDE: tl.constexpr):
    """``((p0 + p1) + (p2 + p3))`` of ``p_s = ptr[off + s * STRIDE]``."""
    p0 = tl.load(ptr + off)
    p1 = tl.load(ptr + off + STRIDE)
    p2 = tl.load(ptr + off + 2 * STRIDE)
    p3 = tl.load(ptr + off + 3 * STRIDE)
    return (p0 + p1) + (p2 + p3)


@triton.jit
def _quad_tree(k, q, s, h):
    """One step of the 16-slice pairwise tree over 4 quads (``q`` the sum of quad k, in order k = 0..3): ``s`` keeps
    an even quad's sum, the odd quad adds it; ``h`` becomes (Q0 + Q1) at k = 1 and ((Q0 + Q1) + (Q2 + Q3)) at k = 3."""
    p = s + q
    h = tl.where(k == 3, h + p, tl.where(k == 1, p, h))
    s = tl.where(k % 2 == 0, q, s)
    return s, h


@triton.jit(do_not_specialize=["M", "iters", "nloop"])
def _stats_kernel(
    ws_ptr, ss_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, mix_ptr, M, iters, nloop, hc_eps, norm_eps,
    K: tl.constexpr, BM: tl.constexpr, FB: tl.constexpr, NPART: tl.constexpr, MIXES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """``_finish_stats`` for FB consecutive rows (of any row blocks), one row a thread (FB = 32 x warps): the same
    sums in the same order, so the same bits. ``_finish_kernel``'s stats programs (FB <= 32 rows on 4 warps) hold
    each row's values in every warp, so each warp runs the whole Sinkhorn again, and move every partial tile
    through shared memory (a barrier after each tile's loads). Here nothing is computed twice and nothing is
    shared. A runtime loop (``nloop`` = 4 steps) keeps one step's loads in flight at a time: 4 whole partials a step
    (24 16-byte loads; each 32-byte sector taken by one thread's neighbouring loads), the pairwise tree carried over
    the steps (``_quad_tree``). (Reading 4 mix columns of the 16 partials a step, 6 steps, asked for each sector
    twice, steps apart: 135 against 50 us at M = 65536, run 188, H100.)"""
    tl.static_assert(NPART == 16, "the stats kernel sums 16 partials a row")
    if PDL:  # launched by programmatic dependent launch: wait for the partials' writer to end
        _gdc_wait()
    rows = tl.program_id(0).to(tl.int64) * FB + tl.arange(0, FB)
    rmask = rows < M
    rl = tl.minimum(rows, M - 1)  # rows past M load the last row's partials and store nothing
    r0 = rl // BM * (NPART * BM) + rl % BM  # the row's offset in its block's first partial
    w0 = r0[:, None] * _NMIX + tl.arange(0, 4)[None, :]
    t_pre = tl.zeros((FB, 4), tl.float32)
    t_post = tl.zeros((FB, 4), tl.float32)
    t_c0 = tl.zeros((FB, 4), tl.float32)
    t_c1 = tl.zeros((FB, 4), tl.float32)
    t_c2 = tl.zeros((FB, 4), tl.float32)
    t_c3 = tl.zeros((FB, 4), tl.float32)
    s_pre, s_post, s_c0, s_c1, s_c2, s_c3 = t_pre, t_post, t_c0, t_c1, t_c2, t_c3  # (zeros; quad 0 sets them)
    for k in range(nloop):
        b = w0 + k * (4 * BM * _NMIX)
        s_pre, t_pre = _quad_tree(k, _sum4(ws_ptr, b, BM * _NMIX), s_pre, t_pre)
        s_post, t_post = _quad_tree(k, _sum4(ws_ptr, b + 4, BM * _NMIX), s_post, t_post)
        s_c0, t_c0 = _quad_tree(k, _sum4(ws_ptr, b + 8, BM * _NMIX), s_c0, t_c0)
        s_c1, t_c1 = _quad_tree(k, _sum4(ws_ptr, b + 12, BM * _NMIX), s_c1, t_c1)
        s_c2, t_c2 = _quad_tree(k, _sum4(ws_ptr, b + 16, BM * _NMIX), s_c2, t_c2)
        s_c3, t_c3 = _quad_tree(k, _sum4(ws_ptr, b + 20, BM * _NMIX), s_c3, t_c3)
    ss = _sum16(ss_ptr, r0, BM)
    _stats_out(t_pre, t_post, t_c0, t_c1, t_c2, t_c3, ss, rows, rmask, scale_ptr, base_ptr, pre_ptr, post_ptr,
               comb_ptr, mix_ptr, iters, hc_eps, norm_eps, K, FB, MIXES)


@triton.jit
def _norm4(a, b, c, d, eps):
    """``v / (sum(v) + eps)`` for four same-shape vectors, summed as ``pairwise_row_sum`` sums 4."""
    t = ((a + b) + (c + d)) + eps
    return _div(a, t), _div(b, t), _div(c, t), _div(d, t)


@triton.jit
def _softmax_cols(z, hc_eps, BM: tl.constexpr):
    """Row softmax of a [BM, 4] tile, plus ``hc_eps``, as its four columns [BM] (the sum as
    ``pairwise_row_sum`` sums 4)."""
    lo, hi = tl.split(tl.reshape(z, (BM, 2, 2)))  # columns (0, 2) and (1, 3)
    z0, z2 = tl.split(lo)
    z1, z3 = tl.split(hi)
    mx = tl.maximum(tl.maximum(z0, z1), tl.maximum(z2, z3))
    e0, e1 = _exp2((z0 - mx) * _LOG2E), _exp2((z1 - mx) * _LOG2E)
    e2, e3 = _exp2((z2 - mx) * _LOG2E), _exp2((z3 - mx) * _LOG2E)
    t = (e0 + e1) + (e2 + e3)
    return _div(e0, t) + hc_eps, _div(e1, t) + hc_eps, _div(e2, t) + hc_eps, _div(e3, t) + hc_eps


@triton.jit
def _store4(p, a, b, c, d, mask):
    tl.store(p, a, mask=mask)
    tl.store(p + 1, b, mask=mask)
    tl.store(p + 2, c, mask=mask)
    tl.store(p + 3, d, mask=mask)


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
            q0 = pid % (BM // FB) * FB
            if rb * BM + q0 >= M:  # none of its rows is live (small M): skip the Sinkhorn of masked rows
                return
            rq = q0 + tl.arange(0, FB)
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
        q0 = (part - PARTS) * FB
        if rb * BM + q0 >= M:  # none of its rows is live
            return
        rq = q0 + tl.arange(0, FB)
        _finish_stats(ws_ptr, ss_ptr, rb, rq, M, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, mix_ptr,
                      iters, hc_eps, norm_eps, 4 * D, BM, FB, MIXES, NPART, NP2)
    elif NORM:
        xs = _norm_sumsq(xss_ptr, slot0, r, rmask, BM, NPART, "", BM)
        _normalize_cols(x_ptr, w_ptr, rows, rmask, stride_x, xs, eps, part * NC * XB, NC, D, XB, "", INTERP)


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


# The stats kernel's launch: one warp a program (32 rows), and a register budget that lets ptxas keep a step's 24
# loads in flight together (164 registers for sm_90, no spill).
STATS_WARPS = 1
STATS_MAXNREG = 168


@functools.cache
def _takes_maxnreg() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "maxnreg" in getattr(CUDAOptions, "__dataclass_fields__", {})


def _maxnreg_option() -> dict:
    """``{"maxnreg": STATS_MAXNREG}`` where this Triton takes the option, else nothing."""
    return {"maxnreg": STATS_MAXNREG} if _takes_maxnreg() else {}


def finish_stats(ws, ss, scale, base, pre, post, comb, mix, m: int, k: int, bm: int, iters: int, hc_eps: float,
                 norm_eps: float, launch_options: dict, kernel: str = "rows_full", pdl: bool = False) -> None:
    """pre, post, comb (and with ``mix`` not None the pre-Sinkhorn mixes) from the partials ``ws``/``ss`` of an
    ``m``-row projection (K = ``k``, 16 slices, ``bm``-row blocks). ``kernel``: "rows_full" (``_stats_kernel``, one
    row a thread) or "tiles" (``_finish_kernel``'s stats programs); the same bits. ``pdl``: "rows_full" launched by
    programmatic dependent launch where the device takes it (``common.pdl_available``), waiting in the kernel for
    the partials' writer, which lets it launch early (the TileLang kernel's ``finish_pdl``)."""
    mixes = mix is not None
    if kernel == "tiles":
        fb = stats_rows(bm, 16)
        _finish_kernel[(triton.cdiv(m, bm), bm // fb)](
            pre, pre, scale, base, pre, post, comb, mix if mixes else pre, ws, ss, ss, m, 0, int(iters),
            float(hc_eps), float(norm_eps), 0.0, D=k // 4, BM=bm, XB=1, NC=1, NORM=False, MIXES=mixes, NPART=16,
            PARTS=0, FB=fb, NP2=16, PDL=False, RX=0, INTERP=INTERPRET, num_warps=4, **launch_options)
        return
    if kernel != "rows_full":
        raise ValueError(f"finish_stats: kernel is 'rows_full' or 'tiles', got {kernel!r}")
    fb = 32 * STATS_WARPS
    pdl = pdl and pdl_available(ws.device)
    _stats_kernel[(triton.cdiv(m, fb),)](
        ws, ss, scale, base, pre, post, comb, mix if mixes else pre, m, int(iters), 4,
        float(hc_eps), float(norm_eps), K=k, BM=bm, FB=fb, NPART=16, MIXES=mixes, PDL=pdl,
        num_warps=STATS_WARPS, **launch_options, **({} if INTERPRET else _maxnreg_option()),
        **({"launch_pdl": True} if pdl else {}))
