"""FP8 (e4m3) quantize-dequantize with UE8M0 per-block scales, and FP8 and MXFP4 weight dequantization.

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


def dequant_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize an FP8 block-quantized weight ``[N, K]`` with a ``[ceil(N/bn), ceil(K/bk)]`` scale.

    ``scale`` may be fp32 or e8m0 (``float8_e8m0fnu``); the products are fp32, rounded once to ``dtype``.
    """
    bn, bk = block
    n, k = weight.shape
    sn, sk = -(-n // bn), -(-k // bk)
    if tuple(scale.shape) != (sn, sk):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {n}x{k} in blocks {bn}x{bk}")
    s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * s).to(dtype)


# e2m1 code -> value: sign bit 3, then the 8 magnitudes of 2 exponent bits and 1 mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32


def dequant_mxfp4_weight(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                         ) -> torch.Tensor:
    """Dequantize an MXFP4 weight (the V4.1 checkpoints' routed experts): ``packed`` int8/uint8 ``[N, K/2]``, two e2m1
    codes a byte, element ``2i`` in the low nibble and ``2i + 1`` in the high one; ``scale`` ``[N, K/32]`` (e8m0 or
    fp32), one a row per 32 columns (the layout DeepSeek's ``inference/convert.py`` unpacks in
    ``cast_e2m1fn_to_e4m3fn``). A code times a power-of-two scale is exact in bf16 (within its range)."""
    n, half = packed.shape
    k = 2 * half
    if k % MXFP4_BLOCK or tuple(scale.shape) != (n, k // MXFP4_BLOCK):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match an MXFP4 weight {n}x{k} "
                         f"(packed {n}x{half}) in blocks of {MXFP4_BLOCK}")
    b = packed.view(torch.uint8).long()
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    w = torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).reshape(n, k)
    return (w * scale.float().repeat_interleave(MXFP4_BLOCK, 1)).to(dtype)
