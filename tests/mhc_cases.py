"""mHC kernel test cases shared by ``tests/lowering/test_mhc_kernel*.py`` and ``test_mhc_pre_tilelang.py``: inputs,
float64 oracles, the bf16-ulp and bitwise assertions, and runners of the Triton ops with the test's constants."""

from __future__ import annotations

import os

import torch

from dsv41_passes.lowering.mhc_weights import build_parts
from dsv41_passes.lowering.triton import mhc as tk
from dsv41_passes.reference import mhc as ref

BF16 = torch.bfloat16
# the three eps apart (sinkhorn/pre, the stats' RMS, the collapse's norm): an op that passes one for another changes
# its results past the tests' bounds
ITERS, HC_EPS, NORM_EPS, EPS = 20, 1e-3, 1e-2, 1e-4
DEV = "cuda" if torch.cuda.is_available() else "cpu"
D = 256 if DEV == "cuda" else 64  # small hidden: tensor-core chunks need hidden/16 % 16 == 0 on a GPU
FLASH_D = 5120
GPU_MS = [1, 7, 4096, 4097, 16384, 65536]
# the TileLang mhc_pre configs its sm_90a build and GPU bit tests cover (``mhc_pre.CONFIGS`` but the mid-streamed ones)
PRE_CONFIG_NAMES = ["wg1", "wg2", "wg1-producer", "wg2-producer", "wg1x2-producer", "wg1-split", "wg1-split-v2",
                    "wg1-split-v2-xhints", "wg1-split-v2-normwg", "wg1-split-v2-normwg3", "wg1-split-v2-normwg3-ws",
                    "wg1-split-v2-normwg3-ws-pp", "wg1-split-v2-normwg3-ws-dd", "wg1-split-v2-normwg3-ws-xh",
                    "wg1-split-v2-normwg3-ws-xr", "wg1-split-v2-normwg3-ws-pk", "wg1-split-v2-normwg3-ws-ml",
                    "wg1-split-v2-normwg3-ws-ml-pk-dd", "wg1-split-v2-normwg3-ws-ml-pk-dd-xh",
                    "wg1-split-v2-ml-pk-dd-xh-hn1", "wg1-split-v2-ml-pk-dd-xh-hn2", "wg1-split-v2-ml-pk-dd-xh-hn3",
                    "wg1-split-v2-ml-pk-dd-xh-hn4", "wg1-split-v2-ml-pk-dd-xh-hn5", "wg1-split-v2-ml-pk-dd-xh-hn6",
                    "wg1-split-v2-ml-pk-dd-xh-hn3-pp", "wg1-split-v2-ml-pk-dd-xh-hn3-mc",
                    "wg1-split-v2-ml-pk-dd-xh-hn3-mc4", "wg1-split-v2-ml-pk-dd-xh-hn3-ff",
                    "wg1-split-v2-ml-pk-dd-xh-hn3-mc-ff", "wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc",
                    "wg1-split-v2-ml-pk-dd-xh-hn3-re", "wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re",
                    "wg1-split-v2-ml-pk-dd-xh-hn3-re-mc", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln",
                    "wg1-split-v2-ml-pk-dd-hn3-re-ln", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc",
                    "wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ms5",
                    "wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ms5", "wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1",
                    "wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1-ln",
                    "wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1-ln-pe",
                    "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-fp", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-om",
                    "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-oa", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-ff"]
# the configs whose sm_90a build CI checks (``test_mhc_pre_builds.py``, about 13 s each on a CI core): the defaults
# (the mhc_pre's with and without its CTA pairs, the fused boundary's), each structural step (one or two warpgroups,
# a producer, two rings, split roles with one vector warpgroup, two normalizing warps) and configs that together take
# every build option of PRE_CONFIG_NAMES at each of its values (``test_build_configs_take_every_option``);
# DSV41_TEST_ALL_BUILDS=1 builds every one of PRE_CONFIG_NAMES
BUILD_CONFIG_NAMES = PRE_CONFIG_NAMES if os.environ.get("DSV41_TEST_ALL_BUILDS") else [
    "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln",
    "wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1-ln", "wg1-split-v2-normwg3-ws-ml-pk-dd-xh-mc-re-ve-lg1-ln-pe",
    "wg1", "wg2", "wg1-producer", "wg2-producer", "wg1x2-producer", "wg1-split", "wg1-split-v2-xhints",
    "wg1-split-v2-normwg", "wg1-split-v2-normwg3-ws-pp", "wg1-split-v2-normwg3-ws-xr",
    "wg1-split-v2-ml-pk-dd-xh-hn1", "wg1-split-v2-ml-pk-dd-xh-hn2", "wg1-split-v2-ml-pk-dd-xh-hn4",
    "wg1-split-v2-ml-pk-dd-xh-hn5", "wg1-split-v2-ml-pk-dd-xh-hn6", "wg1-split-v2-ml-pk-dd-xh-hn3-pp",
    "wg1-split-v2-ml-pk-dd-xh-hn3-mc4", "wg1-split-v2-ml-pk-dd-xh-hn3-ff", "wg1-split-v2-ml-pk-dd-xh-hn3-mc-ff",
    "wg1-split-v2-ml-pk-dd-hn3-re-ln", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ms5",
    "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-fp", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-om",
    "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-oa", "wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc-ff"]
# the fused boundary's build options its build and GPU tests take on its config (BOUNDARY_CONFIG: it has hi_multicast
# 2, dots_defer, packed_cvt, ml48, vec_release_early, lag 1 and its loads under the normal L2 policy; lag 2, the
# config of runs 207-217; the evict-first loads of runs 191-230; the multicast off,
# and with it each of the others the multicast needs)
BOUNDARY_OPTS = [{}, {"post_tma_store": True}, {"packed_cvt": False}, {"dots_release_early": False},
                 {"post_prefetch": 2}, {"post_store_late": True}, {"vec_release_early": False}, {"lag": 2},
                 {"ml_stream": True, "stages": 5}, {"hi_multicast": 0}, {"loads_evict_first": True},
                 {"post_evict_first": True},
                 {"hi_multicast": 0, "dots_defer": False, "dots_release_early": False},
                 {"hi_multicast": 0, "ml48": False},
                 {"hi_multicast": 0, "held_norm": 2, "norm_wg": False, "norm_w_smem": False, "lag": 2}]


def opts_id(opts: dict) -> str:
    """A test id for build options (``-k hi_multicast`` selects the cluster build's tests)."""
    return "-".join(f"{k}={v}" for k, v in opts.items()) or "default"


def chunked(fn, n, step=2048):
    """fn over row slices of at most ``step`` rows, concatenated (float64 oracles of large M in pieces)."""
    return torch.cat([fn(slice(i, min(i + step, n))) for i in range(0, n, step)]) if n else fn(slice(0, 0))


# ----------------------------------------------------------------------------- inputs and float64 oracles
def make_inputs(m: int, d: int, seed: int = 0, device: str = DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    k = 4 * d
    kw = dict(generator=g, device=device)
    return dict(
        h=torch.randn(m, 4, d, **kw).to(BF16),
        fn=torch.randn(24, k, **kw) / k**0.5,
        scale=torch.rand(3, **kw) + 0.5,
        base=torch.randn(24, **kw) * 0.5,
        y=torch.randn(m, d, **kw).to(BF16),
        pre_prev=torch.rand(m, 4, **kw) + 0.1,
        post=2 * torch.rand(m, 4, **kw),
        comb=ref.sinkhorn(torch.randn(m, 4, 4, **kw), ITERS, HC_EPS),
        w=torch.rand(d, **kw) + 0.5,
    )


def mixes64(h, fn, norm_eps=NORM_EPS):
    xf = h.flatten(1).double()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    return (xf @ fn.double().T) * rstd


def split64(mix, scale, base, iters=ITERS, hc_eps=HC_EPS):
    s, b = scale.double(), base.double()
    pre = torch.sigmoid(mix[:, :4] * s[0] + b[:4]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, 4:8] * s[1] + b[4:8])
    c = (mix[:, 8:] * s[2] + b[8:]).unflatten(-1, (4, 4)).softmax(-1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return pre, post, c


def collapse64(h, pre):
    return (pre.double().unsqueeze(-1) * h.double()).sum(1)


def norm64(x_bf16, w, eps=EPS):
    xf = x_bf16.double()
    return w.double() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))


