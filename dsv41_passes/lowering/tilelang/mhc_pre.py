"""TileLang ``mhc_pre`` for prefill sizes (sm_90a): one persistent kernel, one read of the residual, the
collapse + RMSNorm written to HBM once (``mhc_pre_kernel``), then the Triton stats kernel on its partials.
It gives the Triton kernel's bits. The op runs it from ``lowering.mhc.TILELANG_PRE_MIN_M`` (1536) tokens up:
with split roles, the vector work on two warpgroups and the norm on three warps of the producer warpgroup
(``wg1-split-v2-normwg3``, run 174) it measured 13-22% faster than the Triton op from M = 1536 up on the H200, level
at 1024 and slower at decode sizes (``docs/performance.md``). ``DEFAULT_CONFIG`` and the fused boundary's
``BOUNDARY_CONFIG`` are named below with the runs that chose them.
Here: the launch configs, the compiled-kernel cache, the input checks and the host wrappers.
"""

import os
import threading
from typing import Any

import torch

from ..mhc_weights import NUM_SLICES, derived, slice_geometry
from .mhc_pre_kernel import BM, HALF, HC, HELD_REGS, LAG, NMIX, SENTINEL, TWO_CHAIN_REGS, build, compile_kernel

__all__ = ["BM", "BOUNDARY_CONFIG", "CONFIGS", "HALF", "HC", "HELD_REGS", "LAG", "NMIX", "SENTINEL", "TWO_CHAIN_REGS",
           "UNMEASURED", "build", "compile_kernel", "groups_for", "mhc_boundary", "mhc_pre", "partials", "unsupported"]

_LOCK = threading.Lock()
_KERNELS: dict[tuple[Any, ...], Any] = {}


