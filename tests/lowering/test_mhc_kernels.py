"""mHC kernels (Triton; TileLang compile): numerics vs float64, bitwise identities between the fused
ops, batch invariance, declines and errors. On CPU the Triton kernels run under the interpreter
with small shapes; the ``gpu`` tests repeat the numerics at V4.1-Flash shapes on an H200."""

from __future__ import annotations


import pytest
import torch

from dsv41_passes.lowering import registry
from dsv41_passes.lowering.mhc_weights import build_parts
from dsv41_passes.reference import mhc as ref

tk = pytest.importorskip("dsv41_passes.lowering.triton.mhc")

BF16 = torch.bfloat16
ITERS, HC_EPS, NORM_EPS, EPS = 20, 1e-6, 1e-6, 1e-6
DEV = "cuda" if torch.cuda.is_available() else "cpu"
D = 256 if DEV == "cuda" else 64  # small hidden: tensor-core chunks need hidden/16 % 16 == 0 on a GPU


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


def with_cancellation(t):
    """Streams 0 and 1 nearly cancel in the collapse, so its fp32 summation order shows in the bf16 bits."""
    g = torch.Generator(device=t["h"].device).manual_seed(1)
    h, p = t["h"].clone(), t["pre_prev"].clone()
    h[:, 1] = (-h[:, 0].float() * (1 + torch.rand(h[:, 0].shape, generator=g, device=h.device) * 0.01)).to(BF16)
    p[:, :2] = 1 + torch.rand(p.shape[0], 2, generator=g, device=p.device) * 1e-3
    p[:, 2:] *= 1e-2
    return dict(t, h=h, pre_prev=p)


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


@pytest.mark.parametrize("weight", ["w", None])
def test_finish_kernel_gives_the_last_arriver_bits(weight):
    """``finish="kernel"`` (the reduction and the norm as a second launch, spread over column parts)
    computes exactly what the last slice program of each row block computes; 130 rows = 2 row blocks (the
    second a partial one of 2 rows), each normalized in 2 column parts on CPU (more on a GPU)."""
    from dsv41_passes.lowering.triton.mhc_projection import _finish_parts, _norm_block

    assert _finish_parts(D, _norm_block(D, 128)) >= 2
    t = make_inputs(130, D, seed=9)
    # 2 row blocks (one column block a normalizing program) and 9 row blocks (the wide layouts)
    # and the row-major norm layout of prefill sizes (``norm_rows`` rows a program; 130 is no multiple of 4).
    # ``norm_rows`` only places the norm programs: an op without a norm (the stats; pre and boundary without
    # a weight) has the one kernel layout, and the stats (no weight) run in the "w" case only.
    ops = [("pre", lambda **kw: pre_op(t, weight, **kw)), ("boundary", lambda **kw: boundary_op(t, weight, **kw))]
    if weight:
        ops.insert(0, ("stats", lambda **kw: stats(t, **kw)))
    for last in (dict(BLOCK_M=128, num_warps=4, num_stages=1), dict(BLOCK_M=16, num_warps=1, num_stages=1)):
        for name, fn in ops:
            want = fn(config=last)  # the last-arriver outputs, once for the finish layouts
            rows = (None, 4, 16) if weight and name != "stats" else (None,)
            for kern in (dict(last, finish="kernel", **({"norm_rows": r} if r else {})) for r in rows):
                for i, (a, b) in enumerate(zip(want, fn(config=kern))):
                    assert_equal(a, b, f"{name} output {i} {kern}")


