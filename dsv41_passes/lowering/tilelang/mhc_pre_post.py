"""The post of the fused boundary inside the TileLang ``mhc_pre`` kernel (``mhc_pre_kernel.build`` with ``boundary``):
the vector role's macros for the new residual, ``post * y + comb^T res`` with the Triton post kernel's roundings,
written over the stage for the dots and taken to HBM. Moved out of ``mhc_pre_macros`` in the twenty-fifth session;
every build's CUDA source stayed as it was (md5)."""

# No ``from __future__ import annotations``: TileLang evaluates the macros' annotations.

from types import SimpleNamespace


def post_macros(T, g: SimpleNamespace, cvt_in, cvt_out) -> SimpleNamespace:
    """The post's macros of one kernel (``g``: the geometry and options ``build`` computed; ``cvt_in`` / ``cvt_out``:
    ``mhc_pre_macros``' packed bf16 conversions)."""
    m, d, nrun, vals, run_col, packed_cvt = g.m, g.d, g.nrun, g.vals, g.run_col, g.packed_cvt
    stages, groups, bm, ds, bk, nc, post_tma_store = g.stages, g.groups, g.bm, g.ds, g.bk, g.nc, g.post_tma_store
    post_store_late, post_evict_first = g.post_store_late, g.post_evict_first
    no_math = "nopostmath" in g.flags  # (diag: the old residual written back unchanged)
    bf16, f32 = "bfloat16", "float32"

    @T.macro
    def post_weights(b, row):
        """``boundary``: the post and comb weights of this thread's row, at a row block's first step, before its stage
        wait; held for the block (loaded every step: five global loads a step, and the sm_90a build took 127 registers
        against 122, 128 against 117 with ``packed_cvt``; padding rows read the last row and are never stored)."""
        y, post_in, comb_in, new_res = b.post
        yv, nb, pk, cm, _ = b.post_regs
        rc = T.min(row, m - 1)
        for e in T.vectorized(4):
            pk[e] = post_in[rc, e]
        for e in T.vectorized(16):
            cm[e] = comb_in[rc, e]

    @T.macro
    def post_prefetch(b, row_next, pre_prev, row_after):
        """``post_prefetch``: into L1, this thread's row of the next row block (``row_next``; the last row past M): its
        post and comb weights (a 16-byte and a 64-byte row, one line each), which ``post_weights`` loads there; and its
        row of the block after (``row_after``): the pre weights that ``block_start`` loads there, a block ahead (ptxas
        copies them into the registers they are kept in at once, so that load's latency is waited for there too)."""
        y, post_in, comb_in, new_res = b.post
        rn = T.min(row_next, m - 1)
        T.call_extern("handle", "dsv41_prefetch_l1", T.address_of(post_in[rn, 0]))
        T.call_extern("handle", "dsv41_prefetch_l1", T.address_of(comb_in[rn, 0]))
        T.call_extern("handle", "dsv41_prefetch_l1", T.address_of(pre_prev[T.min(row_after, m - 1), 0]))

    @T.macro
    def post_chunk(b, st, r, hf, row, col, hv0, hv1, hv2, hv3):
        """``boundary``: this thread's values of the step's chunk of the new residual, ``post * y + comb^T res``
        with the Triton post kernel's roundings (``mhc_common._combine``: each product and sum rounded, streams in
        order, the result rounded to bf16 once), from the old residual in hv0..hv3 and y from the stage; written over
        the old values in the stage (the dots read them next; ``post_global`` or ``post_store`` take it to HBM); then
        hv0..hv3 <- the new values (``post_weights`` loaded the row's post and comb)."""
        y, post_in, comb_in, new_res = b.post
        yv, nb, pk, cm, nf = b.post_regs
        if packed_cvt:
            for u in T.unroll(nrun):
                T.evaluate(cvt_in(T.address_of(yv[u * 8]), T.address_of(b.ys[st, r, run_col(hf, u)])))
            if no_math:
                for v in T.unroll(vals):
                    nf[0 * vals + v] = hv0[v]
                    nf[1 * vals + v] = hv1[v]
                    nf[2 * vals + v] = hv2[v]
                    nf[3 * vals + v] = hv3[v]
            else:
                for k in T.unroll(4):
                    for v in T.unroll(vals):
                        nf[k * vals + v] = T.ieee_add(T.ieee_mul(pk[k], yv[v]), T.ieee_add(T.ieee_add(T.ieee_add(
                            T.ieee_mul(cm[k], hv0[v]), T.ieee_mul(cm[4 + k], hv1[v])), T.ieee_mul(cm[8 + k], hv2[v])),
                            T.ieee_mul(cm[12 + k], hv3[v])))
            for u in T.unroll(nrun):  # (the old values are all read: hv0..hv3 <- the new ones)
                T.evaluate(cvt_out(T.address_of(nb[0 * vals + u * 8]), T.address_of(nf[0 * vals + u * 8]),
                                   T.address_of(hv0[u * 8])))
                T.evaluate(cvt_out(T.address_of(nb[1 * vals + u * 8]), T.address_of(nf[1 * vals + u * 8]),
                                   T.address_of(hv1[u * 8])))
                T.evaluate(cvt_out(T.address_of(nb[2 * vals + u * 8]), T.address_of(nf[2 * vals + u * 8]),
                                   T.address_of(hv2[u * 8])))
                T.evaluate(cvt_out(T.address_of(nb[3 * vals + u * 8]), T.address_of(nf[3 * vals + u * 8]),
                                   T.address_of(hv3[u * 8])))
        else:
            for u in T.unroll(nrun):
                for e in T.vectorized(8):
                    yv[u * 8 + e] = T.cast(b.ys[st, r, run_col(hf, u) + e], f32)
            for k in T.unroll(4):
                for v in T.unroll(vals):
                    nb[k * vals + v] = T.cast(T.ieee_add(T.ieee_mul(pk[k], yv[v]), T.ieee_add(T.ieee_add(T.ieee_add(
                        T.ieee_mul(cm[k], hv0[v]), T.ieee_mul(cm[4 + k], hv1[v])), T.ieee_mul(cm[8 + k], hv2[v])),
                        T.ieee_mul(cm[12 + k], hv3[v]))), bf16)
        a0, a1, a2, a3 = b.smem[0], b.smem[1], b.smem[2], b.smem[3]
        for u in T.unroll(nrun):
            for e in T.vectorized(8):
                a0[st, r, run_col(hf, u) + e] = nb[0 * vals + u * 8 + e]
            for e in T.vectorized(8):
                a1[st, r, run_col(hf, u) + e] = nb[1 * vals + u * 8 + e]
            for e in T.vectorized(8):
                a2[st, r, run_col(hf, u) + e] = nb[2 * vals + u * 8 + e]
            for e in T.vectorized(8):
                a3[st, r, run_col(hf, u) + e] = nb[3 * vals + u * 8 + e]
        if not packed_cvt:
            for v in T.unroll(vals):
                hv0[v] = T.cast(nb[0 * vals + v], f32)
                hv1[v] = T.cast(nb[1 * vals + v], f32)
                hv2[v] = T.cast(nb[2 * vals + v], f32)
                hv3[v] = T.cast(nb[3 * vals + v], f32)

    @T.macro
    def post_global(b, row, col, hf):
        """``boundary`` without ``post_tma_store``: this thread's values of the step's chunk of the new residual to
        HBM (after the stage's ``ready`` arrival: the async-proxy fence before it then has no global stores to
        order); with ``post_evict_first`` by the 16-byte evict-first store helper."""
        new_res = b.post[3]
        nb = b.post_regs[1]
        if row < m:
            for k in T.unroll(4):
                for u in T.unroll(nrun):
                    if post_evict_first:
                        T.call_extern("handle", "dsv41_st16_evict_first",
                                      T.address_of(new_res[row, k * d + col + run_col(hf, u)]),
                                      T.address_of(nb[k * vals + u * 8]))
                    else:
                        for e in T.vectorized(8):
                            new_res[row, k * d + col + run_col(hf, u) + e] = nb[k * vals + u * 8 + e]

    @T.macro
    def post_store(b, t, s, gi):
        """``post_tma_store``: a warp of the vector role (once every vector thread has written the stage, ``ready``)
        stores step t's chunk of the new residual from the stage by TMA, four [bm, 32] tiles from one elected lane
        (rows past M are clipped); it waits for their reads before the role releases the stage (``store_read``).
        Not from the dots' warpgroup: the elected lane's branch between its wgmmas makes ptxas wait on them (C7517)."""
        new_res = b.post[3]
        a0, a1, a2, a3 = b.smem[0], b.smem[1], b.smem[2], b.smem[3]
        st = t % stages
        rq = (gi + (t // nc) * groups) * bm
        colq = s * ds + (t % nc) * bk
        T.mbarrier_wait_parity(b.ready[st], (t // stages) % 2)
        T.tma_copy(a0[st, :, :], new_res[rq:rq + bm, 0 * d + colq:0 * d + colq + bk], leader_scope_threads=32)
        T.tma_copy(a1[st, :, :], new_res[rq:rq + bm, 1 * d + colq:1 * d + colq + bk], leader_scope_threads=32)
        T.tma_copy(a2[st, :, :], new_res[rq:rq + bm, 2 * d + colq:2 * d + colq + bk], leader_scope_threads=32)
        T.tma_copy(a3[st, :, :], new_res[rq:rq + bm, 3 * d + colq:3 * d + colq + bk], leader_scope_threads=32)

    @T.macro
    def post_step(b, st, r, hf, row, col, hv0, hv1, hv2, hv3, lt, t, s, gi):
        """``boundary``, the vector role after its stage reads: the post (``post_chunk``), the new residual over the
        stage, handed to the dots (``ready``, after the async-proxy fence) and taken to HBM (``post_store`` by a warp,
        or ``post_global``)."""
        post_chunk(b, st, r, hf, row, col, hv0, hv1, hv2, hv3)
        T.fence_proxy_async()
        T.mbarrier_arrive(b.ready[st])
        if post_tma_store:
            if lt < 32:
                post_store(b, t, s, gi)
        elif not post_store_late:  # (else the caller stores it at the end of the step)
            post_global(b, row, col, hf)

    return SimpleNamespace(post_weights=post_weights, post_prefetch=post_prefetch, post_chunk=post_chunk,
                           post_global=post_global, post_store=post_store, post_step=post_step)
