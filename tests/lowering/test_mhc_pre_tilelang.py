"""The persistent TileLang ``mhc_pre`` (prefill sizes): its weight layout and provider rules on CPU, its
sm_90a build (nvcc, no GPU), and on an H200 its bits against the Triton kernel and its numerics against
float64 at V4.1-Flash shapes."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

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
    with pytest.raises(RuntimeError, match="static_weights"):
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


@pytest.mark.parametrize("name", ["wg1", "wg2", "wg1-producer", "wg2-producer", "wg1x2-producer", "wg1-split",
                                  "wg1-split-v2", "wg1-split-v2-xhints", "wg1-split-v2-normwg",
                                  "wg1-split-v2-normwg3", "wg1-split-v2-normwg3-ws",
                                  "wg1-split-v2-normwg3-ws-pp", "wg1-split-v2-normwg3-ws-dd",
                                  "wg1-split-v2-normwg3-ws-xh", "wg1-split-v2-normwg3-ws-xr"])
def test_compiles_for_sm90a(name, tmp_path, monkeypatch):
    """The sm_90a build: one wgmma shape (m64n24k16, the 24 mix columns unpadded), rounding spelled out
    (no contraction: nvcc --fmad=false and explicit __f*_rn), the residual loads by TMA with the
    evict-first hint, no register spills, and the shared memory within the 227 KiB an SM gives a block.
    With a producer warpgroup: warp 0 alone issues the copies, each stage's reuse waits for the consumers'
    release, and after the set-up no barrier takes the whole CTA. With two stage rings: warp 1 fills the second,
    and each consumer warpgroup has a loop of its own (its own wgmma, 12 a step). With split roles: warpgroup 1
    issues every wgmma, warpgroup 2 stores x and publishes the norm partials."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    cfg = tlp.CONFIGS[name]
    producer = cfg.get("producer", False)
    rings = cfg.get("rings", 1)
    split = cfg.get("split_roles", False)
    k = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **cfg), producer)
    src = k.get_kernel_source()
    if producer:
        assert src.count("__syncthreads()") == 1  # the barriers' initialization
        assert "if (((int)threadIdx.x) < 32) {" in src and "tl_shuffle_elect<32>" in src
        assert "tl_shuffle_elect<128>" not in src and "tl_shuffle_elect<256>" not in src
        if rings == 1:
            assert f"empty[(q & {cfg['stages'] - 1})].wait(" in src and "].arrive();" in src
        else:  # warp w waits on ring w's stages
            assert "if (((int)threadIdx.x) < 64) {" in src
            assert "empty[(((((int)threadIdx.x) >> 5) * 2) + (q & 1))].wait(" in src
            assert "if (((int)threadIdx.x) < 256) {" in src and "if (256 <= ((int)threadIdx.x)) {" in src
        # two consumer warpgroups (384 threads) need registers moved to them; one (256) has them already, and
        # with three (512) each role keeps the launch's 128
        vec_wgs = cfg.get("vec_wgs", 1)
        assert ("warpgroup_reg_alloc<240>" in src) == (cfg["wgs"] * rings * (1 + vec_wgs if split else 1) == 2)
        assert "warpgroup_reg_alloc" not in src or vec_wgs == 1
        if split:
            dots, rest = src.split("if (256 <= ((int)threadIdx.x)) {")
            assert "if (((int)threadIdx.x) < 256) {" in dots and "wgmma_ss<" not in rest
            assert "AtomicStore" in rest and "AtomicStore" not in dots.split("if (((int)threadIdx.x) < 256) {")[1]
            # two vector warpgroups: 512 threads, four a row, the runs' sums paired across lanes 1 then 2 apart
            assert f"__launch_bounds__({256 + 128 * vec_wgs}" in src
            lanes = set(re.findall(r"__shfl_xor_sync\([^,]*, [^,]*, (\d+)", rest))
            assert lanes == ({"1", "2"} if vec_wgs == 2 else {"1"}), lanes
    if cfg.get("norm_wg"):  # warps 2-3 (or 1-3) alone poll the norm partials; the vector role hands blocks over, back
        front, vector = src.split("if (256 <= ((int)threadIdx.x)) {")
        first = 128 - 32 * cfg.get("norm_warps", 2)
        polls = 3 if cfg.get("norm_prepoll") else 1  # with norm_prepoll: before xdone, a pass ahead, and the re-poll
        if cfg.get("xss_by_row"):  # a row's 16 partials as four 16-byte relaxed loads (and the helper's definition)
            poll = "dsv41_ld4_relaxed(("
            assert "AtomicLoad" not in src and src.count(poll) == polls and "ld.relaxed.gpu.global.v4.f32" in src
        else:
            poll = "AtomicLoad"
            assert src.count(poll) == polls
        assert f"if ({first} <= ((int)threadIdx.x)) {{" in front.split(poll)[0]
        assert "xdone[" in vector and "].arrive();" in vector and "xfree[" in vector and "].wait(" in vector
        # their weights: from the consumers' shared copy with norm_w_smem (nw is then read once, into w_s)
        assert ("(nw + " in front) != bool(cfg.get("norm_w_smem")) and src.count(" = nw[") == 1
    if cfg.get("x_hints"):  # the plain x stores, once in the step and in the lagged norm (in and after the loop) or
        # the normalizing warps' pass, through the hinted helpers
        assert "createpolicy.fractional.L2::" in src and "st.global.L2::cache_hint.v4.b32" in src
        firsts = 1 if cfg.get("norm_wg") else 2
        assert src.count("dsv41_st16_evict_last(") == 1 and src.count("dsv41_st16_evict_first(") == firsts
    if cfg.get("norm_wg"):
        assert ("dsv41_st16_evict_first(" in front) == bool(cfg.get("x_hints"))  # (front: the normalizing warps)
    shapes = set(re.findall(r"wgmma_ss<[^>]*kFloat32, (\d+), (\d+), (\d+),", src))
    assert shapes == {("64", "24", "16")}, shapes
    waits = re.findall(r"tl::wait_wgmma<(\d)>", src)
    if cfg.get("dots_defer"):  # streams 1-3's chains of a step in flight into the next; all waited at a block's end
        assert src.count("wgmma_ss<") == 12 and waits == ["6", "0"], waits
        dots = src[src.index("if (((int)threadIdx.x) < 256) {"):src.index("if (256 <= ((int)threadIdx.x)) {")]
        issued = re.findall(r"\(\(uint32_t\*\)\((\w+) \+ 0\)\)", dots)  # the accumulator of each wgmma, in order
        assert issued[:4] == ["sh0", "sh1", "sh2", "sh3"] and issued[4:] == ["acc_mid", "acc_lo"] * 4, issued
        assert dots.count("((c == 0) ? 0 : 1)") == 2  # a row block's chains start from zero by stream 0's scale-d
    else:
        assert src.count("wgmma_ss<") == 12 * rings and waits == ["0"] * rings  # 4 streams x 3 parts, one wait a step
    assert "tma_load<tl::CacheHintSm90::EVICT_FIRST>(h_desc" in src
    assert "__fmaf_rn" in src and "__fdiv_rn" in src and "__fsqrt_rn" in src
    offsets = [int(v) for v in re.findall(r"buf_dyn_shmem \+ (\d+)\)", src)]
    assert max(offsets) < 227 * 1024
    cubins = list(Path(tmp_path).rglob("*.cubin"))
    tool = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if cubins and tool.exists():
        out = subprocess.run([str(tool), "--dump-resource-usage", str(cubins[0])], capture_output=True, text=True)
        usage = dict(re.findall(r"\b(REG|STACK):(\d+)", out.stdout))
        assert usage and int(usage["STACK"]) == 0 and int(usage["REG"]) <= 255, usage
        # the wgmmas stay asynchronous: one warpgroup barrier a wait in the source; where ptxas cannot keep them in
        # flight (too few registers, accumulators touched while in flight: C7512-C7518) it puts one after each
        sass = subprocess.run([str(tool), "-sass", str(cubins[0])], capture_output=True, text=True).stdout
        assert sass.count("HGMMA.64x24x16") == 2 * src.count("wgmma_ss<")  # two k16 steps a 32-column chunk
        assert sass.count("WARPGROUP.DEPBAR") == len(waits), (sass.count("WARPGROUP.DEPBAR"), len(waits))


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
@pytest.mark.parametrize("name", ["wg1", "wg2", "wg1-producer", "wg2-producer", "wg1x2-producer", "wg1-split",
                                  "wg1-split-v2", "wg1-split-v2-xhints", "wg1-split-v2-normwg",
                                  "wg1-split-v2-normwg3", "wg1-split-v2-normwg3-ws",
                                  "wg1-split-v2-normwg3-ws-pp", "wg1-split-v2-normwg3-ws-dd",
                                  "wg1-split-v2-normwg3-ws-xh", "wg1-split-v2-normwg3-ws-xr"])
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
    m64 = chunked(lambda s: mixes64(t["h"][s], t["fn"]), m)
    assert normwise(mixes, m64) <= 1e-6
    for out, r in zip((pre, post, comb), split64(m64, t["scale"], t["base"])):
        torch.testing.assert_close(out.double(), r, rtol=2e-5, atol=2e-6)
    xc = tk.mhc_collapse(t["h"], t["pre_prev"], None, EPS, batch_invariant=True)
    assert_ulps(x, chunked(lambda s: norm64(xc[s], t["w"]), m))
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


