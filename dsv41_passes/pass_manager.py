"""The one post-grad pass the library installs (``post_grad_custom_post_pass``).

Fixed order, each stage timed and reported:

1. ``normalize``  view -> reshape, identity permutes removed (what the patterns are traced against);
2. ``mhc``        mHC stats, collapse (+ RMSNorm), post;
3. ``rope_store`` Q RoPE + padded-Q store, KV norm + RoPE + FP8 + cache store;
4. ``wo_a``       inverse RoPE + grouped low-rank output projection;
5. ``fuse``       mHC ops sharing the residual merge: stats + collapse -> ``mhc_pre`` (one
                  read); then (``mhc_boundary``, on by default) post -> next pre -> ``mhc_boundary``;
6. ``order_stores`` a fused KV store whose cache is read again afterwards (old rows) is split
                  into the fused compute + an ``index_put`` placed after the last read, so
                  Inductor writes the cache in place instead of copying it;
7. ``batch_invariant`` (batch-invariant mode only) every remaining matmul pinned to a kernel
                  whose per-row arithmetic depends only on K;
8. ``cleanup``    stable topological sort, dead-code elimination, lint.

``uuid()`` hashes the PassConfig (batch-invariant mode resolved), whether the graph follows the global
mode, whether this torch's Inductor drops bf16 round trips (a probe the collapse patterns depend on), the
source of every pattern, lowering and kernel module, and the torch/triton/tilelang versions,
so Inductor's FX graph cache never replays a graph rewritten under other rules.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .config import PassConfig
from .patterns import GROUPS, PassContext, pass_context
from .patterns.base import normalize
from .report import RewriteReport, SiteRow, graph_to_node_link, publish

log = logging.getLogger("dsv41_passes")
_PKG = Path(__file__).resolve().parent
_HASHED_DIRS = ("patterns", "lowering", "reference")  # patterns trace reference functions
_HASHED_FILES = ("pass_manager.py", "config.py", "guards.py", "tuning.py", "report.py")  # report: the saved format


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("triton", "tilelang"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def source_files() -> list[Path]:
    files = [_PKG / f for f in _HASHED_FILES if (_PKG / f).exists()]
    for d in _HASHED_DIRS:
        files += sorted((_PKG / d).rglob("*.py"))
    return files


def source_hash() -> str:
    h = hashlib.sha256()
    for f in source_files():
        h.update(str(f.relative_to(_PKG)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


class PostGradPassManager(CustomGraphPass):
    def __init__(self, config: PassConfig | None = None) -> None:
        self.config = config or PassConfig()
        self.follows_global = self.config.batch_invariant is None
        # the mode is fixed when the manager is built (compile time)
        self.batch_invariant = self.config.resolved_batch_invariant()
        self.input_warnings: list[str] = []  # what the backend saw in the graph's inputs (not part of uuid)

    # ------------------------------------------------------------- identity
    def uuid(self) -> str:
        from .patterns import mhc as mhc_patterns

        payload = {
            "config": self.config.cache_key() | {"batch_invariant": self.batch_invariant},
            "follows_global": self.follows_global,
            # which collapse spellings apply (the graph cache must not serve a graph rewritten under the other answer)
            "drops_bf16_round_trips": mhc_patterns._inductor_drops_bf16_round_trips(),
            # the report kept beside the cache entry names the providers picked at compile time, and Triton takes
            # CPU tensors only under the interpreter: a hit must not restore a report from the other setting
            "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
            "source": source_hash(),
            "versions": _versions(),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    # ------------------------------------------------------------- running
    def __call__(self, graph: fx.Graph) -> None:
        cfg = self.config
        report = RewriteReport(config=cfg.cache_key() | {"batch_invariant": self.batch_invariant})
        report.before = str(graph)
        ctx = PassContext(
            ",".join(cfg.providers),
            self.batch_invariant,
            self.follows_global,
            cfg.static_weights,
            expect={"hc_sinkhorn_iters": cfg.hc_sinkhorn_iters},
        )
        timings: dict[str, float] = {}

        def stage(name: str, fn: Any) -> Any:
            t = time.perf_counter()
            out = fn()
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t
            return out

        with pass_context(ctx):
            stage("normalize", lambda: normalize(graph))
            for fam in ("mhc", "rope_store", "wo_a"):
                if getattr(cfg, fam) and fam in GROUPS:
                    group = GROUPS[fam]
                    stage(fam, lambda g=group: g.apply(graph))
            if cfg.mhc:
                from .patterns import mhc_fuse

                stage("fuse", lambda: mhc_fuse.run(graph, ctx, boundary=cfg.mhc_boundary))
            if cfg.rope_store:
                from .patterns import rope_store as rs

                stage("order_stores", lambda: rs.order_stores(graph))
            if self.batch_invariant:
                from .patterns import batch_invariant as bi

                stage("batch_invariant", lambda: bi.rewrite(graph, ctx))
            stage("cleanup", lambda: _cleanup(graph))

        report.pass_seconds = timings
        report.after = str(graph)
        report.graph_json = graph_to_node_link(graph)
        for site in ctx.sites.values():
            rewritten = site.rewritten or getattr(site.anchor, "_erased", False)
            report.rows.append(
                SiteRow(
                    kind=site.kind,
                    location=site.location,
                    layer=site.layer,
                    status="rewritten" if rewritten else "skipped",
                    provider=site.provider if rewritten else None,
                    op=site.fused_into or site.kind,
                    reason=(
                        "; ".join(filter(None, [site.note, *site.reasons])) if rewritten else "; ".join(site.reasons)
                    ),
                    source=site.source,
                )
            )
        report.warnings.extend(self.input_warnings)
        counts = report.sites
        for fam in cfg.families():
            kinds = FAMILY_KINDS.get(fam, ())
            if fam in GROUPS and not any(counts.get(k) for k in kinds):
                msg = f"family '{fam}' is enabled but rewrote no site in this graph"
                if _saves_activations():
                    msg += " (grad mode is on: saved activations block the patterns; compile under inference_mode)"
                report.warnings.append(msg)
                log.warning("dsv41: %s", msg)
        if cfg.dump_dir:
            try:
                _dump(cfg.dump_dir, report)
            except OSError as e:  # the dump is a by-product: the compile goes on without it
                msg = f"dump_dir {cfg.dump_dir}: nothing written ({type(e).__name__}: {e})"
                report.warnings.append(msg)
                log.warning("dsv41: %s", msg)
        publish(report)


def _saves_activations() -> bool:
    """Whether AOTAutograd traced this graph for training (outputs that need a gradient), so its forward saves
    activations. It compiles that forward with grad off, so ``torch.is_grad_enabled()`` here cannot tell, and it is
    on for an inference graph compiled outside ``inference_mode`` that saves nothing."""
    try:
        ctx = torch._guards.TracingContext.try_get()
        return bool(getattr(getattr(ctx, "fw_metadata", None), "traced_tangents", None))
    except Exception:  # noqa: BLE001  (a torch without these internals: no claim)
        return False


def _cleanup(graph: fx.Graph) -> None:
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(graph)
    graph.eliminate_dead_code()
    graph.lint()


FAMILY_KINDS = {
    "mhc": ("mhc_stats", "mhc_collapse", "mhc_post"),
    "rope_store": ("q_rope_store", "kv_rope_store"),
    "wo_a": ("wo_a",),
}


def pattern_dump() -> str:
    """Every registered pattern, pretty-printed, grouped by family."""
    from torch._inductor.pattern_matcher import PatternPrettyPrinter

    out = []
    for fam, group in GROUPS.items():
        group.pass_  # register
        out.append(f"# ===== family {fam}: {len(group.registered)} patterns"
                   f" ({len(group.duplicates)} spellings traced to an existing pattern: {group.duplicates})")
        for name, expr in group.registered:
            out.append(f"# --- {name}")
            try:
                out.append(PatternPrettyPrinter.run(expr))
            except Exception as e:  # printing is best effort
                out.append(f"# (could not print: {e})")
    return "\n".join(out)


_DUMP_COUNT = [0]


def _dump(dump_dir: str, report: RewriteReport) -> None:
    os.makedirs(dump_dir, exist_ok=True)
    i = _DUMP_COUNT[0]
    _DUMP_COUNT[0] += 1
    Path(dump_dir, f"graph{i}.before.txt").write_text(report.before)
    Path(dump_dir, f"graph{i}.after.txt").write_text(report.after)
    Path(dump_dir, f"graph{i}.report.md").write_text(report.to_markdown())
    report.save(Path(dump_dir, f"graph{i}.report.json"))
    Path(dump_dir, "patterns.txt").write_text(pattern_dump())
