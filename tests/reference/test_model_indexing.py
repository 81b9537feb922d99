"""A V4.1-Flash layer, after the passes, keeps every intermediate under 2^31 elements up to M = 65536.

Inductor indexes a kernel with int32 when its sizes fit at the first call's M and guards
that choice on M; a tensor of M * 2^16 elements (the window keys, [M, 128, 512]) made
the compiled layer recompile at M = 32768 on the H200. The post-grad graph is read right
after our passes with a symbolic token count, before any codegen.
"""

import pytest
import sympy
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import dsv41_passes as dp
from dsv41_passes.reference import DeepseekV41Config
from dsv41_passes.reference.model import BatchMeta, Block

INT32_MAX = 2**31 - 1
MAX_TOKENS = 65536


def _is_view(node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info is not None)


class _Inspected(Exception):
    pass


def _largest_numel(graph) -> tuple[int, str]:
    worst = (0, "")
    for node in graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or _is_view(node):
            continue  # a view launches no kernel; the kernels reading it iterate over their own sizes
        expr = sympy.sympify(val.numel())
        if not expr.free_symbols:
            continue  # static buffers: Inductor picks int64 for those without a guard on M
        n = int(expr.subs({s: MAX_TOKENS for s in expr.free_symbols}))
        if n > worst[0]:
            worst = (n, f"{node.format_node()} {tuple(val.shape)}")
    return worst


class _ThenInspect(CustomGraphPass):
    """Our pass manager, then record the graph and stop the compile."""

    def __init__(self, inner):
        self.inner, self.graph = inner, None

    def __call__(self, graph):
        self.inner(graph)
        self.graph = graph
        raise _Inspected

    def uuid(self):
        return None


def _post_pass_graph(fn, args, config):
    opts = dp.inductor_options(config)
    spy = _ThenInspect(opts["post_grad_custom_post_pass"])
    opts["post_grad_custom_post_pass"] = spy
    opts["fx_graph_cache"] = False
    with torch.inference_mode(), pytest.raises(Exception) as info:
        torch.compile(fn, options=opts, fullgraph=True)(*args)
    assert spy.graph is not None, info.value
    return spy.graph


def test_flash_layer_intermediates_fit_int32_indexing_at_65536():
    cfg = DeepseekV41Config.flash(tp_size=4, n_routed_experts=16, max_position_embeddings=MAX_TOKENS)
    dev = torch.device("cpu")  # uninitialised weights (~0.5 GB); the meta device defeats the matcher
    with dev:
        block = Block(cfg, 2, 64, 2).eval()  # a small Q buffer: static sizes need no guard
        table = torch.zeros(MAX_TOKENS, cfg.qk_rope_head_dim // 2, dtype=torch.complex64)
    w = cfg.sliding_window

    def layer(h, pre, positions, cu):
        return block(h, pre, table[positions], BatchMeta(positions, cu, None, w, 2 * w))

    m = 9
    h = torch.empty(m, cfg.hc_mult, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
    pre = torch.empty(m, cfg.hc_mult, device=dev)
    pos = torch.arange(m, device=dev)
    cu = torch.tensor([0, 4, m], device=dev)
    for t in (h, pre, pos):
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.reset()
    graph = _post_pass_graph(layer, (h, pre, pos, cu), dp.PassConfig())
    sites = dp.last_report().sites
    assert sites == {"mhc_stats": 2, "mhc_collapse": 2, "mhc_post": 2, "q_rope_store": 1, "kv_rope_store": 1,
                     "wo_a": 1}, sites
    n, where = _largest_numel(graph)
    assert 0 < n <= INT32_MAX, f"{n} elements at M = {MAX_TOKENS}: {where}"
