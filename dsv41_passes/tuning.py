"""Kernel tactics: per-op, per-shape, per-M-bucket launch configs, and their persistent cache.

A fused op asks :func:`tactic` for its config at run time, so M never enters a
compiled graph or a kernel binary: one binary per config serves every M.

* batch-invariant mode: :func:`tactic` always returns the op's fixed default
  (a config whose per-row arithmetic does not depend on M); tuned entries are
  ignored and tuning is skipped;
* ``DSV41_TACTICS=off``: the cache is neither read nor written, defaults only;
* ``save_tactics`` / ``load_tactics`` keep tuned entries with metadata (device,
  capability, torch/triton/tilelang and library versions). A mismatch or a
  corrupt file is rejected with a warning, and so is each entry no kernel can
  launch (an unknown op, bucket or config); loading merges and never drops
  entries already tuned in this process.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

MAX_TOKENS = 65536
_FORMAT = 1
_LOCK = threading.Lock()
_TABLE: dict[str, dict[str, Any]] = {}


def enabled() -> bool:
    return os.environ.get("DSV41_TACTICS", "on").strip().lower() not in ("off", "0", "false", "no")


def bucket(m: int) -> int:
    """Upper edge of the power-of-two bucket holding ``m`` (1, 2, 4, ..., 65536; larger M share the top one)."""
    b = 1
    while b < m and b < MAX_TOKENS:
        b <<= 1
    return b


def buckets(max_tokens: int = MAX_TOKENS) -> list[int]:
    out, b = [], 1
    while b <= min(max_tokens, MAX_TOKENS):
        out.append(b)
        b <<= 1
    return out


def _key(op: str, shape_key: dict[str, Any], m_bucket: int) -> str:
    dims = ",".join(f"{k}={shape_key[k]}" for k in sorted(shape_key))
    return f"{op}|{dims}|{m_bucket}"


def tactic(
    op: str, m: int, shape_key: dict[str, Any], default: dict[str, Any], batch_invariant: bool = False
) -> dict[str, Any]:
    if batch_invariant or not enabled():
        return default
    hit = _TABLE.get(_key(op, shape_key, bucket(m)))
    return hit if hit is not None else default


def record(op: str, m_bucket: int, shape_key: dict[str, Any], config: dict[str, Any]) -> None:
    if not enabled():
        return
    with _LOCK:
        _TABLE[_key(op, shape_key, m_bucket)] = dict(config)


def entries() -> dict[str, dict[str, Any]]:
    return {k: dict(v) for k, v in _TABLE.items()}


def clear() -> None:
    with _LOCK:
        _TABLE.clear()


def metadata(device: torch.device | None = None) -> dict[str, Any]:
    from . import __version__

    meta: dict[str, Any] = {"format": _FORMAT, "dsv41_passes": __version__, "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:
        meta["triton"] = None
    try:
        from importlib.metadata import version

        meta["tilelang"] = version("tilelang")
    except Exception:
        meta["tilelang"] = None
    if torch.cuda.is_available():
        dev = device or torch.device("cuda", torch.cuda.current_device())
        meta["device"] = torch.cuda.get_device_name(dev)
        meta["capability"] = list(torch.cuda.get_device_capability(dev))
    else:
        meta["device"] = "cpu"
        meta["capability"] = None
    return meta


def save_tactics(path: str | os.PathLike[str]) -> int:
    """Write the tuned entries with this process's metadata; returns the number of entries."""
    if not enabled():
        warnings.warn("DSV41_TACTICS=off: tactics are not saved", stacklevel=2)
        return 0
    from .report import save_json

    data = {"meta": metadata(), "entries": entries()}
    save_json(path, data, indent=1, sort_keys=True)
    return len(data["entries"])


