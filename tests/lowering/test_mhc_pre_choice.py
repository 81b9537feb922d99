"""The persistent TileLang ``mhc_pre`` and its fused boundary: which config and which provider run where, on CPU (a
config taken whole, the default from the environment, the providers' thresholds and declines, no guard on M, the
fused boundary's switch, the CTAs a persistent kernel needs resident, the warm-up's entries). Split out of
``test_mhc_pre_tilelang.py`` in the forty-first session."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from dsv41_passes.lowering import registry
from dsv41_passes.lowering.mhc_weights import bf16x3_slice_parts

FLASH_D = 5120
ITERS, HC_EPS, NORM_EPS, EPS = 20, 1e-6, 1e-6, 1e-6


def test_warmup_lists_the_tilelang_kernel_only_where_it_runs():
    from dsv41_passes.lowering import mhc as ops
    from dsv41_passes.reference import DeepseekV41Config

    assert "mhc_pre.tilelang" not in {t.op for t in ops.tunables(DeepseekV41Config.flash(), "cpu")}


def test_configs_are_whole():
    """A config is taken as it is: one without split roles does not inherit them from the default."""
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    assert tlp.DEFAULT_CONFIG.get("split_roles") and not tlp.CONFIGS["wg2-producer"].get("split_roles")
    # the configs not yet run on a GPU are configs, and the default is not one of them
    assert set(tlp.UNMEASURED) <= set(tlp.CONFIGS)
    assert tlp.DEFAULT_CONFIG not in [tlp.CONFIGS[n] for n in tlp.UNMEASURED]
    with pytest.raises(ValueError, match="wgs and stages"):
        tlp.partials(torch.empty(1, 4, FLASH_D, dtype=torch.bfloat16), torch.empty(1, 4), None, None, 1e-6,
                     config={"lag": 1}, groups=1)


def test_default_config_from_the_environment():
    """DSV41_MHC_PRE_TILELANG_CONFIG picks the default among CONFIGS; an unknown name fails at import, naming them."""
    import os
    import sys

    code = ("from dsv41_passes.lowering.tilelang import mhc_pre as t; "
            "print(t.DEFAULT_CONFIG == t.CONFIGS['wg1-split'], "
            "t.DEFAULT_CONFIG is t.CONFIGS['wg1-split-v2-ml-pk-dd-xh-hn3-re-ln-mc'])")
    root = str(Path(__file__).resolve().parents[2])

    def run(value):
        env = dict(os.environ, PYTHONPATH=root)
        env.pop("DSV41_MHC_PRE_TILELANG_CONFIG", None)
        if value is not None:
            env["DSV41_MHC_PRE_TILELANG_CONFIG"] = value
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)

    assert run(None).stdout.split() == ["False", "True"]
    assert run("wg1-split").stdout.split() == ["True", "False"]
    bad = run("wg9")
    assert bad.returncode != 0 and "DSV41_MHC_PRE_TILELANG_CONFIG='wg9'" in bad.stderr and "wg1-split-v2" in bad.stderr


def test_provider_runs_from_its_threshold(monkeypatch):
    """On by default from M = 1536 (measured faster than the Triton op there, level at 1024, slower at decode sizes);
    off when TILELANG_PRE_MIN_M is None; never in batch-invariant mode."""
    from dsv41_passes.lowering import mhc as ops

    if "DSV41_MHC_PRE_TILELANG_MIN_M" not in __import__("os").environ:
        assert ops.TILELANG_PRE_MIN_M == 1536

    monkeypatch.setattr(registry, "tilelang_available", lambda t: None)
    m = 8192
    h = torch.empty(m, 4, FLASH_D, dtype=torch.bfloat16, device="meta")
    args = (h, torch.empty(m, 4, device="meta"), torch.empty(24, 4 * FLASH_D, device="meta"), torch.empty(3),
            torch.empty(24), torch.empty(FLASH_D, device="meta"), ITERS, HC_EPS, NORM_EPS, EPS)
    monkeypatch.setattr(ops, "TILELANG_PRE_MIN_M", None)
    assert "off" in ops._tilelang_pre_ok(*args, batch_invariant=False)
    monkeypatch.setattr(ops, "TILELANG_PRE_MIN_M", 8192)
    assert ops._tilelang_pre_ok(*args, batch_invariant=False) is None
    assert "decode sizes" in ops._tilelang_pre_ok(*(h[:8191], *args[1:]), batch_invariant=False)
    assert "batch-invariant" in ops._tilelang_pre_ok(*args, batch_invariant=True)
    assert "decode sizes" in ops._tilelang_pre_ok(*(h[:100], *args[1:]), batch_invariant=False)
    assert "float32 RMSNorm weight" in ops._tilelang_pre_ok(*args[:5], None, *args[6:], batch_invariant=False)


def test_boundary_provider_follows_the_pre_and_the_post(monkeypatch):
    """The TileLang boundary (Triton post, then the TileLang mhc_pre) runs where both of those would: the pre's
    threshold and batch-invariant rule, the post's input rules; elsewhere the Triton boundary runs."""
    from dsv41_passes.lowering import mhc as ops

    monkeypatch.setattr(registry, "tilelang_available", lambda t: None)
    monkeypatch.setattr(ops, "triton_available", lambda t: None)
    monkeypatch.setattr(ops, "TILELANG_PRE_MIN_M", 4096)
    m = 4096
    meta = dict(device="meta")
    args = [torch.empty(m, FLASH_D, dtype=torch.bfloat16, **meta),
            torch.empty(m, 4, FLASH_D, dtype=torch.bfloat16, **meta),
            torch.empty(m, 4, **meta), torch.empty(m, 4, 4, **meta), torch.empty(m, 4, **meta),
            torch.empty(24, 4 * FLASH_D, **meta), torch.empty(3), torch.empty(24), torch.empty(FLASH_D, **meta),
            ITERS, HC_EPS, NORM_EPS, EPS]
    p, why = registry.choose("mhc_boundary", "tilelang,triton", False, *args)
    assert p.name == "tilelang", why
    p, why = registry.choose("mhc_boundary", "tilelang,triton", True, *args)
    assert p.name == "triton" and "batch-invariant" in why[0]
    small = [a[:4095] if i < 5 else a for i, a in enumerate(args)]
    p, why = registry.choose("mhc_boundary", "tilelang,triton", False, *small)
    assert p.name == "triton" and "decode sizes" in why[0]
    # a decline for speed only: without the Triton provider in the priority, the TileLang one runs there
    p, why = registry.choose("mhc_boundary", "tilelang,reference", False, *small)
    assert p.name == "tilelang" and "runs although" in why[0], why
    p, why = registry.choose("mhc_pre", "tilelang,reference", False, *small[1:2], *small[4:])
    assert p.name == "tilelang" and "runs although" in why[0], why
    p, why = registry.choose("mhc_pre", "tilelang,reference", True, *small[1:2], *small[4:])
    assert p.name == "reference" and "batch-invariant" in why[0], why
    wrong = [args[0].float(), *args[1:]]
    assert "post: y dtype" in ops._tilelang_boundary_ok(*wrong, batch_invariant=False)
    assert "float32 RMSNorm weight" in ops._tilelang_boundary_ok(*args[:8], None, *args[9:], batch_invariant=False)


