"""WO-A patterns: inverse RoPE on the attention output tail + grouped low-rank projection.

Site kind ``wo_a``. The matched subgraph starts at the attention output ``o [M, H, D]``:

* inverse RoPE on the last ``rope_dim`` dims of every head, written back into ``o``
  (functionalised ``o[..., -rd:] = rope(o[..., -rd:])``: slice, copy, slice_scatter),
  in the complex spelling (conj table, as the model does) or the real cos/sin one;
  or no RoPE at all (the projection alone still fuses);
* ``og = o.view(M, G, -1)``, ``Wa = weight.view(G, R, K)`` and the grouped projection as
  ``einsum("mgd,grd->mgr")``, HF-style ``transpose -> bmm(x, Wa^T) -> transpose``,
  ``bmm`` on permuted views, or ``matmul``;
* reshape to ``[M, G*R]``.

The group count and the rope slice start are matched literals (scalar sentinels);
R, K, D and the rope width are read from the bound tensors and checked. Not matched:
one head per group (``G == H``: the grouped view is a no-op that Inductor removes).
"""

from __future__ import annotations

import functools

import torch

from .. import lowering  # noqa: F401  (registers torch.ops.dsv41.*)
from ..reference.rope import apply_rotary_complex, apply_rotary_real
from .base import M_EX, FusionPattern, Spelling, current_context
from .checks import first_failure, is_contiguous_rows, same, want_dtype

aten = torch.ops.aten
BF16, F32, C64 = torch.bfloat16, torch.float32, torch.complex64
END = 9223372036854775807  # the slice end Python's ``x[..., a:]`` records

# Example geometry: no dim equals M_EX (7) or a sentinel; the sentinels appear nowhere else.
G_EX, HPG_EX, D_EX, RD_EX, R_EX = 5, 2, 40, 12, 24
H_EX, K_EX = G_EX * HPG_EX, HPG_EX * D_EX
GROUPS_SENTINEL, ROPE_START_SENTINEL = G_EX, -RD_EX


# ------------------------------------------------------------------ inverse RoPE spellings
def _write_tail(o, rope_start, tail):
    """``o[..., rope_start:] = tail`` after functionalisation."""
    return aten.slice_scatter.default(o, aten.copy.default(o[..., rope_start:], tail), 2, rope_start, END)


def _inv_rope_complex(o, freqs, rope_start):
    return _write_tail(o, rope_start, apply_rotary_complex(o[..., rope_start:], freqs, inverse=True))


def _inv_rope_real(o, cos, sin, rope_start):
    return _write_tail(o, rope_start, apply_rotary_real(o[..., rope_start:], cos, sin, inverse=True))


# ------------------------------------------------------------------ projection spellings
def _proj_einsum(o, weight, groups):
    og = o.view(o.shape[0], groups, -1)
    wa = weight.view(groups, -1, og.shape[-1])
    return torch.einsum("mgd,grd->mgr", og, wa).flatten(1)


