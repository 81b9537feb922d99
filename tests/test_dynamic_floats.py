"""``torch.compile(dynamic=True)``: Dynamo passes Python floats (the norm eps, hc_eps, the FP8 max) as graph inputs,
which the patterns cannot read as constants. ``dsv41_passes.compile`` traces them as constants; the plain backend
says why sites are missing."""

import warnings

import torch

import dsv41_passes as dp
from helpers import eager, packed, tiny_model

# one layer of the tiny preset: every family's sites
SITES = {"mhc_stats": 2, "mhc_collapse": 3, "mhc_post": 2, "q_rope_store": 1, "kv_rope_store": 1, "wo_a": 1}
NEEDLE = "float constants are graph inputs"


def test_compile_dynamic_true_keeps_every_site():
    torch._dynamo.reset()
    model = tiny_model(num_hidden_layers=1)
    ids, pos, cu = packed([9, 4])
    ref = eager(model, ids, pos, cu)
    model.reset_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the float warning would fail here
        warnings.filterwarnings("ignore", message=".*complex operators.*")
        out = dp.compile(model, dynamic=True)(ids, pos, cu)
    rep = dp.last_report()
    assert rep.sites == SITES
    assert not any(NEEDLE in w for w in rep.warnings)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.eps = 1e-6
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_plain_backend_with_dynamic_floats_warns():
    torch._dynamo.reset()
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(_Norm(), backend="dsv41", dynamic=True)(torch.randn(3, 8))
    assert any(NEEDLE in str(w.message) and "eps" in str(w.message) for w in caught)
    assert any(NEEDLE in w for w in dp.last_report().warnings)
    # the same module with floats specialized: no such warning
    torch._dynamo.reset()
    with torch.inference_mode(), torch._dynamo.config.patch(specialize_float=True), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(_Norm(), backend="dsv41", dynamic=True)(torch.randn(3, 8))
    assert not any(NEEDLE in str(w.message) for w in caught)
    assert not any(NEEDLE in w for w in dp.last_report().warnings)
