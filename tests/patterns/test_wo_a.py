"""wo_a: every spelling is rewritten once into dsv41::wo_a; near misses keep their subgraph and say why."""

import os
import re

import pytest
import torch
from torch import nn

import dsv41_passes as dp
from dsv41_passes.patterns.wo_a import SPELLINGS
from dsv41_passes.reference.rope import apply_rotary_complex, apply_rotary_real, rope_table

BF16 = torch.bfloat16
# provider of CPU tensors: the Triton interpreter where TRITON_INTERPRET=1 (conftest sets it on CPU machines), the
# reference elsewhere; decided here, not with the library's own triton_available
CPU_KERNEL = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"
H, D, G, R, RD = 4, 64, 2, 32, 16  # the tiny model's attention tail
K = H // G * D


def _weight(shape=(G * R, K), seed=1):
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter((torch.randn(*shape, generator=g) / K**0.5).to(BF16), requires_grad=False)


def _rope_inputs(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(m, H, D, generator=g).to(BF16)
    freqs = rope_table(RD, 512, 10000.0, None)[torch.randint(0, 512, (m,), generator=g)]
    return o, freqs


class Spelled(nn.Module):
    """One search spelling with the weight as a parameter (static shape, as in a model)."""

    def __init__(self, name):
        super().__init__()
        self.fn = SPELLINGS[name]
        self.kind = name.split("_rope_")[0] if "_rope_" in name else "no"
        self.weight = _weight()

    def forward(self, o, freqs):
        if self.kind == "complex":
            return self.fn(o, freqs, self.weight, G, -RD)
        if self.kind == "real":
            return self.fn(o, freqs.real.contiguous(), freqs.imag.contiguous(), self.weight, G, -RD)
        return self.fn(o, self.weight, G)


def _compile(fn, **cfg):
    # no FX graph cache: the pass runs on every compile, so each test reads its own report
    torch._dynamo.reset()
    return dp.compile(fn, dp.PassConfig(**cfg), options={"fx_graph_cache": False})


def _fused_calls(after: str) -> list[str]:
    return [ln for ln in after.splitlines() if "dsv41.wo_a" in ln]


def _close(out, ref):
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-3 * ref.float().abs().mean().item())


@pytest.mark.parametrize("m", [9, 1], ids=["M9", "M1"])  # M = 1 (decode) gets its own, static graph
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_each_spelling_is_rewritten(name, m):
    mod = Spelled(name)
    o, freqs = _rope_inputs(m)
    out = _compile(mod)(o, freqs)
    rep = dp.last_report()
    assert rep.sites == {"wo_a": 1}, rep.to_markdown()
    assert rep.rows[0].provider == CPU_KERNEL, rep.to_markdown()
    (call,) = _fused_calls(rep.after)
    if mod.kind == "no":
        assert ", None, None, 0," in call, call
    else:
        assert f", {RD}," in call, call  # the inverse RoPE went into the fused op
        assert not re.search(r"view_as_complex|aten\.neg|slice_scatter", rep.after), rep.after
    with torch.inference_mode():
        ref = mod(o, freqs)
    _close(out, ref)


class AttentionTail(nn.Module):
    """The model's code (Attention.forward after the attention)."""

    def __init__(self):
        super().__init__()
        self.wo_a = nn.Linear(K, G * R, bias=False, dtype=BF16)
        self.wo_a.weight = _weight()

    def forward(self, o, freqs):
        m = o.shape[0]
        o = o * 1  # an intermediate, as the attention output is
        o[..., -RD:] = apply_rotary_complex(o[..., -RD:], freqs, inverse=True)
        og = o.view(m, G, -1)
        wa = self.wo_a.weight.view(G, R, -1)
        return torch.einsum("mgd,grd->mgr", og, wa).flatten(1)


