"""Derived weights of the mHC projection: the fp32 ``fn`` split into three bf16 parts.

``hi = bf16(W)``, ``mid = bf16(W - hi)``, ``lo = bf16(W - hi - mid)`` (round to
nearest even each time). Each residual is exact in fp32 and has at most 16, then
8 significant bits, so ``hi + mid + lo == W`` exactly for normal values (a ``lo``
below bf16's normal range, ``|W| < ~2^-110``, or an ``hi`` that rounds to inf
near fp32's maximum are the exceptions). A bf16 activation times a bf16 part is
exact in fp32, so three tensor-core dots reproduce an fp32 projection up to the
fp32 accumulation.

The kernels read the parts as ``[3, K, NP]`` bf16: K-major rows of the mix
columns, zero-padded from ``N = (2 + n) * n`` to ``NP`` (a power of two).

Cache: one entry per weight tensor, keyed by its device, address, shape, strides
and dtype, holding a weak reference to the tensor and its version counter at
build time. An in-place update (``copy_``, an optimizer step,
``load_state_dict``) bumps the counter and the next call rebuilds the parts; a
freed weight drops its entry. With ``static=True`` (``PassConfig(static_weights=
True)``) the parts are built once and a changed counter raises before any kernel
runs, also where a dynamic caller of the same weight has rebuilt them since. An
entry also holds a weak reference to the weight's storage: a parameter given new
storage (``p.data = t``) rebuilds, even where the new storage lands at the old
address. Limits: in-place writes through ``.data`` and fused optimizer steps
(``torch.optim.*(fused=True)``) do not bump the counter (as for autograd): call
``clear_cache()`` after them; inference tensors have no counter (their parts are
rebuilt on every call, with a warning, unless static). A weight that is a view (one
layer of a stacked parameter) reaches the op as an alias the compiled graph makes at
every call, under ``dp.compile`` an inference tensor: its parts are rebuilt on every
call, static or not.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

NP_DEFAULT = 32  # mix columns padded to a power of two: the parts' row length
NUM_SLICES = 16  # fixed K partition of the compensated projection (depends on K only, never on M)
# widest chunk (columns) a kernel walks inside a K slice: part of the numerics (DSV41_MHC_CHUNK is for
# benchmarking other chunk widths; every mHC kernel of a process uses the same value)
CHUNK_MAX = int(os.environ.get("DSV41_MHC_CHUNK", "32"))


def slice_geometry(d: int) -> tuple[int, int]:
    """(DS, BK) for hidden ``d``: 16 K slices of DS hidden columns (all streams), walked in BK-column chunks.

    Shared by the Triton and TileLang kernels; BK is the largest power of two <= CHUNK_MAX dividing DS.
    """
    if d % NUM_SLICES:
        raise ValueError(f"mHC kernels: hidden {d} is not a multiple of {NUM_SLICES}")
    ds = d // NUM_SLICES
    return ds, min(CHUNK_MAX, ds & -ds)


def split_bf16x3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``w`` -> bf16 ``(hi, mid, lo)`` with ``hi + mid + lo == w`` for normal values."""
    if w.dtype != torch.float32:
        raise TypeError(f"split_bf16x3: the weight must be float32, got {w.dtype}")
    hi = w.to(torch.bfloat16)
    r1 = w - hi.float()
    mid = r1.to(torch.bfloat16)
    lo = (r1 - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def build_parts(fn: torch.Tensor, np_cols: int = NP_DEFAULT) -> torch.Tensor:
    """``fn [N, K]`` fp32 -> ``[3, K, np_cols]`` bf16 (hi, mid, lo; transposed, zero-padded columns)."""
    if fn.dim() != 2:
        raise ValueError(f"build_parts: fn must be [N, K], got {tuple(fn.shape)}")
    n, k = fn.shape
    if np_cols < n:
        raise ValueError(f"build_parts: cannot pad {n} mix columns to {np_cols}")
    parts = torch.zeros((3, k, np_cols), dtype=torch.bfloat16, device=fn.device)
    with torch.no_grad():
        for i, p in enumerate(split_bf16x3(fn.detach())):
            parts[i, :, :n] = p.t()
    return parts


@dataclass
class _Entry:
    ref: weakref.ref
    version: int | None
    parts: torch.Tensor
    storage: Any  # StorageWeakRef of the weight's storage at build time
    pinned: int | None = None  # the version a static caller first served (kept across a dynamic caller's rebuild)

    def same_tensor(self, fn: torch.Tensor) -> bool:
        """The entry's weight is alive and still holds the storage it was built from: a ``.data = new`` on a live
        parameter moves it to new storage, which may later land at the old address (same key, same version)."""
        return self.ref() is not None and not self.storage.expired() and self.storage.cdata == _storage(fn).cdata


def _storage(fn: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(fn.untyped_storage())


# re-entrant: dropping a parts tensor under the lock runs the weakref callback of its slice-major copy
_LOCK = threading.RLock()
_CACHE: dict[tuple[Any, ...], _Entry] = {}
_STATS = {"builds": 0}
_WARNED_INFERENCE = [False]


def _key(fn: torch.Tensor, np_cols: int) -> tuple[Any, ...]:
    return (str(fn.device), fn.data_ptr(), tuple(fn.shape), tuple(fn.stride()), fn.dtype, np_cols)


def _version(fn: torch.Tensor) -> int | None:
    return None if fn.is_inference() else fn._version


def _drop(key: tuple[Any, ...], ref: weakref.ref) -> None:
    with _LOCK:
        e = _CACHE.get(key)
        if e is not None and e.ref is ref:
            del _CACHE[key]


def bf16x3_parts(fn: torch.Tensor, *, static: bool = False, np_cols: int = NP_DEFAULT) -> torch.Tensor:
    """The cached ``[3, K, np_cols]`` bf16 parts of ``fn``, rebuilt when ``fn`` changed in place.

    ``static``: build once; a later in-place change of ``fn`` raises ``RuntimeError``
    (call this before writing any output, so a rejected update leaves nothing half-written).
    """
    key = _key(fn, np_cols)
    ver = _version(fn)
    with _LOCK:
        e = _CACHE.get(key)
        alive = e is not None and e.same_tensor(fn)
        if alive and static and e.pinned is not None and ver is not None and ver != e.pinned:
            # (also when a dynamic caller of the same weight has rebuilt the parts since: this caller's were
            # promised never to change)
            raise RuntimeError(
                f"dsv41 mHC: the projection weight fn {tuple(fn.shape)} was updated in place "
                f"(version {e.pinned} -> {ver}), but its derived bf16x3 parts were built once under "
                "PassConfig(static_weights=True). Compile with PassConfig(static_weights=False) to let "
                "weight updates refresh them, or call dsv41_passes.lowering.mhc_weights.clear_cache() "
                "after updating the weights."
            )
        if alive and ((ver is None and static) or (ver is not None and ver == e.version)):
            if static and e.pinned is None:
                e.pinned = ver
            return e.parts
    if ver is None and not static and not _WARNED_INFERENCE[0]:
        _WARNED_INFERENCE[0] = True
        warnings.warn(
            "dsv41 mHC: the projection weight is an inference tensor (no version counter); its bf16x3 "
            "parts are rebuilt on every call. Create weights outside torch.inference_mode() or use "
            "PassConfig(static_weights=True). (A view of a weight, e.g. one layer of a stacked parameter, reaches "
            "the op as a new inference tensor at every call: give each projection a parameter of its own.)",
            stacklevel=3,
        )
    parts = build_parts(fn, np_cols)
    ref = weakref.ref(fn, lambda r, k=key: _drop(k, r))
    with _LOCK:
        old = _CACHE.get(key)
        pinned = ver if static else (old.pinned if old is not None and old.same_tensor(fn) else None)
        _CACHE[key] = _Entry(ref, ver, parts, _storage(fn), pinned)
        _STATS["builds"] += 1
    return parts


def slice_major(parts: torch.Tensor, d: int, nmix: int) -> torch.Tensor:
    """``[3, 4 * d, NP]`` parts -> ``[3, 16, 4, nmix, d / 16]`` (part, K slice, stream, mix column, slice
    column): each K slice's parts contiguous, K-major rows of the mix columns, no padding columns."""
    p, k, np_cols = parts.shape
    n = k // d
    if p != 3 or k != n * d or d % NUM_SLICES or nmix > np_cols:
        raise ValueError(f"slice_major: parts {tuple(parts.shape)} do not fit hidden {d} and {nmix} mix columns")
    v = parts.view(3, n, NUM_SLICES, d // NUM_SLICES, np_cols)[..., :nmix]  # [p, stream, slice, col, n]
    return v.permute(0, 2, 1, 4, 3).contiguous()


# tensors derived from a cached derived weight (its slice-major copy, the ``ml48`` kernel's [mid; lo] tile), keyed by
# what they are and the identity of their source: a source is never changed in place (a weight update builds new
# parts), so the entry lives as long as the source, and the weakref callback drops it with the source
_DERIVED: dict[tuple[str, int], tuple[weakref.ref, torch.Tensor]] = {}


def derived(tag: str, src: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(src)``, built once per ``src`` tensor (``tag`` names what is made), dropped with it."""
    key = (tag, id(src))
    with _LOCK:
        e = _DERIVED.get(key)
        if e is not None and e[0]() is src:
            return e[1]
    out = make(src)
    ref = weakref.ref(src, lambda r, k=key: _drop_derived(k, r))
    with _LOCK:
        _DERIVED[key] = (ref, out)
    return out


def _drop_derived(key: tuple[str, int], ref: weakref.ref) -> None:
    with _LOCK:
        e = _DERIVED.get(key)
        if e is not None and e[0] is ref:
            del _DERIVED[key]


def bf16x3_slice_parts(fn: torch.Tensor, d: int, *, static: bool = False) -> torch.Tensor:
    """``slice_major`` of the cached parts of ``fn``: built once per parts tensor (so it follows the same
    version checks), dropped with it."""
    parts = bf16x3_parts(fn, static=static)
    return derived("slice_major", parts, lambda p: slice_major(p, d, fn.shape[0]))


def cache_info() -> dict[str, int]:
    """Entries and bytes held by the derived-weight cache (parts and their slice-major copies), and parts
    built so far in this process."""
    with _LOCK:
        live = [e for e in _CACHE.values() if e.ref() is not None]
        sliced = [t for r, t in _DERIVED.values() if r() is not None]
        return {
            "entries": len(live),
            "bytes": sum(e.parts.numel() * e.parts.element_size() for e in live)
            + sum(t.numel() * t.element_size() for t in sliced),
            "builds": _STATS["builds"],
        }


def clear_cache() -> None:
    """Forget every derived weight (the next call rebuilds; also lifts a static-weights rejection)."""
    with _LOCK:
        _CACHE.clear()
        _DERIVED.clear()
