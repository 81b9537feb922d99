"""The persistent TileLang ``mhc_pre`` (prefill sizes): its weight layout, declines and host wrapper on CPU, and on a
GPU its bits against the Triton kernel (and of its fused boundary against the Triton boundary), its warm-up builds and
its numerics against float64 at V4.1-Flash shapes. Its sm_90a builds: ``test_mhc_pre_builds.py``; which config and
provider run where: ``test_mhc_pre_choice.py``."""

from __future__ import annotations


import pytest
import torch
from mhc_cases import BOUNDARY_OPTS, PRE_CONFIG_NAMES, opts_id

from dsv41_passes.lowering import registry
from dsv41_passes.lowering.mhc_weights import bf16x3_slice_parts, build_parts, cache_info, clear_cache, slice_major

FLASH_D = 5120
ITERS, HC_EPS, NORM_EPS, EPS = 20, 1e-6, 1e-6, 1e-6


# ----------------------------------------------------------------------------- CPU
def test_slice_major_layout():
    d = 64
    fn = torch.randn(24, 4 * d)
    parts = build_parts(fn)
    sl = slice_major(parts, d, 24)
    assert sl.shape == (3, 16, 4, 24, d // 16) and sl.is_contiguous()
    ds = d // 16
    for p, s, k, n, c in [(0, 0, 0, 0, 0), (1, 3, 2, 17, 1), (2, 15, 3, 23, ds - 1), (0, 7, 1, 5, 2)]:
        assert sl[p, s, k, n, c] == parts[p, k * d + s * ds + c, n]
    # the three parts still add up to the fp32 weight, slice by slice
    total = sl[0].float() + sl[1].float() + sl[2].float()  # [16, 4, 24, ds]
    assert torch.equal(total.permute(2, 1, 0, 3).reshape(24, 4 * d), fn)
    with pytest.raises(ValueError, match="do not fit"):
        slice_major(parts, d + 16, 24)


def test_slice_parts_follow_weight_updates():
    clear_cache()
    fn = torch.randn(24, 4 * 64)
    a = bf16x3_slice_parts(fn, 64)
    assert bf16x3_slice_parts(fn, 64) is a
    info = cache_info()
    parts = build_parts(fn)
    assert info["bytes"] == parts.numel() * parts.element_size() + a.numel() * a.element_size()
    with torch.no_grad():
        fn.mul_(2)
    b = bf16x3_slice_parts(fn, 64)
    assert b is not a and torch.equal(b[0].float(), 2 * a[0].float())
    with torch.no_grad():
        fn.add_(1)
    c = bf16x3_slice_parts(fn, 64, static=True)  # a static caller's first call: the weight as it is now
    assert torch.equal(c, slice_major(build_parts(fn), 64, 24))
    with torch.no_grad():
        fn.add_(1)
    with pytest.raises(RuntimeError, match="static_weights"):  # an update after it
        bf16x3_slice_parts(fn, 64, static=True)
    clear_cache()


def test_provider_declines_where_it_cannot_run():
    from dsv41_passes.lowering import mhc as ops

    m = 8
    h = torch.randn(m, 4, 64).bfloat16()
    args = (h, torch.rand(m, 4), torch.randn(24, 256), torch.ones(3), torch.zeros(24), torch.ones(64), ITERS, HC_EPS,
            NORM_EPS, EPS)
    why = ops._tilelang_pre_ok(*args, batch_invariant=False)
    assert why and "CUDA" in why
    p, reasons = registry.choose("mhc_pre", "tilelang,reference", False, *args)
    assert p.name == "reference" and any(r.startswith("tilelang:") for r in reasons)


def test_kernel_rejects_what_it_cannot_run():
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    assert "dtype" in tlp.unsupported(torch.zeros(2, 4, 5120))
    assert "hc_mult" in tlp.unsupported(torch.zeros(2, 2, 5120, dtype=torch.bfloat16))
    assert "32-column chunks" in tlp.unsupported(torch.zeros(2, 4, 256, dtype=torch.bfloat16))
    assert tlp.unsupported(torch.zeros(2, 4, 5120, dtype=torch.bfloat16)) is None
    assert tlp.groups_for(132) == 8 and tlp.groups_for(114) == 7 and tlp.groups_for(8) == 1


@pytest.mark.parametrize("name,boundary", [("wg1-split-v2-ml-pk-dd-xh-hn3", False),
                                           ("wg1-split-v2-ml-pk-dd-xh-hn3-mc", False),
                                           ("wg1-split-v2-ml-pk-dd-xh-hn3-ff", False),
                                           ("wg1-split-v2-normwg3-ws-ml-pk-dd-xh", True)])
def test_host_wrapper_hands_the_kernel_its_tensors(name, boundary, monkeypatch):
    """``partials`` on CPU with the compiled kernel replaced by a recorder: the residual goes in as ``[M, 4 d]``,
    the parts, x and the partial buffers with their shapes, the boundary's y / post / comb / new residual and the
    fused finish's stats after them (a GPU-only path: a wrong view here fails every GPU test, not one CPU test)."""
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    seen = []

    def fake_kernel(d, groups, eps, cfg):
        seen.append(dict(cfg))
        return lambda *args: seen.append([tuple(a.shape) for a in args])

    monkeypatch.setattr(tlp, "_kernel", fake_kernel)
    m, d = 130, 256
    h = torch.randn(m, 4, d).bfloat16()
    sliced = bf16x3_slice_parts(torch.randn(24, 4 * d), d)
    cfg = dict(tlp.CONFIGS[name], **({"boundary": True} if boundary else {}))
    post = (torch.randn(m, d).bfloat16(), torch.rand(m, 4), torch.rand(m, 4, 4)) if boundary else None
    fin = (torch.rand(3), torch.randn(24), ITERS, HC_EPS, NORM_EPS) if cfg.get("fused_finish") else None
    out = tlp.partials(h, torch.rand(m, 4), sliced, torch.rand(d), EPS, config=cfg, groups=8, post=post, finish=fin)
    built, shapes = seen
    nrb = -(-m // 64)
    rows = nrb * 16 * 64
    want = [(m, 4 * d), tuple(sliced[0].shape), (16, 4, 48, d // 16) if cfg.get("ml48") else tuple(sliced[1].shape),
            tuple(sliced[2].shape), (m, 4), (d,), (m, d), (rows, 24), (rows,), (rows + (nrb if fin else 0),)]
    if boundary:
        want += [(m, d), (m, 4), (m, 16), (m, 4 * d)]
    if fin:
        want += [(3,), (24,), (m, 4), (m, 4), (m, 16)]
        assert built["finish_consts"] == (ITERS, HC_EPS, NORM_EPS)
    assert shapes == want
    x = out[1] if boundary else out[0]
    assert x.shape == (m, d) and (out[0].shape == h.shape if boundary else True)
    if fin:
        assert [tuple(t.shape) for t in out[-3:]] == [(m, 4), (m, 4), (m, 4, 4)]


# ----------------------------------------------------------------------------- H200
def _inputs(m: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = 4 * FLASH_D
    kw = dict(generator=g, device="cuda")
    return dict(
        h=torch.randn(m, 4, FLASH_D, **kw).bfloat16(),
        fn=torch.randn(24, k, **kw) / k**0.5,
        scale=torch.rand(3, **kw) + 0.5,
        base=torch.randn(24, **kw) * 0.5,
        pre_prev=torch.rand(m, 4, **kw) + 0.1,
        w=torch.rand(FLASH_D, **kw) + 0.5,
    )


def _skip_without_tilelang():
    why = registry.tilelang_available(torch.empty(0, device="cuda"))
    if why:
        pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("name", PRE_CONFIG_NAMES)
@pytest.mark.parametrize("m", [1, 4096, 4097, 65536])
def test_gpu_matches_the_triton_kernel(m, name):
    """x, pre, post and comb against the Triton mhc_pre; bitwise is the goal (same numerics, n24 instead
    of n32 wgmma); the float64 bounds hold either way (stats: rtol 2e-5 / atol 2e-6, x: 1 bf16 ulp)."""
    _skip_without_tilelang()
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.lowering.triton import mhc as tk

    from mhc_cases import assert_ulps, chunked, mixes64, norm64, normwise, split64

    t = _inputs(m, seed=m)
    parts = build_parts(t["fn"])
    sliced = slice_major(parts, FLASH_D, 24)
    args = (t["scale"], t["base"], t["w"], ITERS, HC_EPS, NORM_EPS, EPS)
    x, pre, post, comb, mixes = tlp.mhc_pre(t["h"], t["pre_prev"], sliced, *args, config=tlp.CONFIGS[name],
                                            mixes=True)
    m64 = chunked(lambda s: mixes64(t["h"][s], t["fn"], NORM_EPS), m)  # this file's eps, not mhc_cases'
    assert normwise(mixes, m64) <= 1e-6
    for out, r in zip((pre, post, comb), split64(m64, t["scale"], t["base"], ITERS, HC_EPS)):
        torch.testing.assert_close(out.double(), r, rtol=2e-5, atol=2e-6)
    xc = tk.mhc_collapse(t["h"], t["pre_prev"], None, EPS, batch_invariant=True)
    assert_ulps(x, chunked(lambda s: norm64(xc[s], t["w"], EPS), m))
    # the Triton kernel with its fixed default (split 1: at decode sizes its untuned config splits K slices)
    ref = tk.mhc_pre(t["h"], t["pre_prev"], parts, *args, batch_invariant=False, config=tk.default_config("mhc_pre"))
    for what, a, b in zip(("x", "pre", "post", "comb"), (x, pre, post, comb), ref):
        assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1536, 4097])
def test_gpu_boundary_provider_matches_the_triton_boundary(m):
    """The op's TileLang boundary (from TILELANG_PRE_MIN_M) gives the Triton boundary's bits: new residual, x and the
    stats."""
    _skip_without_tilelang()
    from dsv41_passes.lowering import mhc as ops

    from mhc_cases import make_inputs

    if ops.TILELANG_PRE_MIN_M is None or m < ops.TILELANG_PRE_MIN_M:
        pytest.skip(f"the TileLang provider starts at {ops.TILELANG_PRE_MIN_M}")
    t = make_inputs(m, FLASH_D, seed=m, device="cuda")
    args = (t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], t["fn"], t["scale"], t["base"], t["w"], ITERS, HC_EPS,
            NORM_EPS, EPS)
    mode = registry.encode_mode(False)
    p, why = registry.choose("mhc_boundary", "tilelang,triton", False, *args)
    assert p.name == "tilelang", why
    got = torch.ops.dsv41.mhc_boundary(*args, "tilelang,triton", mode)
    ref = torch.ops.dsv41.mhc_boundary(*args, "triton", mode)
    for what, a, b in zip(("new residual", "x", "pre", "post", "comb"), got, ref):
        assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("opts", BOUNDARY_OPTS, ids=opts_id)
@pytest.mark.parametrize("m", [1, 1536, 4097, 65536])
def test_gpu_fused_boundary_matches_the_triton_boundary(m, opts):
    """``mhc_pre.mhc_boundary`` (the post inside the persistent kernel) gives the Triton boundary's bits: the new
    residual, x and the stats."""
    _skip_without_tilelang()
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.lowering.triton import mhc as tk

    from mhc_cases import make_inputs

    t = make_inputs(m, FLASH_D, seed=m, device="cuda")
    parts = build_parts(t["fn"])
    sliced = slice_major(parts, FLASH_D, 24)
    args = (t["scale"], t["base"], t["w"], ITERS, HC_EPS, NORM_EPS, EPS)
    got = tlp.mhc_boundary(t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], sliced, *args,
                           config=dict(tlp.BOUNDARY_CONFIG, **opts))
    ref = tk.mhc_boundary(t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], parts, *args, batch_invariant=False,
                          config=dict(tk.default_config("mhc_boundary"), form="post_pre"))
    for what, a, b in zip(("new residual", "x", "pre", "post", "comb"), got, ref):
        assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} of {a.numel()} differ"


