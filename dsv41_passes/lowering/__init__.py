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


def tactic_candidates() -> dict[str, list[dict]]:
    """Every config a tuned entry may hold, by the op name its kernel reads tactics under (the warm-up records only
    these; ``tuning.load_tactics`` drops any other). Kernel modules that cannot be imported here give no entry."""
    out: dict[str, list[dict]] = {}
    try:
        from .triton import kv_rope_quant, mhc_common
        from .triton import rope_store as triton_rope_store
        from .triton import wo_a as triton_wo_a
    except ImportError:  # no Triton: none of its kernels runs here
        pass
    else:
        for table in (mhc_common.CANDIDATES, triton_rope_store.CANDIDATES, kv_rope_quant.CANDIDATES,
                      triton_wo_a.CANDIDATES):
            out.update(table)
    from .tilelang import mhc as tilelang_mhc
    from .tilelang import wo_a_configs

    out["mhc_stats.tilelang"] = tilelang_mhc.CANDIDATES["mhc_stats"]
    out[wo_a_configs.TACTIC_OP] = wo_a_configs.CANDIDATES[wo_a_configs.TACTIC_OP]
    return out


__all__ = ["PROVIDER_NAMES", "choose", "providers_of", "tactic_candidates", "tunables_for"]
