"""Kernel durations of the mHC pre/stats launches at decode sizes (M = 1 ... 1024), from the CUDA profiler
(torch.profiler, device time per kernel, median of 20 calls), V4.1-Flash shapes.

    source .devsite/setup.sh && python3 benchmarks/probe_mhc_small.py
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import dsv41_passes  # noqa: F401
    from benchmarks.quick_check import mhc_inputs
    from dsv41_passes.lowering.triton import mhc as tk

    for m in (1, 128, 1024):
        t = mhc_inputs(m)
        calls = {
            "mhc_pre": lambda: tk.mhc_pre(t["h"], t["pre_prev"], t["parts"], t["scale"], t["base"], t["w"], 20, 1e-6,
                                          1e-6, 1e-6, batch_invariant=False),
            "mhc_stats": lambda: tk.mhc_stats(t["h"], t["parts"], t["scale"], t["base"], 20, 1e-6, 1e-6,
                                              batch_invariant=False),
        }
        for name, fn in calls.items():
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            per = defaultdict(list)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
            parts = ", ".join(f"{k[:28]} {statistics.median(v):.2f} us x{len(v) // 20}" for k, v in per.items())
            print(f"M={m:5d} {name:9} {parts}", flush=True)


if __name__ == "__main__":
    main()
