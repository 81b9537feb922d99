"""mhc_stats: the walker matches every supported spelling once; near misses are skipped quickly, with reasons."""

import time

import pytest
import torch
import torch.nn.functional as F

import dsv41_passes as dp
from dsv41_passes.reference.mhc import hc_mixes
from helpers import unique_graphs

REF = dp.PassConfig(providers=("reference",))
N, D = 4, 32
HC_EPS, NORM_EPS = 1e-3, 1e-2  # apart: a rewrite that passes one for the other changes the results past rtol 1e-5


def _args(m=9):
    g = torch.Generator().manual_seed(m)
    return (
        torch.randn(m, N, D, generator=g).bfloat16(),
        torch.randn(24, N * D, generator=g) / 16,
        torch.rand(3, generator=g) + 0.5,
        torch.randn(24, generator=g),
    )


def _run(fn, config=REF, m=9):
    torch._dynamo.reset()
    args = _args(m)
    out = dp.compile(fn, config)(*args)
    return out, fn(*args), dp.last_report()


def _variant(*, rms="mean_square", proj="linear", fold="after", softmax="softmax", post2="left", order="flat_first",
             iters=20, eps=HC_EPS, last_eps=None, end_on_row=False, pre_alpha=None, last_alpha=None, pre_step=1,
             dtype_at=None, acc_dtype=torch.float64):
    def acc(at):  # a reduction with a dtype: the RMS mean, the softmax sum or the last row step's sum
        return {"dtype": acc_dtype} if at is not None and at == dtype_at else {}

    def fn(h, fn_w, scale, base):
        n = h.shape[1]
        xf = h.flatten(1).float() if order == "flat_first" else h.float().flatten(1)
        if rms == "mean_square":
            ms = xf.square().mean(-1, keepdim=True, **acc("rms"))
        elif rms == "mul":
            ms = (xf * xf).mean(-1, keepdim=True)
        elif rms == "sum_no_keepdim":  # r is [M]: it scales the mix columns instead of the rows (where M == 24)
            ms = xf.pow(2).sum(-1) / xf.shape[-1]
        else:
            ms = xf.pow(2).sum(-1, keepdim=True) / xf.shape[-1]
        r = torch.rsqrt(ms + NORM_EPS)
        x_in = xf * r if fold == "before" else xf
        mix = {"linear": lambda: F.linear(x_in, fn_w), "matmul": lambda: x_in @ fn_w.T,
               "mm": lambda: torch.mm(x_in, fn_w.t())}[proj]()
        if fold == "after":
            mix = mix * r
        sg = torch.sigmoid(mix[:, :n:pre_step] * scale[0] + base[:n:pre_step])
        pre = sg + eps if pre_alpha is None else torch.add(sg, eps, alpha=pre_alpha)
        s = torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        post = 2 * s if post2 == "left" else s * 2
        c = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
        if softmax == "softmax":
            c = c.softmax(-1)
        elif softmax == "exp_sum":
            c = c.exp()
            c = c / c.sum(-1, keepdim=True, **acc("softmax"))
        else:  # manual_max; max_no_keepdim: [M, n] broadcast over the rows (where M == n), not the columns
            c = (c - c.amax(-1, keepdim=softmax != "max_no_keepdim")).exp()
            c = c / c.sum(-1, keepdim=True)
        c = c + eps
        c = c / (c.sum(-2, keepdim=True) + eps)
        for i in range(iters - 1):
            c = c / (c.sum(-1, keepdim=True, **acc("sinkhorn" if i == iters - 2 else None)) + eps)
            e = last_eps if (last_eps is not None and i == iters - 2) else eps
            if last_alpha is not None and i == iters - 2:
                c = c / torch.add(c.sum(-2, keepdim=True), e, alpha=last_alpha)
            else:
                c = c / (c.sum(-2, keepdim=True) + e)
        if end_on_row:
            c = c / (c.sum(-1, keepdim=True) + eps)
        return pre, post, c

    return fn


SPELLINGS = {
    "reference": dict(),
    "x_times_x": dict(rms="mul"),
    "sum_over_k": dict(rms="sum"),
    "matmul_operator": dict(proj="matmul"),
    "torch_mm": dict(proj="mm"),
    "rms_before_projection": dict(fold="before"),
    "exp_sum_softmax": dict(softmax="exp_sum"),
    "manual_max_softmax": dict(softmax="manual_max"),
    "post_times_two_right": dict(post2="right"),
    "float_then_flatten": dict(order="float_first"),
    "float32_dtype_reductions": dict(dtype_at="sinkhorn", acc_dtype=torch.float32),  # (the chain's own dtype)
}


