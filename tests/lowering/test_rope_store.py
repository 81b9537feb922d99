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
from dsv41_passes.lowering.triton import rope_store as tk
from dsv41_passes.lowering.triton.rope_store import _fp8_qdq_pairs, _unpack_bf16x2
from dsv41_passes.reference.quant import fp8_block_qdq, ue8m0_scale
from dsv41_passes.reference.rope import rope_table
from helpers import assert_within_ulps

BF16 = torch.bfloat16
ops = torch.ops.dsv41
PROVIDERS = {"reference": "reference", "triton": "triton,reference"}
POISON = -1234.0  # exactly representable in bf16


def _tables(m, rd, seed=0, max_pos=4096):
    """cos/sin as the pass passes them: strided views of view_as_real(freqs) (and freqs itself)."""
    g = torch.Generator().manual_seed(seed)
    freqs = rope_table(rd, max_pos, 10000.0, None)[torch.randint(0, max_pos, (m,), generator=g)]
    fr = torch.view_as_real(freqs)
    return freqs, fr[..., 0], fr[..., 1]


def _q_case(m, h, d, rd, hpad, rows, seed=0, strided=True):
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(m, h, d + 8, generator=g) * 3).to(BF16)
    q = base[..., :d] if strided else base[..., :d].contiguous()  # head stride d + 8
    freqs, cos, sin = _tables(m, rd, seed)
    buf = torch.full((rows, hpad, d), POISON, dtype=BF16)
    return buf, q, cos, sin, freqs


def _bits(t):
    return t.view(torch.int16)


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
    ],
)
def test_q_rope_store_bad_inputs(change, match):
    buf, q, cos, sin, _ = _q_case(13, 3, 64, 16, 8, 20)
    args = dict(buf=buf, q=q, cos=cos, sin=sin)
    args.update({k: f(args[k]) for k, f in change.items()})
    with pytest.raises(ValueError, match=match):
        ops.q_rope_store(args["buf"], args["q"], args["cos"], args["sin"], "reference", 0)


