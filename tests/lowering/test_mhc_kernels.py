"""mHC kernels (Triton; TileLang stats): numerics vs float64, bitwise identities between the fused ops, batch
invariance, and the kernels in a compiled model. On CPU the Triton kernels run under the interpreter with small
shapes; the ``gpu`` tests repeat the numerics at V4.1-Flash shapes on an H200. Configs, forms, declines and errors:
``test_mhc_kernel_configs.py``."""

from __future__ import annotations

import pytest
import torch

from dsv41_passes.lowering import registry
from dsv41_passes.lowering.mhc_weights import build_parts
from dsv41_passes.reference import mhc as ref

tk = pytest.importorskip("dsv41_passes.lowering.triton.mhc")

from mhc_cases import (  # noqa: E402  (after the skip: the cases import the Triton ops)
    BF16, D, DEV, FLASH_D, GPU_MS, HC_EPS, ITERS, NORM_EPS, assert_equal, assert_ulps, boundary_op,
    check_collapse_numerics, check_stats_numerics, chunked, collapse64, collapse_op, collapse_terms64, make_inputs,
    mixes64, norm64, normwise, post64, post_op, post_terms64, pre_op, split64, stats, with_cancellation,
)


# ----------------------------------------------------------------------------- CPU (interpreter) tests
@pytest.mark.parametrize("d", [D, 4 * D])
def test_stats_against_float64(d):
    t = make_inputs(33, d, seed=d)
    mixes = tk.stats_mixes(t["h"], build_parts(t["fn"]), t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS)
    check_stats_numerics(t, mixes, *stats(t))


def test_collapse_norm_and_post_against_float64():
    t = make_inputs(33, 2 * D, seed=3)
    check_collapse_numerics(t, collapse_op(t, weight=None), collapse_op(t))
    t["w"] = t["w"].to(BF16)  # a bf16 norm weight is multiplied in fp32 too
    check_collapse_numerics(t, collapse_op(t, weight=None), collapse_op(t))
    out = post_op(t)
    assert_ulps(out, post64(t["y"], t["h"], t["post"], t["comb"]), 1.0)
    if DEV == "cpu":  # the interpreter rounds each product and sum like eager torch (no FMA contraction)
        assert_equal(out, ref.hc_post(t["y"], t["h"], t["post"], t["comb"]), "post vs reference")


def test_post_load_policy_changes_no_value():
    """The post's loads under the normal L2 policy (``loads`` "normal", a probe's candidate) give the default's bits;
    an unknown policy is refused."""
    t = make_inputs(33, 2 * D, seed=4)
    cfg = tk.default_config("mhc_post")
    args = (t["y"], t["h"], t["post"], t["comb"])
    base = tk.mhc_post(*args, batch_invariant=False, config=cfg)
    assert_equal(tk.mhc_post(*args, batch_invariant=False, config=dict(cfg, loads="normal")), base, "post")
    with pytest.raises(ValueError, match="evict_first or normal"):
        tk.mhc_post(*args, batch_invariant=False, config=dict(cfg, loads="evict_last"))


@pytest.mark.parametrize("weight", ["w", None])
def test_pre_equals_collapse_and_stats_bitwise(weight):
    t = with_cancellation(make_inputs(21, D, seed=5))
    x, pre, post, comb = pre_op(t, weight)
    assert_equal(x, collapse_op(t, weight), "x")
    for name, a, b in zip(("pre", "post", "comb"), (pre, post, comb), stats(t)):
        assert_equal(a, b, name)


@pytest.mark.parametrize("weight", ["w", None])
def test_boundary_equals_post_then_pre_bitwise(weight):
    t = make_inputs(21, D, seed=6)
    new_res, *rest = boundary_op(t, weight)
    assert_equal(new_res, post_op(t), "new_res")
    t2 = dict(t, h=new_res)
    for name, a, b in zip(("x", "pre", "post", "comb"), rest, pre_op(t2, weight)):
        assert_equal(a, b, name)