@pytest.mark.gpu
@pytest.mark.parametrize("opts", [None, {}, {"post_tma_store": True}])
@pytest.mark.parametrize("m", [1536, 4097])
def test_gpu_fused_boundary_provider_matches_the_triton_boundary(m, opts, monkeypatch):
    """With ``FUSED_BOUNDARY`` set (DSV41_MHC_BOUNDARY_FUSED) the op's TileLang boundary runs the post inside the
    persistent kernel, with the Triton boundary's bits, and builds that kernel once for every M; off (None), the
    Triton post then the TileLang mhc_pre, with the same bits."""
    _skip_without_tilelang()
    from dsv41_passes.lowering import mhc as ops
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    from mhc_cases import make_inputs

    if ops.TILELANG_PRE_MIN_M is None or m < ops.TILELANG_PRE_MIN_M:
        pytest.skip(f"the TileLang provider starts at {ops.TILELANG_PRE_MIN_M}")
    monkeypatch.setattr(ops, "FUSED_BOUNDARY", opts)
    monkeypatch.setattr(ops, "FUSED_BOUNDARY_MAX_M", None)
    mode = registry.encode_mode(False)
    built, start = [], set(tlp._KERNELS)  # (kernels of earlier tests stay cached in this process)
    for mm in (m, m + 1):
        t = make_inputs(mm, FLASH_D, seed=mm, device="cuda")
        args = (t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], t["fn"], t["scale"], t["base"], t["w"], ITERS,
                HC_EPS, NORM_EPS, EPS)
        got = torch.ops.dsv41.mhc_boundary(*args, "tilelang,triton", mode)
        ref = torch.ops.dsv41.mhc_boundary(*args, "triton", mode)
        for what, a, b in zip(("new residual", "x", "pre", "post", "comb"), got, ref):
            assert torch.equal(a, b), f"M {mm} {what}: {(a != b).sum().item()} of {a.numel()} differ"
        built.append(set(tlp._KERNELS))
    if opts is None:
        assert not any(dict(k[3]).get("boundary") for k in built[0] - start)  # no fused kernel built
    else:
        opts_key = dict(tlp.BOUNDARY_CONFIG, boundary=True, **opts)
        opts_key.setdefault("lag", tlp.LAG)
        assert any(k[3] == tuple(sorted(opts_key.items())) for k in built[0])  # the fused kernel ran
    assert built[1] == built[0]  # and the next M built nothing


