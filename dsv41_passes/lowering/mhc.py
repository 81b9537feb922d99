"""mHC fused ops (namespace ``dsv41``): custom ops, fake implementations, reference providers.

``mhc_post(y, res, post, comb) -> new_res``
    ``new_res[:, k] = post[:, k] * y + sum_j comb[:, j, k] * res[:, j]`` in fp32, one bf16 rounding.
"""

from __future__ import annotations

import json
import math
import os

import torch

from ..reference import mhc as ref
from .registry import dispatch, one_device, register_provider, triton_available

HC_MAX = 8


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def check_post_args(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    """Clear errors for inputs a fused post cannot take (eager calls; the pass checks the same before rewriting)."""
    _check(res.dim() == 3, f"mhc_post: res must be [M, hc_mult, hidden], got {tuple(res.shape)}")
    m, n, d = res.shape
    _check(1 <= n <= HC_MAX, f"mhc_post: hc_mult must be in [1, {HC_MAX}], got {n}")
    _check(tuple(y.shape) == (m, d), f"mhc_post: y must be [M, hidden] = {(m, d)}, got {tuple(y.shape)}")
    _check(tuple(post.shape) == (m, n), f"mhc_post: post must be [M, hc_mult] = {(m, n)}, got {tuple(post.shape)}")
    _check(tuple(comb.shape) == (m, n, n), f"mhc_post: comb must be [M, n, n] = {(m, n, n)}, got {tuple(comb.shape)}")
    _check(y.dtype == res.dtype and y.dtype in (torch.bfloat16, torch.float16, torch.float32),
           f"mhc_post: y and res must share a float dtype, got {y.dtype} and {res.dtype}")
    _check(post.dtype == torch.float32 and comb.dtype == torch.float32,
           f"mhc_post: post and comb must be float32, got {post.dtype} and {comb.dtype}")
    one_device("mhc_post", y, res, post, comb)


@torch.library.custom_op("dsv41::mhc_post", mutates_args=())
def mhc_post(
    y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, providers: str, mode: int
) -> torch.Tensor:
    check_post_args(y, res, post, comb)
    return dispatch("mhc_post", providers, mode, y, res, post, comb)


@mhc_post.register_fake
def _mhc_post_fake(y, res, post, comb, providers, mode):
    one_device("mhc_post", y, res, post, comb)
    return res.new_empty(res.shape)


@register_provider("mhc_post", "reference")
def _mhc_post_reference(y, res, post, comb, *, batch_invariant):
    return ref.hc_post(y, res, post, comb).contiguous()


# ---------------------------------------------------------------------------
# stats: projection + RMS + split/sigmoid/Sinkhorn
# ---------------------------------------------------------------------------
def check_stats_args(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                     iters: int, hc_eps: float, norm_eps: float) -> None:
    _check(iters >= 1, f"mhc_stats: Sinkhorn iterations must be >= 1, got {iters}")
    _check(math.isfinite(hc_eps) and hc_eps >= 0, f"mhc_stats: hc_eps must be finite and >= 0, got {hc_eps}")
    _check(math.isfinite(norm_eps) and norm_eps > 0, f"mhc_stats: norm eps must be finite and > 0, got {norm_eps}")
    _check(h.dim() == 3, f"mhc_stats: h must be [M, hc_mult, hidden], got {tuple(h.shape)}")
    m, n, d = h.shape
    _check(1 <= n <= HC_MAX, f"mhc_stats: hc_mult must be in [1, {HC_MAX}], got {n}")
    nmix = (2 + n) * n
    _check(tuple(fn.shape) == (nmix, n * d), f"mhc_stats: fn must be [{nmix}, {n * d}], got {tuple(fn.shape)}")
    _check(tuple(base.shape) == (nmix,), f"mhc_stats: base must be [{nmix}], got {tuple(base.shape)}")
    _check(tuple(scale.shape) == (3,), f"mhc_stats: scale must be [3], got {tuple(scale.shape)}")
    _check(fn.dtype == scale.dtype == base.dtype == torch.float32, "mhc_stats: fn, scale and base must be float32")
    _check(
        h.dtype in (torch.bfloat16, torch.float16, torch.float32), f"mhc_stats: unsupported residual dtype {h.dtype}"
    )
    one_device("mhc_stats", h, fn, scale, base)


def _stats_out(h: torch.Tensor):
    m, n, _ = h.shape
    f32 = dict(dtype=torch.float32, device=h.device)
    return h.new_empty((m, n), **f32), h.new_empty((m, n), **f32), h.new_empty((m, n, n), **f32)


@torch.library.custom_op("dsv41::mhc_stats", mutates_args=())
def mhc_stats(
    h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
    iters: int, hc_eps: float, norm_eps: float, providers: str, mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_stats_args(h, fn, scale, base, iters, hc_eps, norm_eps)
    return dispatch("mhc_stats", providers, mode, h, fn, scale, base, iters, hc_eps, norm_eps)


@mhc_stats.register_fake
def _mhc_stats_fake(h, fn, scale, base, iters, hc_eps, norm_eps, providers, mode):
    one_device("mhc_stats", h, fn, scale, base)
    return _stats_out(h)


def _bi_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from .matmul import ordered_matmul

    return ordered_matmul(x, w.t())


@register_provider("mhc_stats", "reference")
def _mhc_stats_reference(h, fn, scale, base, iters, hc_eps, norm_eps, *, batch_invariant):
    # library GEMMs change their reduction order with M; batch-invariant mode pins it
    linear = _bi_linear if batch_invariant else torch.nn.functional.linear
    return tuple(t.contiguous() for t in ref.hc_mixes(h, fn, scale, base, iters, hc_eps, norm_eps, linear=linear))


# ---------------------------------------------------------------------------
# collapse (+ RMSNorm)
# ---------------------------------------------------------------------------
def check_collapse_args(h: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None, eps: float) -> None:
    _check(h.dim() == 3, f"mhc_collapse: h must be [M, hc_mult, hidden], got {tuple(h.shape)}")
    m, n, d = h.shape
    _check(1 <= n <= HC_MAX, f"mhc_collapse: hc_mult must be in [1, {HC_MAX}], got {n}")
    _check(h.dtype in (torch.bfloat16, torch.float16, torch.float32),
           f"mhc_collapse: unsupported residual dtype {h.dtype}")
    _check(tuple(pre.shape) == (m, n), f"mhc_collapse: pre must be [M, hc_mult] = {(m, n)}, got {tuple(pre.shape)}")
    _check(pre.dtype == torch.float32, f"mhc_collapse: pre must be float32, got {pre.dtype}")
    if weight is not None:
        _check(tuple(weight.shape) == (d,), f"mhc_collapse: norm weight must be [{d}], got {tuple(weight.shape)}")
        _check(weight.is_floating_point(), f"mhc_collapse: norm weight must be floating point, got {weight.dtype}")
        _check(math.isfinite(eps) and eps > 0, f"mhc_collapse: norm eps must be finite and > 0, got {eps}")
    one_device("mhc_collapse", h, pre, weight)


def collapse_norm_reference(
    h: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    from ..reference.model import rms_norm

    x = ref.hc_collapse(h, pre)
    return x if weight is None else rms_norm(x, weight, eps)


@torch.library.custom_op("dsv41::mhc_collapse", mutates_args=())
def mhc_collapse(
    h: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor | None, eps: float, providers: str, mode: int
) -> torch.Tensor:
    """``sum_j pre_j h_j`` in fp32 -> bf16, then (with ``weight``) RMSNorm -> bf16."""
    check_collapse_args(h, pre, weight, eps)
    return dispatch("mhc_collapse", providers, mode, h, pre, weight, eps)


@mhc_collapse.register_fake
def _mhc_collapse_fake(h, pre, weight, eps, providers, mode):
    one_device("mhc_collapse", h, pre, weight)
    return h.new_empty((h.shape[0], h.shape[2]))


@register_provider("mhc_collapse", "reference")
def _mhc_collapse_reference(h, pre, weight, eps, *, batch_invariant):
    return collapse_norm_reference(h, pre, weight, eps).contiguous()


# ---------------------------------------------------------------------------
# pre: stats of h and collapse (+ norm) of h with the previous pre, one read of h
# ---------------------------------------------------------------------------
@torch.library.custom_op("dsv41::mhc_pre", mutates_args=())
def mhc_pre(
    h: torch.Tensor, pre_prev: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
    weight: torch.Tensor | None, iters: int, hc_eps: float, norm_eps: float, eps: float, providers: str, mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, pre, post, comb) = (collapse_norm(h, pre_prev), *stats(h)): V4.1's shifted pre in one pass."""
    check_stats_args(h, fn, scale, base, iters, hc_eps, norm_eps)
    check_collapse_args(h, pre_prev, weight, eps)
    return dispatch("mhc_pre", providers, mode, h, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps)


@mhc_pre.register_fake
def _mhc_pre_fake(h, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, providers, mode):
    one_device("mhc_pre", h, pre_prev, fn, scale, base, weight)
    return (h.new_empty((h.shape[0], h.shape[2])), *_stats_out(h))


@register_provider("mhc_pre", "reference")
def _mhc_pre_reference(h, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *, batch_invariant):
    x = collapse_norm_reference(h, pre_prev, weight, eps).contiguous()
    return (x, *_mhc_stats_reference(h, fn, scale, base, iters, hc_eps, norm_eps, batch_invariant=batch_invariant))


# ---------------------------------------------------------------------------
# boundary: post of sub-block i, then stats + collapse (+ norm) of sub-block i+1
# ---------------------------------------------------------------------------
@torch.library.custom_op("dsv41::mhc_boundary", mutates_args=())
def mhc_boundary(
    y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, pre_prev: torch.Tensor,
    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, weight: torch.Tensor | None,
    iters: int, hc_eps: float, norm_eps: float, eps: float, providers: str, mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(new_res, x, pre, post, comb): the new residual is written once and not re-read."""
    check_post_args(y, res, post, comb)
    check_stats_args(res, fn, scale, base, iters, hc_eps, norm_eps)
    check_collapse_args(res, pre_prev, weight, eps)
    return dispatch(
        "mhc_boundary", providers, mode, y, res, post, comb, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps,
        eps,
    )


@mhc_boundary.register_fake
def _mhc_boundary_fake(
    y, res, post, comb, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, providers, mode
):
    one_device("mhc_boundary", y, res, post, comb, pre_prev, fn, scale, base, weight)
    return (res.new_empty(res.shape), res.new_empty((res.shape[0], res.shape[2])), *_stats_out(res))


@register_provider("mhc_boundary", "reference")
def _mhc_boundary_reference(
    y, res, post, comb, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *, batch_invariant
):
    new_res = ref.hc_post(y, res, post, comb).contiguous()
    return (new_res, *_mhc_pre_reference(new_res, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps,
                                         batch_invariant=batch_invariant))


# ---------------------------------------------------------------------------
# Triton / TileLang providers (kernels imported lazily). The projection ops take
# the bf16x3 parts of ``fn`` from the derived-weight cache before any output is
# allocated, so a static-weights rejection leaves nothing written.
# ---------------------------------------------------------------------------
def _kernel_residual_ok(res: torch.Tensor) -> str | None:
    from .triton import mhc as tk  # only reached once triton is importable

    return tk.unsupported(res)


def _triton_post_ok(y, res, post, comb, *, batch_invariant):
    why = triton_available(res) or _kernel_residual_ok(res)
    if why:
        return why
    if y.dtype != res.dtype:
        return f"y dtype {y.dtype} differs from the residual's {res.dtype}"
    if y.stride(-1) != 1:
        return "y is not contiguous along hidden"
    return None


@register_provider("mhc_post", "triton", _triton_post_ok)
def _triton_post(y, res, post, comb, *, batch_invariant):
    from .triton import mhc as tk

    return tk.mhc_post(y, res, post, comb, batch_invariant=batch_invariant)


def _triton_collapse_ok(h, pre, weight, eps, *, batch_invariant):
    return triton_available(h) or _kernel_residual_ok(h)


@register_provider("mhc_collapse", "triton", _triton_collapse_ok)
def _triton_collapse(h, pre, weight, eps, *, batch_invariant):
    from .triton import mhc as tk

    return tk.mhc_collapse(h, pre, weight, eps, batch_invariant=batch_invariant)


def _parts(fn: torch.Tensor, mode: int) -> torch.Tensor:
    from .mhc_weights import bf16x3_parts
    from .registry import static_weights

    return bf16x3_parts(fn, static=static_weights(mode))


def _triton_stats_ok(h, fn, scale, base, iters, hc_eps, norm_eps, *, batch_invariant):
    return triton_available(h) or _kernel_residual_ok(h)


@register_provider("mhc_stats", "triton", _triton_stats_ok, wants_mode=True)
def _triton_stats(h, fn, scale, base, iters, hc_eps, norm_eps, *, batch_invariant, mode):
    from .triton import mhc as tk

    parts = _parts(fn, mode)
    return tk.mhc_stats(h, parts, scale, base, iters, hc_eps, norm_eps, batch_invariant=batch_invariant)


def _triton_pre_ok(h, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *, batch_invariant):
    return triton_available(h) or _kernel_residual_ok(h)


@register_provider("mhc_pre", "triton", _triton_pre_ok, wants_mode=True)
def _triton_pre(h, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *, batch_invariant, mode):
    from .triton import mhc as tk

    parts = _parts(fn, mode)
    return tk.mhc_pre(h, pre_prev, parts, scale, base, weight, iters, hc_eps, norm_eps, eps,
                      batch_invariant=batch_invariant)


def _triton_boundary_ok(y, res, post, comb, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *,
                        batch_invariant):
    return _triton_post_ok(y, res, post, comb, batch_invariant=batch_invariant)


@register_provider("mhc_boundary", "triton", _triton_boundary_ok, wants_mode=True)
def _triton_boundary(y, res, post, comb, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *,
                     batch_invariant, mode):
    from .triton import mhc as tk

    parts = _parts(fn, mode)
    return tk.mhc_boundary(y, res, post, comb, pre_prev, parts, scale, base, weight, iters, hc_eps, norm_eps, eps,
                           batch_invariant=batch_invariant)


def _tilelang_stats_ok(h, fn, scale, base, iters, hc_eps, norm_eps, *, batch_invariant):
    from .registry import tilelang_available

    why = tilelang_available(h)
    if why:
        return why
    from .tilelang import mhc as tlk

    return tlk.unsupported(h)


@register_provider("mhc_stats", "tilelang", _tilelang_stats_ok, wants_mode=True)
def _tilelang_stats(h, fn, scale, base, iters, hc_eps, norm_eps, *, batch_invariant, mode):
    from .tilelang import mhc as tlk

    parts = _parts(fn, mode)
    return tlk.mhc_stats(h, parts, scale, base, iters, hc_eps, norm_eps, batch_invariant=batch_invariant)


# The persistent TileLang mhc_pre (prefill sizes) runs from this token count up, outside batch-invariant
# mode; None keeps it off. It gives the Triton kernel's bits. The whole op with the then default config
# (wg1-split-v2-normwg3; the defaults since runs 181 and 183 are faster, tilelang.mhc_pre.CONFIGS), timed in turn with
# the Triton op on the H200 (ms; run174/175-probe_mhc*.log): 1.331 vs 1.698 at M = 65536, 0.3441 vs 0.4232 at
# 16384, 0.0983 vs 0.1128 at 4096, 0.0507 vs 0.0600 at 2048, 0.0415 vs 0.0524 at 1536, 0.0329 vs 0.0325 at 1024;
# at M = 128 and 1 it is slower (bench_mhc run 175: 0.0230 vs 0.0145, 0.0192 vs 0.0121).
# DSV41_MHC_PRE_TILELANG_MIN_M sets it from the environment ("off": never).
def _env_tokens(name: str, default: str, none_words: tuple[str, ...], hint: str) -> int | None:
    """A token count from the environment, or None for one of ``none_words``; a clear error otherwise."""
    value = os.environ.get(name, default)
    if value.strip().lower() in none_words:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: not a token count or one of {none_words} ({hint})") from None


TILELANG_PRE_MIN_M: int | None = _env_tokens("DSV41_MHC_PRE_TILELANG_MIN_M", "1536", ("off", "none", ""),
                                             "off: the Triton kernel at every M")


def _sm_count(dev: torch.device) -> int | None:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else None


def resident_why(dev: torch.device, cfg: dict) -> str | None:
    """Why the persistent TileLang kernel of ``cfg`` cannot run on ``dev`` (None when it can): a group's 16 CTAs (one a
    K slice), times the ``hi_multicast`` groups of a cluster, wait on one another, so all must be resident at once, one
    an SM; a device with fewer SMs (a MIG slice) has too few."""
    from .mhc_weights import NUM_SLICES

    need, sms = NUM_SLICES * max(1, cfg.get("hi_multicast", 0)), _sm_count(dev)
    if sms is not None and sms < need:
        return f"{sms} SMs: the persistent kernel's config needs {need} CTAs resident at once"
    return None


def _pairs_fit(cfg: dict, dev: torch.device) -> dict:
    """``cfg``, or the same without its CTA clusters (``hi_multicast``) where the 16-SM groups of ``dev`` do not pair
    up (16-31 SMs, or 114 on an H100 PCIe: 7 groups): there the clusters would leave a group idle or not be resident."""
    from .tilelang import mhc_pre as tlp

    mc, sms = cfg.get("hi_multicast", 0), _sm_count(dev)
    if mc and sms is not None and tlp.groups_for(sms) % mc:
        return {k: v for k, v in cfg.items() if k != "hi_multicast"}
    return cfg


def pre_config(dev: torch.device) -> dict:
    """The TileLang mhc_pre's config on ``dev``: ``DEFAULT_CONFIG``, without its CTA clusters where they do not fit."""
    from .tilelang import mhc_pre as tlp

    return _pairs_fit(tlp.DEFAULT_CONFIG, dev)


def _tilelang_pre_ok(h, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *, batch_invariant):
    from .registry import Defer, m_below, tilelang_available

    why = tilelang_available(h)
    if why:
        return why
    if TILELANG_PRE_MIN_M is None:
        return "off (TILELANG_PRE_MIN_M is None; DSV41_MHC_PRE_TILELANG_MIN_M=off)"
    if batch_invariant:
        return "batch-invariant mode runs one kernel at every M (the Triton one)"
    if m_below(h.shape[0], TILELANG_PRE_MIN_M):
        return Defer(f"M = {h.shape[0]} < {TILELANG_PRE_MIN_M} (decode sizes run the Triton kernel)", "triton")
    if weight is None or weight.dtype != torch.float32:
        return "needs the float32 RMSNorm weight"
    if pre_prev.dtype != torch.float32:
        return f"pre_prev dtype {pre_prev.dtype}"
    from .tilelang import mhc_pre as tlp

    return tlp.unsupported(h) or resident_why(h.device, pre_config(h.device))


@register_provider("mhc_pre", "tilelang", _tilelang_pre_ok, wants_mode=True)
def _tilelang_pre(h, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *, batch_invariant, mode):
    from .mhc_weights import bf16x3_slice_parts
    from .registry import static_weights
    from .tilelang import mhc_pre as tlp

    sliced = bf16x3_slice_parts(fn, h.shape[2], static=static_weights(mode))
    return tlp.mhc_pre(h, pre_prev, sliced, scale, base, weight, iters, hc_eps, norm_eps, eps,
                       config=pre_config(h.device))


# The boundary at prefill sizes as the Triton post, then the TileLang mhc_pre on the new residual: it reads the
# residual once more than the Triton boundary's post + collapse kernel, and is still faster where the TileLang
# mhc_pre runs (bench_mhc run 175, ms at M = 65536 / 16384 / 4096: 2.864 / 0.7064 / 0.1924 against 2.971 / 0.7190 /
# 0.1987). The same bits as the Triton boundary (both are the Triton post and mhc_pre's numerics).
def _tilelang_boundary_ok(y, res, post, comb, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *,
                          batch_invariant):
    why = _triton_post_ok(y, res, post, comb, batch_invariant=batch_invariant)
    if why:
        return f"post: {why}"
    return _tilelang_pre_ok(res, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps,
                            batch_invariant=batch_invariant)


def fused_boundary_options(value: str) -> dict | None:
    """``DSV41_MHC_BOUNDARY_FUSED``: "off" (or empty) -> None; "on" -> {}; else a JSON object of
    ``mhc_pre_kernel.build`` options added to the TileLang ``mhc_pre``'s config (e.g. ``{"post_tma_store": true}``)."""
    v = value.strip()
    if v.lower() in ("", "off", "0", "none"):
        return None
    if v.lower() in ("on", "1"):
        return {}
    try:
        opts = json.loads(v)
    except json.JSONDecodeError as e:
        raise ValueError(f"DSV41_MHC_BOUNDARY_FUSED={value!r}: not off, on or a JSON object ({e})") from None
    if not isinstance(opts, dict):
        raise ValueError(f"DSV41_MHC_BOUNDARY_FUSED={value!r}: not off, on or a JSON object")
    return opts


# The post inside the persistent kernel (``tilelang.mhc_pre.mhc_boundary``: the new residual written once, never read
# back), where this provider runs, y is contiguous and M <= FUSED_BOUNDARY_MAX_M (None: no bound); else the Triton
# post, then the TileLang mhc_pre. The same bits either way (GPU tests, runs 182, 184-186). bench_mhc, ms fused /
# post + pre: 0.0758 / 0.0787 at M = 1536, 0.0961 / 0.1000 at 2048, 0.3362 / 0.3508 at 8192, 1.316 / 1.357 at 32768
# (run 184); 0.1746 / 0.1832 at 4096, 0.6628 / 0.6877 at 16384 (run 183). At 65536 the bench disagreed with itself
# (2.815 / 2.703 in run 183, 2.814 / 2.917 in run 186); probe_mhc_boundary's interleaved replays had the fused kernel
# faster at 65536 (2.592 / 2.681 in run 185, 2.588 / 2.676 in run 186) and 49152 (1.954 / 2.020, run 186).
# DSV41_MHC_BOUNDARY_FUSED sets the switch ("off", "on", or a JSON object of build options),
# DSV41_MHC_BOUNDARY_FUSED_MAX_M a bound.
FUSED_BOUNDARY: dict | None = fused_boundary_options(os.environ.get("DSV41_MHC_BOUNDARY_FUSED", "on"))
FUSED_BOUNDARY_MAX_M: int | None = _env_tokens("DSV41_MHC_BOUNDARY_FUSED_MAX_M", "none", ("none", ""),
                                               "none: no bound; DSV41_MHC_BOUNDARY_FUSED=off turns it off")


def fused_boundary_config(dev: torch.device) -> dict | None:
    """The fused boundary kernel's build options on ``dev`` (``BOUNDARY_CONFIG`` and ``FUSED_BOUNDARY``'s, without
    the CTA clusters where they do not fit), None when off."""
    from .tilelang import mhc_pre as tlp

    return None if FUSED_BOUNDARY is None else _pairs_fit(dict(tlp.BOUNDARY_CONFIG, **FUSED_BOUNDARY), dev)


def fused_boundary_at(m: int) -> bool:
    """Whether the TileLang boundary runs the fused kernel at M = m (where the provider runs and y is contiguous)."""
    return FUSED_BOUNDARY is not None and (FUSED_BOUNDARY_MAX_M is None or m <= FUSED_BOUNDARY_MAX_M)


@register_provider("mhc_boundary", "tilelang", _tilelang_boundary_ok, wants_mode=True)
def _tilelang_boundary(y, res, post, comb, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps, *,
                       batch_invariant, mode):
    from .triton import mhc as tk

    fused = fused_boundary_at(res.shape[0]) and y.is_contiguous()
    if fused and resident_why(res.device, config := fused_boundary_config(res.device)) is None:
        from .mhc_weights import bf16x3_slice_parts
        from .registry import static_weights
        from .tilelang import mhc_pre as tlp

        sliced = bf16x3_slice_parts(fn, res.shape[2], static=static_weights(mode))
        return tlp.mhc_boundary(y, res, post, comb, pre_prev, sliced, scale, base, weight, iters, hc_eps, norm_eps, eps,
                                config=config)
    new_res = tk.mhc_post(y, res, post, comb, batch_invariant=batch_invariant)
    return (new_res, *_tilelang_pre(new_res, pre_prev, fn, scale, base, weight, iters, hc_eps, norm_eps, eps,
                                    batch_invariant=batch_invariant, mode=mode))


# warm-up / tuning entries (dsv41_passes.tuning.warmup): lowering/mhc_warmup.py
from .mhc_warmup import tunables  # noqa: E402,F401
