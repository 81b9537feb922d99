"""Derived bf16x3 weights: exact split, cache refresh on in-place updates, static-weights rejection."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from dsv41_passes.lowering import mhc_weights as mw
from dsv41_passes.lowering import registry

ITERS, EPS = 20, 1e-6


@pytest.fixture(autouse=True)
def _fresh_cache():
    mw.clear_cache()
    yield
    mw.clear_cache()


def test_split_is_exact_for_normal_values():
    g = torch.Generator().manual_seed(0)
    mant = torch.randn(1 << 16, generator=g)
    w = (mant * torch.exp2(torch.randint(-100, 100, (1 << 16,), generator=g).float())).float()
    w = torch.cat([w, torch.tensor([1.0, -1.0, 3.0e38, 1.17549435e-38 * 2**24, 0.0])])
    hi, mid, lo = mw.split_bf16x3(w)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    total = hi.double() + mid.double() + lo.double()  # exact in float64
    assert torch.equal(total, w.double())
    # the parts shrink by at least 2^8 each step (each carries the next 8 bits)
    nz = w != 0
    assert (mid.double().abs()[nz] <= hi.double().abs()[nz] * 2.0**-8).all()
    assert (lo.double().abs()[nz] <= mid.double().abs()[nz] * 2.0**-8 + 0).all()


def test_split_needs_float32():
    with pytest.raises(TypeError, match="float32"):
        mw.split_bf16x3(torch.ones(3, dtype=torch.float64))


def test_parts_layout_is_transposed_and_zero_padded():
    fn = torch.randn(24, 256)
    parts = mw.build_parts(fn)
    assert parts.shape == (3, 256, 32) and parts.dtype == torch.bfloat16
    for p, ref in zip(parts, mw.split_bf16x3(fn)):
        assert torch.equal(p[:, :24], ref.t())
        assert torch.equal(p[:, 24:], torch.zeros(256, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="pad"):
        mw.build_parts(torch.randn(40, 8))


def _reference_parts(fn):
    return mw.build_parts(fn.detach().clone())


def test_cache_hits_and_refreshes_after_in_place_updates():
    builds0 = mw.cache_info()["builds"]
    fn = torch.nn.Parameter(torch.randn(24, 256))
    p1 = mw.bf16x3_parts(fn)
    assert mw.bf16x3_parts(fn) is p1
    assert mw.cache_info() == {"entries": 1, "bytes": 3 * 256 * 32 * 2, "builds": builds0 + 1}

    with torch.no_grad():  # copy_
        fn.copy_(torch.randn(24, 256))
    p2 = mw.bf16x3_parts(fn)
    assert p2 is not p1 and torch.equal(p2, _reference_parts(fn))

    fn.grad = torch.randn(24, 256)  # an optimizer step
    torch.optim.SGD([fn], lr=0.1).step()
    p3 = mw.bf16x3_parts(fn)
    assert p3 is not p2 and torch.equal(p3, _reference_parts(fn))

    mod = torch.nn.Linear(256, 24, bias=False)  # load_state_dict into a module's weight
    w = mod.weight
    q1 = mw.bf16x3_parts(w)
    mod.load_state_dict({"weight": torch.randn(24, 256)})
    q2 = mw.bf16x3_parts(w)
    assert q2 is not q1 and torch.equal(q2, _reference_parts(w))
    assert mw.cache_info()["entries"] == 2
    assert mw.cache_info()["builds"] == builds0 + 5


def test_freed_weights_leave_the_cache():
    fn = torch.randn(24, 128)
    mw.bf16x3_parts(fn)
    assert mw.cache_info()["entries"] == 1
    del fn
    gc.collect()
    info = mw.cache_info()
    assert info["entries"] == 0 and info["bytes"] == 0


def test_a_new_tensor_at_a_recycled_address_is_not_served_stale_parts():
    fn = torch.randn(24, 128)
    mw.bf16x3_parts(fn)
    del fn
    gc.collect()
    fn2 = torch.full((24, 128), 3.0)
    assert torch.equal(mw.bf16x3_parts(fn2), _reference_parts(fn2))


def test_a_parameter_given_new_storage_is_not_served_stale_parts():
    """``p.data = t`` keeps the parameter (and its version) while the old storage is freed, so a later one can land
    at the old address under the same key: every round must still give the new weight's parts."""
    fn = torch.nn.Parameter(torch.randn(24, 256))
    for i in range(12):  # (on the CI's CPU allocator the old code served stale parts within these rounds)
        mw.bf16x3_parts(fn)
        fn.data = torch.randn(24, 256)  # the old storage goes
        assert torch.equal(mw.bf16x3_parts(fn), _reference_parts(fn)), i


