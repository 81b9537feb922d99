"""Triton kernel of the WO-A family: inverse RoPE + grouped low-rank projection, token-major.

One program computes a ``[BM, BN]`` tile of ``z [M, G*R]``. A column tile lies in one
group ``g`` (``R % BN == 0``), so the program reduces over group ``g``'s ``K = HPG*D``
columns of ``o`` read in place, token-major. The reduction runs in two phases:

1. every ``BK``-chunk of the group that holds no rope dim, all heads: load, ``tl.dot``;
2. each head's last chunk (which holds its ``RD`` rope dims, ``RD <= BK``): load the
   chunk and its pair-swapped copy (column ``j`` pairs with ``j ^ 1``), de-rotate in
   fp32 (even ``y0 = x0*c + x1*s``, odd ``y1 = x1*c - x0*s``), round to bf16 like the
   reference, ``tl.dot``.

The kernel is built without FMA contraction, so the de-rotation's products and sums
round like the reference's (bitwise equal tails). Accumulation is fp32 with one bf16
rounding at the store. Configs with ``SPLIT`` > 1 (decode sizes, never in batch-invariant mode)
give each of SPLIT programs whole heads of the group and sum their fp32 partials in a fixed
order in a second kernel. Without split-K a row's arithmetic never depends on M or on other
rows; in batch-invariant mode the launch config is the fixed default, so a row's bits do not
depend on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import tactic
from ..wo_a import geometry, split_parts
from .common import INTERPRET, pdl_available, pdl_prologue, rne_bf16

# Configs worth timing per op (a tuner picks per M bucket; BN and BK are clipped to the shape).
CANDIDATES: dict[str, list[dict]] = {
    "wo_a": [
        dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in [
            (16, 16, 256, 4, 4), (16, 32, 256, 4, 4), (16, 64, 128, 4, 5), (32, 32, 256, 4, 4),
            (32, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
            (64, 128, 128, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
            (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
        ]
    ]
    + [dict(BM=bm, BN=128, BK=64, num_warps=4, num_stages=4, SPLIT=s) for bm in (16, 32) for s in (2, 4, 8)]
}

# Batch-invariant mode: one M-independent config for every token count.
BATCH_INVARIANT_CONFIG = dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4)


# Decode (M <= 16, outside batch-invariant mode): split-K over the group's heads, 8 parts. On the H200,
# run 27: 7.2 / 8.2 us at M = 1 / 16 vs 18.7 / 22.2 for the unsplit (16, 16, 256) kernel and 41 / 39 for
# the TileLang default of runs <= 26; cuBLAS bmm 7.8 / 7.8. The TileLang provider defers to it there.
SPLIT_K_MAX_M = 16
SPLIT_K_DECODE = dict(BM=16, BN=128, BK=64, num_warps=4, num_stages=4, SPLIT=8)


def default_config(m: int) -> dict:
    """Untuned choice by token count (decode: many narrow column tiles; prefill: big tensor-core tiles)."""
    if m <= SPLIT_K_MAX_M:
        return dict(SPLIT_K_DECODE)
    if m <= 64:
        return dict(BM=32, BN=32, BK=256, num_warps=4, num_stages=4)
    if m <= 512:
        return dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4)
    if m <= 4096:
        return dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4)
    return dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3)


def _pow2_divisor(x: int) -> int:
    return x & -x


def unsupported_reason(o: torch.Tensor, weight: torch.Tensor, rope_dim: int) -> str | None:
    """Why this kernel cannot take these shapes (None when it can). ``rope_dim`` 0: no RoPE."""
    _, _, d, _, r, _ = geometry(o, weight)
    if o.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return f"dtypes {o.dtype}/{weight.dtype} (kernel is bf16)"
    if r % 16:
        return f"o_rank {r} is not a multiple of 16"
    if d % 16:
        return f"head_dim {d} is not a multiple of 16"
    if rope_dim and _pow2_divisor(d) < max(16, triton.next_power_of_2(rope_dim)):
        return f"rope_dim {rope_dim} does not fit one power-of-two chunk of head_dim {d}"
    return None


def tactic_key(o: torch.Tensor, weight: torch.Tensor, rope_dim: int) -> tuple[str, dict]:
    """(op, shape key) under which this provider's tuned configs are stored (``rope_dim`` 0: no RoPE)."""
    _, _, d, g, r, k = geometry(o, weight)
    return "wo_a", dict(g=g, r=r, k=k, d=d, rd=rope_dim)


