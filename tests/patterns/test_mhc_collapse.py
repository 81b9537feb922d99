"""mhc_collapse: collapse (+ RMSNorm) spellings rewritten once; near misses skipped with reasons."""

import pytest
import torch

import dsv41_passes as dp
from dsv41_passes.patterns import mhc as mhc_patterns
from dsv41_passes.patterns.mhc import COLLAPSE_TERMS, _collapse_norm, _collapse_only
from dsv41_passes.reference.mhc import hc_collapse
from dsv41_passes.reference.model import rms_norm

REF = dp.PassConfig(providers=("reference",))
BF16 = torch.bfloat16
# the collapse's mean square is about 12: an eps this large moves rstd by about 0.4 %, past bf16 rounding, so a rewrite
# that drops the matched eps (or passes another) changes the bits
NORM_EPS = 0.05


def _args(m=9, d=48, wdtype=torch.float32):
    g = torch.Generator().manual_seed(m)
    return (
        (3 * torch.randn(m, 4, d, generator=g)).to(BF16),
        torch.rand(m, 4, generator=g) + 1e-6,
        (1 + 0.1 * torch.randn(d, generator=g)).to(wdtype),
    )


def _run(fn, args, config=REF):
    torch._dynamo.reset()
    out = dp.compile(fn, config)(*args)
    return out, dp.last_report()


@pytest.mark.parametrize("term", sorted(COLLAPSE_TERMS))
@pytest.mark.parametrize("norm", [None, "weight_first", "weight_last"])
def test_spellings(term, norm):
    h, pre, w = _args()
    if norm is None:
        fn = _collapse_only(COLLAPSE_TERMS[term])
        args = (h, pre)
    else:
        search = _collapse_norm(COLLAPSE_TERMS[term], norm == "weight_first")

        def fn(h, pre, w):
            return search(h, pre, w, NORM_EPS)

        args = (h, pre, w)
    out, rep = _run(fn, args)
    assert rep.sites == {"mhc_collapse": 1}, rep.to_markdown()
    ref = hc_collapse(h, pre)
    if norm is not None:
        ref = rms_norm(ref, w, NORM_EPS)
        assert "rsqrt" not in rep.after  # the norm went into the fused op
    assert torch.equal(out, ref)  # the reference provider does the reference's arithmetic, roundings included


@pytest.mark.parametrize("term", sorted(COLLAPSE_TERMS))
def test_functional_rms_norm_after_the_collapse(term):
    """``F.rms_norm`` on the collapse (its decomposition adds eps as add.Scalar): the norm goes into the fused op
    (only the collapse was rewritten before), with the reference's bits."""
    import torch.nn.functional as F

    h, pre, w = _args()
    collapse = _collapse_only(COLLAPSE_TERMS[term])

    def fn(h, pre, w):
        return F.rms_norm(collapse(h, pre).float(), (h.shape[-1],), w, NORM_EPS).to(BF16)

    out, rep = _run(fn, (h, pre, w))
    assert rep.sites == {"mhc_collapse": 1} and "rsqrt" not in rep.after, rep.to_markdown()
    assert torch.equal(out, fn(h, pre, w))


def test_model_functions_with_bf16_weight_and_tiny_eps():
    """A tiny eps is bound as it is: the streams are scaled so that the mean square is of its order (a rewrite that
    dropped it, or passed the usual 1e-6, changes every element)."""
    h, pre, w = _args(wdtype=BF16)
    h = (h.float() * 2.0**-33).to(BF16)  # exact: mean square about 1e-20

    def fn(h, pre, w):
        return rms_norm(hc_collapse(h, pre), w, 1e-20)

    out, rep = _run(fn, (h, pre, w))
    assert rep.sites == {"mhc_collapse": 1}
    assert torch.equal(out, fn(h, pre, w))


def test_wrong_reduction_dim_is_a_near_miss():
    h, pre, _ = _args(m=4, d=4)

    def fn(h, pre):  # sums over hidden instead of streams: same ops, other dim
        return (pre.unsqueeze(1) * h.float()).sum(2).to(BF16)

    out, rep = _run(fn, (h, pre))
    assert rep.sites == {}
    assert rep.skipped and "dim" in rep.skipped[0].reason, rep.to_markdown()
    assert torch.equal(out, fn(h, pre))


