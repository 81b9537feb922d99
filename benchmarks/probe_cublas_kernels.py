"""Which cuBLAS kernels the WO-A anchor (``torch.bmm`` on a group-major o, as ``bench_wo_a.py`` times it) runs on
this GPU, per TP shape and M: the kernel name (nvjet names carry the tile, stages and cluster), grid, block, shared
memory and registers from the profiler's trace, and the kernel's time.

    source .devsite/setup.sh && python3 benchmarks/probe_cublas_kernels.py --m 65536 16384 4096 128 --tp 4 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

SHAPES = {4: (16, 512, 2, 1024), 1: (64, 512, 8, 1024)}  # TP: (heads, head dim, groups, rank)


def kernels(m: int, tp: int, reps: int = 20) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    h, d, g, r = SHAPES[tp]
    k = h * d // g
    o_gm = torch.randn(g, m, k, device="cuda").bfloat16()
    w_t = (torch.randn(g, r, k, device="cuda") / k**0.5).bfloat16().transpose(1, 2)
    z = torch.empty(g, m, r, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.bmm(o_gm, w_t, out=z)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.bmm(o_gm, w_t, out=z)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    seen: dict[str, dict] = {}
    for ev in events:
        if ev.get("cat") != "kernel":
            continue
        a = ev.get("args", {})
        row = seen.setdefault(ev["name"], {"kernel": ev["name"], "grid": a.get("grid"), "block": a.get("block"),
                                           "smem": a.get("shared memory"), "regs": a.get("registers per thread"),
                                           "us": []})
        row["us"].append(ev.get("dur", 0.0))
    out = []
    for row in seen.values():
        us = sorted(row.pop("us"))
        out.append(dict(row, tp=tp, m=m, calls=len(us), us_median=us[len(us) // 2]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[65536, 16384, 4096, 128, 1])
    ap.add_argument("--tp", type=int, nargs="+", default=[4, 1], choices=sorted(SHAPES))
    args = ap.parse_args()
    print("| TP | M | kernel | grid | block | smem | regs | calls | us (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp in args.tp:
        for m in args.m:
            for r in kernels(m, tp):
                print(f"| {tp} | {m} | `{r['kernel']}` | {r['grid']} | {r['block']} | {r['smem']} | {r['regs']} | "
                      f"{r['calls']} | {r['us_median']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
