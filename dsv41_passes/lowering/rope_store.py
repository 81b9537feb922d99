"""RoPE/store fused ops (namespace ``dsv41``): custom ops, fake implementations, reference providers.

``q_rope_store(q_buf, q, cos, sin)``  (mutates ``q_buf``, returns nothing)
    ``q_buf[:M, :H] = q`` with the last ``rd = 2 * cos.shape[-1]`` dims of every head
    rotated as interleaved pairs in fp32 (``y0 = x0*c - x1*s``, ``y1 = x0*s + x1*c``),
    one bf16 rounding. Pad heads and rows ``>= M`` are not touched.

``kv_rope_quant_store(cache, kv, weight, eps, cos, sin, slots, block) -> out``  (mutates ``cache``)
    ``out = fp8_block_qdq(rope_tail(rms_norm(kv, weight, eps)), block)`` with the reference
    rounding points (bf16 after the norm, bf16 after the RoPE, FP8-e4m3 with UE8M0 per-block
    scales); ``cache[slots[i]] = out[i]``. ``kv`` is the ``wkv`` output *before* the norm.

``kv_rope_quant(kv, weight, eps, cos, sin, block) -> out``
    the same without the store (used when the cache's old value is read after the store).

``cos``/``sin`` are fp32 ``[M, rd/2]`` and may be strided (e.g. the real and imaginary
parts of ``view_as_real(freqs_cis)``). Slots are int64 indices into the cache rows with
``index_put`` semantics: a negative slot counts from the end. A slot outside
``[-S, S)`` is an error: the reference provider raises; a GPU kernel cannot raise without
a host sync, so the Triton provider skips such a row (it never writes out of bounds).

The mode bits are named ``op_mode`` (not ``mode``): the ops are emitted through
``auto_functionalized(op, **kwargs)``, whose own handlers take a ``mode`` parameter.
"""

from __future__ import annotations

import math

import torch

from ..reference.model import rms_norm
from ..reference.quant import fp8_block_qdq
from ..reference.rope import apply_rotary_complex
from .registry import dispatch, one_device, register_provider, triton_available

