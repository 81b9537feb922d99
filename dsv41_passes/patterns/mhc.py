"""mHC patterns: the post (combine).

``mhc_post``: ``out[:, k] = post[:, k] * y + sum_j comb[:, j, k] * res[:, j]`` in
fp32, one bf16 rounding. Spellings: the combine term as the reference
broadcast-sum, an einsum or ``comb^T @ res``, each with either addition order.
"""

from __future__ import annotations

import torch

from .. import lowering  # noqa: F401  (registers torch.ops.dsv41.*)
from .base import M_EX, FusionPattern, Spelling, current_context
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
        None if same(post.shape[1], n) and same(comb.shape[1], n) and same(comb.shape[2], n) else "post/comb width != hc_mult",
        is_contiguous_rows("res", res),
    )


def _post_replace(y, res, post, comb):
    ctx = current_context()
    return torch.ops.dsv41.mhc_post(y, res, post, comb, ctx.providers, ctx.mode)


def patterns() -> list[FusionPattern]:
    return [
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
