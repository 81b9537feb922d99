"""Shared benchmark plumbing: timing, measured rooflines, result tables and JSON.

Timing: CUDA-graph replay of the op (launch gaps removed; every M, small ones
included), median of several replays via ``triton.testing.do_bench`` when
available. Rooflines come from numbers measured in the same run: a large
device-to-device copy (bytes read + written) for HBM, a large bf16 GEMM for the
tensor cores.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "tilelang", "tile_kernels"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "unknown")
        except Exception:
            out[name] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["device"] = p.name
        out["capability"] = f"{p.major}.{p.minor}"
        out["sms"] = p.multi_processor_count
        out["cuda"] = torch.version.cuda
    else:
        out["device"] = "cpu"
    return out


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def kernel_times_us(fn: Callable[[], Any], calls: int = 20) -> dict[str, tuple[float, int]]:
    """Device time of each kernel ``fn`` launches (torch.profiler): name -> (median us, launches a call)."""
    from collections import defaultdict

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    return {k: (statistics.median(v), len(v) // calls) for k, v in per.items()}


def kernel_summary(fn: Callable[[], Any]) -> str:
    """``kernel_times_us`` as one line: "name us + name us ..." (names cut to 8 characters)."""
    return " + ".join(f"{k.strip('_')[:8]} {us:.2f}" for k, (us, _) in kernel_times_us(fn).items())


def compare_and_time(run: Callable[[Any], Any], variants: dict[str, Any], prefix: tuple = ()) -> list[tuple]:
    """Each config of ``variants`` (name -> config) through ``run``: its outputs compared bitwise with the
    first variant's, then its CUDA-graph time and per-kernel device times. Rows ``(*prefix, name, same bits,
    us, kernels)``, each printed as it is measured."""
    rows, ref = [], None
    for name, cfg in variants.items():
        out = run(cfg)
        ref = out if ref is None else ref
        same = all(torch.equal(a, b) for a, b in zip(out, ref))
        out = None
        ms = time_ms(lambda cfg=cfg: run(cfg))
        rows.append((*prefix, name, same, f"{ms * 1e3:.2f}", kernel_summary(lambda cfg=cfg: run(cfg))))
        print(*rows[-1], sep=" | ", flush=True)
    return rows


def print_markdown(note: str, header: list[str], rows: list[tuple]) -> None:
    print(f"\n{note}")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r) + " |")


def time_ms(fn: Callable[[], Any], graph: bool = True, reps: int = 30, inner: int | None = None) -> float:
    """Median milliseconds per call of ``fn`` (CUDA-graph replay unless ``graph=False``).

    With a graph, ``inner`` calls are captured back to back and the replay time is
    divided by ``inner`` (default: enough calls for >= ~1 ms per replay, estimated from a one-call
    graph, up to 200).
    """
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if not graph:
        return _median_ms(fn, reps)
    g, n = _sized_graph(fn, inner)
    return _median_ms(g.replay, reps) / n


def _sized_graph(fn: Callable[[], Any], inner: int | None = None) -> tuple["torch.cuda.CUDAGraph", int]:
    """``fn`` (already warmed up) captured ``n`` times back to back, and ``n`` (see ``time_ms``)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    n = inner
    if n is None:
        # size the replay from a one-call graph's device time, not from eager calls: an op's host
        # overhead would shrink n and leave the graph launch (several us) on each small call
        est = _median_ms(_capture(fn, 1).replay, 5)
        n = max(1, min(200, int(1.0 / max(est, 1e-3))))
    return _capture(fn, n), n


def time_interleaved(fns: dict[str, Callable[[], Any]], rounds: int = 8, reps: int = 5) -> dict[str, tuple]:
    """``name -> (median, min)`` ms per call over ``rounds``: each round times every function once (the
    median of ``reps`` CUDA-graph replays, each sized like ``time_ms``'s), in turn, so a drift of the
    device's speed over the run falls on every function alike."""
    graphs = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graphs[name] = _sized_graph(fn)
    seen: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (g, n) in graphs.items():
            seen[name].append(_median_ms(g.replay, reps) / n)
    return {name: (statistics.median(v), min(v)) for name, v in seen.items()}


def _capture(fn: Callable[[], Any], n: int) -> "torch.cuda.CUDAGraph":
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    torch.cuda.synchronize()
    return g


def wo_a_probe_inputs(m: int, tp: int = 4, seed: int = 0):
    """WO-A inputs at V4.1-Flash per-rank shapes for the probes: ``(o [M, 64/tp, 512], weight, cos, sin,
    (H, D, G, R, rope_dim))``, random angles per token (cos/sin strided views of one complex table)."""
    h, d, g, r, rd = 64 // tp, 512, 8 // tp, 1024, 64
    gen = torch.Generator(device="cuda").manual_seed(seed)
    o = torch.randn(m, h, d, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(g * r, h // g * d, device="cuda", generator=gen) / 64).bfloat16()
    ang = torch.rand(m, rd // 2, device="cuda", generator=gen) * 6.3
    cs = torch.view_as_real(torch.polar(torch.ones_like(ang), ang))
    return o, w, cs[..., 0], cs[..., 1], (h, d, g, r, rd)


def measure_copy_bandwidth(gib: float = 4.0) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus written."""
    n = int(gib * 2**30) // 4
    a = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), graph=False, reps=20)
    a = b = None
    torch.cuda.empty_cache()
    return 2 * n * 4 / (ms * 1e-3)


def measure_bf16_gemm_flops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, graph=False, reps=10)
    return 2 * n**3 / (ms * 1e-3)


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}" if v < 1 else f"{v:.3f}"
        return "-" if v is None else str(v)

    widths = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols}
    out = [" | ".join(c.ljust(widths[c]) for c in cols), "-+-".join("-" * widths[c] for c in cols)]
    for r in rows:
        out.append(" | ".join(fmt(r.get(c)).ljust(widths[c]) for c in cols))
    return "\n".join(out)


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """benchmarks/results/<name>-<device>-<date>.json with device, versions and date."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = versions()
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    dev = meta.get("device", "cpu").replace(" ", "_")
    path = RESULTS / f"{name}-{dev}-{date[:10]}.json"
    body = {"benchmark": name, "date": date, "versions": meta, "argv": sys.argv, **payload}
    path.write_text(json.dumps(body, indent=1, sort_keys=True))
    out_dir = os.environ.get("OUT")
    if out_dir:  # device runs: also hand the file back
        Path(out_dir, path.name).write_text(path.read_text())
    return path
