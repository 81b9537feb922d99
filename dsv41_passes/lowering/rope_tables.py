"""RoPE table layouts shared by the kernels of several families."""

from __future__ import annotations

import torch


def interleaved_view(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``[M, rd]`` fp32 view with (cos, sin) of each pair side by side, when the two ``[M, rd/2]``
    tables already interleave in memory (the real view of a complex table, as the model's
    ``freqs_cis`` gives them); None otherwise. Its row stride is the tables' row stride."""
    if (
        cos.dim() == 2
        and cos.dtype == sin.dtype == torch.float32
        and cos.shape == sin.shape
        and cos.stride() == sin.stride()
        and cos.stride(1) == 2
        and sin.data_ptr() == cos.data_ptr() + cos.element_size()
    ):
        return cos.as_strided((cos.shape[0], 2 * cos.shape[1]), (cos.stride(0), 1))
    return None
