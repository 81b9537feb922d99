"""WO-A test cases shared by ``tests/lowering/test_wo_a*.py``: inputs, the model's math, a float64 oracle, the
tolerances and the GPU shapes."""

from pathlib import Path

import torch

from dsv41_passes.lowering.registry import encode_mode
from dsv41_passes.reference.rope import apply_rotary_complex, rope_table

BF16 = torch.bfloat16
# the Triton tests run the GPU kernel where there is one, else the interpreter (tiny shapes, tiles >= 16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]
MAX_POS = 4096
TABLE = rope_table(64, MAX_POS, 10000.0, None)


def make(m, h, d, g, r, rd, seed=0, device="cpu", head_pad=0):
    """o [M, H, D] (token stride (H + head_pad) * D), weight [G*R, K], complex table rows, strided cos/sin views."""
    gen = torch.Generator().manual_seed(seed)
    k = h // g * d
    # slice on the target device: .to() of a strided view makes it contiguous
    o = torch.randn(m, h + head_pad, d, generator=gen).to(BF16).to(device)[:, :h]
    w = (torch.randn(g * r, k, generator=gen) / k**0.5).to(BF16)
    pos = torch.randint(0, MAX_POS, (m,), generator=gen)
    freqs = rope_table(rd, MAX_POS, 10000.0, None)[pos] if rd != 64 else TABLE[pos]
    w, freqs = w.to(device), freqs.to(device)
    table = torch.view_as_real(freqs)  # the views the pattern's replacement passes
    return o, w, freqs, table[..., 0], table[..., 1]


def model_math(o, w, freqs, g, rd):
    """Attention.forward's tail, verbatim."""
    m = o.shape[0]
    o = o.clone(memory_format=torch.contiguous_format)  # the attention output is a fresh contiguous tensor
    if freqs is not None:
        o[..., -rd:] = apply_rotary_complex(o[..., -rd:], freqs, inverse=True)
    og = o.view(m, g, -1)
    wa = w.view(g, -1, og.shape[-1])
    return torch.einsum("mgd,grd->mgr", og, wa).flatten(1)


def float64_oracle(o, w, cos, sin, rd, g):
    """Exact math: the inverse rotation and the projection in float64, no intermediate rounding."""
    x = o.double().clone()
    if cos is not None:
        t = x[..., -rd:].unflatten(-1, (-1, 2))
        c, s = cos.double()[:, None], sin.double()[:, None]
        y0 = t[..., 0] * c + t[..., 1] * s
        y1 = t[..., 1] * c - t[..., 0] * s
        x[..., -rd:] = torch.stack((y0, y1), -1).flatten(-2)
    m, k = x.shape[0], w.shape[1]
    return torch.einsum("mgd,grd->mgr", x.reshape(m, g, k), w.double().view(g, -1, k)).reshape(m, -1)


def normwise_error(out, ref64):
    return ((out.double() - ref64).norm() / ref64.norm()).item()


def assert_bf16_gemm_close(out, ref):
    """Within bf16 GEMM tolerance: one bf16 rounding of a differently ordered fp32 sum."""
    assert out.shape == ref.shape and out.dtype == ref.dtype == BF16
    scale = ref.float().abs().mean().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-3 * scale)


def run_op(providers, o, w, cos, sin, rd, batch_invariant=False):
    return torch.ops.dsv41.wo_a(o, w, cos, sin, rd, providers, encode_mode(batch_invariant))


TP_SHAPES = {"tp4": (16, 512, 2, 1024, 64), "tp1": (64, 512, 8, 1024, 64)}  # (H, D, G, R, rope_dim)
# every default: split-K over 64-column tiles, 4 parts of 128 x 128 (TP4, 130), the written-out pipeline with the rope
# chunks de-rotated into registers one CTA a tile (64 / 128 columns: TP4 300 and 1000, TP1 130) and persistent
# (256 columns: TP1 300 and 1000, 2048-32768), and with the rope pass (above)
GPU_M = (1, 7, 130, 300, 1000, 2048, 4096, 4097)