# ----------------------------------------------------------------------------- FP8
@triton.jit
def _qdq_test_kernel(x_ptr, y_ptr, NB: tl.constexpr, BLOCK: tl.constexpr, HW: tl.constexpr,
                     CLAMP_HI: tl.constexpr):
    # x: bf16 pairs as int32 words [NB, BLOCK/2]; y: fp32 [NB, BLOCK/2, 2]
    offs = tl.arange(0, NB)[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
    z0, z1 = _unpack_bf16x2(tl.load(x_ptr + offs).to(tl.uint32, bitcast=True))
    q0, q1 = _fp8_qdq_pairs(tl.expand_dims(z0, 0), tl.expand_dims(z1, 0), HW, CLAMP_HI)
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
    _qdq_test_kernel[(1,)](xp.to(dev).view(torch.int32), y, NB=pad, BLOCK=32, HW=hw, CLAMP_HI=True)
    y = y.cpu()
    want = fp8_block_qdq(x, 32)
    got = y[:nb].to(BF16)  # exact: every result has <= 4 significant bits
    assert torch.equal(y[:nb], got.float())
    bad = (_bits(got) != _bits(want)).nonzero()
    first = tuple(bad[0]) if len(bad) else None
    assert bad.numel() == 0, f"{len(bad)} elements differ, first at {first}: {got[first]} vs {want[first]}"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the NaN / inf blocks (interpreter)
@pytest.mark.parametrize("hw", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["bit_rule", "cvt_on_gpu"])
def test_fp8_upper_clamp_never_binds(hw):
    """The tail path leaves the upper FP8 clamp out: the same bits on every input, infinities and
    NaN included (a NaN element goes to -448 * scale through the lower clamp either way)."""
    dev = "cuda" if hw else ("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(11)
    odd = torch.randn(8, 32, generator=g) * 100
    for (r, c), v in {(0, 3): "inf", (1, 5): "-inf", (2, 7): "nan", (4, 0): "inf", (4, 1): "-inf",
                      (5, 2): "nan", (5, 9): "inf", (6, 31): "inf"}.items():
        odd[r, c] = float(v)
    odd[3] = float("nan")
    x = torch.cat([_fp8_edge_values().float(), odd]).to(BF16)
    pad = triton.next_power_of_2(x.shape[0])
    xp = torch.zeros(pad, 32, dtype=BF16)
    xp[: x.shape[0]] = x
    outs = []
    for clamp_hi in (True, False):
        y = torch.empty(pad, 32, device=dev)
        _qdq_test_kernel[(1,)](xp.to(dev).view(torch.int32), y, NB=pad, BLOCK=32, HW=hw, CLAMP_HI=clamp_hi)
        outs.append(y.cpu().view(torch.int32))
    assert torch.equal(outs[0], outs[1])
    assert torch.isinf(outs[0].view(torch.float32)).any()  # the infinities reached the output


# ----------------------------------------------------------------------------- KV
def _kv_case(m, d, rd, slots_n, scale=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(m, d, generator=g) * scale * torch.exp(torch.randn(m, 1, generator=g))).to(BF16)
    weight = torch.rand(d, generator=g) + 0.5
    _, cos, sin = _tables(m, rd, seed)
    slots = torch.randperm(slots_n, generator=g)[:m]
    cache = torch.full((slots_n, d), POISON, dtype=BF16)
    return cache, kv, weight, cos, sin, slots


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
    out = ops.kv_rope_quant_store(c, kv, weight, 1e-6, cos, sin, bad, 32, "triton,reference", 0)
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
    ops.q_rope_store(buf, q, cos, sin, "triton,reference", 1)
    one = buf.clone()
    ops.q_rope_store(one, q[20:21], cos[20:21], sin[20:21], "triton,reference", 1)
    assert torch.equal(one[0], buf[20])
    cache, kv, weight, kcos, ksin, slots = _kv_case(37, 64, 16, 80)
    out = ops.kv_rope_quant(kv, weight, 1e-6, kcos, ksin, 32, "triton,reference", 1)
    alone = ops.kv_rope_quant(kv[20:21], weight, 1e-6, kcos[20:21], ksin[20:21], 32, "triton,reference", 1)
    assert torch.equal(alone[0], out[20])


def test_launch_configs_agree():
    """A few of the tuner's candidates: per-row arithmetic is the same in every config."""
    buf, q, cos, sin, _ = _q_case(9, 5, 64, 16, 8, 12, strided=False)
    cache, kv, weight, kcos, ksin, slots = _kv_case(9, 64, 16, 20)
    base_q = buf.clone()
    ops.q_rope_store(base_q, q, cos, sin, "triton,reference", 0)
    base_kv = ops.kv_rope_quant(kv, weight, 1e-6, kcos, ksin, 32, "triton,reference", 0)
    try:
        for qc, kc in zip(tk.CANDIDATES["q_rope_store"][::17], tk.CANDIDATES["kv_rope_quant"][::5]):
            tuning.record("q_rope_store", tuning.bucket(9), dict(h=5, d=64, rd=16), qc)
            tuning.record("kv_rope_quant", tuning.bucket(9), dict(d=64, rd=16, block=32), kc)
            b = buf.clone()
            ops.q_rope_store(b, q, cos, sin, "triton,reference", 0)
            assert torch.equal(b, base_q), qc
            assert torch.equal(ops.kv_rope_quant(kv, weight, 1e-6, kcos, ksin, 32, "triton,reference", 0), base_kv), kc
    finally:
        tuning.clear()


def test_kv_untuned_config_by_token_count(monkeypatch):
    """Decode sizes launch one token a program, prefill four (on 2 warps past 8192 tokens); batch-invariant
    mode one config for all."""
    seen = []

    class Spy:  # records the launch config; the kernel itself is covered by the tests above
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["BLOCK_T"], kw["num_warps"], kw["TAIL"]))
            return launch

    monkeypatch.setattr(tk, "_kv_rope_quant_kernel", Spy())
    for m, bi in ((5, False), (1025, False), (tk.KV_LARGE_M_MIN, False), (5, True), (tk.KV_LARGE_M_MIN, True)):
        _, kv, weight, cos, sin, _ = _kv_case(m, 64, 16, 2)
        tk.kv_rope_quant(kv, weight, 1e-6, cos, sin, 32, batch_invariant=bi)
    small, mid, large, default = ((c["BLOCK_T"], c["num_warps"], c.get("tail", False)) for c in (
        tk.KV_SMALL_M, tk.KV_DEFAULT, tk.KV_LARGE_M, tk.KV_DEFAULT))
    assert seen == [small, mid, large, default, default] and len({small, mid, large}) == 3