def test_provider_check_puts_no_guard_on_m(monkeypatch):
    """With the provider on, its M threshold is read without a guard when M is symbolic (compile time)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from dsv41_passes.lowering import mhc as ops

    monkeypatch.setattr(registry, "tilelang_available", lambda t: None)
    monkeypatch.setattr(ops, "TILELANG_PRE_MIN_M", 4096)
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC, DimDynamic.STATIC])
    h = mode.from_tensor(torch.empty(64, 4, FLASH_D, dtype=torch.bfloat16), symbolic_context=ctx)
    before = len(env.guards)
    ops._tilelang_pre_ok(h, torch.empty(64, 4), torch.empty(24, 4 * FLASH_D), torch.empty(3), torch.empty(24),
                         torch.empty(FLASH_D), ITERS, HC_EPS, NORM_EPS, EPS, batch_invariant=False)
    assert len(env.guards) == before, env.guards[before:]
    # and the boundary's check (the post's rules, then the pre's)
    monkeypatch.setattr(ops, "triton_available", lambda t: None)
    ctx2 = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    y = mode.from_tensor(torch.empty(64, FLASH_D, dtype=torch.bfloat16), symbolic_context=ctx2)
    why = ops._tilelang_boundary_ok(y, h, torch.empty(64, 4), torch.empty(64, 4, 4), torch.empty(64, 4),
                                    torch.empty(24, 4 * FLASH_D), torch.empty(3), torch.empty(24), torch.empty(FLASH_D),
                                    ITERS, HC_EPS, NORM_EPS, EPS, batch_invariant=False)
    assert why is None, why  # a symbolic M is not known to be below the threshold: no guard, and no decline
    assert len(env.guards) == before, env.guards[before:]


def test_fused_boundary_switch(monkeypatch):
    """DSV41_MHC_BOUNDARY_FUSED: on by default at every M (DSV41_MHC_BOUNDARY_FUSED_MAX_M sets a bound); "on" or a JSON
    object of build options sends the TileLang boundary through ``mhc_pre.mhc_boundary`` with the mhc_pre default config
    plus those options (the kernel mocked here); a y that is not contiguous, or an M above the bound, keeps the Triton
    post + TileLang mhc_pre; a bad value is a clear error."""
    import os
    import sys

    from dsv41_passes.lowering import mhc as ops
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.lowering.triton import mhc as tk

    assert ops.fused_boundary_options("off") is None and ops.fused_boundary_options("") is None
    assert ops.fused_boundary_options("on") == {}
    assert ops.fused_boundary_options('{"post_tma_store": true}') == {"post_tma_store": True}
    for bad in ("yes", "[1]"):
        with pytest.raises(ValueError, match="DSV41_MHC_BOUNDARY_FUSED"):
            ops.fused_boundary_options(bad)
    code = "from dsv41_passes.lowering import mhc as o; print(o.FUSED_BOUNDARY, o.FUSED_BOUNDARY_MAX_M)"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop("DSV41_MHC_BOUNDARY_FUSED", None)
    env.pop("DSV41_MHC_BOUNDARY_FUSED_MAX_M", None)
    run = subprocess.run
    assert run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout.split() == ["{}", "None"]
    env.update(DSV41_MHC_BOUNDARY_FUSED="off", DSV41_MHC_BOUNDARY_FUSED_MAX_M="32768")
    out = run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    assert out.split() == ["None", "32768"]

    calls = []
    monkeypatch.setattr(tlp, "mhc_boundary", lambda *a, config: calls.append(("fused", config)) or ("fused",))
    monkeypatch.setattr(tk, "mhc_post", lambda *a, **k: calls.append(("post",)) or a[1])
    monkeypatch.setattr(tlp, "mhc_pre", lambda *a, **k: calls.append(("pre",)) or ("x", "pre", "post", "comb"))
    m, d = 8, FLASH_D
    g = torch.Generator().manual_seed(0)
    y = torch.randn(m, d, generator=g).bfloat16()
    args = [y, torch.randn(m, 4, d, generator=g).bfloat16(), torch.rand(m, 4), torch.rand(m, 4, 4), torch.rand(m, 4),
            torch.randn(24, 4 * d, generator=g), torch.ones(3), torch.zeros(24), torch.ones(d), ITERS, HC_EPS,
            NORM_EPS, EPS]
    mode = registry.encode_mode(False)
    monkeypatch.setattr(ops, "FUSED_BOUNDARY_MAX_M", None)
    monkeypatch.setattr(ops, "FUSED_BOUNDARY", None)
    assert ops._tilelang_boundary(*args, batch_invariant=False, mode=mode)[1:] == ("x", "pre", "post", "comb")
    assert calls == [("post",), ("pre",)]
    calls.clear()
    monkeypatch.setattr(ops, "FUSED_BOUNDARY", {"post_tma_store": True})
    assert ops._tilelang_boundary(*args, batch_invariant=False, mode=mode) == ("fused",)
    assert calls == [("fused", dict(tlp.BOUNDARY_CONFIG, post_tma_store=True))]
    calls.clear()
    for bound, fused in ((m, True), (m - 1, False)):  # the bound is inclusive
        monkeypatch.setattr(ops, "FUSED_BOUNDARY_MAX_M", bound)
        ops._tilelang_boundary(*args, batch_invariant=False, mode=mode)
        fused_call = ("fused", dict(tlp.BOUNDARY_CONFIG, post_tma_store=True))
        assert calls == ([fused_call] if fused else [("post",), ("pre",)])
        calls.clear()
    monkeypatch.setattr(ops, "FUSED_BOUNDARY_MAX_M", None)
    strided = torch.randn(m, 2 * d, generator=g).bfloat16()[:, :d]
    ops._tilelang_boundary(strided, *args[1:], batch_invariant=False, mode=mode)
    assert calls == [("post",), ("pre",)]


def test_persistent_kernels_need_their_ctas_resident(monkeypatch):
    """The persistent kernel's CTAs wait on one another, 16 a group, and both configs cluster group pairs
    (hi_multicast 2): on 16 SMs (an H100 MIG 1g slice) the TileLang boundary once ran that kernel, which raised ("got 0
    groups"). Where the groups do not pair up each runs its config without the clusters; below 16 SMs the TileLang
    mhc_pre declines."""
    import types

    from dsv41_passes.lowering import mhc as ops
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp
    from dsv41_passes.lowering.triton import mhc as tk

    sms = [16]
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: types.SimpleNamespace(multi_processor_count=sms[0]))  # read by the kernel wrapper
    monkeypatch.setattr(ops, "_sm_count", lambda dev: sms[0])  # (CPU tensors here)
    monkeypatch.setattr(registry, "tilelang_available", lambda t: None)
    monkeypatch.setattr(ops, "TILELANG_PRE_MIN_M", 8)
    monkeypatch.setattr(ops, "FUSED_BOUNDARY", {})
    monkeypatch.setattr(ops, "FUSED_BOUNDARY_MAX_M", None)
    calls = []
    monkeypatch.setattr(tk, "mhc_post", lambda *a, **k: calls.append("post") or a[1])
    monkeypatch.setattr(tlp, "mhc_pre", lambda *a, **k: calls.append("pre") or ("x", "pre", "post", "comb"))
    m, d = 8, FLASH_D
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(m, d, generator=g).bfloat16(), torch.randn(m, 4, d, generator=g).bfloat16(), torch.rand(m, 4),
            torch.rand(m, 4, 4), torch.rand(m, 4), torch.randn(24, 4 * d, generator=g), torch.ones(3), torch.zeros(24),
            torch.ones(d), ITERS, HC_EPS, NORM_EPS, EPS]
    mode = registry.encode_mode(False)
    monkeypatch.setattr(tlp, "mhc_boundary", lambda *a, config: calls.append(("fused", config)) or ("fused",))
    pre_args = (args[1], *args[4:])
    assert ops._tilelang_pre_ok(*pre_args, batch_invariant=False) is None
    # both configs cluster CTA pairs (hi_multicast 2), only where the 16-SM groups pair up: not on 16-31 SMs or 114
    # (7 groups), where the same config without the clusters runs
    assert tlp.DEFAULT_CONFIG.get("hi_multicast") == 2 and tlp.BOUNDARY_CONFIG.get("hi_multicast") == 2
    dev = torch.device("cuda")
    for sms[0], paired in ((16, False), (31, False), (32, True), (114, False), (132, True)):
        for cfg, full in ((ops.pre_config(dev), tlp.DEFAULT_CONFIG), (ops.fused_boundary_config(dev),
                                                                        tlp.BOUNDARY_CONFIG)):
            assert cfg.get("hi_multicast", 0) == (2 if paired else 0) and ops.resident_why(dev, cfg) is None
            assert {k: v for k, v in cfg.items() if k != "hi_multicast"} == {
                k: v for k, v in full.items() if k != "hi_multicast"}
        assert ops.pre_config(dev) is tlp.DEFAULT_CONFIG or not paired
        calls.clear()  # the fused boundary runs there, with the config of this device
        assert ops._tilelang_boundary(*args, batch_invariant=False, mode=mode) == ("fused",)
        assert calls == [("fused", ops.fused_boundary_config(dev))]
    sms[0] = 16
    monkeypatch.setattr(tlp, "mhc_pre", lambda *a, **k: calls.append(k["config"].get("hi_multicast", 0)) or "x")
    calls.clear()
    assert ops._tilelang_pre(*pre_args, batch_invariant=False, mode=mode) == "x" and calls == [0]
    # where y is strided, the post then the mhc_pre
    calls.clear()
    strided = torch.randn(m, 2 * d, generator=g).bfloat16()[:, :d]
    assert ops._tilelang_boundary(strided, *args[1:], batch_invariant=False, mode=mode)[1:] == ("x",)
    assert calls == ["post", 0]
    sms[0] = 15
    assert "15 SMs" in ops._tilelang_pre_ok(*pre_args, batch_invariant=False)
    from dsv41_passes.reference import DeepseekV41Config

    listed = {}  # the warm-up builds what the op runs
    for sms[0] in (15, 16, 32):
        listed[sms[0]] = {t.op for t in ops.tunables(DeepseekV41Config.flash(), "cpu")} & {
            "mhc_pre.tilelang", "mhc_boundary.tilelang"}
    both = {"mhc_pre.tilelang", "mhc_boundary.tilelang"}
    assert listed == {15: set(), 16: both, 32: both}


def test_ml48_resident_tile_follows_the_parts():
    """An ``ml48`` build takes each stream's mid rows, then its lo rows, as one tile: made once per sliced-parts tensor
    (a weight update builds new parts, so a new one), in inference mode too, and dropped with it."""
    import gc

    from dsv41_passes.lowering import mhc_weights
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    g = torch.Generator().manual_seed(0)
    fn = torch.randn(24, 4 * FLASH_D, generator=g) / 100
    with torch.inference_mode():
        sliced = bf16x3_slice_parts(fn, FLASH_D)
        ml = tlp._mid_lo(sliced)
    assert tuple(ml.shape) == (16, 4, 48, FLASH_D // 16) and ml.is_contiguous()
    assert torch.equal(ml[:, :, :24], sliced[1]) and torch.equal(ml[:, :, 24:], sliced[2])
    assert tlp._mid_lo(sliced) is ml
    fn.mul_(2)  # a weight update: new parts, new slice-major parts, a new tile
    sliced2 = bf16x3_slice_parts(fn, FLASH_D)
    ml2 = tlp._mid_lo(sliced2)
    assert sliced2 is not sliced and torch.equal(ml2[:, :, 24:], sliced2[2]) and not torch.equal(ml2, ml)
    key = ("ml48", id(sliced))
    del sliced, ml
    gc.collect()
    assert key not in mhc_weights._DERIVED
