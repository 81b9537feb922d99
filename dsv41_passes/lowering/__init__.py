"""Fused ops (``torch.ops.dsv41.*``), their fake implementations and providers.

Importing this package registers every op; kernels are imported lazily by the
providers that run them.
"""

from . import mhc  # noqa: F401  (registers torch.ops.dsv41.mhc_*)
from .registry import PROVIDER_NAMES, choose, providers_of

__all__ = ["PROVIDER_NAMES", "choose", "providers_of"]
