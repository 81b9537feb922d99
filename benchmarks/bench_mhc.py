"""mHC kernels on an H200 at V4.1-Flash shapes (hidden 5120, hc 4, K 20480, N 24).

Three units, each checked against the reference (PASS/FAIL) before it is timed:

  pre       stats (projection + Sinkhorn) + collapse with the previous pre + RMSNorm
  post      the residual update
  boundary  post, then the next sub-block's pre on the new residual

Variants: eager (the reference functions), Inductor default (torch.compile of the
reference functions, dynamic M), TileKernels where it has the unit (cuBLAS fp32
projection + ``mhc_pre_big_fuse_fwd``, whose collapse uses its own pre and has no
norm; ``mhc_post_fwd``), ours per provider (Triton, TileLang), and the HBM roofline
from a copy bandwidth measured in the same run. CUDA-graph replay timings.

    python benchmarks/bench_mhc.py                      # table + benchmarks/results/mhc-<device>-<date>.json
    python benchmarks/bench_mhc.py --ms 4096 1          # a subset of token counts
    python benchmarks/bench_mhc.py --tune --tactics t.json   # time CANDIDATES per M bucket, save the winners
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import measure_copy_bandwidth, table, time_ms, write_result  # noqa: E402
from dsv41_passes import tuning  # noqa: E402
from dsv41_passes.lowering.mhc_weights import build_parts  # noqa: E402
from dsv41_passes.reference import DeepseekV41Config  # noqa: E402
from dsv41_passes.reference import mhc as ref  # noqa: E402
from dsv41_passes.reference.model import rms_norm  # noqa: E402

CFG = DeepseekV41Config.flash()
D, HC = CFG.hidden_size, CFG.hc_mult
ITERS, HC_EPS, NORM_EPS, EPS = CFG.hc_sinkhorn_iters, CFG.hc_eps, CFG.rms_norm_eps, CFG.rms_norm_eps
MS = [65536, 16384, 4096, 128, 1]
EAGER_MAX_BYTES = 6 << 30  # skip eager where the reference materialises a larger fp32 intermediate
BYTES_PER_TOKEN = {"pre": 10 * D, "post": 18 * D, "boundary": 20 * D}
ANCHORS = {  # ms at M = 65536 / 16384 / 4096 / 128 / 1 (issue 4)
    ("pre", "eager"): [24.75, 6.53, 1.93, 1.30, 2.05],
    ("pre", "inductor"): [11.29, 3.02, 0.85, 0.70, 1.02],
    ("pre", "tilekernels"): [10.73, 2.77, 0.72, 0.149, 0.145],
    ("post", "tilekernels"): [1.437, 0.364, 0.096, 0.035, 0.094],
}
GOALS = {("pre", 65536): 0.90, ("pre", 16384): 0.225, ("pre", 4096): 0.07, ("pre", 128): 0.015, ("pre", 1): 0.015,
         ("boundary", 65536): 1.75}


# ----------------------------------------------------------------------------- reference functions
def ref_pre(h, pre_prev, fn, scale, base, w):
    pre, post, comb = ref.hc_mixes(h, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    return rms_norm(ref.hc_collapse(h, pre_prev), w, EPS), pre, post, comb


def ref_post(y, res, post, comb):
    return ref.hc_post(y, res, post, comb)


def ref_boundary(y, res, post, comb, pre_prev, fn, scale, base, w):
    new = ref.hc_post(y, res, post, comb)
    return (new, *ref_pre(new, pre_prev, fn, scale, base, w))


def inputs(m: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(m)
    k = HC * D
    f32 = dict(device="cuda", dtype=torch.float32, generator=g)
    t = dict(
        h=torch.randn(m, HC, D, **f32).to(torch.bfloat16),
        y=torch.randn(m, D, **f32).to(torch.bfloat16),
        fn=torch.randn(24, k, **f32) / k**0.5,
        scale=torch.rand(3, **f32) + 0.5,
        base=torch.randn(24, **f32) * 0.5,
        pre_prev=torch.rand(m, HC, **f32) + 0.1,
        post=2 * torch.rand(m, HC, **f32),
        w=torch.rand(D, **f32) + 0.5,
    )
    t["comb"] = ref.sinkhorn(torch.randn(m, HC, HC, **f32), ITERS, HC_EPS)
    t["parts"] = build_parts(t["fn"])
    return t


# ----------------------------------------------------------------------------- variants
def tile_kernels():
    try:
        import tile_kernels.mhc as tkm  # noqa: F401

        return tkm, None
    except Exception as e:  # not in this environment
        return None, f"{type(e).__name__}: {e}"


def variants(unit: str, t: dict[str, torch.Tensor], compiled: dict[str, Callable]) -> dict[str, Callable[[], Any]]:
    from dsv41_passes.lowering.triton import mhc as tk

    h, y, pp, fn, sc, ba, w, parts = (t[k] for k in ("h", "y", "pre_prev", "fn", "scale", "base", "w", "parts"))
    po, co = t["post"], t["comb"]
    m = h.shape[0]
    kw = dict(batch_invariant=False)
    out: dict[str, Callable[[], Any]] = {}
    eager_bytes = (HC if unit == "pre" else HC * HC) * m * D * 4  # largest fp32 tensor eager makes
    ref_fn = {"pre": ref_pre, "post": ref_post, "boundary": ref_boundary}[unit]
    args = {"pre": (h, pp, fn, sc, ba, w), "post": (y, h, po, co), "boundary": (y, h, po, co, pp, fn, sc, ba, w)}[unit]
    if eager_bytes <= EAGER_MAX_BYTES:
        out["eager"] = lambda: ref_fn(*args)
    out["inductor"] = lambda: compiled[unit](*args)
    tkm, _ = tile_kernels()
    if unit == "pre":
        out["triton (mhc_pre, one read)"] = lambda: tk.mhc_pre(h, pp, parts, sc, ba, w, ITERS, HC_EPS, NORM_EPS, EPS,
                                                               **kw)
        out["triton (stats + collapse)"] = lambda: (
            tk.mhc_collapse(h, pp, w, EPS, **kw), *tk.mhc_stats(h, parts, sc, ba, ITERS, HC_EPS, NORM_EPS, **kw))
        if tilelang_ok():
            from dsv41_passes.lowering.tilelang import mhc as tlk

            out["tilelang stats + triton collapse"] = lambda: (
                tk.mhc_collapse(h, pp, w, EPS, **kw), *tlk.mhc_stats(h, parts, sc, ba, ITERS, HC_EPS, NORM_EPS, **kw))
            from dsv41_passes.lowering.mhc_weights import slice_major
            from dsv41_passes.lowering.tilelang import mhc_pre as tlp

            sliced = slice_major(parts, D, 24)
            out[f"tilelang (persistent mhc_pre, the op's from M {tilelang_min_m()})"] = lambda: tlp.mhc_pre(
                h, pp, sliced, sc, ba, w, ITERS, HC_EPS, NORM_EPS, EPS)
        if tkm is not None:
            out["tilekernels (cuBLAS fp32 + big_fuse, no norm)"] = lambda: tilekernels_pre(tkm, h, fn, sc, ba)
    elif unit == "post":
        out["triton"] = lambda: tk.mhc_post(y, h, po, co, **kw)
        if tkm is not None:
            out["tilekernels"] = lambda: tilekernels_post(tkm, y, h, po, co)
    else:
        out["triton (mhc_boundary, untuned form)"] = lambda: tk.mhc_boundary(y, h, po, co, pp, parts, sc, ba, w, ITERS,
                                                                             HC_EPS, NORM_EPS, EPS, **kw)

        def post_then_pre():
            new = tk.mhc_post(y, h, po, co, **kw)
            return (new, *tk.mhc_pre(new, pp, parts, sc, ba, w, ITERS, HC_EPS, NORM_EPS, EPS, **kw))

        out["triton (post + mhc_pre)"] = post_then_pre
        if tilelang_ok():
            from dsv41_passes.lowering.mhc_weights import slice_major
            from dsv41_passes.lowering.tilelang import mhc_pre as tlp

            sliced = slice_major(parts, D, 24)

            def post_then_tilelang_pre():
                new = tk.mhc_post(y, h, po, co, **kw)
                return (new, *tlp.mhc_pre(new, pp, sliced, sc, ba, w, ITERS, HC_EPS, NORM_EPS, EPS))

            split_span, fused_span = boundary_spans()
            out[f"triton post + tilelang mhc_pre (the op's {split_span})"] = post_then_tilelang_pre

            def fused(opts):  # the post inside the persistent kernel (the op's where ``fused_boundary_at``)
                cfg = dict(tlp.BOUNDARY_CONFIG, **opts)
                return lambda: tlp.mhc_boundary(y, h, po, co, pp, sliced, sc, ba, w, ITERS, HC_EPS, NORM_EPS, EPS,
                                                config=cfg)

            out[f"tilelang (fused boundary, one persistent kernel; the op's {fused_span})"] = fused({})
            out["tilelang (fused boundary, new residual stored by TMA)"] = fused({"post_tma_store": True})
        if tkm is not None:
            def tk_boundary():
                new = tilekernels_post(tkm, y, h, po, co)
                return (new, *tilekernels_pre(tkm, new, fn, sc, ba))

            out["tilekernels (post + cuBLAS + big_fuse, no norm)"] = tk_boundary
    return out


def boundary_spans():
    """Where the op's TileLang boundary runs the Triton post + TileLang mhc_pre, and where the fused kernel (labels)."""
    from dsv41_passes.lowering import mhc as ops

    lo, hi = ops.TILELANG_PRE_MIN_M, ops.FUSED_BOUNDARY_MAX_M
    if ops.FUSED_BOUNDARY is None or (hi is not None and hi < lo):
        return f"from M {lo}", "with DSV41_MHC_BOUNDARY_FUSED=on"
    if hi is None:
        return "with DSV41_MHC_BOUNDARY_FUSED=off", f"from M {lo}"
    return f"above M {hi}", f"M {lo} to {hi}"


