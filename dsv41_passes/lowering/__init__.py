"""Fused ops (``torch.ops.dsv41.*``), their fake implementations and providers.

Importing this package registers every op; kernels are imported lazily by the
providers that run them.
"""

from . import matmul, mhc, rope_store, wo_a  # noqa: F401  (registers torch.ops.dsv41.*)
from .registry import PROVIDER_NAMES, choose, providers_of

FAMILIES = (mhc, rope_store, wo_a)


def tunables_for(config, device=None) -> list:
    """Every kernel the warm-up compiles and tunes, at ``config``'s per-rank shapes."""
    out = []
    for fam in FAMILIES:
        if hasattr(fam, "tunables"):
            out.extend(fam.tunables(config, device))
    return out


__all__ = ["PROVIDER_NAMES", "choose", "providers_of", "tunables_for"]
