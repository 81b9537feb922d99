"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl

# The CPU interpreter truncates fp32 -> bf16 stores; kernels round explicitly there so
# interpreted results carry the same round-to-nearest-even bits the GPU produces.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:  # programmatic dependent launch (Hopper): Triton's grid-dependency control, where this Triton has it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton
    gdc_wait = gdc_launch_dependents = None
# A kernel launched with ``launch_pdl=True`` must call ``gdc_wait()`` before it touches global memory.
PDL_SUPPORTED = gdc_wait is not None and not INTERPRET


def overlaps(a, b) -> bool:
    """Whether the memory ``a`` spans intersects the memory ``b`` spans (same storage, byte ranges from the first
    to the last element; conservative for interleaved views): a kernel that writes ``b`` tile by tile while other
    programs still read ``a`` needs a copy of ``a`` then."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """PDL (the launch passes ``launch_pdl=True``): let the next kernel's grid launch now, then wait until
    the previous kernel's writes are complete and visible, before any global access."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


def pdl_available(device) -> bool:
    """Whether a kernel on ``device`` is launched with PDL where its config asks for it: this Triton has
    grid-dependency control, the device is a Hopper or newer GPU (``griddepcontrol`` is sm_90+), and
    ``DSV41_PDL`` is not ``off`` (``0``, ``false``, ``no``; read at every launch)."""
    if not PDL_SUPPORTED or device.type != "cuda":
        return False
    if os.environ.get("DSV41_PDL", "on").lower() in ("off", "0", "false", "no"):
        return False
    return _capability(device.index if device.index is not None else 0) >= (9, 0)


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