def test_model_code_with_dynamic_m():
    mod = AttentionTail()
    f = _compile(mod)
    for m in (3, 17, 64):
        o, freqs = _rope_inputs(m, seed=m)
        out = f(o, freqs)
        with torch.inference_mode():
            _close(out, mod(o, freqs))
    rep = dp.last_report()
    assert rep.sites == {"wo_a": 1}, rep.to_markdown()
    assert rep.rows[0].provider == CPU_KERNEL


def test_token_strided_attention_output():
    """o read in place from a head-padded buffer: row stride (H + 2) * D > H * D."""
    weight = _weight()

    def fn(buf):
        o = (buf * 2)[:, :H]
        return torch.einsum("mgd,grd->mgr", o.view(o.shape[0], G, -1), weight.view(G, R, -1)).flatten(1)

    buf = torch.randn(11, H + 2, D).to(BF16)
    out = _compile(fn)(buf)
    rep = dp.last_report()
    assert rep.sites == {"wo_a": 1}, rep.to_markdown()
    _close(out, fn(buf))


# ------------------------------------------------------------------ near misses
def _einsum_tail(og, wa):
    return torch.einsum("mgd,grd->mgr", og, wa).flatten(1)


def _transposed_weight_view(o, weight):
    # the [G*R, K] weight transposed before the grouped view: another matrix, same ops after the copy
    return _einsum_tail(o.view(o.shape[0], G, -1), weight.t().reshape(G, R, K))


def _other_group_count(o, weight):
    # o [M, 8, 32]: the views make 4 groups of K = 64, the weight [G*R, K] holds 2 groups of K = 128
    return _einsum_tail(o.view(o.shape[0], 4, -1), weight.view(4, -1, K // 2))


def _half_precision(o, weight):
    o = o.half()
    return _einsum_tail(o.view(o.shape[0], G, -1), weight.half().view(G, R, -1))


@pytest.mark.parametrize(
    "fn,o_shape,why",
    [
        (_transposed_weight_view, (H, D), "weight (128, 64) is not [G*R, K] for G = 2, K = 128"),
        (_other_group_count, (8, 32), "weight (64, 128) is not [G*R, K] for G = 4, K = 64"),
        (_half_precision, (H, D), "float16"),
    ],
    ids=["transposed_weight_view", "other_group_count", "half_precision"],
)
def test_near_misses_are_skipped_with_a_reason(fn, o_shape, why):
    weight = _weight()
    o = torch.randn(9, *o_shape).to(BF16)
    out = _compile(lambda x: fn(x, weight))(o)
    rep = dp.last_report()
    assert rep.sites == {}, rep.to_markdown()
    assert "dsv41" not in rep.after
    assert rep.skipped and any(why in r.reason for r in rep.skipped), rep.to_markdown()
    torch.testing.assert_close(out, fn(o, weight))


def test_inverse_rope_on_the_wrong_dims_stays_unfused():
    """RoPE on the first dims of each head: the projection fuses alone, the rotation stays in the graph."""
    weight = _weight()

    def fn(o, cos, sin):
        o = o * 1
        o[..., :RD] = apply_rotary_real(o[..., :RD], cos, sin, inverse=True)
        return _einsum_tail(o.view(o.shape[0], G, -1), weight.view(G, R, -1))

    o, freqs = _rope_inputs(9)
    args = (o, freqs.real.contiguous(), freqs.imag.contiguous())
    out = _compile(fn)(*args)
    rep = dp.last_report()
    assert rep.sites == {"wo_a": 1}, rep.to_markdown()
    (call,) = _fused_calls(rep.after)
    assert ", None, None, 0," in call, call
    assert "slice_scatter" in rep.after and "aten.neg" in rep.after
    _close(out, fn(*args))


def test_family_switch():
    mod = Spelled("complex_rope_einsum")
    _compile(mod, wo_a=False)(*_rope_inputs(9))
    rep = dp.last_report()
    assert rep.sites == {} and "dsv41.wo_a" not in rep.after