def groups_for(sm_count: int) -> int:
    """Row-block groups: one CTA per SM, 16 (the K slices) a group."""
    return max(1, sm_count // NUM_SLICES)


def unsupported(h: torch.Tensor) -> str | None:
    """Why the kernel cannot take a residual ``[M, n, d]`` (None when it can): the Triton kernels' rules
    (it shares their numerics and finish kernel), plus its own chunk width, shared memory and layout."""
    from ..triton.mhc_common import unsupported as triton_unsupported

    why = triton_unsupported(h)
    if why:
        return why
    ds, bk = slice_geometry(h.shape[2])
    if bk != 2 * HALF:
        return f"hidden {h.shape[2]}: the kernel walks 32-column chunks, the slice geometry gives {bk}"
    if 2 * HC * NMIX * ds * 2 > 160 * 1024:
        return f"hidden {h.shape[2]}: the resident weight parts would not fit in shared memory"
    if not h.is_contiguous():
        return "residual is not contiguous"
    return None


def _kernel(d: int, groups: int, eps: float, cfg: dict):
    """The compiled kernel of a config (``build``'s keyword arguments), once per process."""
    opts = dict(cfg)
    opts.setdefault("lag", LAG)
    key = (d, groups, float(eps), tuple(sorted(opts.items())))
    k = _KERNELS.get(key)
    if k is None:
        with _LOCK:
            k = _KERNELS.get(key)
            if k is None:
                k = _KERNELS[key] = compile_kernel(build(d, groups, float(eps), **opts), opts.get("producer", False))
    return k


# (wgs, stages, lag): one warpgroup with four stages, or two (128-row blocks) with two
CONFIGS = {
    "wg1": dict(wgs=1, stages=4, lag=LAG),
    "wg2": dict(wgs=2, stages=2, lag=LAG),
    "wg2-mid-streamed": dict(wgs=2, stages=3, lag=LAG, mid_resident=False),
    "wg1-mid-streamed": dict(wgs=1, stages=5, lag=LAG, mid_resident=False),
    # a producer warpgroup issues the copies; run107-probe_mhc_pre.log (the op, ms at M = 65536 / 16384):
    # 1.600 / 0.439 against 1.862 / 0.515 for wg1 and 2.009 / 0.508 for wg2-producer
    "wg1-producer": dict(wgs=1, stages=4, lag=LAG, producer=True),
    "wg2-producer": dict(wgs=2, stages=2, lag=LAG, producer=True),
    # two consumer warpgroups on alternate row blocks, a stage ring (two stages) and a producer warp each;
    # run108-probe_mhc_pre-together.log: 1.982 / 0.498 / 0.125 ms at 65536 / 16384 / 4096 against 1.614 / 0.416 /
    # 0.116 for wg1-producer, timed in turn
    "wg1x2-producer": dict(wgs=1, stages=2, lag=LAG, producer=True, rings=2),
    # one warpgroup issues the dots, another does the sums of squares, collapse and norm of the same row block
    # run115-probe_mhc_pre-norm-in-mma.log (the op, timed in turn, ms at 65536 / 16384 / 4096 / 4097): 1.467 / 0.380 /
    # 0.106 / 0.113 against 1.580 / 0.404 / 0.113 / 0.121 for wg1-producer and 1.628 / 0.415 / 0.112 / 0.112 Triton
    "wg1-split": dict(wgs=1, stages=4, lag=LAG, producer=True, split_roles=True),
    # the same with the vector role on two warpgroups (512 threads, 128 registers each); run123/125/126-probe_mhc_pre
    # (timed in turn, ms at 65536 / 16384 / 4096): 1.443 / 0.363 / 0.100, 1.394 / 0.354 / 0.101 and 1.427 / 0.364 /
    # 0.100 against 1.554 / 0.387 / 0.107 and 1.494 / 0.377 / 0.107 for wg1-split (runs 123, 125)
    "wg1-split-v2": dict(wgs=1, stages=4, lag=LAG, producer=True, split_roles=True, vec_wgs=2),
}
# the same with L2 eviction hints on the x stores (the un-normalized collapse evict-last, the normalized one
# evict-first): less DRAM traffic (922 against 1006 MB at M = 16384) but no faster (0.3637 / 1.549 / 0.1014 against
# 0.3591 / 1.489 / 0.1009 ms at 16384 / 65536 / 4096, run 130)
CONFIGS["wg1-split-v2-xhints"] = dict(CONFIGS["wg1-split-v2"], x_hints=True)
# the normalization on warps 2-3 of the producer warpgroup (four threads a row, each block once its slices have
# published) instead of the vector role's lagged chunk a step, which costs the default about 10% (run 133). Same bits;
# run135-probe-together.log (timed in turn, medians, ms at 65536 / 16384 / 4096): 1.438 / 0.3634 / 0.1056 against
# 1.462 / 0.3719 / 0.1005: the norm's work moved, not its cost (the lagged norm's x round trip through L2 stays).
# Starting a block only once the next one is stored too (fewer polls) was slower: 1.461 / 0.3805 / 0.1086.
CONFIGS["wg1-split-v2-normwg"] = dict(CONFIGS["wg1-split-v2"], norm_wg=True)
# the same on warps 1-3 (24 rows a pass instead of 16): the default from run 174 to 180. Same bits; run174-probe_mhc.log
# (timed in turn, medians of 8 rounds, ms at 65536 / 16384 / 4096 / 2048): 1.331 / 0.3441 / 0.0983 / 0.0507 against
# 1.423 / 0.3618 / 0.1008 / 0.0580 for wg1-split-v2 (run 173: 1.351 / 0.3493 / 0.0988 against 1.486 / 0.3708 / 0.1010)
CONFIGS["wg1-split-v2-normwg3"] = dict(CONFIGS["wg1-split-v2-normwg"], norm_warps=3)
# the same with the norm weights read from the consumers' shared copy, not from global memory in every pass: the
# default since run 181. The clock64 timers of run 179 (``probe_mhc_pre_diag.py``) have the normalizing warps busy
# 98% of the kernel at M = 65536 (29% of it polling), so they pace it. Same bits (GPU file, run 180); timed in turn
# against wg1-split-v2-normwg3 (the kernel, medians, ms at 65536 / 16384 / 4096): run 179 1.240 / 0.3161 / 0.0869
# against 1.293 / 0.3246 / 0.0910, run 181 1.302 / 0.3302 / 0.0879 against 1.312 / 0.3297 / 0.0908
CONFIGS["wg1-split-v2-normwg3-ws"] = dict(CONFIGS["wg1-split-v2-normwg3"], norm_w_smem=True)
# the default with the normalizing warps' polls issued a pass ahead (``norm_prepoll``: the next pass's partials are
# loaded before this pass's normalization, a block's first before its xdone wait; the polls are 29-36% of these warps'
# time in runs 179 and 181). Same bits; slower: 1.297 / 0.3300 / 0.0874 ms against the default's 1.261 / 0.3231 / 0.0871
# at M = 65536 / 16384 / 4096 (run182-diag.log, the kernel timed in turn, medians).
CONFIGS["wg1-split-v2-normwg3-ws-pp"] = dict(CONFIGS["wg1-split-v2-normwg3-ws"], norm_prepoll=True)
# the default with the dots' wgmmas kept in flight across steps (``dots_defer``: a step's four hi dots issued first,
# then the mid / lo chains, and streams 1-3's chains waited for only at the next step), so the tensor cores do not idle
# at a step boundary while the warps sum the hi parts, release the stage and wait for the next; the timers of run 179
# have that warpgroup busy 81% (87% with the norm cut out). Written and built for sm_90a (118 registers, no spills;
# ptxas keeps the wgmmas asynchronous: one wait a step). Same bits; 1.246 / 0.3191 / 0.0862 ms against 1.261 / 0.3231 /
# 0.0871 (run 182).
CONFIGS["wg1-split-v2-normwg3-ws-dd"] = dict(CONFIGS["wg1-split-v2-normwg3-ws"], dots_defer=True)
# the default with the L2 eviction hints of ``x_hints`` (the un-normalized collapse stored evict-last by the vector
# role, the normalized one evict-first by the normalizing warps): their reload of x is a long-scoreboard wait in every
# pass, from DRAM where the line was evicted in the 2-3 row blocks since it was stored. With the lagged norm the hints
# cut DRAM bytes by 8% but not the time (run 130); the normalizing warps did not pace that kernel. Written and built
# for sm_90a (113 registers, no spills). Same bits; 1.258 / 0.3187 / 0.0831 ms against 1.261 / 0.3231 / 0.0871 (run 182;
# minima 1.145 / 0.3005 / 0.0801 against 1.202 / 0.3151 / 0.0861).
CONFIGS["wg1-split-v2-normwg3-ws-xh"] = dict(CONFIGS["wg1-split-v2-normwg3-ws"], x_hints=True)
# the default with the norm partials laid out a row's 16 side by side (``xss_by_row``): a normalizing thread polls its
# row with four 16-byte relaxed loads instead of 16 of 4 bytes (a warp's poll: 32 L2 sectors instead of 128, and the
# polls are 29% of these warps' time in run 179); the vector role's publication becomes 64 scattered 4-byte stores a
# row block instead of one run of 256 bytes. Built for sm_90a (121 registers, no spills). Same bits; slower: 1.395 /
# 0.3579 / 0.0954 ms against 1.261 / 0.3231 / 0.0871 (run 182).
CONFIGS["wg1-split-v2-normwg3-ws-xr"] = dict(CONFIGS["wg1-split-v2-normwg3-ws"], xss_by_row=True)
# the default with the bf16 <-> f32 conversions by bit operations (``packed_cvt``): a value of a packed bf16 pair comes
# out by one shift or one mask (nvcc spends a PRMT and a shift on a high half) and two values round in one
# instruction; the same values. In the sm_90a build (twenty-third session): the vector role's loop 322 -> 300 SASS
# instructions, the normalizing warps' 525 -> 454 (they pace the kernel: busy 98% of it in run 179), 117 registers,
# no spills. Same bits; 1.254 / 0.3187 / 0.0855 ms against 1.261 / 0.3231 / 0.0871 (run 182).
CONFIGS["wg1-split-v2-normwg3-ws-pk"] = dict(CONFIGS["wg1-split-v2-normwg3-ws"], packed_cvt=True)
# the default with the mid and lo parts resident side by side ([mid; lo], 48 rows a stream) and their chains one
# ``wgmma m64n48k16`` a step and stream (``ml48``; hi streams with the stage in lo's place): 16 HGMMA a step instead of
# 24, and the A tile read from shared memory twice a (stream, k16) instead of three times (about 32 KB a step instead of
# 48; with the norm cut out the dots' warpgroup paces the kernel, run 179). The same shared memory and L2 bytes. The
# same sums if a wgmma's column does not depend on its N (the n24 kernel already gives the n32 Triton kernel's bits).
# Built for sm_90a (twenty-third session): 111 registers, no spills, one wait a step. Same bits (run 182: the n48 wgmma
# gives the n24 chains' bits); 1.245 / 0.3184 / 0.0873 ms against 1.261 / 0.3231 / 0.0871.
CONFIGS["wg1-split-v2-normwg3-ws-ml"] = dict(CONFIGS["wg1-split-v2-normwg3-ws"], ml48=True)
# the three changes that touch different roles together (the dots: ml48 and dots_defer; the vector role and the
# normalizing warps: packed_cvt). 114 registers, no spills, two waits (``wait_wgmma<3>`` a step, ``<0>`` a block); the
# dots' loop 264 SASS instructions a step. Same bits; 1.244 / 0.3161 / 0.0857 ms against 1.261 / 0.3231 / 0.0871 (run
# 182), and at M = 16384 10% fewer cycles in every role (its timers). Not the default yet: one probe, no bench.
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd"] = dict(CONFIGS["wg1-split-v2-normwg3-ws-ml"], packed_cvt=True,
                                                   dots_defer=True)