@pytest.mark.gpu
def test_gpu_warmup_builds_the_tilelang_kernel():
    """The warm-up's TileLang entry builds the op's kernel (the default config, the model's eps) at the first bucket
    from the threshold and nothing below it; the op then adds no binary."""
    _skip_without_tilelang()
    from dsv41_passes.lowering import mhc as ops
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.reference import DeepseekV41Config

    if ops.TILELANG_PRE_MIN_M is None:
        pytest.skip("the TileLang mhc_pre is off")
    cfg = DeepseekV41Config.flash()
    (t,) = [t for t in ops.tunables(cfg, "cuda") if t.op == "mhc_pre.tilelang"]
    assert t.candidates == [tlp.DEFAULT_CONFIG] and t.untuned(65536) is tlp.DEFAULT_CONFIG
    tlp._KERNELS.clear()
    assert t.run(t.make_inputs(ops.TILELANG_PRE_MIN_M - 1, "cuda"), t.default) is None and not tlp._KERNELS
    t.run(t.make_inputs(ops.TILELANG_PRE_MIN_M, "cuda"), t.default)
    assert len(tlp._KERNELS) == 1
    m = 4096
    h = torch.randn(m, cfg.hc_mult, cfg.hidden_size, device="cuda").bfloat16()
    fn = torch.randn(cfg.mix_hc, cfg.hc_mult * cfg.hidden_size, device="cuda") / 100
    args = (h, torch.rand(m, cfg.hc_mult, device="cuda"), fn, torch.ones(3, device="cuda"),
            torch.zeros(cfg.mix_hc, device="cuda"), torch.ones(cfg.hidden_size, device="cuda"), cfg.hc_sinkhorn_iters,
            cfg.hc_eps, cfg.rms_norm_eps, cfg.rms_norm_eps)
    p, why = registry.choose("mhc_pre", "tilelang,triton", False, *args)
    assert p.name == "tilelang", why
    torch.ops.dsv41.mhc_pre(*args, "tilelang,triton", registry.encode_mode(False))
    assert len(tlp._KERNELS) == 1


