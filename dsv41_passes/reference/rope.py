"""Rotary position tables and the interleaved (GPT-J) rotation of DeepSeek-V4.1.

Each layer owns one table: compress ratio 0 layers use ``rope_theta`` without
YaRN; compressed layers use ``compress_rope_theta`` with YaRN (no mscale). The
table is complex64 ``[max_pos, rope_dim // 2]`` and is gathered by absolute
position. The rotation runs in fp32 and rounds once to the input dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original: int) -> tuple[int, int]:
    low = math.floor(_correction_dim(beta_fast, dim, base, original))
    high = math.ceil(_correction_dim(beta_slow, dim, base, original))
    return max(low, 0), min(high, dim - 1)


def inv_frequencies(rope_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """fp32 ``[rope_dim // 2]`` inverse frequencies, YaRN-interpolated when ``scaling`` is given."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if scaling:
        original = int(scaling["original_max_position_embeddings"])
        factor = float(scaling["factor"])
        low, high = yarn_correction_range(
            float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1)), rope_dim, base, original
        )
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_table(rope_dim: int, max_pos: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """complex64 ``[max_pos, rope_dim // 2]`` = ``polar(1, pos * inv_freq)``."""
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_frequencies(rope_dim, base, scaling))
    return torch.polar(torch.ones_like(freqs), freqs)


def layer_rope_params(config: Any, layer_id: int) -> tuple[float, dict[str, Any] | None]:
    """(base, yarn scaling or None) for one layer, by its compress ratio."""
    if config.compress_ratios[layer_id] == 0:
        return float(config.rope_theta), None
    return float(config.compress_rope_theta), config.rope_scaling


def apply_rotary_complex(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """DeepSeek's spelling: ``view_as_complex`` times the table, ``view_as_real``.

    ``x`` is ``[M, ..., rope_dim]`` (any float dtype), ``freqs_cis`` complex
    ``[M, rope_dim // 2]``; the result has ``x``'s dtype.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    f = freqs_cis.view(freqs_cis.shape[0], *([1] * (x.dim() - 2)), freqs_cis.shape[-1])
    if inverse:
        f = f.conj()
    return torch.view_as_real(xc * f).flatten(-2).to(x.dtype)


def apply_rotary_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """The real cos/sin spelling of the same interleaved rotation.

    ``cos``/``sin`` are fp32 ``[M, rope_dim // 2]``.
    """
    shape = (cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[-1])
    c, s = cos.view(shape), sin.view(shape)
    if inverse:
        s = -s
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    return torch.stack((y0, y1), dim=-1).flatten(-2).to(x.dtype)
