"""mhc_fuse: the op-level fusions (mhc_pre, mhc_boundary) never build an op that needs its own output."""

import torch

import dsv41_passes as dp
from dsv41_passes.reference.mhc import hc_collapse, hc_mixes, hc_post

N, D, M = 4, 32, 9
REF = dict(providers=("reference",))
EMULATE = {"emulate_precision_casts": True}


def _close(out, ref):
    for a, b in zip(out, ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0)


def test_collapse_weights_from_the_new_residual_keep_post_and_pre_apart():
    """The collapse weights are computed from the post's output h: one mhc_boundary would need its own output
    (the compile failed in Inductor's topological sort)."""
    def fn(y, res, post, comb, fn_w, scale, base):
        h = hc_post(y, res, post, comb)
        pre, post2, comb2 = hc_mixes(h, fn_w, scale, base, 20, 1e-6, 1e-6)
        return hc_collapse(h, torch.softmax(h.float().sum(-1), -1)), pre, post2, comb2

    g = torch.Generator().manual_seed(1)
    args = (torch.randn(M, D, generator=g).bfloat16(), torch.randn(M, N, D, generator=g).bfloat16(),
            torch.rand(M, N, generator=g) * 2, torch.rand(M, N, N, generator=g),
            torch.randn(24, N * D, generator=g) / 16, torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g))
    torch._dynamo.reset()
    out = dp.compile(fn, dp.PassConfig(**REF, mhc_boundary=True), options=EMULATE)(*args)
    rep = dp.last_report()
    assert "mhc_boundary" not in {r.op for r in rep.rows}, rep.to_markdown()
    assert rep.sites == {"mhc_stats": 1, "mhc_collapse": 1, "mhc_post": 1}, rep.to_markdown()
    _close(out, fn(*args))


def test_v4_wiring_behind_a_long_chain_stays_two_ops():
    """The collapse uses these stats' pre through a chain of 4200 nodes (past the walk's old bound of 4096, which
    then answered 'independent' and fused them into a cycle)."""
    def fn(h, fn_w, scale, base, t, a):
        pre, post, comb = hc_mixes(h, fn_w, scale, base, 20, 1e-6, 1e-6)
        for _ in range(2100):
            t = t * a + a
        return hc_collapse(h, pre * t), post, comb

    g = torch.Generator().manual_seed(1)
    args = (torch.randn(M, N, D, generator=g).bfloat16(), torch.randn(24, N * D, generator=g) / 16,
            torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g), torch.ones(M, 1), torch.full((M, 1), 0.5))
    torch._dynamo.reset()
    out = dp.compile(fn, dp.PassConfig(**REF), options=EMULATE)(*args)
    rep = dp.last_report()
    assert {r.op for r in rep.rows} == {"mhc_stats", "mhc_collapse"}, rep.to_markdown()
    assert any("V4 wiring" in r.reason for r in rep.rows), rep.to_markdown()
    _close(out, fn(*args))