def post64(y, res, post, comb):
    return post.double().unsqueeze(-1) * y.double().unsqueeze(1) + (
        comb.double().unsqueeze(-1) * res.double().unsqueeze(2)
    ).sum(1)


def bf16_ulp(x64):
    return torch.exp2(torch.floor(torch.log2(x64.abs().clamp_min(2.0**-126))) - 7)


def assert_ulps(out, ref64, ulps=1.0, terms=None):
    """Within ``ulps`` bf16 ulp of the float64 value; where the terms of an fp32 sum cancel (``terms`` =
    the sum of their magnitudes), the fp32 accumulation error (<= 2^-22 of it for a handful of
    terms) is allowed on top: no fp32 kernel, eager torch included, can do better there."""
    err = (out.double() - ref64).abs()
    bound = ulps * bf16_ulp(ref64)
    if terms is not None:
        bound = bound + terms * 2.0**-22
    ratio = err / bound
    worst = ratio.max().item() if err.numel() else 0.0
    if worst > 1.0:
        i = tuple(int(v) for v in torch.unravel_index(ratio.argmax(), ratio.shape))
        raise AssertionError(f"max error {worst:.3f} x the bound ({ulps} bf16 ulp + fp32 term rounding) at {i}: "
                             f"got {out[i].item()!r}, float64 {ref64[i].item()!r}, "
                             f"{(ratio > 1).sum().item()} of {ratio.numel()} elements over")


