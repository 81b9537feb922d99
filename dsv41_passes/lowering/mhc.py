"""mHC fused ops (namespace ``dsv41``): custom ops, fake implementations, reference providers.

``mhc_post(y, res, post, comb) -> new_res``
    ``new_res[:, k] = post[:, k] * y + sum_j comb[:, j, k] * res[:, j]`` in fp32, one bf16 rounding.
"""

from __future__ import annotations

import torch

from ..reference import mhc as ref
from .registry import dispatch, register_provider, triton_available

HC_MAX = 8


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_post_args(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    """Clear errors for inputs a fused post cannot take (eager calls; the pass checks the same before rewriting)."""
    _check(res.dim() == 3, f"mhc_post: res must be [M, hc_mult, hidden], got {tuple(res.shape)}")
    m, n, d = res.shape
    _check(1 <= n <= HC_MAX, f"mhc_post: hc_mult must be in [1, {HC_MAX}], got {n}")
    _check(tuple(y.shape) == (m, d), f"mhc_post: y must be [M, hidden] = {(m, d)}, got {tuple(y.shape)}")
    _check(tuple(post.shape) == (m, n), f"mhc_post: post must be [M, hc_mult] = {(m, n)}, got {tuple(post.shape)}")
    _check(tuple(comb.shape) == (m, n, n), f"mhc_post: comb must be [M, n, n] = {(m, n, n)}, got {tuple(comb.shape)}")
    _check(y.dtype == res.dtype and y.dtype in (torch.bfloat16, torch.float16, torch.float32),
           f"mhc_post: y and res must share a float dtype, got {y.dtype} and {res.dtype}")
    _check(post.dtype == torch.float32 and comb.dtype == torch.float32,
           f"mhc_post: post and comb must be float32, got {post.dtype} and {comb.dtype}")
    devs = {t.device for t in (y, res, post, comb)}
    _check(len(devs) == 1, f"mhc_post: all inputs must be on one device, got {sorted(map(str, devs))}")


@torch.library.custom_op("dsv41::mhc_post", mutates_args=())
def mhc_post(
    y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, providers: str, mode: int
) -> torch.Tensor:
    check_post_args(y, res, post, comb)
    return dispatch("mhc_post", providers, mode, y, res, post, comb)


@mhc_post.register_fake
def _mhc_post_fake(y, res, post, comb, providers, mode):
    return res.new_empty(res.shape)


@register_provider("mhc_post", "reference")
def _mhc_post_reference(y, res, post, comb, *, batch_invariant):
    return ref.hc_post(y, res, post, comb).contiguous()


def _mhc_post_triton_ok(y, res, post, comb, *, batch_invariant):
    why = triton_available(res)
    if why:
        return why
    if res.dtype != torch.bfloat16:
        return f"residual dtype {res.dtype} (kernel is bf16)"
    if res.stride(-1) != 1 or y.stride(-1) != 1:
        return "hidden dim not contiguous"
    return None


@register_provider("mhc_post", "triton", _mhc_post_triton_ok)
def _mhc_post_triton(y, res, post, comb, *, batch_invariant):
    from .triton import mhc as tk

    return tk.mhc_post(y, res, post, comb, batch_invariant=batch_invariant)