def test_warmup_lists_the_tilelang_kernel_only_where_it_runs():
    from dsv41_passes.lowering import mhc as ops
    from dsv41_passes.reference import DeepseekV41Config

    assert "mhc_pre.tilelang" not in {t.op for t in ops.tunables(DeepseekV41Config.flash(), "cpu")}


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


def test_configs_are_whole():
    """A config is taken as it is: one without split roles does not inherit them from the default."""
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    assert tlp.DEFAULT_CONFIG.get("split_roles") and not tlp.CONFIGS["wg2-producer"].get("split_roles")
    with pytest.raises(ValueError, match="wgs and stages"):
        tlp.partials(torch.empty(1, 4, FLASH_D, dtype=torch.bfloat16), torch.empty(1, 4), None, None, 1e-6,
                     config={"lag": 1}, groups=1)


def test_default_config_from_the_environment():
    """DSV41_MHC_PRE_TILELANG_CONFIG picks the default among CONFIGS; an unknown name fails at import, naming them."""
    import os
    import sys

    code = ("from dsv41_passes.lowering.tilelang import mhc_pre as t; "
            "print(t.DEFAULT_CONFIG == t.CONFIGS['wg1-split'], "
            "t.DEFAULT_CONFIG is t.CONFIGS['wg1-split-v2-normwg3-ws'])")
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


