"""RoPE/store fused ops: numerics against float64 and the reference rule, untouched memory, bad inputs.

On CPU the Triton provider runs under the interpreter. Its arithmetic is the reference's
operation for operation (no FMA, IEEE sqrt/division, explicit bf16 roundings), so the
interpreted kernels are asserted *bitwise* equal to the reference providers; the Q RoPE is
also checked against a float64 complex product (within 1 bf16 ulp).
"""

import pytest
import torch
import triton
import triton.language as tl

import dsv41_passes  # noqa: F401  (registers torch.ops.dsv41.*)
from dsv41_passes import tuning
from dsv41_passes.lowering.rope_store import kv_rope_quant_reference, rope_tail_reference
from dsv41_passes.lowering.triton import kv_rope_quant as tkv
from dsv41_passes.lowering.triton import rope_store as tk
from dsv41_passes.lowering.triton.rope_store import _fp8_qdq_pairs, _unpack_bf16x2
from dsv41_passes.reference.quant import fp8_block_qdq, ue8m0_scale
from dsv41_passes.reference.rope import rope_table
from helpers import POISON, assert_within_ulps
from helpers import bits as _bits
from helpers import kv_case as _kv_case
from helpers import rope_case_tables as _tables

BF16 = torch.bfloat16
ops = torch.ops.dsv41
PROVIDERS = {"reference": "reference", "triton": "triton"}  # "triton" alone: a declining kernel raises, no fallback


def _q_case(m, h, d, rd, hpad, rows, seed=0, strided=True):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(m, h, d + 8, generator=g) * 3).to(BF16)
    q = base[..., :d] if strided else base[..., :d].contiguous()  # head stride d + 8
    freqs, cos, sin = _tables(m, rd, seed)
    buf = torch.full((rows, hpad, d), POISON, dtype=BF16)
    return buf, q, cos, sin, freqs


# ----------------------------------------------------------------------------- Q
@pytest.mark.parametrize("provider", sorted(PROVIDERS))
@pytest.mark.parametrize("m,h,d,rd,hpad,rows", [(13, 3, 64, 16, 8, 20), (3, 16, 512, 64, 64, 4)])
def test_q_rope_store_numerics_and_untouched_memory(provider, m, h, d, rd, hpad, rows):
    buf, q, cos, sin, freqs = _q_case(m, h, d, rd, hpad, rows)
    ops.q_rope_store(buf, q, cos, sin, PROVIDERS[provider], 0)
    live = buf[:m, :h]
    assert torch.equal(live[..., : d - rd], q[..., : d - rd])  # the un-rotated dims are a plain copy
    x = q[..., d - rd:].double().unflatten(-1, (-1, 2))
    want = torch.view_as_real(torch.complex(x[..., 0], x[..., 1]) * freqs.to(torch.complex128)[:, None, :]).flatten(-2)
    assert_within_ulps(live[..., d - rd:], want, 1.0)
    assert torch.equal(live, rope_tail_reference(q, cos, sin))  # and the reference's bits exactly
    assert (buf[m:] == POISON).all() and (buf[:, h:] == POISON).all()  # rows >= M, pad heads


def test_q_rope_store_zero_tokens():
    buf, q, cos, sin, _ = _q_case(0, 3, 64, 16, 8, 20)
    for p in PROVIDERS.values():
        ops.q_rope_store(buf, q, cos, sin, p, 0)
    assert (buf == POISON).all()


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=lambda a: a.half()), "bfloat16"),
        (dict(buf=lambda a: a[:, :2]), "padded heads"),
        (dict(buf=lambda a: a[:5]), "do not fit"),
        (dict(buf=lambda a: a[..., :32]), "head_dim"),
        (dict(cos=lambda a: a[:4], sin=lambda a: a[:4]), "rows"),
        (dict(cos=lambda a: a[:4]), "differ"),
        (dict(cos=lambda a: a.double(), sin=lambda a: a.double()), "float32"),
        (dict(cos=lambda a: torch.zeros(13, 40), sin=lambda a: torch.zeros(13, 40)), "rope dims"),
        (dict(q=lambda a: a[0]), r"\[M, heads, head_dim\]"),
        (dict(buf=lambda a: a[:1].expand(20, -1, -1)), "share memory"),
    ],
)
def test_q_rope_store_bad_inputs(change, match):
    buf, q, cos, sin, _ = _q_case(13, 3, 64, 16, 8, 20)
    args = dict(buf=buf, q=q, cos=cos, sin=sin)
    args.update({k: f(args[k]) for k, f in change.items()})
    with pytest.raises(ValueError, match=match):
        ops.q_rope_store(args["buf"], args["q"], args["cos"], args["sin"], "reference", 0)


