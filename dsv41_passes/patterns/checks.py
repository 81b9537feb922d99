"""Small predicates for patterns' domain checks. Each returns None when fine, else a reason."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true


def same(a: Any, b: Any) -> bool:
    """Sizes known equal without installing a guard."""
    return bool(statically_known_true(a == b))


def first_failure(*reasons: str | None) -> str | None:
    for r in reasons:
        if r:
            return r
    return None


def want_dtype(name: str, t: Any, dtype: torch.dtype) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"{name} is not a tensor"
    return None if t.dtype == dtype else f"{name} dtype {t.dtype}, expected {dtype}"


def is_contiguous_rows(name: str, t: torch.Tensor) -> str | None:
    """Row-major with a unit last stride and dense inner dims (token dim may be strided)."""
    if t.dim() == 0:
        return None
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if not same(stride, expect):
            return f"{name} is not row-contiguous (strides {tuple(t.stride())})"
        expect = expect * size
    if not same(t.stride()[-1], 1):
        return f"{name} last dim is strided"
    return None


def want_value(name: str, got: Any, ok: bool, expect: str) -> str | None:
    return None if ok else f"{name} = {got!r}, expected {expect}"
