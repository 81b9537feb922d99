"""Numerics of the reference subgraphs against float64 recomputations."""

import math

import numpy as np
import pytest
import torch

from dsv41_passes.reference.mhc import hc_collapse, hc_mixes, hc_post, sinkhorn
from dsv41_passes.reference.quant import fp8_block_qdq
from dsv41_passes.reference.rope import (
    apply_rotary_complex,
    apply_rotary_real,
    inv_frequencies,
    rope_table,
    yarn_correction_range,
)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (float64)."""
    a = x.double().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def assert_within_one_rounding(out_bf16: torch.Tensor, ref64: torch.Tensor, slack: float = 1.0):
    """|out - ref| <= slack * ulp_bf16(ref): the bf16 result is one rounding of the exact value."""
    err = (out_bf16.double() - ref64).abs()
    bound = slack * bf16_ulp(ref64) + 1e-30
    assert torch.all(err <= bound), f"max err/ulp = {(err / bound).max().item():.3f}"


def test_sinkhorn_doubly_stochastic():
    # 20 iterations converge to 1e-5 for logits of moderate spread (std 0.5); wider
    # spreads converge more slowly, which is the reference's behaviour, not a bug.
    logits = torch.randn(4097, 4, 4) * 0.5
    c = sinkhorn(logits, 20, 1e-6)
    assert torch.allclose(c.sum(-1), torch.ones(4097, 4), atol=1e-5)
    assert torch.allclose(c.sum(-2), torch.ones(4097, 4), atol=1e-5)
    assert (c > 0).all()


def test_model_comb_doubly_stochastic():
    from dsv41_passes.reference import DeepseekV41Config, DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM(DeepseekV41Config.tiny())
    h = model.embed(torch.randint(0, 256, (300,))).unsqueeze(1).repeat(1, 4, 1)
    for blk in model.layers:
        for site in ("attn", "ffn"):
            _, _, comb = blk._mixes(h, site)
            assert torch.allclose(comb.sum(-1), torch.ones(300, 4), atol=1e-5)
            assert torch.allclose(comb.sum(-2), torch.ones(300, 4), atol=1e-5)


def test_mixes_against_float64():
    m, n, d = 33, 4, 64
    hc_eps, norm_eps = 1e-3, 1e-2  # apart, and large enough to show against a mean square of 1
    h = torch.randn(m, n, d).to(torch.bfloat16)
    fn = torch.randn(24, n * d) / 16
    scale, base = torch.rand(3) + 0.5, torch.randn(24)
    pre, post, comb = hc_mixes(h, fn, scale, base, 20, hc_eps, norm_eps)
    xf = h.flatten(1).double()
    mix = (xf @ fn.double().T) / torch.sqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    s, b = scale.double(), base.double()
    pre64 = torch.sigmoid(mix[:, :4] * s[0] + b[:4]) + hc_eps
    post64 = 2 * torch.sigmoid(mix[:, 4:8] * s[1] + b[4:8])
    c = (mix[:, 8:] * s[2] + b[8:]).view(m, 4, 4).softmax(-1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(19):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    torch.testing.assert_close(pre.double(), pre64, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(post.double(), post64, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(comb.double(), c, rtol=2e-5, atol=2e-6)


def test_collapse_and_post_one_rounding_from_float64():
    m, n, d = 65, 4, 96
    h = (torch.randn(m, n, d) * 3).to(torch.bfloat16)
    y = torch.randn(m, d).to(torch.bfloat16)
    pre = torch.rand(m, n) + 1e-6
    post = 2 * torch.rand(m, n)
    comb = sinkhorn(torch.randn(m, n, n), 20, 1e-6)
    out = hc_collapse(h, pre)
    ref = (pre.double().unsqueeze(-1) * h.double()).sum(1)
    # fp32 math then one bf16 rounding: within one bf16 ulp (half an ulp + fp32 noise)
    assert_within_one_rounding(out, ref)
    newres = hc_post(y, h, post, comb)
    ref = post.double().unsqueeze(-1) * y.double().unsqueeze(1) + torch.einsum(
        "mjk,mjd->mkd", comb.double(), h.double()
    )
    assert_within_one_rounding(newres, ref)
    # and the rounding really happens once: re-rounding the float64 value gives the same bits almost always
    same = (newres == ref.to(torch.bfloat16)).double().mean().item()
    assert same > 0.99


def complex64_reference(x: torch.Tensor, pos: torch.Tensor, inv_freq64: torch.Tensor, inverse: bool):
    ang = pos.double()[:, None] * inv_freq64[None, :]
    f = torch.polar(torch.ones_like(ang), -ang if inverse else ang)
    xc = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    shape = (x.shape[0], *([1] * (x.dim() - 2)), f.shape[-1])
    return torch.view_as_real(xc * f.view(shape)).flatten(-2)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(
    "scaling", [None, dict(factor=16, original_max_position_embeddings=64, beta_fast=32, beta_slow=1)]
)
def test_rope_spellings_within_one_ulp_of_float64(inverse, scaling):
    rd, maxpos = 64, 512
    base = 10000.0 if scaling is None else 160000.0
    table = rope_table(rd, maxpos, base, scaling)
    pos = torch.randint(0, maxpos, (40,))
    x = torch.randn(40, 3, rd).to(torch.bfloat16)
    inv64 = torch.tensor(_inv_freq64(rd, base, scaling))
    ref = complex64_reference(x, pos, inv64, inverse)
    out_c = apply_rotary_complex(x, table[pos], inverse=inverse)
    t = torch.view_as_real(table[pos])
    out_r = apply_rotary_real(x, t[..., 0].contiguous(), t[..., 1].contiguous(), inverse=inverse)
    # fp32 table angles are off by up to pos * ulp(freq); allow that on top of one rounding
    for out in (out_c, out_r):
        err = (out.double() - ref).abs()
        bound = bf16_ulp(ref) + 4 * maxpos * 2.0**-24 * x.double().abs().amax()
        assert torch.all(err <= bound)
    assert (out_c != out_r).double().mean() < 0.01  # the two spellings agree bitwise almost everywhere


def _inv_freq64(rd, base, scaling):
    freqs = 1.0 / (base ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    if scaling:
        orig, factor = scaling["original_max_position_embeddings"], scaling["factor"]

        def corr(rot):
            return rd * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(scaling["beta_fast"])), 0)
        high = min(math.ceil(corr(scaling["beta_slow"])), rd - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(rd // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def test_yarn_table_matches_float64():
    scaling = dict(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
    inv = inv_frequencies(64, 160000.0, scaling).double()
    inv64 = torch.tensor(_inv_freq64(64, 160000.0, scaling))
    torch.testing.assert_close(inv, inv64, rtol=2e-6, atol=0)
    low, high = yarn_correction_range(32, 1, 64, 160000.0, 65536)
    assert 0 <= low < high <= 63
    # interpolated dims are divided by the factor, fast dims untouched
    assert torch.allclose(inv64[high:], torch.tensor(_inv_freq64(64, 160000.0, None))[high:] / 16)
    table = rope_table(64, 1024, 160000.0, scaling)
    pos = torch.arange(1024, dtype=torch.float64)
    ang = pos[:, None] * inv64[None, :]
    ref = torch.polar(torch.ones_like(ang), ang)
    err = (table.to(torch.complex128) - ref).abs()
    assert err.max() < 1024 * 4 * 2.0**-24 + 1e-6


def _ue8m0_qdq_float64(x: np.ndarray, block: int) -> np.ndarray:
    """Float64 statement of the rule: power-of-two scale, e4m3 round-to-nearest-even, dequantize."""
    xb = x.astype(np.float64).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(xb).max(-1, keepdims=True), 1e-4)
    scale = np.exp2(np.ceil(np.log2(amax / 448.0)))
    v = xb / scale
    a = np.abs(v)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    quantum = np.where(a >= 2.0**-6, np.exp2(e - 3), 2.0**-9)  # 3 mantissa bits; subnormal step 2^-9
    r = np.round(v / quantum) * quantum  # numpy rounds half to even
    r = np.clip(r, -448, 448)
    return (r * scale).reshape(x.shape)


def test_fp8_roundtrip_bitwise_against_float64_rule():
    g = torch.Generator().manual_seed(1)
    parts = [
        torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 1), generator=g).float()),
        torch.randn(8, 256, generator=g) * 1e-6,  # amax below the 1e-4 floor
        torch.zeros(2, 256),
    ]
    x = torch.cat(parts).to(torch.bfloat16)
    # blocks whose amax sits exactly on a power-of-two boundary of the scale
    x[0, :32] = 0.5
    x[0, 0] = 448.0
    x[1, 32:64] = -448.0 * 2.0**-5
    x[2, :32] = torch.linspace(-3, 3, 32).to(torch.bfloat16)
    out = fp8_block_qdq(x, 32)
    ref = _ue8m0_qdq_float64(x.float().numpy(), 32)
    assert out.dtype == torch.bfloat16
    np.testing.assert_array_equal(out.float().numpy(), ref.astype(np.float32))
    assert np.array_equal(ref.astype(np.float32).astype(np.float64), ref)  # exact in fp32/bf16
