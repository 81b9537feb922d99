"""Fused ops (``torch.ops.dsv41.*``), their fake implementations and providers.

Importing this package registers every op; kernels are imported lazily by the
providers that run them.
"""

from . import matmul, mhc, rope_store, wo_a  # noqa: F401  (registers torch.ops.dsv41.*)
from .registry import PROVIDER_NAMES, choose, providers_of

__all__ = ["PROVIDER_NAMES", "choose", "providers_of"]
