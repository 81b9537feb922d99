"""The options of the TileLang ``mhc_pre`` kernel (``mhc_pre_kernel.build``) checked against one another before a
build: each conflict is a ``ValueError`` that names it; and the schedule of ``hi_multicast``'s CTA clusters (which
slice, group and rank a CTA takes, which row blocks it walks). Moved out of ``mhc_pre_kernel`` in the thirty-ninth
and forty-third sessions (the file had grown past 500 lines)."""

from types import SimpleNamespace

from ..mhc_weights import NUM_SLICES, slice_geometry


def checked_options(d: int, groups: int, options: dict) -> SimpleNamespace:
    """``build``'s keyword options (hidden ``d``, ``groups`` CTA groups) checked, and normalized where an option does
    not apply: the post's options are dropped without ``boundary``, ``vec_release_early`` kept only where it acts,
    ``hi_multicast`` an int, and ``flags`` added (``diag``'s comma-separated cuts as a set)."""
    o = SimpleNamespace(**options)
    ds, bk = slice_geometry(d)
    nc = ds // bk  # chunks a slice
    if o.rings not in (1, 2) or (o.rings == 2 and (not o.producer or o.wgs != 1)):
        raise ValueError("TileLang mhc_pre: two stage rings need a producer warpgroup and one warpgroup a row block")
    if o.split_roles and (not o.producer or o.wgs != 1 or o.rings != 1):
        raise ValueError("TileLang mhc_pre: split roles need a producer warpgroup, one warpgroup a row block and "
                         "one ring")
    if o.vec_wgs not in (1, 2) or (o.vec_wgs == 2 and not o.split_roles):
        raise ValueError("TileLang mhc_pre: two vector warpgroups need split roles")
    if o.norm_wg and o.vec_wgs != 2:
        raise ValueError("TileLang mhc_pre: the normalizing warps need two vector warpgroups")
    if o.norm_warps not in (2, 3):
        raise ValueError(f"TileLang mhc_pre: the norm runs on warps 2-3 or 1-3 of the producer, "
                         f"got {o.norm_warps} warps")
    flags = o.flags = set(o.diag.split(",")) - {""}
    if flags - {"timers", "nonorm", "novec", "nodots", "noxstore", "nowstream", "nopostmath", "nopoll", "nohi23",
                "nochain23", "twochains"}:
        raise ValueError(f"TileLang mhc_pre: diag {o.diag!r}: not among timers, nonorm, novec, nodots, noxstore, "
                         "nowstream, nopostmath, nopoll, nohi23, nochain23, twochains")
    if flags & {"nohi23", "nochain23", "twochains"} and not (o.dots_defer and o.ml48 and not o.dots_order):
        raise ValueError("TileLang mhc_pre: diag nohi23, nochain23 and twochains change the deferred dots of ml48 in "
                         "their default order")
    if len(flags & {"nohi23", "nochain23", "twochains", "nodots"}) > 1:
        raise ValueError("TileLang mhc_pre: diag nohi23, nochain23, twochains and nodots go one at a time")
    if "twochains" in flags and not o.held_norm:
        raise ValueError("TileLang mhc_pre: diag twochains takes its registers from held_norm's budgets")
    if o.dots_defer and not o.split_roles:
        raise ValueError("TileLang mhc_pre: dots_defer needs split roles")
    if o.dots_order not in ("", "mix", "alt") or o.dots_order and not (o.dots_defer and o.ml48):
        raise ValueError(f"TileLang mhc_pre: dots_order {o.dots_order!r}: '', 'mix' or 'alt', the last two with "
                         "dots_defer and ml48")
    if o.dots_release_early and not o.dots_defer:
        raise ValueError("TileLang mhc_pre: dots_release_early is an option of dots_defer")
    # the post's options: a boundary config built as an mhc_pre (no post) leaves them out
    o.post_prefetch = int(o.post_prefetch) if o.boundary else 0
    o.post_store_late = bool(o.post_store_late) and o.boundary
    o.post_evict_first = bool(o.post_evict_first) and o.boundary
    if o.post_evict_first and (o.post_tma_store or not o.x_hints):
        raise ValueError("TileLang mhc_pre: post_evict_first is for the boundary with x_hints, without post_tma_store")
    if o.post_prefetch and (o.held_norm or not 1 <= o.post_prefetch <= nc):
        raise ValueError(f"TileLang mhc_pre: post_prefetch {o.post_prefetch} is for the boundary with the normalizing "
                         f"warps, 1 to {nc} steps ahead")
    if o.post_store_late and (o.held_norm or o.post_tma_store):
        raise ValueError("TileLang mhc_pre: post_store_late is for the boundary with the normalizing warps, without "
                         "post_tma_store")
    if "nopostmath" in flags and not (o.boundary and o.packed_cvt):
        raise ValueError("TileLang mhc_pre: diag nopostmath is for the boundary with packed_cvt")
    # (ignored with post_tma_store, whose stage goes back once its stores have read it, and with held_norm, which
    # releases after its loads without the boundary)
    o.vec_release_early = bool(o.vec_release_early) and o.norm_wg and not o.post_tma_store
    if o.post_tma_store and not o.boundary:
        raise ValueError("TileLang mhc_pre: post_tma_store is for the boundary")
    if o.boundary and not ((o.norm_wg or o.held_norm) and o.mid_resident) or o.boundary and "novec" in o.diag:
        raise ValueError("TileLang mhc_pre: the boundary (post fused) needs the normalizing warps (or held_norm), the "
                         "mid part resident and the vector role")
    if o.ml48 and not (o.split_roles and o.mid_resident):
        raise ValueError("TileLang mhc_pre: ml48 needs split roles and the mid part resident")
    if o.ml_stream and not o.ml48:
        raise ValueError("TileLang mhc_pre: ml_stream streams ml48's [mid; lo] part: it needs ml48")
    if o.held_norm and not (o.split_roles and o.vec_wgs == 2 and o.packed_cvt and not o.norm_wg
                            and 1 <= o.held_norm <= d // NUM_SLICES // 32):
        raise ValueError("TileLang mhc_pre: held_norm (1 to the chunks a slice) needs split roles, two vector "
                         "warpgroups and packed_cvt, without the normalizing warps")
    if o.held_prepoll and o.held_norm < 2:
        raise ValueError("TileLang mhc_pre: held_prepoll polls a step before the rsqrt's: held_norm >= 2")
    o.hi_multicast = int(o.hi_multicast)
    if o.hi_multicast and not (o.hi_multicast in (2, 4) and (o.held_norm or o.norm_wg) and o.ml48 and o.dots_defer
                               and groups % o.hi_multicast == 0):
        raise ValueError(f"TileLang mhc_pre: hi_multicast {o.hi_multicast} (2 or 4 CTAs) needs held_norm or the "
                         f"normalizing warps, ml48 and dots_defer, and groups a multiple of it (got {groups})")
    if o.fused_finish and not (o.held_norm and not o.boundary and o.finish_consts is not None):
        raise ValueError("TileLang mhc_pre: fused_finish needs held_norm (the producer warps it frees), no boundary, "
                         "and finish_consts (iterations, hc_eps, norm_eps)")
    if o.finish_pdl and o.fused_finish:
        raise ValueError("TileLang mhc_pre: finish_pdl lets the Triton stats kernel launch early; fused_finish has "
                         "none")
    if (o.norm_w_smem or o.norm_prepoll) and not o.norm_wg:
        raise ValueError("TileLang mhc_pre: norm_w_smem and norm_prepoll are for the normalizing warps (norm_wg)")
    return o


def cluster_slot(cta, n: int, slices: int = NUM_SLICES):
    """``hi_multicast`` n: (K slice, group, cluster rank) of CTA ``cta``. Cluster ``p = cta // n`` takes slice
    ``p % slices`` in groups ``n (p // slices)`` (rank 0) to ``n (p // slices) + n - 1``. Ints or TileLang
    expressions."""
    p = cta // n
    return p % slices, p // slices * n + cta % n, cta % n


def walked_blocks(nrb, g, rank, groups: int):
    """``hi_multicast``: the row blocks a CTA of group ``g`` and cluster rank ``rank`` walks, its rank 0's count
    (of blocks g - rank, g - rank + groups, ... of the ``nrb``): the last may be past M for a rank above 0. Ints or
    TileLang expressions (at most 0 where rank 0's group >= nrb)."""
    return (nrb - g + rank + groups - 1) // groups
