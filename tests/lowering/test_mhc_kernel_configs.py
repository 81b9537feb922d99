"""mHC kernels (Triton): the configs and forms that must not change the bits (tile shapes, finish kernel, K slices
split in two, the boundary's forms, untuned decode configs), empty batches, and the declines and errors of the
kernels and ops. On CPU the Triton kernels run under the interpreter with small shapes."""

from __future__ import annotations

import pytest
import torch

from dsv41_passes.lowering import registry
from dsv41_passes.lowering.mhc_weights import build_parts
from dsv41_passes.reference import mhc as ref

tk = pytest.importorskip("dsv41_passes.lowering.triton.mhc")

from mhc_cases import (  # noqa: E402  (after the skip: the cases import the Triton ops)
    BF16, D, DEV, EPS, FLASH_D, HC_EPS, ITERS, NORM_EPS, assert_equal, boundary_op, collapse_op, make_inputs, mixes64,
    normwise, post_op, pre_op, stats, with_cancellation,
)


@pytest.mark.parametrize("weight", ["w", None])
def test_finish_kernel_gives_the_last_arriver_bits(weight):
    """``finish="kernel"`` (the reduction and the norm as a second launch, spread over column parts)
    computes exactly what the last slice program of each row block computes; 130 rows = 2 row blocks (the
    second a partial one of 2 rows), each normalized in 2 column parts on CPU (more on a GPU)."""
    from dsv41_passes.lowering.triton.mhc_common import _norm_block
    from dsv41_passes.lowering.triton.mhc_finish import _finish_parts

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


def _check_stats_kernel(m: int, d: int) -> None:
    """``finish_stats``'s kernel with one row a thread ("rows_full": the TileLang ``mhc_pre``'s finish)
    compute exactly what the finish kernel's stats programs ("tiles", its finish until now) compute from the same
    partials of ``m`` rows (64-row blocks of 16 slices)."""
    from dsv41_passes.lowering.triton.mhc_common import LAUNCH_OPTIONS
    from dsv41_passes.lowering.triton.mhc_finish import finish_stats

    g = torch.Generator(device=DEV).manual_seed(m)
    nrb, k = -(-m // 64), 4 * d
    ws = torch.randn(nrb * 16 * 64 * 24, generator=g, device=DEV)
    ss = torch.rand(nrb * 16 * 64, generator=g, device=DEV) * k / 16
    scale, base = torch.rand(3, generator=g, device=DEV) + 0.5, torch.randn(24, generator=g, device=DEV)
    for mixes in (False, True):
        want = {n: torch.full((m, c), float("nan"), device=DEV) for n, c in (("pre", 4), ("post", 4), ("comb", 16),
                                                                             ("mix", 24))}
        finish_stats(ws, ss, scale, base, want["pre"], want["post"], want["comb"], want["mix"] if mixes else None,
                     m, k, 64, ITERS, HC_EPS, NORM_EPS, LAUNCH_OPTIONS, kernel="tiles")
        got = {n: torch.full_like(t, float("nan")) for n, t in want.items()}
        finish_stats(ws, ss, scale, base, got["pre"], got["post"], got["comb"], got["mix"] if mixes else None,
                     m, k, 64, ITERS, HC_EPS, NORM_EPS, LAUNCH_OPTIONS, kernel="rows_full")
        for i, (a, b) in enumerate(zip(want.values(), got.values())):
            if i == 3 and not mixes:
                continue
            assert not a.isnan().any(), f"output {i}: a row was not written"
            assert_equal(a, b, f"stats kernel output {i} (mixes={mixes}, M = {m})")


@pytest.mark.parametrize("m", [1, 33, 130])
def test_stats_kernel_gives_the_finish_kernel_bits(m):
    """130 rows are 3 row blocks, the last of 2 rows, and 5 programs of 32 rows, the last of 2."""
    _check_stats_kernel(m, D)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1536, 4097, 65536])
def test_gpu_stats_kernel_gives_the_finish_kernel_bits(m):
    """The same at V4.1-Flash's K on the GPU (the kernels as compiled there: pinned divisions, no contraction)."""
    _check_stats_kernel(m, FLASH_D)


@pytest.mark.parametrize("finish,rows", [("last", None), ("kernel", None), ("kernel", 16)])
def test_k_slices_split_in_two(finish, rows):
    """``split=2``: each K slice in two pieces of whole chunks, a partial each (hidden 1024: 2 chunks of 32
    columns a slice). Same math as one piece up to the order of the fp32 sums: mixes within 1e-6 of float64,
    x within 1 bf16 ulp of the unsplit x. With the same split everywhere the fused ops keep their identities
    bitwise (pre = collapse + stats, boundary = post then pre), both finishes agree, rows do not depend on M.
    ``rows=16``: the decode configs' 16-row blocks on 4 warps (``SMALL_ROWS``)."""
    d = 1024
    t = make_inputs(64, d, seed=1)  # an input where the split's norm sums round one x element differently
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


def test_ops_reject_bad_scalars_and_dtypes():
    """The ops' own checks (before any provider): an integer residual, an integer norm weight, a norm eps <= 0,
    fewer than one Sinkhorn iteration, a negative hc_eps. Each gave numbers (or NaN) before."""
    ops = torch.ops.dsv41
    t = make_inputs(3, D)
    h, pre, w = t["h"], t["pre_prev"], t["w"]
    stats_args = (t["fn"], t["scale"], t["base"])
    cases = [
        ("unsupported residual dtype", lambda: ops.mhc_collapse(h.to(torch.int64), pre, None, EPS, "reference", 0)),
        ("floating point", lambda: ops.mhc_collapse(h, pre, w.to(torch.int32), EPS, "reference", 0)),
        ("eps must be finite and > 0", lambda: ops.mhc_collapse(h, pre, w, -10.0, "reference", 0)),
        ("iterations must be >= 1", lambda: ops.mhc_stats(h, *stats_args, 0, HC_EPS, NORM_EPS, "reference", 0)),
        ("hc_eps must be finite", lambda: ops.mhc_stats(h, *stats_args, ITERS, -1.0, NORM_EPS, "reference", 0)),
        ("norm eps must be finite", lambda: ops.mhc_pre(h, pre, *stats_args, w, ITERS, HC_EPS, 0.0, EPS,
                                                        "reference", 0)),
        ("norm eps must be finite", lambda: ops.mhc_pre(h, pre, *stats_args, w, ITERS, HC_EPS, NORM_EPS,
                                                        float("nan"), "reference", 0)),
    ]
    for match, call in cases:
        with pytest.raises(ValueError, match=match):
            call()


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


def test_token_counts_from_the_environment(monkeypatch):
    from dsv41_passes.lowering.mhc import _env_tokens

    monkeypatch.setenv("DSV41_TEST_M", "4096")
    assert _env_tokens("DSV41_TEST_M", "none", ("none",), "") == 4096
    monkeypatch.setenv("DSV41_TEST_M", " None ")
    assert _env_tokens("DSV41_TEST_M", "1", ("none",), "") is None
    monkeypatch.setenv("DSV41_TEST_M", "off")
    with pytest.raises(ValueError, match="DSV41_TEST_M='off': not a token count"):
        _env_tokens("DSV41_TEST_M", "1", ("none",), "")
    monkeypatch.delenv("DSV41_TEST_M")
    assert _env_tokens("DSV41_TEST_M", "1536", ("off",), "") == 1536
