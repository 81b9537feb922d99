"""Triton kernels of the RoPE/store family: the Q path, and the bit-level helpers both paths use.

``q_rope_store``: one program per (token block, head group); each (token, head) row is
read once from ``q`` and written once into the padded buffer, the last ``rd`` dims rotated.
The KV path (``kv_rope_quant``) is in ``kv_rope_quant.py``.

bf16 data moves as int32 words holding an (even, odd) pair, which is exactly a RoPE pair:
unpacking to fp32 is a shift, packing is an integer round-to-nearest-even, and words
outside the rotated tail are copied bit for bit. Numerics follow the reference rounding
points exactly: products and sums are rounded one by one (``enable_fp_fusion=False``: no
FMA contraction), intermediate bf16 roundings are explicit, 1/sqrt and divisions are
IEEE-rounded, and the FP8 scale exponent and the e4m3 rounding are integer operations on
the fp32 bits. On a GPU the bf16 and e4m3 roundings are the hardware conversions
(``cvt.rn.bf16.f32``, ``cvt.rn.satfinite.e4m3x2.f32``: round to nearest even, the rule the
bit-level helpers implement for the interpreter, whose own casts do not round that way).
Interpreted (CPU) and GPU runs therefore give the same bits.

M is a runtime argument (``do_not_specialize``), every offset that involves the token
index is int64 (a padded Q buffer of 65536 x 64 x 512 bf16 is 4 GiB), and per-row
arithmetic never depends on M or on the launch grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import tactic
from .common import overlaps

# Launch configs worth timing per op (the tuner's search space). The batch-invariant defaults are M-independent.
Q_DEFAULT = dict(BLOCK_T=1, BLOCK_H=4, num_warps=4)
CANDIDATES: dict[str, list[dict]] = {
    "q_rope_store": [
        dict(BLOCK_T=t, BLOCK_H=h, num_warps=w)
        for t in (1, 2, 4)
        for h in (1, 2, 4, 8)
        for w in (2, 4, 8)
        if t * h <= 16
    ],
}


@triton.jit
def _unpack_bf16x2(w):
    """uint32 words holding bf16 pairs (little endian) -> (even, odd) elements as fp32, exactly."""
    return (w << 16).to(tl.float32, bitcast=True), (w & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_f32x2(w):
    """int64 words holding fp32 pairs (little endian) -> (low, high) elements as fp32, exactly."""
    return ((w & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True),
            ((w >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True))


@triton.jit
def _bf16_bits(x):
    """fp32 -> uint32 whose high half is the round-to-nearest-even bf16 of ``x`` (low half zero)."""
    b = x.to(tl.uint32, bitcast=True)
    return (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000


@triton.jit
def _round_bf16(x, HW: tl.constexpr):
    """fp32 -> fp32 holding the round-to-nearest-even bf16 value (for values reused after rounding).
    HW: the GPU's conversion (``cvt.rn.bf16.f32``); otherwise on the bits (the interpreter truncates)."""
    if HW:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return _bf16_bits(x).to(tl.float32, bitcast=True)


@triton.jit
def _pack_bf16x2(y0, y1, HW: tl.constexpr):
    """(even, odd) fp32 -> uint32 words of two round-to-nearest-even bf16 (HW: as ``_round_bf16``)."""
    if HW:
        lo = y0.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        hi = y1.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        return lo | (hi << 16)
    else:
        return (_bf16_bits(y0) >> 16) | _bf16_bits(y1)


@triton.jit
def _cvt_bf16x2(y0, y1):
    """GPU only: (even, odd) fp32 -> uint32 words of two round-to-nearest-even bf16, one
    ``cvt.rn.bf16x2.f32`` per word (the scalar conversions plus the packing take three)."""
    return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [y0, y1],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _pack_words(y0, y1, HW: tl.constexpr):
    """``_pack_bf16x2`` as int32 words; HW: one ``cvt.rn.bf16x2.f32`` a word (the same bits)."""
    if HW:
        return _cvt_bf16x2(y0, y1).to(tl.int32, bitcast=True)
    else:
        return _pack_bf16x2(y0, y1, HW).to(tl.int32, bitcast=True)


