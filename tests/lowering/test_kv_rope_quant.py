"""The KV kernels of the RoPE/store family (``lowering/triton/kv_rope_quant.py``): both kernels and
their options compute the reference bits (interpreter on CPU; hardware conversions on the GPU), the
launcher's config choice, and the sm_90 builds (compiled without a GPU).
"""

from collections import Counter

import pytest
import torch
import triton

import dsv41_passes  # noqa: F401  (registers torch.ops.dsv41.*)
from dsv41_passes.lowering.rope_store import kv_rope_quant_reference
from dsv41_passes.lowering.triton import kv_rope_quant as tk
from helpers import POISON
from helpers import bits as _bits
from helpers import kv_case as _kv_case

BF16 = torch.bfloat16
ops = torch.ops.dsv41


def test_kv_untuned_config_by_token_count(monkeypatch):
    """Shapes the blocks kernel takes: KV_DEFAULT at every M, batch-invariant mode or not. Other shapes
    (the tile kernel): one token a program at decode sizes, four (on 2 warps past 8192 tokens) at
    prefill, KV_TILE_DEFAULT for every M in batch-invariant mode."""
    seen = []

    def spy(kind):
        class Spy:  # records the launch config; the kernels themselves are covered by the tests below
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    seen.append((kind, kw["BLOCK_T"], kw["num_warps"], kw.get("TAIL", True)))
                return launch
        return Spy()

    monkeypatch.setattr(tk, "_kv_rope_quant_kernel", spy("tile"))
    monkeypatch.setattr(tk, "_kv_rope_quant_blocks_kernel", spy("blocks"))
    ms = ((5, False), (1025, False), (tk.KV_LARGE_M_MIN, False), (5, True), (tk.KV_LARGE_M_MIN, True))
    for d, rd in ((64, 16), (96, 32)):
        for m, bi in ms:
            _, kv, weight, cos, sin, _ = _kv_case(m, d, rd, 2)
            tk.kv_rope_quant(kv, weight, 1e-6, cos, sin, 32, batch_invariant=bi)
    assert not tk.kv_blocks_ok(64, 16, 32) and tk.kv_blocks_ok(96, 32, 32) and tk.kv_blocks_ok(512, 64, 32)

    def key(kind, c):
        return kind, c["BLOCK_T"], c["num_warps"], c.get("tail", False) or c.get("blocks", False)

    small, mid, large = (key("tile", c) for c in (tk.KV_SMALL_M, tk.KV_TILE_DEFAULT, tk.KV_LARGE_M))
    blocks = key("blocks", tk.KV_DEFAULT)
    assert seen == [small, mid, large, mid, mid] + [blocks] * 5 and len({small, mid, large}) == 3


def test_kv_interleaved_tables_are_read_as_pairs():
    """cos/sin as the real view of a complex table (interleaved in memory, as the pass passes them)
    take the one-load-per-pair path; the results are the bits of planar copies, cache included."""
    from dsv41_passes.lowering.triton.kv_rope_quant import _paired_table

    cache, kv, weight, ic, is_, slots = _kv_case(13, 64, 16, 40)
    cos, sin = ic.contiguous(), is_.contiguous()
    assert _paired_table(ic, is_, 13) is not None and _paired_table(cos, sin, 13) is None
    outs = []
    for c_, s_ in ((cos, sin), (ic, is_)):
        c = cache.clone()
        outs.append((tk.kv_rope_quant(kv, weight, 1e-6, c_, s_, 32, c, slots, batch_invariant=True), c))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(outs[1][0], ops.kv_rope_quant(kv, weight, 1e-6, ic, is_, 32, "reference", 0))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4096, 65536])
