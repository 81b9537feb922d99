"""torch.library.opcheck over the mHC and batch-invariant matmul ops (the RoPE/store and WO-A ops
have theirs beside their numerics tests), with every provider the machine can run."""

import pytest
import torch

from dsv41_passes.lowering.registry import encode_mode

BF16 = torch.bfloat16


def _mhc_args(m=5, d=64):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(m, 4, d, generator=g).to(BF16)
    fn = torch.randn(24, 4 * d, generator=g) / 16
    sc, base, pre = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g), torch.rand(m, 4, generator=g)
    w = torch.rand(d, generator=g) + 0.5
    y, post, comb = (
        torch.randn(m, d, generator=g).to(BF16), torch.rand(m, 4, generator=g), torch.rand(m, 4, 4, generator=g)
    )
    return dict(h=h, fn=fn, sc=sc, base=base, pre=pre, w=w, y=y, post=post, comb=comb)


CASES = {
    "mhc_post": lambda a: (a["y"], a["h"], a["post"], a["comb"]),
    "mhc_stats": lambda a: (a["h"], a["fn"], a["sc"], a["base"], 20, 1e-6, 1e-6),
    "mhc_collapse": lambda a: (a["h"], a["pre"], a["w"], 1e-6),
    "mhc_pre": lambda a: (a["h"], a["pre"], a["fn"], a["sc"], a["base"], a["w"], 20, 1e-6, 1e-6, 1e-6),
    "mhc_boundary": lambda a: (a["y"], a["h"], a["post"], a["comb"], a["pre"], a["fn"], a["sc"], a["base"], a["w"],
                               20, 1e-6, 1e-6, 1e-6),
    "bi_mm": lambda a: (a["y"], a["h"][:, 0].t().contiguous()),
    "bi_bmm": lambda a: (a["h"], a["h"].transpose(1, 2).contiguous()),
}


@pytest.mark.parametrize("providers", ["reference", "triton"])  # "triton" alone: no fallback to the reference
@pytest.mark.parametrize("op", sorted(CASES))
def test_opcheck(op, providers):
    args = CASES[op](_mhc_args())
    torch.library.opcheck(getattr(torch.ops.dsv41, op).default, (*args, providers, encode_mode(False)))


def test_collapse_without_norm_weight():
    a = _mhc_args()
    torch.library.opcheck(torch.ops.dsv41.mhc_collapse.default, (a["h"], a["pre"], None, 0.0, "reference", 0))


@pytest.mark.parametrize("providers", ["reference", "triton"])  # "triton" alone: no fallback to the reference
def test_batch_invariant_matmuls_give_a_row_the_same_bits_at_any_m(providers):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 40, generator=g).to(BF16)
    row = torch.randn(1, 48, generator=g).to(BF16)
    outs = []
    for m, p in ((1, 0), (5, 4), (70, 33)):
        a = torch.randn(m, 48, generator=g).to(BF16)
        a[p] = row[0]
        mm = torch.ops.dsv41.bi_mm(a, w, providers, encode_mode(True))
        _assert_one_rounding(mm, a, w)
        outs.append(mm[p])
        b = torch.randn(m, 3, 48, generator=g).to(BF16)
        b[p] = row.expand(3, 48)
        wb = w.expand(m, 48, 40).contiguous()
        bmm = torch.ops.dsv41.bi_bmm(b, wb, providers, encode_mode(True))
        _assert_one_rounding(bmm, b, wb)
        outs.append(bmm[p][0])
    assert all(torch.equal(outs[0], o) for o in outs[::2]) and all(torch.equal(outs[1], o) for o in outs[1::2])


def _assert_one_rounding(out, a, b):
    """The product itself, not only the same bits at every M: one bf16 rounding of the float64 product, plus the
    fp32 accumulation's error where the 48 terms cancel."""
    from helpers import assert_within_ulps

    assert out.shape == (*a.shape[:-1], b.shape[-1]) and out.dtype == a.dtype
    terms = a.double().abs() @ b.double().abs()
    assert_within_ulps(out, a.double() @ b.double(), 1.0, floor=terms * 2.0**-16)
