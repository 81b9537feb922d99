"""Global guard state: batch-invariant mode.

``batch_invariant(enabled=True)`` sets the mode at once and, used as a context
manager, restores the previous mode on exit. ``DSV41_BATCH_INVARIANT=1`` turns it
on for the process. A graph compiled in one mode bakes that mode into its fused
ops; running it after the mode changed raises (see ``check_mode``), and
``dsv41_passes.compile`` recompiles for the new mode instead.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator


def _env_default() -> bool:
    return os.environ.get("DSV41_BATCH_INVARIANT", "0").strip().lower() in ("1", "true", "on", "yes")


_STATE = {"batch_invariant": _env_default(), "changes": 0}


def _set(enabled: bool) -> None:
    _STATE["batch_invariant"] = enabled
    _STATE["changes"] += 1


def is_batch_invariant() -> bool:
    return _STATE["batch_invariant"]


def strict_bool(value: Any, what: str, allowed: str = "True or False") -> bool:
    """``value`` as a bool when it is one (numpy's too: kept as Python's, the uuid is JSON); a string is truthy
    whatever it says ("0", "false"), so it and anything else are a ValueError naming ``what``."""
    if isinstance(value, str) or value not in (True, False):
        raise ValueError(f"{what} must be {allowed}, got {value!r}")
    return bool(value)


class batch_invariant:  # noqa: N801  (used like a function)
    """Turn batch-invariant mode on (or off); as a context manager, restore the old mode on exit."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = strict_bool(enabled, "batch_invariant(enabled)")
        self._previous = [_STATE["batch_invariant"]]  # one a pending exit (entered again inside itself: two)
        _set(self.enabled)
        self._set_at = _STATE["changes"]  # (the plain-setter use ends here)

    def __enter__(self) -> "batch_invariant":
        if self._set_at != _STATE["changes"]:  # entered later than made, or again: apply its mode now
            self._previous.append(_STATE["batch_invariant"])
            _set(self.enabled)
        self._set_at = None
        return self

    def __exit__(self, *exc: object) -> None:
        _set(self._previous.pop())


@contextlib.contextmanager
def scoped_mode(enabled: bool) -> Iterator[None]:
    """The mode set for a block and put back after it, not counted as a change: a compile under its graph's mode
    leaves a ``batch_invariant`` object made before it as it was (entered later, it still restores the mode from
    before it was made)."""
    saved = _STATE["batch_invariant"]
    _STATE["batch_invariant"] = enabled
    try:
        yield
    finally:
        _STATE["batch_invariant"] = saved


def check_mode(compiled_batch_invariant: bool, follows_global: bool) -> None:
    """Raise when a graph that follows the global mode runs under the other mode."""
    if follows_global and compiled_batch_invariant != _STATE["batch_invariant"]:
        raise RuntimeError(
            "dsv41: this graph was compiled with batch_invariant="
            f"{compiled_batch_invariant}, but batch-invariant mode is now {_STATE['batch_invariant']}. "
            "Recompile (dsv41_passes.compile does this automatically) or pin PassConfig(batch_invariant=...)."
        )