def test_gpu_rounding_points_without_interpreter_rounding(monkeypatch):
    """The GPU code path (INTERP=False: no explicit RNE; here the interpreter then truncates at every
    bf16 conversion instead of rounding) must still reuse exactly the stored bf16 values: the boundary's
    collapse and norm see the new residual as written, and x as written."""
    from dsv41_passes.lowering.triton import mhc_projection

    for module in (tk, mhc_projection):  # the launchers' flag (configs keep the interpreter's defaults)
        monkeypatch.setattr(module, "INTERPRET", False)
    t = make_inputs(21, D, seed=12)
    new_res, x, *_ = boundary_op(t)  # (the bf16 dots are meaningless in this mode: stats are not compared)
    assert_equal(new_res, post_op(t), "new_res")
    assert_equal(x, pre_op(dict(t, h=new_res))[0], "x")
    assert_equal(x, collapse_op(dict(t, h=new_res)), "x vs collapse")
    xp = collapse_op(dict(t, h=new_res), weight=None)
    assert_equal(pre_op(dict(t, h=new_res), weight=None)[0], xp, "plain x")


def _row(outs, i):
    return [o[i] for o in outs]


@pytest.mark.parametrize("which", ["default", "gpu default"])
@pytest.mark.parametrize("op", ["stats", "pre", "boundary", "collapse", "post"])
def test_batch_invariant_rows(op, which):
    """Batch-invariant configs (this platform's default, and the GPU default whose 128-row blocks split
    these 131 rows in two): a row's bits are the same alone (M = 1) and among N rows."""
    n = 131
    t = make_inputs(n, D, seed=7)
    name = {"stats": "mhc_stats", "pre": "mhc_pre", "boundary": "mhc_boundary", "collapse": "mhc_collapse",
            "post": "mhc_post"}[op]
    cfg = {"config": tk.DEFAULTS[name]} if which == "gpu default" else {}
    fns = {"stats": stats, "pre": pre_op, "boundary": boundary_op, "collapse": collapse_op, "post": post_op}

    def run(tt):
        return fns[op](tt, **cfg)

    full = run(t)
    full = full if isinstance(full, tuple) else (full,)
    for i in (0, 77, 128, n - 1):
        alone = run({k: (v[i : i + 1] if v.dim() and v.shape[0] == n else v) for k, v in t.items()})
        alone = alone if isinstance(alone, tuple) else (alone,)
        for a, b in zip(_row(full, i), _row(alone, 0)):
            assert_equal(a, b, f"{op} row {i}")