BF16, F32 = torch.bfloat16, torch.float32


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_rope_tables(op: str, cos: torch.Tensor, sin: torch.Tensor, m: int, d: int) -> int:
    """Validate ``cos``/``sin`` ``[M, rd/2]`` fp32; returns ``rd``."""
    _check(cos.dim() == 2 and sin.dim() == 2,
           f"{op}: cos/sin must be [M, rope_dim/2], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    _check(cos.shape == sin.shape, f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    _check(cos.shape[0] == m, f"{op}: cos/sin have {cos.shape[0]} rows for {m} tokens")
    rd = 2 * cos.shape[1]
    _check(0 < rd <= d, f"{op}: rope dims {rd} must be in (0, head_dim={d}]")
    _check(cos.dtype == F32 and sin.dtype == F32, f"{op}: cos/sin must be float32, got {cos.dtype} / {sin.dtype}")
    return rd


def check_q_args(q_buf: torch.Tensor, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Clear errors for inputs ``q_rope_store`` cannot take."""
    op = "q_rope_store"
    _check(q.dim() == 3, f"{op}: q must be [M, heads, head_dim], got {tuple(q.shape)}")
    _check(q_buf.dim() == 3, f"{op}: q_buf must be [max_tokens, padded_heads, head_dim], got {tuple(q_buf.shape)}")
    m, h, d = q.shape
    _check(q_buf.shape[2] == d, f"{op}: head_dim of q ({d}) and q_buf ({q_buf.shape[2]}) differ")
    _check(h <= q_buf.shape[1], f"{op}: {h} heads do not fit the buffer's {q_buf.shape[1]} padded heads")
    _check(m <= q_buf.shape[0], f"{op}: {m} tokens do not fit the buffer's {q_buf.shape[0]} rows")
    _check(q.dtype == BF16 and q_buf.dtype == BF16,
           f"{op}: q and q_buf must be bfloat16, got {q.dtype} / {q_buf.dtype}")
    _check(torch._debug_has_internal_overlap(q_buf) != 1, f"{op}: q_buf has elements that share memory "
           f"(strides {tuple(q_buf.stride())}): a store would write them more than once")
    _check_rope_tables(op, cos, sin, m, d)
    one_device(op, q_buf, q, cos, sin)


def check_kv_compute_args(
    op: str, kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, block: int
) -> None:
    _check(kv.dim() == 2, f"{op}: kv must be [M, head_dim], got {tuple(kv.shape)}")
    m, d = kv.shape
    _check(tuple(weight.shape) == (d,), f"{op}: norm weight must be [{d}], got {tuple(weight.shape)}")
    _check(kv.dtype == BF16, f"{op}: kv must be bfloat16, got {kv.dtype}")
    _check(weight.dtype == F32, f"{op}: norm weight must be float32, got {weight.dtype}")
    _check(math.isfinite(eps) and eps > 0, f"{op}: eps must be finite and > 0, got {eps}")
    _check(block >= 1 and d % block == 0, f"{op}: FP8 block {block} must divide head_dim {d}")
    _check_rope_tables(op, cos, sin, m, d)
    one_device(op, kv, weight, cos, sin)


def check_kv_args(
    cache: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float,
    cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, block: int,
) -> None:
    """Clear errors for inputs ``kv_rope_quant_store`` cannot take."""
    op = "kv_rope_quant_store"
    check_kv_compute_args(op, kv, weight, eps, cos, sin, block)
    m, d = kv.shape
    _check(cache.dim() == 2 and cache.shape[1] == d, f"{op}: cache must be [slots, {d}], got {tuple(cache.shape)}")
    _check(cache.dtype == BF16, f"{op}: cache must be bfloat16, got {cache.dtype}")
    _check(torch._debug_has_internal_overlap(cache) != 1, f"{op}: cache has elements that share memory "
           f"(strides {tuple(cache.stride())}): a store would write them more than once")
    _check(tuple(slots.shape) == (m,), f"{op}: slots must be [M] = [{m}], got {tuple(slots.shape)}")
    _check(slots.dtype == torch.int64, f"{op}: slots must be int64, got {slots.dtype}")
    one_device(op, cache, kv, slots)


# ---------------------------------------------------------------------------
# q_rope_store
# ---------------------------------------------------------------------------
@torch.library.custom_op("dsv41::q_rope_store", mutates_args=("q_buf",))
def q_rope_store(
    q_buf: torch.Tensor, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, providers: str, op_mode: int
) -> None:
    check_q_args(q_buf, q, cos, sin)
    if q.shape[0] == 0:
        return
    dispatch("q_rope_store", providers, op_mode, q_buf, q, cos, sin)


@q_rope_store.register_fake
def _q_rope_store_fake(q_buf, q, cos, sin, providers, op_mode):
    one_device("q_rope_store", q_buf, q, cos, sin)
    return None


def rope_tail_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` with its last ``2 * cos.shape[-1]`` dims rotated (DeepSeek's complex spelling, one rounding)."""
    rd = 2 * cos.shape[-1]
    y = x.clone()
    # (contiguous: view_as_complex needs a unit stride in the last dim, which a transposed q lacks)
    y[..., x.shape[-1] - rd:] = apply_rotary_complex(x[..., x.shape[-1] - rd:].contiguous(), torch.complex(cos, sin))
    return y


@register_provider("q_rope_store", "reference")
def _q_rope_store_reference(q_buf, q, cos, sin, *, batch_invariant):
    m, h, _ = q.shape
    q_buf[:m, :h] = rope_tail_reference(q, cos, sin)


def _word_aligned(t: torch.Tensor) -> bool:
    """The data pointer on a 4-byte boundary (a storage may itself start off one); a fake tensor (the pass choosing a
    provider at compile time) has no pointer: its storage offset is what is known then."""
    try:
        return t.data_ptr() % 4 == 0
    except RuntimeError:
        return t.storage_offset() % 2 == 0


def _pair_words_why(**tensors: torch.Tensor) -> str | None:
    """The kernels move bf16 pairs as int32 words: even head_dim, unit last stride, even strides/offset."""
    for name, t in tensors.items():
        if t.shape[-1] % 2:
            return f"{name}: odd head_dim {t.shape[-1]}"
        if t.stride(-1) != 1:
            return f"{name}: head_dim not contiguous"
        if not _word_aligned(t) or any(s % 2 for s in t.stride()[:-1]):
            return f"{name}: odd stride or offset (bf16 pairs not 4-byte aligned)"
    return None


def _q_rope_store_triton_ok(q_buf, q, cos, sin, *, batch_invariant):
    return triton_available(q_buf) or _pair_words_why(q=q, q_buf=q_buf)


@register_provider("q_rope_store", "triton", _q_rope_store_triton_ok)
def _q_rope_store_triton(q_buf, q, cos, sin, *, batch_invariant):
    from .triton import rope_store as tk

    tk.q_rope_store(q_buf, q, cos, sin, batch_invariant=batch_invariant)


# ---------------------------------------------------------------------------
# kv_rope_quant_store
# ---------------------------------------------------------------------------
@torch.library.custom_op("dsv41::kv_rope_quant_store", mutates_args=("cache",))
def kv_rope_quant_store(
    cache: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float,
    cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, block: int, providers: str, op_mode: int,
) -> torch.Tensor:
    check_kv_args(cache, kv, weight, eps, cos, sin, slots, block)
    if kv.shape[0] == 0:
        return torch.empty_like(kv, memory_format=torch.contiguous_format)
    return dispatch("kv_rope_quant_store", providers, op_mode, cache, kv, weight, eps, cos, sin, slots, block)


@kv_rope_quant_store.register_fake
def _kv_rope_quant_store_fake(cache, kv, weight, eps, cos, sin, slots, block, providers, op_mode):
    one_device("kv_rope_quant_store", cache, kv, weight, cos, sin, slots)
    return kv.new_empty(kv.shape)


def kv_rope_quant_reference(
    kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, block: int
) -> torch.Tensor:
    """The model's KV path: RMSNorm -> bf16, RoPE on the tail -> bf16, FP8 round trip."""
    return fp8_block_qdq(rope_tail_reference(rms_norm(kv, weight, eps), cos, sin), block).contiguous()


@register_provider("kv_rope_quant_store", "reference")
def _kv_rope_quant_store_reference(cache, kv, weight, eps, cos, sin, slots, block, *, batch_invariant):
    out = kv_rope_quant_reference(kv, weight, eps, cos, sin, block)
    cache.index_put_((slots,), out)
    return out


# ``kv_rope_quant``: the same computation without the store. The pass uses it when the
# graph reads the cache's old value after the store: the store then moves after those
# reads (see patterns.rope_store.order_stores) so that the cache is still written in place.
@torch.library.custom_op("dsv41::kv_rope_quant", mutates_args=())
def kv_rope_quant(
    kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, block: int,
    providers: str, op_mode: int,
) -> torch.Tensor:
    check_kv_compute_args("kv_rope_quant", kv, weight, eps, cos, sin, block)
    if kv.shape[0] == 0:
        return torch.empty_like(kv, memory_format=torch.contiguous_format)
    return dispatch("kv_rope_quant", providers, op_mode, kv, weight, eps, cos, sin, block)


@kv_rope_quant.register_fake
def _kv_rope_quant_fake(kv, weight, eps, cos, sin, block, providers, op_mode):
    one_device("kv_rope_quant", kv, weight, cos, sin)
    return kv.new_empty(kv.shape)


@register_provider("kv_rope_quant", "reference")
def _kv_rope_quant_reference(kv, weight, eps, cos, sin, block, *, batch_invariant):
    return kv_rope_quant_reference(kv, weight, eps, cos, sin, block)


def _kv_triton_why(kv: torch.Tensor, block: int, cache: torch.Tensor | None) -> str | None:
    return triton_available(kv) or _kv_layout_why(kv, block, cache)


def _kv_layout_why(kv: torch.Tensor, block: int, cache: torch.Tensor | None) -> str | None:
    if block % 2 or block & (block - 1):
        return f"FP8 block {block} is not an even power of two"
    return _pair_words_why(kv=kv, **({} if cache is None else dict(cache=cache)))


def _kv_store_triton_ok(cache, kv, weight, eps, cos, sin, slots, block, *, batch_invariant):
    return _kv_triton_why(kv, block, cache)


@register_provider("kv_rope_quant_store", "triton", _kv_store_triton_ok)
def _kv_rope_quant_store_triton(cache, kv, weight, eps, cos, sin, slots, block, *, batch_invariant):
    from .triton import kv_rope_quant as tk

    return tk.kv_rope_quant(kv, weight, eps, cos, sin, block, cache, slots, batch_invariant=batch_invariant)


def _kv_triton_ok(kv, weight, eps, cos, sin, block, *, batch_invariant):
    return _kv_triton_why(kv, block, None)


@register_provider("kv_rope_quant", "triton", _kv_triton_ok)
def _kv_rope_quant_triton(kv, weight, eps, cos, sin, block, *, batch_invariant):
    from .triton import kv_rope_quant as tk

    return tk.kv_rope_quant(kv, weight, eps, cos, sin, block, batch_invariant=batch_invariant)


# ---------------------------------------------------------------------------
# warm-up / tuning: the Triton kernels at a model's per-rank shapes
# ---------------------------------------------------------------------------
def tunables(config, device=None) -> list:
    """``tuning.Tunable`` entries for this family's Triton kernels at ``config``'s per-rank shapes.

    ``make_inputs(m, device)`` builds the inputs; ``device`` is unused (kept for a uniform signature).
    """
    from ..tuning import Tunable
    from .triton import kv_rope_quant as tkv
    from .triton import rope_store as tk

    h, hpad, d = config.local_heads, config.padded_heads, config.head_dim
    rd, block = config.qk_rope_head_dim, config.kv_quant_block

    def tables(m: int, dev):
        ang = torch.rand(m, rd // 2, device=dev) * 6.283
        return torch.cos(ang), torch.sin(ang)

    def q_inputs(m: int, dev) -> tuple:
        q = torch.randn(m, h, d, device=dev).to(BF16)
        return (torch.zeros(m, hpad, d, dtype=BF16, device=dev), q, *tables(m, dev))

    def kv_inputs(m: int, dev) -> tuple:
        kv = torch.randn(m, d, device=dev).to(BF16)
        cache = torch.zeros(m + 1, d, dtype=BF16, device=dev)
        slots = torch.randperm(m, device=dev)
        return (kv, torch.ones(d, device=dev), 1e-6, *tables(m, dev), block, cache, slots)

    def run_q(inputs: tuple, cfg: dict):
        tk.q_rope_store(*inputs, batch_invariant=False, config=cfg)

    def run_kv(inputs: tuple, cfg: dict):
        return tkv.kv_rope_quant(*inputs, batch_invariant=False, config=cfg)

    def run_kv_compute(inputs: tuple, cfg: dict):
        return tkv.kv_rope_quant(*inputs[:6], batch_invariant=False, config=cfg)

    kv_key = dict(d=d, rd=rd, block=block)

    def kv_untuned(m: int) -> dict:
        return tkv.kv_untuned_config(m, d, rd, block)

    # only what the Triton provider takes at these shapes (elsewhere the op runs the reference provider)
    meta = dict(dtype=BF16, device="meta")
    out = []
    if _pair_words_why(q=torch.empty(1, h, d, **meta), q_buf=torch.empty(1, hpad, d, **meta)) is None:
        out.append(Tunable("q_rope_store", dict(h=h, d=d, rd=rd), q_inputs, run_q, tk.CANDIDATES["q_rope_store"],
                           tk.Q_DEFAULT))
    if _kv_layout_why(torch.empty(1, d, **meta), block, torch.empty(1, d, **meta)) is None:
        kv_default = tkv.kv_default_config(d, rd, block)
        out += [
            Tunable("kv_rope_quant_store", kv_key, kv_inputs, run_kv, tkv.CANDIDATES["kv_rope_quant_store"],
                    kv_default, untuned=kv_untuned),
            Tunable("kv_rope_quant", kv_key, kv_inputs, run_kv_compute, tkv.CANDIDATES["kv_rope_quant"], kv_default,
                    untuned=kv_untuned),
        ]
    return out
