"""A few minutes on the GPU: the kernel variants that were built and checked on CPU only, side by side
with the defaults (V4.1-Flash shapes), correctness first, then time. Prints one table.

    source .devsite/setup.sh && python3 benchmarks/quick_check.py [--m 65536 4096] [--only kv post wo_a mhc]

Times are CUDA-graph replays (``benchmarks.common.time_ms``); % = memory roofline (measured copy
bandwidth) / time. The benchmarks proper (bench_*.py) write JSON.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import measure_copy_bandwidth, time_ms  # noqa: E402

ROWS: list[tuple[str, ...]] = []
BANDWIDTH = 0.0


def row(family: str, variant: str, check: str, t: float | None, note: str = "") -> None:
    ROWS.append((family, variant, check, "-" if t is None else f"{t:.4f}", note))
    print(f"{family:8} {variant:44} {check:28} {ROWS[-1][3]:>8} {note}", flush=True)


def kv(m: int) -> None:
    from dsv41_passes.lowering.triton import rope_store as rk

    d, rd, block = 512, 64, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    kv_in = (torch.randn(m, d, device="cuda", generator=g) * 4).bfloat16()
    w = torch.rand(d, device="cuda", generator=g) + 0.5
    ang = torch.rand(m, rd // 2, device="cuda", generator=g) * 6.3
    cs = torch.view_as_real(torch.polar(torch.ones_like(ang), ang))  # interleaved, as the model's table
    cos, sin = cs[..., 0], cs[..., 1]
    slots = torch.randperm(2 * m, device="cuda")[:m]
    cache = torch.zeros(2 * m, d, dtype=torch.bfloat16, device="cuda")
    base = rk.kv_rope_quant(kv_in, w, 1e-6, cos, sin, block, cache, slots, batch_invariant=True)
    roof = (3 * m * d * 2 + m * rd * 4 + m * 8) / BANDWIDTH * 1e3
    row("kv", f"roofline M={m}", "", roof)
    for cfg in [rk.KV_DEFAULT, *(c for c in rk.CANDIDATES["kv_rope_quant_store"]
                                 if c["num_warps"] >= 2 and c["BLOCK_T"] in (4, 8))]:
        run = lambda cfg=cfg: rk.kv_rope_quant(kv_in, w, 1e-6, cos, sin, block, cache, slots,  # noqa: E731
                                               batch_invariant=False, config=cfg)
        same = torch.equal(run().view(torch.int16), base.view(torch.int16))
        t = time_ms(run)
        row("kv", f"M={m} " + ",".join(f"{k}={v}" for k, v in cfg.items()), f"same bits {same}", t,
            f"{100 * roof / t:.0f}%")


def post(m: int) -> None:
    from dsv41_passes.lowering.triton import mhc as tk

    d = 5120
    g = torch.Generator(device="cuda").manual_seed(0)
    res = torch.randn(m, 4, d, device="cuda", generator=g).bfloat16()
    y = torch.randn(m, d, device="cuda", generator=g).bfloat16()
    post_w = torch.rand(m, 4, device="cuda", generator=g) * 2
    comb = torch.rand(m, 4, 4, device="cuda", generator=g)
    base = tk.mhc_post(y, res, post_w, comb, batch_invariant=True)
    roof = m * d * 2 * (4 + 1 + 4) / BANDWIDTH * 1e3
    row("post", f"roofline M={m}", "", roof)
    for cfg in [tk.DEFAULTS["mhc_post"], *(c for c in tk.CANDIDATES["mhc_post"] if c["BLOCK_D"] == 1024)]:
        run = lambda cfg=cfg: tk.mhc_post(y, res, post_w, comb, batch_invariant=False, config=cfg)  # noqa: E731
        same = torch.equal(run(), base)
        t = time_ms(run)
        row("post", f"M={m} " + ",".join(f"{k}={v}" for k, v in cfg.items()), f"same bits {same}", t,
            f"{100 * roof / t:.0f}%")


def mhc(m: int) -> None:
    from dsv41_passes.lowering.mhc_weights import build_parts
    from dsv41_passes.lowering.triton import mhc as tk

    d = 5120
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(m, 4, d, device="cuda", generator=g).bfloat16()
    y = torch.randn(m, d, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 4 * d, device="cuda", generator=g) / (4 * d) ** 0.5
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda") * 0.5
    pre_prev, w = torch.rand(m, 4, device="cuda") + 0.1, torch.rand(d, device="cuda") + 0.5
    post_w, comb = torch.rand(m, 4, device="cuda") * 2, torch.rand(m, 4, 4, device="cuda")
    parts = build_parts(fn)
    roof = m * d * 2 * (4 + 1) / BANDWIDTH * 1e3
    row("mhc_pre", f"roofline M={m}", "", roof)
    d0 = tk.DEFAULTS["mhc_pre"]
    configs = {"default (finish=last)": d0, "finish=kernel": dict(d0, finish="kernel"),
               "BM 128, 8 warps, finish=kernel": dict(BLOCK_M=128, num_warps=8, num_stages=3, finish="kernel"),
               "BM 128, 4 warps, finish=kernel": dict(BLOCK_M=128, num_warps=4, num_stages=2, finish="kernel")}
    base_out = None
    for name, cfg in configs.items():
        def run(cfg=cfg):
            return tk.mhc_pre(h, pre_prev, parts, scale, base, w, 20, 1e-6, 1e-6, 1e-6, batch_invariant=False,
                              config=cfg)

        out = run()
        base_out = out if base_out is None else base_out
        same = all(torch.equal(a, b) for a, b in zip(out, base_out))
        t = time_ms(run)
        row("mhc_pre", f"M={m} {name}", f"same bits {same}", t, f"{100 * roof / t:.0f}%")
    t = time_ms(lambda: tk.mhc_stats(h, parts, scale, base, 20, 1e-6, 1e-6, batch_invariant=False))
    row("mhc_pre", f"M={m} stats alone (default)", "", t)
    broof = m * d * 2 * (4 + 1 + 4 + 1) / BANDWIDTH * 1e3
    row("boundary", f"roofline M={m}", "", broof)
    d0 = tk.DEFAULTS["mhc_boundary"]
    base_out = None
    for name, cfg in {"default (finish=last)": d0, "finish=kernel": dict(d0, finish="kernel")}.items():
        def fused(cfg=cfg):
            return tk.mhc_boundary(y, h, post_w, comb, pre_prev, parts, scale, base, w, 20, 1e-6, 1e-6, 1e-6,
                                   batch_invariant=False, config=cfg)

        out = fused()
        base_out = out if base_out is None else base_out
        same = all(torch.equal(a, b) for a, b in zip(out, base_out))
        t = time_ms(fused)
        row("boundary", f"M={m} mhc_boundary {name}", f"same bits {same}", t, f"{100 * broof / t:.0f}%")

    def post_then_pre():
        new = tk.mhc_post(y, h, post_w, comb, batch_invariant=False)
        return tk.mhc_pre(new, pre_prev, parts, scale, base, w, 20, 1e-6, 1e-6, 1e-6, batch_invariant=False,
                          config=dict(tk.DEFAULTS["mhc_pre"], finish="kernel"))

    t = time_ms(post_then_pre)
    row("boundary", f"M={m} post + mhc_pre finish=kernel", "", t, f"{100 * broof / t:.0f}%")


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
    flops = 2 * m * g_ * r * (h // g_) * d
    big = dict(BM=128, BN=256, BK=64, stages=4, threads=256, one_loop=True)
    variants = [("default", tw.default_config(m), rd)]
    variants += [(",".join(f"{k}={v}" for k, v in c.items() if k not in ("BK", "one_loop", "threads")), c, rd)
                 for c in tw.CANDIDATES[tw.TACTIC_OP]
                 if c.get("one_loop") and (c["BM"] == 128 and c["BN"] == 256) == (m > 1024)]
    if m > 1024:
        variants += [("no rope (GEMM alone) 128x256 4st", big, 0),
                     ("no rope (GEMM alone) 128x256 3st", dict(big, stages=3), 0)]
    for name, cfg, rdim in variants:
        c_, s_ = (cos, sin) if rdim else (None, None)

        def run(cfg=cfg, c_=c_, s_=s_, rdim=rdim):
            return tw.wo_a(o, w, c_, s_, rdim, batch_invariant=False, config=cfg)

        try:
            out = run().float()
        except Exception as e:  # a config the device cannot take (shared memory)
            row("wo_a", f"M={m} {name}", f"{type(e).__name__}: {str(e)[:60]}", None)
            continue
        err = ((out - ref).norm() / ref.norm()).item() if rdim else float("nan")
        t = time_ms(run) if not err > 4e-3 else None
        row("wo_a", f"M={m} {name}", f"vs reference {err:.1e}", t, f"{flops / t / 1e9:.0f} TFLOP/s" if t else "")
    og = o.view(m, g_, -1).transpose(0, 1).contiguous()
    wt = w.view(g_, r, -1).transpose(1, 2)
    t = time_ms(lambda: torch.bmm(og, wt))
    row("wo_a", f"M={m} cuBLAS bmm, pre-transposed", "", t, f"{flops / t / 1e9:.0f} TFLOP/s")


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
