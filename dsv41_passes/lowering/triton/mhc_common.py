"""Configs and shared arithmetic of the Triton mHC kernels (``mhc``, ``mhc_projection`` and ``mhc_finish``).

The numerics every kernel shares are stated in ``mhc``'s docstring.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
# Defaults: the configs the H200 tuning run of 2026-11-29 picked for pre at M = 65536
# (benchmarks/results/mhc-tune-NVIDIA_H200-2026-11-29.json; its picks at 4096 and 128 differ).
# Post: four rows x 1024 columns a program, programs in row-major order (run 18 and 22 probes at M = 65536:
# 1.45 ms, 98% of the copy roofline, in every allocator state tried; the tuned one-row config ran
# 1.45 or 1.60 ms depending on where the output landed: run22-probe_harness.log).
# finish="kernel": the reduction + norm of pre and boundary run as a second launch spread over
# (row block, column part) programs instead of by the last slice program of each row block (same
# bits; pre 1.75 vs 1.86 ms at M = 65536, 0.025 vs 0.056 ms at 128: run14-quick_check-mhc.log). The stats
# alone likewise (run 58: 17.2 vs 36.0 us at M = 128, 0.080 vs 0.099 ms at 4096, 1.09 vs 1.14 at 65536);
# up to SMALL_ROWS_MAX_M their untuned config keeps the last-arriver finish (11.8 vs 13.9 us at M = 1).
DEFAULTS: dict[str, dict] = {
    "mhc_post": dict(BLOCK_R=4, BLOCK_D=1024, num_warps=8),
    "mhc_collapse": dict(BLOCK_R=32, num_warps=4),
    "mhc_stats": dict(BLOCK_M=64, num_warps=4, num_stages=3, finish="kernel"),
    "mhc_pre": dict(BLOCK_M=64, num_warps=4, num_stages=3, finish="kernel"),
    "mhc_boundary": dict(BLOCK_M=64, num_warps=4, num_stages=3, finish="kernel", form="post_pre", post_rows=1,
                         post_cols=1024, post_warps=4),
}
# Under the CPU interpreter every program costs milliseconds: fewer, larger tiles. Every config computes
# the same bits (see the module docstring), so this changes the speed of the tests, not their results.
INTERPRETER_DEFAULTS: dict[str, dict] = {
    "mhc_post": dict(BLOCK_R=64, BLOCK_D=1024, num_warps=4),
    "mhc_collapse": dict(BLOCK_R=256, num_warps=4),
    "mhc_stats": dict(BLOCK_M=512, num_warps=8, num_stages=1, finish="kernel"),
    "mhc_pre": dict(BLOCK_M=512, num_warps=8, num_stages=1, finish="kernel"),
    "mhc_boundary": dict(BLOCK_M=512, num_warps=8, num_stages=1, finish="kernel", form="post_pre", post_rows=64,
                         post_cols=1024, post_warps=4),
}


# Compile options of every launch (see the module docstring: no FMA contraction).
LAUNCH_OPTIONS = dict(enable_fp_fusion=False)


def default_config(op: str) -> dict:
    """The op's fixed, M-independent launch config (the only one batch-invariant mode uses)."""
    return (INTERPRETER_DEFAULTS if INTERPRET else DEFAULTS)[op]


