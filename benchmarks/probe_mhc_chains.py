"""MMA chains of the Triton mHC projection, V4.1-Flash shapes: ``chains="slice"`` (three accumulators: a
fresh hi dot per (chunk, stream) added in fp32, mid and lo chained over the slice; every wgmma waited for)
against ``chains="stream"`` (twelve accumulators, one chain per (stream, part): the chunk's wgmma groups
run asynchronously) at several warps / stages / register caps.

Prints, per variant: the PTX's wgmma waits and the registers / spills this Triton gives it; the pre-Sinkhorn
mixes' normwise error against float64; then ``mhc_stats`` and ``mhc_pre`` timed as CUDA-graph replays with
their outputs compared bitwise with the first variant's.

    source .devsite/setup.sh && python3 benchmarks/probe_mhc_chains.py [M ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import compare_and_time, print_markdown  # noqa: E402

ITERS, EPS, D = 20, 1e-6, 5120
STREAM = {"64x4": dict(BLOCK_M=64, num_warps=4), "64x8": dict(BLOCK_M=64, num_warps=8),
          "64x8 st4": dict(BLOCK_M=64, num_warps=8, num_stages=4),
          "64x8 r128": dict(BLOCK_M=64, num_warps=8, maxnreg=128)}


def variants(op: str, m: int) -> dict[str, dict]:
    from dsv41_passes.lowering.triton.mhc_common import untuned_config

    base = untuned_config(op, m, D, False)
    out = {}
    if base["BLOCK_M"] == 64:
        for name, c in STREAM.items():
            out[f"stream {name}"] = dict(base, chains="stream", **c)
    else:  # decode sizes: the untuned 16-row blocks
        out["stream untuned"] = dict(base, chains="stream")
    out["slice (default)"] = base
    return out


def builds() -> list[tuple]:
    """wgmma waits in the PTX and registers / spills per variant (stats and pre, the prefill config)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsv41_passes.lowering.mhc_weights import slice_geometry
    from dsv41_passes.lowering.triton import mhc_projection as mp
    from dsv41_passes.lowering.triton.mhc_common import _norm_block

    bk = slice_geometry(D)[1]
    bf16 = ("h_ptr", "y_ptr", "new_ptr", "x_ptr", "parts_ptr")
    rows = []
    for op in ("stats", "pre"):
        for name, c in [("slice 64x4", dict(BLOCK_M=64, num_warps=4, chains="slice"))] + [
                (f"stream {k}", dict(v, chains="stream")) for k, v in STREAM.items()]:
            pre = op == "pre"
            consts = dict(D=D, BK=bk, BM=c["BLOCK_M"], XB=_norm_block(D, c["BLOCK_M"]), BOUNDARY=False, COLLAPSE=pre,
                          NORM=pre, MIXES=False, FINISH=False, SPLIT=1, FB=mp.stats_rows(c["BLOCK_M"], 16), NP2=16,
                          PDL=False, STREAM_CHAINS=c["chains"] == "stream", INTERP=False)
            k = mp._proj_kernel
            types = {a: ("*bf16" if a in bf16 else "*i32" if a == "count_ptr" else "*fp32") for a in k.arg_names
                     if a.endswith("_ptr")}
            types |= {a: "fp32" for a in ("hc_eps", "norm_eps", "eps")}
            sig = {a: "constexpr" if a in consts else types.get(a, "i32") for a in k.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(k.arg_names)
                     if a.startswith("stride") or a.endswith("_ptr")}
            opts = dict(enable_fp_fusion=False, num_warps=c["num_warps"], num_stages=c.get("num_stages", 3))
            if c.get("maxnreg"):
                opts["maxnreg"] = c["maxnreg"]
            cc = triton.compile(ASTSource(k, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32), options=opts)
            cc._init_handles()
            waits = [ln.split()[-1] for ln in cc.asm["ptx"].splitlines() if "wgmma.wait_group" in ln]
            rows.append((op, name, " ".join(waits), cc.n_regs, cc.n_spills, cc.metadata.shared))
            print(*rows[-1], sep=" | ", flush=True)
    return rows


def errors(m: int) -> list[tuple]:
    """Normwise error of the pre-Sinkhorn mixes against float64, per variant."""
    from benchmarks.quick_check import mhc_inputs
    from dsv41_passes.lowering.triton import mhc as tk

    t = mhc_inputs(m)
    xf = t["h"].flatten(1)
    ref = torch.cat([(xf[i:i + 2048].double() @ t["fn"].double().T)
                     * torch.rsqrt(xf[i:i + 2048].double().square().mean(-1, keepdim=True) + EPS)
                     for i in range(0, m, 2048)])
    rows = []
    for name, c in variants("mhc_stats", m).items():
        mixes = tk.stats_mixes(t["h"], t["parts"], t["scale"], t["base"], ITERS, EPS, EPS, batch_invariant=False,
                               config=c)
        rows.append((m, name, f"{((mixes.double() - ref).norm() / ref.norm()).item():.3e}"))
        print(*rows[-1], sep=" | ", flush=True)
    return rows


def main() -> None:
    import triton

    import dsv41_passes  # noqa: F401
    from benchmarks.quick_check import mhc_inputs
    from dsv41_passes.lowering.triton import mhc as tk

    print(torch.cuda.get_device_name(), torch.__version__, "triton", triton.__version__, flush=True)
    sizes = [int(a) for a in sys.argv[1:]] or [65536, 16384, 4096, 128, 1]
    brows = builds()
    erows = errors(4096) + errors(65536)
    rows = []
    for m in sizes:
        t = mhc_inputs(m)

        def stats(c):
            return tk.mhc_stats(t["h"], t["parts"], t["scale"], t["base"], ITERS, EPS, EPS, batch_invariant=False,
                                config=c)

        def pre(c):
            return tk.mhc_pre(t["h"], t["pre_prev"], t["parts"], t["scale"], t["base"], t["w"], ITERS, EPS, EPS, EPS,
                              batch_invariant=False, config=c)

        rows += compare_and_time(stats, variants("mhc_stats", m), (m, "stats"))
        rows += compare_and_time(pre, variants("mhc_pre", m), (m, "pre"))
        t = None
        torch.cuda.empty_cache()
    print_markdown("builds: wgmma waits in the PTX, registers, spills, shared bytes", ["op", "variant", "waits",
                   "regs", "spills", "shared"], brows)
    print_markdown("pre-Sinkhorn mixes, normwise error vs float64", ["M", "variant", "error"], erows)
    print_markdown("us per call (CUDA-graph replay); bits = outputs equal to the first variant's",
                   ["M", "op", "variant", "bits", "us", "kernels (us)"], rows)


if __name__ == "__main__":
    main()
