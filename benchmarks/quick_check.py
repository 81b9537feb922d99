"""A few minutes on the GPU: the kernel variants that were built and checked on CPU only, side by side
with the defaults (V4.1-Flash shapes), correctness first, then time. Prints one table.

    source .devsite/setup.sh && python3 benchmarks/quick_check.py [--m 65536 4096] [--only kv post wo_a mhc]

Times are CUDA-graph replays (``benchmarks.common.time_ms``); % = memory roofline (measured copy
bandwidth) / time. The benchmarks proper (bench_*.py) write JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import measure_copy_bandwidth, time_ms, wo_a_probe_inputs  # noqa: E402

ROWS: list[tuple[str, ...]] = []
BANDWIDTH = 0.0


def row(family: str, variant: str, check: str, t: float | None, note: str = "") -> None:
    ROWS.append((family, variant, check, "-" if t is None else f"{t:.4f}", note))
    print(f"{family:8} {variant:44} {check:28} {ROWS[-1][3]:>8} {note}", flush=True)


def _same_bits(a, b) -> bool:
    """Bitwise equality of two outputs (a tensor or a tuple of tensors)."""
    a, b = (x if isinstance(x, tuple) else (x,) for x in (a, b))
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)) for x, y in zip(a, b))


def time_configs(family: str, m: int, roof: float | None, configs: dict, run, base=None) -> None:
    """A row per config: ``run(cfg)`` compared bitwise with ``base`` (default: the first config's
    output), its time, and the % of ``roof``."""
    for name, cfg in configs.items():
        out = run(cfg)
        base = out if base is None else base
        t = time_ms(lambda cfg=cfg: run(cfg))
        row(family, f"M={m} {name}", f"same bits {_same_bits(out, base)}", t,
            f"{100 * roof / t:.0f}%" if roof else "")


def _names(configs) -> dict:
    return {",".join(f"{k}={v}" for k, v in c.items()): c for c in configs}


def mhc_inputs(m: int, d: int = 5120) -> dict:
    """Residual, branch output, projection weights (fp32 and BF16x3 parts) and mixes at hidden d."""
    from dsv41_passes.lowering.mhc_weights import build_parts

    g = torch.Generator(device="cuda").manual_seed(0)
    fn = torch.randn(24, 4 * d, device="cuda", generator=g) / (4 * d) ** 0.5
    return dict(
        h=torch.randn(m, 4, d, device="cuda", generator=g).bfloat16(),
        y=torch.randn(m, d, device="cuda", generator=g).bfloat16(),
        fn=fn, parts=build_parts(fn),
        scale=torch.rand(3, device="cuda", generator=g) + 0.5, base=torch.randn(24, device="cuda", generator=g) * 0.5,
        pre_prev=torch.rand(m, 4, device="cuda", generator=g) + 0.1, w=torch.rand(d, device="cuda", generator=g) + 0.5,
        post=torch.rand(m, 4, device="cuda", generator=g) * 2, comb=torch.rand(m, 4, 4, device="cuda", generator=g),
    )


def kv(m: int) -> None:
    from dsv41_passes.lowering.triton import kv_rope_quant as rk

    d, rd, block = 512, 64, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    kv_in = (torch.randn(m, d, device="cuda", generator=g) * 4).bfloat16()
    w = torch.rand(d, device="cuda", generator=g) + 0.5
    ang = torch.rand(m, rd // 2, device="cuda", generator=g) * 6.3
    cs = torch.view_as_real(torch.polar(torch.ones_like(ang), ang))  # interleaved, as the model's table
    cos, sin = cs[..., 0], cs[..., 1]
    slots = torch.randperm(2 * 65536 + 1, device="cuda")[:m]  # the benchmark's cache: 131073 rows
    cache = torch.zeros(2 * 65536 + 1, d, dtype=torch.bfloat16, device="cuda")
    base = rk.kv_rope_quant(kv_in, w, 1e-6, cos, sin, block, cache, slots, batch_invariant=True)
    roof = (3 * m * d * 2 + m * rd * 4 + m * 8) / BANDWIDTH * 1e3
    row("kv", f"roofline M={m}", "", roof)
    def run(cfg):
        return rk.kv_rope_quant(kv_in, w, 1e-6, cos, sin, block, cache, slots, batch_invariant=False, config=cfg)

    from dsv41_passes.lowering.rope_store import kv_rope_quant_reference

    ref = kv_rope_quant_reference(kv_in, w, 1e-6, cos, sin, block)
    src = torch.empty(m, 3 * d // 2 + rd + 2, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    row("kv", f"M={m} device copy of the same bytes", "", time_ms(lambda: dst.copy_(src)))
    # the blocks kernel's configs (the first is KV_DEFAULT without PDL), then the tile kernel's untuned ones:
    # bits compared with KV_DEFAULT's, and each output's element mismatches against the reference provider's
    tile = {"KV_TILE_DEFAULT": rk.KV_TILE_DEFAULT, "KV_SMALL_M": rk.KV_SMALL_M, "KV_LARGE_M": rk.KV_LARGE_M}
    blocks = {f"blocks BLOCK_T={t},num_warps={nw}": dict(BLOCK_T=t, num_warps=nw, blocks=True)
              for t, nw in ((2, 1), (1, 1), (4, 2), (4, 4), (8, 4), (8, 8), (16, 8))}
    # programmatic dependent launch: each call's grid launches while the previous call runs
    blocks["blocks BLOCK_T=2,num_warps=1 pdl"] = dict(BLOCK_T=2, num_warps=1, blocks=True, pdl=True)
    blocks["blocks BLOCK_T=4,num_warps=2 pdl"] = dict(BLOCK_T=4, num_warps=2, blocks=True, pdl=True)
    for name, cfg in {**blocks, **tile}.items():
        out = run(cfg)
        t = time_ms(lambda cfg=cfg: run(cfg))
        bad = int((out.view(torch.int16) != ref.view(torch.int16)).sum())
        row("kv", f"M={m} {name}", f"same bits {_same_bits(out, base)}, {bad} != ref", t,
            f"{1000 * t:.2f} us, {100 * roof / t:.1f}%")


def post(m: int) -> None:
    from dsv41_passes.lowering.triton import mhc as tk

    t, d = mhc_inputs(m), 5120
    base = tk.mhc_post(t["y"], t["h"], t["post"], t["comb"], batch_invariant=True)
    roof = m * d * 2 * (4 + 1 + 4) / BANDWIDTH * 1e3
    row("post", f"roofline M={m}", "", roof)
    configs = [tk.DEFAULTS["mhc_post"], *(c for c in tk.CANDIDATES["mhc_post"] if c["BLOCK_D"] == 1024)]
    time_configs("post", m, roof, _names(configs),
                 lambda cfg: tk.mhc_post(t["y"], t["h"], t["post"], t["comb"], batch_invariant=False, config=cfg),
                 base)


def mhc(m: int) -> None:
    from dsv41_passes.lowering.triton import mhc as tk

    t, d = mhc_inputs(m), 5120
    h, y, parts, scale, base, pre_prev, w = (t[k] for k in ("h", "y", "parts", "scale", "base", "pre_prev", "w"))
    roof = m * d * 2 * (4 + 1) / BANDWIDTH * 1e3
    row("mhc_pre", f"roofline M={m}", "", roof)
    d0 = tk.DEFAULTS["mhc_pre"]
    configs = {f"default (finish={d0.get('finish', 'last')})": d0, "finish=last": dict(d0, finish="last")}
    if m <= 1024:  # K slices in two pieces (not a default yet: see mhc_common.SPLITS)
        configs["split 2"] = dict(d0, split=2)
    time_configs("mhc_pre", m, roof, configs,
                 lambda cfg: tk.mhc_pre(h, pre_prev, parts, scale, base, w, 20, 1e-6, 1e-6, 1e-6,
                                        batch_invariant=False, config=cfg))
    ms = time_ms(lambda: tk.mhc_stats(h, parts, scale, base, 20, 1e-6, 1e-6, batch_invariant=False))
    row("mhc_pre", f"M={m} stats alone (default)", "", ms)
    tilelang_pre(m, t, roof)
    broof = m * d * 2 * (4 + 1 + 4 + 1) / BANDWIDTH * 1e3
    row("boundary", f"roofline M={m}", "", broof)
    d0 = tk.DEFAULTS["mhc_boundary"]
    time_configs("boundary", m, broof,
                 {f"mhc_boundary default (finish={d0.get('finish', 'last')})": d0,
                  "mhc_boundary finish=last": dict(d0, finish="last")},
                 lambda cfg: tk.mhc_boundary(y, h, t["post"], t["comb"], pre_prev, parts, scale, base, w, 20, 1e-6,
                                             1e-6, 1e-6, batch_invariant=False, config=cfg))

    def post_then_pre():
        new = tk.mhc_post(y, h, t["post"], t["comb"], batch_invariant=False)
        return tk.mhc_pre(new, pre_prev, parts, scale, base, w, 20, 1e-6, 1e-6, 1e-6, batch_invariant=False,
                          config=tk.DEFAULTS["mhc_pre"])

    ms = time_ms(post_then_pre)
    row("boundary", f"M={m} post + mhc_pre", "", ms, f"{100 * broof / ms:.0f}%")


def tilelang_pre(m: int, t: dict, roof: float) -> None:
    """The persistent TileLang mhc_pre, its default and the configs not yet run on a GPU (``UNMEASURED``, less those
    ``run_gpu.sh`` runs one process each: clusters and the fused finish): bits against the Triton kernel's, then the
    time of the whole op and of the persistent kernel alone (without the Triton finish kernel)."""
    from dsv41_passes.lowering import registry
    from dsv41_passes.lowering.mhc_weights import slice_major
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.lowering.triton import mhc as tk

    if registry.tilelang_available(t["h"]):
        row("mhc_pre", f"M={m} tilelang persistent", registry.tilelang_available(t["h"]), None)
        return
    h, parts, scale, base, pre_prev, w = (t[k] for k in ("h", "parts", "scale", "base", "pre_prev", "w"))
    sliced = slice_major(parts, 5120, 24)
    # the Triton kernel with its fixed default (split 1: the numerics the TileLang kernel shares)
    ref = tk.mhc_pre(h, pre_prev, parts, scale, base, w, 20, 1e-6, 1e-6, 1e-6, batch_invariant=False,
                     config=tk.default_config("mhc_pre"))
    configs = {"default": tlp.DEFAULT_CONFIG}
    configs.update((n, tlp.CONFIGS[n]) for n in tlp.UNMEASURED
                   if not (tlp.CONFIGS[n].get("hi_multicast") or tlp.CONFIGS[n].get("fused_finish")))
    for name, cfg in configs.items():
        def run(cfg=cfg):
            return tlp.mhc_pre(h, pre_prev, sliced, scale, base, w, 20, 1e-6, 1e-6, 1e-6, config=cfg)

        try:
            out = run()
        except Exception as e:  # one config's failure does not hide the others'
            row("mhc_pre", f"M={m} tilelang persistent {name}", f"FAILED {type(e).__name__}: {e}"[:60], None)
            continue
        same = [bool(torch.equal(a, b)) for a, b in zip(out, ref)]
        xdiff = (out[0].float() - ref[0].float()).abs().max().item()
        pdiff = max((a - b).abs().max().item() for a, b in zip(out[1:], ref[1:]))
        check = f"same bits x/pre/post/comb {''.join('1' if v else '0' for v in same)}"
        ms = time_ms(run)
        row("mhc_pre", f"M={m} tilelang persistent {name}", check, ms,
            f"{100 * roof / ms:.0f}% (max |dx| {xdiff:.1e}, |dstats| {pdiff:.1e})")
        ms = time_ms(lambda cfg=cfg: tlp.partials(h, pre_prev, sliced, w, 1e-6, config=cfg))
        row("mhc_pre", f"M={m} tilelang persistent {name}, kernel alone", "", ms, f"{100 * roof / ms:.0f}%")


def wo_a(m: int) -> None:
    from dsv41_passes.lowering.tilelang import wo_a as tw
    from dsv41_passes.lowering.triton import wo_a as tk

    o, w, cos, sin, (h, d, g_, r, rd) = wo_a_probe_inputs(m, tp=4)
    ref = torch.ops.dsv41.wo_a(o, w, cos, sin, rd, "reference", 0).float()
    flops = 2 * m * g_ * r * (h // g_) * d
    big = dict(BM=128, BN=256, BK=64, stages=4, threads=256, one_loop=True)
    # (name, provider module, config, rope dims)
    variants = [("tilelang default", tw, tw.untuned_config(m, g_ * r, h // g_), rd),
                ("triton default", tk, tk.default_config(m), rd)]
    if m > 1024:
        variants += [("tl " + ",".join(f"{k}={v}" for k, v in c.items() if k not in ("BK", "one_loop", "threads")),
                      tw, c, rd) for c in tw.CANDIDATES[tw.TACTIC_OP] if c.get("one_loop") and c["BM"] == 128]
        variants += [("tl no rope (GEMM alone) 128x256 4st", tw, big, 0),
                     ("tl no rope (GEMM alone) 128x256 3st epi_smem", tw, dict(big, stages=3, epi_smem=True), 0)]
    else:  # split-K (Triton for decode, TileLang) against the unsplit kernels
        tr = [dict(BM=16, BN=128, BK=64, num_warps=4, num_stages=4, SPLIT=8),
              dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4, SPLIT=8)] if m <= 16 else []
        tr += [dict(BM=32, BN=128, BK=64, num_warps=4, num_stages=4, SPLIT=s) for s in (2, 4, 8)] if m <= 128 else []
        variants += [("tr " + ",".join(f"{k}={v}" for k, v in c.items()), tk, c, rd) for c in tr]
        tl_cfgs = []
        # WO_A_BN: the tile widths of the TileLang variants (default 128,256)
        bns = [int(b) for b in os.environ.get("WO_A_BN", "128,256").split(",")]
        for bm, t, extra in ((64, 128, dict(rope_regs=True)), (128, 256, dict(cs_regs=True))):
            for bn in bns:
                for split in (1, 2, 4, 8):
                    tl_cfgs.append(dict(BM=bm, BN=bn, BK=64, stages=4 if bn == 128 or bm == 64 else 3, threads=t,
                                        one_loop=True, SPLIT=split, **extra))
        tl_cfgs += [dict(BM=128, BN=bn, BK=64, stages=3, threads=256, one_loop=True, epi_smem=True) for bn in bns]
        variants += [("tl " + ",".join(f"{k}={v}" for k, v in c.items() if k not in ("BK", "one_loop")), tw, c, rd)
                     for c in tl_cfgs]
    best = (float("inf"), "")
    for name, mod, cfg, rdim in variants:
        c_, s_ = (cos, sin) if rdim else (None, None)

        def run(mod=mod, cfg=cfg, c_=c_, s_=s_, rdim=rdim):
            return mod.wo_a(o, w, c_, s_, rdim, batch_invariant=False, config=cfg)

        try:
            out = run().float()
        except Exception as e:  # a config the device cannot take (shared memory)
            row("wo_a", f"M={m} {name}", f"{type(e).__name__}: {str(e)[:60]}", None)
            continue
        err = ((out - ref).norm() / ref.norm()).item() if rdim else float("nan")  # no RoPE: nothing to compare
        t = time_ms(run) if (err <= 4e-3 if rdim else True) else None  # a NaN output is not timed
        if t and rdim:
            best = min(best, (t, name))
        row("wo_a", f"M={m} {name}", f"vs reference {err:.1e}", t, f"{flops / t / 1e9:.0f} TFLOP/s" if t else "")
    og = o.view(m, g_, -1).transpose(0, 1).contiguous()
    wt = w.view(g_, r, -1).transpose(1, 2)
    t = time_ms(lambda: torch.bmm(og, wt))
    row("wo_a", f"M={m} cuBLAS bmm, pre-transposed", "", t, f"{flops / t / 1e9:.0f} TFLOP/s")
    row("wo_a", f"M={m} BEST {best[1]}", "", best[0], f"{t / best[0]:.2f}x cuBLAS")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[65536])
    ap.add_argument("--only", nargs="*", default=["kv", "post", "wo_a", "mhc"])
    args = ap.parse_args()
    import dsv41_passes  # noqa: F401  (registers the ops)

    global BANDWIDTH
    BANDWIDTH = measure_copy_bandwidth()
    print(torch.cuda.get_device_name(), torch.__version__, f"copy {BANDWIDTH / 1e12:.2f} TB/s", flush=True)
    for name in args.only:
        for m in args.m:
            try:
                globals()[name](m)
            except Exception:
                traceback.print_exc()
                row(name, f"M={m} FAILED", "", None)
            torch.cuda.empty_cache()
    print("\n| family | variant | check | ms | note |\n|---|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