# ``split`` (config key of the projection ops and the collapse): each K slice cut into that many pieces of
# whole chunks, a partial each. 1 = the batch-invariant numerics. Split 2 took mhc_pre from 18.5 to 16.7 us
# at M = 1 (run 39) and was 3-8% faster up to M = 256 (run 36). On the H200 (run 40) the split-2 set passed
# the Flash GPU test (mixes vs float64, pre = collapse + stats and boundary = post then pre bitwise at
# M = 1, 7, 200). So every op with the option takes split 2 up to SPLIT2_MAX_M tokens outside
# batch-invariant mode (the same rule for all of them keeps the identities). Splits 5 and 10 are tuner
# options: their projection is faster but the finish sums 80 / 160 partials (runs 49-51).
SPLITS = (1, 2, 5, 10)
SPLIT_OPS = ("mhc_stats", "mhc_pre", "mhc_boundary", "mhc_collapse")
SPLIT2_MAX_M = 256
# Up to SMALL_ROWS_MAX_M tokens (outside batch-invariant mode) the projection ops also take 16-row blocks
# on 4 warps (mma.sync instead of wgmma: the BLOCK_M >= 16 * num_warps rule is for batch invariance): a
# quarter of the elementwise work a warp where 15 of 16 rows of a 64-row block were padding. mhc_pre,
# probe run 51 (us): 12.2 vs 13.4 at M = 1, 13.3 vs 14.7 at 16, 13.8 vs 15.0 at 64; at 128 the
# 64-row block is faster (16.0 vs 17.6).
SMALL_ROWS_MAX_M = 64
SMALL_ROWS = dict(BLOCK_M=16, num_warps=4)
# Above it, up to FINISH_SMALL_MAX_M, mhc_pre's finish takes stats programs of 2 rows on 2 warps
# (``finish_rows`` / ``finish_warps``: the same bits, a different grouping of rows into programs). Probe
# run 55 (us): 14.37 vs 15.71 at M = 65, 14.46 vs 15.96 at 128.
FINISH_SMALL_MAX_M = 128
FINISH_SMALL = dict(finish_rows=2, finish_warps=2)
# ``pdl`` (config key with finish="kernel"; opt-in, off in every default): the finish kernel is launched by
# programmatic dependent launch and waits in the kernel for the projection's writes. Same bits; run 54:
# 0.1-0.8 us faster at M = 1 ... 256 (M = 128: 15.7 vs 16.1 us), slower at prefill (1.73 vs 1.62 ms at
# 65536: its early CTAs hold SM slots while they wait).
_PROJ_OPS = ("mhc_stats", "mhc_pre", "mhc_boundary")


# mhc_boundary (``form``, see ``mhc.mhc_boundary``). Outside batch-invariant mode: up to
# BOUNDARY_POST_PRE_MAX_M tokens the post kernel then mhc_pre, above it the post + collapse kernel (one row
# a program on 4 warps, 1024-column tiles) then mhc_stats. Runs 79 / 82 (us, post_collapse vs post_pre):
# 2764 vs 3051 at M = 65536, 723 vs 844 at 16384, 154.7 vs 157.6 at 3072, 110.9 vs 110.1 at 2048, 63.7 vs
# 56.6 at 1024. Batch-invariant mode keeps post_pre at every M (no M-dependent tactic). Every form gives
# the same bits for one projection config; each form's projection takes the untuned config of the op it
# runs (mhc_pre / mhc_stats).
BOUNDARY_POST_PRE_MAX_M = 2048
_BOUNDARY_POST = ("post_rows", "post_cols", "post_warps")