def load_tactics(path: str | os.PathLike[str]) -> int:
    """Merge entries from ``path`` into the table; returns how many were added.

    Entries already tuned in this process win over the file's. A corrupt file or
    one written for another device or software stack is rejected with a warning;
    so is each entry that is not among its op's candidate configs.
    """
    if not enabled():
        warnings.warn("DSV41_TACTICS=off: tactics file ignored", stacklevel=2)
        return 0
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        meta, ents = data["meta"], data["entries"]
        if not isinstance(meta, dict):
            raise ValueError("meta is not a mapping")
        if not isinstance(ents, dict) or not all(isinstance(v, dict) for v in ents.values()):
            raise ValueError("entries is not a mapping of configs")
    except FileNotFoundError:
        warnings.warn(f"tactics file {path} does not exist; nothing loaded", stacklevel=2)
        return 0
    except Exception as e:  # corrupt JSON, wrong structure
        warnings.warn(f"tactics file {path} is corrupt ({type(e).__name__}: {e}); ignored", stacklevel=2)
        return 0
    mine = metadata()
    diff = sorted(k for k in mine if meta.get(k) != mine[k])
    if diff:
        detail = ", ".join(f"{k}: file {meta.get(k)!r} vs here {mine[k]!r}" for k in diff)
        warnings.warn(f"tactics file {path} was tuned elsewhere ({detail}); ignored", stacklevel=2)
        return 0
    bad = _invalid_entries(ents)
    if bad:
        shown = "; ".join(f"{k!r}: {why}" for k, why in list(bad.items())[:3])
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        warnings.warn(f"tactics file {path}: {len(bad)} entries dropped, no kernel here can run them: {shown}{more}",
                      stacklevel=2)
    added = 0
    with _LOCK:
        for k, v in ents.items():
            if k not in _TABLE and k not in bad:
                _TABLE[k] = dict(v)
                added += 1
    return added


