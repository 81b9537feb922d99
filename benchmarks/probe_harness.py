"""Why a bench times a kernel slower than a probe does: the same timing, repeated after each step the
bench takes before it (run 18: post 1.606 ms in bench_mhc vs 1.449 in probe_post at M = 65536; KV at
M = 128 9.7 us through the op in bench_rope_store vs 2.8 in probe_kv_small).

    source .devsite/setup.sh && python3 benchmarks/probe_harness.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_mhc, bench_rope_store as brs  # noqa: E402
from benchmarks.common import measure_copy_bandwidth, time_ms  # noqa: E402
import dsv41_passes as dp  # noqa: E402
from dsv41_passes.lowering.triton import mhc as tk  # noqa: E402

ROWS = []


def show(what: str, step: str, fns: dict) -> None:
    for name, fn in fns.items():
        ms = time_ms(fn)
        ROWS.append((what, step, name, ms))
        print(ROWS[-1], flush=True)


def post(m: int = 65536) -> None:
    tkm, _ = bench_mhc.tile_kernels()
    t = bench_mhc.inputs(m)
    y, h, po, co = t["y"], t["h"], t["post"], t["comb"]
    fns = {"triton": lambda: tk.mhc_post(y, h, po, co, batch_invariant=False)}
    if tkm is not None:
        fns["tilekernels"] = lambda: bench_mhc.tilekernels_post(tkm, y, h, po, co)
    what = f"post M={m}"
    show(what, "1 fresh", fns)
    compiled = torch.compile(bench_mhc.ref_post, dynamic=True)
    compiled(y, h, po, co)
    show(what, "2 after compiling Inductor's post", fns)
    time_ms(lambda: compiled(y, h, po, co))
    show(what, "3 after timing Inductor's post", fns)
    ok, _ = bench_mhc.check("post", "triton", fns["triton"](), t)
    torch.cuda.empty_cache()
    step = f"4 after the reference check (ok={ok}) + empty_cache"
    show(what, step, fns)
    d0 = tk.DEFAULTS["mhc_post"]
    configs = {"default, order=col": dict(d0, order="col"), "R1 D1024 w4": dict(BLOCK_R=1, BLOCK_D=1024, num_warps=4),
               "R1 D2048 w8": dict(BLOCK_R=1, BLOCK_D=2048, num_warps=8),
               "R2 D1024 w8": dict(BLOCK_R=2, BLOCK_D=1024, num_warps=8),
               "R4 D1024 w8": dict(BLOCK_R=4, BLOCK_D=1024, num_warps=8),
               "R1 D512 w4": dict(BLOCK_R=1, BLOCK_D=512, num_warps=4),
               "R2 D512 w4": dict(BLOCK_R=2, BLOCK_D=512, num_warps=4)}
    show(what, step, {k: (lambda c=c: tk.mhc_post(y, h, po, co, batch_invariant=False, config=c))
                      for k, c in configs.items()})
    out = torch.empty_like(h)
    show(what, "5 then an unused 2.7 GB tensor allocated", fns)
    del out
    t = y = h = po = co = None
    torch.cuda.empty_cache()


def kv(m: int) -> None:
    _, x, weight, freqs, cos, sin, slots = brs.inputs(m, 1)
    cache = torch.zeros(brs.SLOTS, brs.D, dtype=torch.bfloat16, device="cuda")
    fns = {
        "op": lambda: torch.ops.dsv41.kv_rope_quant_store(cache, x, weight, brs.EPS, cos, sin, slots, brs.BLOCK,
                                                          brs.PROVIDERS, 0),
        "kernel": lambda: brs.tkv.kv_rope_quant(x, weight, brs.EPS, cos, sin, brs.BLOCK, cache, slots,
                                                batch_invariant=False),
    }
    what = f"kv M={m}"
    show(what, "1 fresh", fns)
    time_ms(lambda: brs.kv_eager(x, weight, freqs, cache, slots))
    show(what, "2 after timing eager", fns)
    torch._dynamo.reset()
    compiled = torch.compile(brs.kv_eager, dynamic=False)
    compiled(x, weight, freqs, cache, slots)
    time_ms(lambda: compiled(x, weight, freqs, cache, slots))
    show(what, "3 after compiling + timing Inductor", fns)
    torch._dynamo.reset()
    passed = dp.compile(brs.KVStore(weight, cache), dp.PassConfig(mhc=False, wo_a=False,
                                                                  providers=("triton", "reference")))
    passed(x, freqs, slots)
    fns["pass"] = lambda: passed(x, freqs, slots)
    show(what, "4 after dp.compile", fns)


def main() -> None:
    print(torch.cuda.get_device_name(), f"copy {measure_copy_bandwidth() / 1e12:.3f} TB/s", flush=True)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for m in (128, 4096):
        kv(m)
    post()
    print("\n| what | step | variant | ms |\n|---|---|---|---|")
    for what, step, name, ms in ROWS:
        print(f"| {what} | {step} | {name} | {ms:.4f} |")


if __name__ == "__main__":
    main()