def untuned_config(op: str, m: int, d: int, batch_invariant: bool) -> dict:
    """The config ``tactic`` falls back to: the fixed default; at decode sizes outside batch-invariant mode
    split 2 (when a K slice has an even number of chunks), up to SMALL_ROWS_MAX_M 16-row blocks (and for
    ``mhc_stats`` the last-arriver finish), then up to FINISH_SMALL_MAX_M (``mhc_pre``) the small-row
    finish."""
    cfg = default_config(op)
    if op == "mhc_boundary" and not batch_invariant and cfg.get("form") in ("post_pre", "post_collapse"):
        form = "post_pre" if m <= BOUNDARY_POST_PRE_MAX_M else "post_collapse"
        proj = untuned_config("mhc_pre" if form == "post_pre" else "mhc_stats", m, d, False)
        return dict(proj, **{k: cfg[k] for k in _BOUNDARY_POST if k in cfg}, form=form)
    if batch_invariant or op not in SPLIT_OPS or m > SPLIT2_MAX_M or "split" in cfg:
        return cfg
    ds, bk = slice_geometry(d)
    if (ds // bk) % 2:
        return cfg
    cfg = dict(cfg, split=2)
    if op in _PROJ_OPS and m <= SMALL_ROWS_MAX_M:
        cfg.update(SMALL_ROWS)
        if op == "mhc_stats":
            cfg["finish"] = "last"
    elif op == "mhc_pre" and m <= FINISH_SMALL_MAX_M and cfg.get("finish") == "kernel":
        cfg.update(FINISH_SMALL)
    return cfg


def check_split(op: str, cfg: dict, d: int) -> int:
    """The config's split, checked against hidden ``d`` (it must divide a K slice's chunks)."""
    split = int(cfg.get("split", 1))
    ds, bk = slice_geometry(d)
    if split not in SPLITS or (ds // bk) % split:
        raise ValueError(f"Triton {op}: split must be one of {SPLITS} and divide the {ds // bk} chunks of a K "
                         f"slice, got {split}")
    return split


_PROJ_CANDIDATES = [
    dict(BLOCK_M=bm, num_warps=w, num_stages=st) for bm, w in ((64, 4), (128, 4), (128, 8)) for st in (2, 3, 4)
]
_FINISH = [dict(c, finish="kernel") for c in _PROJ_CANDIDATES]
# 256 rows halve the L2 traffic of the weight parts per row; the boundary's extra tiles do not fit there
_WIDE = [dict(BLOCK_M=256, num_warps=8, num_stages=st) for st in (2, 3)]
# the boundary's post + collapse kernel: rows and warps a program (the projection: the stats' default)
_POST_COLLAPSE = [dict(DEFAULTS["mhc_stats"], form="post_collapse", post_rows=r, post_cols=c, post_warps=w)
                  for r, c, w in ((1, 1024, 4), (2, 1024, 8), (4, 1024, 8), (4, 512, 4), (8, 512, 8))]
CANDIDATES: dict[str, list[dict]] = {
    "mhc_post": [
        dict(BLOCK_R=r, BLOCK_D=b, num_warps=w)
        for r in (1, 2, 4)
        for b in (512, 1024, 2048)
        for w in (4, 8)
        if r * b <= 4096
    ],
    "mhc_collapse": [dict(BLOCK_R=r, num_warps=w) for r in (16, 32, 64) for w in (4, 8)],
    "mhc_stats": _PROJ_CANDIDATES + _WIDE,
    "mhc_pre": _PROJ_CANDIDATES + _FINISH + _WIDE,
    "mhc_boundary": _POST_COLLAPSE + [dict(DEFAULTS["mhc_pre"], form="post_pre")] + _PROJ_CANDIDATES + _FINISH,
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
def _normalize_rows(x_ptr, w_ptr, rows, rmask, stride_x, sumsq, eps,
                    D: tl.constexpr, XB: tl.constexpr, CACHE: tl.constexpr, INTERP: tl.constexpr):
    """x <- bf16(w * (x * rsqrt(sumsq / D + eps))) in place (x was written by this launch; CACHE ".cg"
    reads it from L2 when other programs wrote parts of it)."""
    _normalize_cols(x_ptr, w_ptr, rows, rmask, stride_x, sumsq, eps, 0, D // XB, D, XB, CACHE, INTERP)


@triton.jit
def _normalize_cols(x_ptr, w_ptr, rows, rmask, stride_x, sumsq, eps, c0,
                    NC: tl.constexpr, D: tl.constexpr, XB: tl.constexpr, CACHE: tl.constexpr, INTERP: tl.constexpr):
    """``_normalize_rows`` on the columns ``[c0, c0 + NC * XB)`` only. Both divisions round to nearest
    (``div_rn``; a plain ``/`` is ``div.full``/``div.approx`` on the GPU, which Triton versions lower
    differently), so the TileLang ``mhc_pre`` can give the same bits."""
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(sumsq, D * 1.0) + eps))[:, None]
    for c in range(NC):
        cols = c0 + c * XB + tl.arange(0, XB)
        ptrs = x_ptr + rows[:, None] * stride_x + cols[None, :]
        xv = tl.load(ptrs, mask=rmask[:, None], other=0.0, cache_modifier=CACHE).to(tl.float32)
        wv = tl.load(w_ptr + cols).to(tl.float32)
        out = rne_bf16(wv[None, :] * (xv * rstd), INTERP)
        tl.store(ptrs, out.to(x_ptr.dtype.element_ty), mask=rmask[:, None])
