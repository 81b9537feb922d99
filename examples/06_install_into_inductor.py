"""Install the passes into your own Inductor compile, as a vLLM/SGLang-style backend would.

    python examples/06_install_into_inductor.py
"""

import torch

import dsv41_passes as dp
from dsv41_passes.reference.mhc import hc_mixes, hc_post

cfg = dp.PassConfig(rope_store=False, wo_a=False)


def sub_block_boundary(y, res, post, comb, fn, scale, base):
    h = hc_post(y, res, post, comb)
    return h, *hc_mixes(h, fn, scale, base, 20, 1e-6, 1e-6)


m, n, d = 33, 4, 128
args = (
    torch.randn(m, d).bfloat16(), torch.randn(m, n, d).bfloat16(), 2 * torch.rand(m, n),
    torch.softmax(torch.randn(m, n, n), -1), torch.randn(24, n * d) / 32, torch.rand(3), torch.randn(24),
)
# The global Inductor config is untouched. A hit in Inductor's FX graph cache skips the passes and
# with them the report (dsv41_passes.compile and the "dsv41" backend keep reports across hits); this
# example turns the cache off so that it always has a report to print.
options = {**dp.inductor_options(cfg), "fx_graph_cache": False}
compiled = torch.compile(sub_block_boundary, options=options)
with torch.inference_mode():
    out = compiled(*args)
print(dp.last_report().to_markdown())
