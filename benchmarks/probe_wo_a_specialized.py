"""Probe: the warp-specialized TileLang WO-A kernel (``specialized=True``) against the current default.

    source .devsite/setup.sh && python3 benchmarks/probe_wo_a_specialized.py [--m 65536 4096] [--tp 4] [--rounds 8]

For each M above 1024: the TileLang default and each specialized config, with the rope chunks de-rotated beforehand
by ``triton.wo_a.rope_tails`` (timed inside the call), by the consumer warpgroups in the stage, or into the A
registers of a register-A wgmma, persistent or not;
then the same without RoPE, ``rope_tails`` alone and cuBLAS bmm on a pre-transposed input (``--stream-k``: the
default with and without stream-K only). At M <= 1024:
the default and the one-loop 128-row kernel with 128 or 64 columns, split over K in 1, 2, 4 or 8 parts. A row gives
the bits against the default (the same bits are expected: the same K order, wgmma shape and rounding),
the error against the reference and the CUDA-graph time, median and minimum over ``rounds`` rounds that
time every variant in turn (this device's speed drifts by up to ~10% over a run, which timing the
variants one after another put on some of them only). Run 100's log has this probe with two more
variants (rope chunks de-rotated by two producer warps), runs 102-104's with ``rope="early"`` (each head's
rope chunk in a buffer of its own, de-rotated by the consumers during an earlier chunk) and its diagnostic
builds (no proxy fence, no barrier, no de-rotation, no cos/sin loads, the warpgroups de-rotating at different
chunks), all since dropped. Run 119's log has three more with ``rope="registers"``: the de-rotation one chunk early,
32-column chunks in 6 stages, the tile stored from registers with a 4th stage (dropped too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import time_interleaved, wo_a_probe_inputs  # noqa: E402

_BASE = dict(BM=128, BN=256, BK=64, stages=3, specialized=True)
SPECIALIZED = [
    _BASE,
    dict(_BASE, persistent=True),
    dict(_BASE, rope="consumers", persistent=True),
    dict(_BASE, rope="registers", persistent=True),
    dict(_BASE, rope="registers"),
    dict(_BASE, persistent=True, stages=4, z_cols=128),
    dict(_BASE, rope="registers", persistent=True, stages=4, z_cols=128),
]
# the GEMM alone (no RoPE)
NO_ROPE = [dict(_BASE, persistent=True), dict(_BASE, persistent=True, stages=4, z_cols=128)]
# decode sizes (M <= 1024): the one-loop 128 x 128 kernel (``wo_a._DECODE``) split over K or not, and with
# 64-column tiles
DECODE = [dict(BN=bn, SPLIT=s) for bn in (128, 64) for s in (1, 2, 4, 8)]
# the same split, the parts summed by the tile's thread block cluster through distributed shared memory
DECODE += [dict(BN=bn, SPLIT=s, cluster=True) for bn in (128, 64) for s in (2, 4, 8)]
# the sum kernel launched by programmatic dependent launch (1-2% faster at M = 128 and 256, run 160)
DECODE += [dict(BN=bn, SPLIT=s, pdl=True) for bn in (128, 64) for s in (2, 4, 8)]


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _name(c: dict) -> str:
    if c.get("one_loop"):
        bm = "" if c["BM"] == 128 else f"BM={c['BM']} "
        return (f"one-loop {bm}BN={c['BN']} split={c.get('SPLIT', 1)}" + (" cluster" if c.get("cluster") else "")
                + (" pdl" if c.get("pdl") else "") + (f" stages={c['stages']}" if c.get("stages", 4) != 4 else ""))
    return ",".join(f"{k}={v}" for k, v in c.items() if _BASE.get(k) != v) or "tails"


def probe(m: int, tp: int, rounds: int, stream_k: bool = False, store: bool = False,
          decode: list[dict] | None = None) -> list[tuple]:
    from dsv41_passes.lowering.tilelang import wo_a as tw
    from dsv41_passes.lowering.triton.wo_a import rope_tails

    o, w, cos, sin, (h, d, g, r, rd) = wo_a_probe_inputs(m, tp)
    ref = torch.ops.dsv41.wo_a(o, w, cos, sin, rd, "reference", 0).float()
    flops = 2 * m * g * r * (h // g) * d
    default = tw.untuned_config(m, g * r, h // g)
    base = {rd: tw.wo_a(o, w, cos, sin, rd, batch_invariant=False, config=default),
            0: tw.wo_a(o, w, None, None, 0, batch_invariant=False, config=default)}
    variants = [("default", default, rd)]
    if store:  # the register-A kernel and the rope pass (both with stream-K), and each warpgroup storing its rows
        regs = dict(tw.SPECIALIZED_REGISTERS_CONFIG, stream_k=tw.STREAM_K_SHARE)
        tails = dict(tw.SPECIALIZED_CONFIG, stream_k=tw.STREAM_K_SHARE)
        variants += [(name, c, rd) for name, c in (("registers, stream_k", regs), ("rope pass, stream_k", tails))
                     if c != default]
        variants += [("registers, stream_k, wg_store", dict(regs, wg_store=True), rd)]
    elif stream_k:  # the default without stream-K, and with any partial wave shared out (cut tiles' bits differ)
        if default.get("specialized"):
            variants += [("default, no stream_k", dict(default, stream_k=0), rd),
                         ("default, stream_k any wave", dict(default, stream_k=True), rd)]
    elif m > 1024 and not decode:
        variants += [("specialized " + _name(c), c, rd) for c in SPECIALIZED]
        variants += [("no rope, default", default, 0)]
        variants += [("no rope, specialized " + _name(c), c, 0) for c in NO_ROPE]
    else:
        variants += [(_name(c), c, rd) for c in (d_ if d_.get("specialized") else dict(tw._DECODE, **d_)
                                                 for d_ in (decode or DECODE))]
    fns, notes = {}, {}
    for name, cfg, rdim in variants:
        c_, s_ = (cos, sin) if rdim else (None, None)

        def run(cfg=cfg, c_=c_, s_=s_, rdim=rdim):
            return tw.wo_a(o, w, c_, s_, rdim, batch_invariant=False, config=cfg)

        try:
            out = run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a config that does not build or launch)
            notes[name] = (f"{type(e).__name__}: {str(e)[:80]}", "")
            print(name, notes[name], flush=True)
            continue
        err = ((out.float() - ref).norm() / ref.norm()).item() if rdim else float("nan")
        notes[name] = (f"same bits {_bits(out, base[rdim])}", f"{err:.1e}")
        print(name, notes[name], flush=True)
        fns[name] = run
        out = None
    if m <= 16:  # the provider's choice at M <= 16 outside batch-invariant mode
        from dsv41_passes.lowering.triton import wo_a as trk

        fns["Triton split-K"] = lambda: trk.wo_a(o, w, cos, sin, rd, batch_invariant=False)
        notes["Triton split-K"] = (f"same bits {_bits(fns['Triton split-K'](), base[rd])}", "")
    fns["rope_tails alone (Triton)"] = lambda: rope_tails(o, cos, sin, rd, 64)
    notes["rope_tails alone (Triton)"] = ("", "")
    og = o.view(m, g, -1).transpose(0, 1).contiguous()
    wt = w.view(g, r, -1).transpose(1, 2)
    fns["cuBLAS bmm, pre-transposed (no rope)"] = lambda: torch.bmm(og, wt)
    notes["cuBLAS bmm, pre-transposed (no rope)"] = ("", "")
    times = time_interleaved(fns, rounds=rounds)
    rows = []
    for name, (med, low) in times.items():
        rate = f"{flops / med / 1e9:.0f} TFLOP/s" if "rope_tails" not in name else ""
        rows.append((tp, m, name, *notes[name], med, low, rate))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[65536, 16384, 4096])
    ap.add_argument("--tp", type=int, nargs="+", default=[4])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--stream-k", action="store_true", help="the defaults with and without stream-K only")
    ap.add_argument("--store", action="store_true",
                    help="the register-A kernel, the rope pass and the tile stored by each warpgroup only")
    ap.add_argument("--decode", type=json.loads, metavar="JSON",
                    help="at M <= 1024: these configs instead of DECODE (a JSON list: overrides of wo_a._DECODE, or "
                         "whole specialized configs)")
    args = ap.parse_args()
    import dsv41_passes  # noqa: F401  (registers the ops)

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for tp in args.tp:
        for m in args.m:
            rows += probe(m, tp, args.rounds, args.stream_k, args.store, args.decode)
            torch.cuda.empty_cache()
    print("\n| TP | M | variant | bits | vs reference | ms (median) | ms (min) | rate (median) |\n"
          "|---|---|---|---|---|---|---|---|")
    for r_ in rows:
        print("| " + " | ".join(f"{v:.4f}" if isinstance(v, float) else str(v) for v in r_) + " |")


if __name__ == "__main__":
    main()