@pytest.mark.parametrize("finish,rows", [("last", None), ("kernel", None), ("kernel", 16)])
def test_k_slices_split_in_two(finish, rows):
    """``split=2``: each K slice in two pieces of whole chunks, a partial each (hidden 1024: 2 chunks of 32
    columns a slice). Same math as one piece up to the order of the fp32 sums: mixes within 1e-6 of float64,
    x within 1 bf16 ulp of the unsplit x. With the same split everywhere the fused ops keep their identities
    bitwise (pre = collapse + stats, boundary = post then pre), both finishes agree, rows do not depend on M.
    ``rows=16``: the decode configs' 16-row blocks on 4 warps (``SMALL_ROWS``)."""
    d = 1024
    t = make_inputs(64, d, seed=2)  # an input where the split's norm sums round one x element differently
    cfg = {op: dict(tk.default_config(op), split=2) for op in ("mhc_stats", "mhc_pre", "mhc_boundary", "mhc_collapse")}
    for op in ("mhc_stats", "mhc_pre", "mhc_boundary"):
        cfg[op]["finish"] = finish
        if rows:
            cfg[op].update(BLOCK_M=rows, num_warps=4)
    mixes = tk.stats_mixes(t["h"], build_parts(t["fn"]), t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS,
                           config=cfg["mhc_stats"])
    assert normwise(mixes, mixes64(t["h"], t["fn"])) <= 1e-6
    pre2 = pre_op(t, config=cfg["mhc_pre"])
    pre1 = pre_op(t, config=dict(tk.default_config("mhc_pre"), finish=finish))
    torch.testing.assert_close(pre2[0].float(), pre1[0].float(), rtol=2.0**-7, atol=0)
    for a, b in zip(pre2[1:], pre1[1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(pre2[0], pre1[0])  # so the collapse's split below is not vacuous
    expect = (collapse_op(t, config=cfg["mhc_collapse"]), *stats(t, config=cfg["mhc_stats"]))
    for name, a, b in zip(("x", "pre", "post", "comb"), pre2, expect):
        assert_equal(a, b, f"split 2: pre {name} vs collapse + stats")
    bnd = boundary_op(t, config=cfg["mhc_boundary"])
    for a, b in zip(bnd[1:], pre_op(dict(t, h=bnd[0]), config=cfg["mhc_pre"])):
        assert_equal(a, b, "split 2: boundary vs post then pre")
    if finish == "last":
        for a, b in zip(pre2, pre_op(t, config=dict(cfg["mhc_pre"], finish="kernel"))):
            assert_equal(a, b, "split 2: finish last vs kernel")
    alone = pre_op({k: (v[:1] if k in ("h", "pre_prev") else v) for k, v in t.items()}, config=cfg["mhc_pre"])
    for a, b in zip(alone, pre2):
        assert_equal(a, b[:1], "split 2: row 0 alone")


def test_bad_split_is_rejected():
    t = make_inputs(4, D, seed=1)  # hidden 64 (256 on a GPU): one chunk a K slice
    for op, run in (("mhc_pre", pre_op), ("mhc_collapse", collapse_op)):
        with pytest.raises(ValueError, match="split must be"):
            run(t, config=dict(tk.default_config(op), split=2))
    with pytest.raises(ValueError, match="split must be"):
        pre_op(make_inputs(4, 1024, seed=1), config=dict(tk.default_config("mhc_pre"), split=5))
    for rows in (0, 3, 2 * tk.default_config("mhc_pre")["BLOCK_M"]):  # stats rows of the finish
        with pytest.raises(ValueError, match="finish_rows must be"):
            pre_op(t, config=dict(tk.default_config("mhc_pre"), finish_rows=rows))
    for rows in (3, 2 * tk.default_config("mhc_pre")["BLOCK_M"]):  # rows of a row-major norm program
        with pytest.raises(ValueError, match="norm_rows must be"):
            pre_op(t, config=dict(tk.default_config("mhc_pre"), finish="kernel", norm_rows=rows))


def test_unknown_finish_is_rejected():
    t = make_inputs(4, D, seed=1)
    with pytest.raises(ValueError, match="finish must be"):
        pre_op(t, "w", config=dict(BLOCK_M=128, num_warps=4, num_stages=1, finish="later"))


def test_default_configs_keep_wgmma_rows():
    for op in ("mhc_stats", "mhc_pre", "mhc_boundary"):
        for cfg in [tk.DEFAULTS[op], *tk.CANDIDATES[op]]:
            assert cfg["BLOCK_M"] >= 16 * cfg["num_warps"], (op, cfg)


def test_decode_sizes_split_k_slices_in_two_outside_batch_invariant_mode():
    """Untuned configs: split 2 up to SPLIT2_MAX_M tokens for every op that has the option (the same rule for
    all keeps pre = collapse + stats), never in batch-invariant mode, never where a slice has one chunk;
    16-row blocks for the projection ops up to SMALL_ROWS_MAX_M."""
    from dsv41_passes.lowering.triton.mhc_common import (
        FINISH_SMALL,
        FINISH_SMALL_MAX_M,
        SMALL_ROWS,
        SMALL_ROWS_MAX_M,
        SPLIT2_MAX_M,
        SPLIT_OPS,
        untuned_config,
    )

    for op in SPLIT_OPS:
        if op == "mhc_boundary":  # its forms take the untuned configs of the ops they run (next test)
            continue
        # 16-row blocks up to SMALL_ROWS_MAX_M for the projection ops (the collapse keeps its rows)
        small, above = (untuned_config(op, m, 5120, False) for m in (SMALL_ROWS_MAX_M, SMALL_ROWS_MAX_M + 1))
        if op == "mhc_collapse":
            assert small == above == dict(tk.default_config(op), split=2)
        else:
            last = dict(finish="last") if op == "mhc_stats" else {}  # the stats' decode finish
            assert small == dict(tk.default_config(op), split=2, **SMALL_ROWS, **last)
            finish = FINISH_SMALL if op == "mhc_pre" and tk.default_config(op).get("finish") == "kernel" else {}
            assert above == dict(tk.default_config(op), split=2, **finish)
            assert untuned_config(op, FINISH_SMALL_MAX_M + 1, 5120, False) == dict(tk.default_config(op), split=2)
        assert untuned_config(op, 1, 5120, False)["split"] == 2
        assert untuned_config(op, SPLIT2_MAX_M, 5120, False)["split"] == 2
        assert untuned_config(op, SPLIT2_MAX_M + 1, 5120, False).get("split", 1) == 1
        assert untuned_config(op, 1, 5120, True) == tk.default_config(op)
        assert untuned_config(op, 1, D, False).get("split", 1) == 1  # hidden 64: one 4-column chunk a slice
    assert "split" not in untuned_config("mhc_post", 1, 5120, False)
    assert tk.default_config("mhc_stats")["finish"] == "kernel"


def test_boundary_untuned_forms():
    """Up to BOUNDARY_POST_PRE_MAX_M tokens the boundary runs the post kernel and mhc_pre with mhc_pre's untuned
    config; above, the post + collapse kernel and mhc_stats with the stats' config; batch-invariant mode keeps
    the one default (post then pre) at every M."""
    from dsv41_passes.lowering.triton.mhc_common import BOUNDARY_POST_PRE_MAX_M, untuned_config

    dflt = tk.default_config("mhc_boundary")
    post = {k: dflt[k] for k in ("post_rows", "post_cols", "post_warps")}
    for m in (1, 64, 128, BOUNDARY_POST_PRE_MAX_M):
        assert untuned_config("mhc_boundary", m, 5120, False) == dict(untuned_config("mhc_pre", m, 5120, False),
                                                                      form="post_pre", **post)
    for m in (BOUNDARY_POST_PRE_MAX_M + 1, 4096, 65536):
        assert untuned_config("mhc_boundary", m, 5120, False) == dict(untuned_config("mhc_stats", m, 5120, False),
                                                                      form="post_collapse", **post)
    for m in (1, 65536):
        assert untuned_config("mhc_boundary", m, 5120, True) == dflt
    assert dflt["form"] == "post_pre"


@pytest.mark.parametrize("split", [1, 2])
def test_boundary_forms_give_the_same_bits(split):
    """The three forms of the boundary (one projection kernel with the post in it; the post kernel then mhc_pre;
    the post + collapse kernel then mhc_stats) compute the same five outputs bitwise, at several rows and warps
    a program of the post + collapse kernel, with and without the norm (hidden 1024: 2 chunks a K slice, with
    streams that cancel in the collapse)."""
    t = with_cancellation(make_inputs(11, 1024, seed=13))
    proj = dict(tk.default_config("mhc_pre"), split=split)
    for weight in ("w", None):
        ref = boundary_op(t, weight, config=dict(proj, form="post_pre"))
        assert_equal(ref[0], post_op(t), "post_pre new_res")
        variants = [dict(proj, form="fused")] + [dict(proj, form="post_collapse", post_rows=r, post_cols=c,
                                                       post_warps=w) for r, c, w in ((1, 1024, 1), (4, 256, 2))]
        for cfg in variants if weight else variants[-1:]:
            for i, (a, b) in enumerate(zip(boundary_op(t, weight, config=cfg), ref)):
                assert_equal(a, b, f"output {i} {cfg}")


def test_boundary_rejects_bad_forms():
    t = make_inputs(4, 1024, seed=1)
    proj = tk.default_config("mhc_pre")
    with pytest.raises(ValueError, match="form must be"):
        boundary_op(t, config=dict(proj, form="later"))
    with pytest.raises(ValueError, match="post_rows must be"):
        boundary_op(t, config=dict(proj, form="post_collapse", post_rows=3))
    with pytest.raises(ValueError, match="post_cols must be"):
        boundary_op(t, config=dict(proj, form="post_collapse", post_cols=0))
    with pytest.raises(ValueError, match="takes split 1 or 2"):  # hidden 5120: 10 chunks a K slice; no launch
        boundary_op(make_inputs(1, 5120, seed=1), config=dict(proj, form="post_collapse", split=5))


def test_empty_batch():
    t = make_inputs(0, D)
    pre, post, comb = stats(t)
    assert pre.shape == (0, 4) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    x, *_ = pre_op(t)
    assert x.shape == (0, D)
    new_res, x, *_ = boundary_op(t)
    assert new_res.shape == (0, 4, D) and x.shape == (0, D)
    assert collapse_op(t).shape == (0, D) and post_op(t).shape == (0, 4, D)


def test_kernels_reject_what_they_cannot_run():
    t = make_inputs(5, D)
    with pytest.raises(ValueError, match="hc_mult"):
        tk.mhc_collapse(t["h"][:, :2], t["pre_prev"][:, :2], None, EPS, batch_invariant=True)
    with pytest.raises(ValueError, match="dtype"):
        tk.mhc_collapse(t["h"].half(), t["pre_prev"], None, EPS, batch_invariant=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        tk.mhc_collapse(t["h"][..., :40], t["pre_prev"], None, EPS, batch_invariant=True)
    with pytest.raises(ValueError, match="parts"):
        tk.mhc_stats(t["h"], build_parts(t["fn"])[:2], t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS,
                     batch_invariant=True)


def _op_args(t):
    return (t["h"], t["fn"], t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS)


def test_providers_decline_cleanly_and_reference_takes_over():
    t = make_inputs(6, D)
    m = t["h"].shape[0]
    cases = {
        "hc_mult": (t["h"][:, :2].contiguous(), torch.randn(8, 2 * D, device=DEV), t["scale"],
                    torch.randn(8, device=DEV)),
        "dtype": (t["h"].half(), t["fn"], t["scale"], t["base"]),
        "contiguous": (torch.randn(m, D, 4, device=DEV).to(BF16).transpose(1, 2), t["fn"], t["scale"], t["base"]),
        "multiple of 16": (torch.randn(m, 4, 40, device=DEV).to(BF16), torch.randn(24, 160, device=DEV), t["scale"],
                           t["base"]),
    }
    for why, (h, fn, scale, base) in cases.items():
        p, reasons = registry.choose("mhc_stats", "triton,reference", True, h, fn, scale, base, ITERS, HC_EPS,
                                     NORM_EPS)
        assert p.name == "reference", why
        assert why in reasons[0], reasons
        out = torch.ops.dsv41.mhc_stats(h, fn, scale, base, ITERS, HC_EPS, NORM_EPS, "triton,reference",
                                        registry.encode_mode(True))
        for a, b in zip(out, ref.hc_mixes(h, fn, scale, base, ITERS, HC_EPS, NORM_EPS)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # CPU BLAS rounding varies with alignment


def test_ops_check_their_inputs():
    t = make_inputs(6, D)
    mode = registry.encode_mode(True)
    with pytest.raises(ValueError, match="fn must be"):
        torch.ops.dsv41.mhc_stats(t["h"], t["fn"][:, :-1], t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS,
                                  "triton,reference", mode)
    with pytest.raises(ValueError, match="pre must be"):
        torch.ops.dsv41.mhc_collapse(t["h"], t["pre_prev"][:-1], None, EPS, "triton,reference", mode)
    with pytest.raises(ValueError, match="float32"):
        torch.ops.dsv41.mhc_stats(t["h"], t["fn"].double(), t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS,
                                  "triton,reference", mode)


def test_ops_run_the_triton_provider():
    t = make_inputs(9, D, seed=11)
    mode = registry.encode_mode(True)
    p, _ = registry.choose("mhc_boundary", "triton,reference", True, t["y"], t["h"], t["post"], t["comb"],
                           t["pre_prev"], t["fn"], t["scale"], t["base"], t["w"], ITERS, HC_EPS, NORM_EPS, EPS)
    assert p.name == "triton"
    out = torch.ops.dsv41.mhc_boundary(t["y"], t["h"], t["post"], t["comb"], t["pre_prev"], t["fn"], t["scale"],
                                       t["base"], t["w"], ITERS, HC_EPS, NORM_EPS, EPS, "triton,reference", mode)
    for a, b in zip(out, boundary_op(t)):
        assert_equal(a, b, "boundary via op")
    out = torch.ops.dsv41.mhc_post(t["y"], t["h"], t["post"], t["comb"], "triton,reference", mode)
    assert_equal(out, post_op(t), "post via op")


# ----------------------------------------------------------------------------- H200 (gpu) tests
FLASH_D = 5120
GPU_MS = [1, 7, 4096, 4097, 16384, 65536]


def _chunked(fn, n, step=2048):
    return torch.cat([fn(slice(i, min(i + step, n))) for i in range(0, n, step)]) if n else fn(slice(0, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("m", GPU_MS)
def test_gpu_flash_numerics(m):
    t = make_inputs(m, FLASH_D, seed=m, device="cuda")
    parts = build_parts(t["fn"])
    mixes = tk.stats_mixes(t["h"], parts, t["scale"], t["base"], ITERS, HC_EPS, NORM_EPS)
    m64 = _chunked(lambda s: mixes64(t["h"][s], t["fn"]), m)
    assert normwise(mixes, m64) <= 1e-6
    pre, post, comb = stats(t, bi=False)
    for out, r in zip((pre, post, comb), split64(m64, t["scale"], t["base"])):
        torch.testing.assert_close(out.double(), r, rtol=2e-5, atol=2e-6)
    x_plain, x_normed = collapse_op(t, weight=None, bi=False), collapse_op(t, bi=False)
    c64 = _chunked(lambda s: collapse64(t["h"][s], t["pre_prev"][s]), m)
    assert_ulps(x_plain, c64, terms=_chunked(lambda s: collapse_terms64(t["h"][s], t["pre_prev"][s]), m))
    assert_ulps(x_normed, _chunked(lambda s: norm64(x_plain[s], t["w"]), m))
    out = post_op(t, bi=False)
    assert_ulps(out, _chunked(lambda s: post64(t["y"][s], t["h"][s], t["post"][s], t["comb"][s]), m),
                terms=_chunked(lambda s: post_terms64(t["y"][s], t["h"][s], t["post"][s], t["comb"][s]), m))
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
    proj64 = _chunked(lambda s: t["h"][s].flatten(1).double() @ t["fn"].double().t(), m)
    assert normwise(proj[:, : proj64.shape[1]], proj64) <= 1e-6
    m64 = _chunked(lambda s: mixes64(t["h"][s], t["fn"]), m)
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
    with torch.inference_mode():
        logits = fast(*args)
    sites = dp.last_report().sites
    assert any(k.startswith("mhc") for k in sites), sites
    torch.testing.assert_close(logits.float(), ref_logits.float(), rtol=0, atol=1e-3 * ref_logits.abs().max().item())
    builds = mhc_weights.cache_info()["builds"]
    model.reset_cache()
    with torch.inference_mode():
        again = fast(*args)
    assert torch.equal(again, logits)
    assert mhc_weights.cache_info()["builds"] == builds