def tilelang_min_m():
    """The token count from which the ops run the TileLang ``mhc_pre`` (None: off)."""
    from dsv41_passes.lowering import mhc as ops

    return ops.TILELANG_PRE_MIN_M


def tilelang_ok() -> bool:
    from dsv41_passes.lowering.registry import tilelang_available

    return tilelang_available(torch.empty(0, device="cuda")) is None


def tilekernels_post(tkm, y, res, post, comb):
    """TileKernels' post takes [seqs, tokens, ...] tensors and post as [..., hc, 1]."""
    return tkm.mhc_post_fwd(y.unsqueeze(0), res.unsqueeze(0), post.unsqueeze(0).unsqueeze(-1), comb.unsqueeze(0))[0]


def tilekernels_pre(tkm, h, fn, scale, base):
    """cuBLAS fp32 projection + row sum of squares, then TileKernels' fused split/Sinkhorn/collapse (own pre)."""
    m = h.shape[0]
    xf = h.view(m, HC * D).float()
    mul = torch.nn.functional.linear(xf, fn).unsqueeze(0)
    sqr = xf.square().sum(-1).unsqueeze(0)
    post = torch.empty(m, HC, device=h.device)
    comb = torch.empty(m, HC * HC, device=h.device)
    x = torch.empty(m, D, device=h.device, dtype=h.dtype)
    tkm.mhc_pre_big_fuse_fwd(mul, sqr, scale, base, h, post, comb, x, NORM_EPS, HC_EPS, HC_EPS, 2.0, ITERS, n_splits=1)
    return x, post, comb.view(m, HC, HC)


