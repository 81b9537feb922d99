"""rope_store patterns: every spelling is rewritten once; near misses keep their subgraph and say why."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dsv41_passes as dp
from dsv41_passes.patterns.rope_store import KV_SPELLINGS, Q_SPELLINGS
from dsv41_passes.reference.model import rms_norm
from dsv41_passes.reference.quant import fp8_block_qdq, ue8m0_scale
from dsv41_passes.reference.rope import apply_rotary_complex, apply_rotary_real, rope_table
from helpers import EMULATE, unique_graphs

BF16 = torch.bfloat16
H, D, RD, HPAD, ROWS, SLOTS = 4, 64, 16, 8, 40, 48
CFG = dict(mhc=False, wo_a=False, providers=("reference",))


def _tables(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    freqs = rope_table(RD, 512, 10000.0, None)[torch.randint(0, 512, (m,), generator=g)]
    return freqs, freqs.real.contiguous(), freqs.imag.contiguous()


def _rope(kind, x, freqs, cos, sin):
    return apply_rotary_complex(x, freqs) if kind == "complex" else apply_rotary_real(x, cos, sin)


class QStore(nn.Module):
    """The model's Q path: wq_b, view, RoPE on the tail in place, store into the padded buffer."""

    def __init__(self, rope="complex", tail=True, heads_at=0):
        super().__init__()
        self.rope, self.tail, self.h0 = rope, tail, heads_at
        self.wq_b = nn.Linear(32, H * D, bias=False, dtype=BF16)
        self.register_buffer("q_buf", torch.zeros(ROWS, HPAD, D, dtype=BF16))

    def forward(self, x, freqs, cos, sin):
        m = x.shape[0]
        q = self.wq_b(x).view(m, H, D)
        part = slice(-RD, None) if self.tail else slice(0, RD)
        q[..., part] = _rope(self.rope, q[..., part], freqs, cos, sin)
        self.q_buf[:m, self.h0:self.h0 + H] = q
        return self.q_buf[:m, :H].float().sum(-1)


class KVStore(nn.Module):
    """The model's KV path after wkv: norm, RoPE on the tail, FP8 round trip, store by slot."""

    def __init__(self, norm="rms_norm", rope="complex", store="index_put", block=32, quant=fp8_block_qdq,
                 dtype=BF16, per_token_table=True):
        super().__init__()
        self.norm, self.rope, self.store, self.block, self.quant = norm, rope, store, block, quant
        self.per_token_table = per_token_table
        self.weight = nn.Parameter(torch.rand(D) + 0.5)
        self.register_buffer("cache", torch.zeros(SLOTS, D, dtype=dtype))

    def forward(self, x, freqs, cos, sin, slots):
        if self.norm == "rms_norm":
            kv = rms_norm(x, self.weight, 1e-6)
        else:
            kv = F.rms_norm(x.float(), (D,), self.weight, 1e-6).to(x.dtype)
        if not self.per_token_table:
            freqs, cos, sin = freqs[:1], cos[:1], sin[:1]
        kv[..., -RD:] = _rope(self.rope, kv[..., -RD:], freqs, cos, sin)
        kv = self.quant(kv, self.block)
        if self.store == "index_copy":
            self.cache.index_copy_(0, slots, kv)
        elif self.store == "index_put":
            self.cache.index_put_((slots,), kv)
        else:
            self.cache[3:3 + kv.shape[0]] = kv
        return kv


def _q_args(m=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, 32, generator=g).to(BF16), *_tables(m, seed))


def _kv_args(m=9, seed=0, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, D, generator=g) * 4).to(dtype)
    return (x, *_tables(m, seed), torch.randperm(SLOTS, generator=g)[:m])


def _run(module, args, **cfg):
    """(compiled outputs, buffers after the compiled call, eager outputs, buffers after eager)."""
    torch._dynamo.reset()
    buf = next(iter(module.buffers()))
    start = buf.clone()
    with torch.inference_mode():
        ref = module(*args)
    ref_buf = buf.clone()
    buf.copy_(start)
    out = dp.compile(module, dp.PassConfig(**{**CFG, **cfg}), options=EMULATE)(*args)
    return out, buf.clone(), ref, ref_buf


@pytest.mark.parametrize("rope", sorted(Q_SPELLINGS))
def test_q_spellings_are_rewritten(rope):
    out, buf, ref, ref_buf = _run(QStore(rope), _q_args())
    rep = dp.last_report()
    assert rep.sites == {"q_rope_store": 1}, rep.to_markdown()
    assert "dsv41.q_rope_store" in rep.after and "slice_scatter" not in rep.after
    # the reference provider is the model's own arithmetic: bitwise equal to eager
    assert torch.equal(buf, ref_buf) and torch.equal(out, ref)


