"""The persistent TileLang mhc_pre on the GPU: per config and M, x and the stats against the Triton kernel
with the same numerics (split 1; bitwise, else how many elements differ and by how much), and the time
of the TileLang kernel alone, of the op (with the Triton finish kernel) and of the Triton op. Each config
runs in a child process with a time limit (printing a line per M as it goes), so a hung kernel (a cross-CTA
wait that never completes) costs the rest of that config only.

    source .devsite/setup.sh && python3 benchmarks/probe_mhc_pre_tilelang.py [--m 4096 65536]
    ... --together --configs wg1-producer wg1x2-producer: one process, the ops and the Triton op timed in turn
    ... --variant NAME='{"by_stream": true}' --configs NAME: a config defined for this run only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _inputs(m: int):
    """V4.1-Flash mhc_pre inputs at M = m: ``(h, pre_prev, parts, sliced parts, scale, base, norm weight)``."""
    import torch

    from dsv41_passes.lowering.mhc_weights import build_parts, slice_major

    g = torch.Generator(device="cuda").manual_seed(m)
    d, k = 5120, 20480
    h = torch.randn(m, 4, d, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, k, device="cuda", generator=g) / k**0.5
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    base = torch.randn(24, device="cuda", generator=g) * 0.5
    pp = torch.rand(m, 4, device="cuda", generator=g) + 0.1
    w = torch.rand(d, device="cuda", generator=g) + 0.5
    parts = build_parts(fn)
    return h, pp, parts, slice_major(parts, d, 24), scale, base, w


def child(m: int, name: str) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import time_ms
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.lowering.triton import mhc as tk

    h, pp, parts, sliced, scale, base, w = _inputs(m)
    cfg = tlp.CONFIGS[name]
    out: dict = {"m": m, "config": name}
    tcfg = tk.default_config("mhc_pre")  # split 1: the numerics the TileLang kernel shares
    ref = tk.mhc_pre(h, pp, parts, scale, base, w, 20, 1e-6, 1e-6, 1e-6, batch_invariant=False, config=tcfg)
    got = tlp.mhc_pre(h, pp, sliced, scale, base, w, 20, 1e-6, 1e-6, 1e-6, config=cfg)
    for nm, a, b in zip(("x", "pre", "post", "comb"), got, ref):
        out[nm] = {"equal": bool(torch.equal(a, b)), "differ": int((a != b).sum()),
                   "max_abs": float((a.float() - b.float()).abs().max()) if a.numel() else 0.0}
    out["x_nan"] = int(torch.isnan(got[0].float()).sum())
    out["ms_op"] = time_ms(lambda: tlp.mhc_pre(h, pp, sliced, scale, base, w, 20, 1e-6, 1e-6, 1e-6, config=cfg))
    out["ms_kernel"] = time_ms(lambda: tlp.partials(h, pp, sliced, w, 1e-6, config=cfg))
    out["ms_triton"] = time_ms(lambda: tk.mhc_pre(h, pp, parts, scale, base, w, 20, 1e-6, 1e-6, 1e-6,
                                                  batch_invariant=False, config=tcfg))
    return out


def together(m: int, names: list[str], rounds: int) -> list[dict]:
    """Every config's op and the Triton op at one M, timed in turn (``time_interleaved``), with the bits of x
    and the stats against the Triton op."""
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import time_interleaved
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.lowering.triton import mhc as tk

    h, pp, parts, sliced, scale, base, w = _inputs(m)
    tcfg = tk.default_config("mhc_pre")
    args = (scale, base, w, 20, 1e-6, 1e-6, 1e-6)
    fns = {"triton": lambda: tk.mhc_pre(h, pp, parts, *args, batch_invariant=False, config=tcfg)}
    ref = fns["triton"]()
    same = {"triton": True}
    for name in names:
        fns[name] = (lambda c: lambda: tlp.mhc_pre(h, pp, sliced, *args, config=c))(tlp.CONFIGS[name])
        same[name] = all(torch.equal(a, b) for a, b in zip(fns[name](), ref))
    times = time_interleaved(fns, rounds=rounds)
    return [{"m": m, "config": n, "same_bits": same[n], "ms_median": t[0], "ms_min": t[1]} for n, t in times.items()]


def define_variants(specs: list[str]) -> None:
    """``NAME=JSON``: ``mhc_pre.CONFIGS[NAME]`` = the default config updated with the JSON build options."""
    sys.path.insert(0, str(ROOT))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    for spec in specs:
        name, _, opts = spec.partition("=")
        tlp.CONFIGS[name] = dict(tlp.DEFAULT_CONFIG, **json.loads(opts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[4096, 4097, 65536, 16384, 1024, 128, 1])
    ap.add_argument("--configs", nargs="+", default=["wg1", "wg2"])
    ap.add_argument("--limit", type=int, default=150)
    ap.add_argument("--child")
    ap.add_argument("--together", action="store_true",
                    help="one process: every config and the Triton op timed in turn at each M")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="a config for this run only: the default config with these build options, usable in --configs")
    args = ap.parse_args()
    define_variants(args.variant)
    if args.together:
        rows = [r for m in args.m for r in together(m, args.configs, args.rounds)]
        print("\n| M | op | same bits as Triton | ms (median) | ms (min) |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['m']} | {r['config']} | {r['same_bits']} | {r['ms_median']:.4f} | {r['ms_min']:.4f} |")
        return
    if args.child:
        for m in args.m:
            print(json.dumps(child(m, args.child)), flush=True)
        return
    rows = []
    for name in args.configs:
        cmd = [sys.executable, __file__, "--child", name, "--m", *map(str, args.m),
               *[a for v in args.variant for a in ("--variant", v)]]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit)
            stdout, err = proc.stdout, proc.stderr[-1500:] if proc.returncode else ""
        except subprocess.TimeoutExpired as e:
            out = e.stdout or ""
            stdout = out.decode() if isinstance(out, bytes) else out
            err = f"timed out after {args.limit} s"
        done = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
        for res in done:
            print(json.dumps(res), flush=True)
        rows += done
        if err:
            seen = {res["m"] for res in done}
            rows.append({"m": next((m for m in args.m if m not in seen), "?"), "config": name, "error": err})
            print(err, flush=True)
    print("\n| config | M | x | pre | post | comb | op ms | kernel ms | triton ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['m']} | ERROR {r['error'][-200:]!r} |")
            continue
        cells = [("=" if r[k]["equal"] else f"{r[k]['differ']} diff, {r[k]['max_abs']:.1e}") for k in
                 ("x", "pre", "post", "comb")]
        print(f"| {r['config']} | {r['m']} | " + " | ".join(cells) +
              f" | {r['ms_op']:.4f} | {r['ms_kernel']:.4f} | {r['ms_triton']:.4f} |")


if __name__ == "__main__":
    main()