def test_kv_interleaved_tables_are_read_as_pairs():
    """cos/sin as the real view of a complex table (interleaved in memory, as the pass passes them)
    take the one-load-per-pair path; the results are the bits of planar copies, cache included."""
    from dsv41_passes.lowering.triton.rope_store import _paired_table

    cache, kv, weight, ic, is_, slots = _kv_case(13, 64, 16, 40)
    cos, sin = ic.contiguous(), is_.contiguous()
    assert _paired_table(ic, is_, 13) is not None and _paired_table(cos, sin, 13) is None
    outs = []
    for c_, s_ in ((cos, sin), (ic, is_)):
        c = cache.clone()
        outs.append((tk.kv_rope_quant(kv, weight, 1e-6, c_, s_, 32, c, slots, batch_invariant=True), c))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[1][0], ops.kv_rope_quant(kv, weight, 1e-6, ic, is_, 32, "reference", 0))


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


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4096, 65536])
def test_gpu_kv_hardware_conversions_are_the_bit_rule(m):
    """The launched kernel (hardware bf16/e4m3 conversions) and the same kernel with the
    interpreter's bit-level rounding give the same bits, cache included; so does the tail option
    (its norm is the same code on the same layout, the rest exact), both ways."""
    from dsv41_passes.lowering.triton import rope_store as rk

    d, rd, block, slots_n = 512, 64, 32, 2 * 65536 + 1
    cache, kv, weight, cos, sin, slots = (t.cuda() for t in _kv_case(m, d, rd, slots_n, seed=3))
    outs = []
    for hw, tail in ((True, False), (False, False), (True, True), (False, True)):
        c = cache.clone()
        out = rk.kv_rope_quant(kv, weight, 1e-6, cos, sin, block, c, slots, batch_invariant=True,
                               config=dict(rk.KV_DEFAULT, HW=hw, tail=tail))
        outs.append((out, c))
    for out, c in outs[1:]:
        assert torch.equal(_bits(outs[0][0]), _bits(out))
        assert torch.equal(_bits(outs[0][1]), _bits(c))


def test_kv_kernel_builds_for_sm90_with_hardware_conversions():
    """The GPU build as launched (compiled for sm_90 without a GPU): the roundings are single
    hardware conversions and nothing is contracted into an FMA."""
    from sm90 import build_sm90, instructions

    types = dict(kv_ptr="*i32", w_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", slot_ptr="*i64", out_ptr="*i32",
                 cache_ptr="*i32", eps="fp32")
    builds = [dict(module="dsv41_passes.lowering.triton.rope_store", kernel="_kv_rope_quant_kernel", types=types,
                   aligned=["stride_km", "stride_om", "stride_cm", "stride_sm", "stride_cache"],
                   constexprs=dict(D=512, PAIR0=224, BLOCK=32, NB=16, BLOCK_T=1, STORE=True, PAIRED=False, HW=hw,
                                   TREE=False, TAIL=False, HALVINGS=0),
                   options=dict(num_warps=2, enable_fp_fusion=False)) for hw in (True, False)]
    builds.append(dict(builds[0], constexprs=dict(builds[0]["constexprs"], BLOCK_T=4)))
    builds.append(dict(builds[0], types=dict(types, cos_ptr="*i64", sin_ptr="*i64"),
                       constexprs=dict(builds[0]["constexprs"], BLOCK_T=4, PAIRED=True)))
    built = build_sm90(builds)
    hw_build, bit_build, planar, paired = (instructions(b["ptx"]) for b in built)
    assert not any(i.startswith("fma.") for i in paired)
    # sum="tree": no layout-ordered sum left, every tt.reduce is a max (the FP8 block amax, exact in
    # any order), so BLOCK_T / num_warps cannot change bits; the default build still sums with tl.sum
    def add_reduces(b):
        bodies = [r.split("tt.reduce.return")[0] for r in b["ttir"].split('"tt.reduce"')[1:]]
        return sum("arith.addf" in body for body in bodies), len(bodies)

    for b in build_sm90([dict(builds[3], constexprs=dict(builds[3]["constexprs"], TREE=True, BLOCK_T=bt))
                         for bt in (1, 4)]):
        assert add_reduces(b)[0] == 0 and add_reduces(b)[1] > 0, b["ttir"][-2000:]
    assert add_reduces(built[3])[0] > 0

    def loads(ins, width):
        return sum("ld.global" in i and width in i for i in ins)

    # (cos, sin) of a pair in one 8-byte load instead of two 4-byte ones
    assert loads(paired, "b64") > loads(planar, "b64") and loads(paired, ".b32") < loads(planar, ".b32")
    ops = {i.split()[0] for i in hw_build}
    assert {"cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.bf16.f32"} <= ops, sorted(ops)
    assert not any(i.startswith("fma.") for i in hw_build + bit_build)
    assert len(hw_build) < 0.8 * len(bit_build), (len(hw_build), len(bit_build))


