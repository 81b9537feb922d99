"""rope_store patterns."""

from __future__ import annotations


def patterns():
    return []
