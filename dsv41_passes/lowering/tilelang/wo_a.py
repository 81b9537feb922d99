"""TileLang kernel of the WO-A family (sm_90a): inverse RoPE + grouped GEMM, token-major.

``z [M, G*R] = per group g: rope^-1(o[:, g-th head group]) @ Wa[g]^T``. One CTA owns a
``[BM, BN]`` tile of z whose BN columns lie in one group (``R % BN == 0``); CTAs that
share a row tile are adjacent in launch order (column tiles fastest) so o is read from
HBM about once and the weight stays in L2.

The K loop has two parts, like the Triton kernel:

1. a pipelined loop over every ``BK``-chunk without rope dims (all heads of the group):
   copy o and W chunks to shared memory, ``T.gemm`` (wgmma on sm_90a, fp32 accumulation);
2. each head's last chunk, which holds its ``RD`` rope dims: copy to shared, de-rotate
   in fp32 into a second shared tile (bf16 store = the reference's rounding), ``T.gemm``.

``build_one_loop`` (configs with ``one_loop=True``, tuner candidates) runs a single
warp-specialized loop over every chunk instead: the rope chunk is de-rotated in place in
its pipeline stage, and the tile is split between warpgroups by rows, so a 128 x 256 tile
issues wgmma m64n256k16 with four 48 KiB stages (192 KiB of shared memory).

``wo_a_specialized`` (configs with ``specialized=True``, the default from M = 2048, persistent there)
computes the same product with the pipeline written out; its rope chunks are de-rotated beforehand by
``triton.wo_a.rope_tails``, so its loop is a plain GEMM (the same bits as the one-loop kernel; above M = 32768),
or in the kernel: by its consumer warpgroups in the stage (``rope="consumers"``, a tuner candidate) or into the
A registers of a register-A wgmma (``rope="registers"``, M 2048 to 32768).

The rope table is read as ``cs [M, RD]`` fp32 with cos/sin interleaved per pair
(``view_as_real`` of the complex table, so the model's spelling needs no copy).
M is ``T.dynamic``: one binary per config serves every token count. nvcc runs with
``--fmad=false`` so the de-rotation rounds like the reference (the GEMM is wgmma).
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations,
# which name this module's closure variables.

import functools
import threading
from typing import Any

import torch

from ...tuning import tactic
from ..rope_tables import interleaved_view
from ..wo_a import geometry, split_parts

TARGET = {"kind": "cuda", "arch": "sm_90a"}

# Tactic key of this provider (its configs differ from the Triton provider's).
TACTIC_OP = "wo_a.tilelang"

# one K loop, 128 x 128 tiles, cos/sin in registers: the decode-size defaults (split-K or not)
_DECODE = dict(BM=128, BN=128, BK=64, stages=4, threads=256, one_loop=True, cs_regs=True)
CANDIDATES: dict[str, list[dict]] = {
    TACTIC_OP: [
        dict(BM=bm, BN=bn, BK=bk, stages=s, threads=t)
        for bm, bn, bk, s, t in [
            (64, 32, 128, 4, 128), (64, 64, 128, 4, 128), (64, 128, 64, 4, 128), (64, 256, 64, 3, 128),
            (128, 64, 64, 4, 256), (128, 128, 64, 4, 256), (128, 128, 128, 3, 256), (128, 256, 64, 3, 256),
        ]
    ]
    + [  # one K loop, rope chunks de-rotated in place, row-split warpgroups (``build_one_loop``)
        dict(BM=bm, BN=bn, BK=64, stages=s, threads=t, one_loop=True)
        for bm, bn, s, t in [(64, 128, 4, 128), (64, 256, 4, 128), (128, 128, 4, 256), (128, 256, 3, 256),
                             (128, 256, 4, 256)]
    ]
    + [  # the same with each thread's cos/sin pairs loaded once, before the loop, into registers
        dict(BM=128, BN=256, BK=64, stages=s, threads=256, one_loop=True, cs_regs=True) for s in (3, 4)
    ]
    + [dict(_DECODE, SPLIT=s) for s in (2, 4, 8)]  # split-K (decode sizes)
    # the same with 64-column tiles and 8 stages (``decode_config``; 24 KiB a stage)
    + [dict(_DECODE, BN=64, SPLIT=s, stages=8) for s in (1, 2, 4)]
    # split-K whose parts the tile's thread block cluster sums through distributed shared memory (no partials in
    # global memory, no sum kernel; the same bits as the same split); clusters of 4 fit fewer at a time
    # (run138-probe_wo_a_decode-cluster.log: 64-column tiles in 4 parts 16.9 us against 11.1 at M = 128)
    + [dict(_DECODE, BN=64, SPLIT=2, cluster=True), dict(_DECODE, SPLIT=4, cluster=True)]
    # the decode default's split (64-column tiles in 4 parts at TP4, 128 x 128 in 8) with the sum kernel launched by
    # programmatic dependent launch (``pdl``: its grid may start while the GEMM finishes; the same bits, GPU test
    # passed in run 159). Within 1-2% (us, TP4, medians of 6 interleaved rounds): 10.9 against 11.1 at M = 128
    # (run 160), 10.9 against 11.0 with 8 stages (run 162), 15.5 against 15.7 at 256 (64-column tiles in 2 parts,
    # run 160): left to the tuner
    + [dict(_DECODE, BN=64, SPLIT=4, stages=8, pdl=True), dict(_DECODE, SPLIT=8, pdl=True)]
    # the tile leaves through shared memory (TMA store); 128 x 128 x 3 stages with or without it measured
    # 2.39-2.51 ms at 65536 against 1.73 for this one (run26-quick_check-wo_a.log) and were dropped
    + [dict(BM=128, BN=256, BK=64, stages=3, threads=256, one_loop=True, cs_regs=True, epi_smem=True)]
    + [  # the same with the rope chunk de-rotated into registers (wgmma with A from registers); at
        # 128 x 256 it measured slower than in place (run14-quick_check-rest.log), so small tiles only
        dict(BM=64, BN=bn, BK=64, stages=4, threads=128, one_loop=True, rope_regs=True) for bn in (64, 128)
    ]
    # the pipeline written out, rope chunks de-rotated beforehand (``wo_a_specialized``); either wgmma wait
    + [dict(BM=128, BN=256, BK=64, stages=3, specialized=True, wait0=w) for w in (False, True)]
    # a persistent tile loop, and / or the rope chunks de-rotated by the consumer warpgroups
    + [dict(BM=128, BN=256, BK=64, stages=3, specialized=True, persistent=True)]
    + [dict(BM=128, BN=256, BK=64, stages=3, specialized=True, rope="consumers", persistent=p) for p in (False, True)]
    # or into the A registers of a register-A wgmma
    + [dict(BM=128, BN=256, BK=64, stages=3, specialized=True, rope="registers", persistent=p) for p in (False, True)]
    # with 4 stages, the tile leaving in two halves through a [128, 128] buffer
    + [dict(BM=128, BN=256, BK=64, stages=4, specialized=True, rope=r, persistent=True, z_cols=128)
       for r in ("tails", "registers")]
}
# Batch-invariant mode: the prefill default (no split-K, so a row's bits never depend on M); it
# measured 1.73 ms at M = 65536 where the two-loop 128 x 128 kernel of runs <= 25 took 2.50
BATCH_INVARIANT_CONFIG = dict(BM=128, BN=256, BK=64, stages=3, threads=256, one_loop=True, cs_regs=True,
                              epi_smem=True)
# Above M = 32768 (outside batch-invariant mode): the same 128 x 256 product with the pipeline written out, the
# rope chunks de-rotated by a Triton pass over them first, one persistent CTA an SM; the same bits as
# BATCH_INVARIANT_CONFIG. run100-probe_wo_a_specialized.log (medians of 8 interleaved rounds, ms): 1.635 vs
# 1.652 (not persistent) and 1.658 (BATCH_INVARIANT_CONFIG) at 65536, 0.423 vs 0.434 / 0.435 at 16384; without
# RoPE 1.502 vs 1.614 at 65536 (cuBLAS 1.498). The pipeline written out, not persistent, against the one-loop
# kernel: run94-probe_wo_a_specialized.log.
SPECIALIZED_CONFIG = dict(BM=128, BN=256, BK=64, stages=3, specialized=True, persistent=True)
# A tuner candidate (the default for 2048 <= M <= 4096 in runs 105-119): the same, its consumer warpgroups
# de-rotating the rope chunks in the stage (a separate pass costs more there than in the kernel); the same bits
# again. run102-probe_wo_a_specialized.log
# (medians of 6 interleaved rounds, ms): 0.0541 vs 0.0582 (BATCH_INVARIANT_CONFIG) and 0.0582 (rope chunks
# de-rotated beforehand) at 2048, 0.0956 vs 0.1031 / 0.0977 at 3072, 0.1067 vs 0.1168 / 0.1077 at 4096.
SPECIALIZED_CONSUMERS_CONFIG = dict(SPECIALIZED_CONFIG, rope="consumers")
# 2048 <= M <= 32768 (outside batch-invariant mode): the same, the rope chunk de-rotated into the A registers of a
# register-A wgmma, with 4 stages (the tile leaves in two 128-column halves to make room); the same bits. Medians
# of 6 interleaved rounds, ms (``*-probe_wo_a_specialized.log``), against the rope pass (persistent, 3 stages)
# and cuBLAS bmm: run121 0.3935 vs 0.4162 / 0.3951 at 16384, 0.1012 vs 0.1077 / 0.1006 at 4096; run122 0.8253 vs
# 0.8536 / 0.7992 at 32768, 0.2054 vs 0.2135 / 0.2053 at 8192, 0.0515 vs 0.0582 / 0.0516 at 2048. At 65536 it
# tied with the rope pass (1.658 vs 1.6425 in run121, 1.6766 vs 1.6804 in run122); with stream-K on both it is ahead
# at TP4 (``REGISTERS_MAX_N``).
# With 3 stages (run119) 0.4289 vs 0.4355 at 16384: the rope chunk takes longer to consume, and the 4th stage
# keeps the loads ahead of it.
SPECIALIZED_REGISTERS_CONFIG = dict(SPECIALIZED_CONFIG, rope="registers", stages=4, z_cols=128)
# From M = 2048 (outside batch-invariant mode) both run with ``stream_k``: where the tiles leave a partial wave of at
# most a quarter of the CTAs, the last full wave and that one are shared out by K chunks (a cut tile's bits depend on
# M). Medians of 8 interleaved rounds, ms, against the same kernel without it (run143-probe_wo_a_stream_k-tp4.log,
# TP4; the partial wave in tiles of 132): 1.592 vs 1.644 at 65536 (4), 0.4070 vs 0.4157 at 17408 (32), 0.1119 vs
# 0.1435 at 4352 (8), 0.0670 vs 0.0929 at 2304 (12); at TP1 1.638 vs 1.683 at 16384 (4). Sharing out the last full
# wave with larger partial waves was slower (a CTA takes two tiles of a row block in turn and their o is read from
# HBM again): 1.184 vs 1.179 at 49152 (36), 0.990 vs 0.975 at 40960 (52), 0.4312 vs 0.4126 at 18432 (96), at TP1
# 0.4635 vs 0.3967 at 4096 (100). The partial wave alone (the narrow phase, run146-probe_wo_a_stream_k-tp4.log,
# medians of 6 rounds): 1.237 vs 1.251 at 49152, 1.029 vs 1.034 at 40960, 0.2385 vs 0.2526 at 9216 (48), but 1.014
# vs 1.002 at 34816 (64), 0.4037 vs 0.3991 at 16384 (100), 0.1228 vs 0.1039 at 4096 (124), at TP1 0.4476 vs 0.4169
# at 4096 and 0.2592 vs 0.2169 at 2048 (116): the fix-up of tiles cut in up to five parts costs what a mostly full
# partial wave gains. So the default shares out partial waves of up to a quarter of the CTAs only. That fix-up (the
# partials stored, flagged, waited for and added) is what costs: a diagnostic build without it (wrong sums, not kept;
# run156/157-diag-stream_k-fixup.log, medians of 10 rounds, ms) took 0.1044 / 0.1051 against 0.1198 / 0.1208 with it
# (any partial wave) and 0.1054 / 0.1064 for the default at 4096, 0.4159 / 0.4137 against 0.4316 / 0.4279 and 0.4294
# / 0.4232 at 16384, 0.1101 / 0.1198 against 0.1204 / 0.1302 at 4352 (the default's wide phase). Flags a 128-byte
# line apart with one fence a CTA instead of one a thread changed nothing (run157). Partials laid out for 16-byte
# coalesced stores and loads (``ws_index``; the same sums) cut it (run158-diag-stream_k-fixup-coalesced.log, 8
# rounds, ms): the default's wide phase at 4352 0.1140 against cuBLAS 0.1157 (run156/157: 0.1204 / 0.1302 against
# 0.1164 / 0.1265); any partial wave at 4096 0.1121 against 0.1012 for the default, still slower.
STREAM_K_SHARE = 0.25
# Above M = 32768 too, for up to REGISTERS_MAX_N output columns (TP4's 2048; the W of 16 MiB stays in the L2): the
# register-A kernel with stream-K, against the rope pass (medians of 12 interleaved rounds, ms,
# run153-probe_wo_a_store-gt32k-tp4.log): 1.6243 vs 1.7086 at 65536, 1.2726 vs 1.3314 at 49152, 1.0248 vs 1.0689 at
# 40960, 0.9693 vs 0.9974 at 36864 (cuBLAS bmm 1.6303 / 1.2292 / 0.9979 / 0.9273); runs 151-152 1.6414 vs 1.7373 and
# 1.6476 vs 1.7421 at 65536. At TP1 (N 8192, a W of 64 MiB) the rope pass stays ahead: 7.0279 vs 7.2943 at 65536.
REGISTERS_MAX_N = 2048
# Tuner candidates: any partial wave shared out; each consumer warpgroup storing its rows of the tile on its own
# (``wg_store``, the same bits; no clear gain: 1.6164 vs 1.6243 at 65536 and 1.2563 vs 1.2726 at 49152 in run153,
# within 1% either way at 36864, 16384, 4096 and TP1; slower with the rope pass's one 256-column store)
CANDIDATES[TACTIC_OP] += [dict(SPECIALIZED_CONFIG, stream_k=True), dict(SPECIALIZED_REGISTERS_CONFIG, stream_k=True),
                          dict(SPECIALIZED_REGISTERS_CONFIG, stream_k=STREAM_K_SHARE, wg_store=True)]
# Untuned defaults by token count (upper M, config), from benchmarks/results/run27-quick_check-wo_a-small.log
# and run26 (H200): split-K with 128 x 128 tiles for decode sizes (11.8 / 15.9 / 22.5 us at M = 128 / 256 /
# 512 where the 64 x 64 one-loop kernel took 27.4 / 28.1 / 55.3), 128 x 128 up to 1024 (31.4 vs 112 us),
# 128 x 256 with the tile stored through shared memory up to 2047 (0.0997 vs 0.106 ms at 4096, 1.73 vs 1.80
# at 65536), SPECIALIZED_REGISTERS_CONFIG up to 32768 and above for N <= REGISTERS_MAX_N, otherwise SPECIALIZED_CONFIG
# (all with stream-K). M <= 128 with the geometry known: ``decode_config``. M <= 16 (outside batch-invariant mode)
# runs the Triton split-K kernel (``triton.wo_a``).
DEFAULTS: list[tuple[int, dict]] = [
    (128, dict(_DECODE, SPLIT=8)),
    (256, dict(_DECODE, SPLIT=4)),
    (512, dict(_DECODE, SPLIT=2)),
    (1024, _DECODE),
    (2047, BATCH_INVARIANT_CONFIG),
    (32768, dict(SPECIALIZED_REGISTERS_CONFIG, stream_k=STREAM_K_SHARE)),
]
DECODE_MAX_M = 128


def decode_config(m: int, n: int, hpg: int, sms: int) -> dict:
    """M <= 128: 64-column tiles, K split over whole heads into the most parts (a power of two, at most 8) that
    keep the grid within one wave of ``sms`` CTAs. run103-probe_wo_a_decode-tp4.log / -tp1.log (us, medians of
    6 interleaved rounds) at M = 128: TP4 (N 2048, 8 heads a group) 11.0 with 4 parts against 11.8 for the 128 x
    128 tiles in 8 parts (cuBLAS 8.9); TP1 (N 8192) 29.8 with 1 part against 51.2 (cuBLAS 22.8). 8 stages instead of
    4 (192 of the 227 KiB of shared memory; runs 162-163, medians of 6 and 8 interleaved rounds): TP1 25.1 and 24.6
    against 30.1 and 29.6 (the one-part kernel streams all of K, 64 chunks, and 4 stages left it latency-bound:
    DRAM 38% busy at TP4 under Nsight Compute, run 161); TP4 11.0 against 11.1 at 128, 19.9 against 20.0 at 256."""
    tiles = -(-n // 64) * -(-m // 128)  # (a narrower N still takes one column tile)
    parts = 1
    while parts < 8 and hpg % (2 * parts) == 0 and tiles * 2 * parts <= sms:
        parts *= 2
    return dict(_DECODE, BN=64, SPLIT=parts, stages=8)


def default_config(m: int, n: int | None = None, hpg: int | None = None) -> dict:
    """Untuned choice by token count (see ``DEFAULTS``); with the geometry (``n = G*R`` output columns, ``hpg``
    heads a group) given, ``decode_config`` at M <= 128, and above M = 32768 the register-A kernel for ``n`` up to
    ``REGISTERS_MAX_N``."""
    if m <= DECODE_MAX_M and n is not None and hpg is not None:
        return decode_config(m, n, hpg, sm_count())
    for upper, cfg in DEFAULTS:
        if m <= upper:
            return dict(cfg)
    if n is not None and n <= REGISTERS_MAX_N:
        return dict(SPECIALIZED_REGISTERS_CONFIG, stream_k=STREAM_K_SHARE)
    return dict(SPECIALIZED_CONFIG, stream_k=STREAM_K_SHARE)


def _pow2_divisor(x: int) -> int:
    return x & -x


def _tiles(cfg: dict, d: int, r: int, rope_dim: int) -> tuple[int, int]:
    """(BN, BK) clipped to the shape: BN divides R, BK divides D and holds the rope dims."""
    bn = min(cfg["BN"], _pow2_divisor(r))
    bk = min(cfg["BK"], _pow2_divisor(d))
    if rope_dim:
        bk = max(bk, 1 << (rope_dim - 1).bit_length())
    return bn, bk


def shape_reason(h: int, d: int, g: int, r: int, rope_dim: int) -> str | None:
    """Why the kernel cannot be built for this geometry (None when it can)."""
    if r % 32:
        return f"o_rank {r} is not a multiple of 32"
    if d % 64:
        return f"head_dim {d} is not a multiple of 64"
    if rope_dim and _pow2_divisor(d) < max(64, 1 << (rope_dim - 1).bit_length()):
        return f"rope_dim {rope_dim} does not fit one power-of-two chunk of head_dim {d}"
    return None


def unsupported_reason(o: torch.Tensor, weight: torch.Tensor, rope_dim: int) -> str | None:
    _, h, d, g, r, _ = geometry(o, weight)
    if o.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return f"dtypes {o.dtype}/{weight.dtype} (kernel is bf16)"
    if not o.is_contiguous():
        return f"o is not contiguous (strides {tuple(o.stride())}); the kernel reads a dense [M, H*D]"
    if not weight.is_contiguous():
        return "weight is not contiguous"
    return shape_reason(h, d, g, r, rope_dim)


# ------------------------------------------------------------------ kernel
def build(g: int, r: int, hpg: int, d: int, rope_dim: int, BM: int, BN: int, BK: int, stages: int, threads: int):
    """The TileLang prim_func for one geometry and config (M dynamic)."""
    import tilelang.language as T

    bf16, f32 = T.bfloat16, T.float32
    M = T.dynamic("M")
    K, N = hpg * d, g * r
    RD = rope_dim
    chunks = d // BK  # K-chunks per head
    plain = chunks - 1 if RD else chunks  # per head, chunks without rope dims
    rope_from = BK - RD  # first rope column inside a head's last chunk
    cs_cols = max(RD, 2)  # the table's width (a placeholder column pair without RoPE)

    @T.prim_func
    def wo_a_kernel(
        O: T.Tensor((M, g * K), bf16),
        W: T.Tensor((N, K), bf16),
        CS: T.Tensor((M, cs_cols), f32),
        Z: T.Tensor((M, N), bf16),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=threads) as (bx, by):
            a_s = T.alloc_shared((BM, BK), bf16)
            b_s = T.alloc_shared((BN, BK), bf16)
            acc = T.alloc_fragment((BM, BN), f32)
            col0 = (bx * BN // r) * K  # first o column of this tile's group
            T.clear(acc)
            if plain > 0:
                for t in T.Pipelined(hpg * plain, num_stages=stages):
                    k0 = (t // plain) * d + (t % plain) * BK
                    T.copy(O[by * BM, col0 + k0], a_s)
                    T.copy(W[bx * BN, k0], b_s)
                    T.gemm(a_s, b_s, acc, transpose_B=True)
            if RD > 0:
                x_s = T.alloc_shared((BM, BK), bf16)
                y_s = T.alloc_shared((BM, BK), bf16)
                r_s = T.alloc_shared((BN, BK), bf16)
                cs_s = T.alloc_shared((BM, cs_cols), f32)
                T.copy(CS[by * BM, 0], cs_s)
                for h in T.Pipelined(hpg, num_stages=2):
                    k0 = h * d + d - BK
                    T.copy(O[by * BM, col0 + k0], x_s)
                    T.copy(W[bx * BN, k0], r_s)
                    for i, j in T.Parallel(BM, BK):
                        # pair (2p, 2p+1) of the tail: y0 = x0*c + x1*s, y1 = x1*c - x0*s
                        jr = T.max(j - rope_from, 0)
                        odd = jr % 2
                        c = cs_s[i, jr - odd]
                        s = cs_s[i, jr - odd + 1]
                        x = T.cast(x_s[i, j], f32)
                        xp = T.cast(x_s[i, j + 1 - 2 * odd], f32)
                        y_s[i, j] = T.if_then_else(
                            j >= rope_from, T.cast(x * c + xp * T.if_then_else(odd == 1, -s, s), bf16), x_s[i, j]
                        )
                    T.gemm(y_s, r_s, acc, transpose_B=True)
            T.copy(acc, Z[by * BM, bx * BN])

    return wo_a_kernel


def build_one_loop(g: int, r: int, hpg: int, d: int, rope_dim: int, BM: int, BN: int, BK: int, stages: int,
                   threads: int, rope_regs: bool = False, cs_regs: bool = False, epi_smem: bool = False,
                   split: int = 1, cluster: bool = False):
    """Variant (config ``one_loop=True``): one warp-specialized K loop over every chunk; the warpgroups
    split the tile by rows (wgmma ``m64 x BN``). A head's rope chunk is de-rotated in place in its
    pipeline stage before its gemm, or with ``rope_regs`` into a register fragment that feeds the
    wgmma as its A operand (each thread de-rotates its own elements: no barrier, the stage is read only).
    ``cs_regs`` (in-place path): cos/sin depend on the row only, so each thread loads the pairs it
    de-rotates once, before the loop, into registers, instead of at every head's rope chunk.
    ``epi_smem``: the bf16 tile goes to global memory through shared memory (row-contiguous stores)
    instead of straight from the accumulator fragment.
    ``split`` > 1 (split-K, decode sizes, not batch-invariant): the third grid axis picks ``HPG/split``
    whole heads of the group; each CTA writes its fp32 partial tile to ``Z [split, M, N]`` for a
    fixed-order sum kernel."""
    import tilelang.language as T

    bf16, f32 = T.bfloat16, T.float32
    M = T.dynamic("M")
    K, N = hpg * d, g * r
    RD = rope_dim
    chunks = d // BK
    rope_from = BK - RD
    cs_cols = max(RD, 2)
    half = max(RD // 2, 1)
    hps = hpg // split  # heads of the group one CTA reduces over
    if cluster and not (1 < split <= 8 and BM % split == 0 and BN % 4 == 0):
        raise ValueError(f"wo_a (tilelang): a cluster reduction needs 2 to 8 parts dividing BM and BN a multiple of 4, "
                         f"got {split} parts, BM {BM}, BN {BN}")
    z_shape, z_dtype = ((split, M, N), f32) if split > 1 and not cluster else ((M, N), bf16)
    rows = BM // split  # rows of the tile each CTA of a cluster sums
    launch = dict(cluster_dims=(1, 1, split), prelude=CLUSTER_SUM_SOURCE) if cluster else {}

    @T.prim_func
    def wo_a_one_loop_kernel(
        O: T.Tensor((M, g * K), bf16),
        W: T.Tensor((N, K), bf16),
        CS: T.Tensor((M, cs_cols), f32),
        Z: T.Tensor(z_shape, z_dtype),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), split, threads=threads, **launch) as (bx, by, bz):
            a_s = T.alloc_shared((BM, BK), bf16)
            b_s = T.alloc_shared((BN, BK), bf16)
            acc = T.alloc_fragment((BM, BN), f32)
            if cluster:
                p_s = T.alloc_shared((BM, BN), f32)  # this CTA's partial, read by the cluster
            if rope_regs:
                a_r = T.alloc_fragment((BM, BK), bf16)
            if not rope_regs:
                y0_f = T.alloc_fragment((BM, half), bf16)
                y1_f = T.alloc_fragment((BM, half), bf16)
            if cs_regs:
                c_f = T.alloc_fragment((BM, half), f32)
                s_f = T.alloc_fragment((BM, half), f32)
                for i, p in T.Parallel(BM, half):
                    live = by * BM + i < M
                    c_f[i, p] = T.if_then_else(live, CS[by * BM + i, 2 * p], 0.0)
                    s_f[i, p] = T.if_then_else(live, CS[by * BM + i, 2 * p + 1], 0.0)
            col0 = (bx * BN // r) * K
            T.clear(acc)
            for t in T.Pipelined(hps * chunks, num_stages=stages):
                k0 = (bz * hps + t // chunks) * d + (t % chunks) * BK
                T.copy(O[by * BM, col0 + k0], a_s)
                T.copy(W[bx * BN, k0], b_s)
                if RD > 0 and t % chunks == chunks - 1:
                    if rope_regs:
                        for i, j in T.Parallel(BM, BK):
                            # pair (2p, 2p+1) of the tail: y0 = x0*c + x1*s, y1 = x1*c - x0*s
                            jr = T.max(j - rope_from, 0)
                            odd = jr % 2
                            live = by * BM + i < M
                            c = T.if_then_else(live, CS[by * BM + i, jr - odd], 0.0)
                            s = T.if_then_else(live, CS[by * BM + i, jr - odd + 1], 0.0)
                            x = T.cast(a_s[i, j], f32)
                            xp = T.cast(a_s[i, j + 1 - 2 * odd], f32)
                            a_r[i, j] = T.if_then_else(
                                j >= rope_from, T.cast(x * c + xp * T.if_then_else(odd == 1, -s, s), bf16), a_s[i, j]
                            )
                        T.gemm(a_r, b_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    else:
                        # two phases (read all pairs, then write them back): one barrier between them;
                        # a single read-modify-write loop gets a barrier per pair of every thread
                        for i, p in T.Parallel(BM, half):
                            if cs_regs:
                                c = c_f[i, p]
                                s = s_f[i, p]
                            else:
                                live = by * BM + i < M
                                c = T.if_then_else(live, CS[by * BM + i, 2 * p], 0.0)
                                s = T.if_then_else(live, CS[by * BM + i, 2 * p + 1], 0.0)
                            x0 = T.cast(a_s[i, rope_from + 2 * p], f32)
                            x1 = T.cast(a_s[i, rope_from + 2 * p + 1], f32)
                            y0_f[i, p] = T.cast(x0 * c + x1 * s, bf16)
                            y1_f[i, p] = T.cast(x1 * c - x0 * s, bf16)
                        for i, p in T.Parallel(BM, half):
                            a_s[i, rope_from + 2 * p] = y0_f[i, p]
                            a_s[i, rope_from + 2 * p + 1] = y1_f[i, p]
                        T.gemm(a_s, b_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                else:
                    T.gemm(a_s, b_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            if cluster:
                T.copy(acc, p_s)
                T.cluster_sync()  # every partial is in its CTA's shared memory
                for i, j in T.Parallel(rows, BN // 4):  # rank bz of the cluster (its split index) sums rows bz * rows..
                    T.call_extern("handle", "dsv41_cluster_sum4", T.address_of(p_s[bz * rows + i, j * 4]), split,
                                  T.address_of(Z[by * BM + bz * rows + i, bx * BN + j * 4]),
                                  by * BM + bz * rows + i < M)
                T.cluster_sync()  # no CTA leaves while another reads its partial
            elif split > 1:
                T.copy(acc, Z[bz, by * BM, bx * BN])
            elif epi_smem:
                z_s = T.alloc_shared((BM, BN), bf16)
                T.copy(acc, z_s)
                T.copy(z_s, Z[by * BM, bx * BN])
            else:
                T.copy(acc, Z[by * BM, bx * BN])

    return wo_a_one_loop_kernel


# ``cluster``: four fp32 of a row, summed over the cluster's CTAs in rank order (the same offset in each CTA's
# shared memory, read through distributed shared memory), rounded to bf16 and stored when the row is live
CLUSTER_SUM_SOURCE = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ void dsv41_cluster_sum4(void* src, int parts, void* dst, bool live) {
  const unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(src));
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int q = 0; q < parts; ++q) {
    unsigned remote;
    float4 v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(q));
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
    if (q == 0) {
      acc = v;
    } else {
      acc.x = __fadd_rn(acc.x, v.x); acc.y = __fadd_rn(acc.y, v.y);
      acc.z = __fadd_rn(acc.z, v.z); acc.w = __fadd_rn(acc.w, v.w);
    }
  }
  if (live) {
    __nv_bfloat162 out[2] = {__float22bfloat162_rn(make_float2(acc.x, acc.y)),
                             __float22bfloat162_rn(make_float2(acc.z, acc.w))};
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(out);
  }
}
"""

