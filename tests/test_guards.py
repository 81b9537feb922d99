"""Guards: batch-invariant mode end to end, mode switches, dynamic M without recompiles."""

import inspect

import pytest
import torch

import dsv41_passes as dp
from dsv41_passes.reference.mhc import hc_post
from helpers import EMULATE, packed, tiny_model, unique_graphs


def _alone_vs_packed(fast, model, lengths):
    ids, pos, cu = packed(lengths, seed=3)
    model.reset_cache()
    full = fast(ids, pos, cu)
    for b in range(len(lengths)):
        s, e = cu[b].item(), cu[b + 1].item()
        model.reset_cache()
        alone = fast(ids[s:e], pos[s:e], torch.tensor([0, e - s]))
        assert torch.equal(alone, full[s:e]), f"sequence {b} (length {lengths[b]}) differs when packed"


@pytest.mark.parametrize("providers", [("reference",), ("tilelang", "triton", "reference")])
def test_tiny_model_rows_independent_of_the_batch(providers):
    torch._dynamo.reset()
    model = tiny_model()
    fast = dp.compile(model, dp.PassConfig(batch_invariant=True, providers=providers), options=EMULATE)
    _alone_vs_packed(fast, model, [3, 20, 1, 9, 2])
    rep = dp.last_report()
    assert rep.config["batch_invariant"] is True
    assert rep.sites.get("bi_matmul", 0) > 0  # every library GEMM left in the graph is pinned
    assert rep.sites["mhc_stats"] == 4 and rep.sites["mhc_post"] == 4


def test_without_batch_invariance_library_gemms_do_depend_on_the_batch():
    """The hazard the mode exists for: eager CPU GEMMs give a short sequence other bits when packed."""
    model = tiny_model()
    ids, pos, cu = packed([3, 20, 1, 9, 2], seed=3)
    with torch.inference_mode():
        model.reset_cache()
        full = model(ids, pos, cu)
        diffs = 0
        for b in range(5):
            s, e = cu[b].item(), cu[b + 1].item()
            model.reset_cache()
            diffs += not torch.equal(model(ids[s:e], pos[s:e]), full[s:e])
    assert diffs > 0


def _block(y, res, post, comb):
    return hc_post(y, res, post, comb)


def _post_args():
    return (torch.randn(6, 32).bfloat16(), torch.randn(6, 4, 32).bfloat16(), torch.rand(6, 4), torch.rand(6, 4, 4))


def test_compile_recompiles_when_the_mode_changes():
    torch._dynamo.reset()
    fast = dp.compile(_block, dp.PassConfig(providers=("reference",)))
    args = _post_args()
    with dp.batch_invariant(False):
        fast(*args)
        off = dp.last_report()
        assert off.config["batch_invariant"] is False
    with dp.batch_invariant(True):
        fast(*args)
        on = dp.last_report()
        assert on is not off and on.config["batch_invariant"] is True
    with dp.batch_invariant(False):
        fast(*args)  # the first mode's graph is reused: no third compile
        assert dp.last_report() is on


def test_backend_graph_refuses_the_other_mode():
    torch._dynamo.reset()
    args = _post_args()
    with dp.batch_invariant(False):
        f = torch.compile(_block, backend="dsv41")
        with torch.inference_mode():
            f(*args)
    with dp.batch_invariant(True), torch.inference_mode():
        with pytest.raises(RuntimeError, match="compiled with batch_invariant=False"):
            f(*args)
    pinned = dp.PassConfig(batch_invariant=False)  # a pinned mode is not tied to the global switch
    torch._dynamo.reset()
    g = dp.compile(_block, pinned)
    with dp.batch_invariant(True):
        g(*args)


def test_backend_graph_without_fused_ops_refuses_the_other_mode():
    """A graph with no dsv41 op (here a plain linear: nothing to fuse) checks the mode too, in both directions."""
    torch._dynamo.reset()
    x, w = torch.randn(5, 8), torch.randn(4, 8)
    for compiled_mode in (False, True):
        torch._dynamo.reset()
        with dp.batch_invariant(compiled_mode), torch.inference_mode():
            f = torch.compile(lambda x, w: torch.nn.functional.linear(x, w), backend="dsv41")
            want = f(x, w)
        with dp.batch_invariant(not compiled_mode), torch.inference_mode():
            with pytest.raises(RuntimeError, match=f"compiled with batch_invariant={compiled_mode}"):
                f(x, w)
        with dp.batch_invariant(compiled_mode), torch.inference_mode():
            assert torch.equal(f(x, w), want)


