"""Look inside the compiled graph: sizes before/after the passes, sites per layer, and a picture.

    python examples/02_inspect_rewritten_graphs.py [--out DIR] [--layer N]

Compiles the tiny DeepSeek-V4.1 with ``PassConfig(dump_dir=...)``, so the passes write the
post-grad graph before and after the rewrite, the report and every registered pattern into
``DIR/dump/``. The script then prints the node counts of both graphs and the rewritten sites
of each layer, and draws one layer's rewritten region (its fused ``dsv41`` ops and their
direct neighbours) to ``DIR/layer<N>_rewritten_region.png`` with networkx and matplotlib.
``DIR`` defaults to ``examples/out/``. Runs on CPU in well under a minute.
"""

import argparse
import re
import time
from collections import Counter, defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

import dsv41_passes as dp  # noqa: E402
from dsv41_passes.reference import DeepseekV41Config, DeepseekV41ForCausalLM  # noqa: E402

FUSED, NEAR, INPUT, OTHER = "#f28e2b", "#fcd9b1", "#a0cbe8", "#d9d9d9"


def count_nodes(graph_text: str) -> int:
    """Nodes in a printed FX graph: one ``%name : ...`` line each, plus the output (``return``)."""
    lines = [ln.strip() for ln in graph_text.splitlines()]
    return sum(ln.startswith("%") for ln in lines) + sum(ln.startswith("return") for ln in lines)


def fused_ops(graph_text: str) -> dict[str, str]:
    """Node name -> dsv41 op for every call of a fused op, including the in-place stores that
    Inductor wraps in ``auto_functionalized`` (their node target is the wrapper, not the op)."""
    out = {}
    for ln in graph_text.splitlines():
        m = re.match(r"\s*%(\w+) : .*?\bdsv41\.(\w+)", ln)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def layer_fused_nodes(g: nx.DiGraph, fused: dict[str, str], rows, layer: int) -> list[str]:
    """The fused nodes of one layer.

    The graph's nodes carry no layer, so this uses the data flow: every layer ends in the
    mHC post of its FFN sub-block (an ``mhc_boundary`` node where the next layer's pre joined it), and layer ``layer``'s fused ops are the ones that this post
    depends on and the previous layer's last post does not.
    """
    per_layer = sum(r.kind == "mhc_post" and r.layer == layer and r.status == "rewritten" for r in rows)
    # Each post is its own node or, fused with the next sub-block's pre, the one post of an mhc_boundary
    # node (the default); graph order is topological.
    posts = [n for n in g.nodes if fused.get(n) in ("mhc_post", "mhc_boundary")]
    end = (layer + 1) * per_layer - 1
    if per_layer == 0 or end >= len(posts):
        raise SystemExit(f"cannot find the mHC posts of layer {layer} in the rewritten graph")
    upto = nx.ancestors(g, posts[end]) | {posts[end]}
    if layer > 0:
        prev = posts[layer * per_layer - 1]
        upto -= nx.ancestors(g, prev) | {prev}
    return [n for n in g.nodes if n in fused and n in upto]


def short_label(name: str, attrs: dict, fused: dict[str, str]) -> str:
    if name in fused:
        label = fused[name]
    elif attrs.get("op") in ("placeholder", "output"):
        label = name
    else:
        label = attrs.get("target", name).split(".")[0]  # "mm.default" -> "mm"
        label = {"convert_element_type": "convert", "select_scatter": "sel_scatter"}.get(label, label)
    if len(label) > 9 and "_" in label:  # long names on two lines, split at the underscore nearest the middle
        cut = min((i for i, ch in enumerate(label) if ch == "_"), key=lambda i: abs(i - len(label) / 2))
        label = label[:cut] + "\n" + label[cut + 1:]
    return label


def rows_by_depth(g: nx.DiGraph, region: nx.DiGraph) -> dict[str, int]:
    """Row of each region node: its depth in the whole graph (longest path from an input),
    with graph inputs placed one row above their first consumer instead of all at the top."""
    depth: dict[str, int] = {}
    for n in nx.topological_sort(g):
        depth[n] = max((depth[p] + 1 for p in g.predecessors(n)), default=0)
    ranks = {d: i for i, d in enumerate(sorted({depth[n] for n in region if region.in_degree(n)}))}
    row = {n: ranks[depth[n]] for n in region if region.in_degree(n)}
    for n in region:
        if n not in row:  # no producer inside the region
            row[n] = min((row[s] for s in region.successors(n) if s in row), default=1) - 1
    return row