def test_kv_tree_sum_rejects_head_dims_past_its_tree():
    kv, w = torch.zeros(2, 4096, dtype=BF16), torch.ones(4096)
    cos = sin = torch.zeros(2, 32)
    with pytest.raises(ValueError, match="1024 bf16 pairs"):
        tk.kv_rope_quant(kv, w, 1e-6, cos, sin, 32, batch_invariant=False, config=dict(BLOCK_T=1, num_warps=2,
                                                                                          sum="tree"))


@pytest.mark.parametrize("m,d,rd,block,scale", [(37, 64, 16, 32, 4.0), (9, 96, 32, 32, 1e-3), (5, 512, 64, 32, 300.0)])
def test_kv_tree_sum_option_is_the_reference(m, d, rd, block, scale):
    """sum="tree" (the layout-independent sum of squares) computes the reference bits too."""
    cache, kv, weight, cos, sin, slots = _kv_case(m, d, rd, 2 * m + 3, scale)
    want = kv_rope_quant_reference(kv, weight, 1e-6, cos, sin, block)
    for bt, w in ((1, 2), (4, 4)):
        out = tk.kv_rope_quant(kv, weight, 1e-6, cos, sin, block, cache, slots, batch_invariant=False,
                               config=dict(BLOCK_T=bt, num_warps=w, sum="tree"))
        assert torch.equal(_bits(out), _bits(want)) and torch.equal(_bits(cache[slots]), _bits(want))