_CACHE: dict[tuple, Any] = {}
_LOCK = threading.Lock()


def compile_kernel(g: int, r: int, hpg: int, d: int, rope_dim: int, cfg: dict, target: dict | None = None):
    """Compiled kernel for a geometry + config, cached (one binary serves every M)."""
    key = (g, r, hpg, d, rope_dim, tuple(sorted(_tile_args(cfg).items())), _builder(cfg).__name__,
           tuple(sorted((target or TARGET).items())))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        import tilelang
        from tvm.target import Target

        tgt = Target(target or TARGET)
        with tgt:
            fn = _builder(cfg)(g, r, hpg, d, rope_dim, **_tile_args(cfg))
            # no FMA contraction: the de-rotation rounds each product and sum like the reference
            kernel = tilelang.compile(fn, target=tgt, execution_backend="tvm_ffi", compile_flags=["--fmad=false"],
                                      pass_configs=_pass_configs(cfg))
        _CACHE[key] = kernel
        return kernel


def lower_source(g: int, r: int, hpg: int, d: int, rope_dim: int, cfg: dict) -> str:
    """CUDA source of the kernel for sm_90a (needs no GPU and no nvcc)."""
    import tilelang
    from tvm.target import Target

    tgt = Target(TARGET)
    with tgt, tilelang.transform.PassContext(config=_pass_configs(cfg)):
        return tilelang.lower(_builder(cfg)(g, r, hpg, d, rope_dim, **_tile_args(cfg)), target=tgt).kernel_source


