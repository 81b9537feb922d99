"""The provider registry's choice: priority order, declines, and a decline for speed (``Defer``) that gives way only
to a later provider that takes the inputs."""

import dataclasses

import pytest
import torch

from dsv41_passes.lowering import registry
from dsv41_passes.lowering.registry import Defer, choose, register_provider


@pytest.fixture
def op(monkeypatch):
    """A throwaway op: ``fast`` defers to ``triton`` when asked to; ``triton`` declines when asked to."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    name = "test_op"
    register_provider(name, "tilelang", lambda x, *, batch_invariant: Defer("small", "triton") if x == "small"
                      else None)(lambda x, *, batch_invariant: "tilelang")
    register_provider(name, "triton", lambda x, *, batch_invariant: "no triton" if x == "small-no-triton"
                      else None)(lambda x, *, batch_invariant: "triton")
    register_provider(name, "reference")(lambda x, *, batch_invariant: "reference")
    return name


def test_defer_gives_way_to_a_later_provider_that_takes_the_inputs(op):
    p, why = choose(op, "tilelang,triton,reference", False, "small")
    assert p.name == "triton" and why == ["tilelang: small"]


def test_defer_runs_where_its_target_is_not_later_in_the_priority(op):
    p, why = choose(op, "tilelang,reference", False, "small")
    assert p.name == "tilelang" and "runs although small" in why[0], why
    p, why = choose(op, "triton,tilelang,reference", False, "small-no-triton")
    assert p.name == "tilelang", why  # small-no-triton is not "small": no defer
    p, why = choose(op, "reference,tilelang", False, "small")
    assert p.name == "reference" and why == []


def test_defer_runs_where_its_target_declines(op, monkeypatch):
    tl = registry._REGISTRY[op]["tilelang"]
    always = dataclasses.replace(tl, supported=lambda x, *, batch_invariant: Defer("small", "triton"))
    monkeypatch.setitem(registry._REGISTRY[op], "tilelang", always)
    p, why = choose(op, "tilelang,triton,reference", False, "small-no-triton")
    assert p.name == "tilelang" and "runs although small" in why[0], why
    p, why = choose(op, "tilelang,triton,reference", False, "small")
    assert p.name == "triton" and why == ["tilelang: small"]


def test_each_provider_is_asked_once(op, monkeypatch):
    asked = []
    tr = registry._REGISTRY[op]["triton"]
    counting = dataclasses.replace(tr, supported=lambda x, *, batch_invariant: asked.append(x))
    monkeypatch.setitem(registry._REGISTRY[op], "triton", counting)
    p, _ = choose(op, "tilelang,triton,reference", False, "small")
    assert p.name == "triton" and asked == ["small"]  # the Defer's early question is the loop's answer


def test_dispatch_runs_the_provider_on_the_inputs_device(op, monkeypatch):
    """Triton and TileLang launch on the current CUDA device: inputs on another one are run under a device guard.
    (Without CUDA here: a fake tensor on cuda:1 and a current device of 0 stand in; the 2-GPU test runs it for real.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on1, on0 = torch.empty(2, device="cuda:1"), torch.empty(2, device="cuda:0")
    entered, current = [], [0]

    class Guard:
        def __init__(self, dev):
            self.dev = dev

        def __enter__(self):
            entered.append(str(self.dev))
            current.append(self.dev.index)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[-1])
    monkeypatch.setattr(torch.cuda, "device", Guard)
    seen = []
    register_provider(op, "triton")(lambda x, *, batch_invariant: seen.append(torch.cuda.current_device()))
    registry.dispatch(op, "triton", 0, on1)
    registry.dispatch(op, "triton", 0, on0)
    registry.dispatch(op, "triton", 0, torch.empty(2))  # CPU inputs: no guard
    assert seen == [1, 0, 0] and entered == ["cuda:1"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fused_op_on_a_second_device_matches_the_first():
    import dsv41_passes.lowering.mhc  # noqa: F401  (defines torch.ops.dsv41.mhc_post)

    g = torch.Generator().manual_seed(0)
    y, res = torch.randn(64, 512, generator=g).bfloat16(), torch.randn(64, 4, 512, generator=g).bfloat16()
    post, comb = torch.rand(64, 4, generator=g) * 2, torch.rand(64, 4, 4, generator=g)
    outs = []
    for d in ("cuda:0", "cuda:1"):
        with torch.cuda.device(0):  # the current device stays 0
            args = [t.to(d) for t in (y, res, post, comb)]
            outs.append(torch.ops.dsv41.mhc_post(*args, "triton", 0).cpu())
    assert torch.equal(outs[0], outs[1])