@pytest.mark.gpu
def test_gpu_warmup_builds_the_fused_boundary_where_it_is_on(monkeypatch):
    """With ``FUSED_BOUNDARY`` set the warm-up lists the fused boundary's build and makes it at the threshold (none
    below, none above ``FUSED_BOUNDARY_MAX_M``); off, or with the bound below the threshold, it lists none."""
    _skip_without_tilelang()
    from dsv41_passes.lowering import mhc as ops
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.reference import DeepseekV41Config

    if ops.TILELANG_PRE_MIN_M is None:
        pytest.skip("the TileLang mhc_pre is off")
    cfg = DeepseekV41Config.flash()
    monkeypatch.setattr(ops, "FUSED_BOUNDARY", None)
    assert "mhc_boundary.tilelang" not in {t.op for t in ops.tunables(cfg, "cuda")}
    monkeypatch.setattr(ops, "FUSED_BOUNDARY", {"post_tma_store": True})
    monkeypatch.setattr(ops, "FUSED_BOUNDARY_MAX_M", ops.TILELANG_PRE_MIN_M - 1)
    assert "mhc_boundary.tilelang" not in {t.op for t in ops.tunables(cfg, "cuda")}
    monkeypatch.setattr(ops, "FUSED_BOUNDARY_MAX_M", ops.TILELANG_PRE_MIN_M)
    (t,) = [t for t in ops.tunables(cfg, "cuda") if t.op == "mhc_boundary.tilelang"]
    assert t.default == dict(tlp.BOUNDARY_CONFIG, post_tma_store=True)
    tlp._KERNELS.clear()
    assert t.run(t.make_inputs(ops.TILELANG_PRE_MIN_M - 1, "cuda"), t.default) is None and not tlp._KERNELS
    assert t.run(t.make_inputs(ops.TILELANG_PRE_MIN_M + 1, "cuda"), t.default) is None and not tlp._KERNELS
    t.run(t.make_inputs(ops.TILELANG_PRE_MIN_M, "cuda"), t.default)
    assert [dict(k[3]).get("boundary") for k in tlp._KERNELS] == [True]


@pytest.mark.gpu
def test_gpu_one_binary_for_every_m_and_rows_independent():
    """One compiled kernel per config for every token count; a row's result never depends on M."""
    _skip_without_tilelang()
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    n = 20000
    t = _inputs(n, seed=3)
    sliced = slice_major(build_parts(t["fn"]), FLASH_D, 24)
    args = (t["scale"], t["base"], t["w"], ITERS, HC_EPS, NORM_EPS, EPS)
    full = tlp.mhc_pre(t["h"], t["pre_prev"], sliced, *args)
    before = len(tlp._KERNELS)
    for i, mm in ((0, 1), (5, 63), (64, 65), (9999, 4097), (n - 129, 129)):
        part = tlp.mhc_pre(t["h"][i:i + mm], t["pre_prev"][i:i + mm], sliced, *args)
        for a, b in zip(full, part):
            assert torch.equal(a[i:i + mm], b), (i, mm)
    assert len(tlp._KERNELS) == before
