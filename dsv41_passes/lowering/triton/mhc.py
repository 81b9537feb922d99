"""Triton kernels of the mHC family.

All kernels upcast right after loading (the CPU interpreter computes bf16 on raw
bits) and keep per-row arithmetic independent of the launch grid: a row's bits
never depend on M or on the other rows. M is a runtime argument everywhere (one
binary serves every token count); offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import tactic
from .common import INTERPRET, rne_bf16


@triton.jit
def _mhc_post_kernel(
    y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr,
    stride_y, stride_r, stride_o,
    D: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr,
):
    # one program = one token x BLOCK_D hidden columns, all 4 streams
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    rbase = res_ptr + row * stride_r + cols
    r0 = tl.load(rbase, mask=mask, other=0.0).to(tl.float32)
    r1 = tl.load(rbase + D, mask=mask, other=0.0).to(tl.float32)
    r2 = tl.load(rbase + 2 * D, mask=mask, other=0.0).to(tl.float32)
    r3 = tl.load(rbase + 3 * D, mask=mask, other=0.0).to(tl.float32)
    cbase = comb_ptr + row * 16
    for k in tl.static_range(4):
        # out_k = post_k * y + sum_j comb[j, k] * res_j, summed in stream order
        acc = tl.load(cbase + k) * r0
        acc += tl.load(cbase + 4 + k) * r1
        acc += tl.load(cbase + 8 + k) * r2
        acc += tl.load(cbase + 12 + k) * r3
        out = rne_bf16(tl.load(post_ptr + row * 4 + k) * y + acc, INTERP)
        tl.store(out_ptr + row * stride_o + k * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def mhc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *, batch_invariant: bool):
    m, n, d = res.shape
    assert n == 4, "the Triton mhc_post kernel is written for hc_mult 4"
    res = res if res.stride(1) == d and res.stride(2) == 1 else res.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    post, comb = post.contiguous(), comb.contiguous()
    out = torch.empty((m, n, d), dtype=res.dtype, device=res.device)
    if m == 0:
        return out
    cfg = tactic("mhc_post", m, dict(d=d), default=dict(BLOCK_D=1024, num_warps=4), batch_invariant=batch_invariant)
    block = min(cfg["BLOCK_D"], triton.next_power_of_2(d))
    _mhc_post_kernel[(m, triton.cdiv(d, block))](
        y, res, post, comb, out, y.stride(0), res.stride(0), out.stride(0),
        D=d, BLOCK_D=block, INTERP=INTERPRET, num_warps=cfg["num_warps"],
    )
    return out