def test_gpu_kv_hardware_conversions_are_the_bit_rule(m):
    """The launched kernel (hardware bf16/e4m3 conversions) and the same kernel with the
    interpreter's bit-level rounding give the same bits, cache included: the blocks kernel, and the
    tile kernel with and without the tail option (its norm is the same code on the same layout, the
    rest exact), both ways."""
    d, rd, block, slots_n = 512, 64, 32, 2 * 65536 + 1
    cache, kv, weight, cos, sin, slots = (t.cuda() for t in _kv_case(m, d, rd, slots_n, seed=3))
    for configs in ([dict(tk.KV_DEFAULT, HW=hw) for hw in (True, False)],
                    [dict(tk.KV_TILE_DEFAULT, HW=hw, tail=tail) for hw, tail in
                     ((True, False), (False, False), (True, True), (False, True))]):
        outs = []
        for cfg in configs:
            c = cache.clone()
            outs.append((tk.kv_rope_quant(kv, weight, 1e-6, cos, sin, block, c, slots, batch_invariant=True,
                                          config=cfg), c))
        for (out, c), cfg in zip(outs[1:], configs[1:]):
            assert torch.equal(_bits(outs[0][0]), _bits(out)), cfg
            assert torch.equal(_bits(outs[0][1]), _bits(c)), cfg


def test_kv_kernel_builds_for_sm90_with_hardware_conversions():
    """The GPU build as launched (compiled for sm_90 without a GPU): the roundings are single
    hardware conversions and nothing is contracted into an FMA."""
    from sm90 import build_sm90, instructions

    types = dict(kv_ptr="*i32", w_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32", slot_ptr="*i64", out_ptr="*i32",
                 cache_ptr="*i32", eps="fp32")
    builds = [dict(module="dsv41_passes.lowering.triton.kv_rope_quant", kernel="_kv_rope_quant_kernel", types=types,
                   aligned=["stride_km", "stride_om", "stride_cm", "stride_sm", "stride_cache"],
                   constexprs=dict(D=512, PAIR0=224, BLOCK=32, NB=16, BLOCK_T=1, STORE=True, PAIRED=False, HW=hw,
                                   TREE=False, TAIL=False, HALVINGS=0, PDL=False),
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
    """sum="tree" (the layout-independent sum of squares) computes the reference bits too, cache included (a fresh
    cache for each config: one the config before had filled would pass a config that stores nothing)."""
    cache, kv, weight, cos, sin, slots = _kv_case(m, d, rd, 2 * m + 3, scale)
    want = kv_rope_quant_reference(kv, weight, 1e-6, cos, sin, block)
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    for bt, w in ((1, 2), (4, 4)):
        c = cache.clone()
        out = tk.kv_rope_quant(kv, weight, 1e-6, cos, sin, block, c, slots, batch_invariant=False,
                               config=dict(BLOCK_T=bt, num_warps=w, sum="tree"))
        assert torch.equal(_bits(out), _bits(want)) and torch.equal(_bits(c[slots]), _bits(want)), bt
        assert (c[untouched] == POISON).all(), bt


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
                module="dsv41_passes.lowering.triton.kv_rope_quant", kernel="_kv_rope_quant_kernel",
                types=dict(types, w_ptr="*i64") if tail else types,
                aligned=["stride_km", "stride_om", "stride_cm", "stride_sm", "stride_cache"],
                constexprs=dict(D=512, PAIR0=224, BLOCK=32, NB=16, BLOCK_T=bt, STORE=True, PAIRED=True, HW=True,
                                TREE=tree, TAIL=tail, PDL=False,
                                HALVINGS=tk.kv_tail_halvings(512, 64, 32, bt, 4) if tail else 0),
                options=dict(num_warps=4, enable_fp_fusion=False)))
    built = build_sm90(builds)
    for i in range(0, len(built), 2):
        base, tail = (instructions(b["ptx"]) for b in built[i:i + 2])
        assert len(tail) < len(base), (builds[i]["constexprs"], len(base), len(tail))
        assert not any(x.startswith("fma.") for x in tail)
        assert "cvt.rn.bf16x2.f32" in {x.split()[0] for x in tail}
        assert built[i + 1]["usage"].get("STACK", 0) == 0


