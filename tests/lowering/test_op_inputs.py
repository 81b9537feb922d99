"""A call that mixes a ``meta`` tensor with CPU tensors dispatches to the op's fake impl; it must raise as the real
op does, not hand back an uninitialised tensor or skip a store (each op, each tensor argument in turn)."""

import pytest
import torch

import dsv41_passes  # noqa: F401  (registers torch.ops.dsv41.*)

OPS = ("mhc_post", "mhc_stats", "mhc_collapse", "mhc_pre", "mhc_boundary", "q_rope_store", "kv_rope_quant_store",
       "kv_rope_quant", "wo_a", "bi_mm", "bi_bmm")


def _args(op, meta_at):
    """Placeholder arguments from the op's schema: tensors [2, 2, 2] on CPU but the ``meta_at``-th on meta."""
    schema = getattr(torch.ops.dsv41, op).default._schema
    args, k = [], 0
    for a in schema.arguments:
        t = str(a.type)
        if t.startswith("Tensor") or t == "Optional[Tensor]":
            args.append(torch.zeros(2, 2, 2, device="meta" if k == meta_at else "cpu"))
            k += 1
        else:
            args.append({"int": 1, "float": 1e-6, "str": "reference"}[t])
    return args, k


@pytest.mark.parametrize("op", OPS)
def test_meta_beside_cpu_raises(op):
    _, n = _args(op, -1)
    assert n >= 2
    for i in range(n):
        args, _ = _args(op, i)
        with pytest.raises(ValueError, match="one device"):
            getattr(torch.ops.dsv41, op)(*args)


def test_q_store_reference_takes_a_q_whose_head_dim_is_strided():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 64, 4, generator=g).bfloat16().transpose(1, 2)  # [5, 4, 64], head_dim stride 4
    ang = torch.rand(5, 8, generator=g)
    cos, sin = ang.cos(), ang.sin()
    bufs = [torch.zeros(8, 8, 64, dtype=torch.bfloat16) for _ in range(2)]
    torch.ops.dsv41.q_rope_store(bufs[0], q, cos, sin, "reference", 0)
    torch.ops.dsv41.q_rope_store(bufs[1], q.contiguous(), cos, sin, "reference", 0)
    assert torch.equal(bufs[0], bufs[1]) and bufs[0][:5, :4].abs().sum() > 0
