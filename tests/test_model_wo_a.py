"""The tiny model compiled with every family on: each layer's attention tail becomes one dsv41::wo_a."""

import os

import pytest
import torch

import dsv41_passes as dp
from helpers import EMULATE, eager, packed, tiny_model, unique_graphs

VIEW_OPS = {"reshape.default", "view.default", "_unsafe_view.default", "select.int", "view_as_real.default",
            "slice.Tensor", "unsqueeze.default", "squeeze.dim"}
LAYOUT_COPIES = ("permute", "clone", "copy", "contiguous", "transpose", "_to_copy", "expand")


def _layout_copies_around(graph, node):
    """Layout ops among the fused op's producers and consumers, looking through pure views."""
    found = []
    for step in (graph.predecessors, graph.successors):
        frontier = list(step(node))
        while frontier:
            n = frontier.pop()
            target = graph.nodes[n]["target"]
            if any(c in target for c in LAYOUT_COPIES):
                found.append(f"{n} ({target})")
            if target in VIEW_OPS:
                frontier.extend(step(n))
    return found


@pytest.mark.slow
def test_tiny_model_fuses_every_wo_a_site():
    model = tiny_model()
    n_layers = model.config.num_hidden_layers
    f = dp.compile(model, dp.PassConfig(), options={**EMULATE, "fx_graph_cache": False})
    batches = [packed([5, 9], seed=0), packed([3, 17, 2], seed=1)]  # two token counts, one graph
    outs, graphs = [], []
    for b in batches:
        outs.append(f(*b))
        graphs.append(unique_graphs())
    assert graphs[1] == graphs[0], graphs  # the second length compiled nothing new
    rep = dp.last_report()

    assert rep.sites.get("wo_a") == n_layers, rep.to_markdown()
    assert not [r for r in rep.skipped if r.kind == "wo_a"], rep.to_markdown()
    cpu_kernel = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"  # interpreter on CPU hosts
    assert {r.provider for r in rep.rows if r.kind == "wo_a"} == {cpu_kernel}, rep.to_markdown()

    g = rep.networkx()
    fused = [n for n, a in g.nodes(data=True) if a["target"] == "wo_a.default"]
    assert len(fused) == n_layers
    for n in fused:
        assert not _layout_copies_around(g, n), (n, _layout_copies_around(g, n))
        (consumer,) = g.successors(n)
        assert g.nodes[consumer]["target"] == "mm.default"  # z goes straight into wo_b
    # the inverse RoPE went into the fused ops: no conj'd table is left in the graph
    assert "_conj" not in rep.after and "_conj" in rep.before

    for b, out in zip(batches, outs):
        ref = eager(model, *b)
        torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1.6e-2 * ref.abs().max().item())


@pytest.mark.slow
@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
def test_decode_graph_rewrites_every_family(batch_invariant):
    """M = 1 (a single sequence's decode step) gets its own static graph, whose decompositions lay out
    size-1 dims differently: every family is still rewritten there, the attention tail included."""
    model = tiny_model()
    n = model.config.num_hidden_layers
    f = dp.compile(model, dp.PassConfig(batch_invariant=batch_invariant),
                   options={**EMULATE, "fx_graph_cache": False})
    args = packed([1], seed=3)
    out = f(*args)
    rep = dp.last_report()
    want = {"mhc_post": 2 * n, "mhc_stats": 2 * n, "mhc_collapse": 2 * n + 1, "q_rope_store": n,
            "kv_rope_store": n, "wo_a": n}
    sites = dict(rep.sites)
    if batch_invariant:  # and every remaining matmul pinned to the fixed-order kernels
        assert sites.pop("bi_matmul", 0) > 0, rep.to_markdown()
    assert sites == want, rep.to_markdown()
    assert not [w for w in rep.warnings if "rewrote no site" in w], rep.warnings
    ref = eager(model, *args)
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1.6e-2 * ref.abs().max().item())
