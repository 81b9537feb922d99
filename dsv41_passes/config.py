"""PassConfig: what the passes rewrite and how the fused ops choose kernels."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

from .guards import is_batch_invariant, strict_bool

FAMILIES = ("mhc", "rope_store", "wo_a")
_FLAGS = (*FAMILIES, "static_weights", "mhc_boundary", "batch_invariant")
_PROVIDERS = ("tilelang", "triton", "reference")


@dataclass(frozen=True)
class PassConfig:
    """Switches of the dsv41 passes.

    mhc, rope_store, wo_a: fusion families on/off.
    batch_invariant: True/False, or None to follow the global mode
        (``dsv41_passes.batch_invariant()`` / ``DSV41_BATCH_INVARIANT=1``) at compile time.
    providers: kernel priority; the fused op runs the first provider that supports its inputs.
    dump_dir: write before/after graphs, every registered pattern and the report there.
    static_weights: the mHC projection's derived (split) weights are built once; an in-place
        weight update is then rejected with an error instead of refreshing them.
    mhc_boundary: each mHC post is fused with the next sub-block's ``mhc_pre`` into ``mhc_boundary``
        (same bits; its Triton provider, untuned and outside batch-invariant mode, picks the form by M: see
        ``lowering.triton.mhc_common.untuned_config``).
    """

    mhc: bool = True
    rope_store: bool = True
    wo_a: bool = True
    batch_invariant: bool | None = None
    providers: tuple[str, ...] = _PROVIDERS
    dump_dir: str | None = None
    static_weights: bool = False
    mhc_boundary: bool = True
    hc_sinkhorn_iters: int = 20

    def __post_init__(self) -> None:
        for name in _FLAGS:
            value = getattr(self, name)
            if value is None and name == "batch_invariant":  # (None: follow the global mode)
                continue
            allowed = "True, False or None" if name == "batch_invariant" else "True or False"
            object.__setattr__(self, name, strict_bool(value, f"PassConfig.{name}", allowed))
        if isinstance(self.providers, str):
            raise ValueError(f"PassConfig.providers must be a tuple of names, e.g. ('triton', 'reference'), got the "
                             f"string {self.providers!r}")
        provs = tuple(self.providers)
        object.__setattr__(self, "providers", provs)
        bad = [p for p in provs if p not in _PROVIDERS]
        if bad:
            raise ValueError(f"PassConfig.providers: unknown {bad} (choose from {_PROVIDERS})")
        iters = self.hc_sinkhorn_iters
        # operator.index takes ints and numpy's (kept as int: the uuid is JSON), no float or string
        if isinstance(iters, bool) or not hasattr(type(iters), "__index__") or operator.index(iters) < 1:
            raise ValueError(f"PassConfig.hc_sinkhorn_iters must be an int >= 1 (the model's Sinkhorn count), got "
                             f"{iters!r}")
        object.__setattr__(self, "hc_sinkhorn_iters", operator.index(iters))
        if not provs or provs[-1] != "reference" or len(set(provs)) != len(provs):
            raise ValueError(f"PassConfig.providers must name each provider once and end with 'reference', the last "
                             f"resort (a provider after it never runs), got {provs}")

    def resolved_batch_invariant(self) -> bool:
        return is_batch_invariant() if self.batch_invariant is None else bool(self.batch_invariant)

    def families(self) -> tuple[str, ...]:
        return tuple(f for f in FAMILIES if getattr(self, f))

    def cache_key(self) -> dict[str, Any]:
        """Everything that changes the rewritten graph (dump_dir does not)."""
        d = dataclasses.asdict(self)
        d.pop("dump_dir")
        d["batch_invariant"] = self.resolved_batch_invariant()
        d["providers"] = list(self.providers)
        return d

    def replace(self, **changes: Any) -> "PassConfig":
        return dataclasses.replace(self, **changes)
