"""KV store at decode and mid sizes: launch config x rope-table layout, through the op and the kernel directly.

    source .devsite/setup.sh && python3 benchmarks/probe_kv_small.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_rope_store import BLOCK, EPS, SLOTS, inputs  # noqa: E402
from benchmarks.common import time_ms  # noqa: E402
from dsv41_passes.lowering.triton import kv_rope_quant as rk  # noqa: E402

rows = []
SMALL = (dict(BLOCK_T=1, num_warps=2), dict(BLOCK_T=2, num_warps=2), dict(BLOCK_T=4, num_warps=4))
MID = (dict(BLOCK_T=2, num_warps=2), *(dict(BLOCK_T=t, num_warps=w) for t in (4, 8, 16) for w in (4, 8)))
for m in (1, 128, 4096, 16384):
    _, kv, weight, freqs, cos, sin, slots = inputs(m, 1)
    cache = torch.zeros(SLOTS, 512, dtype=torch.bfloat16, device="cuda")
    tables = {"interleaved (paired)": (cos, sin)}
    if m <= 128:
        tables["planar contiguous"] = (cos.contiguous(), sin.contiguous())
    for tname, (c, s) in tables.items():
        for cfg in SMALL if m <= 128 else MID:
            t = time_ms(lambda c=c, s=s, cfg=cfg: rk.kv_rope_quant(kv, weight, EPS, c, s, BLOCK, cache, slots,
                                                                 batch_invariant=False, config=cfg))
            rows.append((m, tname, str(cfg), "kernel", t))
        t = time_ms(lambda c=c, s=s: torch.ops.dsv41.kv_rope_quant_store(cache, kv, weight, EPS, c, s, slots, BLOCK,
                                                                        "triton,reference", 0))
        rows.append((m, tname, "default", "op", t))
print("| M | tables | config | path | us |\n|---|---|---|---|---|")
for m, tname, cfg, path, t in rows:
    print(f"| {m} | {tname} | {cfg} | {path} | {1000 * t:.2f} |")

# The op path timed slower than its kernel (run 18: 4.49 vs 2.79 us at M = 128): list the device work of each.
from torch.profiler import ProfilerActivity, profile  # noqa: E402

for m in (128, 4096):
    _, kv, weight, freqs, cos, sin, slots = inputs(m, 1)
    cache = torch.zeros(SLOTS, 512, dtype=torch.bfloat16, device="cuda")
    calls = {
        "op": lambda: torch.ops.dsv41.kv_rope_quant_store(cache, kv, weight, EPS, cos, sin, slots, BLOCK,
                                                          "triton,reference", 0),
        "kernel": lambda: rk.kv_rope_quant(kv, weight, EPS, cos, sin, BLOCK, cache, slots, batch_invariant=False),
    }
    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"--- M={m} {name}: device work of 10 calls")
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
                print(f"  {e.key[:90]:90} calls={e.count} device_us={e.self_device_time_total:.1f}")
