"""mHC patterns: the post (combine) and the collapse (+ RMSNorm).

``mhc_post``: ``out[:, k] = post[:, k] * y + sum_j comb[:, j, k] * res[:, j]`` in
fp32, one bf16 rounding. Spellings: the combine term as the reference
broadcast-sum, an einsum or ``comb^T @ res``, each with either addition order.

``mhc_collapse``: ``x = sum_j pre[:, j] * h[:, j]`` in fp32 rounded to bf16, with
the following RMSNorm when there is one (fp32 statistics, weight multiply,
bf16). Collapse spellings: broadcast-sum (either factor order), einsum,
``pre @ h``; norm spellings: weight before or after the normalised value (the
reference and the ``F.rms_norm``/HF order). The stats (projection + Sinkhorn)
are matched by :mod:`.mhc_stats`.
"""

from __future__ import annotations

import functools

import torch

from .. import lowering  # noqa: F401  (registers torch.ops.dsv41.*)
from .base import M_EX, FusionPattern, Spelling, current_context, rms_normalized_functional
from .checks import first_failure, is_contiguous_rows, same, want_dtype

BF16, F32 = torch.bfloat16, torch.float32
HC_EX, D_EX = 4, 32


def _post_inputs():
    return [
        torch.empty(M_EX, D_EX, dtype=BF16),
        torch.empty(M_EX, HC_EX, D_EX, dtype=BF16),
        torch.empty(M_EX, HC_EX, dtype=F32),
        torch.empty(M_EX, HC_EX, HC_EX, dtype=F32),
    ]


def _res_broadcast_sum(res, comb):
    return (comb.unsqueeze(-1) * res.unsqueeze(2)).sum(1)


def _res_einsum(res, comb):
    return torch.einsum("mjk,mjd->mkd", comb, res.float())


def _res_matmul(res, comb):
    return torch.matmul(comb.transpose(1, 2), res.float())


def _post_spelling(res_term, post_first: bool):
    if post_first:

        def search(y, res, post, comb):
            return (post.unsqueeze(-1) * y.unsqueeze(1) + res_term(res, comb)).to(BF16)

    else:

        def search(y, res, post, comb):
            return (res_term(res, comb) + post.unsqueeze(-1) * y.unsqueeze(1)).to(BF16)

    return search


POST_SPELLINGS = {
    f"{name}{'' if first else '_res_first'}": _post_spelling(fn, first)
    for name, fn in (("broadcast_sum", _res_broadcast_sum), ("einsum", _res_einsum), ("matmul", _res_matmul))
    for first in (True, False)
}


def _post_check(v) -> str | None:
    y, res, post, comb = v["y"], v["res"], v["post"], v["comb"]
    if res.dim() != 3 or y.dim() != 2 or post.dim() != 2 or comb.dim() != 3:
        return "ranks are not y[M,d], res[M,n,d], post[M,n], comb[M,n,n]"
    m, n, d = res.shape
    return first_failure(
        want_dtype("y", y, BF16),
        want_dtype("res", res, BF16),
        want_dtype("post", post, F32),
        want_dtype("comb", comb, F32),
        None if isinstance(n, int) and 1 <= n <= 8 else f"hc_mult {n} outside [1, 8]",
        None if same(y.shape[0], m) and same(y.shape[1], d) else f"y {tuple(y.shape)} vs res {tuple(res.shape)}",
        None
        if same(post.shape[1], n) and same(comb.shape[1], n) and same(comb.shape[2], n)
        else "post/comb width != hc_mult",
        None if same(post.shape[0], m) and same(comb.shape[0], m)
        else f"post {tuple(post.shape)} / comb {tuple(comb.shape)} are not per token (M = {m})",
        is_contiguous_rows("res", res),
    )


def _post_replace(y, res, post, comb):
    ctx = current_context()
    return torch.ops.dsv41.mhc_post(y, res, post, comb, ctx.providers, ctx.mode)


# ---------------------------------------------------------------- collapse
EPS_SENTINEL = 1.2345e-5  # stands for the norm eps in traced patterns; bound to the matched literal


def _collapse_broadcast(h, pre):
    return (pre.unsqueeze(-1) * h.float()).sum(1)


def _collapse_broadcast_swapped(h, pre):
    return (h.float() * pre.unsqueeze(-1)).sum(1)


def _collapse_einsum(h, pre):
    return torch.einsum("mn,mnd->md", pre, h.float())


def _collapse_matmul(h, pre):
    return torch.matmul(pre.unsqueeze(1), h.float()).squeeze(1)


COLLAPSE_TERMS = {
    "broadcast_sum": _collapse_broadcast,
    "broadcast_sum_swapped": _collapse_broadcast_swapped,
    "einsum": _collapse_einsum,
    "matmul": _collapse_matmul,
}


def _normed(xf, eps):
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def _collapse_only(term):
    def search(h, pre):
        return term(h, pre).to(BF16)

    return search


def _collapse_norm(term, weight_first: bool, round_trip: bool = True, functional: bool = False):
    """collapse -> bf16 -> RMSNorm. ``round_trip=False`` is the same code after Inductor (GPU,
    without ``emulate_precision_casts``) dropped the bf16 -> fp32 round trip between the two: the
    fused op restores the reference's rounding point there."""

    def collapsed(h, pre):
        x = term(h, pre)
        return x.to(BF16).float() if round_trip else x

    if functional:  # F.rms_norm(x, (d,), weight, eps): (x * rstd) * weight

        def search(h, pre, weight, eps):
            return (rms_normalized_functional(collapsed(h, pre), eps) * weight).to(BF16)

    elif weight_first:

        def search(h, pre, weight, eps):
            return (weight * _normed(collapsed(h, pre), eps)).to(BF16)

    else:

        def search(h, pre, weight, eps):
            return (_normed(collapsed(h, pre), eps) * weight).to(BF16)

    return search