# the same with the x eviction hints (``x_hints``): in run 182 the hints alone took the minimum at M = 65536 from 1.202
# to 1.145 ms and the median at 4096 from 0.0871 to 0.0831, and the normalizing warps' reload stopped holding the vector
# role back (its wait on xfree 9% -> 1%). 114 registers, no spills. The default since run 183: same bits (its x, ws
# and ss the old default's in the probe; x, pre, post, comb the Triton kernel's at M = 1, 4096, 4097, 65536), timed in
# turn with the old default (run183-diag.log, medians, ms at 65536 / 16384 / 4096) 1.216 / 0.3107 / 0.0812 against
# 1.337 / 0.3339 / 0.0869 (-ml-pk-dd 1.244 / 0.3160 / 0.0850); bench_mhc (run 183) 1.234 / 0.3210 / 0.0880 against run
# 181's 1.324 / 0.3379 / 0.0975 for the old default. It keeps a 1.97 MB [mid; lo] tile a weight beside the sliced parts.
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh"] = dict(CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd"], x_hints=True)
# The collapse held in registers (``held_norm``, ``mhc_pre_heldnorm``): no normalizing warps, no round trip of the
# un-normalized collapse through the L2 (22% of the SMs' L2 sectors at M = 65536, run 184); the previous block's rsqrt
# read at step k = held_norm - 1 of the next. The same bits (GPU tests of -hn1 to -hn3, run 185). Timed in turn with the
# run-183 default (run186-diag.log, medians, ms at 65536 / 16384 / 4096; the default 1.164 / 0.3046 / 0.0800):
# -hn1 1.199 / 0.3022 / 0.0776, -hn2 1.175 / 0.2931 / 0.0738, -hn3 1.123 / 0.2812 / 0.0721. -hn3: the default since.
_HELD = {k: v for k, v in CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh"].items()
         if k not in ("norm_wg", "norm_warps", "norm_w_smem")}
# -hn4 to -hn6: more slack (run 186: the later the rsqrt is read, the faster, up to k = 2 at least). Run 190 (H100,
# the kernel alone, medians, ms at 65536 / 16384 / 4096): -hn3 1.462 / 0.3690 / 0.0894, -hn4 1.460 / 0.3685 / 0.0901,
# -hn5 1.451 / 0.3671 / 0.0899, -hn6 1.462 / 0.3716 / 0.0899: no gain past k = 2. The boundary's option takes -hn2's
# k = 1: with k = 2 its build spills.
for _k in range(1, 7):
    CONFIGS[f"wg1-split-v2-ml-pk-dd-xh-hn{_k}"] = dict(_HELD, held_norm=_k)
