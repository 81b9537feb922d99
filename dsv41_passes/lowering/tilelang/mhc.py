"""TileLang kernels of the mHC family: the compensated BF16x3 stats (``mhc_stats``) for sm_90a.

Two launches, both with the token count as ``T.dynamic("M")`` (one binary per config):

1. ``partial``: grid (16 K slices, row blocks). Slice s is the four streams' hidden
   columns ``[s * D/16, (s + 1) * D/16)``, walked in chunks of BK columns with
   streams 0..3 inside a chunk (the Triton kernels' partition). Per step one
   ``[BM, BK]`` activation tile in shared memory feeds three ``T.gemm`` (hi, mid,
   lo bf16 weight parts) into separate fp32 fragments (hi from a fresh accumulator
   each step, added in registers) and the row sums of squares;
   the slice partial ``(hi + mid) + lo`` goes to ``[16, M, 32]`` and the sums of
   squares to ``[16, M]``.
2. ``finish``: ordered slice sum (0..15), ``rsqrt(sumsq / K + eps)``, pre/post
   sigmoids, softmax + Sinkhorn for ``R`` rows per block.

The numerics match the Triton provider's definition (slices, dot order, fp32
everywhere) but not its bits: the reduction trees inside ``T.reduce_sum`` and
the wgmma issue order are TileLang's. Every config is M-independent, so rows are
batch invariant. Kernels are compiled lazily and cached per config.
"""

# no "from __future__ import annotations": TileLang evaluates the prim_func annotations (closure sizes)

import threading
from typing import Any

import torch

from ...tuning import tactic
from ..mhc_weights import NUM_SLICES, slice_geometry
from ..mhc_weights import NP_DEFAULT as NP

HC = 4
NMIX = (2 + HC) * HC
TARGET = {"kind": "cuda", "arch": "sm_90a"}

DEFAULTS: dict[str, dict] = {"mhc_stats": dict(BLOCK_M=64, threads=128, num_stages=3, FINISH_ROWS=32)}
CANDIDATES: dict[str, list[dict]] = {
    "mhc_stats": [
        dict(BLOCK_M=bm, threads=t, num_stages=st, FINISH_ROWS=32)
        for bm, t in ((64, 128), (128, 128), (128, 256))
        for st in (2, 3, 4)
    ]
}

_LOCK = threading.Lock()
_KERNELS: dict[tuple[Any, ...], Any] = {}


def unsupported(h: torch.Tensor) -> str | None:
    if h.dtype != torch.bfloat16:
        return f"residual dtype {h.dtype} (kernels are bf16)"
    if h.dim() != 3 or h.shape[1] != HC:
        return f"hc_mult {h.shape[1] if h.dim() == 3 else '?'} (kernels are written for {HC})"
    d = h.shape[2]
    if d % (NUM_SLICES * 16):
        return f"hidden {d}: tensor-core chunks need hidden/16 divisible by 16"
    if not h.is_contiguous():
        return "residual is not contiguous"
    return None