def test_reference_function_matches():
    def fn(h, fn_w, scale, base):
        return hc_mixes(h, fn_w, scale, base, 20, HC_EPS, NORM_EPS)

    out, ref, rep = _run(fn)
    assert rep.sites == {"mhc_stats": 1}, rep.to_markdown()
    assert "dsv41.mhc_stats" in rep.after and "aten.exp" not in rep.after
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Sinkhorn ends on the columns: each sums to S / (S + hc_eps), with S close to 1
    assert torch.allclose(out[2].sum(-2), torch.full((9, N), 1 / (1 + HC_EPS)), atol=1e-5)


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_spellings(name):
    out, ref, rep = _run(_variant(**SPELLINGS[name]))
    assert rep.sites == {"mhc_stats": 1}, rep.to_markdown()
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "kw,reason",
    [
        (dict(iters=19), "19 iterations"),
        (dict(last_eps=1e-5), "eps"),
        (dict(end_on_row=True), "column"),
    ],
)
def test_near_misses_stay_and_compile_fast(kw, reason):
    t = time.perf_counter()
    out, ref, rep = _run(_variant(**kw))
    elapsed = time.perf_counter() - t
    assert rep.sites == {}
    assert "dsv41" not in rep.after
    assert rep.skipped and reason in rep.skipped[0].reason, rep.to_markdown()
    assert rep.pass_seconds["mhc"] < 5.0 and elapsed < 120
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kw,reason",
    [
        (dict(rms="sum_no_keepdim"), "keepdim"),
        (dict(pre_alpha=1000.0), "keyword arguments"),
        (dict(last_alpha=1e5), "keyword arguments"),
        (dict(pre_step=2), "three column slices"),
        (dict(dtype_at="rms"), "keyword arguments"),
        (dict(dtype_at="softmax", softmax="exp_sum"), "keyword arguments"),
        (dict(dtype_at="sinkhorn"), "keyword arguments"),
    ],
)
def test_near_misses_that_changed_the_result(kw, reason):
    """Spellings the walker took before and computed something else from: no keepdim on the RMS sum (M = 24, the
    mix width, so it broadcasts), an add with alpha (eps scaled), a stepped mix slice, a reduction with a dtype
    (float64 outputs came back float32)."""
    out, ref, rep = _run(_variant(**kw), m=24)
    assert rep.sites == {}, rep.to_markdown()
    assert rep.skipped and reason in rep.skipped[0].reason, rep.to_markdown()
    for a, b in zip(out, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_softmax_max_without_keepdim_is_skipped():
    """c - c.amax(-1) with no keepdim (M == n, so it broadcasts): skipped with a reason (the walker raised an
    IndexError reading amax's keepdim, and the compile failed)."""
    out, ref, rep = _run(_variant(softmax="max_no_keepdim"), m=N)
    assert rep.sites == {}, rep.to_markdown()
    assert rep.skipped and "softmax max" in rep.skipped[0].reason, rep.to_markdown()
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_a_walker_error_keeps_the_site_unrewritten(monkeypatch):
    """A graph form the walker reads wrongly (an argument it expected missing: the keepdim case above) is a skipped
    site with the error as its reason, not a failed compile."""
    from dsv41_passes.patterns import mhc_stats

    def broken(*a, **k):
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(mhc_stats, "_softmax", broken)
    torch._dynamo.reset()
    fn, args = _variant(), _args(9)
    # (no FX graph cache: the pass's uuid cannot see the patch, and a cached unrewritten graph would serve other tests)
    out, ref, rep = dp.compile(fn, REF, options={"fx_graph_cache": False})(*args), fn(*args), dp.last_report()
    assert rep.sites == {}, rep.to_markdown()
    assert "could not read this graph (IndexError" in rep.skipped[0].reason, rep.to_markdown()
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_open_ended_post_bias_is_skipped():
    """post's bias as base[n:] (to the end) instead of base[n:2n]: at hc_mult 1 it broadcasts, and post is [M, 2]
    (it was rewritten, and the op returned post [M, 1]). One Sinkhorn iteration keeps the compile short."""
    def fn(h, fn_w, scale, base):
        n = h.shape[1]
        xf = h.flatten(1).float()
        mix = F.linear(xf, fn_w) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + NORM_EPS)
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + HC_EPS
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:])
        c = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n)).softmax(-1) + HC_EPS
        return pre, post, c / (c.sum(-2, keepdim=True) + HC_EPS)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(9, 1, D, generator=g).bfloat16(), torch.randn(3, D, generator=g) / 16,
            torch.rand(3, generator=g) + 0.5, torch.randn(3, generator=g))
    torch._dynamo.reset()
    out = dp.compile(fn, dp.PassConfig(providers=("reference",), hc_sinkhorn_iters=1))(*args)
    rep = dp.last_report()
    assert rep.sites == {}, rep.to_markdown()
    assert rep.skipped and "bias of slice 1" in rep.skipped[0].reason, rep.to_markdown()
    for a, b in zip(out, fn(*args)):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_near_miss_in_batch_invariant_mode_stays_skipped():
    """The skipped site's projection GEMM is pinned (bi_matmul, a row of its own); the mhc_stats row stays skipped
    (it read 'rewritten' once the pinning had replaced its anchor)."""
    out, ref, rep = _run(_variant(iters=19), dp.PassConfig(providers=("reference",), batch_invariant=True))
    rows = {r.kind: r for r in rep.rows}
    assert rep.sites == {"bi_matmul": 1}, rep.to_markdown()
    assert rows["mhc_stats"].status == "skipped" and "19 iterations" in rows["mhc_stats"].reason
    assert rows["bi_matmul"].status == "rewritten" and "dsv41.bi_mm" in rep.after
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_iteration_count_follows_pass_config():
    out, ref, rep = _run(_variant(iters=19), dp.PassConfig(providers=("reference",), hc_sinkhorn_iters=19))
    assert rep.sites == {"mhc_stats": 1}
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def test_dynamic_token_count():
    from torch._dynamo.utils import counters

    def fn(h, fn_w, scale, base):
        return hc_mixes(h, fn_w, scale, base, 20, HC_EPS, NORM_EPS)

    torch._dynamo.reset()
    counters.clear()
    f = dp.compile(fn, REF)
    for m in (3, 17, 40):
        out = f(*_args(m))
        ref = fn(*_args(m))
        for a, b in zip(out, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    assert dp.last_report().sites == {"mhc_stats": 1}
    assert unique_graphs() == 1  # one graph for every token count: nothing guards on M


def test_inductor_online_softmax_form():
    """The form Inductor gives softmax on GPUs: prims.prepare_softmax_online, then exp(x - max) / sum."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.prepare_softmax_online)

    def fn(h, fn_w, scale, base):
        n = h.shape[1]
        xf = h.flatten(1).float()
        mix = F.linear(xf, fn_w) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + NORM_EPS)
        pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + HC_EPS
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        c = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
        mx, sm = torch.ops.prims.prepare_softmax_online(c, -1)
        c = torch.exp(c - mx) / sm + HC_EPS
        return pre, post, sinkhorn_tail(c, 20, HC_EPS)

    out, ref, rep = _run(fn)
    assert rep.sites == {"mhc_stats": 1}, rep.to_markdown()
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)


def sinkhorn_tail(c, iters, eps):
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def test_projection_weight_computed_in_the_graph_stays():
    """Two sites whose ``fn`` is computed in the graph (a bf16 weight upcast): Inductor may hand both sites one
    reused buffer, and the kernels' bf16x3 parts are cached per weight tensor, so the second site read the
    first one's parts (static weights, where the buffers are inference tensors). Such sites keep their subgraph."""
    def fn(h, w1, w2, scale, base):
        a = hc_mixes(h, w1.float(), scale, base, 20, HC_EPS, NORM_EPS)
        b = hc_mixes(h, w2.float(), scale, base, 20, HC_EPS, NORM_EPS)
        return (*a, *b)

    h, w, scale, base = _args()
    args = (h, w.bfloat16(), (w.flip(0) * 2).bfloat16(), scale, base)
    torch._dynamo.reset()
    config = dp.PassConfig(providers=("triton", "reference"), static_weights=True)
    out = dp.compile(fn, config)(*args)
    rep = dp.last_report()
    for a, b in zip(out, fn(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    assert rep.sites == {}, rep.to_markdown()
    assert len(rep.skipped) == 2, rep.to_markdown()
    assert all("computed in the graph" in r.reason for r in rep.skipped), rep.to_markdown()


def test_projection_weight_viewed_from_a_graph_input_fuses():
    """A view of a graph input (one layer of a stacked weight) is still a weight: the site is rewritten."""
    def fn(h, stacked, scale, base):
        return hc_mixes(h, stacked[1], scale, base, 20, HC_EPS, NORM_EPS)

    h, w, scale, base = _args()
    args = (h, torch.stack([w.flip(0), w]), scale, base)
    torch._dynamo.reset()
    out = dp.compile(fn, REF)(*args)
    rep = dp.last_report()
    assert rep.sites == {"mhc_stats": 1}, rep.to_markdown()
    for a, b in zip(out, fn(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