# the rsqrt's first poll a step ahead (``held_prepoll``): run 190, 1.479 / 0.3740 / 0.0921 (slower)
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-pp"] = dict(_HELD, held_norm=3, held_prepoll=True)
# the streamed hi part loaded once for the 2 or 4 CTAs of a cluster on one K slice (``hi_multicast``: rank 0's TMA
# multicast into all): with held_norm the weight stream is the largest L2 load beyond the residual and the output
# (31.5 M of the 146 M sectors the SMs move at M = 65536, runs 184-186); this halves or quarters it. Clusters of 4
# need 32 of them resident at once (one CTA an SM). Run 189 (H100, the op against the default in turn, ms at 65536 /
# 16384 / 4096): -mc 1.568 / 0.3760 / 0.0968 against 1.574 / 0.3780 / 0.0970 (no real gain: without the stream at all,
# a diag build, 1.8% at 65536 in run 190); -mc4 2.041 / 0.5091 / 0.1417 (the clusters of 4 do not all fit at once);
# the same bits (GPU tests at M = 1, 4096, 4097, 65536)
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-mc"] = dict(_HELD, held_norm=3, hi_multicast=2)
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-mc4"] = dict(_HELD, held_norm=3, hi_multicast=4)
# the stats computed in the kernel by the producer warps that held_norm leaves idle (``fused_finish``,
# ``mhc_pre_finish``): no Triton finish launch after it (its launch gap and its read of the partials from HBM: about
# 7 us of the op at M = 4096 in run 183, bench against probe), the same roundings (``triton.mhc_finish`` pins them).
# Run 189 gave its stats the Triton bits but a wrong x: TileLang had put the finish's shared buffer on the norm
# weights' bytes (now one buffer; the build test checks that no two shared buffers share bytes). Its time there: 1.493
# / 0.3828 / 0.0983 against 1.576 / 0.3748 / 0.0960 for the default with the "tiles" stats kernel.
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-ff"] = dict(_HELD, held_norm=3, fused_finish=True)
# the fused boundary's config (the normalizing warps) with the weight stream multicast to CTA pairs: as an
# ``mhc_pre`` config (run 189: 1.629 / 0.4084 / 0.1116 against 1.572 / 0.3812 / 0.1000 for the default), and the fused
# boundary's since run 191 (``BOUNDARY_CONFIG``)
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc"] = dict(CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh"],
                                                        hi_multicast=2)
# both (the counters count only the blocks below M, which every CTA of a group walks)
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-mc-ff"] = dict(_HELD, held_norm=3, hi_multicast=2, fused_finish=True)
# the dots' release of a stage before their wait for the next one (``dots_release_early``): in the boundary the dots
# wait 45% of their time for the vector role's post of the next stage and the producer 51% for a free stage (run 188,
# H100, timers at M = 65536), while the deferred loop held each stage until that post was done; here a stage goes back
# once its own dots are done. The same bits (GPU tests of run 192 at M = 1, 4096, 4097, 65536, and the boundary's at
# 1, 1536, 4097, 65536). Run 192 (H100): as the mhc_pre default's option, the kernel alone in turn with -hn3 (medians,
# ms) 0.3558 against 0.3686 at M = 16384, 0.0897 against 0.0901 at 4096, and at 65536 its timed build's roles ran
# 2446k cycles against 2575k (the plain times at 65536 did not come back): the mhc_pre default since. In the boundary
# (probe_mhc_boundary, us) 3466 against 3513 at 65536, 880.6 against 891.8 at 16384, 230.3 against 232.2 at 4096; the
# timers' probe 3.408 against 3.459 ms at 65536 (the dots' wait for a stage 30% -> 16% of their time, the vector
# role's 29% -> 19%): the boundary's since. As an mhc_pre config the boundary's is slower (1.484 / 0.3879 / 0.1113
# against 1.497 / 0.3772 / 0.1007 for the op at 65536 / 16384 / 4096).
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re"] = dict(_HELD, held_norm=3, dots_release_early=True)
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re"] = dict(CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc"],
                                                           dots_release_early=True)
# the mhc_pre default with the weight stream multicast to CTA pairs (``-hn3-mc`` measured before the dots' early
# release, on an H100 only, run 189: within noise). The L2 paces this kernel, most of all on the H200 whose HBM is
# faster behind the same L2 (run 186: its fabric between the L2 halves 76% busy with held_norm); pairs halve the weight
# stream, 17% of the SMs' L2 reads at M = 65536 (run 184). Run 225 (H100, the op in turn with the default, the same
# bits; GPU tests at M = 1, 4096, 4097, 65536): 1.4320 / 0.3571 / 0.0923 / 0.0493 ms against 1.4206 / 0.3582 / 0.0934 /
# 0.0495 at M = 65536 / 16384 / 4096 / 2048, within noise again: not kept (the H200 not measured)
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-mc"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re"], hi_multicast=2)
# the boundary's with its row's post and comb weights of the next block and its pre weights of the block after
# prefetched into L1 (``post_prefetch`` k, at step 10 - k of a block): in run 193's Nsight Compute samples of the
# boundary at M = 65536 (H100) the vector role's first step of a block waited for the loads of those (7.1% of the
# samples in its loop, on the loads' scoreboard)
for _k in (2, 5):
    CONFIGS[f"wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-pf{_k}"] = dict(
        CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re"], post_prefetch=_k)
# the same samples had the vector role wait 12% of its loop's for its global stores to read their registers (a later
# instruction reusing one): with ``post_store_late`` the new residual's stores come last in the step, after the x
# stores, where the next step's stage wait follows (126 -> 118 registers in the sm_90a build, no spills).
# Run 196 (H100, probe_mhc_boundary, us at 65536 / 16384 / 4096): -pf2 3505 / 892.1 / 232.1, -pf5 3514 / 891.4 / 232.5,
# -sl 3508 / 892.4 / 233.1, -pf2-sl 3522 / 895.2 / 233.5 against the default's 3477 / 884.5 / 230.7 (the same bits):
# 0.8-1% slower, the vector role's and the dots' waits as the default's (timers). Not kept.
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-sl"] = dict(CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re"],
                                                              post_store_late=True)
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-pf2-sl"] = dict(
    CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-pf2"], post_store_late=True)
