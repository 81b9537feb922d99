"""RoPE/store on the H200: Q RoPE into the head-padded Q buffer; KV norm + RoPE + FP8 + cache store.

    python benchmarks/bench_rope_store.py [--tp 4 1] [--m 65536 16384 4096 128 1] [--tune]

Shapes (DeepSeek-V4.1-Flash): H = 64/tp heads of D = 512 (rope 64) into a buffer padded to
64 heads; KV: D = 512, FP8 blocks of 32, a cache of 2 * 65536 + 1 rows written at random slots.
Implementations per path:

* ``eager``     the model's spelling (in-place RoPE on a view, slice store / norm, RoPE,
                ``fp8_block_qdq``, ``index_copy_``);
* ``inductor``  ``torch.compile`` (default options, static shape) of the same function;
* ``ours``      the fused op (Triton provider); for KV also ``ours_pass``: the same eager
                function compiled with the dsv41 pass (the rewrite end to end);
* ``roofline``  bytes that must move / measured copy bandwidth (Q: read + write the live
                heads + the tables; KV: read kv + write out + write cache rows + tables).

Correctness first, at the benchmark shapes (PASS/FAIL): Q against a float64 complex product
(<= 1 bf16 ulp) on sampled rows plus every padded head and row >= M left untouched; KV
against the CPU reference rule on sampled rows (bitwise, except where a differently ordered
RMS sum moves an element by one FP8 step). ``--tune`` also times every launch config of
``CANDIDATES`` and saves the fastest as tactics. Timings are CUDA-graph replays
(``benchmarks.common.time_ms``); JSON goes to ``benchmarks/results/rope_store-<device>-<date>.json``.
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

import dsv41_passes as dp  # noqa: E402
from benchmarks.common import measure_copy_bandwidth, table, time_ms, write_result  # noqa: E402
from dsv41_passes.lowering.rope_store import kv_rope_quant_reference  # noqa: E402
from dsv41_passes.lowering.triton import kv_rope_quant as tkv  # noqa: E402
from dsv41_passes.lowering.triton import rope_store as tk  # noqa: E402
from dsv41_passes.reference.model import rms_norm  # noqa: E402
from dsv41_passes.reference.quant import fp8_block_qdq, ue8m0_scale  # noqa: E402
from dsv41_passes.reference.rope import apply_rotary_complex, rope_table  # noqa: E402

BF16 = torch.bfloat16
HEADS, HPAD, D, RD, BLOCK, EPS = 64, 64, 512, 64, 32, 1e-6
SLOTS = 2 * 65536 + 1
POISON = -32767  # int16 pattern (a NaN) that no kernel writes
PROVIDERS = "triton,reference"
# issue 5 anchors, Q path, TP4 per rank, ms
ANCHORS_Q_TP4 = {
    65536: dict(eager=5.11, inductor=10.45, roofline=0.50),
    16384: dict(eager=1.30, inductor=2.65, roofline=0.126),
    4096: dict(eager=0.333, inductor=0.670, roofline=0.031),
    128: dict(eager=0.108, inductor=0.098),
    1: dict(eager=0.104, inductor=0.049),
}


def q_eager(x: torch.Tensor, freqs: torch.Tensor, buf: torch.Tensor, h: int) -> None:
    """Attention.forward's Q store (``x`` is the wq_b output; RoPE in place on its view)."""
    m = x.shape[0]
    q = x.view(m, h, D)
    q[..., -RD:] = apply_rotary_complex(q[..., -RD:], freqs)
    buf[:m, :h] = q


def kv_eager(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor):
    """Attention.forward's KV path (``x`` is the wkv output)."""
    kv = rms_norm(x, weight, EPS)
    kv[..., -RD:] = apply_rotary_complex(kv[..., -RD:], freqs)
    kv = fp8_block_qdq(kv, BLOCK)
    cache.index_copy_(0, slots, kv)
    return kv


