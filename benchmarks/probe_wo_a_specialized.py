"""Probe: the warp-specialized TileLang WO-A kernel (``specialized=True``) against the current default.

    source .devsite/setup.sh && python3 benchmarks/probe_wo_a_specialized.py [--m 65536 4096] [--tp 4] [--rounds 2]

For each M: the TileLang default and each specialized config (its rope chunks de-rotated beforehand by
``triton.wo_a.rope_tails``, timed inside the call), in turn, ``rounds`` times (this device reads up to
~10% apart for one kernel timed at different moments), then the same without RoPE, ``rope_tails`` alone
and cuBLAS bmm on a pre-transposed input. A row gives the bits against the default (the same bits are
expected: the same K order, wgmma shape and rounding), the error against the reference and the
CUDA-graph time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import time_ms, wo_a_probe_inputs  # noqa: E402

SPECIALIZED = [
    dict(BM=128, BN=256, BK=64, stages=3, specialized=True),
    dict(BM=128, BN=256, BK=64, stages=3, specialized=True, wait0=True),
]


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _name(c: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in c.items() if k != "specialized")


def probe(m: int, tp: int, rounds: int) -> list[tuple]:
    from dsv41_passes.lowering.tilelang import wo_a as tw
    from dsv41_passes.lowering.triton.wo_a import rope_tails

    o, w, cos, sin, (h, d, g, r, rd) = wo_a_probe_inputs(m, tp)
    ref = torch.ops.dsv41.wo_a(o, w, cos, sin, rd, "reference", 0).float()
    flops = 2 * m * g * r * (h // g) * d
    rows = []
    default = tw.default_config(m)
    base = {rd: tw.wo_a(o, w, cos, sin, rd, batch_invariant=False, config=default),
            0: tw.wo_a(o, w, None, None, 0, batch_invariant=False, config=default)}
    with_rope = [("default " + str(default), default, rd)] + [("specialized " + _name(c), c, rd) for c in SPECIALIZED]
    without = [("no rope, default", default, 0)] + [("no rope, specialized " + _name(c), c, 0) for c in SPECIALIZED]
    for name, cfg, rdim in with_rope * rounds + without:
        c_, s_ = (cos, sin) if rdim else (None, None)

        def run(cfg=cfg, c_=c_, s_=s_, rdim=rdim):
            return tw.wo_a(o, w, c_, s_, rdim, batch_invariant=False, config=cfg)

        try:
            out = run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a config that does not build or launch)
            rows.append((tp, m, name, f"{type(e).__name__}: {str(e)[:80]}", "", None, ""))
            print(rows[-1], flush=True)
            continue
        err = ((out.float() - ref).norm() / ref.norm()).item() if rdim else float("nan")
        t = time_ms(run)
        rows.append((tp, m, name, f"same bits {_bits(out, base[rdim])}", f"{err:.1e}", t,
                     f"{flops / t / 1e9:.0f} TFLOP/s"))
        print(rows[-1], flush=True)
    tails = rope_tails(o, cos, sin, rd, 64)
    t = time_ms(lambda: rope_tails(o, cos, sin, rd, 64))
    moved = o.numel() // (d // 64) * 2 * 2 + m * rd * 4  # the rope chunks read and written, the table read
    rows.append((tp, m, "rope_tails alone (Triton)", f"{tails.shape[-1]} columns a head", "", t,
                 f"{moved / t / 1e6:.0f} GB/s"))
    print(rows[-1], flush=True)
    og = o.view(m, g, -1).transpose(0, 1).contiguous()
    wt = w.view(g, r, -1).transpose(1, 2)
    t = time_ms(lambda: torch.bmm(og, wt))
    rows.append((tp, m, "cuBLAS bmm, pre-transposed (no rope)", "", "", t, f"{flops / t / 1e9:.0f} TFLOP/s"))
    print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[65536, 16384, 4096, 4097, 2048])
    ap.add_argument("--tp", type=int, nargs="+", default=[4])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import dsv41_passes  # noqa: F401  (registers the ops)

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for tp in args.tp:
        for m in args.m:
            rows += probe(m, tp, args.rounds)
            torch.cuda.empty_cache()
    print("\n| TP | M | variant | bits | vs reference | ms | rate |\n|---|---|---|---|---|---|---|")
    for r_ in rows:
        print("| " + " | ".join("-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v)) for v in r_) + " |")


if __name__ == "__main__":
    main()