# ----------------------------------------------------------------------------- correctness
def close_bf16(a: torch.Tensor, b: torch.Tensor, ulps: float = 2.0) -> bool:
    """Within ``ulps`` bf16 ulp elementwise, plus a floor of 1e-5 of the tensor's largest value: where the
    terms of an fp32 sum cancel, two correct fp32 orders differ by more than an ulp of the tiny result."""
    ulp = torch.exp2(torch.floor(torch.log2(b.float().abs().clamp_min(2.0**-126))) - 7)
    floor = 1e-5 * b.float().abs().amax()
    return bool(((a.float() - b.float()).abs() <= ulps * ulp + floor).all())


def check(unit: str, name: str, out, t) -> tuple[bool, str]:
    h, y, pp, fn, sc, ba, w = (t[k] for k in ("h", "y", "pre_prev", "fn", "scale", "base", "w"))
    f32 = lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)  # noqa: E731
    if unit == "post":
        return close_bf16(out, ref_post(y, h, t["post"], t["comb"])), ""
    if unit == "boundary":
        new_ref = ref_post(y, h, t["post"], t["comb"])
        if not close_bf16(out[0], new_ref):
            return False, "new residual"
        h, out = out[0], out[1:]  # the stats of the variant's own new residual
    if "tilekernels" in name:  # V4 form: collapse with its own pre, no norm; returns (x, post, comb)
        pre, post, comb = ref.hc_mixes(h, fn, sc, ba, ITERS, HC_EPS, NORM_EPS)
        ok = close_bf16(out[0], ref.hc_collapse(h, pre)) and f32(out[1], post) and f32(out[2], comb)
        return ok, ""
    x_ref, *stats_ref = ref_pre(h, pp, fn, sc, ba, w)
    ok_x = close_bf16(out[0], x_ref, ulps=3.0)  # a collapse rounding flip propagates through the norm
    ok_s = all(f32(a, b) for a, b in zip(out[1:], stats_ref))
    return ok_x and ok_s, "" if ok_x and ok_s else f"x {ok_x} stats {ok_s}"