def test_q_and_kv_stores_read_their_inputs_before_writing_over_them():
    """q inside the Q buffer one row further on, and a KV cache that is the kv tensor itself (other slots): the
    Triton kernels stored over rows other programs had still to read; they now work from a copy (the reference
    provider's bits). q as the buffer's own rows (the model's in-place use) needs none."""
    m, h, d, rd = 6, 2, 16, 8
    _, cos, sin = _tables(m, rd)
    init = (torch.randn(m + 1, h, d, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    got = {}
    for p in ("triton", "reference"):
        base = init.clone()
        ops.q_rope_store(base[1:], base[:m], cos, sin, p, 0)
        got[p] = base
    assert torch.equal(_bits(got["triton"]), _bits(got["reference"]))

    _, kv, weight, kcos, ksin, _ = _kv_case(4, 32, 16, 4)
    slots = torch.tensor([1, 2, 3, 0])
    res = {}
    for p in ("triton", "reference"):
        buf = kv.clone()
        out = ops.kv_rope_quant_store(buf, buf, weight, 1e-6, kcos, ksin, slots, 8, p, 0)
        res[p] = (out, buf)
    assert torch.equal(_bits(res["triton"][0]), _bits(res["reference"][0]))
    assert torch.equal(_bits(res["triton"][1]), _bits(res["reference"][1]))


# ----------------------------------------------------------------------------- FP8
@triton.jit
def _qdq_test_kernel(x_ptr, y_ptr, NB: tl.constexpr, BLOCK: tl.constexpr, HW: tl.constexpr):
    # x: bf16 pairs as int32 words [NB, BLOCK/2]; y: fp32 [NB, BLOCK/2, 2]
    offs = tl.arange(0, NB)[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    z0, z1 = _unpack_bf16x2(tl.load(x_ptr + offs).to(tl.uint32, bitcast=True))
    q0, q1 = _fp8_qdq_pairs(tl.expand_dims(z0, 0), tl.expand_dims(z1, 0), HW)
    tl.store(y_ptr + 2 * offs, tl.reshape(q0, (NB, BLOCK // 2)))
    tl.store(y_ptr + 2 * offs + 1, tl.reshape(q1, (NB, BLOCK // 2)))


def _fp8_edge_values() -> torch.Tensor:
    """Blocks of 32 bf16 values that stress the scale exponent and the e4m3 rounding."""
    g = torch.Generator().manual_seed(7)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()  # 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties: must round to the even code
    blocks = [
        torch.cat([mids[: 32 - 1], torch.tensor([448.0])]),  # amax 448: scale exactly 1
        torch.cat([mids[-31:], torch.tensor([448.0])]) * -1,
        torch.cat([mids[:31] * 2.0**-10, torch.tensor([448.0 * 2.0**-10])]),  # subnormal ties at scale 2^-10
        torch.full((32,), 1.75) * torch.exp2(torch.arange(32.0) - 16),  # amax = 1.75 * 2^e: f == 0.75 boundary
        torch.full((32,), 1.7578125) * 2.0**3,  # just above the boundary (next bf16 after 1.75)
        torch.zeros(32),  # all zero: amax floor 1e-4
        torch.tensor([-0.0, 0.0] * 16),  # signed zeros must keep their sign
        torch.full((32,), 3e-5) * torch.randn(32, generator=g),  # below the amax floor
        torch.full((32,), 1e30) * torch.randn(32, generator=g),  # huge
        torch.full((32,), 3e38) * torch.sign(torch.randn(32, generator=g)),  # near bf16 max
    ]
    rand = torch.randn(48, 32, generator=g) * torch.exp2(torch.randint(-40, 40, (48, 1), generator=g).float())
    return torch.cat([torch.stack(blocks), rand]).to(BF16)


@pytest.mark.parametrize("hw", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["bit_rule", "cvt_on_gpu"])
def test_fp8_qdq_is_bitwise_the_reference_rule(hw):
    """The e4m3 rounding on the fp32 bits (interpreter and GPU) and the GPU's cvt.rn.satfinite
    conversion the launched kernel uses, both against the reference rule."""
    dev = "cuda" if hw else ("cuda" if torch.cuda.is_available() else "cpu")
    x = _fp8_edge_values()
    nb = x.shape[0]
    pad = triton.next_power_of_2(nb)
    xp = torch.zeros(pad, 32, dtype=BF16)
    xp[:nb] = x
    y = torch.empty(pad, 32, device=dev)
    _qdq_test_kernel[(1,)](xp.to(dev).view(torch.int32), y, NB=pad, BLOCK=32, HW=hw)
    y = y.cpu()
    want = fp8_block_qdq(x, 32)
    got = y[:nb].to(BF16)  # exact: every result has <= 4 significant bits
    assert torch.equal(y[:nb], got.float())
    bad = (_bits(got) != _bits(want)).nonzero()
    first = tuple(bad[0]) if len(bad) else None
    assert bad.numel() == 0, f"{len(bad)} elements differ, first at {first}: {got[first]} vs {want[first]}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the NaN / inf blocks (interpreter)
@pytest.mark.parametrize("hw", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["bit_rule", "cvt_on_gpu"])
def test_fp8_round_trip_keeps_nan_and_infinities(hw):
    """No clamp in the round trip: a NaN element stays NaN (a clamp to +-448 would make it a finite
    +-448 * scale), +-inf stays +-inf, the other elements of those blocks stay finite (their scale is
    the infinite block's 2^120: they flush to zero), and the hardware conversion gives the bit rule's
    results (NaN where it gives NaN, the same bits elsewhere)."""
    dev = "cuda" if hw else ("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(11)
    odd = torch.randn(8, 32, generator=g) * 100
    special = {(0, 3): "inf", (1, 5): "-inf", (2, 7): "nan", (4, 0): "inf", (4, 1): "-inf",
               (5, 2): "nan", (5, 9): "inf", (6, 31): "inf"}
    for (r, c), v in special.items():
        odd[r, c] = float(v)
    odd[3] = float("nan")
    x = torch.cat([_fp8_edge_values().float(), odd]).to(BF16)
    pad = triton.next_power_of_2(x.shape[0])
    xp = torch.zeros(pad, 32, dtype=BF16)
    xp[: x.shape[0]] = x
    outs = []
    for mode in sorted({hw, False}):
        y = torch.empty(pad, 32, device=dev)
        _qdq_test_kernel[(1,)](xp.to(dev).view(torch.int32), y, NB=pad, BLOCK=32, HW=mode)
        outs.append(y.cpu())
    y = outs[-1][: x.shape[0]]
    xf = x.float()
    assert torch.equal(torch.isnan(y), torch.isnan(xf))
    inf = torch.isinf(xf)
    assert torch.equal(torch.isinf(y), inf) and torch.equal(torch.sign(y[inf]), torch.sign(xf[inf]))
    finite = ~torch.isnan(xf) & ~inf
    assert torch.isfinite(y[finite]).all()
    nan_free = ~torch.isnan(outs[0])
    assert torch.equal(torch.isnan(outs[0]), torch.isnan(outs[-1]))
    assert torch.equal(outs[0][nan_free].view(torch.int32), outs[-1][nan_free].view(torch.int32))


# ----------------------------------------------------------------------------- KV
@pytest.mark.parametrize("provider", sorted(PROVIDERS))
@pytest.mark.parametrize("m,d,rd,block,scale", [(37, 64, 16, 32, 4.0), (9, 96, 32, 32, 1e-3), (5, 512, 64, 32, 300.0)])
def test_kv_rope_quant_store_is_the_reference(provider, m, d, rd, block, scale):
    cache, kv, weight, cos, sin, slots = _kv_case(m, d, rd, 2 * m + 3, scale)
    out = ops.kv_rope_quant_store(cache, kv, weight, 1e-6, cos, sin, slots, block, PROVIDERS[provider], 0)
    want = kv_rope_quant_reference(kv, weight, 1e-6, cos, sin, block)
    assert torch.equal(_bits(out), _bits(want))
    assert torch.equal(_bits(cache[slots]), _bits(want))
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert (cache[untouched] == POISON).all()
    alone = ops.kv_rope_quant(kv, weight, 1e-6, cos, sin, block, PROVIDERS[provider], 0)
    assert torch.equal(_bits(alone), _bits(want))


def test_kv_slot_semantics():
    cache, kv, weight, cos, sin, _ = _kv_case(4, 64, 16, 10)
    slots = torch.tensor([0, -1, 5, -10])  # negative slots count from the end, like index_put
    outs = {}
    for name, p in PROVIDERS.items():
        c = cache.clone()
        outs[name] = ops.kv_rope_quant_store(c, kv, weight, 1e-6, cos, sin, slots, 32, p, 0)
        assert torch.equal(c[[0, 9, 5, 0]][1:3], outs[name][1:3]) and torch.equal(c[0], outs[name][3])
    assert torch.equal(outs["reference"], outs["triton"])
    # out of range: the reference raises; the kernel cannot, and skips the row instead of writing out of bounds
    bad = torch.tensor([1, 10, 2, 3])
    with pytest.raises(IndexError):
        ops.kv_rope_quant_store(cache.clone(), kv, weight, 1e-6, cos, sin, bad, 32, "reference", 0)
    c = cache.clone()
    out = ops.kv_rope_quant_store(c, kv, weight, 1e-6, cos, sin, bad, 32, "triton", 0)
    assert torch.equal(c[[1, 2, 3]], out[[0, 2, 3]]) and (c[[0, 4, 5, 6, 7, 8, 9]] == POISON).all()


def test_kv_zero_tokens():
    cache, kv, weight, cos, sin, slots = _kv_case(0, 64, 16, 10)
    for p in PROVIDERS.values():
        assert ops.kv_rope_quant_store(cache, kv, weight, 1e-6, cos, sin, slots, 32, p, 0).shape == (0, 64)
        assert ops.kv_rope_quant(kv, weight, 1e-6, cos, sin, 32, p, 0).shape == (0, 64)
    assert (cache == POISON).all()


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(eps=0.0), "eps"),
        (dict(eps=float("nan")), "eps"),
        (dict(block=24), "divide"),
        (dict(slots=lambda a: a.int()), "int64"),
        (dict(slots=lambda a: a[:3]), r"slots must be \[M\]"),
        (dict(weight=lambda a: a.to(BF16)), "float32"),
        (dict(cache=lambda a: a.half()), "bfloat16"),
        (dict(cache=lambda a: a[:, :32]), "cache must be"),
        (dict(cache=lambda a: a[:1].expand(a.shape[0], -1)), "share memory"),
        (dict(kv=lambda a: a.float()), "bfloat16"),
        (dict(cos=lambda a: torch.zeros(5, 40), sin=lambda a: torch.zeros(5, 40)), "rope dims"),
        (dict(cos=lambda a: a[:, None], sin=lambda a: a[:, None]), "cos/sin must be"),
    ],
)
def test_kv_bad_inputs(change, match):
    cache, kv, weight, cos, sin, slots = _kv_case(5, 64, 16, 10)
    args = dict(cache=cache, kv=kv, weight=weight, eps=1e-6, cos=cos, sin=sin, slots=slots, block=32)
    args.update({k: (f(args[k]) if callable(f) else f) for k, f in change.items()})
    with pytest.raises(ValueError, match=match):
        ops.kv_rope_quant_store(*args.values(), "reference", 0)


# ----------------------------------------------------------------------------- op contracts
def test_opcheck():
    buf, q, cos, sin, _ = _q_case(5, 3, 64, 16, 8, 10)
    for p in PROVIDERS.values():
        torch.library.opcheck(ops.q_rope_store.default, (buf, q, cos, sin, p, 0))
        cache, kv, weight, kcos, ksin, slots = _kv_case(5, 64, 16, 10)
        torch.library.opcheck(ops.kv_rope_quant_store.default, (cache, kv, weight, 1e-6, kcos, ksin, slots, 32, p, 0))
        torch.library.opcheck(ops.kv_rope_quant.default, (kv, weight, 1e-6, kcos, ksin, 32, p, 0))


def test_rows_do_not_depend_on_the_batch():
    """Batch-invariant mode: a token's bits are the same alone and among 36 others."""
    buf, q, cos, sin, _ = _q_case(37, 3, 64, 16, 8, 40)
    ops.q_rope_store(buf, q, cos, sin, "triton", 1)
    one = buf.clone()
    ops.q_rope_store(one, q[20:21], cos[20:21], sin[20:21], "triton", 1)
    assert torch.equal(one[0], buf[20])
    cache, kv, weight, kcos, ksin, slots = _kv_case(37, 64, 16, 80)
    out = ops.kv_rope_quant(kv, weight, 1e-6, kcos, ksin, 32, "triton", 1)
    alone = ops.kv_rope_quant(kv[20:21], weight, 1e-6, kcos[20:21], ksin[20:21], 32, "triton", 1)
    assert torch.equal(alone[0], out[20])


def test_launch_configs_agree(monkeypatch):
    """A few of the tuner's candidates (those that fit the shape): per-row arithmetic is the same in every
    config, under the interpreter; at D 96 both KV kernels fit. Each config is recorded under the launchers' own
    shape keys and read back (a record the launcher does not look up runs the default again, and tests nothing)."""
    monkeypatch.delenv("DSV41_TACTICS", raising=False)
    buf, q, cos, sin, _ = _q_case(9, 5, 64, 16, 8, 12, strided=False)
    base_q = buf.clone()
    ops.q_rope_store(base_q, q, cos, sin, "triton", 0)
    try:
        for qc in tk.CANDIDATES["q_rope_store"][::17]:
            tuning.record("q_rope_store", tuning.bucket(9), tk.q_shape_key(q, cos), qc)
            assert tuning.tactic("q_rope_store", 9, tk.q_shape_key(q, cos), default={}) == qc
            b = buf.clone()
            ops.q_rope_store(b, q, cos, sin, "triton", 0)
            assert torch.equal(b, base_q), qc
        for d, rd in ((64, 16), (96, 32)):
            cache, kv, weight, kcos, ksin, slots = _kv_case(9, d, rd, 20)
            base_kv = ops.kv_rope_quant(kv, weight, 1e-6, kcos, ksin, 32, "triton", 0)
            fits = [c for c in tkv.CANDIDATES["kv_rope_quant"] if not c.get("blocks") or tkv.kv_blocks_ok(d, rd, 32)]
            assert any(c.get("blocks") for c in fits) == (d == 96)
            for kc in fits[::4]:
                tuning.record("kv_rope_quant", tuning.bucket(9), tkv.kv_shape_key(kv, kcos, 32), kc)
                assert tuning.tactic("kv_rope_quant", 9, tkv.kv_shape_key(kv, kcos, 32), default={}) == kc
                out = ops.kv_rope_quant(kv, weight, 1e-6, kcos, ksin, 32, "triton", 0)
                assert torch.equal(out, base_kv), (d, kc)
    finally:
        tuning.clear()


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m", [65536, 65537])
def test_gpu_q_store_writes_every_element_at_64k(m):
    """TP4 per-rank shape into a 4 GiB padded buffer: int64 offsets, every live element, nothing else."""
    h, hpad, d, rd = 16, 64, 512, 64
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(m, h * d, device=dev, generator=g).to(BF16).view(m, h, d)
    freqs = rope_table(rd, 1 << 17, 10000.0, None).to(dev)[torch.randint(0, 1 << 17, (m,), device=dev, generator=g)]
    fr = torch.view_as_real(freqs)
    buf = torch.empty(m + 3, hpad, d, dtype=BF16, device=dev)  # > 4 GiB
    buf.view(torch.int16).fill_(-32767)  # a NaN pattern nothing writes
    ops.q_rope_store(buf, q, fr[..., 0], fr[..., 1], "triton,reference", 0)
    torch.cuda.synchronize()
    for lo in range(0, m, 8192):  # compare in chunks: float64 temporaries per chunk
        hi = min(m, lo + 8192)
        got, x = buf[lo:hi, :h], q[lo:hi]
        assert torch.equal(got[..., : d - rd], x[..., : d - rd]), lo
        xt = x[..., d - rd:].double().unflatten(-1, (-1, 2))
        f = freqs[lo:hi].to(torch.complex128)[:, None, :]
        # fp32 products: where x0*c and x1*s cancel, their rounding (2^-24 each) bounds the error
        terms = (xt[..., 0].abs() * f.real.abs() + xt[..., 1].abs() * f.imag.abs()).unsqueeze(-1).expand(*xt.shape)
        floor = (terms * 2.0**-23).flatten(-2)
        assert_within_ulps(got[..., d - rd:], torch.view_as_real(torch.complex(xt[..., 0], xt[..., 1]) * f).flatten(-2),
                           floor=floor)
    untouched = buf[:, h:].view(torch.int16)
    assert (untouched == -32767).all() and (buf[m:].view(torch.int16) == -32767).all()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4096, 65536])
def test_gpu_kv_matches_cpu_rule(m):
    """Real sizes on the GPU against the CPU reference (the exact rule) on a sample of rows."""
    d, rd, block, slots_n = 512, 64, 32, 2 * 65536 + 1
    cache, kv, weight, cos, sin, slots = _kv_case(m, d, rd, slots_n)
    c_gpu = cache.cuda()
    out = ops.kv_rope_quant_store(c_gpu, kv.cuda(), weight.cuda(), 1e-6, cos.cuda(), sin.cuda(), slots.cuda(), block,
                                  "triton,reference", 0).cpu()
    rows = torch.arange(m)[:: max(1, m // 2048)]
    want = kv_rope_quant_reference(kv[rows], weight, 1e-6, cos[rows], sin[rows], block)
    same = _bits(out[rows]) == _bits(want)
    # the only operation whose order differs from torch's is the RMS sum of squares: a 1-ulp
    # difference of the normalised value can move an element by one FP8 step, rarely
    assert same.float().mean() > 0.999
    scale = ue8m0_scale(want.float().unflatten(-1, (-1, block)).abs().amax(-1, keepdim=True)).expand(-1, -1, block)
    step = torch.maximum(out[rows].float().abs(), want.float().abs()) * 2.0**-3 + scale.flatten(-2) * 2.0**-9
    assert ((out[rows].float() - want.float()).abs() <= step).all()
    assert torch.equal(c_gpu.cpu()[slots], out)




def test_pair_kernels_decline_a_storage_that_starts_off_a_word():
    """The Triton kernels load bf16 pairs as 4-byte words: a tensor at offset 0 of a storage that itself starts 2
    bytes into a buffer is declined (the check looked at the storage offset only)."""
    from dsv41_passes.lowering.rope_store import _pair_words_why

    raw = bytearray(2 + 4 * 8 * 2)
    t = torch.frombuffer(raw, dtype=torch.bfloat16, offset=2).view(4, 8)
    assert t.storage_offset() == 0 and t.data_ptr() % 4 == 2
    assert "4-byte aligned" in _pair_words_why(q=t)
    assert _pair_words_why(q=torch.zeros(4, 8, dtype=torch.bfloat16)) is None
