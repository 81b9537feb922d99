"""The dots of the TileLang ``mhc_pre`` kernel (``mhc_pre_kernel.build``) as TileLang macros: a stream's hi dot and
[mid; lo] chains of a step, the slice's mix partials published at a row block's end, and the dots' warpgroup loop of
``dots_defer`` (``dots_deferred``). Moved out of ``mhc_pre_macros`` in the forty-third session (that file had grown
past 500 lines); every config's TileLang script is unchanged by the move."""

# No ``from __future__ import annotations``: TileLang evaluates the macros' annotations.

from types import SimpleNamespace


# ``dots_order``: a step's wgmma groups, (hi dot?, stream) in issue order, and the chain groups left in flight by its
# wait (groups complete in order): "" H0-H3 then C0-C3 (C1-C3 in flight), "mix" C0 H0 H1 C1 H2 H3 C2 C3 (C2-C3),
# "alt" H0 C0 H1 C1 H2 C2 H3 C3 (C3)
DOTS_ORDERS = {
    "": (((True, 0), (True, 1), (True, 2), (True, 3), (False, 0), (False, 1), (False, 2), (False, 3)), 3),
    "mix": (((False, 0), (True, 0), (True, 1), (False, 1), (True, 2), (True, 3), (False, 2), (False, 3)), 2),
    "alt": (((True, 0), (False, 0), (True, 1), (False, 1), (True, 2), (False, 2), (True, 3), (False, 3)), 1),
}


