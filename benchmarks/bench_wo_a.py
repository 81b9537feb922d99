"""WO-A on the H200: inverse RoPE + grouped low-rank projection, written token-major.

    python benchmarks/bench_wo_a.py [--tp 4 1] [--m 65536 16384 4096 128 1] [--providers tilelang triton]

Shapes (DeepSeek-V4.1-Flash): H = 64/tp heads of D = 512 (rope 64), G = 8/tp groups, R = 1024,
K = 4096. Implementations, all with the inverse RoPE unless noted:

* ``eager``      the model's spelling: in-place inverse RoPE on o, ``einsum("mgd,grd->mgr")``, flatten;
* ``inductor``   ``torch.compile`` (default options, static shape) of the same function;
* ``cublas_bmm`` ``torch.bmm`` on an o already de-rotated and transposed group-major, output left
  group-major (no RoPE, no copies counted: the GEMM alone);
* ``ours_<p>``   ``dsv41::wo_a`` with provider p;
* rooflines: tensor cores at a measured bf16 GEMM rate, HBM at a measured copy bandwidth.

Each implementation is first checked against the reference at the benchmark shapes (PASS/FAIL);
timings are CUDA-graph replays, every implementation of a shape timed in turn for ``--rounds`` rounds and the median
kept (``benchmarks.common.time_interleaved``: this H200's speed drifts by 5-10% over a run, which timing them one
after another put on some of them only), or one after another where a graph cannot be captured. Results go to
``benchmarks/results/wo_a-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsv41_passes  # noqa: E402,F401  (registers torch.ops.dsv41.*)
from benchmarks.common import (  # noqa: E402
    measure_bf16_gemm_flops,
    measure_copy_bandwidth,
    table,
    time_interleaved,
    time_ms,
    write_result,
)
from dsv41_passes.config import PassConfig  # noqa: E402
from dsv41_passes.lowering.registry import choose, encode_mode  # noqa: E402
from dsv41_passes.reference.rope import apply_rotary_complex, rope_table  # noqa: E402

BF16 = torch.bfloat16
HEADS, HEAD_DIM, ROPE, GROUPS, RANK = 64, 512, 64, 8, 1024
# issue 6 anchors, TP4 per rank, ms (M: eager, inductor, cublas_bmm, roofline at 790 TFLOP/s)
ANCHORS_TP4 = {
    65536: dict(eager=1.92, inductor=1.79, cublas_bmm=1.63, roofline=1.39),
    16384: dict(eager=0.465, inductor=0.440, cublas_bmm=0.402, roofline=0.348),
    4096: dict(eager=0.114, inductor=0.107, cublas_bmm=0.096, roofline=0.087),
    128: dict(eager=0.039, inductor=0.054, cublas_bmm=0.014),
    1: dict(eager=0.013, inductor=0.032, cublas_bmm=0.0127),
}


def model_tail(o: torch.Tensor, freqs: torch.Tensor, weight: torch.Tensor, g: int) -> torch.Tensor:
    """Attention.forward after the attention (o is de-rotated in place, as the model does)."""
    m = o.shape[0]
    o[..., -ROPE:] = apply_rotary_complex(o[..., -ROPE:], freqs, inverse=True)
    og = o.view(m, g, -1)
    wa = weight.view(g, -1, og.shape[-1])
    return torch.einsum("mgd,grd->mgr", og, wa).flatten(1)


@functools.lru_cache(maxsize=1)
def _table() -> torch.Tensor:
    return rope_table(ROPE, 1 << 16, 10000.0, None).cuda()


def inputs(m: int, tp: int, seed: int = 0):
    h, g = HEADS // tp, GROUPS // tp
    k = h // g * HEAD_DIM
    gen = torch.Generator(device="cuda").manual_seed(seed)
    o = torch.randn(m, h, HEAD_DIM, device="cuda", dtype=BF16, generator=gen)
    w = (torch.randn(g * RANK, k, device="cuda", generator=gen) / k**0.5).to(BF16)
    pos = torch.randint(0, 1 << 16, (m,), device="cuda", generator=gen)
    freqs = _table()[pos]
    table_ = torch.view_as_real(freqs)
    return o, w, freqs, table_[..., 0], table_[..., 1]


def check(name: str, out: torch.Tensor, ref: torch.Tensor, quiet: bool = False) -> bool:
    """bf16 GEMM tolerance: one rounding of a differently ordered fp32 sum."""
    out, ref = out.float(), ref.float()
    err = (out - ref).abs()
    bound = 2**-7 * ref.abs() + 1e-3 * ref.abs().mean()
    rel = ((out - ref).norm() / ref.norm()).item()
    ok = bool((err <= bound).all()) and rel <= 4e-3
    if not quiet or not ok:
        print(f"  {'PASS' if ok else 'FAIL'} {name}: max |diff| {err.max().item():.3e}, normwise rel {rel:.2e}")
    return ok


PASS_PRIORITY = ",".join(PassConfig().providers)  # the provider list the passes bake into the graph


def kernel_module(provider: str):
    if provider == "triton":
        from dsv41_passes.lowering.triton import wo_a as mod
    else:
        from dsv41_passes.lowering.tilelang import wo_a as mod
    return mod


def tune(provider: str, m: int, o, w, cos, sin, ref) -> tuple[dict | None, float | None]:
    """Time every candidate config of a provider at this shape; record the fastest correct one as its tactic."""
    from dsv41_passes import tuning

    mod = kernel_module(provider)
    op, key = mod.tactic_key(o, w, ROPE)
    best: tuple[dict | None, float | None] = (None, None)
    for cfg in mod.CANDIDATES[op]:
        def run(cfg=cfg):
            return mod.wo_a(o, w, cos, sin, ROPE, batch_invariant=False, config=cfg)

        try:
            if not check(f"{provider} {cfg}", run(), ref, quiet=True):
                continue
            ms = time_ms(run)
        except Exception as e:  # a config this shape or device cannot take
            print(f"    {provider} {cfg}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if best[1] is None or ms < best[1]:
            best = (cfg, ms)
    if best[0] is not None:
        tuning.record(op, tuning.bucket(m), key, best[0])
        print(f"  tuned {provider}: {best[0]} {best[1]:.4f} ms")
    return best


def timed(fn) -> tuple[float | None, str]:
    try:
        return time_ms(fn), "graph"
    except Exception as e:  # a launch path that cannot be captured: time it plainly
        print(f"    (CUDA-graph capture failed: {type(e).__name__}: {e}; timing without a graph)")
        torch.cuda.synchronize()
        try:
            return time_ms(fn, graph=False), "events"
        except Exception:
            traceback.print_exc()
            return None, "failed"


def bench_shape(tp: int, m: int, providers: list[str], tflops: float, bandwidth: float, tune_configs: bool,
                rounds: int = 6) -> dict:
    h, g = HEADS // tp, GROUPS // tp
    k, n = h // g * HEAD_DIM, g * RANK
    print(f"TP{tp} M={m}: o [{m}, {h}, {HEAD_DIM}], weight [{n}, {k}]")
    o, w, freqs, cos, sin = inputs(m, tp)
    row: dict = dict(tp=tp, M=m)
    mode = encode_mode(False)

    # correctness at the benchmark shape (the reference provider is the model's math)
    ref = torch.ops.dsv41.wo_a(o, w, cos, sin, ROPE, "reference", mode)
    ok = {"eager": check("eager", model_tail(o.clone(), freqs, w, g), ref)}
    torch._dynamo.reset()  # a fresh static-shape compile per shape (no recompile limit, no dynamic fallback)
    compiled = torch.compile(model_tail, dynamic=False)
    ok["inductor"] = check("inductor", compiled(o.clone(), freqs, w, g), ref)
    runnable = []
    for p in providers:
        prov, why = choose("wo_a", p, False, o, w, cos, sin, ROPE)
        if prov is None:
            print(f"  SKIP ours_{p}: {'; '.join(why)}")
            continue
        try:
            out = torch.ops.dsv41.wo_a(o, w, cos, sin, ROPE, p, mode)
            ok[f"ours_{p}"] = check(f"ours_{p}", out, ref)
            if ok[f"ours_{p}"]:  # a wrong kernel has no time (nor a best)
                runnable.append(p)
        except Exception as e:
            print(f"  FAIL ours_{p}: {type(e).__name__}: {e}")
            ok[f"ours_{p}"] = False
    row["correct"] = ok
    del ref

    # timings
    o_work = o.clone()
    o_gm = o.reshape(m, g, k).transpose(0, 1).contiguous()  # group-major, prepared outside the timing
    w_t = w.view(g, RANK, k).transpose(1, 2)
    z_gm = torch.empty(g, m, RANK, device="cuda", dtype=BF16)
    fns = {"eager": lambda: model_tail(o_work, freqs, w, g), "inductor": lambda: compiled(o_work, freqs, w, g),
           "cublas_bmm": lambda: torch.bmm(o_gm, w_t, out=z_gm)}
    for p in runnable:
        fns[f"ours_{p}"] = lambda p=p: torch.ops.dsv41.wo_a(o, w, cos, sin, ROPE, p, mode)
    # what the pass runs: the first provider of its priority list that takes these inputs
    row["provider"] = choose("wo_a", PASS_PRIORITY, False, o, w, cos, sin, ROPE)[0].name
    fns["ours"] = lambda: torch.ops.dsv41.wo_a(o, w, cos, sin, ROPE, PASS_PRIORITY, mode)
    if "tilelang" in runnable:  # the one-loop kernel's largest tile, beside the default, every run
        from dsv41_passes.lowering.tilelang import wo_a as tw

        cfg = dict(BM=128, BN=256, BK=64, stages=4, threads=256, one_loop=True) if m > 1024 else \
            dict(BM=64, BN=128, BK=64, stages=4, threads=128, one_loop=True)
        out = tw.wo_a(o, w, cos, sin, ROPE, batch_invariant=False, config=cfg)
        ok["ours_tilelang_one_loop"] = check("ours_tilelang_one_loop", out, torch.ops.dsv41.wo_a(
            o, w, cos, sin, ROPE, "reference", mode))
        row["config_tilelang_one_loop"], row["ours_tilelang_one_loop"] = cfg, None
        if ok["ours_tilelang_one_loop"]:  # a wrong kernel has no time
            fns["ours_tilelang_one_loop"] = lambda: tw.wo_a(o, w, cos, sin, ROPE, batch_invariant=False, config=cfg)
    try:
        for name, (med, _) in time_interleaved(fns, rounds=rounds).items():
            row[name] = med
        how = "graph, interleaved"
    except Exception as e:  # a launch path that cannot be captured: each timed on its own
        print(f"    (interleaved CUDA-graph timing failed: {type(e).__name__}: {e}; timing one after another)")
        torch.cuda.synchronize()
        for name, fn in fns.items():
            row[name], how = timed(fn)
    for p in runnable:
        row[f"timing_{p}"] = how
    fns.clear()  # the closures go, then the buffers they held
    o_gm = z_gm = None
    if tune_configs:
        ref = torch.ops.dsv41.wo_a(o, w, cos, sin, ROPE, "reference", mode)
        for p in runnable:
            row[f"config_{p}"], row[f"tuned_{p}"] = tune(p, m, o, w, cos, sin, ref)
        del ref

    flops = 2 * m * n * k
    bytes_moved = 2 * (m * g * k + n * k + m * n) + 4 * m * ROPE
    row["roofline_tc"] = flops / tflops * 1e3
    row["roofline_hbm"] = bytes_moved / bandwidth * 1e3
    row["roofline"] = max(row["roofline_tc"], row["roofline_hbm"])
    cols = [c for p in runnable for c in (f"ours_{p}", f"tuned_{p}")] + ["ours_tilelang_one_loop"]
    row["ours_best"] = min((row[c] for c in cols if row.get(c)), default=None)
    if row["ours"]:
        row["x_eager"] = row["eager"] / row["ours"] if row["eager"] else None
        row["x_cublas"] = row["cublas_bmm"] / row["ours"] if row["cublas_bmm"] else None
    if tp == 4 and m in ANCHORS_TP4:
        row["anchor"] = ANCHORS_TP4[m]
    o = o_work = w = None
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[4, 1])
    ap.add_argument("--m", type=int, nargs="+", default=[65536, 16384, 4096, 128, 1])
    ap.add_argument("--providers", nargs="+", default=["tilelang", "triton"])
    ap.add_argument("--tune", action="store_true", help="also time every candidate config; save the best as tactics")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of the interleaved timing")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_wo_a needs a CUDA device")

    tflops = measure_bf16_gemm_flops()
    bandwidth = measure_copy_bandwidth()
    print(f"measured: bf16 GEMM {tflops / 1e12:.0f} TFLOP/s, copy {bandwidth / 1e12:.2f} TB/s")
    rows = [bench_shape(tp, m, args.providers, tflops, bandwidth, args.tune, args.rounds) for tp in args.tp
            for m in args.m]

    ours = [f"ours_{p}" for p in args.providers] + ([f"tuned_{p}" for p in args.providers] if args.tune else [])
    if "tilelang" in args.providers:
        ours.append("ours_tilelang_one_loop")
    cols = ["tp", "M", "eager", "inductor", "cublas_bmm", "ours", "provider", *ours, "roofline", "x_eager",
            "x_cublas"]
    if args.tune:
        from benchmarks.common import RESULTS
        from dsv41_passes import tuning

        tactics = RESULTS / f"tactics-wo_a-{torch.cuda.get_device_name().replace(' ', '_')}.json"
        print(f"tuned tactics: {tuning.save_tactics(tactics)} entries in {tactics}")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], tactics.name).write_text(tactics.read_text())
    path = write_result("wo_a", dict(gemm_flops=tflops, copy_bytes_per_s=bandwidth, rows=rows,
                                     anchors_tp4_ms=ANCHORS_TP4))
    print()
    print(f"ms per call (CUDA-graph replay); ours = the op as the pass calls it ({PASS_PRIORITY}: first provider"
          " that takes the inputs, default config); ours_* = one provider's default, tuned_* = fastest candidate;"
          " x_eager / x_cublas = speedup of ours")
    print(table(rows, cols))
    bad = [f"TP{r['tp']} M={r['M']} {k}" for r in rows for k, v in r["correct"].items() if not v]
    print(f"results: {path}")
    if bad:
        print("FAIL: " + ", ".join(bad))


if __name__ == "__main__":
    main()
