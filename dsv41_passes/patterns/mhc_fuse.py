"""mHC op-level fusion, run after the mHC, RoPE/store and WO-A patterns.

Two rewrites of our own ops (the sites keep their kind in the report and name
the op they became part of):

* ``mhc_stats(h)`` + ``mhc_collapse(h, pre_prev)`` -> ``mhc_pre``: V4.1's shifted
  pre collapses with the previous sub-block's ``pre``, which exists before ``h``
  is read, so the stats and the collapse (+ norm) share one read of ``h``.
  In the V4 wiring (the collapse uses the ``pre`` these stats produce) the two
  stay separate ops.
* ``mhc_post -> h`` + ``mhc_pre(h)`` -> ``mhc_boundary`` (``PassConfig(mhc_boundary=True)``, the
  default): the new residual is written once and never re-read by the next sub-block's stats and
  collapse. Which kernels run it is the op's choice by M (``lowering.mhc``): the post inside the
  persistent TileLang kernel from M = 1536 on a GPU that takes it, else the Triton boundary's forms.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .base import PassContext

OPS = torch.ops.dsv41


def _is(n: object, op: object) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target == op


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's place in the graph (topological order); taken once per candidate, before it is rewritten."""
    return {n: i for i, n in enumerate(graph.nodes)}


def _depends_on(node: object, target: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether ``node`` is computed from ``target``: a backwards walk that stops at nodes placed before ``target``
    (the graph is in topological order, so none of those reads it), so no depth bound can cut it short."""
    start = order[target]
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen or order.get(n, -1) < start:
            continue
        if n is target:
            return True
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


def _outputs(node: fx.Node) -> list[fx.Node | None]:
    """getitem users of a multi-output op, by index."""
    val = node.meta["val"]
    outs: list[fx.Node | None] = [None] * len(val)
    for u in node.users:
        if u.target is operator.getitem:
            outs[u.args[1]] = u
    return outs


def _emit(graph: fx.Graph, op, args: tuple, after: fx.Node, like: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]):
        out = op(*vals)
    with graph.inserting_after(after):
        node = graph.call_function(op, args)
    node.meta["val"] = out
    for key in ("stack_trace", "nn_module_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    gets = []
    prev = node
    for i, v in enumerate(out):
        with graph.inserting_after(prev):
            g = graph.call_function(operator.getitem, (node, i))
        g.meta["val"] = v
        gets.append(g)
        prev = g
    return node, gets


def _latest(order: dict[fx.Node, int], nodes: list[object]) -> fx.Node:
    return max((n for n in nodes if isinstance(n, fx.Node)), key=lambda n: order[n])


def _sites(node: fx.Node) -> list:
    if "dsv41_site" in node.meta:
        return [node.meta["dsv41_site"]]
    return list(node.meta.get("dsv41_sites", []))


def _retag(old: list[fx.Node], new: fx.Node, ctx: PassContext, op_name: str) -> None:
    """The sites of ``old`` now run inside ``new``: record the op and the provider it picks."""
    from ..lowering import choose

    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in new.args[:-2]]
    p, declined = choose(op_name, ctx.providers, ctx.batch_invariant, *vals)
    sites = [s for o in old for s in _sites(o)]
    for site in sites:
        site.fused_into = op_name
        site.op_node = new
        site.provider = p.name if p else None
        site.note = "; ".join(declined)
    new.meta["dsv41_sites"] = sites


def _replace(graph: fx.Graph, ctx: PassContext, new: fx.Node, gets: list[fx.Node], *, single: fx.Node,
             multi: fx.Node, op_name: str) -> None:
    """``new`` (outputs ``gets``) takes over a single-output op (its output 0) and a multi-output op (1..)."""
    single.replace_all_uses_with(gets[0])
    for i, g in enumerate(_outputs(multi)):
        if g is not None:
            g.replace_all_uses_with(gets[1 + i])
            graph.erase_node(g)
    _retag([single, multi], new, ctx, op_name)
    graph.erase_node(multi)
    graph.erase_node(single)


def fuse_pre(graph: fx.Graph, ctx: PassContext) -> int:
    n = 0
    for stats in list(graph.find_nodes(op="call_function", target=OPS.mhc_stats.default)):
        h = stats.args[0]
        cols = [u for u in h.users if _is(u, OPS.mhc_collapse.default) and u.args[0] is h]
        if len(cols) != 1:
            continue
        col = cols[0]
        pre_prev, weight, eps = col.args[1], col.args[2], col.args[3]
        _, fn, scale, base, iters, hc_eps, norm_eps, providers, mode = stats.args
        order = _positions(graph)
        v4 = _depends_on(pre_prev, stats, order)
        if v4 or _depends_on(weight, stats, order) or _depends_on(stats, col, order):
            site = stats.meta.get("dsv41_site")
            if site is not None:
                site.note = ("V4 wiring: the collapse uses these stats' pre, so stats and collapse stay two ops" if v4
                             else "the collapse and the stats depend on each other's outputs: they stay two ops")
            continue
        args = (h, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, providers, mode)
        node, gets = _emit(
            graph, OPS.mhc_pre.default, args, _latest(order, [h, pre_prev, fn, scale, base, weight]), stats
        )
        _replace(graph, ctx, node, gets, single=col, multi=stats, op_name="mhc_pre")
        n += 1
    return n


def fuse_boundary(graph: fx.Graph, ctx: PassContext) -> int:
    n = 0
    for pre in list(graph.find_nodes(op="call_function", target=OPS.mhc_pre.default)):
        post = pre.args[0]
        if not _is(post, OPS.mhc_post.default):
            continue
        y, res, p, c, providers, mode = post.args
        h, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, _, _ = pre.args
        order = _positions(graph)
        if any(_depends_on(a, post, order) for a in (pre_prev, fn, scale, base, weight)):
            for site in _sites(pre):  # one op cannot take an input computed from its own output
                site.note = "the next pre's other inputs are computed from this post's output: no mhc_boundary"
            continue
        args = (y, res, p, c, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, providers, mode)
        latest = _latest(order, [y, res, p, c, pre_prev, fn, scale, base, weight])
        node, gets = _emit(graph, OPS.mhc_boundary.default, args, latest, pre)
        _replace(graph, ctx, node, gets, single=post, multi=pre, op_name="mhc_boundary")
        n += 1
    return n


def run(graph: fx.Graph, ctx: PassContext, boundary: bool = False) -> int:
    return fuse_pre(graph, ctx) + (fuse_boundary(graph, ctx) if boundary else 0)
