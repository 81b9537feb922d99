"""Triton kernels of the KV path of the RoPE/store family: RMSNorm, RoPE on the tail, FP8-e4m3
round trip with UE8M0 per-block scales, and the cache row picked by the token's slot
(``kv_rope_quant_store``; ``kv_rope_quant`` without the store). Numerics, word layout and int64
offsets as described in ``rope_store.py``, whose bit-level helpers both kernels use.

Two kernels compute the same per-row rule:

* ``_kv_rope_quant_blocks_kernel`` (config ``blocks=True``, the default where the shape allows: the
  rotated words are whole quant blocks, a power of two of them; V4.1's 448 + 64 dims with block 32
  are). A thread holds whole quant blocks of one token (the tile is ``[vectors, tokens, blocks,
  4 words]``), so a block's amax never leaves the thread and a row's sum of squares is in-thread adds
  and four lane shuffles; the rotated blocks are read again (L1 hits) into a small ``[tokens,
  rotated words]`` tile, so the RoPE runs on two words a thread. Nothing goes through shared memory.
  sm_90 SASS, D 512 / rd 64, two tokens on one warp: 654 instructions up to EXIT for 32 elements a
  thread, against 505 for 16 in the tile kernel's old default. On the H200 (``bench_rope_store.py``,
  run 75): 0.0571 / 0.0148 / 0.0040 ms at M = 65536 / 16384 / 4096, 90 / 86.5 / 79.7% of the copy
  roofline, against 0.0584 / 0.0161 / 0.0042 for the tile kernel's untuned configs (run 30).
* ``_kv_rope_quant_kernel`` (the tile kernel, every other shape): tile ``[tokens, blocks, words]``
  with Triton's default layout, options ``tail`` (the RoPE on the upper half of the blocks only,
  fewer instructions, the same bits) and ``sum="tree"`` (a layout-independent sum of squares,
  1-13% slower on the H200, run 28).

The sum of squares follows the register layout (``tl.sum``), so a row's bits depend on the launch
config, never on M or on the other rows. ``KV_DEFAULT`` is one config for every M, batch-invariant
mode or not, so on V4.1 shapes the untuned bits do not change with M either. On the GPU the sum's
order differs from torch's, so rstd can differ in its last place: 24-30 of the 33.5 M output elements
at M = 65536 differ from the reference provider's by one FP8 step (run 67).

Both kernels take the ``pdl`` config option (on in ``KV_DEFAULT``): launched by programmatic dependent
launch where the GPU and Triton support it, the kernel lets the next grid launch, then waits for the
previous grid's writes before its first global access (``common.pdl_prologue``; the same arithmetic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import tactic
from ..rope_tables import interleaved_view
from .common import INTERPRET, overlaps, pairwise_row_sum, pdl_available, pdl_prologue
from .rope_store import (
    _fp8_qdq_pairs,
    _pack_bf16x2,
    _pack_words,
    _pow2,
    _round_bf16,
    _round_bf16_pair,
    _rotate,
    _to_e4m3,
    _ue8m0_exponent,
    _unpack_bf16x2,
    _unpack_f32x2,
    as_words,
)

# The blocks kernel, two tokens on one warp: every M, batch-invariant mode included (run 71, the
# benchmark's cache: 4.12 / 15.03 / 57.18 us at M = 4096 / 16384 / 65536; the tile kernel's best
# untuned config 4.06 / 15.82 / 57.75; one token a warp is no faster and gives other bits. At M = 1 it
# costs 0.1-0.2 us: 1.64 vs 1.44 for KV_SMALL_M). ``pdl``: launched by programmatic dependent launch
# (Hopper and newer; ignored elsewhere), so its grid launches while the kernel before it still runs; the
# same bits. Run 85, back-to-back calls in a CUDA graph (us, with / without): 56.28 / 56.94 at M = 65536,
# 14.36 / 14.66 at 16384, 3.89 / 4.07 at 4096, 1.24 / 1.75 at 128, 1.15 / 1.63 at 1.
KV_DEFAULT = dict(BLOCK_T=2, num_warps=1, blocks=True, pdl=True)
# The tile kernel's configs, for shapes the blocks kernel does not take. Four tokens a program on
# 4 warps with the tail option (0.063 ms at M = 65536 vs 0.105 for one token with 2 warps,
# run13/14-quick_check; with tail 4.1 vs 5.2 us at M = 4096, run28-quick_check-kv.log) ...
KV_TILE_DEFAULT = dict(BLOCK_T=4, num_warps=4, tail=True)
# ... at decode sizes one token a program (1.7 us at M = 128, run29-quick_check-kv.log) ...
KV_SMALL_M = dict(BLOCK_T=1, num_warps=2, tail=True)
KV_SMALL_M_MAX = 1024
# ... and four tokens on 2 warps past 8192 (0.0582 / 0.0160 ms at M = 65536 / 16384 vs 0.0603 / 0.0166
# for KV_TILE_DEFAULT, run 28). Its sum of squares runs in another order, so its bits can differ.
KV_LARGE_M = dict(BLOCK_T=4, num_warps=2)
KV_LARGE_M_MIN = 8193


def kv_blocks_ok(d: int, rd: int, block: int) -> bool:
    """Whether the blocks kernel takes this shape: the rotated words are whole quant blocks (of a
    multiple of 8 elements), a power of two of them."""
    hb, rw = block // 2, rd // 2
    return hb % 4 == 0 and (d - rd) // 2 % hb == 0 and rw % hb == 0 and rw & (rw - 1) == 0


def kv_default_config(d: int, rd: int, block: int) -> dict:
    """The batch-invariant KV config of a shape (one for every M)."""
    return KV_DEFAULT if kv_blocks_ok(d, rd, block) else KV_TILE_DEFAULT


def kv_untuned_config(m: int, d: int, rd: int, block: int) -> dict:
    """The KV launch config an untuned call at M tokens runs, outside batch-invariant mode."""
    if kv_blocks_ok(d, rd, block):
        return KV_DEFAULT
    if m <= KV_SMALL_M_MAX:
        return KV_SMALL_M
    return KV_LARGE_M if m >= KV_LARGE_M_MIN else KV_TILE_DEFAULT


_TILE_CANDIDATES = ([dict(BLOCK_T=t, num_warps=w) for t in (1, 2, 4, 8) for w in (1, 2, 4, 8)]
                    + [dict(BLOCK_T=t, num_warps=w, tail=True) for t in (1, 2, 4, 8) for w in (2, 4)])
_BLOCKS_CANDIDATES = [dict(BLOCK_T=t, num_warps=w, blocks=True, pdl=p)
                      for t, w in ((1, 1), (2, 1), (4, 1), (4, 2), (8, 4)) for p in (True, False)]
# Launch configs worth timing per op (the tuner's search space; a blocks config that does not fit a
# shape raises, and the tuner skips it).
CANDIDATES: dict[str, list[dict]] = {
    "kv_rope_quant_store": _BLOCKS_CANDIDATES + _TILE_CANDIDATES,
    "kv_rope_quant": _BLOCKS_CANDIDATES + _TILE_CANDIDATES,
}


def kv_shape_key(kv: torch.Tensor, cos: torch.Tensor, block: int) -> dict:
    return dict(d=kv.shape[1], rd=2 * cos.shape[1], block=block)


@triton.jit
def _cache_rows(slot, tok_ok, S):
    """The cache row of each token and whether it is written: index_put semantics (a negative slot
    counts from the end); an out-of-range slot is skipped, never written."""
    row = tl.where(slot < 0, slot + S, slot)
    return row, tok_ok & (row >= 0) & (row < S)


@triton.jit
def _store_rows(cache_ptr, slot, tok_ok, col, col_ok, out, S, stride_cache):
    slot, keep = _cache_rows(slot, tok_ok, S)
    tl.store(cache_ptr + slot[:, None, None] * stride_cache + col[None, :, :], out,
             mask=keep[:, None, None] & col_ok[None, :, :])


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, t, p, rot, stride_cm, stride_cp, stride_sm, stride_sp, PAIRED: tl.constexpr):
    """cos/sin of the pairs ``p`` of tokens ``t`` (broadcastable index tiles; 0 where ``rot`` is off), as
    fp32 tiles. PAIRED: one int64 load per pair from the interleaved table (cos in the low half)."""
    if PAIRED:
        c, s = _unpack_f32x2(tl.load(cos_ptr + t * stride_cm + p, mask=rot, other=0))
    else:
        c = tl.load(cos_ptr + t * stride_cm + p * stride_cp, mask=rot, other=0.0)
        s = tl.load(sin_ptr + t * stride_sm + p * stride_sp, mask=rot, other=0.0)
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
    stores. The packing into bf16 is exact: the FP8 results have at most 4 significant bits. TAIL: with
    HW the pair is packed by one conversion."""
    col = C0 + tl.arange(0, N)[:, None] * HB + tl.arange(0, HB)[None, :]
    col_ok = col < D // 2
    q0, q1 = _fp8_qdq_pairs(y0, y1, HW)
    if TAIL:
        out = _pack_words(q0, q1, HW)
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
    TAIL: tl.constexpr, HALVINGS: tl.constexpr, PDL: tl.constexpr,
):
    # tile [BLOCK_T tokens, NB quant blocks, BLOCK/2 words]; kv/out/cache pointers and strides in words.
    # PAIRED: cos_ptr points at int64 words holding (cos, sin) of a pair (the interleaved table of
    # ``view_as_real``), stride_cm in words: one load per pair instead of two strided ones.
    # TAIL (the ``tail`` config option; same bits as without it): the norm as without it; then the
    # first half of the quant blocks is split off HALVINGS times (``kv_tail_halvings``), quantized and
    # stored without RoPE work or the second bf16 rounding (its values are bf16 already), and the RoPE
    # (tables, products, selects) runs only on the last NB / 2**HALVINGS blocks, which hold every
    # rotated word (anywhere in them: PAIR0 need not start a block). Also: bf16 roundings and packing
    # as one cvt.rn.bf16x2.f32 a pair (HW), and with w_ptr int64
    # (the weights 8-byte aligned) one load per weight pair in the tile's layout.
    HB: tl.constexpr = BLOCK // 2
    NR: tl.constexpr = NB >> HALVINGS  # quant blocks the RoPE runs on (TAIL), the last ones
    R0: tl.constexpr = (NB - NR) * HB  # their first word
    tl.static_assert(NR >= 1 and R0 <= PAIR0, "HALVINGS must leave every rotated word in the last piece")
    pdl_prologue(PDL)
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
    c, s = _rope_tables(cos_ptr, sin_ptr, t[:, None, None], p[None, :, :], rot, stride_cm, stride_cp, stride_sm,
                        stride_sp, PAIRED)
    if w_ptr.dtype.element_ty == tl.int64:
        tl.static_assert(TAIL, "int64 weight pairs are read by the tail path only")
        gw = tl.load(w_ptr + tl.broadcast_to(col[None, :, :], (BLOCK_T, NB, HB)),
                     mask=tl.broadcast_to(col_ok[None, :, :], (BLOCK_T, NB, HB)), other=0)
        g0, g1 = _unpack_f32x2(gw)
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
def _blocks_weights(w_ptr, col, col_ok, rc, Q: tl.constexpr, BLOCK_T: tl.constexpr, NB: tl.constexpr,
                    RW: tl.constexpr):
    """The norm weights of the blocks kernel's two tiles, as (even, odd) fp32 tiles."""
    gcol = tl.broadcast_to(col, (Q, BLOCK_T, NB, 4))
    gok = tl.broadcast_to(col_ok, (Q, BLOCK_T, NB, 4))
    grc = tl.broadcast_to(rc[None, :], (BLOCK_T, RW))
    if w_ptr.dtype.element_ty == tl.int64:
        g0, g1 = _unpack_f32x2(tl.load(w_ptr + gcol, mask=gok, other=0))
        gr0, gr1 = _unpack_f32x2(tl.load(w_ptr + grc))
    else:
        g0 = tl.load(w_ptr + 2 * gcol, mask=gok, other=0.0)
        g1 = tl.load(w_ptr + 2 * gcol + 1, mask=gok, other=0.0)
        gr0 = tl.load(w_ptr + 2 * grc)
        gr1 = tl.load(w_ptr + 2 * grc + 1)
    return g0, g1, gr0, gr1