# the boundary's with the vector role's stage released right after its post's ``ready`` arrival (``vec_release_early``),
# not at the end of its step: in run 200's Nsight Compute samples (H100, M = 65536) the vector role spends 28% of its
# loop after that arrival, during which its stage stays held although only the dots still read it, while it waits 25%
# of its loop for a stage and the producer 64-71% of its time (timers) for a free one. Run 207 (H100,
# probe_mhc_boundary, us at 65536 / 16384 / 4096): 3384.6 / 860.9 / 225.6 against the default's 3394.8 / 861.4 / 226.2,
# the timers' probe 3.373 / 0.8429 ms against 3.389 / 0.8456; the same bits (GPU tests at M = 1, 1536, 4097, 65536).
# 0.1-0.5% faster at every size: the boundary's config since
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve"] = dict(CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re"],
                                                              vec_release_early=True)
# the same with a ring of two row blocks between the vector role and the normalizing warps (``lag`` 1, was 2): the
# vector role may store a block's collapse once the normalizing warps are done with the block before the last, so it
# waits for them more (run 218, H100, timers at 65536: 9% of its time against 5%), but the collapse they read back is
# younger. Runs 218-219 (H100, probe_mhc_pre_diag --boundary, the kernel, medians, ms at 65536 / 16384 / 4096):
# 3.156 / 0.8028 / 0.2096 against 3.323 / 0.8461 / 0.2162 (5.0%, 5.1%, 3.0% faster; lag 3 and 4 2-5% slower, lag 0
# 10% slower), the same bits (x, partials, new residual): the boundary's config since
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1"] = dict(
    CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve"], lag=1)
# hi resident and [mid; lo] streamed with the stage (``ml_stream``): 60 KiB resident instead of 120, so a fifth stage
# fits (in the boundary 221 of the 227 KiB), for twice the weight bytes a step from L2 (run 190: without the weight
# stream at all the mhc_pre was 1.8% faster). In the boundary both roles wait for a stage (run 200: the vector role
# 25% of its loop, the dots 21% of their samples) while the producer waits for a free one. Run 207 (H100, the boundary,
# us at 65536 / 16384 / 4096): 3630.1 / 926.0 / 239.5 against 3394.8 / 861.4 / 226.2, 6-7% slower, the same bits; the
# waits for a stage shrank (the vector role's 18% -> 14%, the dots' 15% -> 11%) but every role's step grew: not kept
# for the boundary. As the mhc_pre's (run 216, H100, the kernel, medians, ms at 65536 / 16384 / 4096): 1.533 / 0.3860 /
# 0.0930 against the default's 1.410 / 0.3550 / 0.0893, the same bits; its vector role waits as long for a stage
# (33-36% of its time), its dots' and the whole step longer: not kept either
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ms5"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re"], ml_stream=True,
                                                      stages=5)
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ms5"] = dict(CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re"],
                                                               ml_stream=True, stages=5)
# the default and the boundary's with the residual's TMA loads (and the boundary's y) under the normal L2 policy
# instead of evict-first (``loads_evict_first`` off): the evict-first policy was chosen for the normalizing warps'
# reload of the un-normalized collapse, which ``held_norm`` does not have; in ``benchmarks/probe_read_pattern.py`` (a
# plain pipeline reading the residual in this kernel's order and writing x) evict-first loads took 1.282 against 1.174
# ms at M = 65536 (run 230, H100), and with the threads' stores cut out this kernel takes 1.03 against 1.36 (run 229).
# Run 231 (H100; the same bits as the Triton kernel and boundary, GPU tests at M = 1, 4096, 4097, 65536): the kernel
# alone 1.2005 / 0.3059 / 0.0838 ms against 1.3704 / 0.3475 / 0.0871 at 65536 / 16384 / 4096; the fused boundary
# (probe_mhc_boundary, us) 675.5 / 183.1 against 817.3 / 218.7 at 16384 / 4096 and 2665.6 at 65536. Both the
# defaults since (``BOUNDARY_CONFIG``; ``DEFAULT_CONFIG`` until run 245, and where its CTA pairs do not fit)
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re"],
                                                     loads_evict_first=False)
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1-ln"] = dict(
    CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1"], loads_evict_first=False)
# the boundary's with the new residual's stores evict-first (``post_evict_first``): the x stores' hint was worth 2.4%
# in the mhc_pre (run 229); the new residual is 4 times x's bytes and nothing in the kernel reads it back
CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1-ln-pe"] = dict(
    CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1-ln"], post_evict_first=True)
