"""Warp-specialized TileLang WO-A kernel (sm_90a) with the pipeline written out.

The product of ``wo_a.build_one_loop`` (one K loop over every ``BK`` chunk of the group, the tile
split between consumer warpgroups by rows, ``wgmma m64 x BN``, the same K order, so the same bits).
TileLang's own warp specialization keeps TMA loads only for an unconditional copy, so the pipeline is
written here:

* warp 0 issues the TMA loads of the A and W tiles into ``stages`` stages (barrier ``loaded[stage]``);
* the consumer warpgroups wait on ``loaded``, issue the chunk's wgmma asynchronously and release the
  previous chunk's stage once its wgmma has completed (``wgmma.wait_group 1``), or with ``wait0`` wait
  for the chunk's own wgmma and release its stage (TileLang's schedule).

Where the rope chunks are de-rotated (``rope``):

* ``"tails"``: beforehand, by ``triton.wo_a.rope_tails`` into ``CS [M, H*BK]`` bf16; the producer loads
  a head's last chunk from there, and the loop is a plain GEMM.
* ``"consumers"``: in the kernel. ``CS`` is the ``[M, RD]`` fp32 table (cos/sin interleaved); each
  consumer thread owns half the rope pairs of one row of its warpgroup's rows, loads their cos/sin into
  registers once per tile, and de-rotates them in the stage, 16 bytes at a time (fp32, one bf16 rounding,
  like the reference), while the previous chunk's wgmma runs; a proxy fence and a warpgroup barrier,
  then the chunk's wgmma.
* ``"registers"``: in the kernel, into the A operand of a register-A wgmma (``wgmma_rs``). Each consumer
  thread loads the cos and +-sin of its A-fragment elements (a pair's two elements sit in one thread) once per
  tile, 64 registers; the rope chunk is read from the stage, de-rotated (fp32, one bf16 rounding) into the
  fragment, and multiplied from there: no write back to shared memory, no proxy fence, no barrier. The same
  bits as the others (GPU, runs 118-122).

``z_cols``: the bf16 tile leaves through a ``[BM, z_cols]`` buffer, in ``BN / z_cols`` parts; with 128 of 256 the
buffer is 32 KiB and a 4th 48 KiB stage fits (224 KiB in all).

``ctas`` > 0: a persistent kernel of ``ctas`` CTAs that walk the tiles (column tiles fastest); the
producer runs ahead into the next tile while the consumers store the last one.

``stream_k`` (persistent only): when the tiles do not fill a whole number of waves and the partial wave holds at
most ``stream_k`` x ``ctas`` tiles (``True``: any), its tiles are shared out by K chunks (stream-K), and with a
partial wave of at most a quarter of the CTAs the last full wave's too ("wide"; a narrow phase keeps each CTA's
share at a quarter of a tile or more): CTA ``b`` takes chunks ``[b L / ctas, (b + 1) L / ctas)`` of those tiles'
``L`` chunks in (tile, chunk) order, so every CTA does the same work, give or take a chunk. A tile cut at CTA
boundaries has a head (the last item of CTA ``b``) and parts from CTAs ``b + 1, ...`` (each such part that CTA's
first item): those leave their fp32 partials in ``WS[cta]`` (laid out by ``ws_index`` for coalesced 16-byte
stores and loads) with a release flag ``FL[cta]``, and CTA ``b`` adds them to the head in CTA order (one fixed
order) and stores the tile. The wide phase alone (run143) was slower
than whole tiles with partial waves of 36 or more of 132 tiles: a CTA then takes about two tiles of a row block in
turn, and their o is read from HBM again; the narrow phase holds only the partial wave's tiles (no faster than
whole tiles either with mostly full partial waves, run146: see ``wo_a.STREAM_K_SHARE``). A cut tile's bits differ
from the uncut sum's and depend on M, so batch-invariant mode never runs it. A CTA waits only at the end of its
range, for flags that the next few CTAs (at most ``stream_k_partners``) publish at the start of theirs, before any
wait of their own: with CTAs dispatched in order, the kernel goes on with as few as five of them resident at a time
(SMs held by another kernel delay it, they cannot stall it).

``wg_store``: each consumer warpgroup writes its 64 rows of the tile into a ``[64, z_cols]`` buffer of its own, meets
on a named barrier of its own and its leader thread stores them by TMA (rows past M clipped by the store); a store's
read is waited for only before that buffer is written again, so neither warpgroup waits for the other's epilogue.
The same bits; no clear gain (run153). Tried with it and dropped (runs 151-152): warpgroup 1 starting its first tile
one or two chunks after warpgroup 0, so that one's wgmmas run while the other stores (within 1-2% either way).
W multicast to a CTA pair of a cluster (run150: the same bits, 1.6662 against 1.6523 ms at M = 65536, not faster:
the L2 does not pace the kernel) was dropped too.

The bf16 tile leaves through shared memory (TMA store). M is ``T.dynamic``.
De-rotating in the producer warpgroup was tried twice and dropped: three warps reading cos/sin from L2 a
pair at a time took 2.3-2.5 times the kernel's time (run 91); two warps in 16-byte pieces, the rope chunk
on its own barrier, 2.63 against 1.65 ms at M = 65536 (run 100): each piece waits on its cos/sin from L2.
Tried with ``"registers"`` and dropped (run 119, ms at 65536 against 1.768): de-rotating the rope chunk a chunk
early, while two wgmmas run (1.890: it holds a third stage, so the producer has none to fill); 32-column chunks
in 6 stages (1.898, two rope chunks a head); the tile stored from registers to free z_s for a 4th stage (1.832;
the GEMM alone 1.841 against 1.665; storing it in two halves through shared memory keeps the GEMM's speed).
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func annotations.

from .register_split import CONSUMER_REGS, PRODUCER_REGS, split_reason

# the pipeline is written out, and so are the thread syncs it needs
PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_thread_storage_sync": True}
ROPE_PLACES = ("tails", "consumers", "registers")


def rope_reason(rope: str, rope_dim: int) -> str | None:
    """Why the kernel cannot de-rotate the rope pairs itself in this place (16-byte pieces; registers: one
    chunk of at most 64 columns, whose cos/sin a consumer thread keeps in 64 registers)."""
    if rope == "consumers" and rope_dim % 16:
        return f"rope_dim {rope_dim} does not split into two halves of 16-byte pieces"
    if rope == "registers" and (rope_dim % 2 or rope_dim > 64):
        return f"rope_dim {rope_dim} is odd or past the 64 whose cos/sin the consumers keep in registers"
    return None


# ``stream_k``: the flag of a cut tile's partial (any part but its head), published after the CTA's stores (each
# thread's fence, a barrier, then one release store) and taken with an acquire load that spins, then cleared for the
# next launch
FLAG_SOURCE = r"""
__device__ __forceinline__ void dsv41_flag_set(int* flag) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" :: "l"(flag), "r"(1) : "memory");
}
__device__ __forceinline__ void dsv41_flag_take(int* flag) {
  int v = 0;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  } while (v == 0);
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" :: "l"(flag), "r"(0) : "memory");
}
__device__ __forceinline__ void dsv41_fence() { __threadfence(); }
"""


def workspace_shapes(cfg_ctas: int, BM: int, BN: int, stream_k: bool) -> tuple[tuple, tuple]:
    """Shapes of the kernel's ``WS`` (fp32 tail partials, one a CTA) and ``FL`` (int32 flags, zero between
    launches); placeholders of one element without ``stream_k``."""
    return ((cfg_ctas, BM, BN), (cfg_ctas,)) if stream_k else ((1, 1, 1), (1,))


def stream_k_percent(stream_k: float) -> int:
    """The largest partial wave shared out, in percent of the CTAs (0: stream-K off)."""
    share = 1.0 if stream_k is True else float(stream_k)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"wo_a (tilelang, specialized): stream_k {stream_k!r} is not a share of the CTAs in [0, 1]")
    return round(100 * share)


def stream_k_partners(total: int) -> int:
    """Most CTAs whose parts a cut tile's head adds: a narrow phase gives each CTA at least ``total // 4`` chunks."""
    return max(1, -(-(total - 1) // max(total // 4, 1)))


def stream_k_schedule(tiles: int, ctas: int, total: int, stream_k: float = True) -> list[list[tuple[int, int, int]]]:
    """The kernel's schedule with ``stream_k``, in Python: per CTA, its items ``(tile, first chunk, end chunk)``
    in order (whole tiles round-robin, then its range of the shared-out tiles' chunks)."""
    full, rem = divmod(tiles, ctas)
    use = full >= 1 and 0 < rem and 100 * rem <= stream_k_percent(stream_k) * ctas
    base = full - 1 if 4 * rem <= ctas else full  # wide (the last full wave too) or narrow (the partial wave)
    out = []
    for b in range(ctas):
        if not use:
            out.append([(b + i * ctas, 0, total) for i in range(-(-(tiles - b) // ctas))])
            continue
        items = [(b + i * ctas, 0, total) for i in range(base)]
        span = (tiles - base * ctas) * total
        i0, i1 = b * span // ctas, (b + 1) * span // ctas
        for ft in range(i0 // total, (i1 - 1) // total + 1):
            items.append((base * ctas + ft, max(i0 - ft * total, 0), min(i1 - ft * total, total)))
        out.append(items)
    return out


def build_specialized(g: int, r: int, hpg: int, d: int, rope_dim: int, BM: int, BN: int, BK: int,
                      stages: int, threads: int = 0, wait0: bool = False, rope: str = "tails", ctas: int = 0,
                      z_cols: int = 0, stream_k: float = 0, wg_store: bool = False):
    """The prim_func for one geometry and config (``threads`` is implied: one producer warpgroup and
    ``BM / 64`` consumers; a value passed must count the consumers or all of them)."""
    import tilelang.language as T

    if BM % 64:
        raise ValueError(f"wo_a (tilelang, specialized): BM {BM} is not a multiple of 64")
    if rope not in ROPE_PLACES:
        raise ValueError(f"wo_a (tilelang, specialized): rope {rope!r} is not one of {ROPE_PLACES}")
    consumers = 128 * (BM // 64)  # two threads a row
    if threads and threads not in (consumers, 128 + consumers):
        raise ValueError(f"wo_a (tilelang, specialized): {threads} threads do not fit BM {BM}")
    RD = rope_dim
    in_kernel = RD > 0 and rope == "consumers"
    in_regs = RD > 0 and rope == "registers"
    if RD and rope_reason(rope, RD):
        raise ValueError(f"wo_a (tilelang, specialized): {rope_reason(rope, RD)}")
    if split_reason(consumers):
        raise ValueError(f"wo_a (tilelang, specialized): {split_reason(consumers)} (BM {BM})")
    bf16, f32 = T.bfloat16, T.float32
    M = T.dynamic("M")
    K, N = hpg * d, g * r
    chunks = d // BK  # K chunks a head; the last holds the rope dims
    total = hpg * chunks
    rope_from = BK - RD
    ppt = RD // 4  # rope pairs a consumer thread de-rotates (half of its row's)
    vecs = ppt // 4  # of four pairs (16 bytes) each
    if in_kernel or in_regs:
        cs_shape, cs_dtype = (M, RD), f32
    else:
        cs_shape, cs_dtype = (M, g * hpg * BK if RD else 1), bf16
    col_tiles = N // BN
    ZC = z_cols or BN  # the tile leaves in BN / ZC parts through a [BM, ZC] buffer (a smaller one frees a stage)
    if BN % ZC:
        raise ValueError(f"wo_a (tilelang, specialized): z_cols {ZC} does not divide BN {BN}")
    z_parts = list(range(BN // ZC))  # a list: unrolled when traced
    persistent = ctas > 0
    sk_pct = stream_k_percent(stream_k)
    sk = sk_pct > 0
    if sk and not persistent:
        raise ValueError("wo_a (tilelang, specialized): stream_k needs a persistent kernel")
    ws_shape, fl_shape = workspace_shapes(ctas, BM, BN, sk)
    partners = stream_k_partners(total)

    def ws_index(i, j):
        """Where element (i, j) of a partial sits in ``WS[cta]`` (a bijection of the BM x BN tile): thread-major
        in 16-byte pieces, for a wgmma accumulator's layout (thread t of the consumers holds rows i with
        i // 16 = t // 32, i % 8 = t % 32 // 4 and columns with j % 8 // 2 = t % 4): piece k of every thread side by
        side, so a warp reads and writes 512 contiguous bytes an instruction."""
        t = (i // 16) * 32 + (i % 8) * 4 + (j % 8) // 2
        return (j // 8) * (4 * consumers) + t * 4 + ((i % 16) // 8) * 2 + j % 2

    def var(expr):  # an int32 register: the expression is computed once, not at every use
        return T.alloc_var(T.int32, init=expr)[0]

    def phase(bid, tiles):
        """A CTA's work: (items, whole tiles first, the waves of them, the shared-out chunks, its first and end
        chunk of them). Without ``stream_k``, ``rounds`` whole tiles."""
        if not sk:
            return (T.ceildiv(tiles - bid, ctas) if persistent else 1), None, None, None, None, None
        full = tiles // ctas
        rem = tiles % ctas
        use = T.And(full >= 1, T.And(rem > 0, 100 * rem <= sk_pct * ctas))  # a partial wave to share out
        base = var(T.if_then_else(4 * rem <= ctas, full - 1, full))  # wide: the last full wave too
        dp = var(T.if_then_else(use, base, T.ceildiv(tiles - bid, ctas)))
        span = var((tiles - base * ctas) * total)  # the shared-out chunks
        i0 = var(T.if_then_else(use, bid * span // ctas, 0))
        i1 = var(T.if_then_else(use, (bid + 1) * span // ctas, 0))
        return var(dp + T.if_then_else(use, (i1 - 1) // total - i0 // total + 1, 0)), dp, base, span, i0, i1

    def work(bid, it, dp, base, i0, i1):
        """(tile, first chunk, end chunk, stage-ring uses before chunk 0) of a CTA's item ``it``."""
        if not sk:
            return (bid + it * ctas if persistent else bid), 0, total, it * total
        cut = it >= dp
        ft = var(i0 // total + it - dp)  # the item's tile among the shared-out ones
        return (var(T.if_then_else(cut, base * ctas + ft, bid + it * ctas)),
                var(T.if_then_else(cut, T.max(i0 - ft * total, 0), 0)),
                var(T.if_then_else(cut, T.min(i1 - ft * total, total), total)),
                var(T.if_then_else(cut, (dp + ft) * total - i0, it * total)))

    @T.prim_func
    def wo_a_specialized_kernel(
        O: T.Tensor((M, g * K), bf16),  # noqa: E741
        W: T.Tensor((N, K), bf16),
        CS: T.Tensor(cs_shape, cs_dtype),  # de-rotated rope chunks, or the cos/sin table (unread without RoPE)
        Z: T.Tensor((M, N), bf16),
        WS: T.Tensor(ws_shape, f32),  # stream_k: a cut tile's partial (not its head), by the CTA that computed it
        FL: T.Tensor(fl_shape, T.int32),  # stream_k: its flag (1: WS[b] holds a partial not yet taken)
    ):
        with T.Kernel(ctas if persistent else col_tiles * T.ceildiv(M, BM), threads=128 + consumers,
                      prelude=FLAG_SOURCE if sk else None) as bid:
            a_s = T.alloc_shared((stages, BM, BK), bf16)
            b_s = T.alloc_shared((stages, BN, BK), bf16)
            if wg_store:  # a [64, ZC] buffer a consumer warpgroup
                z_s = T.alloc_shared((BM // 64, 64, ZC), bf16)
            else:
                z_s = T.alloc_shared((BM, ZC), bf16)
            loaded = T.alloc_barrier([32] * stages)
            empty = T.alloc_barrier([consumers] * stages)
            acc = T.alloc_fragment((BM, BN), f32)
            if in_regs:  # the rope chunk de-rotated into the wgmma's A registers; cos and +-sin of each element's
                # pair (1 and 0 before the rope dims), loaded once a tile
                a_r = T.alloc_fragment((BM, BK), bf16)
                c_f = T.alloc_fragment((BM, BK), f32)
                s_f = T.alloc_fragment((BM, BK), f32)
            cs_r = T.alloc_local((max(2 * ppt, 1),), f32)
            x_r = T.alloc_local((8,), bf16)
            y_r = T.alloc_local((8,), bf16)
            tx = T.get_thread_binding()
            tiles = col_tiles * T.ceildiv(M, BM)
            rounds, dp, base, span, i0, i1 = phase(bid, tiles)
            if tx < 128:
                T.set_max_nreg(PRODUCER_REGS, 0)
                if tx < 32:
                    for it in T.serial(rounds):
                        tile, lo, hi, ub = work(bid, it, dp, base, i0, i1)
                        bx = tile % col_tiles
                        by = tile // col_tiles
                        grp = bx * BN // r  # this tile's group
                        for jc in T.serial(hi - lo):
                            t = lo + jc
                            u = ub + t  # the stage ring's use count
                            st = u % stages
                            if u >= stages:  # use n of a stage waits for the release of use n - 1
                                T.mbarrier_wait_parity(empty[st], ((u // stages) + 1) % 2)
                            k0 = (t // chunks) * d + (t % chunks) * BK
                            if RD > 0 and rope == "tails" and t % chunks == chunks - 1:
                                hd = grp * hpg + t // chunks
                                T.tma_copy(CS[by * BM:(by + 1) * BM, hd * BK:(hd + 1) * BK], a_s[st, :, :],
                                           barrier=loaded[st], leader_scope_threads=32)
                            else:
                                T.tma_copy(O[by * BM:(by + 1) * BM, grp * K + k0:grp * K + k0 + BK], a_s[st, :, :],
                                           barrier=loaded[st], leader_scope_threads=32)
                            T.tma_copy(W[bx * BN:(bx + 1) * BN, k0:k0 + BK], b_s[st, :, :],
                                       barrier=loaded[st], leader_scope_threads=32)
                            T.mbarrier_arrive(loaded[st])
            else:
                T.set_max_nreg(CONSUMER_REGS, 1)
                c = tx - 128
                row = c // 2  # the row whose rope pairs [p0, p0 + ppt) this thread de-rotates
                p0 = (c % 2) * ppt
                for it in T.serial(rounds):
                    tile, lo, hi, ub = work(bid, it, dp, base, i0, i1)
                    bx = tile % col_tiles
                    by = tile // col_tiles
                    if in_kernel:
                        live = by * BM + row < M
                        for q in T.unroll(ppt // 2):  # 16-byte loads (two pairs' cos/sin)
                            for e in T.vectorized(4):
                                cs_r[4 * q + e] = T.if_then_else(live, CS[by * BM + row, 2 * p0 + 4 * q + e], 0.0)
                    if in_regs:
                        for i, k in T.Parallel(BM, BK):
                            q = k - rope_from  # the element's rope dim
                            live = (by * BM + i < M) and q >= 0
                            c_f[i, k] = T.if_then_else(live, CS[by * BM + i, q - k % 2],
                                                       T.if_then_else(q >= 0, 0.0, 1.0))
                            s_f[i, k] = T.if_then_else(live, CS[by * BM + i, q - k % 2 + 1], 0.0) * (1 - 2 * (k % 2))
                    T.clear(acc)
                    for jc in T.serial(hi - lo):
                        t = lo + jc
                        u = ub + t
                        st = u % stages
                        T.mbarrier_wait_parity(loaded[st], (u // stages) % 2)
                        if in_kernel and t % chunks == chunks - 1:
                            for v in T.unroll(vecs):  # 16-byte pieces (four pairs) of this thread's pairs
                                j = rope_from + 2 * p0 + 8 * v
                                for e in T.vectorized(8):
                                    x_r[e] = a_s[st, row, j + e]
                                for q in T.unroll(4):
                                    c0 = cs_r[8 * v + 2 * q]
                                    s0 = cs_r[8 * v + 2 * q + 1]
                                    x0 = T.cast(x_r[2 * q], f32)
                                    x1 = T.cast(x_r[2 * q + 1], f32)
                                    y_r[2 * q] = T.cast(x0 * c0 + x1 * s0, bf16)
                                    y_r[2 * q + 1] = T.cast(x1 * c0 - x0 * s0, bf16)
                                for e in T.vectorized(8):
                                    a_s[st, row, j + e] = y_r[e]
                            T.fence_proxy_async()  # the stage's new values, before the wgmma reads them
                            T.sync_threads(2 + c // 128, 128)  # this warpgroup's rows are all de-rotated
                        if in_regs and t % chunks == chunks - 1:
                            # y0 = x0 c + x1 s, y1 = x1 c - x0 s: x_k c + x_(k^1) (+-s), both pair elements a thread's
                            for i, k in T.Parallel(BM, BK):
                                a_r[i, k] = T.if_then_else(
                                    k >= rope_from,
                                    T.cast(T.cast(a_s[st, i, k], f32) * c_f[i, k]
                                           + T.cast(a_s[st, i, k + 1 - 2 * (k % 2)], f32) * s_f[i, k], bf16),
                                    a_s[st, i, k])
                            T.wgmma_gemm(a_r, b_s[st, :, :], acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        else:
                            T.wgmma_gemm(a_s[st, :, :], b_s[st, :, :], acc, transpose_B=True,
                                         policy=T.GemmWarpPolicy.FullRow)
                        if wait0:
                            T.wait_wgmma(0)
                            T.mbarrier_arrive(empty[st])
                        else:
                            T.wait_wgmma(1)  # the previous chunk's wgmma is done: its stage can be refilled
                            if jc > 0:
                                T.mbarrier_arrive(empty[(u + stages - 1) % stages])
                    T.wait_wgmma(0)
                    if not wait0 and persistent:  # the tile's last stage (a non-persistent CTA just exits)
                        T.mbarrier_arrive(empty[(ub + hi - 1) % stages])
                    if sk:
                        if lo > 0:  # a cut tile's later part (a first shared-out item): its partial, for the head
                            for i, j in T.Parallel(BM, BN):
                                x = ws_index(i, j)
                                WS[bid, x // BN, x % BN] = acc[i, j]
                            T.call_extern("handle", "dsv41_fence")
                            T.sync_threads(1, consumers)
                            if c == 0:
                                T.call_extern("handle", "dsv41_flag_set", T.address_of(FL[bid]))
                        if lo == 0 and hi < total:  # a cut tile's head (the last item): add the next CTAs' parts
                            for q in T.unroll(partners):
                                if (bid + 1 + q) * span // ctas < i1 - hi + total:  # CTA bid + 1 + q starts in it
                                    if c == 0:
                                        T.call_extern("handle", "dsv41_flag_take", T.address_of(FL[bid + 1 + q]))
                                    T.sync_threads(1, consumers)
                                    for i, j in T.Parallel(BM, BN):
                                        x = ws_index(i, j)
                                        acc[i, j] = acc[i, j] + WS[bid + 1 + q, x // BN, x % BN]
                    if lo == 0:  # the whole tile is in acc
                        if wg_store:  # each warpgroup stores its rows
                            wg = c // 128
                            r0 = by * BM + wg * 64  # this warpgroup's first row
                            for h in z_parts:
                                T.tma_store_wait(0)  # this warpgroup's last store (its leader's) has read z_s
                                T.sync_threads(2 + wg, 128)
                                for i, j in T.Parallel(BM, ZC):
                                    z_s[i // 64, i % 64, j] = T.cast(acc[i, h * ZC + j], bf16)
                                T.fence_proxy_async()
                                T.sync_threads(2 + wg, 128)
                                T.tma_copy(z_s[wg, :, :], Z[r0:r0 + 64, bx * BN + h * ZC:bx * BN + (h + 1) * ZC],
                                           leader_scope_threads=128)
                        else:
                            for h in z_parts:
                                if persistent or h > 0:
                                    T.sync_threads(1, consumers)  # the last TMA store has read z_s
                                if ZC == BN:
                                    T.copy(acc, z_s)
                                else:
                                    for i, j in T.Parallel(BM, ZC):
                                        z_s[i, j] = T.cast(acc[i, h * ZC + j], bf16)
                                T.fence_proxy_async()  # the shared-memory writes, before the TMA store reads them
                                T.sync_threads(1, consumers)
                                T.copy(z_s, Z[by * BM, bx * BN + h * ZC])
            if wg_store:
                if tx >= 128:
                    T.tma_store_wait(0)  # the last stores have read z_s before the CTA leaves

    return wo_a_specialized_kernel
