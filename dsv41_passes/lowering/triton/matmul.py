"""A fixed-tile batched matmul for batch-invariant mode.

One config for every shape: no split-K, K walked in BLOCK_K steps in order,
fp32 accumulation, one rounding at the store. A row's arithmetic depends only on
K and the tile config, never on M or on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, rne_bf16

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit(do_not_specialize=["M"])
def _bmm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    bid = tl.program_id(0).to(tl.int64)  # batch on grid x: up to 2^31 - 1 (attention batches by token)
    rm = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(2).to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(a_ptr + bid * sab + rm[:, None] * sam + kk[None, :] * sak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + bid * sbb + kk[:, None] * sbk + rn[None, :] * sbn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if INTERP:
            # the interpreter computes bf16 on raw bits, and its dot (numpy's matmul, i.e. the CPU's BLAS) can
            # round a row differently by its place in the tile (seen on an AVX2 machine): products and a sum over
            # the tile's K instead, the same for every row
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    acc = rne_bf16(acc, ROUND_BF16)
    tl.store(c_ptr + bid * scb + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def fixed_tile_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a [B, M, K] @ b [B, K, N]`` with the one fixed config."""
    bsz, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((bsz, m, n), dtype=a.dtype, device=a.device)
    if c.numel() == 0:
        return c
    grid = (bsz, triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _bmm_kernel[grid](
        a, b, c, m, n, k,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, IEEE=a.dtype == torch.float32, INTERP=INTERPRET,
        ROUND_BF16=INTERPRET and a.dtype == torch.bfloat16,
        num_warps=4,
    )
    return c