def _builder(cfg: dict):
    if cfg.get("specialized"):
        from .wo_a_specialized import build_specialized  # noqa: PLC0415

        return build_specialized
    return build_one_loop if cfg.get("one_loop") else build


def _pass_configs(cfg: dict) -> dict:
    if cfg.get("specialized"):
        from .wo_a_specialized import PASS_CONFIGS  # noqa: PLC0415

        return dict(PASS_CONFIGS)
    return {}


def _tile_args(cfg: dict) -> dict:
    skip = ("one_loop", "SPLIT", "pdl")  # (``pdl`` is the sum kernel's)
    if cfg.get("specialized"):  # the tile always leaves through shared memory
        skip += ("specialized", "cs_regs", "epi_smem", "persistent")
    args = {k: v for k, v in cfg.items() if k not in skip}
    if cfg.get("SPLIT", 1) > 1:
        args["split"] = cfg["SPLIT"]
    if cfg.get("specialized") and cfg.get("persistent"):
        args["ctas"] = sm_count()
    return args


def sm_count() -> int:
    """CTAs of a persistent kernel: the current device's SMs (an H200's 132 without a GPU)."""
    return _sms(torch.cuda.current_device()) if torch.cuda.is_available() else 132


@functools.lru_cache(maxsize=None)
def _sms(device: int) -> int:  # asked at every call (the kernel cache's key): once a device
    return torch.cuda.get_device_properties(device).multi_processor_count


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``WS`` / ``FL`` of a specialized kernel: for ``stream_k`` the cut tiles' partials (fp32, one a CTA) and their
    flags (zero between launches: each launch takes every flag it sets), one pair per device and stream, so
    launches that may overlap never share one (CUDA graphs captured on one stream share it: replay them one at a
    time, as a serving loop does); otherwise one-element placeholders."""
    from .wo_a_specialized import workspace_shapes  # noqa: PLC0415

    sk = bool(cfg.get("stream_k"))
    ws, fl = workspace_shapes(sm_count() if sk else 1, cfg["BM"], cfg["BN"], sk)
    key = (str(device), torch.cuda.current_stream(device).stream_id if sk else 0, ws, fl)
    hit = _WORKSPACES.get(key)
    if hit is None:
        hit = _WORKSPACES[key] = (torch.empty(ws, dtype=torch.float32, device=device),
                                  torch.zeros(fl, dtype=torch.int32, device=device))
    return hit


def derotates_beforehand(cfg: dict, rope_dim: int) -> bool:
    """Whether the kernel of ``cfg`` reads its rope chunks de-rotated by ``rope_tails`` (not the table)."""
    return bool(rope_dim and cfg.get("specialized") and cfg.get("rope", "tails") == "tails")


def launch_config(config: dict, h: int, d: int, r: int, rope_dim: int) -> dict:
    """``config`` with BN / BK clipped to the shape. A specialized config whose consumers cannot de-rotate the
    rope pairs (``rope_reason``) reads them from ``rope_tails``; one that reads them from there becomes the
    one-loop kernel with the same bits (``BATCH_INVARIANT_CONFIG``) where ``rope_tails`` cannot tile them."""
    from ..triton.wo_a import rope_tails_tile  # noqa: PLC0415
    from .wo_a_specialized import rope_reason  # noqa: PLC0415

    if config.get("stream_k") and not (config.get("specialized") and config.get("persistent")):
        raise ValueError(f"wo_a (tilelang): stream_k needs a persistent specialized config, got {config}")
    bn, bk = _tiles(config, d, r, rope_dim)
    if config.get("specialized") and rope_dim and rope_reason(config.get("rope", "tails"), rope_dim):
        config = dict(config, rope="tails")
    if derotates_beforehand(config, rope_dim) and not rope_tails_tile(h, bk):
        config = BATCH_INVARIANT_CONFIG
        bn, bk = _tiles(config, d, r, rope_dim)
    return dict(config, BN=bn, BK=bk)


def tactic_key(o: torch.Tensor, weight: torch.Tensor, rope_dim: int) -> tuple[str, dict]:
    """(op, shape key) under which this provider's tuned configs are stored (``rope_dim`` 0: no RoPE)."""
    _, _, d, g, r, k = geometry(o, weight)
    return TACTIC_OP, dict(g=g, r=r, k=k, d=d, rd=rope_dim)


