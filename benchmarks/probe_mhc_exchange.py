"""The Triton mHC projection ops with ``finish="exchange"`` (the slice programs of a row block wait for each
other and finish it in the same launch) against their untuned config, V4.1-Flash shapes: every output's bits
compared with the untuned config's, then timed as a CUDA-graph replay with the device time of each kernel.

    source .devsite/setup.sh && python3 benchmarks/probe_mhc_exchange.py [M ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import kernel_times_us, time_ms  # noqa: E402

ITERS, EPS, D = 20, 1e-6, 5120


def variants(op: str, m: int) -> dict[str, dict]:
    from dsv41_passes.lowering.triton.mhc_common import untuned_config

    base = untuned_config(op, m, D, False)
    out = {"untuned": base, "exchange": dict(base, finish="exchange")}
    if m >= 4096:
        for bm, w, st in ((64, 4, 4), (128, 4, 3), (128, 8, 3)):
            if op == "mhc_boundary" and bm > 64:
                continue
            out[f"exchange {bm}x{w} st{st}"] = dict(base, BLOCK_M=bm, num_warps=w, num_stages=st, finish="exchange")
    return out


def main() -> None:
    import dsv41_passes  # noqa: F401
    from benchmarks.quick_check import mhc_inputs
    from dsv41_passes.lowering.triton import mhc as tk

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    sizes = [int(a) for a in sys.argv[1:]] or [1, 16, 64, 128, 256, 4096, 16384, 65536]
    rows = []
    for m in sizes:
        t = mhc_inputs(m)
        runs = {
            "mhc_stats": lambda c: tk.mhc_stats(t["h"], t["parts"], t["scale"], t["base"], ITERS, EPS, EPS,
                                                batch_invariant=False, config=c),
            "mhc_pre": lambda c: tk.mhc_pre(t["h"], t["pre_prev"], t["parts"], t["scale"], t["base"], t["w"], ITERS,
                                            EPS, EPS, EPS, batch_invariant=False, config=c),
            "mhc_boundary": lambda c: tk.mhc_boundary(t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], t["parts"],
                                                      t["scale"], t["base"], t["w"], ITERS, EPS, EPS, EPS,
                                                      batch_invariant=False, config=c),
        }
        for op, run in runs.items():
            ref = None
            for name, cfg in variants(op, m).items():
                try:
                    out = run(cfg)
                    ref = out if ref is None else ref
                    same = all(torch.equal(a, b) for a, b in zip(out, ref))
                    ms = time_ms(lambda cfg=cfg: run(cfg))
                    ks = " + ".join(f"{k.strip('_')[:8]} {us:.1f}"
                                    for k, (us, _) in kernel_times_us(lambda cfg=cfg: run(cfg)).items())
                    rows.append((m, op, name, same, f"{ms * 1e3:.2f}", ks))
                except Exception as e:  # noqa: BLE001 - a config a shape cannot take
                    rows.append((m, op, name, "-", "-", f"{type(e).__name__}: {str(e)[:80]}"))
                print(*rows[-1], sep=" | ", flush=True)
        t = runs = None
        torch.cuda.empty_cache()
    print("\nus per call (CUDA-graph replay); bits = all outputs equal to the untuned config's")
    print("| M | op | config | bits | us | kernels (us) |\n|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(str(v) for v in r) + " |")


if __name__ == "__main__":
    main()
