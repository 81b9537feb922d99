"""The provider registry's choice: priority order, declines, and a decline for speed (``Defer``) that gives way only
to a later provider that takes the inputs."""

import dataclasses

import pytest

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