def _rope_table(cos: torch.Tensor, sin: torch.Tensor, m: int, rope_dim: int) -> torch.Tensor:
    """``cs [M, RD]`` with (cos, sin) interleaved; a view when cos/sin come from ``view_as_real``."""
    cs = interleaved_view(cos, sin)
    if cs is not None and cs.is_contiguous():
        return cs
    return torch.stack((cos, sin), dim=-1).reshape(m, rope_dim)


def wo_a(
    o: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rope_dim: int,
    *,
    batch_invariant: bool,
    config: dict | None = None,
) -> torch.Tensor:
    m, h, d, g, r, _ = geometry(o, weight)
    n = g * r
    rd = rope_dim if cos is not None else 0
    why = unsupported_reason(o, weight, rd)
    if why:
        raise ValueError(f"wo_a (tilelang): {why}")
    z = torch.empty((m, n), dtype=o.dtype, device=o.device)
    if m == 0:
        return z
    if config is None:
        default = BATCH_INVARIANT_CONFIG if batch_invariant else default_config(m, n, h // g)
        op, key = tactic_key(o, weight, rd)
        config = tactic(op, m, key, default, batch_invariant=batch_invariant)
    cfg = launch_config(config, h, d, r, rd)
    split = split_parts(cfg.pop("SPLIT", 1), h // g, batch_invariant, "tilelang")
    if split > 1:
        if not cfg.get("one_loop") or cfg.get("specialized"):
            raise ValueError("wo_a (tilelang): split-K needs a one_loop config (not a specialized one)")
        cfg["SPLIT"] = split
    else:
        cfg.pop("cluster", None)  # one part: nothing to reduce
    if batch_invariant:
        cfg.pop("stream_k", None)  # a cut tile's bits depend on M
    kernel = compile_kernel(g, r, h // g, d, rd, cfg)
    if derotates_beforehand(cfg, rd):  # its rope chunks come in de-rotated
        from ..triton.wo_a import rope_tails  # noqa: PLC0415  (one pass over the rope chunks of o)

        cs = rope_tails(o, cos, sin, rd, cfg["BK"]).view(m, h * cfg["BK"])
    elif rd:
        cs = _rope_table(cos, sin, m, rd)
    elif cfg.get("specialized"):
        cs = torch.empty((m, 1), dtype=o.dtype, device=o.device)  # unread
    else:
        cs = torch.empty((m, 2), dtype=torch.float32, device=o.device)  # unread
    if cfg.get("specialized"):
        kernel(o.view(m, h * d), weight, cs, z, *_workspace(o.device, cfg))
        return z
    if split == 1 or cfg.get("cluster"):  # (a cluster sums its parts itself)
        kernel(o.view(m, h * d), weight, cs, z)
        return z
    from ..triton.wo_a import sum_splits  # noqa: PLC0415  (the fixed-order sum of the parts)

    part = torch.empty((split, m, n), dtype=torch.float32, device=o.device)
    kernel(o.view(m, h * d), weight, cs, part)
    return sum_splits(part, z, pdl=bool(cfg.get("pdl")))
