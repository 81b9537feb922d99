"""The building blocks of the TileLang ``mhc_pre`` kernel (``mhc_pre_kernel.build``), as TileLang macros over one
kernel's geometry: the partial layouts, the norm (its rsqrt from the 16 slices' partials, the x loads and stores, the
normalizing warps' loop), the dots (per stream, and the deferred loop of ``dots_defer``) and the vector role's stage
reads, and the TMA copies of a step and of the resident weight parts. ``build`` takes them from ``kernel_macros``;
each macro's docstring says what it does."""

# No ``from __future__ import annotations``: TileLang evaluates the macros' annotations.

from types import SimpleNamespace

from .mhc_pre_dots import dots_macros
from .mhc_pre_finish import finish_loop
from .mhc_pre_post import post_macros


def kernel_macros(T, g: SimpleNamespace) -> SimpleNamespace:
    """The macros of one kernel: ``T`` is ``tilelang.language``, ``g`` the geometry and options ``build`` computed
    (names as there)."""
    S, d, eps, m, BM, SENTINEL = g.S, g.d, g.eps, g.m, g.BM, g.SENTINEL
    ds, bk, nc, bm, wgs, groups, rings = g.ds, g.bk, g.nc, g.bm, g.wgs, g.groups, g.rings
    nrun, vals, run_col, x_hints, mid_resident, lead, nt, nring = (
        g.nrun, g.vals, g.run_col, g.x_hints, g.mid_resident, g.lead, g.nt, g.nring)
    flags, norm_w_smem, norm_prepoll = g.flags, g.norm_w_smem, g.norm_prepoll
    xss_by_row, packed_cvt, ml48 = g.xss_by_row, g.packed_cvt, g.ml48
    ml_stream = g.ml_stream  # (ml48 with hi resident, [mid; lo] in the stage's lo0..lo3)
    load_policy = g.load_policy  # the residual's (and the boundary's y) TMA loads' L2 eviction policy
    hi_multicast = g.hi_multicast
    # ``fused_finish``: a warp's publication of a row block's partials (``mhc_pre_finish``)
    count_block = finish_loop(T, g).count_block if g.fused_finish else None
    timers = "timers" in flags
    bf16, f32 = "bfloat16", "float32"

    def pslot(rb, r, s2):
        """Index of row r of kernel row block rb, slice s2, in the 64-row partial layout."""
        return ((rb * wgs + r // BM) * S + s2) * BM + r % BM

    def xslot(rb, r, s2):
        """Index of that row's slice-s2 norm partial in xss: the partial layout, or with ``xss_by_row`` a row's 16
        partials side by side (64 bytes, polled as four 16-byte loads)."""
        return ((rb * wgs + r // BM) * BM + r % BM) * S + s2 if xss_by_row else pslot(rb, r, s2)

    def clock():
        """The SM cycle counter (``diag`` timers)."""
        return T.call_extern("int64", "clock64")

    @T.macro
    def timers_start(tm):
        """``diag`` timers: zero the counters, tm[2] <- now."""
        if timers:
            for k in T.unroll(4):
                tm[k] = T.int64(0)
            tm[2] = clock()

    @T.macro
    def timed_wait(bar, i, parity, tm, tc, k):
        """Wait on ``bar[i]`` for ``parity``; with the ``diag`` timers, its cycles added to tm[k]."""
        if timers:
            tc[0] = clock()
        T.mbarrier_wait_parity(bar[i], parity)
        if timers:
            tm[k] += clock() - tc[0]

    @T.macro
    def timers_write(xss, g, s, first, lt, tm):
        """``diag`` timers: tm[2] <- cycles since ``timers_start``; thread 0 of the role writes tm[0:3] as floats over
        xss rows ``first`` to ``first + 2`` of its CTA's first row block (a probe reads them after the launch)."""
        if timers:
            tm[2] = clock() - tm[2]
            if lt == 0:
                for k in T.unroll(3):
                    xss[pslot(g, first + k, s)] = T.cast(tm[k], f32)

    def normed(w, xv, rstd):
        """bf16(w * (x * rstd)) of one un-normalized bf16 value (the norm's rounding, wherever it runs)."""
        return T.cast(T.ieee_mul(w, T.ieee_mul(T.cast(xv, f32), rstd)), bf16)

    def collapsed(pr, hv0, hv1, hv2, hv3, v):
        """The collapse of value v in f32, ``((p0 h0 + p1 h1) + p2 h2) + p3 h3``, each product and sum rounded."""
        return T.ieee_add(
            T.ieee_add(T.ieee_add(T.ieee_mul(pr[0], hv0[v]), T.ieee_mul(pr[1], hv1[v])), T.ieee_mul(pr[2], hv2[v])),
            T.ieee_mul(pr[3], hv3[v]),
        )

    def cvt_in(dst, src):
        """``packed_cvt``: the 8 f32 values at ``dst`` <- the 8 bf16 at ``src`` (addresses; by bit operations)."""
        return T.call_extern("handle", "dsv41_bf16x8_to_f32", dst, src)

    def cvt_out(dst, src, back=None):
        """``packed_cvt``: the 8 bf16 at ``dst`` <- the 8 f32 at ``src`` rounded to nearest, two an instruction;
        ``back``: the rounded values as f32 there too (it may be ``src``)."""
        if back is None:
            return T.call_extern("handle", "dsv41_f32x8_to_bf16", dst, src)
        return T.call_extern("handle", "dsv41_f32x8_to_bf16_back", dst, back, src)

    @T.macro
    def poll_issue(xss, rbn, r, pv):
        """pv <- row r's 16 slice partials as they are now (relaxed loads from L2; checked by ``row_rstd``)."""
        if xss_by_row:
            for q in T.unroll(S // 4):
                T.call_extern("handle", "dsv41_ld4_relaxed", T.address_of(pv[q * 4]),
                              T.address_of(xss[xslot(rbn, r, q * 4)]))
        else:
            for s2 in T.unroll(S):
                pv[s2] = T.atomic_load(xss[pslot(rbn, r, s2)], memory_order="relaxed")

    @T.macro
    def row_rstd(xss, rbn, r, pv, red, polled=False):
        """red[1] <- rsqrt factor of row r of row block rbn, once its 16 slice partials are published
        (relaxed loads from L2, polled; the values are the only data read, so no fence is needed); ``polled``: pv
        already holds a first poll (``poll_issue``)."""
        for it in T.serial(m + (1 << 30)):  # a ``while`` is not accepted here; a runtime bound is not unrolled
            if not polled or it > 0:
                poll_issue(xss, rbn, r, pv)
            red[0] = 0.0
            if "nopoll" not in flags:
                for s2 in T.unroll(S):
                    red[0] = T.if_then_else(pv[s2] == SENTINEL, 1.0, red[0])
            if red[0] == 0.0:  # (diag nopoll: after one poll)
                T.loop_break()
        red[0] = 0.0
        for s2 in T.unroll(S):  # slice order, as the Triton finish kernel
            red[0] = T.ieee_add(red[0], pv[s2])
        red[1] = T.ieee_fdiv(1.0, T.ieee_fsqrt(T.ieee_add(T.ieee_fdiv(red[0], float(d)), eps)))

    @T.macro
    def store_x(x, row, col2, hf, src, policy):
        """x[row, this thread's columns of the chunk at col2] <- src (bf16); with ``x_hints`` through the 16-byte
        store helper of ``policy`` ("last" / "first")."""
        if row < m:
            for u in T.unroll(nrun):
                if x_hints:
                    T.call_extern("handle", f"dsv41_st16_evict_{policy}", T.address_of(x[row, col2 + run_col(hf, u)]),
                                  T.address_of(src[u * 8]))
                else:
                    for e in T.vectorized(8):
                        x[row, col2 + run_col(hf, u) + e] = src[u * 8 + e]

    @T.macro
    def norm_chunk(x, w_s, row, col2, lcol, hf, xn, wv, red):
        """x[row, this thread's columns of the chunk at col2] <- bf16(w * (x * rstd)) from xn (the
        un-normalized values, loaded before); lcol: the chunk's column within the slice (w_s)."""
        for u in T.unroll(nrun):
            for e in T.vectorized(8):
                wv[u * 8 + e] = w_s[lcol + run_col(hf, u) + e]
        for v in T.unroll(vals):
            xn[v] = normed(wv[v], xn[v], red[1])
        store_x(x, row, col2, hf, xn, "first")

    @T.macro
    def load_chunk(x, row, col2, hf, xn):
        if row < m:
            for u in T.unroll(nrun):
                for e in T.vectorized(8):
                    xn[u * 8 + e] = x[row, col2 + run_col(hf, u) + e]

    @T.macro
    def block_start(sq, xq, pr, prn, pre_prev, row_next):
        """The vector role at a row block's first step: its sums of squares from zero, this block's pre weights (loaded
        a block ahead: loaded here, their latency stalled the step, 6% of the op at M = 16384, run 114) and the next
        block's, for this thread's row there (``row_next``)."""
        for v in T.unroll(vals):
            sq[v] = 0.0
            xq[v] = 0.0
        for k in T.unroll(4):
            pr[k] = prn[k]
        for k in T.unroll(4):
            prn[k] = T.if_then_else(row_next < m, pre_prev[row_next, k], 0.0)

    @T.macro
    def sums_collapse(sq, xq, xf, xo, pr, hv0, hv1, hv2, hv3):
        """This thread's sums of squares of the stage's values (hv0..hv3) and their collapse,
        ((p0 h0 + p1 h1) + p2 h2) + p3 h3: in xf (f32) with ``packed_cvt`` (rounded by the caller, a pair at a time),
        else rounded into xo here, its square summed in xq."""
        for v in T.unroll(vals):
            sq[v] = T.ieee_fmaf(hv0[v], hv0[v], sq[v])
            sq[v] = T.ieee_fmaf(hv1[v], hv1[v], sq[v])
            sq[v] = T.ieee_fmaf(hv2[v], hv2[v], sq[v])
            sq[v] = T.ieee_fmaf(hv3[v], hv3[v], sq[v])
            if packed_cvt:  # rounded to bf16 by the caller, two values at a time
                xf[v] = collapsed(pr, hv0, hv1, hv2, hv3, v)
            else:
                xo[v] = T.cast(collapsed(pr, hv0, hv1, hv2, hv3, v), bf16)
                xq[v] = T.ieee_fmaf(T.cast(xo[v], f32), T.cast(xo[v], f32), xq[v])

    @T.macro
    def publish_sums(ss, xss, rb, r, s, hf, sq, xq, red):
        """The vector role at a row block's last step: this thread's sums of squares (of the residual, sq, and of the
        collapse, xq) reduced over the row's threads and published by its first one, ss then xss (the rows'
        normalization, in every CTA of the group, waits for xss)."""
        # xss last: the normalization of this row block (one CTA each slice) waits for it
        # pairwise tree over the 32 chunk positions: within each run of 8 here (levels 1-3),
        # then (run0 + partner's run0) + (run1 + partner's run1) (levels 4-5)
        for lvl in T.unroll(3):
            for u in T.unroll(nrun):
                for v in T.unroll(4):
                    if v < (4 >> lvl):
                        sq[u * 8 + v] = T.ieee_add(sq[u * 8 + 2 * v], sq[u * 8 + 2 * v + 1])
                        xq[u * 8 + v] = T.ieee_add(xq[u * 8 + 2 * v], xq[u * 8 + 2 * v + 1])
        if nrun == 2:
            red[0] = T.shfl_xor(sq[0], 1)
            red[1] = T.shfl_xor(sq[8], 1)
            sq[0] = T.ieee_add(T.ieee_add(sq[0], red[0]), T.ieee_add(sq[8], red[1]))
            red[0] = T.shfl_xor(xq[0], 1)
            red[1] = T.shfl_xor(xq[8], 1)
            xq[0] = T.ieee_add(T.ieee_add(xq[0], red[0]), T.ieee_add(xq[8], red[1]))
        else:  # runs 8p: (run 0 + run 8) + (run 16 + run 24), lanes 4r + p
            red[0] = T.shfl_xor(sq[0], 1)
            red[1] = T.shfl_xor(xq[0], 1)
            sq[0] = T.ieee_add(sq[0], red[0])
            xq[0] = T.ieee_add(xq[0], red[1])
            red[0] = T.shfl_xor(sq[0], 2)
            red[1] = T.shfl_xor(xq[0], 2)
            sq[0] = T.ieee_add(sq[0], red[0])
            xq[0] = T.ieee_add(xq[0], red[1])
        if hf == 0:
            ss[pslot(rb, r, s)] = sq[0]
            T.atomic_store(xss[xslot(rb, r, s)], xq[0], memory_order="relaxed")

    def within(j, b):
        """Whether block j of the CTA's walk is below M: with ``hi_multicast`` an expression (it walks rank 0's
        ``nloc``), otherwise True (a Python value: no test in the kernel)."""
        return j < b.nloc if hi_multicast else True

    @T.macro
    def release(empty, st, lt, rank):
        """A consumer thread is done with stage st: its arrival, and with ``hi_multicast`` (rank 0 copies into every
        CTA's stage of the cluster) its warp's one arrival on each other CTA's barrier once every lane is (``lt``: the
        thread's index in its role, a multiple of 32 at a warp's start; ``rank``: this CTA's in the cluster)."""
        T.mbarrier_arrive(empty[st])
        if hi_multicast:
            T.sync_warp()
            if lt % 32 == 0:
                for o in T.unroll(1, hi_multicast):
                    T.mbarrier_arrive(empty[st], (rank + o) % hi_multicast)

    @T.macro
    def load_stream(a, hv, st, r, hf):
        """This thread's values of a stream's chunk, from the shared stage, as fp32."""
        for u in T.unroll(nrun):
            if packed_cvt:
                T.evaluate(cvt_in(T.address_of(hv[u * 8]), T.address_of(a[st, r, run_col(hf, u)])))
            else:
                for e in T.vectorized(8):
                    hv[u * 8 + e] = T.cast(a[st, r, run_col(hf, u) + e], f32)

    post = post_macros(T, g, cvt_in, cvt_out)  # (``boundary``)

    @T.macro
    def residual_copies(h, rq, colq, st, a0, a1, a2, a3, full):
        """TMA of the four streams' [bm, 32] chunk at row rq, column colq of each stream, into stage st. The residual
        is read once: with ``loads_evict_first`` (``load_policy``) evicted first, so the un-normalized collapse stays
        in L2 until its normalization."""
        T.tma_copy(h[rq:rq + bm, 0 * d + colq:0 * d + colq + bk], a0[st, :, :], barrier=full[st],
                   eviction_policy=load_policy, leader_scope_threads=lead)
        T.tma_copy(h[rq:rq + bm, 1 * d + colq:1 * d + colq + bk], a1[st, :, :], barrier=full[st],
                   eviction_policy=load_policy, leader_scope_threads=lead)
        T.tma_copy(h[rq:rq + bm, 2 * d + colq:2 * d + colq + bk], a2[st, :, :], barrier=full[st],
                   eviction_policy=load_policy, leader_scope_threads=lead)
        T.tma_copy(h[rq:rq + bm, 3 * d + colq:3 * d + colq + bk], a3[st, :, :], barrier=full[st],
                   eviction_policy=load_policy, leader_scope_threads=lead)

    @T.macro
    def y_copy(y, ys, rq, colq, st, full):
        """``boundary``: TMA of the sub-block's output y of the step's chunk into stage st, for the post."""
        T.tma_copy(y[rq:rq + bm, colq:colq + bk], ys[st, :, :], barrier=full[st], eviction_policy=load_policy,
                   leader_scope_threads=lead)

    @T.macro
    def issue(h, wlo, wmid, q, st, s, g, a0, a1, a2, a3, lo0, lo1, lo2, lo3, mds, full, ring=0, y=None, ys=None,
              real=True):
        """TMA of step q of ``ring`` (row block g + j * groups with j = (q // nc) * rings + ring, chunk q % nc)
        into stage st; every thread arrives (the elected leader first adds the expected bytes). The residual (and y)
        only where the row block is ``real`` (``hi_multicast``: not past M; otherwise the Python True), and with
        ``hi_multicast`` the streamed part by rank 0 of the cluster into every CTA of it (each expects its bytes)."""
        rq = (g + ((q // nc) * rings + ring if rings > 1 else q // nc) * groups) * bm
        cq = q % nc
        colq = s * ds + cq * bk
        if real:
            residual_copies(h, rq, colq, st, a0, a1, a2, a3, full)
        mask = (1 << hi_multicast) - 1 if hi_multicast else None
        if "nowstream" not in flags:  # (diag: the streamed weight part left out, its L2 reads with it)
            T.tma_copy(wlo[s, 0, :, cq * bk:(cq + 1) * bk], lo0[st, :, :], barrier=full[st], leader_scope_threads=lead,
                       cluster_mask=mask)
            T.tma_copy(wlo[s, 1, :, cq * bk:(cq + 1) * bk], lo1[st, :, :], barrier=full[st], leader_scope_threads=lead,
                       cluster_mask=mask)
            T.tma_copy(wlo[s, 2, :, cq * bk:(cq + 1) * bk], lo2[st, :, :], barrier=full[st], leader_scope_threads=lead,
                       cluster_mask=mask)
            T.tma_copy(wlo[s, 3, :, cq * bk:(cq + 1) * bk], lo3[st, :, :], barrier=full[st], leader_scope_threads=lead,
                       cluster_mask=mask)
        if not mid_resident:
            T.tma_copy(wmid[s, :, :, cq * bk:(cq + 1) * bk], mds[st, :, :, :], barrier=full[st],
                       leader_scope_threads=lead)
        if ys is not None:  # ``boundary``: the sub-block's output y of the chunk, for the post
            if real:
                y_copy(y, ys, rq, colq, st, full)
        T.mbarrier_arrive(full[st])

    @T.macro
    def resident(whi, wmid, s, hi0, hi1, hi2, hi3, md0, md1, md2, md3, wbar):
        """TMA of slice s's resident weight parts (hi, and mid unless it streams), onto ``wbar``; with
        ``hi_multicast`` (``ml48``) rank 0 of the cluster loads [mid; lo] into all its CTAs, which share the slice
        (each expects its bytes; ``wbar`` is used once, after the cluster's sync of the barriers' initialization)."""
        mask = (1 << hi_multicast) - 1 if hi_multicast else None
        if not ml48 or ml_stream:  # (with ml48 hi streams with the stage and wmid is [mid; lo], unless ml_stream)
            T.tma_copy(whi[s, 0, :, :], hi0, barrier=wbar[0], leader_scope_threads=lead, cluster_mask=mask)
            T.tma_copy(whi[s, 1, :, :], hi1, barrier=wbar[0], leader_scope_threads=lead, cluster_mask=mask)
            T.tma_copy(whi[s, 2, :, :], hi2, barrier=wbar[0], leader_scope_threads=lead, cluster_mask=mask)
            T.tma_copy(whi[s, 3, :, :], hi3, barrier=wbar[0], leader_scope_threads=lead, cluster_mask=mask)
        if mid_resident and not ml_stream:
            T.tma_copy(wmid[s, 0, :, :], md0, barrier=wbar[0], leader_scope_threads=lead, cluster_mask=mask)
            T.tma_copy(wmid[s, 1, :, :], md1, barrier=wbar[0], leader_scope_threads=lead, cluster_mask=mask)
            T.tma_copy(wmid[s, 2, :, :], md2, barrier=wbar[0], leader_scope_threads=lead, cluster_mask=mask)
            T.tma_copy(wmid[s, 3, :, :], md3, barrier=wbar[0], leader_scope_threads=lead, cluster_mask=mask)
        T.mbarrier_arrive(wbar[0])

    @T.macro
    def normalize_blocks(x, nw, w_s, xss, s, g, nloc, lt, xdone, xfree, xr, wr, pv, red, tm, tc):
        """``norm_wg`` (thread ``lt`` of the ``nt``): each of the CTA's row blocks in order, once the vector role has
        stored it (``xdone``); four threads a row (8 columns of each chunk, so a warp's access covers 8 rows x 64
        contiguous bytes), ``nt / 4`` rows a pass, a row's whole slice loaded at once once its 16 slices have published
        their norm partials; then the block's ring slot is free (``xfree``). ``norm_w_smem``: the weights from ``w_s``
        (the consumers wrote it before their first ``xdone`` arrival). ``norm_prepoll``: a pass's first poll is issued
        before the previous pass's normalization (the block's first before its ``xdone`` wait), so a poll's L2 round
        trip overlaps other work."""
        q = lt % 4
        rp = nt // 4  # rows a pass
        npass = 0 if "nonorm" in flags else T.ceildiv(BM, rp)
        timers_start(tm)
        for jj in T.serial(nloc):
            rbn = g + jj * groups
            if norm_prepoll:
                poll_issue(xss, rbn, lt // 4, pv)  # rows lt // 4 < rp <= BM
            timed_wait(xdone, jj % nring, (jj // nring) % 2, tm, tc, 0)
            for p in T.serial(npass):
                r = p * rp + lt // 4
                row = rbn * bm + r
                if r < BM:
                    if timers:
                        tc[0] = clock()
                    row_rstd(xss, rbn, r, pv, red, norm_prepoll)
                    if timers:
                        tm[1] += clock() - tc[0]
                if T.And(r < BM, row < m):
                    for c2 in T.unroll(nc):
                        for e in T.vectorized(8):
                            xr[c2 * 8 + e] = x[row, s * ds + c2 * bk + q * 8 + e]
                if norm_prepoll:  # the next pass's first poll (pv is free once red[1] holds this row's factor)
                    if r + rp < BM:
                        poll_issue(xss, rbn, r + rp, pv)
                if T.And(r < BM, row < m):
                    for c2 in T.unroll(nc):
                        for e in T.vectorized(8):
                            if norm_w_smem:
                                wr[e] = w_s[c2 * bk + q * 8 + e]
                            else:
                                wr[e] = nw[s * ds + c2 * bk + q * 8 + e]
                        if packed_cvt:  # (normed's roundings, a pair at a time)
                            T.evaluate(T.call_extern("handle", "dsv41_norm_bf16x8", T.address_of(xr[c2 * 8]),
                                                     T.address_of(wr[0]), red[1]))
                        else:
                            for e in T.unroll(8):
                                xr[c2 * 8 + e] = normed(wr[e], xr[c2 * 8 + e], red[1])
                        if x_hints:  # (the normalized values leave L2 first)
                            T.call_extern("handle", "dsv41_st16_evict_first",
                                          T.address_of(x[row, s * ds + c2 * bk + q * 8]), T.address_of(xr[c2 * 8]))
                        else:
                            for e in T.vectorized(8):
                                x[row, s * ds + c2 * bk + q * 8 + e] = xr[c2 * 8 + e]
            T.mbarrier_arrive(xfree[jj % nring])
        timers_write(xss, g, s, 3, lt, tm)  # (wait on xdone, polls, total)

    base = SimpleNamespace(release=release, timed_wait=timed_wait, timers_start=timers_start,
                           timers_write=timers_write, within=within, count_block=count_block, pslot=pslot)
    dots = dots_macros(T, g, base)
    stream_dots, publish, dots_deferred = dots.stream_dots, dots.publish, dots.dots_deferred
    return SimpleNamespace(pslot=pslot, xslot=xslot, normed=normed, cvt_in=cvt_in, cvt_out=cvt_out, row_rstd=row_rstd,
                           store_x=store_x, norm_chunk=norm_chunk, load_chunk=load_chunk, stream_dots=stream_dots,
                           load_stream=load_stream, issue=issue, resident=resident, normalize_blocks=normalize_blocks,
                           timed_wait=timed_wait, publish=publish, dots_deferred=dots_deferred,
                           post_weights=post.post_weights, post_chunk=post.post_chunk, post_global=post.post_global,
                           post_store=post.post_store, post_prefetch=post.post_prefetch, publish_sums=publish_sums,
                           collapsed=collapsed, block_start=block_start, sums_collapse=sums_collapse,
                           post_step=post.post_step,
                           poll_issue=poll_issue, release=release, count_block=count_block, within=within,
                           timers_start=timers_start, timers_write=timers_write)
