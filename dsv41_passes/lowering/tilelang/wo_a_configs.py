"""Launch configs of the TileLang WO-A kernels (``wo_a``): the tuner's candidates, the batch-invariant config and
the untuned defaults by token count, each with the H200 measurements that chose it (``docs/performance.md``)."""

import functools

import torch

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
# 128 < M < 2048 with the geometry known (outside batch-invariant mode): the register-A kernel, one CTA a tile, with
# the widest tile (256, 128 or 64 columns, 4, 6 or 8 stages of 192 KiB in all) whose grid reaches half a wave; below
# that the split-K one-loop kernel (``split_config``). run168-probe_wo_a_decode-split_config.log (us, medians of 6
# interleaved rounds, against the one-loop kernel in 1-4 parts and cuBLAS bmm): TP4 M = 512 (64 columns, 128 tiles)
# 18.0 against 22.6 (2 parts; cuBLAS 14.4), M = 1024 (128 columns) 27.1 against 34.3 (1 part; cuBLAS 24.9); TP1 M =
# 256 (128 columns) 34.8 against 38.8 (1 part; cuBLAS 27.9); at TP4 M = 256 64 columns (64 tiles) took 17.3 against
# 15.9 in 4 parts.
REGISTERS_64 = dict(BM=128, BN=64, BK=64, stages=8, specialized=True, rope="registers")
REGISTERS_128 = dict(BM=128, BN=128, BK=64, stages=6, specialized=True, rope="registers", z_cols=64)
REGISTERS_256 = dict(SPECIALIZED_REGISTERS_CONFIG, stream_k=STREAM_K_SHARE)  # persistent: the default from 2048
CANDIDATES[TACTIC_OP] += [REGISTERS_64, REGISTERS_128]
MID_MAX_M = 2047

# Untuned defaults by token count (upper M, config), from benchmarks/results/run27-quick_check-wo_a-small.log
# and run26 (H200): split-K with 128 x 128 tiles for decode sizes (11.8 / 15.9 / 22.5 us at M = 128 / 256 /
# 512 where the 64 x 64 one-loop kernel took 27.4 / 28.1 / 55.3), 128 x 128 up to 1024 (31.4 vs 112 us),
# 128 x 256 with the tile stored through shared memory up to 2047 (0.0997 vs 0.106 ms at 4096, 1.73 vs 1.80
# at 65536), SPECIALIZED_REGISTERS_CONFIG up to 32768 and above for N <= REGISTERS_MAX_N, otherwise SPECIALIZED_CONFIG
# (all with stream-K). With the geometry known (every call of ``wo_a``): ``decode_config`` at M <= 128 and
# ``mid_config`` up to 2047 instead of the table; against it, at TP4 / TP1 (run169-probe_wo_a_mid_config.log, us):
# M = 512 17.8 / 56.0 against 22.8 / 113.2, M = 1024 26.3 / 105.6 against 32.6 / 157.4, M = 2047 48.1 / 211.7
# against 55.1 / 243.8. M <= 16 (outside batch-invariant mode) runs the Triton split-K kernel (``triton.wo_a``).
DEFAULTS: list[tuple[int, dict]] = [
    (128, dict(_DECODE, SPLIT=8)),
    (256, dict(_DECODE, SPLIT=4)),
    (512, dict(_DECODE, SPLIT=2)),
    (1024, _DECODE),
    (2047, BATCH_INVARIANT_CONFIG),
    (32768, REGISTERS_256),
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
    return dict(_DECODE, BN=64, SPLIT=one_wave_parts(tile_count(m, n, 64), hpg, sms), stages=8)


def tile_count(m: int, n: int, bn: int) -> int:
    """Tiles of 128 rows and ``bn`` columns over ``[m, n]`` (a narrower N still takes one column tile)."""
    return -(-n // bn) * -(-m // 128)


def mid_config(m: int, n: int, hpg: int, sms: int) -> dict:
    """128 < M <= MID_MAX_M: the register-A kernel with the widest tile whose grid reaches half a wave of ``sms``
    CTAs (``REGISTERS_256`` as above M = 2047), else ``split_config``."""
    for bn, cfg in ((256, REGISTERS_256), (128, REGISTERS_128), (64, REGISTERS_64)):
        if 2 * tile_count(m, n, bn) >= sms:
            return dict(cfg)
    return split_config(m, n, hpg, sms)


def one_wave_parts(tiles: int, hpg: int, sms: int) -> int:
    """The most parts (a power of two, at most 8, whole heads each) that K splits into with ``tiles`` tiles in
    one wave of ``sms`` CTAs."""
    parts = 1
    while parts < 8 and hpg % (2 * parts) == 0 and tiles * 2 * parts <= sms:
        parts *= 2
    return parts


def split_config(m: int, n: int, hpg: int, sms: int) -> dict:
    """The 128 x 128 one-loop kernel, K split by ``one_wave_parts``. At TP4 (N 2048) this is the ``DEFAULTS``
    table's 4 / 2 / 1 parts up to 256 / 512 / 1024; at TP1 (N 8192, 128 tiles at M = 256) one part, where the
    table's 4 parts took 63.8 us against 36.4 at M = 256 (run166-probe_wo_a_decode-specialized.log)."""
    parts = one_wave_parts(tile_count(m, n, 128), hpg, sms)
    return dict(_DECODE, SPLIT=parts) if parts > 1 else dict(_DECODE)


def default_config(m: int, n: int | None = None, hpg: int | None = None) -> dict:
    """Untuned choice by token count (see ``DEFAULTS``); with the geometry (``n = G*R`` output columns, ``hpg``
    heads a group) given, ``decode_config`` at M <= 128, ``mid_config`` up to 2047, and above M = 32768 the
    register-A kernel for ``n`` up to ``REGISTERS_MAX_N``."""
    if m <= MID_MAX_M and n is not None and hpg is not None:
        return (decode_config if m <= DECODE_MAX_M else mid_config)(m, n, hpg, sm_count())
    for upper, cfg in DEFAULTS:
        if m <= upper:
            return dict(cfg)
    if n is not None and n <= REGISTERS_MAX_N:
        return dict(REGISTERS_256)
    return dict(SPECIALIZED_CONFIG, stream_k=STREAM_K_SHARE)


def untuned_config(m: int, n: int, hpg: int) -> dict:
    """What a call at M runs without a tuned tactic: ``default_config`` at M's tuning bucket (the power of two
    above it), so that every M runs a binary that warm-up (which compiles each bucket's) has built; the tile-count
    rules of ``mid_config`` and ``split_config`` could otherwise change within a bucket."""
    from ...tuning import bucket  # noqa: PLC0415

    return default_config(bucket(m), n, hpg)


def sm_count() -> int:
    """CTAs of a persistent kernel: the current device's SMs (an H200's 132 without a GPU)."""
    return _sms(torch.cuda.current_device()) if torch.cuda.is_available() else 132


@functools.lru_cache(maxsize=None)
def _sms(device: int) -> int:  # asked at every call (the kernel cache's key): once a device
    return torch.cuda.get_device_properties(device).multi_processor_count