def dots_macros(T, g: SimpleNamespace, base: SimpleNamespace) -> SimpleNamespace:
    """The dots' macros of one kernel: ``T`` is ``tilelang.language``, ``g`` the geometry and options ``build``
    computed, ``base`` the macros of ``mhc_pre_macros.kernel_macros`` they use (stage release, timed waits and timers,
    ``within``, the fused finish's ``count_block``, ``pslot``)."""
    bm, nc, stages, groups, nmix, bk = g.bm, g.nc, g.stages, g.groups, g.nmix, g.bk
    ml48, ml_stream, mid_resident, flags = g.ml48, g.ml_stream, g.mid_resident, g.flags
    dots_release_early, dots_order = g.dots_release_early, g.dots_order
    release, timed_wait = base.release, base.timed_wait
    timers_start, timers_write = base.timers_start, base.timers_write
    within, count_block, pslot = base.within, base.count_block, base.pslot

    @T.macro
    def hi_dot(a, hi, lo, sh, st, c):
        """A stream's hi dot of a step (async), from zero (with ``ml48`` the hi chunk came with the stage, in
        ``lo``; with ``ml_stream`` it is resident)."""
        if ml48 and not ml_stream:
            T.wgmma_gemm(a[st, :, :], lo[st, :, :], sh, transpose_B=True, clear_accum=True)
        else:
            T.wgmma_gemm(a[st, :, :], hi[:, c * bk:(c + 1) * bk], sh, transpose_B=True, clear_accum=True)

    @T.macro
    def chain_dots(a, md, mds, k, lo, acc_mid, acc_lo, st, c, fresh=False):
        """A stream's mid and lo dots of a step (async), chained over the slice (from zero where ``fresh`` holds:
        ``dots_deferred`` starts a row block's chains by the wgmma, not by clearing the registers)."""
        if ml48 and ml_stream:  # [mid; lo] streamed with the stage
            T.wgmma_gemm(a[st, :, :], lo[st, :, :], acc_mid, transpose_B=True, clear_accum=fresh)
        elif ml48:  # [mid; lo] resident: one n48 wgmma, both chains (acc_mid is [mid | lo])
            T.wgmma_gemm(a[st, :, :], md[:, c * bk:(c + 1) * bk], acc_mid, transpose_B=True, clear_accum=fresh)
        elif mid_resident:
            T.wgmma_gemm(a[st, :, :], md[:, c * bk:(c + 1) * bk], acc_mid, transpose_B=True, clear_accum=fresh)
        else:
            T.wgmma_gemm(a[st, :, :], mds[st, k, :, :], acc_mid, transpose_B=True, clear_accum=fresh)
        if not ml48:
            T.wgmma_gemm(a[st, :, :], lo[st, :, :], acc_lo, transpose_B=True, clear_accum=fresh)

    @T.macro
    def stream_dots(a, hi, md, mds, k, lo, sh, acc_mid, acc_lo, st, c):
        """Stream k's three dots of a step (async): hi from zero into sh, mid and lo chained."""
        hi_dot(a, hi, lo, sh, st, c)
        chain_dots(a, md, mds, k, lo, acc_mid, acc_lo, st, c)

    @T.macro
    def publish(ws, rb, s, fr):
        """This slice's mix partials of row block rb (hi + mid + lo), in the Triton finish kernel's layout."""
        acc_hi, acc_mid, acc_lo = fr[0], fr[1], fr[2]
        if ml48:  # acc_mid is [mid | lo]; lo goes through sh0 (free once the block's groups are done: a parallel loop
            # reads a fragment at one index only)
            sh0 = fr[3]
            for i, n in T.Parallel(bm, nmix):
                sh0[i, n] = acc_mid[i, nmix + n]
            for i, n in T.Parallel(bm, nmix):
                ws[pslot(rb, i, s), n] = T.ieee_add(T.ieee_add(acc_hi[i, n], acc_mid[i, n]), sh0[i, n])
        else:
            for i, n in T.Parallel(bm, nmix):
                ws[pslot(rb, i, s), n] = T.ieee_add(T.ieee_add(acc_hi[i, n], acc_mid[i, n]), acc_lo[i, n])

    @T.macro
    def dots_deferred(nloc, fr, lt, b):
        """``dots_defer``: the dots' warpgroup of split roles (one ring, a producer) with each step's last wgmma
        groups in flight into the next step, so the tensor cores do not idle while the warps sum the hi parts,
        release the stage and wait for the next. A step issues the four hi dots first, then the mid / lo chains;
        ``wait_wgmma<6>`` (it takes at most 7; ``<3>`` with ``ml48``, one chain group a stream) then has the hi dots
        done and streams 1-3's chains in flight, and the previous step's groups all done, so its stage is released
        then. The same products and sums in the same order
        as the plain loop (the hi parts added in stream order, each chain over the streams in order; a chain starts
        by the wgmma's scale-d, not from zeroed registers, which at most could flip the sign of an all-zero partial,
        not a value). Only chain groups, never read in the loop, stay in flight across its back edge: ptxas
        serializes every wgmma (C7514) when an instruction in a loop reads the accumulator of a group that may be in
        flight across it, and (C7515, C7518) when one in a branch touches an accumulator, so a row block's last chunk
        is not a branch of the loop but its end. ``dots_release_early``: a step first waits for all the previous
        step's groups and releases its stage, before it waits for its own, so a stage is not held while the dots wait
        for the next one (with ``boundary``, for the vector role's post of it); the same products and sums.
        ``dots_order`` (``ml48``): the step's eight groups issued in another order, "mix" (C0 H0 H1 C1 H2 H3 C2 C3, C
        a stream's chain group, H its hi dot) or "alt" (H0 C0 H1 C1 ...), so a chain group does not follow another;
        each accumulator sees the same wgmmas in the same order: the same bits. The ``diag`` cuts "nohi23" and
        "nochain23" (the default order, ``ml48``) leave out streams 2-3's hi dots or their chain groups: four wgmmas a
        step fewer either way, the chain of a step half as long only with the second; "twochains" keeps every wgmma
        and runs streams 2-3's chain in an accumulator of its own (``fr[7]``), added at the block's end: two chains of
        four a step (wrong mixes by design, for the time of a change of the numerics both kernels share)."""
        acc_hi, acc_mid, acc_lo, sh0, sh1, sh2, sh3 = fr[:7]
        a0, a1, a2, a3, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3, md0, md1, md2, md3, mds = b.smem
        h, wlo, wmid, x, ws, ss, xss, pre_prev, w_s, s, gi = b.io
        timers_start(b.tm)
        nodots = "nodots" in flags  # (``diag``: the stage waits and releases alone, no partials)
        # (``diag``, wrong mixes by design: streams 2-3's hi dots, or their [mid; lo] chain groups, not issued)
        nohi23, nochain23 = "nohi23" in flags, "nochain23" in flags
        # (``diag``, wrong mixes by design: streams 2-3's chain in an accumulator of its own, added at the block's end)
        twochains = "twochains" in flags
        acc_b = fr[7] if twochains else acc_mid
        streams = ((a0, hi0, lo0, sh0, md0), (a1, hi1, lo1, sh1, md1), (a2, hi2, lo2, sh2, md2),
                   (a3, hi3, lo3, sh3, md3))
        # a step's wgmma groups as (hi dot?, stream), and how many chain groups its wait leaves in flight
        issue, in_flight = DOTS_ORDERS[dots_order]
        if not ml48:
            in_flight = 6  # (two chain groups a stream)
        if nohi23 or nochain23:  # streams 2-3's hi dots dropped, or their chain groups
            issue = tuple((is_hi, k) for is_hi, k in issue if k < 2 or is_hi != nohi23)
            in_flight = 1 if nochain23 else in_flight
        for j in T.serial(nloc):
            if nodots:
                for c in T.serial(nc):
                    t = j * nc + c
                    timed_wait(b.full, t % stages, (t // stages) % 2, b.tm, b.tc, 0)
                    release(b.empty, t % stages, lt, b.rank)
                if count_block is not None:  # (fused_finish: still counted, or the finishing warps wait forever)
                    if within(j, b):
                        count_block(xss, gi + j * groups, lt)
                continue
            T.clear(acc_hi)  # (added to by instructions, not by a wgmma)
            for c in T.serial(nc):
                t = j * nc + c
                st = t % stages
                if dots_release_early:  # (at a block's first step nothing is in flight: the block's end waited)
                    T.wait_wgmma(0)
                    if c > 0:
                        release(b.empty, (t - 1) % stages, lt, b.rank)
                timed_wait(b.full, st, (t // stages) % 2, b.tm, b.tc, 0)
                if b.ready is not None:  # ``boundary``: the vector role has written the new residual over the stage
                    timed_wait(b.ready, st, (t // stages) % 2, b.tm, b.tc, 1)
                # (trace time: the step's groups in ``issue``'s order; the buffers are not rebound to names here, as
                # TileLang names a buffer after the variable that last held it)
                for is_hi, k in issue:
                    if is_hi:
                        hi_dot(streams[k][0], streams[k][1], streams[k][2], streams[k][3], st, c)
                    elif twochains and k >= 2:  # streams 2-3's chain in its own accumulator, from zero as stream 0's
                        chain_dots(streams[k][0], streams[k][4], mds, k, streams[k][2], acc_b, acc_lo, st, c,
                                   c == 0 if k == 2 else False)
                    else:
                        chain_dots(streams[k][0], streams[k][4], mds, k, streams[k][2], acc_mid, acc_lo, st, c,
                                   c == 0 if k == 0 else False)
                T.wait_wgmma(in_flight)
                if nohi23:
                    for i, n in T.Parallel(bm, nmix):
                        acc_hi[i, n] = T.ieee_add(T.ieee_add(acc_hi[i, n], sh0[i, n]), sh1[i, n])
                else:
                    for i, n in T.Parallel(bm, nmix):
                        acc_hi[i, n] = T.ieee_add(
                            T.ieee_add(T.ieee_add(T.ieee_add(acc_hi[i, n], sh0[i, n]), sh1[i, n]), sh2[i, n]),
                            sh3[i, n])
                if not dots_release_early:
                    if c > 0:
                        release(b.empty, (t - 1) % stages, lt, b.rank)
            T.wait_wgmma(0)
            release(b.empty, (j * nc + nc - 1) % stages, lt, b.rank)
            if twochains:
                for i, n in T.Parallel(bm, 2 * nmix):
                    acc_mid[i, n] = T.ieee_add(acc_mid[i, n], acc_b[i, n])
            if within(j, b):
                publish(ws, gi + j * groups, s, fr)
                if count_block is not None:
                    count_block(xss, gi + j * groups, lt)
        timers_write(xss, gi, s, 6, lt, b.tm)  # (wait on full, -, total)

    return SimpleNamespace(hi_dot=hi_dot, chain_dots=chain_dots, stream_dots=stream_dots, publish=publish,
                           dots_deferred=dots_deferred)
