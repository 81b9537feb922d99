"""mHC post at prefill sizes: program order x launch config x input set, TileKernels alongside.

Run 17 timed the same post config at 1.683 ms in bench_mhc and 1.525 in quick_check (M = 65536);
this probe times both input sets in one process, each variant twice, to separate the kernel from
the harness.

    source .devsite/setup.sh && python3 benchmarks/probe_post.py [--m 65536 16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_mhc, quick_check  # noqa: E402
from benchmarks.common import measure_copy_bandwidth, time_ms  # noqa: E402
from dsv41_passes.lowering.triton import mhc as tk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[65536, 16384])
    args = ap.parse_args()
    bw = measure_copy_bandwidth()
    tkm, why = bench_mhc.tile_kernels()
    print(torch.cuda.get_device_name(), f"copy {bw / 1e12:.3f} TB/s", "TileKernels:", why or "yes", flush=True)
    d0 = tk.DEFAULTS["mhc_post"]
    configs = {
        "default": d0,
        "default, order=col": dict(d0, order="col"),
        "default, normal loads": dict(d0, loads="normal"),
        "R1 D1024 w4": dict(BLOCK_R=1, BLOCK_D=1024, num_warps=4),
        "R1 D2048 w8": dict(BLOCK_R=1, BLOCK_D=2048, num_warps=8),
        "R2 D1024 w8": dict(BLOCK_R=2, BLOCK_D=1024, num_warps=8),
        "R4 D1024 w8": dict(BLOCK_R=4, BLOCK_D=1024, num_warps=8),
        "R2 D512 w4": dict(BLOCK_R=2, BLOCK_D=512, num_warps=4),
    }
    rows = []
    for m in args.m:
        roof = m * 5120 * 2 * 9 / bw * 1e3
        sets = {"bench_mhc inputs": bench_mhc.inputs(m), "quick_check inputs": quick_check.mhc_inputs(m)}
        for sname, t in sets.items():
            y, h, po, co = t["y"], t["h"], t["post"], t["comb"]
            base = tk.mhc_post(y, h, po, co, batch_invariant=True)
            fns = {name: (lambda cfg=cfg: tk.mhc_post(y, h, po, co, batch_invariant=False, config=cfg))
                   for name, cfg in configs.items()}
            if tkm is not None:
                fns["tilekernels"] = lambda: bench_mhc.tilekernels_post(tkm, y, h, po, co)
            for rep in (1, 2):
                for name, fn in fns.items():
                    out = fn()
                    same = torch.equal(out.view(torch.int16), base.view(torch.int16))
                    ms = time_ms(fn)
                    rows.append((m, sname, name, rep, same, ms, 100 * roof / ms))
                    print(rows[-1], flush=True)
            ms = time_ms(fns["default"], graph=False)
            rows.append((m, sname, "default, no graph", 1, True, ms, 100 * roof / ms))
        del sets, t
        torch.cuda.empty_cache()
    print("\n| M | inputs | variant | pass | bitwise = default | ms | % roofline |\n|---|---|---|---|---|---|---|")
    for m, sname, name, rep, same, ms, pct in rows:
        print(f"| {m} | {sname} | {name} | {rep} | {same} | {ms:.4f} | {pct:.0f}% |")


if __name__ == "__main__":
    main()
