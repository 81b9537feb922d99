"""What the passes did to one compiled graph: a row per site, graphs before/after, timings."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.fx as fx


@dataclass
class SiteRow:
    kind: str  # site kind: mhc_post, mhc_stats, ...
    location: str  # module path from nn_module_stack
    layer: int | None
    status: str  # "rewritten" or "skipped"
    provider: str | None  # provider the site's fused op picks for the traced inputs (runtime may refine per M)
    op: str  # the site's fusion (its kind), or the fused op it became part of (mhc_pre, mhc_boundary)
    reason: str = ""  # why skipped; or which providers declined
    source: str = ""  # source line of the site


@dataclass
class RewriteReport:
    config: dict[str, Any] = field(default_factory=dict)
    rows: list[SiteRow] = field(default_factory=list)
    before: str = ""
    after: str = ""
    pass_seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    from_cache: bool = False
    graph_json: dict[str, Any] | None = None  # node-link data of the rewritten graph (networkx)

    @property
    def sites(self) -> dict[str, int]:
        """Site kind -> number of model sites rewritten."""
        return dict(Counter(r.kind for r in self.rows if r.status == "rewritten"))

    @property
    def skipped(self) -> list[SiteRow]:
        return [r for r in self.rows if r.status != "rewritten"]

    @property
    def total_seconds(self) -> float:
        return sum(self.pass_seconds.values())

    def to_markdown(self) -> str:
        out = ["| kind | layer | module | status | provider / reason |", "|---|---|---|---|---|"]
        for r in sorted(self.rows, key=lambda r: (r.layer if r.layer is not None else 1 << 30, r.kind, r.location)):
            detail = (r.provider or "-") + (f" ({r.op})" if r.op and r.op != r.kind else "")
            if r.status != "rewritten":
                detail = r.reason
            out.append(f"| {r.kind} | {'' if r.layer is None else r.layer} | {r.location} | {r.status} | {detail} |")
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.sites.items())) or "none"
        out.append("")
        out.append(f"rewritten sites: {counts}; pass time {1e3 * self.total_seconds:.1f} ms"
                   + (" (report restored from the FX graph cache)" if self.from_cache else ""))
        for stage, s in self.pass_seconds.items():
            out.append(f"- {stage}: {1e3 * s:.1f} ms")
        for w in self.warnings:
            out.append(f"WARNING: {w}")
        return "\n".join(out)

    # ------------------------------------------------------------- graphs
    def networkx(self):
        """The rewritten graph as a networkx DiGraph (node attrs: op, target, fused)."""
        import networkx as nx

        if self.graph_json is None:
            return nx.DiGraph()
        return nx.node_link_graph(self.graph_json, directed=True, edges="edges")

    def rewritten_region(self, hops: int = 1):
        """Subgraph around the fused ops: each dsv41 node and its neighbours within ``hops``."""
        import networkx as nx

        g = self.networkx()
        keep = {n for n, a in g.nodes(data=True) if a.get("fused")}
        frontier = set(keep)
        und = g.to_undirected(as_view=True)
        for _ in range(hops):
            frontier = {m for n in frontier for m in und.neighbors(n)} - keep
            keep |= frontier
        return nx.DiGraph(g.subgraph(keep))

    # ------------------------------------------------------------- files
    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [asdict(r) for r in self.rows]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RewriteReport":
        d = dict(d)
        d["rows"] = [SiteRow(**r) for r in d.get("rows", [])]
        return cls(**d)

    def save(self, path: str | os.PathLike[str]) -> None:
        save_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "RewriteReport":
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))


def save_json(path: str | os.PathLike[str], data: Any, **dump_options: Any) -> None:
    """``data`` as JSON at ``path``, replaced at once (a reader never sees half a file); a failed write (a path that
    is a directory) leaves nothing behind."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, **dump_options)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def graph_to_node_link(graph: fx.Graph) -> dict[str, Any]:
    import networkx as nx

    g = nx.DiGraph()
    for n in graph.nodes:
        op = n.target
        if "auto_functionalized" in str(op) and n.args:  # a mutating op (q_rope_store, the KV store): its op
            op = n.args[0]
        target = op if isinstance(op, str) else getattr(op, "__name__", str(op))
        name = str(op)
        g.add_node(n.name, op=n.op, target=str(target), fused=name.startswith("dsv41."))  # (not dsv41_bench.*)
        for a in n.all_input_nodes:
            g.add_edge(a.name, n.name)
    return nx.node_link_data(g, edges="edges")


_LAST: list[RewriteReport] = []


def publish(report: RewriteReport) -> None:
    _LAST.append(report)
    del _LAST[:-16]


def last_report() -> RewriteReport:
    """Report of the most recent compile that ran (or restored) the dsv41 passes."""
    if not _LAST:
        raise RuntimeError("no dsv41 compile has run yet in this process")
    return _LAST[-1]


def reports() -> list[RewriteReport]:
    return list(_LAST)