def draw_region(g: nx.DiGraph, region: nx.DiGraph, fused: dict[str, str], mine: set[str], title: str,
                path: Path) -> None:
    row = rows_by_depth(g, region)
    nx.set_node_attributes(region, row, "row")
    pos = nx.multipartite_layout(region, subset_key="row", align="horizontal")
    pos = {n: (x, -y) for n, (x, y) in pos.items()}  # first row at the top
    widest = max(Counter(row.values()).values())
    depth = max(row.values()) - min(row.values()) + 1

    fig, ax = plt.subplots(figsize=(max(9, 1.1 * widest), max(6, 0.8 * depth)))
    groups = {
        "fused dsv41 op of this layer": ([n for n in region if n in mine], FUSED, 1500),
        "fused dsv41 op of a neighbouring layer": ([n for n in region if n in fused and n not in mine], NEAR, 1500),
        "graph input (weight, buffer, activation)": (
            [n for n in region if n not in fused and region.nodes[n].get("op") == "placeholder"], INPUT, 800),
        "aten op / getitem": (
            [n for n in region if n not in fused and region.nodes[n].get("op") != "placeholder"], OTHER, 800),
    }
    for nodes, colour, size in groups.values():
        nx.draw_networkx_nodes(region, pos, nodelist=nodes, node_color=colour, node_size=size,
                               edgecolors="#555555", ax=ax)
    nx.draw_networkx_edges(region, pos, ax=ax, arrows=True, arrowsize=10, edge_color="#888888",
                           node_size=1000, width=0.8)
    labels = {n: short_label(n, a, fused) for n, a in region.nodes(data=True)}
    nx.draw_networkx_labels(region, pos, labels, font_size=7, ax=ax)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#555555", label=k) for k, (_, c, _) in groups.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"), help="output directory")
    ap.add_argument("--layer", type=int, default=0, help="layer whose rewritten region is drawn")
    args = ap.parse_args()
    out = Path(args.out)
    dump = out / "dump"
    out.mkdir(parents=True, exist_ok=True)

    cfg = DeepseekV41Config.tiny()
    if not 0 <= args.layer < cfg.num_hidden_layers:  # (before the compile)
        ap.error(f"--layer {args.layer}: the tiny model has layers 0 to {cfg.num_hidden_layers - 1}")
    model = DeepseekV41ForCausalLM(cfg, max_num_tokens=512).eval()
    lengths = [7, 30, 12]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    start = time.time()
    fast = dp.compile(model, dp.PassConfig(dump_dir=str(dump)))  # dump_dir also bypasses the FX graph cache
    fast(ids, pos, cu)
    rep = dp.last_report()
    for f in sorted(dump.iterdir()):
        if f.stat().st_mtime >= start - 1:
            print(f"wrote {f}")

    graph = rep.networkx()
    print(f"\npost-grad graph: {count_nodes(rep.before)} nodes before the passes, "
          f"{count_nodes(rep.after)} after ({graph.number_of_nodes()} in report.networkx())")

    # Sites per layer, from the report rows (layer None: outside the decoder layers, e.g. the final norm).
    per_layer: dict[object, Counter] = defaultdict(Counter)
    for r in rep.rows:
        if r.status == "rewritten":
            per_layer[r.layer][r.kind] += 1
    print("\nrewritten sites per layer:")
    for layer in sorted(per_layer, key=lambda k: (k is None, k or 0)):
        sites = ", ".join(f"{k} {v}" for k, v in sorted(per_layer[layer].items()))
        print(f"  {'outside the layers' if layer is None else f'layer {layer}'}: {sites}")
    if rep.skipped:
        print(f"  skipped: {len(rep.skipped)} (reasons in the report table)")

    # The whole rewritten region, then the part of it that belongs to one layer.
    fused = fused_ops(rep.after)
    whole = rep.rewritten_region(hops=1)
    print(f"\nrewritten region of the whole graph: {whole.number_of_nodes()} nodes around "
          f"{len(fused)} fused-op calls")
    mine = layer_fused_nodes(graph, fused, rep.rows, args.layer)
    keep = set(mine)
    for n in mine:  # the fused ops plus their direct producers and consumers
        keep |= set(graph.predecessors(n)) | set(graph.successors(n))
    region = nx.DiGraph(graph.subgraph(keep))
    print(f"layer {args.layer}: {len(mine)} fused ops ({', '.join(fused[n] for n in mine)}), "
          f"region of {region.number_of_nodes()} nodes")

    png = out / f"layer{args.layer}_rewritten_region.png"
    title = f"DeepSeek-V4.1 tiny, layer {args.layer}: fused dsv41 ops and their direct neighbours"
    draw_region(graph, region, fused, set(mine), title, png)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