# ----------------------------------------------------------------------------- main
UNITS = ("pre", "post", "boundary")
# Timing right after the reference check, with its freed temporaries still cached by the allocator,
# made the post ~8% slower for every kernel at M = 16384, TileKernels' included (run 20: 0.396 / 0.399
# ms kept vs 0.367 / 0.362 released); --keep-cache reproduces that condition. check_after: time each
# variant before its reference check.


def run(ms: list[int], units: tuple[str, ...] = UNITS, release_cache: bool = True,
        check_after: bool = False) -> dict[str, Any]:
    bw = measure_copy_bandwidth()
    print(f"copy bandwidth: {bw / 1e12:.3f} TB/s (read + write)")
    compiled = {u: torch.compile(f, dynamic=True) for u, f in
                (("pre", ref_pre), ("post", ref_post), ("boundary", ref_boundary))}
    tkm, why = tile_kernels()
    if tkm is None:
        print(f"TileKernels unavailable: {why}")
    rows: list[dict[str, Any]] = []
    for m in ms:
        t = inputs(m)
        for unit in units:
            roof = BYTES_PER_TOKEN[unit] * m / bw * 1e3
            rows.append(dict(unit=unit, M=m, variant="roofline (HBM)", check="-", ms=roof))
            for name, fn in variants(unit, t, compiled).items():
                row: dict[str, Any] = dict(unit=unit, M=m, variant=name)
                try:
                    if check_after:
                        row["ms"] = time_ms(fn)
                    ok, note = check(unit, name, fn(), t)
                    row["check"] = "PASS" if ok else f"FAIL {note}".strip()
                    if release_cache:  # the check's fp32 temporaries (GBs) go back to the driver first
                        torch.cuda.empty_cache()
                    if not check_after:
                        row["ms"] = time_ms(fn)
                    row["x_roofline"] = row["ms"] / roof if roof else None
                except Exception as e:  # report and continue with the other variants
                    row["check"] = f"ERROR {type(e).__name__}: {str(e)[:80]}"
                    traceback.print_exc()
                key = (unit, name.split(" ")[0])
                if key in ANCHORS and m in MS:
                    row["anchor_ms"] = ANCHORS[key][MS.index(m)]
                if name.startswith(("triton", "tilelang")) and (unit, m) in GOALS:
                    row["goal_ms"] = GOALS[(unit, m)]
                rows.append(row)
                print(table([row], ["unit", "M", "variant", "check", "ms", "x_roofline", "anchor_ms", "goal_ms"])
                      .splitlines()[-1], flush=True)
        t = None  # (the closures timed above are done with it)
        torch.cuda.empty_cache()
    return {"copy_bandwidth_Bps": bw, "rows": rows, "shapes": dict(hidden=D, hc=HC, K=HC * D, N=24)}