# ----------------------------------------------------------------------------- the blocks kernel
@pytest.mark.parametrize(
    "m,d,rd,block,scale",
    [
        (5, 512, 64, 32, 300.0),  # the model's shape: the rotated words are the last two quant blocks
        (6, 512, 64, 16, 2.0),  # four rotated blocks of 8 words
        (9, 96, 32, 32, 1e-3),  # three blocks padded to four, the last one rotated
        (3, 128, 128, 32, 1.0),  # everything rotates: the main tile stores nothing
        (4, 448, 64, 32, 8.0),  # 14 blocks padded to 16
    ],
)
def test_kv_blocks_option_is_the_reference(m, d, rd, block, scale):
    """blocks=True computes the reference bits for one, two and four tokens a program on one or two
    warps, with and without the cache store, interleaved and planar tables, 8-byte aligned weights
    (read as pairs) and shifted ones (fp32 loads); cache rows outside the slots untouched."""
    assert tk.kv_blocks_ok(d, rd, block)
    cache, kv, weight, icos, isin, slots = _kv_case(m, d, rd, 2 * m + 3, scale)
    want = kv_rope_quant_reference(kv, weight, 1e-6, icos, isin, block)
    shifted = torch.empty(d + 1)[1:]
    shifted.copy_(weight)
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    for i, (bt, w) in enumerate(((1, 1), (2, 1), (4, 2))):
        cfg = dict(BLOCK_T=bt, num_warps=w, blocks=True)
        tables = (icos, isin) if i % 2 else (icos.contiguous(), isin.contiguous())
        for wt in (weight, shifted):
            where = dict(BLOCK_T=bt, aligned=wt is weight)
            c = cache.clone()
            out = tk.kv_rope_quant(kv, wt, 1e-6, *tables, block, c, slots, batch_invariant=False, config=cfg)
            assert torch.equal(_bits(out), _bits(want)), where
            assert torch.equal(_bits(c[slots]), _bits(want)) and (c[untouched] == POISON).all(), where
        alone = tk.kv_rope_quant(kv, weight, 1e-6, *tables, block, batch_invariant=False, config=cfg)
        assert torch.equal(_bits(alone), _bits(want))


def test_kv_blocks_rejects_shapes_it_cannot_take():
    """Rotated words that do not fill whole quant blocks (or not a power of two of them): an explicit
    blocks config is an error; the default config is the tile kernel's."""
    for d, rd in ((64, 16), (512, 96), (512, 48)):
        assert not tk.kv_blocks_ok(d, rd, 32)
        assert tk.kv_default_config(d, rd, 32) == tk.KV_TILE_DEFAULT
        _, kv, weight, cos, sin, _ = _kv_case(2, d, rd, 2)
        with pytest.raises(ValueError, match="blocks=True"):
            tk.kv_rope_quant(kv, weight, 1e-6, cos, sin, 32, batch_invariant=False, config=tk.KV_DEFAULT)
    assert tk.kv_default_config(512, 64, 32) == tk.KV_DEFAULT
    _, kv, weight, cos, sin, _ = _kv_case(2, 512, 64, 2)
    with pytest.raises(ValueError, match="sum='tree'"):
        tk.kv_rope_quant(kv, weight, 1e-6, cos, sin, 32, batch_invariant=False, config=dict(tk.KV_DEFAULT, sum="tree"))


def test_kv_blocks_rows_do_not_depend_on_the_batch():
    """The default at the model's shape (blocks kernel, one config for every M): a token's bits are the
    same alone, among 36 others and at an odd offset, batch-invariant mode or not."""
    cache, kv, weight, cos, sin, slots = _kv_case(37, 512, 64, 80)
    for mode in (0, 1):
        out = ops.kv_rope_quant(kv, weight, 1e-6, cos, sin, 32, "triton", mode)
        for lo, hi in ((20, 21), (19, 22), (3, 36)):
            part = ops.kv_rope_quant(kv[lo:hi], weight, 1e-6, cos[lo:hi], sin[lo:hi], 32, "triton", mode)
            assert torch.equal(_bits(part), _bits(out[lo:hi])), (mode, lo, hi)