# the new default without the x stores' evict-first hint (``x_hints``): with evict-first loads the hint made the kernel
# 2.4% faster (run 229: 1.3625 against 1.3947 ms at M = 65536); with the normal policy (run 236, H100, the kernel alone,
# medians, ms at 65536 / 16384 / 4096) 1.1883 / 0.3039 / 0.0824 against 1.1951 / 0.3058 / 0.0824: within the
# probes' spread, not taken
CONFIGS["wg1-split-v2-ml-pk-dd-hn3-re-ln"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln"], x_hints=False)
# the default with the weight stream multicast to CTA pairs (``-mc``, within noise on the H100 with evict-first loads,
# runs 189 and 225), meant for the H200, whose L2 paced the kernel more (run 186). Runs 244-245 (H100, in turn with
# -ln, the same bits; its GPU tests at M = 1, 4096, 4097, 65536 passed), medians, ms at M = 65536 / 16384 / 4096: the
# kernel alone 1.2093 / 0.3114 / 0.0852 against 1.2196 / 0.3176 / 0.0856 and 1.2085 / 0.3110 / 0.0853 against
# 1.2205 / 0.3161 / 0.0857; the op 1.2575 / 0.3270 / 0.0948 against 1.2743 / 0.3308 / 0.0951, 1.2620 / 0.3268 / 0.0949
# against 1.2765 / 0.3312 / 0.0950, 1.2584 / 0.3274 / 0.0948 against 1.2757 / 0.3328 / 0.0958 (at 2048 once 0.0567
# against 0.0563). 1.0-1.7% faster at 65536 and 16384 in every pair: the default since run 245 (the H200 not measured)
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln"], hi_multicast=2)
# a boundary candidate: the collapse held in registers (k = 1; the boundary's build spills with k = 2, and with the
# CTA pairs' multicast at k = 1) instead of the normalizing warps, with the loads under the normal policy. Run 185
# (H200) had the held boundary 5% slower with the evict-first loads of then, whose reason was the normalizing
# warps' read-back of the un-normalized collapse from the L2; the normal policy may no longer keep it there. Run 242
# (H100, probe_mhc_boundary.py --tilelang, us at 65536 / 16384 / 4096; the same bits, GPU tests passed): 2630 / 680.8
# / 198.3 against the default's 2662 / 679.5 / 183.2. 1% faster at 65536, 8% slower at 4096: not kept.
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn2-re-ln"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln"], held_norm=2)
# The default with the Triton stats kernel launched by programmatic dependent launch
# (``finish_pdl``: the kernel's CTAs trigger it first, its CTAs wait for this grid's end in the kernel): the op spends
# 12 us past the kernel at M = 4096 (H100: 0.0948 ms in run 249 against the kernel's 0.0827 in run 251), the stats
# kernel's launch gap among them. The same bits by construction (the same kernels, the same order of writes and reads).
# Run 253 (H200, the op in turn with the default, medians, ms): 1.1425 against 1.1122 at M = 65536, 0.1153 against
# 0.0793 at 4096, the same bits: slower (45% at 4096), not kept.
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-fp"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc"],
                                                           finish_pdl=True)
# The default with its dots' eight wgmma groups a step issued in another order (``dots_order``), so that no chain
# group follows another: "mix" C0 H0 H1 C1 H2 H3 C2 C3, "alt" H0 C0 H1 C1 H2 C2 H3 C3. Runs 252-253 (H200) had the
# dots' warpgroup busy about 1040 cycles a step for about 290 of tensor-core work, and the kernel 15% faster without
# them (``benchmarks/probe_wgmma_step.py`` times the orders alone). The same bits by construction.
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-om"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc"],
                                                           dots_order="mix")
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-oa"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc"],
                                                           dots_order="alt")
# The default with the stats computed in the kernel (``fused_finish``): on the H200 the op spent 9 us past its kernel
# at M = 4096 (run 252's 0.0783 against run 253's 0.0692 for the kernel), 12% of the op, where the goal (0.07) is
# missed by 12%. Runs 189-192 (H100) had it level with the default of then; it has not run on the H200.
CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-ff"] = dict(CONFIGS["wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc"],
                                                           fused_finish=True)
# Not kept (measured in runs 173-174 and 179-181, code not in the tree): the row's x loaded before its partials are
# polled; the residual's sums of squares moved to the dots' warpgroup (with setmaxnreg budgets a role); the row
# block's pre weights brought by TMA with its first stage; one stage-barrier arrival a warp instead of a thread;
# four normalizing warps with the copies issued by the vector role: no faster, or slower (docs/performance.md).
# Dropped unmeasured: each stream's A tile copied into the dots' registers once a step for three register-A wgmmas
# (``dots_rs``, twenty-first session): at 128 registers a thread ptxas serializes every wgmma of it (C7512).
# Configs written and built for sm_90a but never run on a GPU: no bits or time measured yet
# (``benchmarks/probe_mhc_pre_diag.py --unmeasured`` times them against the default; ``run_gpu.sh mhc_unmeasured``).
# Run 192 measured the fused finish's after its fix: the op 1.495 / 0.3831 / 0.0985 / 0.0528 ms against the default's
# 1.508 / 0.3737 / 0.0973 / 0.0506 at M = 65536 / 16384 / 4096 / 2048 (-hn3-mc-ff: 1.549 / 0.3933 / 0.1028 / 0.0544),
# the same bits: not kept.
UNMEASURED: tuple[str, ...] = ("wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-om", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-oa",
                                "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-ff")