def test_configs_do_not_change_bits():
    """Every candidate config computes the same per-row arithmetic (elementwise accumulation, fixed trees)."""
    t = make_inputs(70, D, seed=8)
    base_stats = stats(t)
    for bm, warps in sorted({(c["BLOCK_M"], c["num_warps"]) for c in tk.CANDIDATES["mhc_stats"]}):
        for a, b in zip(stats(t, config=dict(BLOCK_M=bm, num_warps=warps, num_stages=2)), base_stats):
            assert_equal(a, b, f"stats BLOCK_M={bm} num_warps={warps}")
    base_x = collapse_op(t)
    for br in sorted({c["BLOCK_R"] for c in tk.CANDIDATES["mhc_collapse"]}):
        assert_equal(collapse_op(t, config=dict(BLOCK_R=br, num_warps=4)), base_x, f"collapse BLOCK_R={br}")
    base_p = post_op(t)
    for cfg in tk.CANDIDATES["mhc_post"][:4]:
        assert_equal(post_op(t, config=cfg), base_p, f"post {cfg}")
    # program order: row-major 1D grid vs (row block, column block) grid, several column blocks, a partial
    # row block (M = 70)
    for order in ("row", "col"):
        for br, bd in ((1, D // 4), (4, D // 2), (8, D)):
            assert_equal(post_op(t, config=dict(BLOCK_R=br, BLOCK_D=bd, num_warps=2, order=order)), base_p,
                         f"post order={order} BLOCK_R={br} BLOCK_D={bd}")


# ----------------------------------------------------------------------------- H200 (gpu) tests
@pytest.mark.gpu
@pytest.mark.parametrize("m", GPU_MS)
def test_gpu_flash_numerics(m):
    t = make_inputs(m, FLASH_D, seed=m, device="cuda")
    parts = build_parts(t["fn"])
    mixes = tk.stats_mixes(t["h"], parts, t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS)
    m64 = chunked(lambda s: mixes64(t["h"][s], t["fn"]), m)
    assert normwise(mixes, m64) <= 1e-6
    pre, post, comb = stats(t, bi=False)
    for out, r in zip((pre, post, comb), split64(m64, t["scale"], t["base"])):
        torch.testing.assert_close(out.double(), r, rtol=2e-5, atol=2e-6)
    x_plain, x_normed = collapse_op(t, weight=None, bi=False), collapse_op(t, bi=False)
    c64 = chunked(lambda s: collapse64(t["h"][s], t["pre_prev"][s]), m)
    assert_ulps(x_plain, c64, terms=chunked(lambda s: collapse_terms64(t["h"][s], t["pre_prev"][s]), m))
    assert_ulps(x_normed, chunked(lambda s: norm64(x_plain[s], t["w"]), m))
    out = post_op(t, bi=False)
    assert_ulps(out, chunked(lambda s: post64(t["y"][s], t["h"][s], t["post"][s], t["comb"][s]), m),
                terms=chunked(lambda s: post_terms64(t["y"][s], t["h"][s], t["post"][s], t["comb"][s]), m))
    # one read of h: mhc_pre is (collapse, stats) bitwise; the boundary is post then pre bitwise
    for a, b in zip(pre_op(t, bi=False), (x_normed, pre, post, comb)):
        assert_equal(a, b, "pre")
    bnd = boundary_op(t, bi=False)
    assert_equal(bnd[0], out, "boundary new_res")
    for a, b in zip(bnd[1:], pre_op(dict(t, h=out), bi=False)):
        assert_equal(a, b, "boundary pre")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 200])
def test_gpu_flash_split_in_two(m):
    """The ``split=2`` set at Flash shapes (decode sizes): mixes within 1e-6 of float64, pre/post/comb as
    the float64 rule allows, and the fused ops' identities bitwise (pre = collapse + stats, boundary = post
    then pre)."""
    t = make_inputs(m, FLASH_D, seed=m, device="cuda")
    cfg = {op: dict(tk.DEFAULTS[op], split=2) for op in ("mhc_stats", "mhc_pre", "mhc_boundary", "mhc_collapse")}
    mixes = tk.stats_mixes(t["h"], build_parts(t["fn"]), t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS,
                           config=cfg["mhc_stats"])
    m64 = mixes64(t["h"], t["fn"])
    assert normwise(mixes, m64) <= 1e-6
    st = stats(t, bi=False, config=cfg["mhc_stats"])
    for out, r in zip(st, split64(m64, t["scale"], t["base"])):
        torch.testing.assert_close(out.double(), r, rtol=2e-5, atol=2e-6)
    x = collapse_op(t, bi=False, config=cfg["mhc_collapse"])
    for name, a, b in zip(("x", "pre", "post", "comb"), pre_op(t, bi=False, config=cfg["mhc_pre"]), (x, *st)):
        assert_equal(a, b, f"split 2: pre {name}")
    bnd = boundary_op(t, bi=False, config=cfg["mhc_boundary"])
    assert_equal(bnd[0], post_op(t, bi=False), "split 2: boundary new_res")
    for a, b in zip(bnd[1:], pre_op(dict(t, h=bnd[0]), bi=False, config=cfg["mhc_pre"])):
        assert_equal(a, b, "split 2: boundary pre")