# the KV kernels' sm_90 builds as the launcher passes them (D 512 / rd 64 / block 32: int64 weight pairs,
# interleaved tables, hardware conversions)
_AS_LAUNCHED = dict(module="dsv41_passes.lowering.triton.kv_rope_quant",
                    types=dict(kv_ptr="*i32", w_ptr="*i64", cos_ptr="*i64", sin_ptr="*i64", slot_ptr="*i64",
                               out_ptr="*i32", cache_ptr="*i32", eps="fp32"),
                    aligned=["stride_km", "stride_om", "stride_cm", "stride_sm", "stride_cache"])
_AS_LAUNCHED_CONSTS = dict(D=512, PAIR0=224, BLOCK=32, NB=16, STORE=True, PAIRED=True, HW=True)


def _blocks_build(pdl: bool) -> dict:
    """KV_DEFAULT's blocks kernel (two tokens on one warp), with or without PDL."""
    return dict(_AS_LAUNCHED, kernel="_kv_rope_quant_blocks_kernel",
                constexprs=dict(_AS_LAUNCHED_CONSTS, BLOCK_T=2, PDL=pdl),
                options=dict(num_warps=1, enable_fp_fusion=False))


def test_kv_blocks_pdl_build_only_adds_the_grid_dependency_control():
    """KV_DEFAULT's ``pdl`` (compiled for sm_90 without a GPU): the kernel first lets the next grid launch,
    then waits for the previous grid, before any global access; the other PTX instructions are the
    non-PDL build's, opcode for opcode (the same arithmetic, so the same bits)."""
    from sm90 import build_sm90, instructions

    on, off = (instructions(b["ptx"]) for b in build_sm90([_blocks_build(pdl) for pdl in (True, False)]))
    gdc = [i for i, ins in enumerate(on) if ins.startswith("griddepcontrol.")]
    assert [on[i].rstrip("; ") for i in gdc] == ["griddepcontrol.launch_dependents", "griddepcontrol.wait"], gdc
    first_global = min(i for i, ins in enumerate(on) if ins.startswith(("ld.global", "st.global")))
    assert gdc[1] < first_global
    assert not any(ins.startswith("griddepcontrol.") for ins in off)
    assert Counter(ins.split()[0] for i, ins in enumerate(on) if i not in gdc) == Counter(ins.split()[0] for ins in off)


def test_pdl_needs_hopper_and_can_be_switched_off(monkeypatch):
    """PDL launches only on sm_90+ with grid-dependency control, and never with ``DSV41_PDL=off``."""
    from dsv41_passes.lowering.triton import common

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(common, "PDL_SUPPORTED", True)
    monkeypatch.setattr(common, "_capability", lambda index: (9, 0))
    monkeypatch.delenv("DSV41_PDL", raising=False)
    assert common.pdl_available(cuda) and not common.pdl_available(cpu)
    for off in ("off", "0", "False", "no"):
        monkeypatch.setenv("DSV41_PDL", off)
        assert not common.pdl_available(cuda), off
    monkeypatch.setenv("DSV41_PDL", "on")
    assert common.pdl_available(cuda)
    monkeypatch.setattr(common, "_capability", lambda index: (8, 0))  # Ampere: no griddepcontrol
    assert not common.pdl_available(cuda)
    monkeypatch.setattr(common, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(common, "PDL_SUPPORTED", False)  # a Triton without it, or the interpreter
    assert not common.pdl_available(cuda)


@pytest.mark.gpu
def test_gpu_kv_pdl_waits_for_the_kernel_before_it():
    """KV_DEFAULT launches with PDL: each call's input is written by the kernel just before it (a copy, or
    the previous call's output), and every result equals the non-PDL launch's, cache included."""
    if not tk.pdl_available(torch.device("cuda")):
        pytest.skip("PDL needs a Hopper or newer GPU and Triton's grid-dependency control")
    d, rd, block, m = 512, 64, 32, 4096
    cache, kv, weight, cos, sin, slots = (t.cuda() for t in _kv_case(m, d, rd, 2 * m + 1, seed=5))
    srcs = [kv * (1 + i / 8) for i in range(6)]
    results = {}
    for pdl in (True, False):
        cfg = dict(tk.KV_DEFAULT, pdl=pdl)
        c, buf, outs = cache.clone(), torch.empty_like(kv), []
        for src in srcs:
            buf.copy_(src)  # written by the kernel right before the KV kernel
            out = tk.kv_rope_quant(buf, weight, 1e-6, cos, sin, block, c, slots, batch_invariant=True, config=cfg)
            out = tk.kv_rope_quant(out, weight, 1e-6, cos, sin, block, c, slots.flip(0), batch_invariant=True,
                                   config=cfg)  # reads the previous KV call's output
            outs.append(out.clone())
        torch.cuda.synchronize()
        results[pdl] = (outs, c)
    for a, b in zip(results[True][0], results[False][0]):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(results[True][1]), _bits(results[False][1]))


