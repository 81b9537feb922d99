"""mhc_post: every spelling is rewritten once; near misses keep their subgraph and say why."""

import pytest
import torch

import dsv41_passes as dp
from dsv41_passes.patterns.mhc import POST_SPELLINGS
from dsv41_passes.reference.mhc import hc_post, sinkhorn
from helpers import unique_graphs

BF16 = torch.bfloat16


def _args(m=9, d=48, dtype=BF16):
    g = torch.Generator().manual_seed(m)
    return (
        torch.randn(m, d, generator=g).to(dtype),
        torch.randn(m, 4, d, generator=g).to(dtype),
        2 * torch.rand(m, 4, generator=g),
        sinkhorn(torch.randn(m, 4, 4, generator=g), 20, 1e-6),
    )


def _compile(fn, **cfg):
    torch._dynamo.reset()
    return dp.compile(fn, dp.PassConfig(**cfg))


@pytest.mark.parametrize("name", sorted(POST_SPELLINGS))
def test_each_spelling_is_rewritten(name):
    fn = POST_SPELLINGS[name]
    args = _args()
    out = _compile(fn)(*args)
    rep = dp.last_report()
    assert rep.sites == {"mhc_post": 1}, rep.to_markdown()
    assert "dsv41.mhc_post" in rep.after
    torch.testing.assert_close(out.float(), fn(*args).float(), rtol=0, atol=2 ** -6 * out.abs().max().item())
    assert torch.equal(out, hc_post(*args)) or (out != hc_post(*args)).float().mean() < 0.01


def test_reference_module_function_and_dynamic_m():
    from torch._dynamo.utils import counters

    f = _compile(hc_post)
    counters.clear()
    for m in (3, 17, 64):
        args = _args(m)
        assert torch.equal(f(*args), hc_post(*args))
    assert dp.last_report().sites == {"mhc_post": 1}
    assert unique_graphs() == 1  # one graph for every token count: nothing guards on M


def _transposed_comb(y, res, post, comb):
    # comb[k, j] instead of comb[j, k]: same ops, other dims; must not be rewritten
    return (post.unsqueeze(-1) * y.unsqueeze(1) + (comb.unsqueeze(-1) * res.unsqueeze(1)).sum(2)).to(BF16)


def _half_output(y, res, post, comb):
    return (post.unsqueeze(-1) * y.unsqueeze(1) + (comb.unsqueeze(-1) * res.unsqueeze(2)).sum(1)).to(torch.float16)


@pytest.mark.parametrize("fn,why", [(_transposed_comb, "dim"), (_half_output, "float16")])
def test_near_misses_are_skipped_with_a_reason(fn, why):
    args = _args()
    out = _compile(fn)(*args)
    rep = dp.last_report()
    assert rep.sites == {}
    assert "dsv41" not in rep.after
    assert rep.skipped and why in rep.skipped[0].reason, rep.to_markdown()
    torch.testing.assert_close(out, fn(*args))


def test_post_and_comb_shared_by_every_token_are_skipped():
    """post [1, n] and comb [1, n, n] broadcast over the tokens: the op takes them per token, so the site stays
    (it was rewritten, and the op then raised on the shapes)."""
    y, res, post, comb = _args()
    post, comb = post[:1], comb[:1]
    out = _compile(hc_post)(y, res, post, comb)
    rep = dp.last_report()
    assert rep.sites == {} and rep.skipped and "not per token" in rep.skipped[0].reason, rep.to_markdown()
    assert torch.equal(out, hc_post(y, res, post, comb))


def test_fp16_residual_is_skipped():
    args = _args(dtype=torch.float16)

    def fn(y, res, post, comb):
        return (post.unsqueeze(-1) * y.unsqueeze(1) + (comb.unsqueeze(-1) * res.unsqueeze(2)).sum(1)).to(torch.float16)

    _compile(fn)(*args)
    assert dp.last_report().sites == {}


def test_family_switch():
    _compile(hc_post, mhc=False)(*_args())
    rep = dp.last_report()
    assert rep.sites == {} and not rep.rows