class KVStore(torch.nn.Module):
    """``kv_eager`` with the norm weight and the cache as module state, as in the model (static shapes)."""

    def __init__(self, weight: torch.Tensor, cache: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.register_buffer("cache", cache)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return kv_eager(x, self.weight, freqs, self.cache, slots)


@functools.lru_cache(maxsize=1)
def _table() -> torch.Tensor:
    return rope_table(RD, 1 << 17, 10000.0, None).cuda()


def inputs(m: int, h: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    freqs = _table()[torch.randint(0, 1 << 17, (m,), device="cuda", generator=gen)]
    fr = torch.view_as_real(freqs)
    q = (torch.randn(m, h * D, device="cuda", generator=gen) * 2).to(BF16)
    kv = (torch.randn(m, D, device="cuda", generator=gen) * 3).to(BF16)
    weight = torch.rand(D, device="cuda", generator=gen) + 0.5
    slots = torch.randperm(SLOTS, device="cuda", generator=gen)[:m]
    return q, kv, weight, freqs, fr[..., 0], fr[..., 1], slots


def rows_to_check(m: int) -> torch.Tensor:
    return torch.unique(torch.cat([torch.arange(0, m, max(1, m // 4096)), torch.arange(max(0, m - 64), m)]))


def check_q(name: str, buf: torch.Tensor, q: torch.Tensor, freqs: torch.Tensor, m: int, h: int) -> bool:
    rows = rows_to_check(m).cuda()
    got, x = buf[rows, :h].float(), q.view(m, h, D)[rows]
    ok = torch.equal(got[..., : D - RD], x[..., : D - RD].float())
    xt = x[..., D - RD:].double().unflatten(-1, (-1, 2))
    f = freqs[rows].to(torch.complex128)[:, None]
    want = torch.view_as_real(torch.complex(xt[..., 0], xt[..., 1]) * f).flatten(-2)
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0**-126))) - 7)
    # where x0*c and x1*s cancel, the fp32 products' rounding (2^-24 each) bounds any fp32 kernel
    terms = (xt[..., 0].abs() * f.real.abs() + xt[..., 1].abs() * f.imag.abs()).unsqueeze(-1).expand(*xt.shape)
    worst = ((got[..., D - RD:].double() - want).abs() / (ulp + terms.flatten(-2) * 2.0**-23)).max().item()
    ok &= worst <= 1.0
    untouched = bool((buf[:, h:].view(torch.int16) == POISON).all() and (buf[m:].view(torch.int16) == POISON).all())
    ok &= untouched
    print(f"  {'PASS' if ok else 'FAIL'} q {name}: rope max {worst:.2f} x (1 ulp + fp32 product rounding) vs float64, "
          f"pad heads and rows >= M untouched: {untouched}")
    return ok


def check_kv(name: str, out: torch.Tensor, kv: torch.Tensor, weight, cos, sin, cache=None, slots=None,
             quiet: bool = False) -> bool:
    m = kv.shape[0]
    rows = rows_to_check(m)
    want = kv_rope_quant_reference(kv[rows.cuda()].cpu(), weight.cpu(), EPS, cos[rows.cuda()].cpu(),
                                   sin[rows.cuda()].cpu(), BLOCK)
    got = out[rows.cuda()].cpu()
    same = (got.view(torch.int16) == want.view(torch.int16)).float().mean().item()
    scale = ue8m0_scale(want.float().unflatten(-1, (-1, BLOCK)).abs().amax(-1, keepdim=True)).expand(-1, -1, BLOCK)
    step = torch.maximum(got.float().abs(), want.float().abs()) * 2.0**-3 + scale.flatten(-2) * 2.0**-9
    ok = same > 0.999 and bool(((got.float() - want.float()).abs() <= step).all())
    stored = "-"
    if cache is not None:
        stored = bool(torch.equal(cache[slots], out))
        ok &= stored
    if not quiet or not ok:
        print(f"  {'PASS' if ok else 'FAIL'} kv {name}: {100 * same:.3f}% bitwise vs the CPU rule, "
              f"cache rows = out: {stored}")
    return ok


def timed(fn) -> float | None:
    try:
        return time_ms(fn)
    except Exception as e:  # a launch path that cannot be captured: time it plainly
        print(f"    (CUDA-graph capture failed: {type(e).__name__}: {e}; timing without a graph)")
        torch.cuda.synchronize()
        try:
            return time_ms(fn, graph=False)
        except Exception:
            traceback.print_exc()
            return None


def tune(name: str, run, candidates: list[dict], reference, reset) -> tuple[dict | None, float | None]:
    """Time each candidate config; configs whose results differ from ``reference(out)`` after ``reset()`` (which
    poisons what the candidate must write, so one that skips a store fails) are rejected."""
    best: tuple[dict | None, float | None] = (None, None)
    for cfg in candidates:
        try:
            reset()
            if not reference(run(cfg)):
                print(f"    {name} {cfg}: wrong result, skipped")
                continue
            ms = time_ms(lambda cfg=cfg: run(cfg))
        except Exception as e:  # a config this shape cannot take
            print(f"    {name} {cfg}: {type(e).__name__}: {str(e)[:160]}")
            continue
        if best[1] is None or ms < best[1]:
            best = (cfg, ms)
    print(f"  tuned {name}: {best[0]} {best[1] if best[1] is None else round(best[1], 4)} ms")
    return best


def bench_q(tp: int, m: int, bandwidth: float, tune_configs: bool) -> dict:
    h = HEADS // tp
    q, _, _, freqs, cos, sin, _ = inputs(m, h)
    buf = torch.empty(m + 1, HPAD, D, dtype=BF16, device="cuda")
    row: dict = dict(path="q", tp=tp, M=m)
    ok = {}
    buf.view(torch.int16).fill_(POISON)
    q_eager(q.clone(), freqs, buf, h)
    ok["eager"] = check_q("eager", buf, q, freqs, m, h)
    torch._dynamo.reset()
    compiled = torch.compile(q_eager, dynamic=False)
    buf.view(torch.int16).fill_(POISON)
    compiled(q.clone(), freqs, buf, h)
    ok["inductor"] = check_q("inductor", buf, q, freqs, m, h)
    qv = q.view(m, h, D)
    buf.view(torch.int16).fill_(POISON)
    torch.ops.dsv41.q_rope_store(buf, qv, cos, sin, PROVIDERS, 0)
    ok["ours"] = check_q("ours", buf, q, freqs, m, h)
    row["correct"] = ok

    work = q.clone()
    row["eager"] = timed(lambda: q_eager(work, freqs, buf, h))
    row["inductor"] = timed(lambda: compiled(work, freqs, buf, h))
    row["ours"] = timed(lambda: torch.ops.dsv41.q_rope_store(buf, qv, cos, sin, PROVIDERS, 0))
    if tune_configs:
        base = buf[:m, :h].clone()

        def run(cfg):
            tk.q_rope_store(buf, qv, cos, sin, batch_invariant=False, config=cfg)
            return buf

        row["config_ours"], row["tuned"] = tune("q", run, tk.CANDIDATES["q_rope_store"],
                                               lambda b: torch.equal(b[:m, :h], base),
                                               lambda: buf.view(torch.int16).fill_(POISON))
        if row["config_ours"]:
            dp.tuning.record("q_rope_store", dp.tuning.bucket(m), tk.q_shape_key(qv, cos), row["config_ours"])
    row["roofline"] = (2 * m * h * D * 2 + m * RD * 4) / bandwidth * 1e3
    if tp == 4 and m in ANCHORS_Q_TP4:
        row["anchor"] = ANCHORS_Q_TP4[m]
    q = work = buf = None
    torch.cuda.empty_cache()
    return row


def copy_time(nbytes: int) -> float | None:
    """A device copy that reads and writes ``nbytes`` in all (what the roofline divides by its bandwidth),
    timed like the kernels: the time a plain copy of that size takes, launch and ramp included."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src))


def bench_kv(m: int, bandwidth: float, tune_configs: bool) -> dict:
    _, kv, weight, freqs, cos, sin, slots = inputs(m, 1)
    cache = torch.zeros(SLOTS, D, dtype=BF16, device="cuda")
    row: dict = dict(path="kv", tp="-", M=m)
    ok = {"eager": check_kv("eager", kv_eager(kv, weight, freqs, cache, slots), kv, weight, cos, sin, cache, slots)}
    torch._dynamo.reset()
    compiled = torch.compile(kv_eager, dynamic=False)
    cache.zero_()
    ok["inductor"] = check_kv("inductor", compiled(kv, weight, freqs, cache, slots), kv, weight, cos, sin, cache, slots)
    cache.zero_()
    out = torch.ops.dsv41.kv_rope_quant_store(cache, kv, weight, EPS, cos, sin, slots, BLOCK, PROVIDERS, 0)
    ok["ours"] = check_kv("ours", out, kv, weight, cos, sin, cache, slots)
    torch._dynamo.reset()
    cache.zero_()
    module = KVStore(weight, cache)
    passed = dp.compile(module, dp.PassConfig(mhc=False, wo_a=False, providers=("triton", "reference")))
    out_pass = passed(kv, freqs, slots)
    rewritten = dp.last_report().sites.get("kv_rope_store", 0) == 1
    if not rewritten:
        print("  FAIL ours_pass: the pass did not rewrite the KV site\n" + dp.last_report().to_markdown())
    ok["ours_pass"] = rewritten and check_kv("ours_pass", out_pass, kv, weight, cos, sin, cache, slots)
    row["correct"] = ok

    row["eager"] = timed(lambda: kv_eager(kv, weight, freqs, cache, slots))
    row["inductor"] = timed(lambda: compiled(kv, weight, freqs, cache, slots))
    row["ours"] = timed(lambda: torch.ops.dsv41.kv_rope_quant_store(cache, kv, weight, EPS, cos, sin, slots, BLOCK,
                                                                     PROVIDERS, 0))
    row["ours_pass"] = timed(lambda: passed(kv, freqs, slots)) if rewritten else None
    if tune_configs:
        def run(cfg):
            return tkv.kv_rope_quant(kv, weight, EPS, cos, sin, BLOCK, cache, slots, batch_invariant=False, config=cfg)

        row["config_ours"], row["tuned"] = tune("kv", run, tkv.CANDIDATES["kv_rope_quant_store"],
                                               lambda o: check_kv("candidate", o, kv, weight, cos, sin, cache, slots,
                                                                  quiet=True),
                                               cache.zero_)
        if row["config_ours"]:
            dp.tuning.record("kv_rope_quant_store", dp.tuning.bucket(m), tkv.kv_shape_key(kv, cos, BLOCK),
                             row["config_ours"])
    row["roofline"] = (3 * m * D * 2 + m * RD * 4 + m * 8) / bandwidth * 1e3
    row["copy_same_bytes"] = copy_time(3 * m * D * 2 + m * RD * 4 + m * 8)
    kv = cache = None
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[4, 1])
    ap.add_argument("--m", type=int, nargs="+", default=[65536, 16384, 4096, 128, 1])
    ap.add_argument("--tune", action="store_true", help="also time every candidate config; save the best as tactics")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_rope_store needs a CUDA device")
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    bandwidth = measure_copy_bandwidth()
    print(f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    rows = []
    for tp in args.tp:
        for m in args.m:
            print(f"Q TP{tp} M={m}: q [{m}, {HEADS // tp}, {D}] -> buffer [{m + 1}, {HPAD}, {D}]")
            rows.append(bench_q(tp, m, bandwidth, args.tune))
    for m in args.m:
        print(f"KV M={m}: kv [{m}, {D}] -> cache [{SLOTS}, {D}]")
        rows.append(bench_kv(m, bandwidth, args.tune))
    for r in rows:
        if r.get("ours"):
            r["x_eager"] = r["eager"] / r["ours"] if r.get("eager") else None
            r["x_inductor"] = r["inductor"] / r["ours"] if r.get("inductor") else None
            r["pct_roofline"] = 100 * r["roofline"] / r["ours"]

    if args.tune:
        from benchmarks.common import RESULTS

        tactics = RESULTS / f"tactics-rope_store-{torch.cuda.get_device_name().replace(' ', '_')}.json"
        print(f"tuned tactics: {dp.tuning.save_tactics(tactics)} entries in {tactics}")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], tactics.name).write_text(tactics.read_text())
    path = write_result("rope_store", dict(copy_bytes_per_s=bandwidth, rows=rows, anchors_q_tp4_ms=ANCHORS_Q_TP4))
    cols = ["path", "tp", "M", "eager", "inductor", "ours", "ours_pass", *(["tuned"] if args.tune else []),
            "roofline", "pct_roofline", "copy_same_bytes", "x_eager", "x_inductor"]
    print()
    print("ms per call (CUDA-graph replay); ours = default config; pct_roofline = roofline / ours;"
          " copy_same_bytes = a device copy moving the KV bytes (read + write);"
          " goals: Q <= 0.59 ms at 65536 (TP4), <= 0.010 ms at M <= 128; KV >= 80% of roofline at M >= 4096")
    print(table(rows, cols))
    failed = [f"{r['path']} TP{r['tp']} M={r['M']} {k}" for r in rows for k, v in r["correct"].items() if not v]
    print(f"results: {path}")
    if any("ours" in f for f in failed):
        print("FAIL: " + ", ".join(f for f in failed if "ours" in f))
    if any("ours" not in f for f in failed):
        # Inductor's default (no emulate_precision_casts) drops the bf16 rounding between the norm
        # and the RoPE, so its FP8 values can differ from the model's: reported, not our failure
        print("baselines that differ from the reference rule: " + ", ".join(f for f in failed if "ours" not in f))


if __name__ == "__main__":
    main()