def test_kv_blocks_builds_for_sm90_without_shared_memory():
    """The blocks kernel as launched (two tokens on one warp, int64 weight pairs, interleaved tables,
    hardware conversions), compiled for sm_90 without a GPU: no shared memory (a block's amax and a
    row's sum stay in the thread and its warp), one barrier (it keeps the loads ahead of the
    arithmetic), no FMA, no spill, the packed conversions, and fewer PTX instructions per element
    than the tile kernel's default config."""
    from sm90 import build_sm90, instructions

    blocks, tile = build_sm90([
        _blocks_build(False),
        dict(_AS_LAUNCHED, kernel="_kv_rope_quant_kernel",
             constexprs=dict(_AS_LAUNCHED_CONSTS, PDL=False, BLOCK_T=4, TREE=False, TAIL=True,
                             HALVINGS=tk.kv_tail_halvings(512, 64, 32, 4, 4)),
             options=dict(num_warps=4, enable_fp_fusion=False)),
    ])
    assert blocks["shared"] == 0 and tile["shared"] > 0
    ins = instructions(blocks["ptx"])
    ops_ = {i.split()[0] for i in ins}
    assert {"cvt.rn.satfinite.e4m3x2.f32", "cvt.rn.bf16x2.f32"} <= ops_, sorted(ops_)
    assert not any(i.startswith("fma.") for i in ins)
    assert sum(i.startswith("bar.") for i in ins) == 1  # the fence after the loads, no data exchange
    assert blocks["usage"].get("STACK", 0) == 0
    # elements a thread: 2 tokens x 512 / 32 threads (blocks), 4 x 512 / 128 (tile)
    assert len(ins) / 32 < 0.9 * len(instructions(tile["ptx"])) / 16, (len(ins), len(instructions(tile["ptx"])))


@pytest.mark.parametrize("store", [False, True])
def test_kv_strided_norm_weight(store):
    """A norm weight that is a strided view (e.g. every other element of a packed buffer) gives the reference
    bits: the kernels index it densely, so the launcher makes it contiguous (it read the wrong elements)."""
    cache, kv, weight, cos, sin, slots = _kv_case(5, 64, 16, 8)
    strided = torch.stack([weight, torch.full_like(weight, 7.0)], 1).flatten()[::2]
    assert strided.stride() == (2,) and torch.equal(strided, weight)
    want = kv_rope_quant_reference(kv, weight, 1e-6, cos, sin, 32)
    if store:
        got = ops.kv_rope_quant_store(cache, kv, strided, 1e-6, cos, sin, slots, 32, "triton", 0)
        assert torch.equal(_bits(cache[slots]), _bits(want))
    else:
        got = ops.kv_rope_quant(kv, strided, 1e-6, cos, sin, 32, "triton", 0)
    assert torch.equal(_bits(got), _bits(want))