def test_two_vector_warpgroups_need_split_roles():
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    pytest.importorskip("tilelang")
    with pytest.raises(ValueError, match="two vector warpgroups need split roles"):
        tlp.build(FLASH_D, 8, EPS, stages=4, wgs=1, producer=True, vec_wgs=2)
    with pytest.raises(ValueError, match="two vector warpgroups"):
        tlp.build(FLASH_D, 8, EPS, stages=4, wgs=1, producer=True, split_roles=True, vec_wgs=3)


def test_build_options_are_checked():
    """``diag`` takes only its known flags, ``norm_w_smem`` only goes with the normalizing warps and ``dots_defer``
    with split roles."""
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    pytest.importorskip("tilelang")
    with pytest.raises(ValueError, match="diag 'timers,nosq'"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.DEFAULT_CONFIG, diag="timers,nosq"))
    with pytest.raises(ValueError, match="norm_w_smem and norm_prepoll are for the normalizing warps"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.CONFIGS["wg1-split-v2"], norm_w_smem=True))
    with pytest.raises(ValueError, match="dots_defer needs split roles"):
        tlp.build(FLASH_D, 8, EPS, **dict(tlp.CONFIGS["wg1-producer"], dots_defer=True))


@pytest.mark.parametrize("name", [None, "wg1-split-v2-normwg3-ws-dd"])  # the default; the deferred dots' own loop
def test_diag_timers_build(name, tmp_path, monkeypatch):
    """The probe build (``diag`` "timers", ``benchmarks/probe_mhc_pre_diag.py``): each role's first thread reads the
    cycle counter around its barrier waits and writes three counts over xss at the end; no spills."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed: TileLang cannot build the sm_90a cubin")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    from dsv41_passes.lowering.tilelang import mhc_pre as tlp

    cfg = tlp.DEFAULT_CONFIG if name is None else tlp.CONFIGS[name]
    src = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **dict(cfg, diag="timers")), True)
    src = src.get_kernel_source()
    writes = re.findall(r"xss\[\(+\(\(int\)blockIdx.x\) \* 64\) \+ k_\d+\)(?: \+ (\d+))?\)?\] = \(\(float\)tm\[", src)
    assert sorted(int(w or 0) for w in writes) == [0, 3, 6, 9] and src.count("clock64()") >= 16  # a role's rows
    plain = tlp.compile_kernel(tlp.build(FLASH_D, 8, EPS, **cfg), True).get_kernel_source()
    assert "clock64" not in plain


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