# ----------------------------------------------------------------------------- KV tail option
def _valid_halvings(d, rd, block):
    """Every halving count the kernel takes for this shape (each leaves all rotated words in the last piece)."""
    nb, hb, pair0 = triton.next_power_of_2(d // block), block // 2, (d - rd) // 2
    return [k for k in range(nb.bit_length()) if (nb - (nb >> k)) * hb <= pair0]


@pytest.mark.parametrize(
    "m,d,rd,block,scale",
    [
        (5, 512, 64, 32, 300.0),  # the model's shape: the rotated words are the last two quant blocks
        (6, 512, 64, 16, 2.0),
        (37, 64, 16, 32, 4.0),  # the rotation starts inside a block (first rotated word 24, half block 16)
        (9, 96, 32, 32, 1e-3),  # three blocks padded to four, the rotation starts on the third
        (3, 128, 128, 32, 1.0),  # everything rotates: no halving
    ],
)
def test_kv_tail_option_is_the_reference(monkeypatch, m, d, rd, block, scale):
    """tail=True computes the reference bits for every halving count the kernel takes (the launcher
    picks one with kv_tail_halvings), with and without the cache store, one and four tokens a
    program, both sums, interleaved and planar rope tables; cache rows outside the slots untouched."""
    cache, kv, weight, icos, isin, slots = _kv_case(m, d, rd, 2 * m + 3, scale)
    want = kv_rope_quant_reference(kv, weight, 1e-6, icos, isin, block)
    halvings = _valid_halvings(d, rd, block)
    assert (len(halvings) > 1) == (rd < d)
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    for k in halvings:
        monkeypatch.setattr(tk, "kv_tail_halvings", lambda *a, k=k: k)
        for bt, w in ((1, 2), (4, 4)):
            for tree in (False, True):
                where = dict(halvings=k, BLOCK_T=bt, tree=tree)
                cfg = dict(BLOCK_T=bt, num_warps=w, tail=True, **(dict(sum="tree") if tree else {}))
                tables = (icos, isin) if (k + bt) % 2 else (icos.contiguous(), isin.contiguous())
                c = cache.clone()
                out = tk.kv_rope_quant(kv, weight, 1e-6, *tables, block, c, slots, batch_invariant=False,
                                       config=cfg)
                assert torch.equal(_bits(out), _bits(want)), where
                assert torch.equal(_bits(c[slots]), _bits(want)) and (c[untouched] == POISON).all(), where
                if bt == 4 and not tree:
                    alone = tk.kv_rope_quant(kv, weight, 1e-6, *tables, block, batch_invariant=False, config=cfg)
                    assert torch.equal(_bits(alone), _bits(want)), where


def test_kv_tail_halvings_and_weight_pairs(monkeypatch):
    """The launcher halves once where a thread holds two 16-byte vectors and the rotated words are in
    the second half, else not; tail=True reads the weights as int64 pairs when 8-byte aligned, as
    fp32 otherwise (and without tail), with the same bits."""
    assert tk.kv_tail_halvings(512, 64, 32, 4, 4) == 1 and tk.kv_tail_halvings(512, 64, 32, 8, 4) == 1
    assert tk.kv_tail_halvings(512, 64, 32, 1, 2) == 0 and tk.kv_tail_halvings(512, 64, 32, 4, 8) == 0
    assert tk.kv_tail_halvings(512, 512, 32, 8, 1) == 0 and tk.kv_tail_halvings(512, 288, 32, 8, 1) == 0
    seen = []
    real = tk._kv_rope_quant_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((args[1].dtype, kw["TAIL"], kw["HALVINGS"]))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(tk, "_kv_rope_quant_kernel", Spy())
    cache, kv, weight, cos, sin, slots = _kv_case(7, 64, 16, 20)
    want = kv_rope_quant_reference(kv, weight, 1e-6, cos, sin, 32)
    shifted = torch.empty(65)[1:]  # 4 bytes past an aligned allocation
    shifted.copy_(weight)
    assert weight.data_ptr() % 8 == 0 and shifted.data_ptr() % 8 == 4
    for w, tail in ((weight, True), (shifted, True), (weight, False)):
        out = tk.kv_rope_quant(kv, w, 1e-6, cos, sin, 32, batch_invariant=False,
                               config=dict(BLOCK_T=8, num_warps=1, tail=tail))
        assert torch.equal(_bits(out), _bits(want)), (w.data_ptr() % 8, tail)
    # D 64 / rd 16 at 8 tokens on 1 warp: two 16-byte vectors a thread, the rotated words in block 1
    assert seen == [(torch.int64, True, 1), (torch.float32, True, 1), (torch.float32, False, 0)]


def test_kv_tail_builds_for_sm90_with_fewer_instructions():
    """tail=True as launched on the GPU (int64 weight pairs, interleaved tables, hardware conversions,
    the launcher's halving), compiled for sm_90 without a GPU: fewer PTX instructions than the same
    config without it at BLOCK_T 4 and 8 (also with sum="tree"), no FMA, no spill, the packed bf16
    conversion in use."""
    from sm90 import build_sm90, instructions

    types = dict(kv_ptr="*i32", w_ptr="*fp32", cos_ptr="*i64", sin_ptr="*i64", slot_ptr="*i64", out_ptr="*i32",
                 cache_ptr="*i32", eps="fp32")
    builds = []
    for bt, tree in ((4, False), (8, False), (4, True)):
        for tail in (False, True):
            builds.append(dict(
                module="dsv41_passes.lowering.triton.rope_store", kernel="_kv_rope_quant_kernel",
                types=dict(types, w_ptr="*i64") if tail else types,
                aligned=["stride_km", "stride_om", "stride_cm", "stride_sm", "stride_cache"],
                constexprs=dict(D=512, PAIR0=224, BLOCK=32, NB=16, BLOCK_T=bt, STORE=True, PAIRED=True, HW=True,
                                TREE=tree, TAIL=tail, HALVINGS=tk.kv_tail_halvings(512, 64, 32, bt, 4) if tail else 0),
                options=dict(num_warps=4, enable_fp_fusion=False)))
    built = build_sm90(builds)
    for i in range(0, len(built), 2):
        base, tail = (instructions(b["ptx"]) for b in built[i:i + 2])
        assert len(tail) < len(base), (builds[i]["constexprs"], len(base), len(tail))
        assert not any(x.startswith("fma.") for x in tail)
        assert "cvt.rn.bf16x2.f32" in {x.split()[0] for x in tail}
        assert built[i + 1]["usage"].get("STACK", 0) == 0
