"""FP8 (e4m3) quantize-dequantize with UE8M0 per-block scales, and FP8 weight dequantization.

The activation rule of DeepSeek's ``act_quant(..., inplace=True)``: per block of
``block`` elements along the last dim, ``amax = max(|x|, 1e-4)``, the scale is the
power of two ``2 ** ceil(log2(amax / 448))``, values are ``clamp(x / s, ±448)``
rounded to e4m3 and multiplied back by ``s``. With power-of-two scales every
step except the e4m3 rounding is exact, so the result is bf16-exact.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale ``2 ** ceil(log2(amax / 448))`` (fp32)."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(AMAX_FLOOR) / FP8_MAX)))


def fp8_block_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8-e4m3 round trip with UE8M0 scales over blocks of ``block`` along the last dim."""
    xf = x.float().unflatten(-1, (-1, block))
    scale = ue8m0_scale(xf.abs().amax(-1, keepdim=True))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).flatten(-2).to(x.dtype)


def dequant_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Dequantize an FP8 block-quantized weight ``[N, K]`` with a ``[ceil(N/bn), ceil(K/bk)]`` scale.

    ``scale`` may be fp32 or e8m0 (``float8_e8m0fnu``); the result is bf16.
    """
    bn, bk = block
    n, k = weight.shape
    sn, sk = -(-n // bn), -(-k // bk)
    if tuple(scale.shape) != (sn, sk):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {n}x{k} in blocks {bn}x{bk}")
    s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * s).to(torch.bfloat16)
