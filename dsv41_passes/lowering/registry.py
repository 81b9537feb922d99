"""Providers of the fused ops and how one is chosen.

Every fused op has a ``reference`` provider (plain torch, runs anywhere, the
numerics oracle) and may have ``triton`` and ``tilelang`` ones. A provider
declares ``supported(*args, batch_invariant=...) -> str | None`` (``None`` when
it can run these arguments, else the reason it cannot). The op walks the
priority list baked into the graph and runs the first provider that accepts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

ProviderFn = Callable[..., Any]
SupportFn = Callable[..., "str | None"]

PROVIDER_NAMES = ("tilelang", "triton", "reference")


@dataclass(frozen=True)
class Provider:
    op: str
    name: str
    fn: ProviderFn
    supported: SupportFn
    wants_mode: bool = False  # the provider also takes the raw ``mode`` bits (e.g. static weights)


_REGISTRY: dict[str, dict[str, Provider]] = {}


def register_provider(
    op: str, name: str, supported: SupportFn | None = None, wants_mode: bool = False
) -> Callable[[ProviderFn], ProviderFn]:
    """Register ``fn(*op_args, batch_invariant=bool[, mode=int])`` as provider ``name`` of ``op``."""
    if name not in PROVIDER_NAMES:
        raise ValueError(f"unknown provider {name!r}; expected one of {PROVIDER_NAMES}")

    def deco(fn: ProviderFn) -> ProviderFn:
        _REGISTRY.setdefault(op, {})[name] = Provider(op, name, fn, supported or (lambda *a, **k: None), wants_mode)
        return fn

    return deco


def providers_of(op: str) -> dict[str, Provider]:
    return dict(_REGISTRY.get(op, {}))


class Defer(str):
    """A provider's decline for speed, not ability: it gives way to provider ``to`` only where ``to`` comes later in
    the priority and takes the inputs; elsewhere (``to`` left out of the priority, or declining) it runs."""

    to: str

    def __new__(cls, reason: str, to: str) -> "Defer":
        d = super().__new__(cls, reason)
        d.to = to
        return d


def choose(op: str, priority: str, batch_invariant: bool, *args: Any) -> tuple[Provider | None, list[str]]:
    """First provider in ``priority`` (comma-separated) that supports ``args``; plus why others declined."""
    why: list[str] = []
    table = _REGISTRY.get(op, {})
    names = priority.split(",")
    answers: dict[str, str | None] = {}  # each provider's supported() asked once (a Defer asks its target early)

    def ask(p: Provider) -> str | None:
        if p.name not in answers:
            answers[p.name] = p.supported(*args, batch_invariant=batch_invariant)
        return answers[p.name]

    for i, name in enumerate(names):
        p = table.get(name)
        if p is None:
            why.append(f"{name}: not implemented for {op}")
            continue
        reason = ask(p)
        if isinstance(reason, Defer):
            target = table.get(reason.to) if reason.to in names[i + 1:] else None
            if target is None or ask(target) is not None:
                why.append(f"{name}: runs although {reason} ({reason.to} is not a later provider that takes these "
                           "inputs)")
                return p, why
        if reason is None:
            return p, why
        why.append(f"{name}: {reason}")
    return None, why


MODE_BATCH_INVARIANT = 1  # fixed, M-independent configs
MODE_FOLLOWS_GLOBAL = 2  # the graph follows the global batch-invariant mode: check it at run time
MODE_STATIC_WEIGHTS = 4  # derived weights are built once; an in-place weight update is an error


def encode_mode(batch_invariant: bool, follows_global: bool = False, static_weights: bool = False) -> int:
    """The ``mode`` argument every fused op carries (a bit set; see the MODE_* constants)."""
    return (
        (MODE_BATCH_INVARIANT if batch_invariant else 0)
        | (MODE_FOLLOWS_GLOBAL if follows_global else 0)
        | (MODE_STATIC_WEIGHTS if static_weights else 0)
    )


def decode_mode(mode: int) -> tuple[bool, bool]:
    return bool(mode & MODE_BATCH_INVARIANT), bool(mode & MODE_FOLLOWS_GLOBAL)


def static_weights(mode: int) -> bool:
    return bool(mode & MODE_STATIC_WEIGHTS)


def dispatch(op: str, priority: str, mode: int, *args: Any) -> Any:
    from ..guards import check_mode

    batch_invariant, follows = decode_mode(mode)
    check_mode(batch_invariant, follows)
    p, why = choose(op, priority, batch_invariant, *args)
    if p is None:
        raise RuntimeError(f"dsv41::{op}: no provider can run these inputs ({'; '.join(why)})")
    kw = {"batch_invariant": batch_invariant, "mode": mode} if p.wants_mode else {"batch_invariant": batch_invariant}
    dev = _cuda_device_of(args)
    if dev is not None and dev.index != torch.cuda.current_device():
        # Triton and TileLang launch on the current device: run where the inputs are (as torch's own ops do)
        with torch.cuda.device(dev):
            return p.fn(*args, **kw)
    return p.fn(*args, **kw)


def _cuda_device_of(args: tuple) -> torch.device | None:
    """The device of the first CUDA tensor argument (one_device() has checked they agree), else None."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device if a.device.type == "cuda" else None
    return None


def one_device(op: str, *tensors: torch.Tensor | None) -> None:
    """Every tensor argument of an op on one device (None skipped). The ops' argument checks and their fake impls
    both call it: a call mixing ``meta`` with real tensors dispatches to the fake impl, which would otherwise return
    an empty tensor (or skip a store) where the real op raises."""
    devs = {t.device for t in tensors if isinstance(t, torch.Tensor)}
    if len(devs) > 1:
        raise ValueError(f"{op}: all inputs must be on one device, got {sorted(map(str, devs))}")


def m_below(m, bound: int) -> bool:
    """``m < bound`` when that is known without a guard: a concrete M is compared; a symbolic one (the
    pass choosing a provider at compile time, for the report) gives False, so no supported() check
    puts a guard on the token count (a guard on it recompiles the graph for other lengths)."""
    if isinstance(m, int):
        return m < bound
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(m < bound))


# ---------------------------------------------------------------- availability
def triton_available(t: torch.Tensor) -> str | None:
    """Triton runs CUDA tensors, or CPU tensors under TRITON_INTERPRET=1."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the install
        return "triton is not installed"
    if t.device.type == "cuda":
        return None
    if t.device.type in ("cpu", "meta") and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"{t.device.type} tensors need CUDA or TRITON_INTERPRET=1"


def tilelang_available(t: torch.Tensor) -> str | None:
    if t.device.type != "cuda":
        return "TileLang kernels need a CUDA device"
    try:
        import tilelang  # noqa: F401
    except Exception:
        return "tilelang is not installed"
    major, minor = torch.cuda.get_device_capability(t.device)
    if (major, minor) != (9, 0):
        return f"TileLang kernels are built for sm_90a, device is sm_{major}{minor}"
    return None