def _tile_sizes(cfg: dict, d: int, r: int, rope_dim: int) -> tuple[int, int]:
    """(BN, BK) of ``cfg`` clipped to the shape: BN divides R, BK divides D and holds the rope dims."""
    bn = min(cfg["BN"], _pow2_divisor(r))
    bk = min(cfg["BK"], _pow2_divisor(d))
    if rope_dim:
        bk = max(bk, triton.next_power_of_2(rope_dim))
    return bn, bk


@triton.jit(do_not_specialize=["M"])  # one binary for every token count (no M == 1 / M % 16 variants)
def _wo_a_kernel(
    o_ptr, w_ptr, cos_ptr, sin_ptr, z_ptr,
    M, stride_om, stride_wn, stride_cm, stride_ck, stride_sm, stride_sk, stride_zm,
    R: tl.constexpr, D: tl.constexpr, HPG: tl.constexpr, RD: tl.constexpr, N_TILES: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INTERP: tl.constexpr, SPLIT: tl.constexpr,
):
    # column tiles of one row tile run next to each other, so o's rows are re-read from L2
    pid = tl.program_id(0).to(tl.int64)
    pid_m = pid // N_TILES
    n0 = (pid % N_TILES) * BN
    g = n0 // R
    K: tl.constexpr = HPG * D
    HPS: tl.constexpr = HPG // SPLIT  # heads of the group this program reduces over (split-K part)
    h0 = tl.program_id(1) * HPS
    rows = pid_m * BM + tl.arange(0, BM)
    rmask = rows[:, None] < M
    cols = n0 + tl.arange(0, BN)
    kk = tl.arange(0, BK)
    a_base = o_ptr + rows[:, None] * stride_om + g * K + kk[None, :]  # [BM, BK] chunk at k0 = 0
    b_base = w_ptr + cols[None, :] * stride_wn + kk[:, None]  # [BK, BN] chunk of W^T at k0 = 0
    acc = tl.zeros((BM, BN), dtype=tl.float32)

    # phase 1: chunks without rope dims (all of them when RD == 0)
    CHUNKS: tl.constexpr = D // BK
    PLAIN: tl.constexpr = CHUNKS - 1 if RD > 0 else CHUNKS
    if PLAIN > 0:
        for t in range(0, HPS * PLAIN):
            k0 = (h0 + t // PLAIN) * D + (t % PLAIN) * BK
            a = tl.load(a_base + k0, mask=rmask, other=0.0)
            b = tl.load(b_base + k0)
            if INTERP:  # the interpreter computes bf16 on raw bits
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc)

    # phase 2: each head's last chunk, de-rotated in the prologue
    if RD > 0:
        j = kk  # column within the chunk; rope dims are j >= BK - RD
        is_rope = j >= BK - RD
        pair = tl.where(is_rope, (j - (BK - RD)) // 2, 0)
        cmask = rmask & is_rope[None, :]
        c = tl.load(cos_ptr + rows[:, None] * stride_cm + pair[None, :] * stride_ck, mask=cmask, other=0.0)
        s = tl.load(sin_ptr + rows[:, None] * stride_sm + pair[None, :] * stride_sk, mask=cmask, other=0.0)
        s = tl.where((j % 2 == 0)[None, :], s, -s)
        swap = (j ^ 1) - j  # column offset of each column's pair partner
        for h in range(0, HPS):
            k0 = (h0 + h) * D + (D - BK)
            x = tl.load(a_base + k0, mask=rmask, other=0.0).to(tl.float32)
            xp = tl.load(a_base + k0 + swap[None, :], mask=rmask, other=0.0).to(tl.float32)
            y = tl.where(is_rope[None, :], x * c + xp * s, x)
            y = rne_bf16(y, INTERP)  # the reference rounds the de-rotated tail to bf16
            b = tl.load(b_base + k0)
            if INTERP:
                b = b.to(tl.float32)
            else:
                y = y.to(tl.bfloat16)
            acc = tl.dot(y, b, acc)

    if SPLIT == 1:
        out = rne_bf16(acc, INTERP)
        tl.store(z_ptr + rows[:, None] * stride_zm + cols[None, :], out.to(z_ptr.dtype.element_ty), mask=rmask)
    else:  # fp32 partial sums [SPLIT, M, N] (stride_zm: the partial's row stride, N)
        part = z_ptr + tl.program_id(1).to(tl.int64) * M * stride_zm
        tl.store(part + rows[:, None] * stride_zm + cols[None, :], acc, mask=rmask)


@triton.jit(do_not_specialize=["MN"])
def _sum_splits_kernel(part_ptr, z_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr,
                       PDL: tl.constexpr):
    """``z = bf16(part[0] + part[1] + ... + part[SPLIT-1])``, always in that order."""
    pdl_prologue(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    mn = MN.to(tl.int64)  # part s starts at s * MN: past 2^31 elements at M = 65536, N = 8192, SPLIT = 8
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * mn + i, mask=ok, other=0.0)
    tl.store(z_ptr + i, rne_bf16(acc, INTERP).to(z_ptr.dtype.element_ty), mask=ok)


def wo_a(
    o: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rope_dim: int,
    *,
    batch_invariant: bool,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch the kernel; ``config`` overrides the tactic (for tuners and tests)."""
    m, h, d, g, r, _ = geometry(o, weight)
    n = g * r
    rd = rope_dim if cos is not None else 0
    why = unsupported_reason(o, weight, rd)
    if why:
        raise ValueError(f"wo_a (triton): {why}")
    z = torch.empty((m, n), dtype=o.dtype, device=o.device)
    if m == 0:
        return z
    if config is None:
        default = BATCH_INVARIANT_CONFIG if batch_invariant else default_config(m)
        op, key = tactic_key(o, weight, rd)
        config = tactic(op, m, key, default, batch_invariant=batch_invariant)
    bn, bk = _tile_sizes(config, d, r, rd)
    bm = config["BM"]
    n_tiles = n // bn
    split = split_parts(config.get("SPLIT", 1), h // g, batch_invariant, "triton")
    if cos is None:
        cos = sin = z  # never read (RD == 0)
    out = z if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=o.device)
    _wo_a_kernel[(triton.cdiv(m, bm) * n_tiles, split)](
        o, weight, cos, sin, out,
        m, o.stride(0), weight.stride(0), cos.stride(0), cos.stride(-1), sin.stride(0), sin.stride(-1), n,
        R=r, D=d, HPG=h // g, RD=rd, N_TILES=n_tiles, BM=bm, BN=bn, BK=bk, INTERP=INTERPRET, SPLIT=split,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
        enable_fp_fusion=False,  # no FMA contraction: the de-rotation rounds like the reference
    )
    return sum_splits(out, z) if split > 1 else z


@triton.jit
def _bf16_bits(y, INTERP: tl.constexpr):
    """fp32 -> its bf16 rounding (nearest even) as the low 16 bits of a uint32."""
    return rne_bf16(y, INTERP).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit(do_not_specialize=["M"])
def _rope_tails_kernel(
    o_ptr, cos_ptr, sin_ptr, t_ptr, M, stride_ow, stride_cm, stride_ck, stride_sm, stride_sk,
    H: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    INTERP: tl.constexpr, PDL: tl.constexpr,
):
    """``t[m, h, :] = o[m, h, D-BK:]`` with the last RD columns de-rotated (the rope chunks of the
    specialized TileLang kernel), ``BT`` tokens a program. o and t are read and written as 32-bit words,
    one (even, odd) bf16 pair each; the rounding is the GEMM kernels' (fp32, no FMA, one bf16 rounding)."""
    pdl_prologue(PDL)
    PW: tl.constexpr = BK // 2  # words of a head's last chunk
    t0 = tl.program_id(0).to(tl.int64) * BT
    row = t0 * H + tl.arange(0, BT * H)  # (token, head)
    tok = row // H
    rmask = tok[:, None] < M
    q = tl.arange(0, PW)
    is_rope = q >= (BK - RD) // 2
    pair = tl.where(is_rope, q - (BK - RD) // 2, 0)
    # cos/sin once a token, then broadcast over its heads
    t8 = t0 + tl.arange(0, BT)
    cmask = (t8[:, None] < M) & is_rope[None, :]
    c = tl.load(cos_ptr + t8[:, None] * stride_cm + pair[None, :] * stride_ck, mask=cmask, other=0.0)
    s = tl.load(sin_ptr + t8[:, None] * stride_sm + pair[None, :] * stride_sk, mask=cmask, other=0.0)
    c = tl.reshape(tl.broadcast_to(c[:, None, :], (BT, H, PW)), (BT * H, PW))
    s = tl.reshape(tl.broadcast_to(s[:, None, :], (BT, H, PW)), (BT * H, PW))
    src = o_ptr + tok[:, None] * stride_ow + ((row % H) * (D // 2) + (D - BK) // 2)[:, None] + q[None, :]
    w = tl.load(src, mask=rmask, other=0).to(tl.uint32, bitcast=True)
    x0 = (w << 16).to(tl.float32, bitcast=True)
    x1 = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
    y = (_bf16_bits(x1 * c - x0 * s, INTERP) << 16) | _bf16_bits(x0 * c + x1 * s, INTERP)
    out = tl.where(is_rope[None, :], y, w).to(tl.int32, bitcast=True)
    tl.store(t_ptr + row[:, None] * PW + q[None, :], out, mask=rmask)


# tokens a program of ``rope_tails`` (16 heads x 32 words: 2 KiB a token)
ROPE_TAILS_BT = 8


def rope_tails_tile(heads: int, bk: int) -> bool:
    """Whether ``rope_tails`` tiles ``heads`` chunks of ``bk`` columns a token (a power-of-two product)."""
    return heads * bk > 0 and not (heads * bk) & (heads * bk - 1)


def rope_tails(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, bk: int) -> torch.Tensor:
    """``[M, H, bk]`` bf16: each head's last ``bk`` columns of ``o [M, H, D]`` (contiguous), the last
    ``rope_dim`` of them de-rotated (fp32, one bf16 rounding, like the reference)."""
    m, h, d = o.shape
    if rope_dim % 2 or bk % 2 or not rope_dim <= bk <= d or not rope_tails_tile(h, bk) or not o.is_contiguous():
        raise ValueError(f"rope_tails: {h} heads x {bk} columns (rope {rope_dim}, head_dim {d}, contiguous "
                         f"{o.is_contiguous()}) do not tile")
    t = torch.empty((m, h, bk), dtype=o.dtype, device=o.device)
    if m == 0:
        return t
    words = o.view(m, h * d).view(torch.int32)
    pdl = pdl_available(o.device)
    _rope_tails_kernel[(triton.cdiv(m, ROPE_TAILS_BT),)](
        words, cos, sin, t.view(m, h * bk).view(torch.int32), m, words.stride(0),
        cos.stride(0), cos.stride(-1), sin.stride(0), sin.stride(-1),
        H=h, D=d, RD=rope_dim, BK=bk, BT=ROPE_TAILS_BT, INTERP=INTERPRET, PDL=pdl, num_warps=4,
        enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}),
    )
    return t


def sum_splits(part: torch.Tensor, z: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``z = bf16(part[0] + ... + part[S-1])`` summed in that order (``part [S, M, N]`` fp32, contiguous).
    ``pdl``: launched by programmatic dependent launch where available (``common.pdl_available``), so its grid
    can start while the kernel that wrote ``part`` finishes; it waits for that kernel's writes first."""
    s, m, n = part.shape
    block = 1024
    pdl = pdl and pdl_available(part.device)
    _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, z, m * n, SPLIT=s, BLOCK=block, INTERP=INTERPRET,
                                                      PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return z
