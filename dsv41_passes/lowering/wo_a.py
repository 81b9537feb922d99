"""WO-A fused op (namespace ``dsv41``): custom op, fake implementation, providers.

``wo_a(o, weight, cos, sin, rope_dim) -> z``
    ``o [M, H, D]`` bf16 attention output, token-major (the token stride may exceed
    ``H*D``); ``weight [G*R, K]`` bf16, the ``wo_a.weight`` as stored, ``K = (H/G)*D``;
    ``cos``/``sin`` fp32 ``[M, rope_dim/2]`` or both ``None``.

    With ``cos``/``sin``, the last ``rope_dim`` dims of every head are de-rotated first
    (inverse interleaved RoPE in fp32, rounded to bf16 like the reference:
    ``y0 = x0*c + x1*s``, ``y1 = -x0*s + x1*c``). Then, per group ``g`` (heads
    ``g*H/G ... (g+1)*H/G - 1``), ``z[:, g*R:(g+1)*R] = og[:, g, :] @ Wa[g]^T`` with
    fp32 accumulation and one bf16 rounding; ``z [M, G*R]`` bf16 is contiguous.
"""

from __future__ import annotations

import math

import torch

from ..reference.rope import apply_rotary_real
from .registry import Defer, dispatch, m_below, one_device, register_provider, tilelang_available, triton_available

OP = "wo_a"


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"wo_a: {msg}")