@pytest.mark.gpu
def test_gpu_flash_batch_invariance():
    n = 65536
    t = make_inputs(n, FLASH_D, seed=1, device="cuda")
    runs = {"stats": stats, "pre": pre_op, "boundary": boundary_op, "collapse": collapse_op, "post": post_op}
    for op, run in runs.items():
        full = run(t)
        full = full if isinstance(full, tuple) else (full,)
        for i in (0, 1, 4095, 4096, 33333, n - 1):
            for mm in (1, 7, 4097):
                sub = {k: (v[i : i + mm] if v.dim() and v.shape[0] == n else v) for k, v in t.items()}
                part = run(sub)
                part = part if isinstance(part, tuple) else (part,)
                for a, b in zip(full, part):
                    assert_equal(a[i], b[0], f"{op} row {i} (M={mm})")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4097, 65536])
def test_gpu_tilelang_stats_numerics(m):
    if registry.tilelang_available(torch.empty(0, device="cuda")):
        pytest.skip(registry.tilelang_available(torch.empty(0, device="cuda")))
    from dsv41_passes.lowering.tilelang import mhc as tlk

    t = make_inputs(m, FLASH_D, seed=m, device="cuda")
    pre, post, comb = tlk.mhc_stats(t["h"], build_parts(t["fn"]), t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS,
                                    batch_invariant=True)
    # the compensated projection itself (slices summed in order), before the rsqrt scaling
    ws, _ = tlk.partials(t["h"], build_parts(t["fn"]), tlk.DEFAULTS["mhc_stats"])
    proj = ws[0].clone()
    for s in range(1, ws.shape[0]):
        proj += ws[s]
    proj64 = chunked(lambda s: t["h"][s].flatten(1).double() @ t["fn"].double().t(), m)
    assert normwise(proj[:, : proj64.shape[1]], proj64) <= 1e-6
    m64 = chunked(lambda s: mixes64(t["h"][s], t["fn"]), m)
    for out, r in zip((pre, post, comb), split64(m64, t["scale"], t["base"])):
        torch.testing.assert_close(out.double(), r, rtol=2e-5, atol=2e-6)


# ----------------------------------------------------------------------------- in a compiled model
@pytest.mark.slow
def test_tiny_model_runs_the_triton_mhc_kernels():
    """The compiled tiny model with Triton mHC providers: logits near eager (with Inductor's precision
    emulation every other op rounds like eager), and the derived weights are built once, not per call."""
    import dsv41_passes as dp
    from dsv41_passes.lowering import mhc_weights
    from helpers import EMULATE, eager, packed, tiny_model

    model = tiny_model()
    args = packed([7, 5])
    ref_logits = eager(model, *args)
    torch._dynamo.reset()
    fast = dp.compile(model, dp.PassConfig(providers=("triton", "reference"), rope_store=False, wo_a=False),
                      options=EMULATE)
    model.reset_cache()
    before = mhc_weights.cache_info()["builds"]
    with torch.inference_mode():
        logits = fast(*args)
    rep = dp.last_report()
    # 2 layers: stats and post per sub-block, a collapse per sub-block plus the final norm's
    assert rep.sites == {"mhc_stats": 4, "mhc_collapse": 5, "mhc_post": 4}, rep.to_markdown()
    assert all(r.provider == "triton" for r in rep.rows), rep.to_markdown()  # no site fell back to the reference
    torch.testing.assert_close(logits.float(), ref_logits.float(), rtol=0, atol=1e-3 * ref_logits.abs().max().item())
    builds = mhc_weights.cache_info()["builds"]
    assert builds - before == rep.sites["mhc_stats"]  # the kernels built one parts tensor per stats weight
    model.reset_cache()
    with torch.inference_mode():
        again = fast(*args)
    assert torch.equal(again, logits)
    assert mhc_weights.cache_info()["builds"] == builds
