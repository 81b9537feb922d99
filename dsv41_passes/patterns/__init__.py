"""Fusion patterns, one module per family; :data:`GROUPS` registers each family lazily."""

from __future__ import annotations

from .base import FusionPattern, PassContext, PatternGroup, Site, Spelling, pass_context


def _mhc():
    from . import mhc

    return mhc.patterns()


def _mhc_rewriters():
    from . import mhc_stats

    return [mhc_stats.rewrite]


def _rope_store():
    from . import rope_store

    return rope_store.patterns()


def _wo_a():
    from . import wo_a

    return wo_a.patterns()


GROUPS: dict[str, PatternGroup] = {
    "mhc": PatternGroup("mhc", _mhc, _mhc_rewriters),
    "rope_store": PatternGroup("rope_store", _rope_store),
    "wo_a": PatternGroup("wo_a", _wo_a),
}

__all__ = ["FusionPattern", "GROUPS", "PassContext", "PatternGroup", "Site", "Spelling", "pass_context"]
