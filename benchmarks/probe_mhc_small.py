"""Kernel durations of the mHC pre/stats launches at decode sizes (M = 1 ... 1024), from the CUDA profiler
(torch.profiler, device time per kernel, median of 20 calls), V4.1-Flash shapes.

    source .devsite/setup.sh && python3 benchmarks/probe_mhc_small.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import kernel_times_us  # noqa: E402


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
            parts = ", ".join(f"{k[:28]} {us:.2f} us x{n}" for k, (us, n) in kernel_times_us(fn).items())
            print(f"M={m:5d} {name:9} {parts}", flush=True)


if __name__ == "__main__":
    main()
