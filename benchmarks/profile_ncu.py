"""Launch each fused kernel once at M = 65536 (V4.1-Flash shapes) inside an NVTX range, for Nsight Compute.

    source .devsite/setup.sh && ncu --clock-control none --nvtx --nvtx-include "profile/" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy --section LaunchStats python3 benchmarks/profile_ncu.py

Every kernel is compiled and run once at a small M first (outside the range), so the profiled
launches are the steady-state binaries (M is a runtime argument: the same binary).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def launches(m: int) -> dict:
    """name -> zero-argument callable launching one kernel at M = m."""
    from benchmarks.quick_check import mhc_inputs
    from dsv41_passes.lowering.tilelang import wo_a as tw
    from dsv41_passes.lowering.triton import mhc as tm
    from dsv41_passes.lowering.triton import kv_rope_quant as rk

    t = mhc_inputs(m)
    g = torch.Generator(device="cuda").manual_seed(1)
    kv_in = (torch.randn(m, 512, device="cuda", generator=g) * 4).bfloat16()
    kw = torch.rand(512, device="cuda", generator=g) + 0.5
    ang = torch.rand(m, 32, device="cuda", generator=g) * 6.3
    cs = torch.view_as_real(torch.polar(torch.ones_like(ang), ang))  # interleaved, as the model's table
    cos, sin = cs[..., 0], cs[..., 1]
    slots = torch.randperm(2 * m, device="cuda")[:m]
    cache = torch.zeros(2 * m, 512, dtype=torch.bfloat16, device="cuda")
    o = torch.randn(m, 16, 512, device="cuda", generator=g).bfloat16()
    wa = (torch.randn(2048, 4096, device="cuda", generator=g) / 64).bfloat16()
    from dsv41_passes.lowering.mhc_weights import slice_major
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    sliced = slice_major(t["parts"], 5120, 24)
    return {
        "mhc_pre_tilelang": lambda: tlp.partials(t["h"], t["pre_prev"], sliced, t["w"], 1e-6),
        # the post inside the persistent kernel, then the finish (two kernels in the range)
        "mhc_boundary_tilelang": lambda: tlp.mhc_boundary(t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], sliced,
                                                          t["scale"], t["base"], t["w"], 20, 1e-6, 1e-6, 1e-6),
        "mhc_pre_tilelang_rings2": lambda: tlp.partials(t["h"], t["pre_prev"], sliced, t["w"], 1e-6,
                                                        config=tlp.CONFIGS["wg1x2-producer"]),
        "mhc_pre": lambda: tm.mhc_pre(t["h"], t["pre_prev"], t["parts"], t["scale"], t["base"], t["w"], 20, 1e-6,
                                      1e-6, 1e-6, batch_invariant=False),
        "mhc_post": lambda: tm.mhc_post(t["y"], t["h"], t["post"], t["comb"], batch_invariant=False),
        "kv": lambda: rk.kv_rope_quant(kv_in, kw, 1e-6, cos, sin, 32, cache, slots, batch_invariant=False),
        "kv_tile": lambda: rk.kv_rope_quant(kv_in, kw, 1e-6, cos, sin, 32, cache, slots, batch_invariant=False,
                                            config=rk.KV_TILE_DEFAULT),
        "wo_a": lambda: tw.wo_a(o, wa, cs[..., 0], cs[..., 1], 64, batch_invariant=False),
        # cuBLAS on the same product (no RoPE), o laid out group-major first (outside the profiled launch)
        "wo_a_bmm": functools.partial(torch.bmm, o.view(m, 2, -1).transpose(0, 1).contiguous(),
                                      wa.view(2, 1024, -1).transpose(1, 2)),
    }


def _tilelang_pre(m: int, cfg: dict):
    from benchmarks.quick_check import mhc_inputs
    from dsv41_passes.lowering.mhc_weights import slice_major
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    t = mhc_inputs(m)
    sliced = slice_major(t["parts"], 5120, 24)
    fin = (t["scale"], t["base"], 20, 1e-6, 1e-6) if cfg.get("fused_finish") else None  # (the kernel's own stats)
    return lambda: tlp.partials(t["h"], t["pre_prev"], sliced, t["w"], 1e-6, config=cfg, finish=fin)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=65536)
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--mhc-config", action="append", default=[], metavar="NAME=JSON",
                    help="also profile the TileLang mhc_pre with the default config updated by these build options")
    args = ap.parse_args()
    import dsv41_passes  # noqa: F401

    warm = launches(256)
    big = launches(args.m)
    if args.mhc_config:
        from benchmarks.probe_mhc_pre_tilelang import define_variants
        from dsv41_passes.lowering.tilelang import mhc_pre as tlp

        define_variants(args.mhc_config)
        for name in (spec.partition("=")[0] for spec in args.mhc_config):
            for table, m in ((warm, 256), (big, args.m)):
                table[name] = _tilelang_pre(m, tlp.CONFIGS[name])
    names = args.only or list(big)
    for n in names:
        warm[n]()
        big[n]()  # first launch at this M (allocations), outside the range
    torch.cuda.synchronize()
    for n in names:
        torch.cuda.nvtx.range_push("profile")
        big[n]()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"launched {n}", flush=True)


if __name__ == "__main__":
    main()