@triton.jit
def _round_bf16_pair(y0, y1, HW: tl.constexpr):
    """``_round_bf16`` of both halves of a pair; HW: through one packed conversion."""
    if HW:
        return _unpack_bf16x2(_cvt_bf16x2(y0, y1))
    else:
        return _round_bf16(y0, HW), _round_bf16(y1, HW)


@triton.jit
def _rotate(x0, x1, c, s, rot):
    """Interleaved pair rotation where ``rot`` holds, identity elsewhere; products rounded one by one."""
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    return tl.where(rot, y0, x0), tl.where(rot, y1, x1)


@triton.jit
def _ue8m0_exponent(amax):
    """``ceil(log2(max(amax, 1e-4) / 448))`` computed exactly from the fp32 bits of ``amax``.

    With ``a = 2^e * (1 + f)`` and ``448 = 1.75 * 2^8``: ``448 * 2^k >= a`` first holds at
    ``k = e - 8`` when ``f <= 0.75`` and at ``k = e - 7`` otherwise. (For bf16-valued amax this
    is also what ``torch.log2`` + ``ceil`` give: ``a / 448`` is then a power of two or at least
    0.4% away from one.)
    """
    a = tl.maximum(amax, 1e-4)
    u = a.to(tl.int32, bitcast=True)
    e = ((u >> 23) & 0xFF) - 127
    return e - 8 + ((u & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def _pow2(k):
    """2^k as fp32 for an int32 k in the normal range."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rne(v):
    """Round fp32 ``v`` (|v| <= 448) to the nearest e4m3fn value, ties to even, on the bits; a NaN
    stays NaN and an infinity infinite (the hardware conversion saturates it to 448, and the block's
    scale of 2^120 then gives the same infinity)."""
    u = v.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    mag = u & 0x7FFFFFFF
    ef = mag >> 23
    # normal e4m3 (|v| >= 2^-6): keep 3 mantissa bits (a carry moves into the exponent)
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000
    # subnormal e4m3 (|v| < 2^-6): a multiple n of 2^-9, n = rne(|v| * 2^9)
    mant = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - ef.to(tl.int32), 31).to(tl.uint32)
    n = (mant + ((1 << (shift - 1)) - 1) + ((mant >> shift) & 1)) >> shift
    n = tl.where(ef == 0, 0, n)
    sub = (n.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    mag_q = tl.where(ef >= 121, normal, sub)
    return tl.where(mag > 0x7F800000, v, (sign | mag_q).to(tl.float32, bitcast=True))


@triton.jit
def _to_e4m3(v, HW: tl.constexpr):
    """fp32 (|v| <= 448) -> nearest e4m3fn value as fp32, ties to even: the hardware conversion
    (``cvt.rn.satfinite``) on a GPU, the same rounding on the bits under the interpreter."""
    if HW:
        return v.to(tl.float8e4nv).to(tl.float32)
    else:
        return _e4m3_rne(v)


@triton.jit
def _fp8_qdq_pairs(z0, z1, HW: tl.constexpr):
    """FP8-e4m3 round trip of a block split into its even ``z0`` and odd ``z1`` elements.

    ``z0``, ``z1``: ``[A, NB, BLOCK/2]``; one UE8M0 scale per ``[a, nb]`` block (both halves).
    ``448 * 2^k >= amax`` exactly, so a scaled finite value never exceeds 448 in magnitude and the
    reference's clamp to +-448 never changes a result; it is left out. A NaN element stays NaN (a
    clamp would turn it into +-448 * scale, a finite value; the reference's NaN amax makes its whole
    block NaN, here the scale comes from the block's other elements) and +-inf stays +-inf.
    """
    amax = tl.maximum(tl.max(tl.abs(z0), axis=2), tl.max(tl.abs(z1), axis=2))
    k = _ue8m0_exponent(amax)
    inv_scale = tl.expand_dims(_pow2(-k), 2)
    scale = tl.expand_dims(_pow2(k), 2)
    return _to_e4m3(z0 * inv_scale, HW) * scale, _to_e4m3(z1 * inv_scale, HW) * scale


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A bf16 tensor viewed as int32 words of two elements (the providers check it can be)."""
    return t.view(torch.int32)


# ---------------------------------------------------------------------------
# Q: RoPE on the tail, store into the head-padded buffer
# ---------------------------------------------------------------------------
@triton.jit(do_not_specialize=["M"])
def _q_rope_store_kernel(
    q_ptr, buf_ptr, cos_ptr, sin_ptr, M, H,
    stride_qm, stride_qh, stride_bm, stride_bh, stride_cm, stride_cp, stride_sm, stride_sp,
    W: tl.constexpr, PAIR0: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # rows = (token, head) pairs of this program; columns = one head as W int32 words (bf16 pairs);
    # q/buf pointers and strides are in words
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + r // BLOCK_H
    h = tl.program_id(1) * BLOCK_H + r % BLOCK_H
    row_ok = (t < M) & (h < H)
    col = tl.arange(0, BLOCK_W)
    mask = row_ok[:, None] & (col < W)[None, :]
    w = tl.load(q_ptr + t[:, None] * stride_qm + h[:, None] * stride_qh + col[None, :], mask=mask, other=0)
    w = w.to(tl.uint32, bitcast=True)
    p = col - PAIR0  # index into the rope tables
    rot = row_ok[:, None] & ((p >= 0) & (p < W - PAIR0))[None, :]
    c = tl.load(cos_ptr + t[:, None] * stride_cm + p[None, :] * stride_cp, mask=rot, other=0.0)
    s = tl.load(sin_ptr + t[:, None] * stride_sm + p[None, :] * stride_sp, mask=rot, other=0.0)
    x0, x1 = _unpack_bf16x2(w)
    y0, y1 = _rotate(x0, x1, c, s, rot)
    out = tl.where(rot, _pack_bf16x2(y0, y1, False), w)  # un-rotated words are copied bit for bit
    tl.store(buf_ptr + t[:, None] * stride_bm + h[:, None] * stride_bh + col[None, :],
             out.to(tl.int32, bitcast=True), mask=mask)


def q_shape_key(q: torch.Tensor, cos: torch.Tensor) -> dict:
    return dict(h=q.shape[1], d=q.shape[2], rd=2 * cos.shape[1])


def q_rope_store(
    q_buf: torch.Tensor, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, batch_invariant: bool,
    config: dict | None = None,
):
    """Launch with the tactic for this M (or an explicit ``config``, e.g. from a tuner)."""
    m, h, d = q.shape
    if m == 0:
        return
    if overlaps(q, q_buf) and not (q.data_ptr() == q_buf.data_ptr() and q.stride() == q_buf.stride()):
        q = q.clone()  # q inside the buffer at other positions: other programs would read rows already written
    rd = 2 * cos.shape[1]
    cfg = config or tactic("q_rope_store", m, q_shape_key(q, cos), default=Q_DEFAULT, batch_invariant=batch_invariant)
    block_h = min(cfg["BLOCK_H"], triton.next_power_of_2(h))
    block_t = cfg["BLOCK_T"]
    qw, bw = as_words(q), as_words(q_buf)
    grid = (triton.cdiv(m, block_t), triton.cdiv(h, block_h))
    _q_rope_store_kernel[grid](
        qw, bw, cos, sin, m, h,
        qw.stride(0), qw.stride(1), bw.stride(0), bw.stride(1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        W=d // 2, PAIR0=(d - rd) // 2, BLOCK_W=triton.next_power_of_2(d // 2),
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=cfg["num_warps"], enable_fp_fusion=False,
    )