def tune(ms: list[int], ops: list[str], path: str) -> None:
    from dsv41_passes.lowering.triton import mhc as tk

    runners = {
        "mhc_post": lambda t, c: tk.mhc_post(t["y"], t["h"], t["post"], t["comb"], batch_invariant=False, config=c),
        "mhc_collapse": lambda t, c: tk.mhc_collapse(t["h"], t["pre_prev"], t["w"], EPS, batch_invariant=False,
                                                     config=c),
        "mhc_stats": lambda t, c: tk.mhc_stats(t["h"], t["parts"], t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS,
                                               batch_invariant=False, config=c),
        "mhc_pre": lambda t, c: tk.mhc_pre(t["h"], t["pre_prev"], t["parts"], t["scale"], t["base"], t["w"], ITERS,
                                           HC_EPS, NORM_EPS, EPS, batch_invariant=False, config=c),
        "mhc_boundary": lambda t, c: tk.mhc_boundary(t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], t["parts"],
                                                     t["scale"], t["base"], t["w"], ITERS, HC_EPS, NORM_EPS, EPS,
                                                     batch_invariant=False, config=c),
    }
    cands = dict(tk.CANDIDATES)
    if tilelang_ok():
        from dsv41_passes.lowering.tilelang import mhc as tlk

        runners["mhc_stats.tilelang"] = lambda t, c: tlk.mhc_stats(t["h"], t["parts"], t["scale"], t["base"], ITERS,
                                                                   HC_EPS, NORM_EPS, batch_invariant=False, config=c)
        cands["mhc_stats.tilelang"] = tlk.CANDIDATES["mhc_stats"]
    def close(out, want) -> bool:  # a candidate's outputs against the untuned call's (the sum order may differ)
        out, want = (out if isinstance(out, tuple) else (out,)), (want if isinstance(want, tuple) else (want,))
        tol = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
        return len(out) == len(want) and all(
            a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a.float(), b.float(), **tol[b.dtype])
            for a, b in zip(out, want))

    rows = []
    for m in ms:
        t = inputs(m)
        for op in ops:
            best = None
            want = runners[op](t, None)  # the config an untuned call at this M runs
            for cfg in cands[op]:
                try:
                    if not close(runners[op](t, cfg), want):
                        print(f"{op} M={m} {cfg}: wrong result, skipped")
                        continue
                    ms_ = time_ms(lambda: runners[op](t, cfg))
                except Exception as e:  # e.g. a config that does not fit in shared memory
                    print(f"{op} M={m} {cfg}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                if best is None or ms_ < best[0]:
                    best = (ms_, cfg)
            if best is not None:
                tuning.record(op, tuning.bucket(m), dict(d=D, n=HC), best[1])
                rows.append(dict(op=op, M=m, ms=best[0], config=str(best[1])))
                print(table(rows[-1:], ["op", "M", "ms", "config"]).splitlines()[-1], flush=True)
        t = None  # (the closures timed above are done with it)
        torch.cuda.empty_cache()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    n = tuning.save_tactics(path)
    print(f"saved {n} tactics to {path}")
    if os.environ.get("OUT"):  # device runs: hand the tactics file back too
        Path(os.environ["OUT"], Path(path).name).write_text(Path(path).read_text())
    write_result("mhc-tune", {"rows": rows, "tactics": path})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", type=int, nargs="*", default=MS)
    ap.add_argument("--tune", action="store_true",
                    help="time every CANDIDATES config per M bucket and save the winners")
    ap.add_argument("--tune-ops", nargs="*", default=["mhc_post", "mhc_collapse", "mhc_stats", "mhc_pre",
                                                       "mhc_boundary", "mhc_stats.tilelang"])
    ap.add_argument("--tactics", default=str(Path(__file__).resolve().parent / "results" / "mhc-tactics.json"))
    ap.add_argument("--load-tactics", default=None, help="time with the tuned configs saved by --tune")
    ap.add_argument("--keep-cache", action="store_true",
                    help="time without releasing the reference check's cached memory first (the run <= 17 harness)")
    ap.add_argument("--check-after", action="store_true", help="time each variant before its reference check")
    ap.add_argument("--units", nargs="+", default=list(UNITS), choices=UNITS,
                    help="what to time, in this order (a subset writes mhc-<units>-*.json)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mhc.py needs a CUDA device (H200)")
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference projection is fp32
    if a.tune:
        ops = [o for o in a.tune_ops if o != "mhc_stats.tilelang" or tilelang_ok()]
        tune(a.ms, ops, a.tactics)
        return
    if a.load_tactics:
        print(f"loaded {tuning.load_tactics(a.load_tactics)} tuned configs from {a.load_tactics}")
    units = tuple(a.units)
    payload = run(a.ms, units, release_cache=not a.keep_cache, check_after=a.check_after)
    payload["units"] = list(units)
    payload["release_cache_before_timing"] = not a.keep_cache
    payload["timed_before_check"] = a.check_after
    payload["tactics"] = a.load_tactics
    payload["chunk"] = int(os.environ.get("DSV41_MHC_CHUNK", "32"))
    cols = ["unit", "M", "variant", "check", "ms", "x_roofline", "anchor_ms", "goal_ms"]
    print()
    print(table(payload["rows"], cols))
    name = ("mhc" if units == UNITS else "mhc-" + "-".join(units)) + ("-keep-cache" if a.keep_cache else "") + (
        "-check-after" if a.check_after else "")
    print(f"\nwrote {write_result(name, payload)}")


if __name__ == "__main__":
    main()
