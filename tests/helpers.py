"""Shared test helpers: the tiny model, packed batches, compile counters."""

from __future__ import annotations

import torch

from dsv41_passes.reference import DeepseekV41Config, DeepseekV41ForCausalLM

EMULATE = {"emulate_precision_casts": True}  # Inductor rounds like eager: compiled == eager bit for bit on CPU


# the tiny preset's hc_eps and rms_norm_eps are both 1e-6: set apart, a fused op given one for the other changes the
# logits (the model's mHC stats and collapse norms both use rms_norm_eps)
EPS_APART = dict(hc_eps=1e-3, rms_norm_eps=1e-2)


def tiny_model(max_num_tokens: int = 1024, **overrides) -> DeepseekV41ForCausalLM:
    return DeepseekV41ForCausalLM(
        DeepseekV41Config.tiny(**{**EPS_APART, **overrides}), max_num_tokens=max_num_tokens, max_num_seqs=8
    ).eval()


def packed(lengths, vocab: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(list(lengths)).cumsum(0).tolist()])
    return ids, pos, cu


def eager(model, *args):
    model.reset_cache()
    with torch.inference_mode():
        return model(*args)


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    a = x.double().abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def assert_within_ulps(
    out: torch.Tensor, ref64: torch.Tensor, ulps: float = 1.0, floor: torch.Tensor | None = None
) -> None:
    """|out - ref| <= ulps * ulp_bf16(ref) (+ floor) elementwise (ref in float64).

    ``floor`` carries the fp32 arithmetic error where terms cancel: there the exact result is
    smaller than the rounding error of the terms that produced it, so no fp32 kernel (and no
    eager fp32 code) can be within one bf16 ulp of it.
    """
    err = (out.double() - ref64).abs()
    bound = ulps * bf16_ulp(ref64)
    if floor is not None:
        bound = bound + floor
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert torch.all(err <= bound), f"max error {worst:.3f} x the bound ({ulps} bf16 ulp)"


# RoPE/store test data (tests/lowering/test_rope_store.py and test_kv_rope_quant.py)
POISON = -1234.0  # exactly representable in bf16


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def rope_case_tables(m: int, rd: int, seed: int = 0, max_pos: int = 4096):
    """cos/sin as the pass passes them: strided views of view_as_real(freqs) (and freqs itself)."""
    from dsv41_passes.reference.rope import rope_table

    g = torch.Generator().manual_seed(seed)
    freqs = rope_table(rd, max_pos, 10000.0, None)[torch.randint(0, max_pos, (m,), generator=g)]
    fr = torch.view_as_real(freqs)
    return freqs, fr[..., 0], fr[..., 1]


def kv_case(m: int, d: int, rd: int, slots_n: int, scale: float = 4.0, seed: int = 0):
    """A KV batch: (cache poisoned, kv with per-row magnitudes, fp32 weight, cos, sin, distinct slots)."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(m, d, generator=g) * scale * torch.exp(torch.randn(m, 1, generator=g))).to(torch.bfloat16)
    weight = torch.rand(d, generator=g) + 0.5
    _, cos, sin = rope_case_tables(m, rd, seed)
    slots = torch.randperm(slots_n, generator=g)[:m]
    cache = torch.full((slots_n, d), POISON, dtype=torch.bfloat16)
    return cache, kv, weight, cos, sin, slots