def collapse_terms64(h, pre):
    return (pre.double().unsqueeze(-1) * h.double()).abs().sum(1)


def post_terms64(y, res, post, comb):
    return (post.double().unsqueeze(-1) * y.double().unsqueeze(1)).abs() + (
        comb.double().unsqueeze(-1) * res.double().unsqueeze(2)
    ).abs().sum(1)


def normwise(out, ref64):
    return ((out.double() - ref64).norm() / ref64.norm()).item()


def assert_equal(a, b, what=""):
    assert a.shape == b.shape and torch.equal(a, b), f"{what}: {(a != b).sum().item()} elements differ"


def with_cancellation(t):
    """Streams 0 and 1 nearly cancel in the collapse, so its fp32 summation order shows in the bf16 bits."""
    g = torch.Generator(device=t["h"].device).manual_seed(1)
    h, p = t["h"].clone(), t["pre_prev"].clone()
    h[:, 1] = (-h[:, 0].float() * (1 + torch.rand(h[:, 0].shape, generator=g, device=h.device) * 0.01)).to(BF16)
    p[:, :2] = 1 + torch.rand(p.shape[0], 2, generator=g, device=p.device) * 1e-3
    p[:, 2:] *= 1e-2
    return dict(t, h=h, pre_prev=p)


# ----------------------------------------------------------------------------- runners
def stats(t, **kw):
    return tk.mhc_stats(t["h"], build_parts(t["fn"]), t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS,
                        batch_invariant=kw.pop("bi", True), **kw)


def pre_op(t, weight="w", **kw):
    return tk.mhc_pre(t["h"], t["pre_prev"], build_parts(t["fn"]), t["scale"], t["base"],
                      t[weight] if weight else None, ITERS, HC_EPS, NORM_EPS, EPS,
                      batch_invariant=kw.pop("bi", True), **kw)


def boundary_op(t, weight="w", **kw):
    return tk.mhc_boundary(t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], build_parts(t["fn"]), t["scale"],
                           t["base"], t[weight] if weight else None, ITERS, HC_EPS, NORM_EPS, EPS,
                           batch_invariant=kw.pop("bi", True), **kw)


def collapse_op(t, weight="w", **kw):
    return tk.mhc_collapse(t["h"], t["pre_prev"], t[weight] if weight else None, EPS,
                           batch_invariant=kw.pop("bi", True), **kw)


def post_op(t, **kw):
    return tk.mhc_post(t["y"], t["h"], t["post"], t["comb"], batch_invariant=kw.pop("bi", True), **kw)


def check_stats_numerics(t, mixes, pre, post, comb):
    m64 = mixes64(t["h"], t["fn"])
    err = normwise(mixes, m64)
    assert err <= 1e-6, f"mixes normwise relative error {err:.3e}"
    for name, out, r in zip(("pre", "post", "comb"), (pre, post, comb), split64(m64, t["scale"], t["base"])):
        torch.testing.assert_close(out.double(), r, rtol=2e-5, atol=2e-6, msg=lambda s: f"{name}: {s}")


def check_collapse_numerics(t, x_plain, x_normed):
    """Collapse: one rounding of the exact value (almost always the correctly rounded one). Norm: one
    rounding of the float64 norm of that bf16 collapse (the reference rounds the collapse first)."""
    c64 = collapse64(t["h"], t["pre_prev"])
    assert_ulps(x_plain, c64, 1.0)
    assert (x_plain == c64.to(BF16)).double().mean().item() > 0.999
    assert_ulps(x_normed, norm64(x_plain, t["w"]), 1.0)