def test_fp16_streams_are_skipped():
    h, pre, _ = _args()
    h = h.half()

    def fn(h, pre):
        return (pre.unsqueeze(-1) * h.float()).sum(1).to(torch.float16)

    _, rep = _run(fn, (h, pre))
    assert rep.sites == {}


def _unrounded_collapse_norm(h, pre, w):
    """Collapse + RMSNorm with no bf16 rounding between them."""
    xf = (pre.unsqueeze(-1) * h.float()).sum(1)
    return (w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6))).to(BF16)


def test_dropped_round_trip_form_restores_the_reference_rounding(monkeypatch):
    """Where Inductor drops the collapse's bf16 round trip before the norm (torch 2.11's joint-graph passes, without
    emulate_precision_casts), the pattern still matches and the fused op rounds where the reference does."""
    monkeypatch.setattr(mhc_patterns, "_inductor_drops_bf16_round_trips", lambda: True)
    h, pre, w = _args()

    out, rep = _run(_unrounded_collapse_norm, (h, pre, w))
    assert rep.sites == {"mhc_collapse": 1}, rep.to_markdown()
    assert torch.equal(out, rms_norm(hc_collapse(h, pre), w, 1e-6))


def test_without_the_rounding_where_inductor_keeps_casts_stays(monkeypatch):
    """Where this torch's Inductor keeps a narrowing round trip, a graph without it is a program without it: the
    fused op would add a rounding (the case a probe of the public API found rewritten on torch 2.13)."""
    monkeypatch.setattr(mhc_patterns, "_inductor_drops_bf16_round_trips", lambda: False)
    h, pre, w = _args()

    out, rep = _run(_unrounded_collapse_norm, (h, pre, w))
    assert rep.sites == {} and "keeps such casts" in rep.skipped[0].reason, rep.to_markdown()
    assert not torch.equal(out, rms_norm(hc_collapse(h, pre), w, 1e-6))  # (the rounding it would have added)


def test_round_trip_probe_agrees_with_inductor():
    """The probe says what Inductor does to the model's own spelling: the bf16 convert is in the post-grad graph
    exactly where the probe says it is kept."""
    h, pre, w = _args()

    def fn(h, pre, w):
        x = (pre.unsqueeze(-1) * h.float()).sum(1).to(BF16)
        xf = x.float()
        return (w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6))).to(BF16)

    _, rep = _run(fn, (h, pre, w), dp.PassConfig(mhc=False, providers=("reference",)))
    lines = rep.before.splitlines()
    kept = any("convert_element_type" in ln and "torch.bfloat16" in ln and "sum" in ln for ln in lines)
    assert kept != mhc_patterns._inductor_drops_bf16_round_trips(), rep.before


def test_without_the_rounding_under_emulated_casts_stays():
    """With emulate_precision_casts Inductor keeps every cast: a graph without the bf16 round trip is a program
    without it, and rewriting it would add a rounding (it changed a quarter of the elements by up to 2**-5)."""
    h, pre, w = _args()

    torch._dynamo.reset()
    out = dp.compile(_unrounded_collapse_norm, REF, options={"emulate_precision_casts": True})(h, pre, w)
    rep = dp.last_report()
    assert rep.sites == {} and "emulate_precision_casts" in rep.skipped[0].reason, rep.to_markdown()
    torch.testing.assert_close(out, _unrounded_collapse_norm(h, pre, w), rtol=0, atol=0)


def test_without_the_rounding_when_inductor_pattern_matching_is_off_stays(monkeypatch):
    """Inductor drops the collapse's round trip in its joint-graph pattern passes, which pattern_matcher=False turns
    off: a graph without it is then a program without it, even on a torch whose Inductor drops such round trips."""
    monkeypatch.setattr(mhc_patterns, "_inductor_drops_bf16_round_trips", lambda: True)  # torch 2.11's answer
    h, pre, w = _args()

    torch._dynamo.reset()
    out = dp.compile(_unrounded_collapse_norm, REF, options={"pattern_matcher": False})(h, pre, w)
    rep = dp.last_report()
    assert rep.sites == {} and "pattern_matcher" in rep.skipped[0].reason, rep.to_markdown()
    torch.testing.assert_close(out, _unrounded_collapse_norm(h, pre, w), rtol=0, atol=0)
