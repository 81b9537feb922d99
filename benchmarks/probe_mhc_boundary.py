"""Forms of the Triton ``mhc_boundary`` (post of sub-block i, then stats + collapse + norm of i+1), V4.1-Flash
shapes: ``post_pre`` (the post kernel, then ``mhc_pre``: what the pass formed before), ``post_collapse`` (one
kernel for the post and the collapse + norm of whole rows, then ``mhc_stats``) at several rows / warps a
program, and ``fused`` (the projection kernel computes the post). ``--tilelang``: also the TileLang boundaries, the
Triton post then the TileLang ``mhc_pre`` (the provider's path) and the post inside the persistent kernel
(``mhc_pre.mhc_boundary``, with the default config and ``--tilelang-configs NAME,...``). Each variant's five outputs
are compared bitwise with ``post_pre``'s, then timed as a CUDA-graph replay with the device time of each kernel.

    source .devsite/setup.sh && python3 benchmarks/probe_mhc_boundary.py [--no-fused] [--no-post-collapse] \
        [--tilelang [--tilelang-configs NAME,...]] [M ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import compare_and_time, print_markdown  # noqa: E402

ITERS, EPS, D = 20, 1e-6, 5120
POST_COLLAPSE = ((1, 1024, 4), (2, 1024, 4), (2, 1024, 8), (4, 1024, 8), (4, 512, 4), (4, 512, 8), (8, 512, 8),
                 (4, 256, 4), (1, 256, 1))


def variants(m: int) -> dict[str, dict]:
    from dsv41_passes.lowering.triton.mhc_common import untuned_config

    pre, stats = untuned_config("mhc_pre", m, D, False), untuned_config("mhc_stats", m, D, False)
    out = {"post_pre": dict(pre, form="post_pre")}
    for r, c, w in POST_COLLAPSE if "--no-post-collapse" not in sys.argv else ():
        out[f"post_collapse {r}x{c} w{w}"] = dict(stats, form="post_collapse", post_rows=r, post_cols=c, post_warps=w)
    if "--no-fused" not in sys.argv and m <= 4096:
        out["fused"] = dict(pre, form="fused")
    if "--tilelang" in sys.argv:
        names = [None]
        if "--tilelang-configs" in sys.argv:
            names += sys.argv[sys.argv.index("--tilelang-configs") + 1].split(",")
        out["tilelang post_pre"] = dict(tilelang="post_pre", name=None)
        for name in names:
            out[f"tilelang fused {name or 'default'}"] = dict(tilelang="fused", name=name)
        out["tilelang fused default, TMA stores"] = dict(tilelang="fused", name=None, post_tma_store=True)
    return out


def run_tilelang(t: dict, c: dict):
    """The TileLang boundaries: the Triton post then the TileLang ``mhc_pre``, or the post in the persistent kernel."""
    from dsv41_passes.lowering.mhc_weights import slice_major
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.lowering.triton import mhc as tk

    if "sliced" not in t:
        t["sliced"] = slice_major(t["parts"], D, 24)
    args = (t["sliced"], t["scale"], t["base"], t["w"], ITERS, EPS, EPS, EPS)
    # by default each form runs the op's config: the fused kernel BOUNDARY_CONFIG, the mhc_pre after the Triton post
    # DEFAULT_CONFIG (runs 187-196 ran that mhc_pre with BOUNDARY_CONFIG too)
    default = tlp.BOUNDARY_CONFIG if c["tilelang"] == "fused" else tlp.DEFAULT_CONFIG
    cfg = dict(default if c["name"] is None else tlp.CONFIGS[c["name"]])
    if c.get("post_tma_store"):
        cfg["post_tma_store"] = True
    if c["tilelang"] == "fused":
        return tlp.mhc_boundary(t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], *args, config=cfg)
    new = tk.mhc_post(t["y"], t["h"], t["post"], t["comb"], batch_invariant=False)
    return (new, *tlp.mhc_pre(new, t["pre_prev"], *args, config=cfg))


def main() -> None:
    import dsv41_passes  # noqa: F401
    from benchmarks.quick_check import mhc_inputs
    from dsv41_passes.lowering.triton import mhc as tk

    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    sizes = [int(a) for a in sys.argv[1:] if a.isdigit()] or [1, 128, 256, 512, 1024, 4096, 16384, 65536]
    rows = []
    for m in sizes:
        t = mhc_inputs(m)
        y, post, comb = t["y"], t["post"], t["comb"]

        def run(c):
            if "tilelang" in c:
                return run_tilelang(t, c)
            return tk.mhc_boundary(y, t["h"], post, comb, t["pre_prev"], t["parts"], t["scale"], t["base"], t["w"],
                                   ITERS, EPS, EPS, EPS, batch_invariant=False, config=c)

        rows += compare_and_time(run, variants(m), (m,))
        t = y = post = comb = None
        torch.cuda.empty_cache()
    print_markdown("us per call (CUDA-graph replay); bits = all five outputs equal to post_pre's",
                   ["M", "form", "bits", "us", "kernels (us)"], rows)


if __name__ == "__main__":
    main()
