"""Manifold-constrained hyper-connections (mHC), as in DeepSeek-V4.1's reference.

The residual is ``n = hc_mult`` bf16 streams ``[M, n, d]``. Per sub-block:

* ``hc_mixes`` (stats): fp32 projection of the flattened streams with the fp32
  ``fn [(2+n)*n, n*d]``, scaled by the row's rsqrt-mean-square (the RMS is folded
  after the projection), then ``pre = sigmoid + hc_eps``, ``post = 2 sigmoid``,
  ``comb`` = row softmax + eps followed by Sinkhorn normalisation ending on a
  column step (``hc_sinkhorn_iters`` in total);
* ``hc_collapse``: ``sum_j pre_j * x_j`` in fp32, rounded to bf16;
* ``hc_post``: ``out_k = post_k * y + sum_j comb[j, k] * res_j`` in fp32, rounded
  once to bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``[M, n, n]`` fp32 logits -> doubly stochastic ``comb`` (ends on a column step)."""
    c = logits.softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_mixes(
    h: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    linear=F.linear,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stats of the residual ``h [M, n, d]`` -> ``pre [M, n]``, ``post [M, n]``, ``comb [M, n, n]`` (fp32).

    ``linear`` computes the projection (callers may pass an order-pinned matmul).
    """
    n = h.shape[1]
    xf = h.flatten(1).float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    mix = linear(xf, fn) * rstd
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = (mix[:, 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
    return pre, post, sinkhorn(logits, iters, hc_eps)


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Weighted collapse of the streams: ``[M, n, d]`` x ``[M, n]`` -> bf16 ``[M, d]``."""
    return (pre.unsqueeze(-1) * h.float()).sum(1).to(h.dtype)


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New residual ``[M, n, d]`` from the sub-block output ``y [M, d]`` and the old streams ``res``."""
    out = post.unsqueeze(-1) * y.unsqueeze(1) + (comb.unsqueeze(-1) * res.unsqueeze(2)).sum(1)
    return out.to(y.dtype)