def _invalid_entries(ents: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The entries of a tactics file that no kernel of this library can launch, with why: an op no kernel reads
    tactics under, a bucket that is not one of :func:`buckets`, or a config that is not among the op's candidates
    (what the warm-up records; a hand-edited key a kernel does not know would fail at launch)."""
    from .lowering import tactic_candidates

    known = tactic_candidates()
    valid_buckets = {str(b) for b in buckets()}
    bad: dict[str, str] = {}
    for k, v in ents.items():
        parts = k.split("|")
        if len(parts) != 3:
            bad[k] = "not an 'op|shape|bucket' key"
        elif parts[0] not in known:
            bad[k] = f"no kernel reads tactics for op {parts[0]!r}"
        elif parts[2] not in valid_buckets:
            bad[k] = f"bucket {parts[2]!r} is not a power of two up to {MAX_TOKENS}"
        elif v not in known[parts[0]]:
            bad[k] = f"{v} is not one of {parts[0]}'s candidate configs"
    return bad


# ---------------------------------------------------------------------------
# warm-up and tuning
# ---------------------------------------------------------------------------
@dataclass
class Tunable:
    """One kernel of one op at one model shape, as the warm-up sees it.

    ``make_inputs(m, device)`` builds the op's inputs for ``m`` tokens; ``run(inputs, config)`` launches the
    kernel with an explicit config. An entry whose kernel the op runs only at some M may build None elsewhere,
    and its ``run`` then does nothing.
    """

    op: str
    shape_key: dict[str, Any]
    make_inputs: Callable[[int, Any], tuple | None]
    run: Callable[[tuple | None, dict[str, Any]], Any]
    candidates: list[dict[str, Any]]
    default: dict[str, Any]  # the batch-invariant config (and the untuned one, unless ``untuned`` is given)
    untuned: Callable[[int], dict[str, Any]] | None = None  # untuned config by token count


def _time_ms(fn: Callable[[], Any], device: Any) -> float:
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=5, rep=20, return_mode="median"))
    import time

    fn()
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def warmup(
    config_or_model: Any,
    max_tokens: int = MAX_TOKENS,
    pass_config: Any = None,
    device: Any = None,
    progress: bool = True,
) -> dict[str, dict[int, dict[str, Any]]]:
    """Compile (and, outside batch-invariant mode, tune) every fused op for every M bucket up to ``max_tokens``.

    Takes a ``DeepseekV41Config`` or a model holding one (``.config``); builds
    each op's inputs at the model's per-rank shapes, so nothing of the model runs
    (no KV cache, no LM head). Only the kernels that graphs compiled with ``pass_config`` can run are built: its
    families, providers, ``mhc_boundary`` and batch-invariant mode. Returns ``{op: {bucket: config}}``.
    """
    from tqdm import tqdm

    from .config import PassConfig
    from .lowering import tunables_for

    if isinstance(config_or_model, PassConfig):
        raise TypeError("dsv41 warm-up takes the model's config (a DeepseekV41Config) or the model; a PassConfig goes "
                        "to pass_config=")
    if pass_config is not None and not isinstance(pass_config, PassConfig):
        raise TypeError(f"dsv41 warm-up: pass_config must be a PassConfig, got {type(pass_config).__name__}")
    cfg = getattr(config_or_model, "config", config_or_model)
    pc = pass_config or PassConfig()
    bi = pc.resolved_batch_invariant()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from .lowering.registry import triton_available

    why = triton_available(torch.empty(0, device=dev))
    if why and "triton" in pc.providers:
        raise RuntimeError(f"dsv41 warm-up builds the Triton kernels: {why}")
    tunables = [t for t in tunables_for(cfg, dev) if _runs_under(t.op, pc, bi)] if not why else []
    todo = [(b, t) for b in buckets(bucket(max_tokens)) for t in tunables]  # up to the bucket max_tokens falls in
    chosen: dict[str, dict[int, dict[str, Any]]] = {}
    for b, t in tqdm(todo, disable=not progress, desc="dsv41 warm-up", unit="kernel"):
        inputs = t.make_inputs(b, dev)
        if bi:
            best = t.default
        elif not enabled() or len(t.candidates) <= 1:
            best = t.untuned(b) if t.untuned else t.default  # what an untuned call at this M runs
        else:
            timed = []
            for cand in t.candidates:
                try:
                    timed.append((_time_ms(lambda c=cand: t.run(inputs, c), dev), cand))
                except Exception:  # a candidate that does not fit this shape
                    continue
            if timed:
                best = min(timed, key=lambda x: x[0])[1]
                record(t.op, b, t.shape_key, best)
            else:  # no candidate ran: what an untuned call runs, nothing recorded
                best = t.untuned(b) if t.untuned else t.default
        t.run(inputs, best)  # compile the binary this bucket will use
        chosen.setdefault(t.op, {})[b] = dict(best)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return chosen


def _runs_under(op: str, pc: Any, bi: bool) -> bool:
    """Whether graphs compiled with ``pc`` (in mode ``bi``) can run the kernel of warm-up entry ``op`` ("mhc_post",
    "wo_a.tilelang", ...): its family and provider switched on (the TileLang ``mhc_pre`` and fused boundary also
    decline in batch-invariant mode)."""
    base, _, provider = op.partition(".")
    family = "mhc" if base.startswith("mhc_") else "wo_a" if base == "wo_a" else "rope_store"
    if (provider or "triton") not in pc.providers or not getattr(pc, family):
        return False
    if base == "mhc_boundary" and not pc.mhc_boundary:
        return False
    return not (bi and provider == "tilelang" and base in ("mhc_pre", "mhc_boundary"))


def kernel_cache_sizes() -> dict[str, int]:
    """Compiled binaries held per kernel module (Triton JIT caches, TileLang per-config dicts).

    A dynamic-M kernel adds no binary for a new M: after warm-up these counts stay put.
    """
    import importlib
    import pkgutil
    import sys

    out: dict[str, int] = {}
    for pkg in ("dsv41_passes.lowering.triton", "dsv41_passes.lowering.tilelang"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.iter_modules(mod.__path__):
            name = f"{pkg}.{info.name}"
            m = sys.modules.get(name)
            if m is None:
                continue  # never imported: nothing compiled
            total = 0
            for attr in vars(m).values():
                if getattr(getattr(attr, "fn", None), "__module__", name) != name:
                    continue  # a kernel imported from another module: counted there
                caches = getattr(attr, "device_caches", None)  # triton.JITFunction
                if isinstance(caches, dict):
                    for v in caches.values():
                        first = v[0] if isinstance(v, tuple) else v
                        total += len(first) if hasattr(first, "__len__") else 0
            for attr_name in ("_KERNELS", "_CACHE"):
                d = getattr(m, attr_name, None)
                if isinstance(d, dict):
                    total += len(d)
            out[name.rsplit(".", 2)[-2] + "/" + info.name] = total
    return out
