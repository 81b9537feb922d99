"""The vector role of the TileLang ``mhc_pre`` kernel with the collapse held in registers (``held_norm``).

Without it the un-normalized collapse of a row block makes a round trip through the L2: the vector role stores it,
and once the 16 slices of the row have published their norm partials the normalizing warps read it back, rescale it
and store it again (at M = 65536, 42 M of the 187 M sectors the SMs move through the L2, which paces the kernel:
run 184). Here each vector thread keeps its row's 80 values of the block (10 chunks x 8 columns, 40 registers) and
rescales them in place one block later: at step ``c`` of block ``j`` it normalizes and stores chunk ``c`` of block
``j - 1`` before the collapse of chunk ``c`` of block ``j`` takes its registers. The previous block's rsqrt is read
at step ``held_norm - 1`` (``k``), so the 16 CTAs of a group wait on one another by at most that many steps' slack;
chunks ``0 .. k-1`` move to a small side buffer first. The same products and roundings as the normalizing warps
(``dsv41_norm_bf16x8``), so the same bits. The chunk loop is unrolled (the registers are indexed statically)."""

# No ``from __future__ import annotations``: TileLang evaluates the macros' annotations.

from types import SimpleNamespace


def held_norm_loop(T, geo: SimpleNamespace, mc: SimpleNamespace):
    """The vector role's consumer macro ``consume(nloc, fr, lt, b)`` (split roles, two vector warpgroups,
    ``packed_cvt``; with ``boundary`` the post too, as ``mhc_pre_roles``), ``b.held`` = (xb [nc * 8] bf16,
    xk [max(k, 1) * 8] bf16, w8 [8] f32)."""
    HC, bk, bm, ds, groups, m, nc, stages, tpr, vals = (
        geo.HC, geo.bk, geo.bm, geo.ds, geo.groups, geo.m, geo.nc, geo.stages, geo.tpr, geo.vals)
    k = geo.held_norm - 1  # the step of a block at which the previous block's rsqrt is read
    x_hints, boundary, post_tma_store, held_prepoll = geo.x_hints, geo.boundary, geo.post_tma_store, geo.held_prepoll
    timers_start, timers_write, timed_wait = mc.timers_start, mc.timers_write, mc.timed_wait
    novec, noxstore = "novec" in geo.flags, "noxstore" in geo.flags  # (``diag`` cuts: wrong results by design)

    @T.macro
    def norm_store(x, w_s, buf, off, row, col, c, hf, w8, red):
        """The 8 held values buf[off:off + 8] <- bf16(w * (x * rstd)) in place, then stored to x[row, this thread's
        columns of chunk c at col] (evict-first with ``x_hints``: nothing reads them here again)."""
        for e in T.vectorized(8):
            w8[e] = w_s[c * bk + hf * 8 + e]
        T.evaluate(T.call_extern("handle", "dsv41_norm_bf16x8", T.address_of(buf[off]), T.address_of(w8[0]), red[1]))
        if row < m and not noxstore:
            if x_hints:
                T.call_extern("handle", "dsv41_st16_evict_first", T.address_of(x[row, col + hf * 8]),
                              T.address_of(buf[off]))
            else:
                for e in T.vectorized(8):
                    x[row, col + hf * 8 + e] = buf[off + e]

    @T.macro
    def consume(nloc, fr, lt, b):
        h, wlo, wmid, x, ws, ss, xss, pre_prev, w_s, s, g = b.io
        a0, a1, a2, a3 = b.smem[0], b.smem[1], b.smem[2], b.smem[3]
        full, empty = b.full, b.empty
        sq, xq, pr, hv0, hv1, hv2, hv3, xo, xn, wv, pv, red, prn, xf = b.regs
        xb, xk, w8 = b.held
        r = lt // tpr
        hf = lt % tpr
        timers_start(b.tm)
        row0 = g * bm + r
        for q in T.unroll(HC):
            prn[q] = T.if_then_else(row0 < m, pre_prev[row0, q], 0.0)
        for j in T.serial(nloc):
            rb = g + j * groups
            row = rb * bm + r
            prow = row - groups * bm  # this thread's row of the previous block
            for c in T.unroll(nc):
                t = j * nc + c
                st = t % stages
                if c == 0:
                    mc.block_start(sq, xq, pr, prn, pre_prev, row + groups * bm)
                    if boundary:
                        mc.post_weights(b, row)
                # the previous block's chunk c leaves first, so its poll and stores overlap the stage's copy (chunks
                # below k wait in xk for its rsqrt)
                # (diag novec: only the group's wait for the norm partials stays)
                if j >= 1:
                    if k > 0 and not novec:
                        if c < k:
                            for e in T.unroll(8):
                                xk[c * 8 + e] = xb[c * 8 + e]
                    if held_prepoll and c == k - 1:  # the first poll a step ahead: its L2 round trip overlaps it
                        mc.poll_issue(xss, rb - groups, r, pv)
                    if c == k:
                        mc.row_rstd(xss, rb - groups, r, pv, red, held_prepoll)
                        if k > 0 and not novec:
                            for c0 in T.unroll(k):
                                norm_store(x, w_s, xk, c0 * 8, prow, s * ds + c0 * bk, c0, hf, w8, red)
                    if c >= k and not novec:
                        norm_store(x, w_s, xb, c * 8, prow, s * ds + c * bk, c, hf, w8, red)
                timed_wait(full, st, (t // stages) % 2, b.tm, b.tc, 0)
                if not novec:
                    mc.load_stream(a0, hv0, st, r, hf)
                    mc.load_stream(a1, hv1, st, r, hf)
                    mc.load_stream(a2, hv2, st, r, hf)
                    mc.load_stream(a3, hv3, st, r, hf)
                if boundary:  # the post: the new residual over the stage and to HBM, then the dots may read it
                    mc.post_step(b, st, r, hf, row, s * ds + c * bk, hv0, hv1, hv2, hv3, lt, t, s, g)
                else:
                    mc.release(empty, st, lt, b.rank)  # the stage's values are in registers
                if not novec:
                    mc.sums_collapse(sq, xq, xf, xo, pr, hv0, hv1, hv2, hv3)  # (packed_cvt: the collapse in xf)
                    T.evaluate(mc.cvt_out(T.address_of(xb[c * 8]), T.address_of(xf[0]), T.address_of(xf[0])))
                    for v in T.unroll(vals):
                        xq[v] = T.ieee_fmaf(xf[v], xf[v], xq[v])
                if boundary:  # (the stage's TMA stores have read it)
                    if post_tma_store and lt < 32:
                        T.tma_store_wait(0)
                    mc.release(empty, st, lt, b.rank)
                if c == nc - 1:
                    if mc.within(j, b):  # (a block past M publishes nothing)
                        mc.publish_sums(ss, xss, rb, r, s, hf, sq, xq, red)
                        if mc.count_block is not None:
                            mc.count_block(xss, rb, lt)
        # the last block (unless a block past M came after it and normalized it)
        if mc.within(nloc - 1, b) and not novec:
            if nloc >= 1:
                mc.row_rstd(xss, g + (nloc - 1) * groups, r, pv, red)
                for c in T.unroll(nc):
                    norm_store(x, w_s, xb, c * 8, (g + (nloc - 1) * groups) * bm + r, s * ds + c * bk, c, hf, w8,
                               red)
        timers_write(xss, g, s, 9, lt, b.tm)  # (wait on full, -, total)

    return consume