@triton.jit(do_not_specialize=["M", "S"])
def _kv_rope_quant_blocks_kernel(
    kv_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, out_ptr, cache_ptr, M, S, eps,
    stride_km, stride_om, stride_cm, stride_cp, stride_sm, stride_sp, stride_slot, stride_cache,
    D: tl.constexpr, PAIR0: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
    BLOCK_T: tl.constexpr, STORE: tl.constexpr, PAIRED: tl.constexpr, HW: tl.constexpr, PDL: tl.constexpr,
):
    # The blocks config (see the module docstring). Unrotated blocks: norm, bf16, FP8 round trip and
    # the stores on the main tile, where a thread holds whole blocks; rotated blocks: the same plus the
    # RoPE on a small [BLOCK_T, RW] tile. The main tile computes the rotated blocks too (for the sum of
    # squares; their FP8 values are not stored).
    HB: tl.constexpr = BLOCK // 2      # words a quant block
    Q: tl.constexpr = HB // 4          # 16-byte vectors a block
    RW: tl.constexpr = D // 2 - PAIR0  # rotated words
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = t < M
    # main tile [Q, BLOCK_T, NB, 4]: word nb * HB + q * 4 + v; a thread holds whole quant blocks
    col = (tl.arange(0, NB)[None, None, :, None] * HB + tl.arange(0, Q)[:, None, None, None] * 4
           + tl.arange(0, 4)[None, None, None, :])
    col_ok = col < D // 2
    tmask = tok_ok[None, :, None, None]
    rc = PAIR0 + tl.arange(0, RW)
    g0, g1, gr0, gr1 = _blocks_weights(w_ptr, col, col_ok, rc, Q, BLOCK_T, NB, RW)
    w = tl.load(kv_ptr + t[None, :, None, None] * stride_km + col, mask=tmask & col_ok, other=0)
    # the rotated words again, as the small tile (L1 hits)
    wr = tl.load(kv_ptr + t[:, None] * stride_km + rc[None, :], mask=tok_ok[:, None], other=0)
    if STORE:
        slot = tl.load(slot_ptr + t * stride_slot, mask=tok_ok, other=-1)
    else:
        slot = t  # never read
    c, s = _rope_tables(cos_ptr, sin_ptr, t[:, None], tl.arange(0, RW)[None, :], tok_ok[:, None], stride_cm,
                        stride_cp, stride_sm, stride_sp, PAIRED)
    # every load is issued before the arithmetic: without the barrier ptxas sinks the weight loads
    # below the row sum and their latency adds to the kv loads' (run 74: 14.65 vs 14.95 us at M = 16384,
    # 4.05 vs 4.11 at 4096, the same bits)
    tl.debug_barrier()
    x0, x1 = _unpack_bf16x2(w.to(tl.uint32, bitcast=True))
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
    q0 = _to_e4m3(y0 * inv, HW) * sc  # no clamp: see _fp8_qdq_pairs
    q1 = _to_e4m3(y1 * inv, HW) * sc
    out = _pack_words(q0, q1, HW)
    keep_col = col < PAIR0
    tl.store(out_ptr + t[None, :, None, None] * stride_om + col, out, mask=tmask & keep_col)
    if STORE:
        sl, keep = _cache_rows(slot, tok_ok, S)
        tl.store(cache_ptr + sl[None, :, None, None] * stride_cache + col, out,
                 mask=keep[None, :, None, None] & keep_col)
    # the rotated words: norm, bf16, RoPE, bf16, FP8 round trip on the small tile
    xr0, xr1 = _unpack_bf16x2(wr.to(tl.uint32, bitcast=True))
    r2 = rstd[:, None]
    yr0, yr1 = _round_bf16_pair(gr0 * (xr0 * r2), gr1 * (xr1 * r2), HW)
    yr0, yr1 = yr0 * c - yr1 * s, yr0 * s + yr1 * c
    yr0, yr1 = _round_bf16_pair(yr0, yr1, HW)
    qr0, qr1 = _fp8_qdq_pairs(tl.reshape(yr0, (BLOCK_T, RW // HB, HB)), tl.reshape(yr1, (BLOCK_T, RW // HB, HB)),
                              HW)
    qr0, qr1 = tl.reshape(qr0, (BLOCK_T, RW)), tl.reshape(qr1, (BLOCK_T, RW))
    outr = _pack_words(qr0, qr1, HW)
    tl.store(out_ptr + t[:, None] * stride_om + rc[None, :], outr, mask=tok_ok[:, None])
    if STORE:
        tl.store(cache_ptr + sl[:, None] * stride_cache + rc[None, :], outr, mask=keep[:, None])


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
    weight = weight.contiguous()  # the kernels index it densely ([d] fp32: a copy only for a strided view)
    if cache is not None and overlaps(kv, cache):
        kv = kv.clone()  # a program would read kv rows another one has already stored over
    rd = 2 * cos.shape[1]
    op = "kv_rope_quant_store" if cache is not None else "kv_rope_quant"
    default = kv_default_config(d, rd, block) if batch_invariant else kv_untuned_config(m, d, rd, block)
    cfg = config or tactic(op, m, kv_shape_key(kv, cos, block), default=default, batch_invariant=batch_invariant)
    block_t = cfg["BLOCK_T"]
    nb = triton.next_power_of_2(d // block)
    if cfg.get("sum") == "tree" and nb * block // 2 > 1024:
        raise ValueError(f"kv_rope_quant: sum='tree' takes at most 1024 bf16 pairs a row, head_dim {d} has more")
    blocks = bool(cfg.get("blocks", False))
    if blocks and not kv_blocks_ok(d, rd, block):
        raise ValueError(f"kv_rope_quant: blocks=True needs the rotated words to be whole quant blocks, a power "
                         f"of two of them (head_dim {d}, rope dims {rd}, block {block})")
    if blocks and cfg.get("sum") == "tree":
        raise ValueError("kv_rope_quant: sum='tree' is an option of the tile kernel, not of blocks=True")
    tail = bool(cfg.get("tail", False)) or blocks  # both read the weights as pairs
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
    pdl = bool(cfg.get("pdl", False)) and pdl_available(kv.device)
    common = dict(D=d, PAIR0=(d - rd) // 2, BLOCK=block, NB=nb, BLOCK_T=block_t, STORE=store,
                  PAIRED=pairs is not None, HW=cfg.get("HW", not INTERPRET), PDL=pdl, num_warps=cfg["num_warps"],
                  enable_fp_fusion=False, **({"launch_pdl": True} if pdl else {}))
    grid = (triton.cdiv(m, block_t),)
    if blocks:
        _kv_rope_quant_blocks_kernel[grid](*args, **common)
    else:
        _kv_rope_quant_kernel[grid](
            *args, **common, TREE=cfg.get("sum") == "tree", TAIL=tail,
            HALVINGS=kv_tail_halvings(d, rd, block, block_t, cfg["num_warps"]) if tail else 0)
    return out
