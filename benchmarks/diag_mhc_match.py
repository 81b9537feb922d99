"""Why do the mHC stats/collapse patterns (not) match on this device? Prints the report and the graph around the
projection."""

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv41_passes as dp  # noqa: E402
from dsv41_passes.reference.mhc import hc_collapse, hc_mixes  # noqa: E402
from dsv41_passes.reference.model import rms_norm  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
d = int(sys.argv[1]) if len(sys.argv) > 1 else 5120


def unit(h, pre_prev, fn, scale, base, w):
    pre, post, comb = hc_mixes(h, fn, scale, base, 20, 1e-6, 1e-20)
    return rms_norm(hc_collapse(h, pre_prev), w, 1e-20), pre, post, comb


m = 33
args = (torch.randn(m, 4, d, device=dev).bfloat16(), torch.rand(m, 4, device=dev),
        torch.randn(24, 4 * d, device=dev) / 64,
        torch.rand(3, device=dev), torch.randn(24, device=dev), torch.rand(d, device=dev))
dp.compile(unit, dp.PassConfig())(*args)
rep = dp.last_report()
print(rep.to_markdown())
for ln in rep.before.splitlines():
    if re.search(r"aten\.(mm|addmm|bmm|constant_pad_nd|mean|sum)|pad", ln):
        print(ln.strip()[:220])