def _proj_hf_bmm(o, weight, groups):
    # transformers' DeepseekV4GroupedLinear
    x = o.reshape(-1, groups, o.shape[1] * o.shape[2] // groups).transpose(0, 1)
    w = weight.view(groups, -1, x.shape[-1]).transpose(1, 2)
    return torch.bmm(x, w).transpose(0, 1).reshape(o.shape[0], -1)


def _proj_permuted_bmm(o, weight, groups):
    og = o.view(o.shape[0], groups, -1)
    wa = weight.view(groups, -1, og.shape[-1])
    return torch.bmm(og.permute(1, 0, 2), wa.permute(0, 2, 1)).permute(1, 0, 2).reshape(o.shape[0], -1)


def _proj_matmul(o, weight, groups):
    og = o.view(o.shape[0], groups, -1)
    wa = weight.view(groups, -1, og.shape[-1])
    return torch.matmul(og.transpose(0, 1), wa.transpose(1, 2)).transpose(0, 1).flatten(1)


PROJECTIONS = {
    "einsum": _proj_einsum,
    "hf_bmm": _proj_hf_bmm,
    "permuted_bmm": _proj_permuted_bmm,
    "matmul": _proj_matmul,
}


def _with_complex_rope(proj):
    def search(o, freqs, weight, groups, rope_start):
        return proj(_inv_rope_complex(o, freqs, rope_start), weight, groups)

    return search


def _with_real_rope(proj):
    def search(o, cos, sin, weight, groups, rope_start):
        return proj(_inv_rope_real(o, cos, sin, rope_start), weight, groups)

    return search


def _without_rope(proj):
    def search(o, weight, groups):
        return proj(o, weight, groups)

    return search


# Spellings with the RoPE come first: at a site, the first spelling that matches wins,
# and the projection-only spelling would otherwise take the projection and leave the RoPE.
SPELLINGS = {
    **{f"complex_rope_{p}": _with_complex_rope(fn) for p, fn in PROJECTIONS.items()},
    **{f"real_rope_{p}": _with_real_rope(fn) for p, fn in PROJECTIONS.items()},
    **{f"no_rope_{p}": _without_rope(fn) for p, fn in PROJECTIONS.items()},
}


# ------------------------------------------------------------------ example inputs
def _o(m):
    return torch.empty(m, H_EX, D_EX, dtype=BF16)


def _w():
    return torch.empty(G_EX * R_EX, K_EX, dtype=BF16)


def _complex_inputs(m=M_EX):
    return [_o(m), torch.empty(m, RD_EX // 2, dtype=C64), _w(), GROUPS_SENTINEL, ROPE_START_SENTINEL]


def _real_inputs(m=M_EX):
    return [_o(m), torch.empty(m, RD_EX // 2, dtype=F32), torch.empty(m, RD_EX // 2, dtype=F32), _w(),
            GROUPS_SENTINEL, ROPE_START_SENTINEL]


def _plain_inputs(m=M_EX):
    return [_o(m), _w(), GROUPS_SENTINEL]


_ROPE_SCALARS = {"groups": GROUPS_SENTINEL, "rope_start": ROPE_START_SENTINEL}
# The decode graph (M = 1, specialised by Dynamo) decomposes every projection spelling with its
# size-1 dims permuted differently: each spelling is also traced at M = 1, for that graph only.
DECODE_M = 1


def _spelling(name: str, m: int | None = None) -> Spelling:
    tag = "" if m is None else f"@M{m}"
    inputs, scalars = {
        "complex": (_complex_inputs, _ROPE_SCALARS),
        "real": (_real_inputs, _ROPE_SCALARS),
        "no": (_plain_inputs, {"groups": GROUPS_SENTINEL}),
    }[name.split("_rope_")[0]]
    factory = inputs if m is None else functools.partial(inputs, m)
    return Spelling(name + tag, SPELLINGS[name], factory, scalars=dict(scalars), tokens=m)


# ------------------------------------------------------------------ domain check
def _projection_check(o, weight, groups) -> str | None:
    if not isinstance(o, torch.Tensor) or o.dim() != 3:
        return "o is not [M, H, D]"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return "weight is not a 2-D [G*R, K] tensor"
    _, h, d = o.shape
    n, k = weight.shape
    if not (isinstance(groups, int) and groups >= 1):
        return f"group count {groups!r} is not a positive int"
    if not isinstance(h, int) or h % groups:
        return f"{groups} groups do not split {h} heads evenly"
    want_k = (h // groups) * d
    return first_failure(
        want_dtype("o", o, BF16),
        want_dtype("weight", weight, BF16),
        is_contiguous_rows("o", o),
        None if same(k, want_k) and same(n % groups, 0)
        else f"weight {tuple(weight.shape)} is not [G*R, K] for G = {groups}, K = {want_k}",
        None if same(weight.stride(1), 1) and same(weight.stride(0), k)
        else f"weight is not row-contiguous (strides {tuple(weight.stride())})",
    )


def _rope_check(o, cos, sin, rope_start) -> str | None:
    m, _, d = o.shape
    if cos.dim() != 2 or not same(cos.shape[0], m):
        return f"rope table {tuple(cos.shape)} is not [M, rope_dim/2]"
    rd = 2 * cos.shape[1]
    if not (0 < rd <= d):
        return f"rope width {rd} outside (0, head_dim {d}]"
    if rope_start not in (-rd, d - rd):
        return f"rope slice starts at {rope_start}, not at the last {rd} dims of head_dim {d}"
    if sin is not None and (tuple(sin.shape) != tuple(cos.shape) or sin.dtype != cos.dtype):
        return f"sin {tuple(sin.shape)} {sin.dtype} does not match cos {tuple(cos.shape)} {cos.dtype}"
    return None


def _check(v) -> str | None:
    why = _projection_check(v["o"], v["weight"], v["groups"])
    if why or "rope_start" not in v:
        return why
    if "freqs" in v:
        return first_failure(want_dtype("freqs", v["freqs"], C64),
                             _rope_check(v["o"], v["freqs"], None, v["rope_start"]))
    return first_failure(want_dtype("cos", v["cos"], F32), want_dtype("sin", v["sin"], F32),
                         _rope_check(v["o"], v["cos"], v["sin"], v["rope_start"]))


# ------------------------------------------------------------------ replacement
def _replace(o, weight, groups, freqs=None, cos=None, sin=None, rope_start=None):
    ctx = current_context()
    rope_dim = 0
    if freqs is not None:
        table = torch.view_as_real(freqs)  # [M, rd/2, 2] views: no copy
        cos, sin = table[..., 0], table[..., 1]
    if cos is not None:
        rope_dim = 2 * cos.shape[-1]
    return torch.ops.dsv41.wo_a(o, weight, cos, sin, rope_dim, ctx.providers, ctx.mode)


def _provider_args(v):
    cos = sin = None
    if "freqs" in v:
        table = torch.view_as_real(v["freqs"])
        cos, sin = table[..., 0], table[..., 1]
    elif "cos" in v:
        cos, sin = v["cos"], v["sin"]
    return (v["o"], v["weight"], cos, sin, 0 if cos is None else 2 * cos.shape[-1])


def patterns() -> list[FusionPattern]:
    return [
        FusionPattern(
            kind="wo_a",
            family="wo_a",
            op="wo_a",
            spellings=[sp for name in SPELLINGS for sp in (_spelling(name), _spelling(name, DECODE_M))],
            replace=_replace,
            check=_check,
            provider_args=_provider_args,
        )
    ]