# ----------------------------------------------------------------------------- kernel builders
def build_partial(d: int, block_m: int, threads: int, num_stages: int):
    """PrimFunc: ``h [M, 4*d] bf16, parts [3, 4*d, 32] bf16 -> ws [16, M, 32] f32, ss [16, M] f32``."""
    import tilelang.language as T

    k_total = HC * d
    ds, bk = slice_geometry(d)
    steps = (ds // bk) * HC
    m = T.dynamic("M")
    bf16, f32 = "bfloat16", "float32"

    @T.prim_func
    def partial(
        h: T.Tensor((m, k_total), bf16),
        parts: T.Tensor((3, k_total, NP), bf16),
        ws: T.Tensor((NUM_SLICES, m, NP), f32),
        ss: T.Tensor((NUM_SLICES, m), f32),
    ):
        with T.Kernel(NUM_SLICES, T.ceildiv(m, block_m), threads=threads) as (s, bm):
            a_s = T.alloc_shared((block_m, bk), bf16)
            hi_s = T.alloc_shared((bk, NP), bf16)
            mid_s = T.alloc_shared((bk, NP), bf16)
            lo_s = T.alloc_shared((bk, NP), bf16)
            acc_hi = T.alloc_fragment((block_m, NP), f32)
            step_hi = T.alloc_fragment((block_m, NP), f32)
            acc_mid = T.alloc_fragment((block_m, NP), f32)
            acc_lo = T.alloc_fragment((block_m, NP), f32)
            sq = T.alloc_fragment((block_m, bk), f32)
            sq_row = T.alloc_fragment((block_m,), f32)
            T.clear(acc_hi)
            T.clear(acc_mid)
            T.clear(acc_lo)
            T.clear(sq)
            for it in T.Pipelined(steps, num_stages=num_stages):
                # step = (chunk c, stream j); column k0 of the flattened [4*d] row
                k0 = (it % HC) * d + s * ds + (it // HC) * bk
                T.copy(h[bm * block_m, k0], a_s)
                T.copy(parts[0, k0, 0], hi_s)
                T.copy(parts[1, k0, 0], mid_s)
                T.copy(parts[2, k0, 0], lo_s)
                # hi: a fresh MMA chain per step, added in fp32 registers (Hopper's in-MMA accumulation
                # is not round-to-nearest; over a slice's 1280 products it reached ~1.3e-6 normwise);
                # mid and lo are below 2^-8 and 2^-16 of it and accumulate in the MMA
                T.gemm(a_s, hi_s, step_hi, clear_accum=True)
                for i, n in T.Parallel(block_m, NP):
                    acc_hi[i, n] += step_hi[i, n]
                T.gemm(a_s, mid_s, acc_mid)
                T.gemm(a_s, lo_s, acc_lo)
                for i, c in T.Parallel(block_m, bk):
                    sq[i, c] += T.cast(a_s[i, c], f32) * T.cast(a_s[i, c], f32)
            T.reduce_sum(sq, sq_row, dim=1)
            for i, n in T.Parallel(block_m, NP):
                acc_hi[i, n] = (acc_hi[i, n] + acc_mid[i, n]) + acc_lo[i, n]
            for i, n in T.Parallel(block_m, NP):
                if bm * block_m + i < m:
                    ws[s, bm * block_m + i, n] = acc_hi[i, n]
            for i in T.Parallel(block_m):
                if bm * block_m + i < m:
                    ss[s, bm * block_m + i] = sq_row[i]

    return partial


def build_finish(d: int, rows: int, iters: int, hc_eps: float, norm_eps: float):
    """PrimFunc: partials -> ``pre [M, 4], post [M, 4], comb [M, 4, 4]`` (iters and eps baked in)."""
    import tilelang.language as T

    k_total = HC * d
    m = T.dynamic("M")
    f32 = "float32"

    @T.prim_func
    def finish(
        ws: T.Tensor((NUM_SLICES, m, NP), f32),
        ss: T.Tensor((NUM_SLICES, m), f32),
        scale: T.Tensor((3,), f32),
        base: T.Tensor((NMIX,), f32),
        pre: T.Tensor((m, HC), f32),
        post: T.Tensor((m, HC), f32),
        comb: T.Tensor((m, HC, HC), f32),
    ):
        with T.Kernel(T.ceildiv(m, rows), threads=128) as bx:
            t_pre = T.alloc_fragment((rows, HC), f32)
            t_post = T.alloc_fragment((rows, HC), f32)
            cm = T.alloc_fragment((rows, HC, HC), f32)
            sq = T.alloc_fragment((rows,), f32)
            rstd = T.alloc_fragment((rows,), f32)
            row_max = T.alloc_fragment((rows, HC), f32)
            row_sum = T.alloc_fragment((rows, HC), f32)
            col_sum = T.alloc_fragment((rows, HC), f32)
            T.clear(t_pre)
            T.clear(t_post)
            T.clear(cm)
            T.clear(sq)
            for s in T.serial(NUM_SLICES):  # slice order 0..15
                for i, j in T.Parallel(rows, HC):
                    if bx * rows + i < m:
                        t_pre[i, j] += ws[s, bx * rows + i, j]
                        t_post[i, j] += ws[s, bx * rows + i, HC + j]
                for i, j, k in T.Parallel(rows, HC, HC):
                    if bx * rows + i < m:
                        cm[i, j, k] += ws[s, bx * rows + i, 2 * HC + j * HC + k]
                for i in T.Parallel(rows):
                    if bx * rows + i < m:
                        sq[i] += ss[s, bx * rows + i]
            for i in T.Parallel(rows):
                rstd[i] = 1.0 / T.sqrt(sq[i] / k_total + T.float32(norm_eps))
            for i, j in T.Parallel(rows, HC):
                t_pre[i, j] = T.sigmoid(t_pre[i, j] * rstd[i] * scale[0] + base[j]) + T.float32(hc_eps)
                t_post[i, j] = 2.0 * T.sigmoid(t_post[i, j] * rstd[i] * scale[1] + base[HC + j])
            for i, j, k in T.Parallel(rows, HC, HC):
                cm[i, j, k] = cm[i, j, k] * rstd[i] * scale[2] + base[2 * HC + j * HC + k]
            T.reduce_max(cm, row_max, dim=2)
            for i, j, k in T.Parallel(rows, HC, HC):
                cm[i, j, k] = T.exp(cm[i, j, k] - row_max[i, j])
            T.reduce_sum(cm, row_sum, dim=2)
            for i, j, k in T.Parallel(rows, HC, HC):
                cm[i, j, k] = cm[i, j, k] / row_sum[i, j] + T.float32(hc_eps)
            T.reduce_sum(cm, col_sum, dim=1)
            for i, j, k in T.Parallel(rows, HC, HC):
                cm[i, j, k] = cm[i, j, k] / (col_sum[i, k] + T.float32(hc_eps))
            for _ in T.serial(iters - 1):
                T.reduce_sum(cm, row_sum, dim=2)
                for i, j, k in T.Parallel(rows, HC, HC):
                    cm[i, j, k] = cm[i, j, k] / (row_sum[i, j] + T.float32(hc_eps))
                T.reduce_sum(cm, col_sum, dim=1)
                for i, j, k in T.Parallel(rows, HC, HC):
                    cm[i, j, k] = cm[i, j, k] / (col_sum[i, k] + T.float32(hc_eps))
            for i, j in T.Parallel(rows, HC):
                if bx * rows + i < m:
                    pre[bx * rows + i, j] = t_pre[i, j]
                    post[bx * rows + i, j] = t_post[i, j]
            for i, j, k in T.Parallel(rows, HC, HC):
                if bx * rows + i < m:
                    comb[bx * rows + i, j, k] = cm[i, j, k]

    return finish


def compile_kernel(func, execution_backend: str = "tvm_ffi"):
    """Lower and compile a PrimFunc for sm_90a (needs nvcc, not a GPU)."""
    import tilelang
    from tvm.target import Target

    target = Target(TARGET)
    with target:
        return tilelang.compile(func, target=target, execution_backend=execution_backend)


def _kernel(kind: str, *key: Any):
    full = (kind, *key)
    k = _KERNELS.get(full)
    if k is None:
        with _LOCK:
            k = _KERNELS.get(full)
            if k is None:
                func = build_partial(*key) if kind == "partial" else build_finish(*key)
                k = _KERNELS[full] = compile_kernel(func)
    return k


# ----------------------------------------------------------------------------- entry point
def mhc_stats(h, parts, scale, base, iters, hc_eps, norm_eps, *, batch_invariant: bool, config: dict | None = None):
    why = unsupported(h)
    if why:
        raise ValueError(f"TileLang mhc_stats: {why}")
    m, n, d = h.shape
    if tuple(parts.shape) != (3, n * d, NP) or parts.dtype != torch.bfloat16:
        raise ValueError(f"TileLang mhc_stats: parts must be bf16 [3, {n * d}, {NP}], got {tuple(parts.shape)}")
    f32 = dict(dtype=torch.float32, device=h.device)
    pre, post, comb = torch.empty((m, n), **f32), torch.empty((m, n), **f32), torch.empty((m, n, n), **f32)
    if m == 0:
        return pre, post, comb
    cfg = config or tactic("mhc_stats.tilelang", m, dict(d=d, n=n), DEFAULTS["mhc_stats"],
                           batch_invariant=batch_invariant)
    ws, ss = partials(h, parts, cfg)
    _kernel("finish", d, cfg["FINISH_ROWS"], int(iters), float(hc_eps), float(norm_eps))(
        ws, ss, scale.contiguous(), base.contiguous(), pre, post, comb
    )
    return pre, post, comb


def partials(h: torch.Tensor, parts: torch.Tensor, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The first launch alone: per-slice projection partials ``[16, M, 32]`` and sums of squares ``[16, M]``."""
    m, n, d = h.shape
    f32 = dict(dtype=torch.float32, device=h.device)
    ws = torch.empty((NUM_SLICES, m, NP), **f32)
    ss = torch.empty((NUM_SLICES, m), **f32)
    _kernel("partial", d, cfg["BLOCK_M"], cfg["threads"], cfg["num_stages"])(h.view(m, n * d), parts, ws, ss)
    return ws, ss
