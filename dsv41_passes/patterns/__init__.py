"""Fusion patterns, one module per family; :data:`GROUPS` registers each family lazily."""

from __future__ import annotations

from .base import FusionPattern, PassContext, PatternGroup, Site, Spelling, pass_context


def _mhc():
    from . import mhc

    return mhc.patterns()


GROUPS: dict[str, PatternGroup] = {
    "mhc": PatternGroup("mhc", _mhc),
}

__all__ = ["FusionPattern", "GROUPS", "PassContext", "PatternGroup", "Site", "Spelling", "pass_context"]