def _collapse_inputs():
    return [torch.empty(M_EX, HC_EX, D_EX, dtype=BF16), torch.empty(M_EX, HC_EX, dtype=F32)]


def _collapse_norm_inputs():
    return [*_collapse_inputs(), torch.empty(D_EX, dtype=F32), EPS_SENTINEL]


def _collapse_check(v) -> str | None:
    h, pre = v["h"], v["pre"]
    if h.dim() != 3 or pre.dim() != 2:
        return "ranks are not h[M,n,d], pre[M,n]"
    m, n, d = h.shape
    w = v.get("weight")
    eps = v.get("eps")
    return first_failure(
        want_dtype("h", h, BF16),
        want_dtype("pre", pre, F32),
        None if isinstance(n, int) and 1 <= n <= 8 else f"hc_mult {n} outside [1, 8]",
        None if same(pre.shape[0], m) and same(pre.shape[1], n) else f"pre {tuple(pre.shape)} vs h {tuple(h.shape)}",
        None if w is None or (w.dim() == 1 and same(w.shape[0], d)) else f"norm weight {tuple(w.shape)} is not [{d}]",
        None if w is None or w.dtype in (F32, BF16) else f"norm weight dtype {w.dtype}",
        None if eps is None or (isinstance(eps, float) and 0 < eps < 1) else f"norm eps {eps!r} outside (0, 1)",
        is_contiguous_rows("h", h),
    )


def _collapse_replace(h, pre, weight=None, eps=0.0):
    ctx = current_context()
    return torch.ops.dsv41.mhc_collapse(h, pre, weight, float(eps), ctx.providers, ctx.mode)


@functools.lru_cache(maxsize=None)
def _inductor_drops_bf16_round_trips() -> bool:
    """Whether this torch's joint-graph passes remove an fp32 -> bf16 -> fp32 round trip (``pointless_convert``):
    the GPU image's torch 2.11 does; newer ones keep a narrowing intermediate. Probed once on a three-node graph;
    True (the old assumption) where the probe cannot run."""
    try:
        from torch._inductor.fx_passes import joint_graph
        import torch._inductor.config as icfg
        from torch.fx.experimental.proxy_tensor import make_fx

        cvt = torch.ops.prims.convert_element_type.default

        def trip(x):
            return cvt(cvt(x, torch.bfloat16), torch.float32) * 2

        gm = make_fx(trip, tracing_mode="fake")(torch.empty(4))
        if hasattr(joint_graph, "lazy_init"):
            joint_graph.lazy_init()
        with icfg.patch(emulate_precision_casts=False):
            joint_graph.patterns.apply(gm.graph)
        return not any(n.target is cvt and n.args[1] == torch.bfloat16 for n in gm.graph.nodes)
    except Exception:  # noqa: BLE001  (a torch without these internals)
        return True


def _casts_may_be_dropped() -> str | None:
    """The collapse's bf16 round trip is missing from the graph. Inductor's joint-graph passes remove it where this
    torch's ``pointless_convert`` drops narrowing round trips (torch 2.11), ``emulate_precision_casts`` is off and
    ``pattern_matcher`` on; the fused op then restores the program's rounding. Elsewhere the program itself has none,
    and the op would add it."""
    import torch._inductor.config as icfg

    if getattr(icfg, "emulate_precision_casts", False):
        return ("no bf16 rounding between the collapse and the norm, and Inductor keeps casts "
                "(emulate_precision_casts): the fused op would add one")
    if not getattr(icfg, "pattern_matcher", True):  # pointless_convert is one of the joint-graph patterns
        return ("no bf16 rounding between the collapse and the norm, and Inductor's pattern passes, which drop such "
                "casts, are off (pattern_matcher=False): the fused op would add one")
    if not _inductor_drops_bf16_round_trips():
        return ("no bf16 rounding between the collapse and the norm, and this torch's Inductor keeps such casts: "
                "the fused op would add one")
    return None


def _collapse_spellings() -> list[Spelling]:
    out = []
    for name, term in COLLAPSE_TERMS.items():
        out.append(Spelling(name, _collapse_only(term), _collapse_inputs))
        for norm in ("rms_norm", "rms_norm_weight_last", "F.rms_norm"):
            for trip in (True, False):
                out.append(
                    Spelling(
                        f"{name}+{norm}{'' if trip else '_casts_dropped'}",
                        _collapse_norm(term, norm == "rms_norm", trip, functional=norm == "F.rms_norm"),
                        _collapse_norm_inputs,
                        scalars={"eps": EPS_SENTINEL},
                        applies=None if trip else _casts_may_be_dropped,
                    )
                )
    return out


def patterns() -> list[FusionPattern]:
    return [
        FusionPattern(
            kind="mhc_collapse",
            family="mhc",
            op="mhc_collapse",
            spellings=_collapse_spellings(),
            replace=_collapse_replace,
            check=_collapse_check,
            provider_args=lambda v: (v["h"], v["pre"], v.get("weight"), float(v.get("eps", 0.0))),
        ),
        FusionPattern(
            kind="mhc_post",
            family="mhc",
            op="mhc_post",
            spellings=[Spelling(name, fn, _post_inputs) for name, fn in POST_SPELLINGS.items()],
            replace=_post_replace,
            check=_post_check,
            provider_args=lambda v: (v["y"], v["res"], v["post"], v["comb"]),
        )
    ]
