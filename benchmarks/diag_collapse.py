"""Diagnose collapse(+norm) mismatches at large M on the GPU: which rows, how far, kernel vs eager vs float64."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_mhc import EPS, inputs  # noqa: E402
from dsv41_passes.lowering.triton import mhc as tk  # noqa: E402
from dsv41_passes.reference import mhc as ref  # noqa: E402
from dsv41_passes.reference.model import rms_norm  # noqa: E402


def ulp(x):
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-126))) - 7)


for m in (16384, 40000, 65536):
    t = inputs(m)
    for w in (None, t["w"]):
        k = tk.mhc_collapse(t["h"], t["pre_prev"], w, EPS, batch_invariant=True)
        e = ref.hc_collapse(t["h"], t["pre_prev"])
        e = e if w is None else rms_norm(e, w, EPS)
        bad_rows = []
        maxerr = 0.0
        for lo in range(0, m, 4096):
            hi = min(m, lo + 4096)
            x64 = (t["pre_prev"][lo:hi].double().unsqueeze(-1) * t["h"][lo:hi].double()).sum(1)
            if w is not None:
                xb = x64.to(torch.bfloat16).double()
                x64 = w.double() * (xb * torch.rsqrt(xb.square().mean(-1, keepdim=True) + EPS))
            err = (k[lo:hi].double() - x64).abs() / ulp(x64)
            maxerr = max(maxerr, err.max().item())
            rows = (err > 4).any(-1).nonzero().flatten() + lo
            bad_rows += rows.tolist()
        ke = (k.float() - e.float()).abs().max().item()
        print(f"M={m} norm={w is not None}: max err {maxerr:.2f} ulp vs float64; rows > 4 ulp: {len(bad_rows)} "
              f"{bad_rows[:8]}{'...' if len(bad_rows) > 8 else ''} last {bad_rows[-3:]}; max |kernel - eager| {ke:.3e}")
    del t
    torch.cuda.empty_cache()
