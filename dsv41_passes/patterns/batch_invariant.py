"""Batch-invariant mode: pin every remaining matmul to a kernel whose per-row arithmetic depends only on K.

Runs last (after the fusion families), only when the graph is compiled in
batch-invariant mode. ``mm``, ``addmm`` (bias added afterwards, elementwise) and
``bmm`` with float operands become ``dsv41.bi_mm`` / ``dsv41.bi_bmm``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .base import PassContext, Site

aten = torch.ops.aten
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _emit(graph: fx.Graph, node: fx.Node, op, args: tuple) -> fx.Node:
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]):
        out = op(*vals)
    with graph.inserting_before(node):
        new = graph.call_function(op, args)
    new.meta.update({k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
    new.meta["val"] = out
    return new


def rewrite(graph: fx.Graph, ctx: PassContext) -> int:
    n = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default, aten.bmm.default):
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype not in _FLOATS:
            continue
        other = ctx.sites.get(node)
        if other is not None and other.kind != "bi_matmul":
            # another family's site anchored here (skipped: its subgraph stays, this GEMM of it pinned): the
            # pinning gets a row of its own, and that site's status stays its own
            site = ctx.sites[("bi_matmul", node)] = Site("bi_matmul", node, other.location, other.layer, other.source)
        else:
            other, site = None, ctx.site(node, "bi_matmul")
        if node.target == aten.addmm.default:
            bias, a, b = node.args[:3]
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                site.reasons.append("addmm with alpha/beta")
                continue
            mm = _emit(graph, node, torch.ops.dsv41.bi_mm.default, (a, b, ctx.providers, ctx.mode))
            with graph.inserting_before(node):
                out = graph.call_function(aten.add.Tensor, (mm, bias))
            out.meta["val"] = val
        else:
            op = torch.ops.dsv41.bi_bmm.default if node.target == aten.bmm.default else torch.ops.dsv41.bi_mm.default
            out = _emit(graph, node, op, (*node.args[:2], ctx.providers, ctx.mode))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        if other is not None:
            other.anchor = out  # not erased by a rewrite of its own
        site.rewritten = True
        site.provider = "pinned"
        n += 1
    return n
