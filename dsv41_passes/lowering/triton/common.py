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