# DSV41_MHC_PRE_TILELANG_CONFIG names another entry from the environment (for probes and benchmarks)
_ENV_CONFIG = os.environ.get("DSV41_MHC_PRE_TILELANG_CONFIG", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc")
if _ENV_CONFIG not in CONFIGS:
    raise ValueError(f"DSV41_MHC_PRE_TILELANG_CONFIG={_ENV_CONFIG!r}: not one of {sorted(CONFIGS)}")
DEFAULT_CONFIG = CONFIGS[_ENV_CONFIG]
# the fused boundary's (``mhc_boundary``): with the normalizing warps, which take the norm off the vector role that
# also computes the post (with ``held_norm`` instead, 5-6% slower: run 185), and the weight stream multicast to CTA
# pairs (run 191, H100, us: 3602 against 3674 at M = 65536, 899 / 912 at 16384, 231.7 / 234.7 at 4096; the same bits),
# the dots' early release (run 192, above), the vector role's (run 207, above), a ring of two blocks (runs 218-219)
# and its loads under the normal L2 policy (run 231, above)
BOUNDARY_CONFIG = CONFIGS["wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1-ln"]


def _mid_lo(sliced: torch.Tensor) -> torch.Tensor:
    """``[16, 4, 48, d/16]``: each stream's mid rows, then its lo rows (an ``ml48`` build's resident tile), made once
    per sliced-parts tensor and dropped with it (``mhc_weights.derived``)."""
    return derived("ml48", sliced, lambda t: torch.cat((t[1], t[2]), dim=2).contiguous())


def partials(h, pre_prev, sliced, weight, eps: float, *, config: dict | None = None, groups: int | None = None,
             with_xss: bool = False, post: tuple | None = None, finish: tuple | None = None):
    """The persistent kernel alone: ``x [M, d]`` (collapse + RMSNorm) and the slice partials ``ws, ss``
    in the Triton finish kernel's layout (64-row blocks, 16 slices); ``with_xss``: also the norm partials ``xss``
    (where a ``diag`` "timers" build leaves its counts, ``benchmarks/probe_mhc_pre_diag.py``). ``post``: ``(y, post,
    comb)`` of ``mhc_boundary`` (a ``boundary`` build, which ``boundary`` makes of the config): ``h`` is then the
    old residual, and the new one, computed and written by the kernel, comes first. ``finish``: ``(scale, base, iters,
    hc_eps, norm_eps)`` of a ``fused_finish`` build (and only of one), whose ``pre, post, comb`` come last."""
    cfg = dict(DEFAULT_CONFIG if config is None else config)  # a whole config (a ``CONFIGS`` entry)
    if "wgs" not in cfg or "stages" not in cfg:
        raise ValueError(f"TileLang mhc_pre: a config names at least wgs and stages, got {config!r}")
    if bool(cfg.get("boundary")) != (post is not None):
        raise ValueError("TileLang mhc_pre: a boundary build takes (y, post, comb), and only it does")
    if bool(cfg.get("fused_finish")) != (finish is not None):
        raise ValueError("TileLang mhc_pre: a fused_finish build takes (scale, base, iters, hc_eps, norm_eps), and "
                         "only it does")
    m, n, d = h.shape
    dev = h.device
    if groups is None:
        groups = groups_for(torch.cuda.get_device_properties(dev).multi_processor_count)
        groups -= groups % max(1, cfg.get("hi_multicast", 0))  # a cluster's CTAs are in consecutive groups
    mc = cfg.get("hi_multicast", 0)
    if mc and (groups < mc or groups % mc):
        raise ValueError(f"TileLang mhc_pre: hi_multicast clusters CTAs of {mc} groups, got {groups} groups (at least "
                         f"{16 * mc} SMs are needed)")
    bm = BM * cfg["wgs"]
    nrb = -(-m // bm)
    f32 = dict(dtype=torch.float32, device=dev)
    rows = nrb * cfg["wgs"] * NUM_SLICES * BM
    x = torch.empty((m, d), dtype=h.dtype, device=dev)
    ws = torch.empty((rows, NMIX), **f32)
    ss = torch.empty((rows,), **f32)
    # (fused_finish: a counter a row block after the norm partials, from the same sentinel)
    xss = torch.full((rows + (nrb if finish is not None else 0),), SENTINEL, **f32)
    new = torch.empty_like(h) if post is not None else None
    stats = tuple(torch.empty((m, k), **f32) for k in (n, n, n * n)) if finish is not None else ()
    if m:
        extra = ()
        if post is not None:
            y, p, c = post
            extra = (y.contiguous(), p.contiguous(), c.reshape(m, n * n).contiguous(), new.view(m, n * d))
        if finish is not None:
            scale, base, iters, hc_eps, norm_eps = finish
            for name, t, k in (("scale", scale, 3), ("base", base, NMIX)):
                if t.dtype != torch.float32 or t.numel() != k or t.device != dev:
                    raise ValueError(f"TileLang mhc_pre: {name} must be float32 with {k} values on {dev}, got "
                                     f"{t.dtype} {list(t.shape)} on {t.device}")
            cfg["finish_consts"] = (int(iters), float(hc_eps), float(norm_eps))
            extra = (scale.contiguous(), base.contiguous(), *stats)
        mid = _mid_lo(sliced) if cfg.get("ml48") else sliced[1]
        _kernel(d, groups, eps, cfg)(
            h.view(m, n * d), sliced[0], mid, sliced[2], pre_prev.contiguous(), weight.contiguous(),
            x, ws, ss, xss, *extra,
        )
    out = (x, ws, ss, xss[:rows]) if with_xss else (x, ws, ss)
    if stats:
        out = (*out, stats[0], stats[1], stats[2].view(m, n, n))
    return out if new is None else (new, *out)


def _check(op: str, h, sliced, weight):
    why = unsupported(h)
    if why:
        raise ValueError(f"TileLang {op}: {why}")
    d = h.shape[2]
    if tuple(sliced.shape) != (3, NUM_SLICES, HC, NMIX, d // NUM_SLICES) or sliced.dtype != torch.bfloat16:
        raise ValueError(f"TileLang {op}: sliced parts must be bf16 [3, 16, 4, 24, {d // NUM_SLICES}], "
                         f"got {sliced.dtype} {tuple(sliced.shape)}")
    if weight is None or weight.dtype != torch.float32 or tuple(weight.shape) != (d,):
        raise ValueError(f"TileLang {op}: needs the float32 RMSNorm weight [hidden]")


# The stats kernel after the persistent kernel (``triton.mhc_finish.finish_stats``, the same bits whichever runs):
# "rows_full" (one row a thread, 4 whole partials a step) at every M. Run 188 (H100, the whole op, in turn
# replays, ms): 1.509 against 1.576 for "tiles" (the finish kernel's stats programs) and 1.596 for "rows" (4 mix
# columns a step, since removed) at M = 65536, 0.3756 / 0.3868 / 0.3761 at 16384, 0.0973 / 0.0980 / 0.0970 at 4096.
# A config's "stats_kernel" key names the other ("tiles").
STATS_KERNEL = "rows_full"


def _finish(x, ws, ss, scale, base, iters, hc_eps, norm_eps, mixes: bool = False, kernel: str | None = None,
            pdl: bool = False):
    """``(pre, post, comb[, mixes])``: the Triton stats kernel on the partials (``triton.mhc_finish.finish_stats``,
    the bits of the finish kernel's stats programs; ``kernel``: which, ``STATS_KERNEL`` when None; ``pdl``: launched
    by programmatic dependent launch, after a ``finish_pdl`` build)."""
    from ..triton.mhc_common import LAUNCH_OPTIONS
    from ..triton.mhc_finish import finish_stats

    m, d = x.shape
    n = HC
    f32 = dict(dtype=torch.float32, device=x.device)
    pre, post, comb = torch.empty((m, n), **f32), torch.empty((m, n), **f32), torch.empty((m, n, n), **f32)
    mix = torch.empty((m, NMIX), **f32) if mixes else None
    if m:
        finish_stats(ws, ss, scale.contiguous(), base.contiguous(), pre, post, comb, mix, m, 4 * d, BM, iters,
                     hc_eps, norm_eps, LAUNCH_OPTIONS, kernel=kernel or STATS_KERNEL, pdl=pdl)
    return (pre, post, comb, mix) if mixes else (pre, post, comb)


def mhc_pre(h, pre_prev, sliced, scale, base, weight, iters, hc_eps, norm_eps, eps, *, config: dict | None = None,
            mixes: bool = False):
    """``(x, pre, post, comb)`` of ``mhc_pre`` (``sliced``: ``mhc_weights.bf16x3_slice_parts``); the stats
    are the Triton stats kernel's on this kernel's partials. ``mixes``: also the pre-Sinkhorn mixes."""
    _check("mhc_pre", h, sliced, weight)
    cfg = dict(DEFAULT_CONFIG if config is None else config)
    kern = cfg.pop("stats_kernel", None)
    if cfg.get("fused_finish"):  # the stats from the kernel (mixes, for tests: the Triton finish of its partials)
        x, ws, ss, pre, post, comb = partials(h, pre_prev, sliced, weight, eps, config=cfg,
                                              finish=(scale, base, iters, hc_eps, norm_eps))
        if mixes:
            return x, pre, post, comb, _finish(x, ws, ss, scale, base, iters, hc_eps, norm_eps, True)[3]
        return x, pre, post, comb
    x, ws, ss = partials(h, pre_prev, sliced, weight, eps, config=cfg)
    return (x, *_finish(x, ws, ss, scale, base, iters, hc_eps, norm_eps, mixes, kern, bool(cfg.get("finish_pdl"))))


def mhc_boundary(y, res, post, comb, pre_prev, sliced, scale, base, weight, iters, hc_eps, norm_eps, eps, *,
                 config: dict | None = None):
    """``(new_res, x, pre, post, comb)`` of ``mhc_boundary`` in one persistent kernel (``boundary``: the post computed
    from the stage's old residual and y, written to HBM once and over the stage for the projection), then the Triton
    stats kernel; the bits of the Triton post kernel followed by ``mhc_pre``. The ``mhc_boundary`` op's TileLang
    provider runs it where it applies (``lowering.mhc.fused_boundary_at``)."""
    _check("mhc_boundary", res, sliced, weight)
    m, n, d = res.shape
    for name, t, shape, dtype in (("y", y, (m, d), res.dtype), ("post", post, (m, n), torch.float32),
                                  ("comb", comb, (m, n, n), torch.float32)):
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != res.device:
            raise ValueError(f"TileLang mhc_boundary: {name} must be {dtype} {list(shape)} on {res.device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    cfg = dict(BOUNDARY_CONFIG if config is None else config, boundary=True)
    kern = cfg.pop("stats_kernel", None)
    new, x, ws, ss = partials(res, pre_prev, sliced, weight, eps, config=cfg, post=(y, post, comb))
    return (new, x, *_finish(x, ws, ss, scale, base, iters, hc_eps, norm_eps, kernel=kern,
                             pdl=bool(cfg.get("finish_pdl"))))