def test_env_and_setter():
    assert dp.is_batch_invariant() is False
    dp.batch_invariant(True)
    try:
        assert dp.is_batch_invariant() is True
    finally:
        dp.batch_invariant(False)
    with dp.batch_invariant():
        assert dp.is_batch_invariant()
    assert not dp.is_batch_invariant()


def test_context_object_entered_later_or_again_applies_its_mode():
    cm = dp.batch_invariant(True)
    dp.batch_invariant(False)
    with cm:  # made before another change: applied on entry
        assert dp.is_batch_invariant()
    assert not dp.is_batch_invariant()
    with cm:  # again
        assert dp.is_batch_invariant()
    assert not dp.is_batch_invariant()
    with pytest.raises(RuntimeError), dp.batch_invariant(True):
        raise RuntimeError
    assert not dp.is_batch_invariant()


def test_context_object_entered_inside_itself_restores_each_mode():
    cm = dp.batch_invariant(True)
    with cm:
        with cm:
            assert dp.is_batch_invariant()
        assert dp.is_batch_invariant()
        dp.batch_invariant(False)
        with cm:
            assert dp.is_batch_invariant()
        assert not dp.is_batch_invariant()
    assert not dp.is_batch_invariant()  # the mode from before cm was made
    dp.batch_invariant(True)
    with cm:
        with cm:
            assert dp.is_batch_invariant()
        assert dp.is_batch_invariant()
    assert dp.is_batch_invariant()
    dp.batch_invariant(False)


def test_a_compile_between_making_and_entering_leaves_the_object_as_it_was():
    """dp.compile compiles under its graph's mode; that is not a change of mode for an object made before it."""
    f = dp.compile(lambda x: x * 2, dp.PassConfig(batch_invariant=False))
    cm = dp.batch_invariant(True)
    f(torch.ones(3))  # compiles in the scope of batch_invariant=False
    assert dp.is_batch_invariant()
    with cm:
        assert dp.is_batch_invariant()
    assert not dp.is_batch_invariant()  # the mode from before cm was made


@pytest.mark.parametrize("value", ["0", "false", None, [True]])
def test_setter_refuses_what_is_not_a_bool(value):
    # dp.batch_invariant("0") turned the mode on: a string is truthy whatever it says
    with pytest.raises(ValueError, match="True or False"):
        dp.batch_invariant(value)
    assert not dp.is_batch_invariant()


@pytest.mark.parametrize("value,want", [(" 1 ", True), ("1\n", True), ("TRUE", True), ("0", False), ("", False)])
def test_env_value_with_spaces(monkeypatch, value, want):
    from dsv41_passes import guards, tuning

    monkeypatch.setenv("DSV41_BATCH_INVARIANT", value)
    assert guards._env_default() is want
    monkeypatch.setenv("DSV41_TACTICS", " off ")
    assert tuning.enabled() is False


@pytest.mark.slow
def test_twelve_token_counts_one_graph_up_to_65536():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(max_num_tokens=65536, num_hidden_layers=1, max_position_embeddings=65536)
    fast = dp.compile(model, dp.PassConfig(providers=("reference",)), options=EMULATE)
    n0 = None
    for m in (2, 3, 17, 100, 1000, 4096, 9999, 20000, 32768, 50001, 65535, 65536):
        ids, pos, cu = packed([m - m // 3, m // 3] if m > 3 else [m], seed=m)
        model.reset_cache()
        out = fast(ids, pos, cu)
        assert out.shape == (m, 256) and torch.isfinite(out).all()
        n0 = unique_graphs() if n0 is None else n0
    assert unique_graphs() == n0 == 1
    ids, pos, cu = packed([65537])
    with pytest.raises(Exception, match="max_num_tokens"):
        model.reset_cache()
        fast(ids, pos % 65536, cu)


@pytest.mark.skipif("isolate_recompiles" not in inspect.signature(torch.compile).parameters,
                    reason="this torch.compile has no isolate_recompiles: every variant shares one recompile limit")
def test_compiled_variants_do_not_share_one_recompile_limit():
    """Dynamo keeps the graphs of every torch.compile of one function together and falls back to eager, silently, at
    its recompile limit (8): the ninth dp.compile variant here ran eagerly, without its fused op or its mode."""
    torch._dynamo.reset()
    args = _post_args()
    for i in range(10):
        cfg = dp.PassConfig(providers=("reference",), batch_invariant=i % 2 == 1, hc_sinkhorn_iters=1 + i)
        before = dp.reports()[-1] if dp.reports() else None
        dp.compile(_block, cfg)(*args)
        rep = dp.last_report()
        assert rep is not before, f"variant {i} ran without compiling"
        assert rep.sites == {"mhc_post": 1} and rep.config["hc_sinkhorn_iters"] == 1 + i