def geometry(o: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(M, H, D, G, R, K) of valid inputs; G is read from the weight's row length K = H*D/G."""
    m, h, d = o.shape
    n, k = weight.shape
    g = h * d // k
    return m, h, d, g, n // g, k


def split_parts(requested: int, heads_per_group: int, batch_invariant: bool, provider: str) -> int:
    """Split-K parts a config asks for, clipped to a divisor of the group's heads (whole heads per part).
    Split-K sums the parts in its own order, so batch-invariant mode refuses it."""
    parts = math.gcd(requested, heads_per_group)
    if parts > 1 and batch_invariant:
        raise ValueError(f"wo_a ({provider}): split-K configs are not batch-invariant (their sum order is theirs)")
    return parts


def check_args(
    o: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, rope_dim: int
) -> None:
    """Clear errors for inputs the op cannot take (the pattern checks the same facts before rewriting)."""
    _check(o.dim() == 3, f"o must be [M, H, D], got shape {tuple(o.shape)}")
    _check(weight.dim() == 2, f"weight must be [G*R, K], got shape {tuple(weight.shape)}")
    _check(o.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16,
           f"o and weight must be bfloat16, got {o.dtype} and {weight.dtype}")
    m, h, d = o.shape
    n, k = weight.shape
    _check(h > 0 and d > 0, f"o must have heads and a head dim, got shape {tuple(o.shape)}")
    _check(n > 0, f"weight must have rows (G*R > 0), got shape {tuple(weight.shape)}")
    _check(k > 0 and (h * d) % k == 0, f"weight row length {k} does not divide H*D = {h * d}")
    g = h * d // k
    _check(h % g == 0, f"{g} groups do not split {h} heads evenly (K = {k}, D = {d})")
    _check(n % g == 0, f"weight rows {n} are not a multiple of the group count {g}")
    _check(o.stride(2) == 1 and (o.stride(1) == d or h == 1),
           f"o must have contiguous heads (strides {tuple(o.stride())})")
    _check(weight.stride(1) == 1, f"weight rows must be contiguous (strides {tuple(weight.stride())})")
    _check((cos is None) == (sin is None), "cos and sin must be given together")
    if cos is not None:
        assert sin is not None
        _check(rope_dim > 0 and rope_dim % 2 == 0 and rope_dim <= d,
               f"rope_dim must be even and in (0, D = {d}], got {rope_dim}")
        for name, t in (("cos", cos), ("sin", sin)):
            _check(t.dtype == torch.float32, f"{name} must be float32, got {t.dtype}")
            _check(tuple(t.shape) == (m, rope_dim // 2), f"{name} must be [M, rope_dim/2] = {(m, rope_dim // 2)}, "
                                                          f"got {tuple(t.shape)}")
    one_device(OP, o, weight, cos, sin)


@torch.library.custom_op("dsv41::wo_a", mutates_args=())
def wo_a(
    o: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rope_dim: int,
    providers: str,
    mode: int,
) -> torch.Tensor:
    """Inverse RoPE on each head's tail + grouped low-rank projection, written token-major ``[M, G*R]``."""
    check_args(o, weight, cos, sin, rope_dim)
    return dispatch(OP, providers, mode, o, weight, cos, sin, rope_dim)


@wo_a.register_fake
def _wo_a_fake(o, weight, cos, sin, rope_dim, providers, mode):
    one_device("wo_a", o, weight, cos, sin)
    return o.new_empty((o.shape[0], weight.shape[0]))


# ---------------------------------------------------------------- reference
def wo_a_reference(
    o: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, rope_dim: int,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The model's math in plain torch (the numerics oracle); in batch-invariant mode the grouped product sums K
    in index order (``matmul.ordered_matmul``): a library bmm picks its reduction order by M."""
    m, h, d, g, r, k = geometry(o, weight)
    if cos is not None:
        o = o.clone()
        tail = o[..., d - rope_dim :]
        o[..., d - rope_dim :] = apply_rotary_real(tail, cos, sin, inverse=True)
    if batch_invariant:
        from .matmul import ordered_matmul

        z = ordered_matmul(o.reshape(m, g, k).transpose(0, 1), weight.view(g, r, k).transpose(1, 2)).transpose(0, 1)
    else:
        z = torch.einsum("mgd,grd->mgr", o.reshape(m, g, k), weight.view(g, r, k))
    return z.reshape(m, g * r).contiguous()


@register_provider(OP, "reference")
def _wo_a_reference(o, weight, cos, sin, rope_dim, *, batch_invariant):
    return wo_a_reference(o, weight, cos, sin, rope_dim, batch_invariant)


# ---------------------------------------------------------------- triton
def _wo_a_triton_ok(o, weight, cos, sin, rope_dim, *, batch_invariant):
    why = triton_available(o)
    if why:
        return why
    from .triton import wo_a as tk  # noqa: PLC0415  (kernels load lazily)

    return tk.unsupported_reason(o, weight, rope_dim if cos is not None else 0)


@register_provider(OP, "triton", _wo_a_triton_ok)
def _wo_a_triton(o, weight, cos, sin, rope_dim, *, batch_invariant):
    from .triton import wo_a as tk

    return tk.wo_a(o, weight, cos, sin, rope_dim, batch_invariant=batch_invariant)


# ---------------------------------------------------------------- tilelang
def _wo_a_tilelang_ok(o, weight, cos, sin, rope_dim, *, batch_invariant):
    why = tilelang_available(o)
    if why:
        return why
    from .tilelang import wo_a as tl_wo_a
    from .triton import wo_a as tk

    if not batch_invariant and m_below(o.shape[0], tk.SPLIT_K_MAX_M + 1):
        return Defer(f"M <= {tk.SPLIT_K_MAX_M} outside batch-invariant mode: the Triton split-K kernel is faster",
                     "triton")
    return tl_wo_a.unsupported_reason(o, weight, rope_dim if cos is not None else 0)


@register_provider(OP, "tilelang", _wo_a_tilelang_ok)
def _wo_a_tilelang(o, weight, cos, sin, rope_dim, *, batch_invariant):
    from .tilelang import wo_a as tl_wo_a

    return tl_wo_a.wo_a(o, weight, cos, sin, rope_dim, batch_invariant=batch_invariant)


# ---------------------------------------------------------------- warm-up / tuning
def tunables(config, device=None) -> list:
    """``tuning.Tunable`` entries for this op's kernels at ``config``'s per-rank shapes (with the inverse RoPE).

    The TileLang entry is listed only where TileLang can run (sm_90 and tilelang installed).
    """
    from ..tuning import Tunable
    from .tilelang import wo_a as tl_wo_a
    from .triton import wo_a as tk

    h, d, rd = config.local_heads, config.head_dim, config.qk_rope_head_dim
    g, r = config.local_groups, config.o_lora_rank
    k = h // g * d

    def make_inputs(m: int, dev) -> tuple:
        o = torch.randn(m, h, d, device=dev).to(torch.bfloat16)
        w = (torch.randn(g * r, k, device=dev) / k**0.5).to(torch.bfloat16)
        ang = torch.rand(m, rd // 2, device=dev) * 6.283
        table = torch.stack((ang.cos(), ang.sin()), dim=-1)  # [M, rd/2, 2], as view_as_real of the complex table
        return o, w, table[..., 0], table[..., 1], rd

    def run_triton(inputs: tuple, cfg: dict):
        return tk.wo_a(*inputs, batch_invariant=False, config=cfg)

    def run_tilelang(inputs: tuple, cfg: dict):
        return tl_wo_a.wo_a(*inputs, batch_invariant=False, config=cfg)

    key = dict(g=g, r=r, k=k, d=d, rd=rd)
    # only the kernels that take these shapes (elsewhere the op runs another provider)
    meta = dict(dtype=torch.bfloat16, device="meta")
    o, w = torch.empty(1, h, d, **meta), torch.empty(g * r, k, **meta)
    out = []
    if tk.unsupported_reason(o, w, rd) is None:
        out.append(Tunable("wo_a", key, make_inputs, run_triton, tk.CANDIDATES["wo_a"], tk.BATCH_INVARIANT_CONFIG,
                           tk.default_config))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if tilelang_available(torch.empty(0, device=dev)) is None and tl_wo_a.unsupported_reason(o, w, rd) is None:
        out.append(Tunable(tl_wo_a.TACTIC_OP, key, make_inputs, run_tilelang, tl_wo_a.CANDIDATES[tl_wo_a.TACTIC_OP],
                           tl_wo_a.BATCH_INVARIANT_CONFIG, lambda m: tl_wo_a.untuned_config(m, g * r, k // d)))
    return out
