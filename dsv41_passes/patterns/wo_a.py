"""wo_a patterns."""

from __future__ import annotations


def patterns():
    return []
