"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The CPU interpreter truncates fp32 -> bf16 stores; kernels round explicitly there so
# interpreted results carry the same round-to-nearest-even bits the GPU produces.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def rne_bf16(x, INTERP: tl.constexpr):
    """fp32 -> fp32 holding the bf16 round-to-nearest-even value (identity on GPU, where stores round)."""
    if INTERP:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _halve(t, R: tl.constexpr, W: tl.constexpr):
    a, b = tl.split(tl.reshape(t, (R, W // 2, 2)))
    return a + b


@triton.jit
def pairwise_row_sum(t, R: tl.constexpr, W: tl.constexpr):
    """``[R, W] -> [R]`` (W a power of two <= 1024): adjacent pairs, then pairs of those, ...; the order
    is fixed by the shape, never by the register layout (``tl.sum``'s follows the layout)."""
    tl.static_assert(W <= 1024, "pairwise_row_sum takes at most 1024 columns")
    for i in tl.static_range(10):  # widths W, W/2, ..., 2 (unrolled at compile time)
        if (W >> i) >= 2:
            t = _halve(t, R, W >> i)
    return tl.reshape(t, (R,))
