"""The TileLang ``mhc_pre`` kernel (sm_90a): one persistent kernel, one read of the residual, the
collapse + RMSNorm written to HBM once. It gives the Triton kernel's bits; the op runs it from
``lowering.mhc.TILELANG_PRE_MIN_M`` tokens up (``mhc_pre.CONFIGS``, ``docs/performance.md``). Here: the options
(checked in ``mhc_pre_options``), the buffers and the roles' dispatch; the building blocks are ``mhc_pre_macros``
(the dots' ``mhc_pre_dots``), the consumer loops ``mhc_pre_roles``.
With ``boundary`` the kernel also computes the post before it (``mhc_pre.mhc_boundary``; ``post_tma_store``: the new
residual leaves the stage by TMA).

Why a second kernel beside the Triton one: that kernel reloads its K slice's weight parts from L2 for
every 64-row block (1.5 times the bytes of the residual tile: L2 73% busy in run 33) and writes the
un-normalized collapse, which a second launch reads and rewrites (20 KB a token on top of the 50 that
have to move). Here:

* CTA ``(g, s)`` (``groups * 16`` of them, at most one per SM) owns K slice ``s`` and walks row blocks
  ``g, g + groups, ...``. Two of the slice's three weight parts (``[4, 24, D/16]`` bf16 each, 120 KiB: hi and
  mid, or with ``ml48``, every default since run 183, mid and lo side by side) are loaded into shared memory
  once; the third part and the residual come in by TMA, four stages deep, one (chunk, 4 streams) step a
  stage. The pipeline is written out (mbarriers; the copies issued by a producer warpgroup, or by one
  elected consumer thread without it).
* The projection is ``wgmma m64n24k16`` (``m64n48k16`` for the mid and lo chains with ``ml48``): the mix
  columns are not padded to 32 (TileLang splits an N of 24 into n8 atoms; ``_n24`` lets it emit the one
  instruction). The wgmmas run asynchronously beside the sums of squares and the collapse, which read the
  same shared tiles.
* The collapse of a row block is written un-normalized (it should stay in L2: with ``loads_evict_first`` the
  residual is loaded evict-first; the defaults load it under the normal policy since run 231, which was
  faster) and the CTA publishes its slice partials at the block's end: mixes and sums of squares
  in the Triton finish kernel's layout, the norm's sum of squares last, into a buffer filled with
  ``SENTINEL`` before the launch. Then its rows are normalized once the 16 slices' norm partials are in
  (polled with relaxed loads; those values are the only data read from other CTAs, so no fence or counter
  is needed): by default (``norm_wg``) three warps of the producer warpgroup take each row block as the
  vector role hands it over, reload its slice of x, rescale and store it; otherwise the vector role does it
  ``LAG`` row blocks later, one chunk a step.
* The stats (ordered slice sum, rsqrt, sigmoids, Sinkhorn) are the Triton stats kernel
  (``triton.mhc_finish.finish_stats``), run next on the partials; with ``fused_finish`` the kernel computes them
  itself, with the same roundings (``mhc_pre_finish``).

Numerics are the Triton projection kernel's (``triton.mhc`` docstring, split 1): the same K slices,
chunks, stream order, fresh hi dot per (chunk, stream) added in fp32, mid/lo MMA chains over the slice,
``(hi + mid) + lo``, per-position ``fma`` sums of squares reduced by the same pairwise tree, the collapse
as ``((p0 h0 + p1 h1) + p2 h2) + p3 h3`` rounded once, the norm as ``w * (x * rstd)`` with round-to-
nearest divisions. nvcc runs with ``--fmad=false`` and every sum and product is an explicit ``__f*_rn``.
x, pre, post and comb equal the Triton kernel's bitwise on the H200 at every M tested (1 to 65536, odd ones too).

Cross-CTA waits: a CTA waits only for the 16 CTAs of its own group, ``LAG`` row blocks behind, and the
grid is at most one CTA per SM (212 KiB of shared memory each), so every CTA a wait depends on is
resident or, with another kernel on the device, scheduled once that kernel's blocks retire.

Warpgroups (the options are ``build``'s; which were measured, kept or dropped, and why, is in ``mhc_pre.CONFIGS``
and ``docs/performance.md``): every default has a producer warpgroup (``producer``: warp 0 issues the copies, the
consumers release a stage on the mbarrier ``empty`` and never sync the CTA), the dots on one warpgroup and the sums of
squares, collapse (and with ``boundary`` the post) on two (``split_roles``, ``vec_wgs=2``, four threads a row, two
warps a scheduler; the tree of the sums of squares pairs the same runs, so the bits are unchanged). The norm is done
either by warps 1-3 of the producer warpgroup as each row block is handed over (``norm_wg``, ``norm_warps=3``, the
fused boundary's default) or by the vector role a block later from registers (``held_norm``, the ``mhc_pre``
default, registers moved between the roles by ``setmaxnreg``).
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.

import contextlib
from types import SimpleNamespace

from ..mhc_weights import NUM_SLICES, slice_geometry
from .mhc_pre_cuda import LD4_RELAXED_SOURCE, PACKED_CVT_SOURCE, PDL_TRIGGER_SOURCE, PREFETCH_SOURCE, X_HINTS_SOURCE
from .mhc_pre_finish import FINISH_SOURCE, finish_loop
from .mhc_pre_macros import kernel_macros
from .mhc_pre_options import checked_options, cluster_slot, walked_blocks
from .mhc_pre_roles import consumer_loops
from .register_split import CONSUMER_REGS, PRODUCER_REGS, launch_regs, split_reason

HC = 4
NMIX = (2 + HC) * HC  # 24 mix columns, the wgmma N
BM = 64  # rows a row block (one warpgroup's wgmma M)
HALF = 16  # columns of a chunk a thread owns (two threads a row; 8 with ``vec_wgs=2``), as two runs of 8:
# [8 hf, 8 hf + 8) and [16 + 8 hf, 24 + 8 hf), so each 16-byte access of a warp pairs with its
# neighbour's into one whole 32-byte sector of the row
TARGET = {"kind": "cuda", "arch": "sm_90a"}
# the pipeline is written out (TMA + mbarriers): TileLang's own warp specialization would release a stage
# before the asynchronous wgmma reading it has completed
PASS_CONFIGS = {"tl.device_compile_flags": ["--fmad=false"], "tl.disable_warp_specialized": True}
# with a producer warpgroup the syncs are written out too (TileLang's own would sync the CTA, producer included)
PRODUCER_PASS_CONFIGS = dict(PASS_CONFIGS, **{"tl.disable_thread_storage_sync": True})
DEFAULT_STAGES = 4
# ``held_norm``: setmaxnreg of the producer warpgroup, the dots' and the vector role's two (128 * 56 + 128 * 104 +
# 256 * 176 = 65536; ptxas ignores them all when the producer's falls below what its code needs: 40 did)
HELD_REGS = (56, 104, 176)
TWO_CHAIN_REGS = (56, 128, 160)  # ``diag`` "twochains": a second [mid | lo] accumulator (no spills so)
LAG = 2  # a row block is normalized while its CTA computes the one this many row blocks later
SENTINEL = -1.0  # xss before publication (a sum of squares is >= 0 or NaN, never -1)


@contextlib.contextmanager
def _n24():
    """Let TileLang emit ``wgmma m64n24k16`` for the 24 mix columns (it picks n8 for N % 16 == 8,
    because of wrong results with several N atoms a warp, TileLang issue #2593; here there is one)."""
    import tilelang.cuda.intrinsics.macro.wgmma_macro_generator as wg

    orig = getattr(wg, "select_wgmma_inst_n", None)
    if orig is None:  # another TileLang: keep its choice
        yield
        return
    wg.select_wgmma_inst_n = lambda n: NMIX if n == NMIX else orig(n)
    try:
        yield
    finally:
        wg.select_wgmma_inst_n = orig


# ----------------------------------------------------------------------------- kernel
def build(d: int, groups: int, eps: float, stages: int = DEFAULT_STAGES, wgs: int = 1, lag: int = LAG,
          mid_resident: bool = True, producer: bool = False, rings: int = 1, split_roles: bool = False,
          vec_wgs: int = 1, x_hints: bool = False, norm_wg: bool = False, norm_warps: int = 2,
          norm_w_smem: bool = False, diag: str = "", norm_prepoll: bool = False, dots_defer: bool = False,
          xss_by_row: bool = False, boundary: bool = False, post_tma_store: bool = False, packed_cvt: bool = False,
          ml48: bool = False, held_norm: int = 0, held_prepoll: bool = False, hi_multicast: int = 0,
          fused_finish: bool = False, finish_consts: tuple | None = None, dots_release_early: bool = False,
          post_prefetch: int = 0, post_store_late: bool = False, vec_release_early: bool = False,
          ml_stream: bool = False, loads_evict_first: bool = True, post_evict_first: bool = False,
          finish_pdl: bool = False, dots_order: str = ""):
    """PrimFunc of the persistent kernel (hidden ``d``, ``groups * 16`` CTAs, norm ``eps`` baked in;
    ``wgs`` warpgroups a CTA, each 64 rows of a ``64 * wgs``-row block; a row block's collapse is
    normalized while the CTA computes the row block ``lag`` after it; ``mid_resident``: the mid part
    stays in shared memory like hi, else it streams in with lo, freeing 60 KiB for stages; ``producer``: a
    warpgroup of its own issues the copies (warp 0: TMA into the stages once the consumer warpgroups have
    released them, barrier ``empty``), so the consumers neither issue copies nor sync the CTA at each step);
    ``rings`` 2 (with a producer, one warpgroup a row block): two consumer warpgroups take alternate row blocks
    of the CTA, each with a stage ring of its own filled by a producer warp of its own (warp 0 or 1), so they
    do not step together; ``split_roles`` (with a producer, one warpgroup a row block, one ring): two consumer
    warpgroups on the same row block, one issuing the dots and summing the hi parts, the other computing the sums of
    squares, the collapse and the norm, so neither waits behind the other's instructions; ``vec_wgs`` 2 (with split
    roles): that second role on two warpgroups, four threads a row owning 8 columns of a chunk each (two warps a
    scheduler instead of one), the same sums in the same order; ``x_hints``: the un-normalized collapse is stored
    with an L2 evict-last policy (it is read back ``lag`` row blocks later) and the normalized one evict-first;
    ``norm_wg`` (with two vector warpgroups): warps 2 and 3 of the producer warpgroup, four threads a row, normalize
    each row block once its 16 slices have published their norm partials, instead of the vector role one chunk a
    step ``lag`` blocks behind (mbarriers ``xdone`` / ``xfree``, a ring of ``lag + 1``, hand the blocks over);
    ``norm_warps`` 3: warps 1-3 do it, 24 rows a pass (warp 0 still issues the copies); ``norm_w_smem``: those warps
    read the norm weights from the consumers' shared copy instead of global memory; ``norm_prepoll`` (``norm_wg``):
    the normalizing warps load a pass's partials a pass ahead (``normalize_blocks``); ``dots_defer`` (split roles):
    the dots' warpgroup issues a step's four hi dots first and leaves its last chains in flight into the next step
    (``dots_deferred``); ``dots_release_early`` (``dots_defer``): they release the previous step's stage before they
    wait for the next one; ``xss_by_row``: the norm partials laid out with a row's 16 side by side, so a poll is four
    16-byte loads, not 16 of 4 bytes; ``boundary`` (with the normalizing warps or ``held_norm``): ``mhc_boundary``, the
    post computed by the vector role from the stage's old residual and y (``mhc_pre_macros.post_chunk``) and written
    over the stage before the dots read it (barrier ``ready``); ``post_tma_store``: the new residual stored from the
    stage by TMA; ``post_prefetch`` k (the boundary; ignored without it): the vector role prefetches its row's post
    and comb weights of the next row block, and its pre weights of the block after, into L1 at step ``nc - k`` of a
    block (the loads at the next block's first step may then hit);
    ``post_store_late`` (the boundary with the normalizing warps, without ``post_tma_store``; ignored without the
    boundary): the new residual's global stores issued at the end of the vector role's step, after the x stores,
    instead of right after ``ready``;
    ``ml_stream`` (``ml48``): the other way round, hi resident and the [mid; lo] part streamed with the stage (a
    [48, 32] chunk a stream and step): 60 KiB of shared memory resident instead of 120, so a fifth stage fits, for
    twice the weight bytes streamed from L2 a step; the same products;
    ``loads_evict_first`` (on by default): the residual's (and the boundary's y) TMA loads with the L2 evict-first
    policy; off, the normal one (in ``benchmarks/probe_read_pattern.py`` evict-first loads made a read + write of
    these bytes 9% slower, run 230);
    ``post_evict_first`` (the boundary, with ``x_hints``, without ``post_tma_store``): the new residual's stores with
    the L2 evict-first policy (the x stores' helper), not the normal one;
    ``vec_release_early`` (the normalizing warps; ignored with ``post_tma_store`` or ``held_norm``): the vector
    role releases its stage once it has nothing more to do with it, after its loads of the stage or, with the boundary,
    after its post's ``ready`` arrival, instead of at the end of its step (``held_norm`` does so without the boundary);
    ``packed_cvt``: the vector role's and the normalizing warps' bf16 <-> f32 conversions by bit operations, two
    roundings an instruction (``PACKED_CVT_SOURCE``; the same values); ``ml48`` (split roles, the mid part resident):
    the mid and lo parts resident side by side as one [48, DS] tile a stream (``wmid`` is then ``[16, 4, 48, d/16]``,
    mid rows first) and their two chains one ``wgmma m64n48k16`` a step and stream, which reads the A tile once for
    both; the hi part streams with the stage in lo's place (``mhc_pre_dots.chain_dots``); ``held_norm`` k + 1 (split
    roles, two vector warpgroups, ``packed_cvt``, no normalizing warps): the vector role keeps its rows' collapse of a
    block in registers and normalizes it during the next block, reading its rsqrt at step k (``mhc_pre_heldnorm``;
    registers by ``setmaxnreg``: ``HELD_REGS``); ``held_prepoll`` (``held_norm`` >= 2): that rsqrt's first poll issued a
    step earlier; ``hi_multicast`` n (2 or 4; with ``held_norm`` or the normalizing warps, ``ml48``, ``dots_defer``,
    ``groups`` a multiple of n; the boundary too): the n CTAs of a thread block cluster take the same K slice in n
    consecutive groups, and rank 0 loads each step's streamed hi part into all of them by TMA multicast (1/n of the
    weight stream's L2 reads); all walk rank 0's row blocks (another rank's last may be past M: no residual or y
    copies, nothing published or stored), and each stage's ``empty`` counts its own consumers and one arrival from
    each warp of each other CTA's
    (``mhc_pre_macros.release``); ``fused_finish`` (``held_norm``, not the boundary; ``finish_consts`` = (Sinkhorn
    iterations, hc_eps, the stats' norm eps)): warps 1-3 of the producer warpgroup compute pre, post and comb from the
    partials once each row block's 16 slices have published them (``mhc_pre_finish``), instead of the Triton finish
    kernel after the launch; ``finish_pdl``: each CTA's threads issue ``griddepcontrol.launch_dependents`` first, so
    a stats kernel launched by programmatic dependent launch is placed while this grid runs (it waits for its end);
    ``dots_order`` "mix" or "alt" (``dots_defer``, ``ml48``): the order of a step's wgmma groups
    (``mhc_pre_dots.dots_deferred``).
    ``diag`` (probe builds only, ``benchmarks/probe_mhc_pre_diag.py``; comma-separated): "timers" has the first thread
    of each role (producer, normalizing warps, dots, vector) count clock64 cycles waiting on its barriers and in all,
    written over xss at the end (in the partial layout); "nonorm", "novec", "nodots" and "noxstore" drop that work
    (with ``held_norm``: "novec" leaves the vector role its stage waits, releases and norm partials, zero ones),
    "nopoll" the wait for a row's 16 norm partials (one poll, whatever it reads), "nowstream" the streamed weight
    part's copies, "nopostmath" the post's arithmetic (the boundary: the old residual
    is written back as the new one, y unused), "nohi23" / "nochain23" streams 2-3's hi dots / [mid; lo] chain groups,
    "twochains" the same wgmmas with streams 2-3's chain in an accumulator of its own (``mhc_pre_dots.dots_deferred``;
    registers ``TWO_CHAIN_REGS``); wrong results by design.

    Arguments: ``h [M, 4d]`` bf16, ``hi/mid/lo [16, 4, 24, d/16]`` bf16 (slice-major parts), ``pre_prev
    [M, 4]`` f32, ``w [d]`` f32 -> ``x [M, d]`` bf16 (normalized), ``ws [nrb*16*64, 24]``, ``ss``,
    ``xss [nrb*16*64]`` f32 (the Triton finish kernel's partial layout; ``xss`` filled with ``SENTINEL``
    before the launch: a slice's norm partial is published when it stops being the sentinel)."""
    options = {k: v for k, v in locals().items() if k not in ("d", "groups", "eps")}  # (the arguments alone so far)
    import tilelang.language as T

    S = NUM_SLICES
    ds, bk = slice_geometry(d)
    nc = ds // bk  # chunks a slice
    k_total = HC * d
    o = checked_options(d, groups, options)
    flags, post_prefetch, post_store_late, post_evict_first, vec_release_early, hi_multicast = (
        o.flags, o.post_prefetch, o.post_store_late, o.post_evict_first, o.vec_release_early, o.hi_multicast)
    held_regs = TWO_CHAIN_REGS if "twochains" in flags else HELD_REGS  # (``diag``: 24 more for the dots)
    nt = 32 * norm_warps  # the normalizing threads (``norm_wg``): the producer warpgroup's last ones
    nring = lag + 1  # row blocks the vector role may run ahead of the normalizing warps (``norm_wg``)
    consumers = 128 * wgs * rings * (1 + vec_wgs if split_roles else 1)
    threads = consumers + (128 if producer else 0)
    lead = 32 if producer else None  # the threads a TMA issue elects its thread from
    # registers move to the consumers only where the launch gives a thread fewer than they need; with four
    # warpgroups the launch's 128 a thread is what each role gets
    split_regs = producer and vec_wgs == 1 and CONSUMER_REGS > launch_regs(threads)
    tpr = 2 * vec_wgs  # threads of the vector work a row
    nrun = 4 // tpr  # runs of 8 columns of a chunk a thread owns
    vals = 8 * nrun

    def run_col(p, i):
        """Column within a chunk of run i of the thread with part p of its row (see HALF): runs 8 p and 16 + 8 p
        with two threads a row, run 8 p with four (the same 32 columns, the same pairs of runs in the tree)."""
        return i * 16 + p * 8 if nrun == 2 else p * 8
    if split_regs and split_reason(consumers):
        raise ValueError(f"TileLang mhc_pre: {split_reason(consumers)}")
    bm = BM * wgs  # rows a kernel row block; the partials keep 64-row blocks (the finish kernel's layout)
    m = T.dynamic("M")
    bf16, f32 = "bfloat16", "float32"

    geo = SimpleNamespace(
        S=S, d=d, eps=eps, m=m, BM=BM, SENTINEL=SENTINEL, ds=ds, bk=bk, nc=nc, bm=bm, wgs=wgs, groups=groups,
        rings=rings, nrun=nrun, vals=vals, run_col=run_col, x_hints=x_hints, mid_resident=mid_resident, lead=lead,
        nt=nt, nring=nring, flags=flags, norm_w_smem=norm_w_smem, norm_prepoll=norm_prepoll, nmix=NMIX, stages=stages,
        xss_by_row=xss_by_row, HC=HC, lag=lag, tpr=tpr, boundary=boundary, dots_defer=dots_defer, norm_wg=norm_wg,
        producer=producer, post_tma_store=post_tma_store, packed_cvt=packed_cvt, ml48=ml48, held_norm=held_norm,
        held_prepoll=held_prepoll, hi_multicast=hi_multicast, fused_finish=fused_finish, finish_consts=finish_consts,
        dots_release_early=dots_release_early, post_prefetch=post_prefetch, post_store_late=post_store_late,
        post_evict_first=post_evict_first,
        vec_release_early=vec_release_early, ml_stream=ml_stream, dots_order=dots_order,
        load_policy="evict_first" if loads_evict_first else "evict_normal")
    mc = kernel_macros(T, geo)
    timers_start, timers_write, timed_wait = mc.timers_start, mc.timers_write, mc.timed_wait
    issue, resident, normalize_blocks = mc.issue, mc.resident, mc.normalize_blocks

    def ring_blocks(nloc, ring):
        """Row blocks of ``ring`` among the CTA's ``nloc`` (blocks ring, ring + rings, ...)."""
        return T.ceildiv(nloc - ring, rings) if rings > 1 else nloc

    consumer = consumer_loops(T, geo, mc)

    launch = dict(cluster_dims=(hi_multicast, 1, 1)) if hi_multicast else {}
    prelude = (X_HINTS_SOURCE if x_hints else "") + (LD4_RELAXED_SOURCE if xss_by_row else "") + (
        PACKED_CVT_SOURCE if packed_cvt else "") + (FINISH_SOURCE if fused_finish else "") + (
        PREFETCH_SOURCE if post_prefetch else "") + (PDL_TRIGGER_SOURCE if finish_pdl else "") or None
    fin = finish_loop(T, geo) if fused_finish else None

    @T.macro
    def body(h, whi, wmid, wlo, pre_prev, nw, x, ws, ss, xss, io_post, io_fin=None):
        """The kernel; ``io_post``: ``mhc_boundary``'s extra tensors (y, post, comb, new_res) or None; ``io_fin``:
        ``fused_finish``'s (scale, base, pre, post, comb)."""
        with T.Kernel(groups * S, threads=threads, prelude=prelude, **launch) as cta:
            if finish_pdl:  # the stats kernel's grid may launch now (it waits for this one's writes)
                T.call_extern("handle", "dsv41_pdl_trigger")
            if hi_multicast:
                s, g, rank = cluster_slot(cta, hi_multicast, S)
            else:
                s = cta % S
                g = cta // S
            # resident parts, one [24, DS] tile a stream (laid out as DS/32 swizzled [24, 32] chunks)
            if ml48 and not ml_stream:  # [mid; lo], one [48, DS] tile a stream; hi streams with the stage (lo0..3)
                md0 = T.alloc_shared((2 * NMIX, ds), bf16)
                md1 = T.alloc_shared((2 * NMIX, ds), bf16)
                md2 = T.alloc_shared((2 * NMIX, ds), bf16)
                md3 = T.alloc_shared((2 * NMIX, ds), bf16)
                mds = md0
                hi0, hi1, hi2, hi3 = md0, md1, md2, md3  # (not read)
            else:
                hi0 = T.alloc_shared((NMIX, ds), bf16)
                hi1 = T.alloc_shared((NMIX, ds), bf16)
                hi2 = T.alloc_shared((NMIX, ds), bf16)
                hi3 = T.alloc_shared((NMIX, ds), bf16)
            if ml_stream:  # [mid; lo] streams with the stage (in lo0..lo3)
                md0, md1, md2, md3, mds = hi0, hi1, hi2, hi3, hi0  # (not read)
            if mid_resident and not ml48:
                md0 = T.alloc_shared((NMIX, ds), bf16)
                md1 = T.alloc_shared((NMIX, ds), bf16)
                md2 = T.alloc_shared((NMIX, ds), bf16)
                md3 = T.alloc_shared((NMIX, ds), bf16)
                mds = md0
            elif not mid_resident:  # streamed: [stage, stream, 24, 32]
                mds = T.alloc_shared((stages, HC, NMIX, bk), bf16)
                md0 = md1 = md2 = md3 = mds
            # stages: the four streams' [bm, 32] chunk of a row block and the streamed part's [24, 32] chunks ([48, 32]
            # with ml_stream)
            nlo = 2 * NMIX if ml_stream else NMIX
            a0 = T.alloc_shared((stages * rings, bm, bk), bf16)
            a1 = T.alloc_shared((stages * rings, bm, bk), bf16)
            a2 = T.alloc_shared((stages * rings, bm, bk), bf16)
            a3 = T.alloc_shared((stages * rings, bm, bk), bf16)
            lo0 = T.alloc_shared((stages * rings, nlo, bk), bf16)
            lo1 = T.alloc_shared((stages * rings, nlo, bk), bf16)
            lo2 = T.alloc_shared((stages * rings, nlo, bk), bf16)
            lo3 = T.alloc_shared((stages * rings, nlo, bk), bf16)
            full = T.alloc_barrier([32 if producer else threads] * (stages * rings))
            wbar = T.alloc_barrier([32 if producer else threads])
            if hi_multicast:  # released by this CTA's consumers and one thread of each warp of the others'
                empty = T.alloc_cluster_barrier([consumers + (hi_multicast - 1) * consumers // 32] * stages)
            elif producer:
                empty = T.alloc_barrier([consumers // rings] * (stages * rings))
            if norm_wg:  # a row block's x stored by the vector role / normalized by warps 2-3
                xdone = T.alloc_barrier([128 * vec_wgs] * nring)
                xfree = T.alloc_barrier([nt] * nring)
                xr = T.alloc_local((nc * 8,), bf16)
                wr = T.alloc_local((8,), f32)
            if boundary:  # y's chunk a stage; the new residual written over a stage (the dots wait for it)
                ys = T.alloc_shared((stages, bm, bk), bf16)
                ready = T.alloc_barrier([128 * vec_wgs] * stages)
                post_regs = (T.alloc_local((vals,), f32), T.alloc_local((HC * vals,), bf16),
                             T.alloc_local((HC,), f32), T.alloc_local((HC * HC,), f32),
                             T.alloc_local((HC * vals,), f32))
            # a ring's accumulators (each consumer warpgroup its own with two rings)
            frags = []
            for _ring in [0, 1][:rings]:
                if ml48:  # acc_mid is [mid | lo] (48 columns), acc_lo the same fragment
                    acc_ml = T.alloc_fragment((bm, 2 * NMIX), f32)
                    frags.append([T.alloc_fragment((bm, NMIX), f32), acc_ml, acc_ml]
                                 + [T.alloc_fragment((bm, NMIX), f32) for _ in range(4)])
                    if "twochains" in flags:  # (``diag``) streams 2-3's [mid | lo] chain
                        frags[-1].append(T.alloc_fragment((bm, 2 * NMIX), f32))
                else:
                    frags.append([T.alloc_fragment((bm, NMIX), f32) for _ in range(7)])
            # vector thread (r, hf) = (lt // tpr, lt % tpr) owns the runs run_col(hf, .) of every chunk of row r
            sq = T.alloc_local((vals,), f32)
            xq = T.alloc_local((vals,), f32)
            pr = T.alloc_local((HC,), f32)
            prn = T.alloc_local((HC,), f32)
            hv0 = T.alloc_local((vals,), f32)
            hv1 = T.alloc_local((vals,), f32)
            hv2 = T.alloc_local((vals,), f32)
            hv3 = T.alloc_local((vals,), f32)
            xo = T.alloc_local((vals,), bf16)
            xn = T.alloc_local((vals,), bf16)
            wv = T.alloc_local((vals,), f32)
            xf = T.alloc_local((vals,), f32)  # ``packed_cvt``: the collapse before its rounding
            if held_norm:  # a block's collapse held for its normalization, chunks waiting for the rsqrt, weights
                held = (T.alloc_local((nc * vals,), bf16), T.alloc_local((max(held_norm - 1, 1) * vals,), bf16),
                        T.alloc_local((vals,), f32))
            # this slice's norm weights; fused_finish: then the 4 rows' mixes of a row block, in the same buffer
            # (as a buffer of its own TileLang's planner gave it w_s's bytes: their users are in different roles)
            w_s = T.alloc_shared((ds + (96 if fused_finish else 0),), f32)
            if fused_finish:  # the finishing threads' values
                fv = T.alloc_local((8,), f32)
            pv = T.alloc_local((S,), f32)
            red = T.alloc_local((2,), f32)
            tm = T.alloc_local((4,), "int64")  # ``diag`` timers
            tc = T.alloc_local((1,), "int64")
            tx = T.get_thread_binding()
            nrb = T.ceildiv(m, bm)
            nloc = T.ceildiv(nrb - g, groups)  # row blocks of this CTA (0 when g >= nrb)
            total = nloc * nc
            # row blocks it walks: with hi_multicast rank 0's (another rank's last may be past M, then it only takes
            # part in the copies); the loops get nwalk, the rest nloc
            nwalk = walked_blocks(nrb, g, rank, groups) if hi_multicast else nloc
            # (with a cluster barrier TileLang syncs the cluster after the barriers' initialization: neither CTA
            # arrives on the other's barriers before they are initialized; the build test checks it)

            if producer:
                if tx < 128:
                    if split_regs:
                        T.set_max_nreg(PRODUCER_REGS, 0)
                    if held_norm:
                        T.set_max_nreg(held_regs[0], 0)
                    if tx < 32:
                        resident(whi, wmid, s, hi0, hi1, hi2, hi3, md0, md1, md2, md3, wbar)
                    if tx < 32 * rings:  # warp ``ring`` fills that ring
                        ring = tx // 32 if rings > 1 else 0
                        base = ring * stages if rings > 1 else 0
                        timers_start(tm)
                        for q in T.serial(ring_blocks(nwalk, ring) * nc):
                            st = base + q % stages
                            if q >= stages:  # use n of a stage waits for the release of use n - 1
                                timed_wait(empty, st, ((q // stages) + 1) % 2, tm, tc, 0)
                            # (inline: TileLang names a TMA descriptor after the variable that holds the tensor)
                            issue(h, wmid if ml_stream else whi if ml48 else wlo, wmid, q, st, s, g, a0, a1, a2, a3,
                                  lo0, lo1, lo2, lo3, mds, full, ring,
                                  io_post[0] if boundary else None, ys if boundary else None,
                                  q // nc < nloc if hi_multicast else True)
                        timers_write(xss, g, s, 0, tx, tm)  # (wait on empty, -, total)
                    if fused_finish and tx >= 32:
                        fin.finish_blocks(ws, ss, xss, io_fin, s, g, nloc, tx - 32, w_s, ds, fv)
                    if norm_wg and tx >= 128 - nt:
                        normalize_blocks(x, nw, w_s, xss, s, g, nloc, tx - (128 - nt), xdone, xfree, xr, wr, pv,
                                         red, tm, tc)
            else:
                resident(whi, wmid, s, hi0, hi1, hi2, hi3, md0, md1, md2, md3, wbar)
            if (not producer) or tx >= 128:
                if split_regs:
                    T.set_max_nreg(CONSUMER_REGS, 1)
                for i in T.Parallel(ds):
                    w_s[i] = nw[s * ds + i]
                if producer:
                    T.sync_threads(1, consumers)  # w_s is written (no CTA-wide sync: the producer runs on)
                else:
                    for p in T.unroll(stages):
                        if p < total:
                            issue(h, wlo, wmid, p, p, s, g, a0, a1, a2, a3, lo0, lo1, lo2, lo3, mds, full)
                T.mbarrier_wait_parity(wbar[0], 0)
                b = SimpleNamespace(
                    io=(h, wlo, wmid, x, ws, ss, xss, pre_prev, w_s, s, g),
                    smem=(a0, a1, a2, a3, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, md0, md1, md2, md3, mds),
                    full=full, empty=empty if producer else None,
                    xdone=xdone if norm_wg else None, xfree=xfree if norm_wg else None,
                    regs=(sq, xq, pr, hv0, hv1, hv2, hv3, xo, xn, wv, pv, red, prn, xf), tm=tm, tc=tc,
                    ready=ready if boundary else None, ys=ys if boundary else None, post=io_post,
                    post_regs=post_regs if boundary else None, held=held if held_norm else None, nloc=nloc,
                    rank=rank if hi_multicast else None)
                if split_roles:  # warpgroup 1 issues the dots, warpgroup 2 (and 3) does the rest
                    if tx < 256:
                        if held_norm:
                            T.set_max_nreg(held_regs[1], 0)
                        consumer(0, "mma")(nwalk, frags[0], tx - 128, b)
                    if tx >= 256:
                        if held_norm:
                            T.set_max_nreg(held_regs[2], 1)
                        consumer(0, "vec")(nwalk, frags[0], tx - 256, b)
                elif rings == 1:
                    consumer(0)(nloc, frags[0], tx - 128 if producer else tx, b)
                else:  # warpgroup 1 takes the CTA's even row blocks, warpgroup 2 the odd ones
                    if tx < 256:
                        consumer(0)(ring_blocks(nloc, 0), frags[0], tx - 128, b)
                    if tx >= 256:
                        consumer(1)(ring_blocks(nloc, 1), frags[1], tx - 256, b)
            if hi_multicast:
                T.cluster_sync()  # neither CTA leaves while the other may still arrive on its barriers or copy into it

    rows = T.ceildiv(m, bm) * wgs * S * BM  # of the partial buffers
    nmid = 2 * NMIX if ml48 else NMIX  # rows of a stream's resident mid tile ([mid; lo] with ml48)
    # three signatures with the same first ten tensors (the fused finish's xss longer): TileLang reads a prim_func's
    # parameters from its source, so they are written out, and the plain kernel keeps its own (its CUDA unchanged)
    if fused_finish:  # xss: the norm partials, then a counter a row block
        @T.prim_func
        def pre(
            h: T.Tensor((m, k_total), bf16),
            whi: T.Tensor((S, HC, NMIX, ds), bf16),
            wmid: T.Tensor((S, HC, nmid, ds), bf16),
            wlo: T.Tensor((S, HC, NMIX, ds), bf16),
            pre_prev: T.Tensor((m, HC), f32),
            nw: T.Tensor((d,), f32),
            x: T.Tensor((m, d), bf16),
            ws: T.Tensor((rows, NMIX), f32),
            ss: T.Tensor((rows,), f32),
            xss: T.Tensor((rows + T.ceildiv(m, bm),), f32),
            scale: T.Tensor((3,), f32),
            base: T.Tensor((NMIX,), f32),
            pre_out: T.Tensor((m, HC), f32),
            post_out: T.Tensor((m, HC), f32),
            comb_out: T.Tensor((m, HC * HC), f32),
        ):
            body(h, whi, wmid, wlo, pre_prev, nw, x, ws, ss, xss, None, (scale, base, pre_out, post_out, comb_out))
    elif boundary:
        @T.prim_func
        def pre(
            h: T.Tensor((m, k_total), bf16),
            whi: T.Tensor((S, HC, NMIX, ds), bf16),
            wmid: T.Tensor((S, HC, nmid, ds), bf16),
            wlo: T.Tensor((S, HC, NMIX, ds), bf16),
            pre_prev: T.Tensor((m, HC), f32),
            nw: T.Tensor((d,), f32),
            x: T.Tensor((m, d), bf16),
            ws: T.Tensor((rows, NMIX), f32),
            ss: T.Tensor((rows,), f32),
            xss: T.Tensor((rows,), f32),
            y: T.Tensor((m, d), bf16),
            post_in: T.Tensor((m, HC), f32),
            comb_in: T.Tensor((m, HC * HC), f32),
            new_res: T.Tensor((m, k_total), bf16),
        ):
            body(h, whi, wmid, wlo, pre_prev, nw, x, ws, ss, xss, (y, post_in, comb_in, new_res))
    else:
        @T.prim_func
        def pre(
            h: T.Tensor((m, k_total), bf16),
            whi: T.Tensor((S, HC, NMIX, ds), bf16),
            wmid: T.Tensor((S, HC, nmid, ds), bf16),
            wlo: T.Tensor((S, HC, NMIX, ds), bf16),
            pre_prev: T.Tensor((m, HC), f32),
            nw: T.Tensor((d,), f32),
            x: T.Tensor((m, d), bf16),
            ws: T.Tensor((rows, NMIX), f32),
            ss: T.Tensor((rows,), f32),
            xss: T.Tensor((rows,), f32),
        ):
            body(h, whi, wmid, wlo, pre_prev, nw, x, ws, ss, xss, None)
    return pre


def compile_kernel(func, producer: bool = False):
    """Lower and compile for sm_90a (nvcc, no GPU needed), with the n24 wgmma and no FMA contraction."""
    import tilelang
    from tvm.target import Target

    target = Target(TARGET)
    with target, _n24():
        return tilelang.compile(func, target=target, execution_backend="tvm_ffi",
                                pass_configs=PRODUCER_PASS_CONFIGS if producer else PASS_CONFIGS)
