"""The consumer loops of the TileLang ``mhc_pre`` kernel (``mhc_pre_kernel.build``): a ring's loop over its row blocks'
steps, for both roles or, with split roles, for the dots (the wgmmas, the hi sums, the mix partials; with
``dots_defer`` the loop of ``mhc_pre_dots.dots_deferred``) or the vector work (the sums of squares, the collapse, the
x stores, the post of ``boundary``, the norm partials, and the lagged norm without the normalizing warps). Moved out
of ``build`` in the twenty-second session; the move left every config's CUDA source as it was (md5 of
``get_kernel_source()``)."""

# No ``from __future__ import annotations``: TileLang evaluates the macros' annotations.

from types import SimpleNamespace

from .mhc_pre_heldnorm import held_norm_loop


def consumer_loops(T, geo: SimpleNamespace, mc: SimpleNamespace):
    """``consumer(ring, role)`` of one kernel: ``T`` is ``tilelang.language``, ``geo`` the geometry and options
    ``build`` computed, ``mc`` its macros (``mhc_pre_macros.kernel_macros``)."""
    HC, NMIX, bk, bm, ds, groups, lag, m, nc, nring, nrun, rings, stages, tpr, vals = (
        geo.HC, geo.nmix, geo.bk, geo.bm, geo.ds, geo.groups, geo.lag, geo.m, geo.nc, geo.nring, geo.nrun, geo.rings,
        geo.stages, geo.tpr, geo.vals)
    boundary, dots_defer, flags, norm_wg, producer = geo.boundary, geo.dots_defer, geo.flags, geo.norm_wg, geo.producer
    post_tma_store, packed_cvt = geo.post_tma_store, geo.packed_cvt
    vec_early = geo.vec_release_early
    row_rstd, store_x, norm_chunk, load_chunk = mc.row_rstd, mc.store_x, mc.norm_chunk, mc.load_chunk
    timers_start, timers_write, timed_wait = mc.timers_start, mc.timers_write, mc.timed_wait
    stream_dots, load_stream, issue = mc.stream_dots, mc.load_stream, mc.issue

    def consumer(ring, role="both"):
        """The consumer loop of one ring (trace-time ``ring``): its warpgroup's row blocks j = local * rings + ring
        of the CTA (``nloc`` of them), ``lt`` the thread's index in the warpgroup, ``fr`` its accumulators, ``b``
        the kernel's buffers and indices; ``role``: "both", or with split roles "mma" (the dots, the hi sums and the
        mix partials) or "vec" (the rest)."""
        if role == "mma" and dots_defer:
            return mc.dots_deferred
        if role == "vec" and geo.held_norm:
            return held_norm_loop(T, geo, mc)
        mma = role != "vec"
        vec = role != "mma"
        lagged = vec and not norm_wg  # the vector role normalizes ``lag`` blocks behind
        base = ring * stages if rings > 1 else 0  # the ring's first stage
        back = groups * rings  # row blocks of the CTA's sequence between two of this ring's

        @T.macro
        def consume(nloc, fr, lt, b):
            acc_hi, acc_mid, acc_lo, sh0, sh1, sh2, sh3 = fr
            h, wlo, wmid, x, ws, ss, xss, pre_prev, w_s, s, g = b.io
            a0, a1, a2, a3, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, md0, md1, md2, md3, mds = b.smem
            full = b.full
            sq, xq, pr, hv0, hv1, hv2, hv3, xo, xn, wv, pv, red, prn, xf = b.regs
            r = lt // tpr  # (the dots' role uses neither)
            hf = lt % tpr
            timers_start(b.tm)
            if vec:  # the first row block's pre weights (``prn``: the next block's, loaded a block ahead)
                row0 = (g + (ring if rings > 1 else 0) * groups) * bm + r
                for k in T.unroll(HC):
                    prn[k] = T.if_then_else(row0 < m, pre_prev[row0, k], 0.0)
            for t in T.serial(nloc * nc):
                st = base + t % stages
                j = t // nc
                c = t % nc
                rb = g + (j * rings + ring if rings > 1 else j) * groups
                col = s * ds + c * bk
                row = rb * bm + r
                # the row block ``lag`` back: its rsqrt at chunk 0, one chunk normalized a step
                nrow = (rb - lag * back) * bm + r
                ncol = col
                if lagged and j >= lag:
                    if c == 0:
                        row_rstd(xss, rb - lag * back, r, pv, red)
                    load_chunk(x, nrow, ncol, hf, xn)
                if vec and norm_wg and c == 0 and j >= nring:  # the normalizing warps are done with block j - nring
                    timed_wait(b.xfree, j % nring, (j // nring + 1) % 2, b.tm, b.tc, 1)
                if c == 0:
                    if mma:
                        T.clear(acc_hi)
                        T.clear(acc_mid)
                        T.clear(acc_lo)
                    if vec:
                        mc.block_start(sq, xq, pr, prn, pre_prev, row + back * bm)
                if vec and boundary and c == 0:
                    mc.post_weights(b, row)
                if vec and boundary and geo.post_prefetch and c == nc - geo.post_prefetch:
                    mc.post_prefetch(b, row + back * bm, pre_prev, row + 2 * back * bm)
                timed_wait(full, st, (t // stages) % 2, b.tm, b.tc, 0)
                if mma and boundary:  # the vector role has written the new residual over the stage
                    timed_wait(b.ready, st, (t // stages) % 2, b.tm, b.tc, 1)
                # 12 async wgmma groups: hi from zero per stream, mid and lo chained over the slice
                if mma and "nodots" not in flags:
                    stream_dots(a0, hi0, md0, mds, 0, lo0, sh0, acc_mid, acc_lo, st, c)
                    stream_dots(a1, hi1, md1, mds, 1, lo1, sh1, acc_mid, acc_lo, st, c)
                    stream_dots(a2, hi2, md2, mds, 2, lo2, sh2, acc_mid, acc_lo, st, c)
                    stream_dots(a3, hi3, md3, mds, 3, lo3, sh3, acc_mid, acc_lo, st, c)
                # meanwhile: sums of squares and the collapse from the same shared tiles
                if vec and "novec" not in flags:
                    load_stream(a0, hv0, st, r, hf)
                    load_stream(a1, hv1, st, r, hf)
                    load_stream(a2, hv2, st, r, hf)
                    load_stream(a3, hv3, st, r, hf)
                    if boundary:  # the post: the new residual over the stage and to HBM, then the dots may read it
                        mc.post_step(b, st, r, hf, row, col, hv0, hv1, hv2, hv3, lt, t, s, g)
                    if vec_early:  # the role is done with the stage (its values, old or new, are in registers)
                        mc.release(b.empty, st, lt, b.rank)
                    mc.sums_collapse(sq, xq, xf, xo, pr, hv0, hv1, hv2, hv3)
                    if packed_cvt:
                        for u in T.unroll(nrun):  # xf <- the rounded values
                            T.evaluate(mc.cvt_out(T.address_of(xo[u * 8]), T.address_of(xf[u * 8]),
                                                  T.address_of(xf[u * 8])))
                        for v in T.unroll(vals):
                            xq[v] = T.ieee_fmaf(xf[v], xf[v], xq[v])
                    if "noxstore" not in flags:
                        store_x(x, row, col, hf, xo, "last")
                    if boundary and geo.post_store_late:  # the new residual's stores last: nothing reuses their
                        mc.post_global(b, row, col, hf)  # registers before the next step's stage wait
                if mma and "nodots" not in flags:
                    T.wait_wgmma(0)
                    for i, n in T.Parallel(bm, NMIX):
                        acc_hi[i, n] = T.ieee_add(
                            T.ieee_add(T.ieee_add(T.ieee_add(acc_hi[i, n], sh0[i, n]), sh1[i, n]), sh2[i, n]), sh3[i, n]
                        )
                # stage st is free once every thread is past its reads (the wgmma reads ended at the wait)
                if producer:
                    if vec and post_tma_store and lt < 32:  # the stage's TMA stores have read it
                        T.tma_store_wait(0)
                    if not (vec and vec_early):  # (vec_early: released after its reads of the stage, above)
                        mc.release(b.empty, st, lt, b.rank)
                else:
                    T.sync_threads()
                    if t + stages < nloc * nc:
                        issue(h, wlo, wmid, t + stages, st, s, g, a0, a1, a2, a3, lo0, lo1, lo2, lo3, mds,
                              full)
                if lagged and j >= lag:
                    norm_chunk(x, w_s, nrow, ncol, c * bk, hf, xn, wv, red)
                if mma and c == nc - 1:
                    mc.publish(ws, rb, s, fr)  # this slice's partials (Triton finish layout)
                if vec and c == nc - 1:
                    if mc.within(j, b):  # (a block past M publishes nothing)
                        mc.publish_sums(ss, xss, rb, r, s, hf, sq, xq, red)
                    if norm_wg:  # after this thread's x stores of the block (release: the warps read them next)
                        T.mbarrier_arrive(b.xdone[j % nring])
            # the last ``lag`` row blocks of this CTA: normalized after the loop
            for jj in T.serial(lag if lagged else 0):
                if nloc - lag + jj >= 0:
                    rbn = g + ((nloc - lag + jj) * rings + ring if rings > 1 else nloc - lag + jj) * groups
                    row_rstd(xss, rbn, r, pv, red)
                    for c2 in T.serial(nc):
                        load_chunk(x, rbn * bm + r, s * ds + c2 * bk, hf, xn)
                        norm_chunk(x, w_s, rbn * bm + r, s * ds + c2 * bk, c2 * bk, hf, xn, wv, red)
            timers_write(xss, g, s, 6 if mma else 9, lt, b.tm)  # (wait on full, wait on xfree, total)

        return consume

    return consumer