@pytest.mark.parametrize("name", sorted(KV_SPELLINGS))
def test_kv_spellings_are_rewritten(name):
    *norm, rope, store = name.split(".")
    norm = ".".join(norm)
    out, cache, ref, ref_cache = _run(KVStore(norm, rope, store), _kv_args())
    rep = dp.last_report()
    assert rep.sites == {"kv_rope_store": 1}, rep.to_markdown()
    assert "dsv41.kv_rope_quant_store" in rep.after and "index_put" not in rep.after
    if norm == "rms_norm":
        assert torch.equal(out, ref) and torch.equal(cache, ref_cache)
    else:
        # eager F.rms_norm is a fused kernel with its own summation order; the graph (and the op)
        # use the decomposition. A 1-ulp bf16 difference before quantization can move an element
        # by one FP8 step (at most 2^5 x the block scale, the e4m3 spacing in [256, 448]).
        diff = (out.float() - ref.float()).abs()
        scale = ue8m0_scale(ref.float().abs().unflatten(-1, (-1, 32)).amax(-1)).repeat_interleave(32, -1)
        assert (diff > 0).float().mean() < 0.02 and torch.all(diff <= scale * 32)
        slots = _kv_args()[-1]
        rows = slots if store == "index_put" else torch.arange(3, 3 + out.shape[0])
        assert torch.equal(cache[rows], out)
        others = torch.ones(SLOTS, dtype=torch.bool)
        others[rows] = False
        assert torch.equal(cache[others], ref_cache[others])  # no other row written


def test_index_copy_traces_like_index_put():
    out, cache, ref, ref_cache = _run(KVStore(store="index_copy"), _kv_args())
    assert dp.last_report().sites == {"kv_rope_store": 1}
    assert torch.equal(out, ref) and torch.equal(cache, ref_cache)


def test_other_fp8_block_is_supported():
    out, cache, ref, ref_cache = _run(KVStore(block=16), _kv_args())
    assert dp.last_report().sites == {"kv_rope_store": 1}
    assert torch.equal(out, ref) and torch.equal(cache, ref_cache)


def test_dynamic_token_count_one_graph():
    torch._dynamo.reset()
    module = KVStore()
    fast = dp.compile(module, dp.PassConfig(**CFG), options=EMULATE)
    n0 = None
    for m in (5, 17, 33):
        args = _kv_args(m, seed=m)
        module.cache.zero_()
        out = fast(*args)
        cache = module.cache.clone()
        n0 = n0 or unique_graphs()
        module.cache.zero_()
        with torch.inference_mode():
            assert torch.equal(out, module(*args))
        assert torch.equal(cache, module.cache)
    assert unique_graphs() == n0
    # the one graph has the fused op (a site left unrewritten where M is symbolic also compiles once)
    assert dp.last_report().sites == {"kv_rope_store": 1}, dp.last_report().to_markdown()


def _fp8_other_floor(x, block):
    # amax floor 1e-3 instead of DeepSeek's 1e-4: a different quantizer
    xf = x.float().unflatten(-1, (-1, block))
    scale = torch.exp2(torch.ceil(torch.log2(xf.abs().amax(-1, keepdim=True).clamp_min(1e-3) / 448.0)))
    return ((xf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).flatten(-2).to(x.dtype)


@pytest.mark.parametrize(
    "module,args,why",
    [
        (lambda: QStore(tail=False), _q_args, "9223372036854775807"),  # RoPE on the first rd dims
        (lambda: QStore(rope="real", tail=False), _q_args, "9223372036854775807"),
        (lambda: KVStore(quant=_fp8_other_floor), _kv_args, "0.001"),
        (lambda: KVStore(per_token_table=False), _kv_args, "is not [M, rope_dim/2]"),
        (lambda: KVStore(dtype=torch.float16), lambda: _kv_args(dtype=torch.float16), "float16"),
    ],
    ids=["q_rope_on_head", "q_real_rope_on_head", "kv_other_fp8_floor", "kv_shared_table_row", "kv_fp16"],
)
def test_near_misses_are_skipped_with_a_reason(module, args, why):
    out, buf, ref, ref_buf = _run(module(), args())
    rep = dp.last_report()
    assert rep.sites == {}, rep.to_markdown()
    assert "dsv41" not in rep.after
    assert rep.skipped and any(why in r.reason for r in rep.skipped), rep.to_markdown()
    assert torch.equal(out, ref) and torch.equal(buf, ref_buf)


def test_unverifiable_layout_is_left_alone():
    # Q heads stored at an offset: the head count sentinel binds two different values, so the
    # coarse match fails (no site, no reason); the subgraph must stay and stay correct
    out, buf, ref, ref_buf = _run(QStore(heads_at=1), _q_args())
    rep = dp.last_report()
    assert rep.sites == {} and "dsv41" not in rep.after
    assert torch.equal(out, ref) and torch.equal(buf, ref_buf)
