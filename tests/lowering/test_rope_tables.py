"""The interleaved-table view shared by the KV and WO-A kernels."""

import torch

from dsv41_passes.lowering.rope_tables import interleaved_view


def test_interleaved_view_of_a_complex_table():
    freqs = torch.polar(torch.ones(5, 8), torch.rand(5, 8))
    fr = torch.view_as_real(freqs)
    cs = interleaved_view(fr[..., 0], fr[..., 1])
    assert cs is not None and cs.shape == (5, 16) and cs.is_contiguous()
    assert torch.equal(cs[:, 0::2], freqs.real) and torch.equal(cs[:, 1::2], freqs.imag)
    rows = torch.view_as_real(torch.polar(torch.ones(10, 8), torch.rand(10, 8)))[::2]  # every other row
    strided = interleaved_view(rows[..., 0], rows[..., 1])
    assert strided is not None and strided.stride() == (32, 1) and not strided.is_contiguous()


def test_no_view_when_the_tables_do_not_interleave():
    cos, sin = torch.rand(5, 8), torch.rand(5, 8)
    assert interleaved_view(cos, sin) is None
    fr = torch.view_as_real(torch.polar(torch.ones(5, 8), torch.rand(5, 8)))
    assert interleaved_view(fr[..., 1], fr[..., 0]) is None  # sin before cos
    f64 = torch.view_as_real(torch.polar(torch.ones(5, 8, dtype=torch.float64), torch.rand(5, 8, dtype=torch.float64)))
    assert interleaved_view(f64[..., 0], f64[..., 1]) is None  # interleaved, but the kernels read fp32