def test_static_weights_build_once_and_reject_updates():
    fn = torch.nn.Parameter(torch.randn(24, 128))
    p = mw.bf16x3_parts(fn, static=True)
    assert mw.bf16x3_parts(fn, static=True) is p
    with torch.no_grad():
        fn.mul_(2)
    with pytest.raises(RuntimeError, match=r"PassConfig\(static_weights=True\)"):
        mw.bf16x3_parts(fn, static=True)
    mw.clear_cache()  # the documented way out after a deliberate update
    assert torch.equal(mw.bf16x3_parts(fn, static=True), _reference_parts(fn))


def test_static_weights_reject_an_update_that_a_dynamic_caller_refreshed():
    """Two compiles of one model, static and dynamic: the dynamic one's rebuild after an update must not make the
    static one's check pass (its parts were promised never to change)."""
    fn = torch.nn.Parameter(torch.randn(24, 128))
    mw.bf16x3_parts(fn)  # a dynamic caller first: the static one pins the version it first serves
    p = mw.bf16x3_parts(fn, static=True)
    with torch.no_grad():
        fn.mul_(2)
    assert torch.equal(mw.bf16x3_parts(fn), _reference_parts(fn))  # the dynamic caller refreshes
    with pytest.raises(RuntimeError, match=r"version \d+ -> \d+.*static_weights=True"):
        mw.bf16x3_parts(fn, static=True)
    assert not torch.equal(p, _reference_parts(fn))
    # a static caller that first comes after an update (the entry stale) builds fresh parts and pins them
    fn2 = torch.nn.Parameter(torch.randn(24, 128))
    mw.bf16x3_parts(fn2)
    with torch.no_grad():
        fn2.add_(1)
    assert torch.equal(mw.bf16x3_parts(fn2, static=True), _reference_parts(fn2))
    assert torch.equal(mw.bf16x3_parts(fn2), _reference_parts(fn2))
    mw.clear_cache()


def test_inference_tensors_are_rebuilt_every_call_with_a_warning():
    with torch.inference_mode():
        fn = torch.randn(24, 128)
    mw._WARNED_INFERENCE[0] = False
    builds0 = mw.cache_info()["builds"]
    with pytest.warns(UserWarning, match="inference tensor"):
        mw.bf16x3_parts(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mw.bf16x3_parts(fn)
    assert mw.cache_info()["builds"] == builds0 + 2
    assert mw.bf16x3_parts(fn, static=True) is mw.bf16x3_parts(fn, static=True)


def _pre_args(m=5, seed=0):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    d = 256 if dev == "cuda" else 64
    g = torch.Generator(device=dev).manual_seed(seed)
    kw = dict(generator=g, device=dev)
    h = torch.randn(m, 4, d, **kw).to(torch.bfloat16)
    fn = torch.nn.Parameter(torch.randn(24, 4 * d, **kw) / 16)
    return h, torch.rand(m, 4, **kw), fn, torch.rand(3, **kw) + 0.5, torch.randn(24, **kw), torch.rand(d, **kw) + 0.5


def test_ops_refresh_or_reject_through_the_provider(monkeypatch):
    pytest.importorskip("triton")
    from dsv41_passes.lowering.triton import mhc as tk
    from dsv41_passes.lowering.triton import mhc_projection as tkp

    h, pre_prev, fn, scale, base, w = _pre_args()

    def run(static):
        mode = registry.encode_mode(True, static_weights=static)
        return torch.ops.dsv41.mhc_pre(h, pre_prev, fn, scale, base, w, ITERS, EPS, EPS, EPS, "triton,reference", mode)

    # dynamic: an in-place update is picked up at the next call
    out1 = run(False)
    with torch.no_grad():
        fn.mul_(-1)
    out2 = run(False)
    assert not torch.equal(out1[1], out2[1])
    expect = tk.mhc_pre(h, pre_prev, mw.build_parts(fn.detach().clone()), scale, base, w, ITERS, EPS, EPS, EPS,
                        batch_invariant=True)
    for a, b in zip(out2, expect):
        assert torch.equal(a, b)

    # static: built once; after an update the op raises before any kernel runs
    mw.clear_cache()
    run(True)
    launches = []
    real = tkp._launch_proj
    monkeypatch.setattr(tkp, "_launch_proj", lambda *a, **k: launches.append(1) or real(*a, **k))
    with torch.no_grad():
        fn.add_(1)
    with pytest.raises(RuntimeError, match=r"static_weights=True"):
        run(True)
    assert launches == []
    run(False)  # (the spy sees a launch: the check above is not vacuous)
    assert launches
