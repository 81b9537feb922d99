"""Triton kernels of the RoPE/store family.

``q_rope_store``: one program per (token block, head group); each (token, head) row is
read once from ``q`` and written once into the padded buffer, the last ``rd`` dims rotated.
``kv_rope_quant``: one program per block of tokens (four; one at decode sizes): RMSNorm, RoPE on
the tail, FP8-e4m3 round trip with UE8M0 per-block scales; stores the result and, for
``kv_rope_quant_store``, also the cache row picked by the token's slot. On a GPU the bf16
and e4m3 roundings are the hardware conversions (``cvt.rn.bf16.f32``,
``cvt.rn.satfinite.e4m3x2.f32``: round to nearest even, the rule the bit-level helpers
implement for the interpreter, whose own casts do not round that way); they take about 40%
of the instructions out of this issue-bound kernel (sm_90 PTX, BLOCK_T 4: 72 -> 43 per element).

bf16 data moves as int32 words holding an (even, odd) pair, which is exactly a RoPE pair:
unpacking to fp32 is a shift, packing is an integer round-to-nearest-even, and words
outside the rotated tail are copied bit for bit. Numerics follow the reference rounding
points exactly: products and sums are rounded one by one (``enable_fp_fusion=False``: no
FMA contraction), intermediate bf16 roundings are explicit, 1/sqrt and divisions are
IEEE-rounded, and the FP8 scale exponent and the e4m3 rounding are integer operations on
the fp32 bits. Interpreted (CPU) and GPU runs therefore give the same bits; the only
operation whose order can differ from torch's is the RMSNorm sum of squares.

The ``tail`` config option (``tail=True``; in ``KV_DEFAULT`` and ``KV_SMALL_M``) computes the same
bits with fewer instructions: the norm as without it, then the quant blocks before the rotated ones
are split off in registers and quantized with no RoPE work or second bf16 rounding, the RoPE runs on
the other half only (``kv_tail_halvings``), bf16 roundings and the packing are one
``cvt.rn.bf16x2.f32`` a pair, the never-binding upper FP8 clamp is left out and 8-byte aligned norm
weights are read as pairs. sm_90 PTX instructions a thread, D 512 / rd 64, 4 warps: BLOCK_T 4
650 -> 508 (SASS 649 -> 524), BLOCK_T 8 1218 -> 951. On the H200 it took M = 4096 from 5.2 to 4.1 us
and left 16384 / 65536 unchanged (run 28); four tokens on 2 warps, the untuned config past 8192
tokens, measured faster without it, so both paths stay.

M is a runtime argument (``do_not_specialize``), every offset that involves the token
index is int64 (a padded Q buffer of 65536 x 64 x 512 bf16 is 4 GiB), and per-row
arithmetic never depends on M or on the launch grid. It can depend on the launch config in one
place: the KV sum of squares (``tl.sum``) follows the register layout, so on the GPU a row's bits
may change with BLOCK_T / num_warps. Batch-invariant mode always runs ``KV_DEFAULT``; outside it
the untuned config depends on M (``kv_untuned_config``). The ``sum="tree"`` config option makes
the sum a fixed pairwise tree (layout-independent); it measured 1-13% slower than ``tl.sum``
on the H200 (run 28), so it is not the default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import tactic
from ..rope_tables import interleaved_view
from .common import INTERPRET, pairwise_row_sum

# Launch configs worth timing per op (the tuner's search space). The batch-invariant defaults are M-independent.
Q_DEFAULT = dict(BLOCK_T=1, BLOCK_H=4, num_warps=4)
# KV: four tokens a program, 4 warps (0.063 ms at M = 65536 on the H200 vs 0.105 for one token with
# 2 warps, run13/14-quick_check), with the tail option: the same bits, 4.1 vs 5.2 us at M = 4096 and
# equal times at 16384 / 65536 (run28-quick_check-kv.log). Batch-invariant mode runs it at every M.
KV_DEFAULT = dict(BLOCK_T=4, num_warps=4, tail=True)
# Decode sizes (untuned, outside batch-invariant mode): one token a program, with the tail option (the
# same bits as without): 1.7 us at M = 128 (run29-quick_check-kv.log) where the bench measured 1.9
# without it (runs 22, 29); kernel probe, run 19: 2.04 us vs 2.17 for four tokens, 4 warps.
KV_SMALL_M = dict(BLOCK_T=1, num_warps=2, tail=True)
KV_SMALL_M_MAX = 1024
# Large prefill (untuned, outside batch-invariant mode): four tokens on 2 warps, 0.0582 / 0.0160 ms at
# M = 65536 / 16384 vs 0.0603 / 0.0166 for KV_DEFAULT (run 28; run 25: 0.0586 / 0.0161). Its sum of
# squares runs in another order, so its bits can differ from KV_DEFAULT's.
KV_LARGE_M = dict(BLOCK_T=4, num_warps=2)
KV_LARGE_M_MIN = 8193


def kv_untuned_config(m: int) -> dict:
    """The KV launch config an untuned call at M tokens runs (batch-invariant mode: KV_DEFAULT always)."""
    if m <= KV_SMALL_M_MAX:
        return KV_SMALL_M
    return KV_LARGE_M if m >= KV_LARGE_M_MIN else KV_DEFAULT
CANDIDATES: dict[str, list[dict]] = {
    "q_rope_store": [
        dict(BLOCK_T=t, BLOCK_H=h, num_warps=w)
        for t in (1, 2, 4)
        for h in (1, 2, 4, 8)
        for w in (2, 4, 8)
        if t * h <= 16
    ],
    "kv_rope_quant_store": [dict(BLOCK_T=t, num_warps=w) for t in (1, 2, 4, 8) for w in (1, 2, 4, 8)]
    + [dict(BLOCK_T=t, num_warps=w, tail=True) for t in (1, 2, 4, 8) for w in (2, 4)],
    "kv_rope_quant": [dict(BLOCK_T=t, num_warps=w) for t in (1, 2, 4, 8) for w in (1, 2, 4, 8)]
    + [dict(BLOCK_T=t, num_warps=w, tail=True) for t in (1, 2, 4, 8) for w in (2, 4)],
}


@triton.jit
def _unpack_bf16x2(w):
    """uint32 words holding bf16 pairs (little endian) -> (even, odd) elements as fp32, exactly."""
    return (w << 16).to(tl.float32, bitcast=True), (w & 0xFFFF0000).to(tl.float32, bitcast=True)


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
    """Round fp32 ``v`` (|v| <= 448) to the nearest e4m3fn value, ties to even, on the bits."""
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
    return (sign | mag_q).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(v, HW: tl.constexpr):
    """fp32 (|v| <= 448) -> nearest e4m3fn value as fp32, ties to even: the hardware conversion
    (``cvt.rn.satfinite``) on a GPU, the same rounding on the bits under the interpreter."""
    if HW:
        return v.to(tl.float8e4nv).to(tl.float32)
    else:
        return _e4m3_rne(v)


@triton.jit
def _fp8_qdq_pairs(z0, z1, HW: tl.constexpr, CLAMP_HI: tl.constexpr = True):
    """FP8-e4m3 round trip of a block split into its even ``z0`` and odd ``z1`` elements.

    ``z0``, ``z1``: ``[A, NB, BLOCK/2]``; one UE8M0 scale per ``[a, nb]`` block (both halves).
    ``448 * 2^k >= amax`` exactly, so a scaled value never exceeds 448 in magnitude (+inf stays +inf:
    its block's scale 2^120 makes 448 * scale +inf too) and the upper clamp never changes a result;
    the lower one also maps a NaN (max ignores it) to -448. CLAMP_HI=False leaves the no-op out.
    """
    amax = tl.maximum(tl.max(tl.abs(z0), axis=2), tl.max(tl.abs(z1), axis=2))
    k = _ue8m0_exponent(amax)
    inv_scale = tl.expand_dims(_pow2(-k), 2)
    scale = tl.expand_dims(_pow2(k), 2)
    if CLAMP_HI:
        q0 = _to_e4m3(tl.minimum(tl.maximum(z0 * inv_scale, -448.0), 448.0), HW) * scale
        q1 = _to_e4m3(tl.minimum(tl.maximum(z1 * inv_scale, -448.0), 448.0), HW) * scale
    else:
        q0 = _to_e4m3(tl.maximum(z0 * inv_scale, -448.0), HW) * scale
        q1 = _to_e4m3(tl.maximum(z1 * inv_scale, -448.0), HW) * scale
    return q0, q1


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


def kv_shape_key(kv: torch.Tensor, cos: torch.Tensor, block: int) -> dict:
    return dict(d=kv.shape[1], rd=2 * cos.shape[1], block=block)


def q_rope_store(
    q_buf: torch.Tensor, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, batch_invariant: bool,
    config: dict | None = None,
):
    """Launch with the tactic for this M (or an explicit ``config``, e.g. from a tuner)."""
    m, h, d = q.shape
    if m == 0:
        return
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


# ---------------------------------------------------------------------------
# KV: RMSNorm + RoPE on the tail + FP8 round trip + cache store
# ---------------------------------------------------------------------------
@triton.jit
def _store_rows(cache_ptr, slot, tok_ok, col, col_ok, out, S, stride_cache):
    slot = tl.where(slot < 0, slot + S, slot)  # index_put semantics: negative counts from the end
    keep = tok_ok & (slot >= 0) & (slot < S)  # out-of-range slots are skipped, never written
    tl.store(cache_ptr + slot[:, None, None] * stride_cache + col[None, :, :], out,
             mask=keep[:, None, None] & col_ok[None, :, :])


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, t, p, rot, stride_cm, stride_cp, stride_sm, stride_sp, PAIRED: tl.constexpr):
    """cos/sin of the pairs ``p`` of tokens ``t`` (0 where ``rot`` is off), as fp32 tiles like ``p``.
    PAIRED: one int64 load per pair from the interleaved table (cos in the low half)."""
    if PAIRED:
        cs = tl.load(cos_ptr + t[:, None, None] * stride_cm + p[None, :, :], mask=rot, other=0)
        c = (cs & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)  # little endian: cos first
        s = ((cs >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        c = tl.load(cos_ptr + t[:, None, None] * stride_cm + p[None, :, :] * stride_cp, mask=rot, other=0.0)
        s = tl.load(sin_ptr + t[:, None, None] * stride_sm + p[None, :, :] * stride_sp, mask=rot, other=0.0)
    return c, s


@triton.jit
def _halves(y, BLOCK_T: tl.constexpr, N: tl.constexpr, HB: tl.constexpr):
    """``[BLOCK_T, N, HB]`` -> its first and last ``N/2`` quant blocks. The split itself renames
    registers; for the first one Triton changes the layout of the (bf16) values once so that the
    two halves sit in the same thread."""
    return tl.split(tl.permute(tl.reshape(y, (BLOCK_T, 2, N // 2, HB)), (0, 2, 3, 1)))


@triton.jit
def _quant_store(y0, y1, t, tok_ok, slot, out_ptr, cache_ptr, S, stride_om, stride_cache,
                 C0: tl.constexpr, N: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                 STORE: tl.constexpr, HW: tl.constexpr, TAIL: tl.constexpr):
    """FP8 round trip of the bf16 values ``y0``/``y1`` ``[BLOCK_T, N, HB]`` (words ``C0 ..``) and their
    stores. The packing into bf16 is exact: the FP8 results have at most 4 significant bits. TAIL: the
    scaled values are at most 448 in magnitude (see ``_fp8_qdq_pairs``), so only the lower clamp is
    applied (it is what maps a NaN to -448, as the two-sided clamp does), and with HW the pair is
    packed by one conversion."""
    col = C0 + tl.arange(0, N)[:, None] * HB + tl.arange(0, HB)[None, :]
    col_ok = col < D // 2
    q0, q1 = _fp8_qdq_pairs(y0, y1, HW, not TAIL)
    if HW and TAIL:
        out = _cvt_bf16x2(q0, q1).to(tl.int32, bitcast=True)
    else:
        out = _pack_bf16x2(q0, q1, HW).to(tl.int32, bitcast=True)
    tl.store(out_ptr + t[:, None, None] * stride_om + col[None, :, :], out,
             mask=tok_ok[:, None, None] & col_ok[None, :, :])
    if STORE:
        _store_rows(cache_ptr, slot, tok_ok, col, col_ok, out, S, stride_cache)


@triton.jit(do_not_specialize=["M", "S"])
def _kv_rope_quant_kernel(
    kv_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, out_ptr, cache_ptr, M, S, eps,
    stride_km, stride_om, stride_cm, stride_cp, stride_sm, stride_sp, stride_slot, stride_cache,
    D: tl.constexpr, PAIR0: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
    BLOCK_T: tl.constexpr, STORE: tl.constexpr, PAIRED: tl.constexpr, HW: tl.constexpr, TREE: tl.constexpr,
    TAIL: tl.constexpr, HALVINGS: tl.constexpr,
):
    # tile [BLOCK_T tokens, NB quant blocks, BLOCK/2 words]; kv/out/cache pointers and strides in words.
    # PAIRED: cos_ptr points at int64 words holding (cos, sin) of a pair (the interleaved table of
    # ``view_as_real``), stride_cm in words: one load per pair instead of two strided ones.
    # TAIL (the ``tail`` config option; same bits as without it): the norm as without it; then the
    # first half of the quant blocks is split off HALVINGS times (``kv_tail_halvings``), quantized and
    # stored without RoPE work or the second bf16 rounding (its values are bf16 already), and the RoPE
    # (tables, products, selects) runs only on the last NB / 2**HALVINGS blocks, which hold every
    # rotated word (anywhere in them: PAIR0 need not start a block). Also: bf16 roundings and packing
    # as one cvt.rn.bf16x2.f32 a pair (HW), no upper FP8 clamp (never binds), and with w_ptr int64
    # (the weights 8-byte aligned) one load per weight pair in the tile's layout.
    HB: tl.constexpr = BLOCK // 2
    NR: tl.constexpr = NB >> HALVINGS  # quant blocks the RoPE runs on (TAIL), the last ones
    R0: tl.constexpr = (NB - NR) * HB  # their first word
    tl.static_assert(NR >= 1 and R0 <= PAIR0, "HALVINGS must leave every rotated word in the last piece")
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t < M
    col = tl.arange(0, NB)[:, None] * HB + tl.arange(0, HB)[None, :]  # word = pair index
    col_ok = col < D // 2
    mask = tok_ok[:, None, None] & col_ok[None, :, :]
    # every global load is issued up front (slots and rope tables do not wait for the norm): one
    # memory round trip per program instead of three dependent ones
    w = tl.load(kv_ptr + t[:, None, None] * stride_km + col[None, :, :], mask=mask, other=0)
    if STORE:
        slot = tl.load(slot_ptr + t * stride_slot, mask=tok_ok, other=-1)
    else:
        slot = t  # never read (_quant_store takes it)
    if TAIL:  # the tables of the last piece only
        p = R0 + tl.arange(0, NR)[:, None] * HB + tl.arange(0, HB)[None, :] - PAIR0
    else:
        p = col - PAIR0
    rot = tok_ok[:, None, None] & ((p >= 0) & (p < D // 2 - PAIR0))[None, :, :]
    c, s = _rope_tables(cos_ptr, sin_ptr, t, p, rot, stride_cm, stride_cp, stride_sm, stride_sp, PAIRED)
    if w_ptr.dtype.element_ty == tl.int64:
        tl.static_assert(TAIL, "int64 weight pairs are read by the tail path only")
        gw = tl.load(w_ptr + tl.broadcast_to(col[None, :, :], (BLOCK_T, NB, HB)),
                     mask=tl.broadcast_to(col_ok[None, :, :], (BLOCK_T, NB, HB)), other=0)
        g0 = (gw & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        g1 = ((gw >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        g0 = tl.load(w_ptr + 2 * col, mask=col_ok, other=0.0)[None, :, :]
        g1 = tl.load(w_ptr + 2 * col + 1, mask=col_ok, other=0.0)[None, :, :]
    x0, x1 = _unpack_bf16x2(w.to(tl.uint32, bitcast=True))
    # RMSNorm: fp32 statistics, (x * rstd) then * weight, one bf16 rounding
    # tl.sum's order follows the register layout: on the GPU a row's bits change with BLOCK_T /
    # num_warps (run 25). TREE: a fixed pairwise tree instead (layout-independent; 20% more
    # instructions in the sm_90 build, 1-13% slower on the H200 in run 28, so not the default).
    sq = x0 * x0 + x1 * x1
    if TREE:
        ms = pairwise_row_sum(tl.reshape(sq, (BLOCK_T, NB * HB)), BLOCK_T, NB * HB)
    else:
        ms = tl.sum(tl.sum(sq, axis=2), axis=1)
    ms = ms * (1.0 / D)
    rstd = tl.math.div_rn(tl.full((BLOCK_T,), 1.0, tl.float32), tl.sqrt_rn(ms + eps))  # torch.rsqrt on CPU
    rstd = tl.expand_dims(tl.expand_dims(rstd, 1), 2)
    if TAIL:
        y0, y1 = _round_bf16_pair(g0 * (x0 * rstd), g1 * (x1 * rstd), HW)
        # no rotated word in the first half: quantize and store it as it is
        for i in tl.static_range(HALVINGS):
            y0_head, y0 = _halves(y0, BLOCK_T, NB >> i, HB)
            y1_head, y1 = _halves(y1, BLOCK_T, NB >> i, HB)
            _quant_store(y0_head, y1_head, t, tok_ok, slot, out_ptr, cache_ptr, S, stride_om, stride_cache,
                         (NB - (NB >> i)) * HB, NB >> (i + 1), HB, D, STORE, HW, True)
        if PAIR0 == R0:  # every word of the piece rotates (padding past D/2 is zeros): no select
            y0, y1 = y0 * c - y1 * s, y0 * s + y1 * c
        else:
            y0, y1 = _rotate(y0, y1, c, s, rot)
        y0, y1 = _round_bf16_pair(y0, y1, HW)
        _quant_store(y0, y1, t, tok_ok, slot, out_ptr, cache_ptr, S, stride_om, stride_cache,
                     R0, NR, HB, D, STORE, HW, True)
    else:
        y0 = _round_bf16(g0 * (x0 * rstd), HW)
        y1 = _round_bf16(g1 * (x1 * rstd), HW)
        # RoPE on the last rd dims (pairs never straddle a quant block: BLOCK is even), bf16 rounding
        y0, y1 = _rotate(y0, y1, c, s, rot)
        # FP8 round trip (padded columns are zeros and never raise a block's amax) and the stores
        _quant_store(_round_bf16(y0, HW), _round_bf16(y1, HW), t, tok_ok, slot, out_ptr, cache_ptr, S, stride_om,
                     stride_cache, 0, NB, HB, D, STORE, HW, False)


@triton.jit
def _quant_store_rows(y0, y1, t, tok_ok, slot, out_ptr, cache_ptr, S, stride_om, stride_cache,
                      C0: tl.constexpr, WH: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                      BLOCK_T: tl.constexpr, STORE: tl.constexpr, HW: tl.constexpr):
    """``_quant_store`` for ``[BLOCK_T, WH]`` tiles of words ``C0 ..`` (the row layout): the quant
    blocks are a reshape of the row, and the stores keep the loads' 16-byte vectors."""
    q0, q1 = _fp8_qdq_pairs(tl.reshape(y0, (BLOCK_T, WH // HB, HB)), tl.reshape(y1, (BLOCK_T, WH // HB, HB)),
                            HW, False)
    q0, q1 = tl.reshape(q0, (BLOCK_T, WH)), tl.reshape(q1, (BLOCK_T, WH))
    if HW:
        out = _cvt_bf16x2(q0, q1).to(tl.int32, bitcast=True)
    else:
        out = _pack_bf16x2(q0, q1, HW).to(tl.int32, bitcast=True)
    col = C0 + tl.arange(0, WH)
    col_ok = col < D // 2
    tl.store(out_ptr + t[:, None] * stride_om + col[None, :], out, mask=tok_ok[:, None] & col_ok[None, :])
    if STORE:
        slot = tl.where(slot < 0, slot + S, slot)
        keep = tok_ok & (slot >= 0) & (slot < S)
        tl.store(cache_ptr + slot[:, None] * stride_cache + col[None, :], out, mask=keep[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["M", "S"])
def _kv_rope_quant_rows_kernel(
    kv_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, out_ptr, cache_ptr, M, S, eps,
    stride_km, stride_om, stride_cm, stride_cp, stride_sm, stride_sp, stride_slot, stride_cache,
    D: tl.constexpr, PAIR0: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
    BLOCK_T: tl.constexpr, STORE: tl.constexpr, PAIRED: tl.constexpr, HW: tl.constexpr,
):
    # The ``rows`` config option: the arithmetic of the tail path, in a layout where a token's
    # words lie along one warp's lanes (16-byte vectors) and its two halves in the same thread.
    # The tile is [2 halves, BLOCK_T tokens, WH words]; the RoPE runs on the second half only
    # (PAIR0 >= WH). The row sum is then in-thread adds and lane shuffles, the split into halves
    # renames registers, and nothing goes through shared memory.
    HB: tl.constexpr = BLOCK // 2
    WH: tl.constexpr = NB * HB // 2
    tl.static_assert(NB >= 2 and PAIR0 >= WH, "rows: every rotated word must lie in the second half")
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t < M
    col = tl.arange(0, 2)[:, None, None] * WH + tl.arange(0, WH)[None, None, :]
    col_ok = col < D // 2
    w = tl.load(kv_ptr + t[None, :, None] * stride_km + col, mask=tok_ok[None, :, None] & col_ok, other=0)
    if STORE:
        slot = tl.load(slot_ptr + t * stride_slot, mask=tok_ok, other=-1)
    else:
        slot = t  # never read
    p = WH + tl.arange(0, WH) - PAIR0
    rot = tok_ok[:, None] & ((p >= 0) & (p < D // 2 - PAIR0))[None, :]
    if PAIRED:  # as in _rope_tables, on [BLOCK_T, WH] tiles
        cs = tl.load(cos_ptr + t[:, None] * stride_cm + p[None, :], mask=rot, other=0)
        c = (cs & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        s = ((cs >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        c = tl.load(cos_ptr + t[:, None] * stride_cm + p[None, :] * stride_cp, mask=rot, other=0.0)
        s = tl.load(sin_ptr + t[:, None] * stride_sm + p[None, :] * stride_sp, mask=rot, other=0.0)
    if w_ptr.dtype.element_ty == tl.int64:
        gw = tl.load(w_ptr + tl.broadcast_to(col, (2, BLOCK_T, WH)), mask=tl.broadcast_to(col_ok, (2, BLOCK_T, WH)), other=0)
        g0 = (gw & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        g1 = ((gw >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        g0 = tl.load(w_ptr + 2 * tl.broadcast_to(col, (2, BLOCK_T, WH)), mask=tl.broadcast_to(col_ok, (2, BLOCK_T, WH)), other=0.0)
        g1 = tl.load(w_ptr + 2 * tl.broadcast_to(col, (2, BLOCK_T, WH)) + 1, mask=tl.broadcast_to(col_ok, (2, BLOCK_T, WH)), other=0.0)
    x0, x1 = _unpack_bf16x2(w.to(tl.uint32, bitcast=True))
    ms = tl.sum(tl.sum(x0 * x0 + x1 * x1, axis=2), axis=0) * (1.0 / D)
    rstd = tl.math.div_rn(tl.full((BLOCK_T,), 1.0, tl.float32), tl.sqrt_rn(ms + eps))[None, :, None]
    y0, y1 = _round_bf16_pair(g0 * (x0 * rstd), g1 * (x1 * rstd), HW)
    h0, r0 = tl.split(tl.permute(y0, (1, 2, 0)))
    h1, r1 = tl.split(tl.permute(y1, (1, 2, 0)))
    _quant_store_rows(h0, h1, t, tok_ok, slot, out_ptr, cache_ptr, S, stride_om, stride_cache,
                      0, WH, HB, D, BLOCK_T, STORE, HW)
    if PAIR0 == WH:  # every word of the half rotates (padding past D/2 is zeros): no select
        r0, r1 = r0 * c - r1 * s, r0 * s + r1 * c
    else:
        r0, r1 = _rotate(r0, r1, c, s, rot)
    r0, r1 = _round_bf16_pair(r0, r1, HW)
    _quant_store_rows(r0, r1, t, tok_ok, slot, out_ptr, cache_ptr, S, stride_om, stride_cache,
                      WH, WH, HB, D, BLOCK_T, STORE, HW)


@triton.jit(do_not_specialize=["M", "S"])
def _kv_rope_quant_blocks_kernel(
    kv_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, out_ptr, cache_ptr, M, S, eps,
    stride_km, stride_om, stride_cm, stride_cp, stride_sm, stride_sp, stride_slot, stride_cache,
    D: tl.constexpr, PAIR0: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
    BLOCK_T: tl.constexpr, STORE: tl.constexpr, PAIRED: tl.constexpr, HW: tl.constexpr,
    FMA_SQ: tl.constexpr = False, CLAMP: tl.constexpr = True,
):
    HB: tl.constexpr = BLOCK // 2      # words a quant block
    Q: tl.constexpr = HB // 4          # 16-byte vectors a block
    RW: tl.constexpr = D // 2 - PAIR0  # rotated words
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t < M
    # main tile [Q, BLOCK_T, NB, 4]: word nb * HB + q * 4 + v; a thread holds whole quant blocks
    col = (tl.arange(0, NB)[None, None, :, None] * HB + tl.arange(0, Q)[:, None, None, None] * 4
           + tl.arange(0, 4)[None, None, None, :])
    col_ok = col < D // 2
    tmask = tok_ok[None, :, None, None]
    w = tl.load(kv_ptr + t[None, :, None, None] * stride_km + col, mask=tmask & col_ok, other=0)
    # the rotated words again, as a small tile [BLOCK_T, RW] (L1 hits)
    rc = PAIR0 + tl.arange(0, RW)
    wr = tl.load(kv_ptr + t[:, None] * stride_km + rc[None, :], mask=tok_ok[:, None], other=0)
    if STORE:
        slot = tl.load(slot_ptr + t * stride_slot, mask=tok_ok, other=-1)
    else:
        slot = t
    p = tl.arange(0, RW)
    if PAIRED:
        cs = tl.load(cos_ptr + t[:, None] * stride_cm + p[None, :], mask=tok_ok[:, None], other=0)
        c = (cs & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        s = ((cs >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        c = tl.load(cos_ptr + t[:, None] * stride_cm + p[None, :] * stride_cp, mask=tok_ok[:, None], other=0.0)
        s = tl.load(sin_ptr + t[:, None] * stride_sm + p[None, :] * stride_sp, mask=tok_ok[:, None], other=0.0)
    gcol = tl.broadcast_to(col, (Q, BLOCK_T, NB, 4))
    gok = tl.broadcast_to(col_ok, (Q, BLOCK_T, NB, 4))
    grc = tl.broadcast_to(rc[None, :], (BLOCK_T, RW))
    if w_ptr.dtype.element_ty == tl.int64:
        gw = tl.load(w_ptr + gcol, mask=gok, other=0)
        g0 = (gw & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        g1 = ((gw >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        gr = tl.load(w_ptr + grc)
        gr0 = (gr & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
        gr1 = ((gr >> 32) & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    else:
        g0 = tl.load(w_ptr + 2 * gcol, mask=gok, other=0.0)
        g1 = tl.load(w_ptr + 2 * gcol + 1, mask=gok, other=0.0)
        gr0 = tl.load(w_ptr + 2 * grc)
        gr1 = tl.load(w_ptr + 2 * grc + 1)
    x0, x1 = _unpack_bf16x2(w.to(tl.uint32, bitcast=True))
    if FMA_SQ:
        sq = tl.fma(x1, x1, x0 * x0)
    else:
        sq = x0 * x0 + x1 * x1
    ms = tl.sum(tl.sum(tl.sum(sq, axis=3), axis=0), axis=1) * (1.0 / D)
    rstd = tl.math.div_rn(tl.full((BLOCK_T,), 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    # the unrotated blocks: norm, bf16, FP8 round trip in the thread
    r4 = rstd[None, :, None, None]
    y0, y1 = _round_bf16_pair(g0 * (x0 * r4), g1 * (x1 * r4), HW)
    amax = tl.max(tl.max(tl.maximum(tl.abs(y0), tl.abs(y1)), axis=3), axis=0)  # [BLOCK_T, NB]
    k = _ue8m0_exponent(amax)
    inv = _pow2(-k)[None, :, :, None]
    sc = _pow2(k)[None, :, :, None]
    if CLAMP:
        q0 = _to_e4m3(tl.maximum(y0 * inv, -448.0), HW) * sc
        q1 = _to_e4m3(tl.maximum(y1 * inv, -448.0), HW) * sc
    else:
        q0 = _to_e4m3(y0 * inv, HW) * sc
        q1 = _to_e4m3(y1 * inv, HW) * sc
    if HW:
        out = _cvt_bf16x2(q0, q1).to(tl.int32, bitcast=True)
    else:
        out = _pack_bf16x2(q0, q1, HW).to(tl.int32, bitcast=True)
    keep_col = col < PAIR0
    tl.store(out_ptr + t[None, :, None, None] * stride_om + col, out, mask=tmask & keep_col)
    if STORE:
        sl = tl.where(slot < 0, slot + S, slot)
        keep = tok_ok & (sl >= 0) & (sl < S)
        tl.store(cache_ptr + sl[None, :, None, None] * stride_cache + col, out, mask=keep[None, :, None, None] & keep_col)
    # the rotated words: norm, bf16, RoPE, bf16, FP8 round trip on the small tile
    xr0, xr1 = _unpack_bf16x2(wr.to(tl.uint32, bitcast=True))
    r2 = rstd[:, None]
    yr0, yr1 = _round_bf16_pair(gr0 * (xr0 * r2), gr1 * (xr1 * r2), HW)
    yr0, yr1 = yr0 * c - yr1 * s, yr0 * s + yr1 * c
    yr0, yr1 = _round_bf16_pair(yr0, yr1, HW)
    qr0, qr1 = _fp8_qdq_pairs(tl.reshape(yr0, (BLOCK_T, RW // HB, HB)), tl.reshape(yr1, (BLOCK_T, RW // HB, HB)), HW, False)
    qr0, qr1 = tl.reshape(qr0, (BLOCK_T, RW)), tl.reshape(qr1, (BLOCK_T, RW))
    if HW:
        outr = _cvt_bf16x2(qr0, qr1).to(tl.int32, bitcast=True)
    else:
        outr = _pack_bf16x2(qr0, qr1, HW).to(tl.int32, bitcast=True)
    tl.store(out_ptr + t[:, None] * stride_om + rc[None, :], outr, mask=tok_ok[:, None])
    if STORE:
        tl.store(cache_ptr + sl[:, None] * stride_cache + rc[None, :], outr, mask=keep[:, None])


def kv_blocks_ok(d: int, rd: int, block: int) -> bool:
    """Whether the ``blocks`` kernel takes this shape: the rotated words are whole quant blocks, a
    power of two of them."""
    hb, rw = block // 2, rd // 2
    return (d - rd) // 2 % hb == 0 and rw % hb == 0 and rw & (rw - 1) == 0 and hb % 4 == 0


def kv_rows_ok(d: int, rd: int, block: int) -> bool:
    """Whether the ``rows`` kernel takes this shape: two or more quant blocks a row and every rotated
    word in the second half of the (power-of-two padded) row."""
    nb = triton.next_power_of_2(d // block)
    return nb >= 2 and (d - rd) // 2 >= nb * (block // 2) // 2


def kv_tail_halvings(d: int, rd: int, block: int, block_t: int, num_warps: int) -> int:
    """How often the ``tail`` option halves the quant blocks before the RoPE (the kernel takes any
    count that leaves every rotated word in the last piece; this picks 0 or 1). One when the rotated
    words all lie in the second half and a thread holds at least two 16-byte vectors of words: the
    split then costs one bf16 layout change. sm_90 builds, D 512 / rd 64, SASS instructions up to
    EXIT: BLOCK_T 4 / 4 warps 569 with no halving, 524 with one; with one vector a thread a halving
    adds (BLOCK_T 4 / 8 warps: 317 -> 356), and a second one gains nothing at BLOCK_T 8 / 4 warps
    (975 -> 974: Triton moves data again)."""
    nb, hb, pair0 = triton.next_power_of_2(d // block), block // 2, (d - rd) // 2
    vectors = block_t * nb * hb // (32 * num_warps * 4)
    return int(nb >= 2 and (nb // 2) * hb <= pair0 and vectors >= 2)


def _paired_table(cos: torch.Tensor, sin: torch.Tensor, m: int) -> torch.Tensor | None:
    """``[M, rd/2]`` int64 words of (cos, sin) when the two tables interleave in memory, else None.
    Strides of the result are in words."""
    pairs = interleaved_view(cos, sin) if m > 0 else None
    if pairs is None or pairs.stride(0) % 2 or pairs.data_ptr() % 8:
        return None
    return pairs.view(torch.int64)


def kv_rope_quant(
    kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, block: int,
    cache: torch.Tensor | None = None, slots: torch.Tensor | None = None, *, batch_invariant: bool,
    config: dict | None = None,
) -> torch.Tensor:
    """The KV path; with ``cache`` and ``slots`` also ``cache[slots[i]] = out[i]`` (same kernel)."""
    m, d = kv.shape
    out = torch.empty((m, d), dtype=kv.dtype, device=kv.device)
    if m == 0:
        return out
    rd = 2 * cos.shape[1]
    op = "kv_rope_quant_store" if cache is not None else "kv_rope_quant"
    default = KV_DEFAULT if batch_invariant else kv_untuned_config(m)
    cfg = config or tactic(op, m, kv_shape_key(kv, cos, block), default=default, batch_invariant=batch_invariant)
    block_t = cfg["BLOCK_T"]
    nb = triton.next_power_of_2(d // block)
    if cfg.get("sum") == "tree" and nb * block // 2 > 1024:
        raise ValueError(f"kv_rope_quant: sum='tree' takes at most 1024 bf16 pairs a row, head_dim {d} has more")
    rows = bool(cfg.get("rows", False))
    if rows and not kv_rows_ok(d, rd, block):
        raise ValueError(f"kv_rope_quant: rows=True needs the rope dims in the second half of the row "
                         f"(head_dim {d}, rope dims {rd}, block {block})")
    if rows and cfg.get("sum") == "tree":
        raise ValueError("kv_rope_quant: rows=True sums with tl.sum; sum='tree' is the other kernel's option")
    tail = bool(cfg.get("tail", False)) or rows or bool(cfg.get("blocks", False))
    if tail and weight.stride(0) == 1 and weight.data_ptr() % 8 == 0:
        weight = weight.view(torch.int64)  # (even, odd) weight pairs, one 8-byte load each (else fp32)
    store = cache is not None
    if not store:  # placeholders the STORE=False kernel never touches
        cache, slots = out, out.new_empty((0,), dtype=torch.int64)
    kw, ow, cw = as_words(kv), as_words(out), as_words(cache)
    pairs = _paired_table(cos, sin, m)
    if pairs is not None:
        cos = sin = pairs
    args = (kw, weight, cos, sin, slots, ow, cw, m, cache.shape[0] if store else 0, float(eps),
            kw.stride(0), ow.stride(0), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            slots.stride(0), cw.stride(0))
    common = dict(D=d, PAIR0=(d - rd) // 2, BLOCK=block, NB=nb, BLOCK_T=block_t, STORE=store,
                  PAIRED=pairs is not None, HW=cfg.get("HW", not INTERPRET), num_warps=cfg["num_warps"],
                  enable_fp_fusion=False)
    grid = (triton.cdiv(m, block_t),)
    if cfg.get("blocks"):
        if not kv_blocks_ok(d, rd, block):
            raise ValueError(f"kv_rope_quant: blocks=True needs whole quant blocks of rotated words "
                             f"(head_dim {d}, rope dims {rd}, block {block})")
        _kv_rope_quant_blocks_kernel[grid](*args, **common, FMA_SQ=cfg.get("fma_sq", False), CLAMP=cfg.get("clamp", True))
    elif rows:
        _kv_rope_quant_rows_kernel[grid](*args, **common)
    else:
        _kv_rope_quant_kernel[grid](
            *args, **common, TREE=cfg.get("sum") == "tree", TAIL=tail,
            HALVINGS=kv_tail_halvings(d, rd, block, block_t, cfg["num_warps"]) if tail else 0)
    return out
