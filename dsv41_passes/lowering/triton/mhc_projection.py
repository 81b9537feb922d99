"""The Triton mHC projection kernel: compensated BF16x3 stats, optionally with the collapse + norm
(``mhc_pre``) or the preceding post (``mhc_boundary``), one read of the residual (numerics: ``mhc``); its finish
(the partials reduced, the stats and the norm) is ``mhc_finish``."""

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
from .mhc_common import (
    _NMIX,
    _NP,
    _S,
    LAUNCH_OPTIONS,
    NMIX,
    _combine,
    _norm_block,
    _normalize_rows,
    _round_bf16,
    check_split,
    unsupported,
    untuned_config,
)
from .mhc_finish import NORM_ROWS, _finish_kernel, _finish_parts, _finish_stats, _norm_sumsq, norm_cols, stats_rows

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
            if rb * BM + q * FB < M:  # some of these rows are live
                rq = q * FB + tl.arange(0, FB)
                _finish_stats(ws_ptr, ss_ptr, rb, rq, M, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
                              mix_ptr, iters, hc_eps, norm_eps, K, BM, FB, MIXES, NPART, NP2)
        if NORM:
            xs = _norm_sumsq(xss_ptr, slot0, r, rmask, BM, NPART, ".cg", BM)
            _normalize_rows(x_ptr, w_ptr, rows, rmask, stride_x, xs, eps, D, XB, ".cg", INTERP)


@functools.lru_cache(maxsize=None)
def _sm_count(dev: torch.device) -> int:
    """Multiprocessors of ``dev`` (a fixed 132 off CUDA: the interpreter's programs run one by one)."""
    if dev.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(dev).multi_processor_count


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

