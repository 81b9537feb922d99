"""Warm-up / tuning entries of the mHC family (``dsv41_passes.tuning.warmup``): ``tunables``, re-exported by
``lowering.mhc``. Moved out of ``lowering/mhc.py`` unchanged (twenty-third session); the thresholds and switches it
reads stay there, read at each call."""

from __future__ import annotations

import torch

from . import mhc as ops


def tunables(config, device=None) -> list:
    """``tuning.Tunable`` entries of the Triton mHC kernels at ``config``'s shapes (hc_mult 4, bf16), and, where
    TileLang runs and takes the shape, the persistent TileLang ``mhc_pre`` (op name ``mhc_pre.tilelang``): one binary
    for every M, built at the first bucket from ``TILELANG_PRE_MIN_M`` (the ops' and the boundary's from there), its
    config the op's default (nothing to tune); where the fused boundary runs (``fused_boundary_at``), its own build too
    (``mhc_boundary.tilelang``)."""
    from ..tuning import Tunable
    from .mhc_weights import build_parts
    from .triton import mhc as tk

    n, d = config.hc_mult, config.hidden_size
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if tk.unsupported(torch.empty(0, n, d, dtype=torch.bfloat16, device=dev)) is not None:
        return []  # the ops run the reference provider at these shapes: nothing to build
    key = dict(d=d, n=n)
    iters, hc_eps, eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps

    def weights(dev):
        g = torch.Generator().manual_seed(0)
        fn = (torch.randn(config.mix_hc, n * d, generator=g) / (n * d) ** 0.5).to(dev)
        return (
            fn, build_parts(fn), torch.ones(3, device=dev), torch.zeros(config.mix_hc, device=dev),
            torch.ones(d, device=dev),
        )

    def res(m, dev):
        return torch.randn(m, n, d, device=dev).to(torch.bfloat16)

    def small(m, dev):
        return (torch.rand(m, n, device=dev), torch.softmax(torch.randn(m, n, n, device=dev), -1))

    def post_inputs(m, dev):
        return (torch.randn(m, d, device=dev).to(torch.bfloat16), res(m, dev), *small(m, dev))

    def collapse_inputs(m, dev):
        return (res(m, dev), torch.rand(m, n, device=dev), torch.ones(d, device=dev), eps)

    def stats_inputs(m, dev):
        _, parts, scale, base, _ = weights(dev)
        return (res(m, dev), parts, scale, base, iters, hc_eps, eps)

    def pre_inputs(m, dev):
        _, parts, scale, base, w = weights(dev)
        return (res(m, dev), torch.rand(m, n, device=dev), parts, scale, base, w, iters, hc_eps, eps, eps)

    def boundary_inputs(m, dev):
        _, parts, scale, base, w = weights(dev)
        return (*post_inputs(m, dev), torch.rand(m, n, device=dev), parts, scale, base, w, iters, hc_eps, eps, eps)

    def runner(fn):
        return lambda inputs, cfg: fn(*inputs, batch_invariant=False, config=cfg)

    table = {
        "mhc_post": (post_inputs, tk.mhc_post),
        "mhc_collapse": (collapse_inputs, tk.mhc_collapse),
        "mhc_stats": (stats_inputs, tk.mhc_stats),
        "mhc_pre": (pre_inputs, tk.mhc_pre),
        "mhc_boundary": (boundary_inputs, tk.mhc_boundary),
    }
    out = [  # untuned: what a call at M runs without a tactic (split 2 and 16-row blocks at decode sizes)
        Tunable(op, key, make, runner(fn), tk.CANDIDATES[op], tk.default_config(op),
                lambda m, op=op: tk.untuned_config(op, m, d, False))
        for op, (make, fn) in table.items()
    ]
    from .registry import tilelang_available

    if ops.TILELANG_PRE_MIN_M is not None and tilelang_available(torch.empty(0, device=dev)) is None:
        from .mhc_weights import slice_major
        from .tilelang import mhc_pre as tlp

        cfg = ops.pre_config(dev)
        if (tlp.unsupported(torch.empty(1, n, d, dtype=torch.bfloat16, device=dev)) is None
                and ops.resident_why(dev, cfg) is None):
            def tl_pre_inputs(m, dev):
                if m < ops.TILELANG_PRE_MIN_M:
                    return None  # the op runs the Triton kernel at this M: nothing to build
                _, parts, scale, base, w = weights(dev)
                return (res(m, dev), torch.rand(m, n, device=dev), slice_major(parts, d, config.mix_hc), scale, base,
                        w, iters, hc_eps, eps, eps)

            def run_tl_pre(inputs, cfg):
                return None if inputs is None else tlp.mhc_pre(*inputs, config=cfg)

            out.append(Tunable("mhc_pre.tilelang", key, tl_pre_inputs, run_tl_pre, [cfg], cfg, lambda m: cfg))
            bcfg = ops.fused_boundary_config(dev)
            # the boundary's own build (the post inside the kernel), where the op runs it
            if ops.fused_boundary_at(ops.TILELANG_PRE_MIN_M) and ops.resident_why(dev, bcfg) is None:
                def tl_boundary_inputs(m, dev):
                    if m < ops.TILELANG_PRE_MIN_M or not ops.fused_boundary_at(m):
                        return None
                    r, *rest = tl_pre_inputs(m, dev)  # the pre's residual is the post's old one
                    return (torch.randn(m, d, device=dev).to(torch.bfloat16), r, *small(m, dev), *rest)

                def run_tl_boundary(inputs, cfg):
                    return None if inputs is None else tlp.mhc_boundary(*inputs, config=cfg)

                out.append(Tunable("mhc_boundary.tilelang", key, tl_boundary_inputs, run_tl_boundary, [bcfg], bcfg,
                                   lambda m: bcfg))
    return out
