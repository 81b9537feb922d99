"""Layouts of the Triton mHC finish kernel, V4.1-Flash shapes: the row-major norm (``norm_rows`` rows x 1024
columns a program) against the (row block, column part) layout at prefill sizes for ``mhc_pre``, and
``finish="kernel"`` against the last-arriver finish for ``mhc_stats``. Each variant's outputs are compared
bitwise with the untuned config's, then timed as a CUDA-graph replay with the device time of each kernel.

    source .devsite/setup.sh && python3 benchmarks/probe_mhc_finish.py [--stats-rows] [M ...]

``--stats-rows``: instead, ``mhc_pre``'s stats programs of 16 / 32 / 64 rows (``finish_rows``) at M >= 4096.
``--stats-kernel``: instead, the TileLang ``mhc_pre``'s finish on random partials of M rows (default 1536, 4096,
16384, 65536): the stats kernel with one row a thread ("rows_full") against the finish kernel's stats programs
("tiles"), timed in turn, with their bits compared.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import compare_and_time, print_markdown  # noqa: E402

ITERS, EPS, D = 20, 1e-6, 5120


def variants(op: str, m: int) -> dict[str, dict]:
    from dsv41_passes.lowering.triton.mhc_common import untuned_config

    base = untuned_config(op, m, D, False)
    out = {"untuned": base}
    if "--stats-rows" in sys.argv:
        if op == "mhc_pre" and m >= 4096:
            out |= {f"finish_rows {fr}": dict(base, finish_rows=fr) for fr in (16, 32, 64)}
    elif op == "mhc_stats":
        out["finish kernel"] = dict(base, finish="kernel")
    elif m >= 4096:
        for rx in (0, 1, 2, 4, 8, 16):
            out[f"norm_rows {rx}"] = dict(base, norm_rows=rx)
    return out


def stats_kernels(sizes: list[int]) -> None:
    """``--stats-kernel`` (see the module docstring)."""
    from benchmarks.common import time_interleaved
    from dsv41_passes.lowering.triton.mhc_common import LAUNCH_OPTIONS
    from dsv41_passes.lowering.triton.mhc_finish import finish_stats

    rows = []
    for m in sizes:
        g = torch.Generator(device="cuda").manual_seed(m)
        nrb, k = -(-m // 64), 4 * D
        ws = torch.randn(nrb * 16 * 64 * 24, device="cuda", generator=g)
        ss = torch.rand(nrb * 16 * 64, device="cuda", generator=g) * k / 16
        scale = torch.rand(3, device="cuda", generator=g) + 0.5
        base = torch.randn(24, device="cuda", generator=g)
        outs = {kern: [torch.empty((m, c), device="cuda") for c in (4, 4, 16)] for kern in ("tiles", "rows_full")}

        def fn(kern):
            return lambda: finish_stats(ws, ss, scale, base, *outs[kern], None, m, k, 64, ITERS, EPS, EPS,
                                        LAUNCH_OPTIONS, kernel=kern)
        fns = {kern: fn(kern) for kern in outs}
        for f in fns.values():
            f()
        same = all(torch.equal(a, b) for a, b in zip(outs["tiles"], outs["rows_full"]))
        times = time_interleaved(fns, rounds=8)
        gb = (ws.numel() + ss.numel() + 24 * m) * 4 / 1e9
        for kern, (med, low) in times.items():
            rows.append((m, kern, same, f"{med * 1e3:.2f}", f"{low * 1e3:.2f}", f"{gb / med:.2f}"))
            print(*rows[-1], sep=" | ", flush=True)
    print_markdown("the stats of the TileLang mhc_pre's partials, us per call (CUDA-graph replays, 8 rounds in turn); "
                   "bits = the two kernels' pre, post and comb equal",
                   ["M", "kernel", "bits", "us (median)", "us (min)", "TB/s (partials + outputs)"], rows)


def main() -> None:
    import dsv41_passes  # noqa: F401
    from benchmarks.quick_check import mhc_inputs
    from dsv41_passes.lowering.triton import mhc as tk

    import datetime

    import triton

    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          datetime.date.today().isoformat(), flush=True)
    sizes = [int(a) for a in sys.argv[1:] if not a.startswith("--")]
    if "--stats-kernel" in sys.argv:
        stats_kernels(sizes or [1536, 4096, 16384, 65536])
        return
    sizes = sizes or [1, 16, 128, 256, 4096, 16384, 65536]
    rows = []
    for m in sizes:
        t = mhc_inputs(m)
        runs = {
            "mhc_stats": lambda c: tk.mhc_stats(t["h"], t["parts"], t["scale"], t["base"], ITERS, EPS, EPS,
                                                batch_invariant=False, config=c),
            "mhc_pre": lambda c: tk.mhc_pre(t["h"], t["pre_prev"], t["parts"], t["scale"], t["base"], t["w"], ITERS,
                                            EPS, EPS, EPS, batch_invariant=False, config=c),
        }
        for op, run in runs.items():
            rows += compare_and_time(run, variants(op, m), (m, op))
        t = runs = None
        torch.cuda.empty_cache()
    print_markdown("us per call (CUDA-graph replay); bits = all outputs equal to the untuned config's",
                   ["M", "op", "config", "bits", "us", "kernels (us)"], rows)


if __name__ == "__main__":
    main()
