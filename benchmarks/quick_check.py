"""A few minutes on the GPU: the kernel variants that were built and checked on CPU only, side by side
with the defaults at M = 65536 (V4.1-Flash shapes), correctness first, then time. Prints one table.

    source .devsite/setup.sh && python3 benchmarks/quick_check.py [--m 65536]

Times are CUDA-event means over a few launches after a warm-up (at this M a launch costs far less
than the kernel); the benchmarks proper (bench_*.py) use CUDA graphs and write JSON.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS: list[tuple[str, str, str, str]] = []


def ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def row(family: str, variant: str, check: str, t: float | None) -> None:
    ROWS.append((family, variant, check, "-" if t is None else f"{t:.3f}"))
    print(f"{family:8} {variant:34} {check:28} {ROWS[-1][3]}", flush=True)


def kv(m: int) -> None:
    from dsv41_passes.lowering.triton import rope_store as rk

    d, rd, block = 512, 64, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    kv_in = (torch.randn(m, d, device="cuda", generator=g) * 4).bfloat16()
    w = torch.rand(d, device="cuda", generator=g) + 0.5
    ang = torch.rand(m, rd // 2, device="cuda", generator=g) * 6.3
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(2 * m, device="cuda")[:m]
    outs = {}
    for hw in (True, False):
        cache = torch.zeros(2 * m, d, dtype=torch.bfloat16, device="cuda")
        cfg = dict(rk.KV_DEFAULT, HW=hw)
        run = lambda: rk.kv_rope_quant(kv_in, w, 1e-6, cos, sin, block, cache, slots,  # noqa: E731
                                       batch_invariant=True, config=cfg)
        outs[hw] = (run(), cache)
        row("kv", f"hardware cvt={hw}", "", ms(run))
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(outs[True], outs[False]))
    row("kv", "hardware == bit rule", f"bitwise {same}", None)


def mhc(m: int) -> None:
    from dsv41_passes.lowering.mhc_weights import build_parts
    from dsv41_passes.lowering.triton import mhc as tk

    d = 5120
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(m, 4, d, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 4 * d, device="cuda", generator=g) / (4 * d) ** 0.5
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda") * 0.5
    pre_prev, w = torch.rand(m, 4, device="cuda") + 0.1, torch.rand(d, device="cuda") + 0.5
    parts = build_parts(fn)
    rows = slice(0, 2048)
    exact = h[rows].flatten(1).double() @ fn.double().t()
    exact = exact * torch.rsqrt(h[rows].double().flatten(1).square().mean(-1, keepdim=True) + 1e-6)
    configs = {"default": None, "BLOCK_M 128, 8 warps": dict(BLOCK_M=128, num_warps=8, num_stages=3)}
    base_x = None
    for name, cfg in configs.items():
        mixes = tk.stats_mixes(h, parts, scale, base, 20, 1e-6, 1e-6, config=cfg)[rows].double()
        err = ((mixes - exact).norm() / exact.norm()).item()
        run = lambda cfg=cfg: tk.mhc_pre(h, pre_prev, parts, scale, base, w, 20, 1e-6, 1e-6, 1e-6,  # noqa: E731
                                         batch_invariant=False, config=cfg)
        x = run()[0]
        base_x = x if base_x is None else base_x
        row("mhc_pre", name, f"mixes {err:.2e}, x same {torch.equal(x, base_x)}", ms(run))


def wo_a(m: int) -> None:
    from dsv41_passes.lowering.tilelang import wo_a as tw

    h, d, g_, r, rd = 16, 512, 2, 1024, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    o = torch.randn(m, h, d, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(g_ * r, h // g_ * d, device="cuda", generator=gen) / 64).bfloat16()
    ang = torch.rand(m, rd // 2, device="cuda", generator=gen) * 6.3
    cs = torch.view_as_real(torch.polar(torch.ones_like(ang), ang))
    cos, sin = cs[..., 0], cs[..., 1]
    ref = torch.ops.dsv41.wo_a(o, w, cos, sin, rd, "reference", 0).float()
    for name, cfg in (("tilelang default", tw.default_config(m)),
                      ("tilelang one loop 128x256", dict(BM=128, BN=256, BK=64, stages=4, threads=256, one_loop=True)),
                      ("tilelang one loop 128x256 3st", dict(BM=128, BN=256, BK=64, stages=3, threads=256,
                                                             one_loop=True))):
        run = lambda cfg=cfg: tw.wo_a(o, w, cos, sin, rd, batch_invariant=False, config=cfg)  # noqa: E731
        err = ((run().float() - ref).norm() / ref.norm()).item()
        row("wo_a", name, f"vs reference {err:.1e}", ms(run) if err < 4e-3 else None)
    og = o.view(m, g_, -1).transpose(0, 1).contiguous()
    wt = w.view(g_, r, -1).transpose(1, 2)
    row("wo_a", "cuBLAS bmm, pre-transposed", "", ms(lambda: torch.bmm(og, wt)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=65536)
    ap.add_argument("--only", nargs="*", default=["kv", "mhc", "wo_a"])
    args = ap.parse_args()
    import dsv41_passes  # noqa: F401  (registers the ops)

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for name in args.only:
        try:
            globals()[name](args.m)
        except Exception:
            traceback.print_exc()
            row(name, "FAILED", "", None)
    print("\n| family | variant | check | ms |\n|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
