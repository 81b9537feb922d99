"""Batch-invariant matmuls (namespace ``dsv41``), used only in batch-invariant mode.

Library GEMMs pick kernels and reduction orders by problem size (MKL and cuBLAS
both do), so a row's result can change with M. In batch-invariant mode the pass
manager routes every remaining ``mm`` / ``addmm`` / ``bmm`` through these ops,
whose per-row arithmetic depends only on K:

* ``reference``: fp32 accumulation over K in index order, one multiply and one
  add per step as separate correctly rounded ops (no fused-multiply-add that a
  vectorised body and a scalar tail could apply differently), then one rounding
  to the output dtype. Slow (K steps of elementwise work) and exact in its
  order: meant for CPU tests and as the last resort.
* ``triton``: fixed tiles, no split-K, fp32 accumulation (``ieee`` for fp32 inputs).
"""

from __future__ import annotations

import torch

from .registry import dispatch, one_device, register_provider, triton_available

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _check_mm(a: torch.Tensor, b: torch.Tensor, batched: bool) -> None:
    rank = 3 if batched else 2
    if a.dim() != rank or b.dim() != rank:
        raise ValueError(
            f"bi_{'b' if batched else ''}mm: operands must be {rank}-D, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-2] or (batched and a.shape[0] != b.shape[0]):
        raise ValueError(f"bi_{'b' if batched else ''}mm: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    if a.dtype != b.dtype or a.dtype not in _FLOATS:
        raise ValueError(f"bi matmul: operands must share a float dtype, got {a.dtype} and {b.dtype}")
    one_device(f"bi_{'b' if batched else ''}mm", a, b)


@torch.library.custom_op("dsv41::bi_mm", mutates_args=())
def bi_mm(a: torch.Tensor, b: torch.Tensor, providers: str, mode: int) -> torch.Tensor:
    _check_mm(a, b, batched=False)
    return dispatch("bi_mm", providers, mode, a, b)


@bi_mm.register_fake
def _bi_mm_fake(a, b, providers, mode):
    one_device("bi_mm", a, b)
    return a.new_empty((a.shape[0], b.shape[1]))


@torch.library.custom_op("dsv41::bi_bmm", mutates_args=())
def bi_bmm(a: torch.Tensor, b: torch.Tensor, providers: str, mode: int) -> torch.Tensor:
    _check_mm(a, b, batched=True)
    return dispatch("bi_bmm", providers, mode, a, b)


@bi_bmm.register_fake
def _bi_bmm_fake(a, b, providers, mode):
    one_device("bi_bmm", a, b)
    return a.new_empty((a.shape[0], a.shape[1], b.shape[2]))


def ordered_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D or batched 3-D) with fp32 accumulation over K in index order."""
    af, bf = a.float(), b.float()
    acc = torch.zeros((*a.shape[:-1], b.shape[-1]), dtype=torch.float32, device=a.device)
    for k in range(a.shape[-1]):
        acc = torch.add(acc, torch.mul(af[..., k : k + 1], bf[..., k : k + 1, :]))
    return acc.to(a.dtype)


@register_provider("bi_mm", "reference")
def _bi_mm_reference(a, b, *, batch_invariant):
    return ordered_matmul(a, b)


@register_provider("bi_bmm", "reference")
def _bi_bmm_reference(a, b, *, batch_invariant):
    return ordered_matmul(a, b)


def _triton_ok(a, b, *, batch_invariant):
    return triton_available(a)


@register_provider("bi_mm", "triton", _triton_ok)
def _bi_mm_triton(a, b, *, batch_invariant):
    from .triton import matmul as tk

    return tk.fixed_tile_matmul(a.unsqueeze(0), b.unsqueeze(0))[0]


@register_provider("bi_bmm", "triton", _triton_ok)
def _bi_bmm_triton(a, b, *, batch_invariant):
    from .triton import matmul as tk

    return tk.fixed_tile_matmul(a, b)
