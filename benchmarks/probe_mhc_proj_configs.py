"""Launch configs of the Triton mHC projection ops (``mhc_stats``, ``mhc_pre``) at V4.1-Flash shapes: every
tuner candidate with the default's finish, outputs compared bitwise with the default's (every candidate keeps
one wgmma shape, so the bits should not move), timed as CUDA-graph replays with each kernel's device time.

    source .devsite/setup.sh && python3 benchmarks/probe_mhc_proj_configs.py [M ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import compare_and_time, print_markdown  # noqa: E402

ITERS, EPS, D = 20, 1e-6, 5120


def variants(op: str, m: int) -> dict[str, dict]:
    from dsv41_passes.lowering.triton.mhc_common import CANDIDATES, untuned_config

    base = untuned_config(op, m, D, False)
    out = {"default": base}
    for c in CANDIDATES[op]:
        cfg = dict(base, **c)
        name = f"{cfg['BLOCK_M']}x{cfg['num_warps']} st{cfg['num_stages']} {cfg.get('finish', 'last')}"
        if cfg != base and name not in out:
            out[name] = cfg
    return out


def main() -> None:
    import triton

    import dsv41_passes  # noqa: F401
    from benchmarks.quick_check import mhc_inputs
    from dsv41_passes.lowering.triton import mhc as tk

    print(torch.cuda.get_device_name(), torch.__version__, "triton", triton.__version__, flush=True)
    sizes = [int(a) for a in sys.argv[1:]] or [65536, 16384, 4096]
    rows = []
    for m in sizes:
        t = mhc_inputs(m)

        def stats(c):
            return tk.mhc_stats(t["h"], t["parts"], t["scale"], t["base"], ITERS, EPS, EPS, batch_invariant=False,
                                config=c)

        def pre(c):
            return tk.mhc_pre(t["h"], t["pre_prev"], t["parts"], t["scale"], t["base"], t["w"], ITERS, EPS, EPS, EPS,
                              batch_invariant=False, config=c)

        rows += compare_and_time(stats, variants("mhc_stats", m), (m, "stats"))
        rows += compare_and_time(pre, variants("mhc_pre", m), (m, "pre"))
        t = None
        torch.cuda.empty_cache()
    print_markdown("us per call (CUDA-graph replay); bits = outputs equal to the default's",
                   ["M", "op", "config", "bits", "us", "kernels (us)"], rows)


if __name__ == "__main__":
    main()
