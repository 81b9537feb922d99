"""The pass framework end to end on the tiny model: sites, numerics, dynamic M, config switches."""

import subprocess
import sys

import pytest
import torch

import dsv41_passes as dp
from helpers import EMULATE, eager, packed, tiny_model, unique_graphs

L = 2  # tiny preset layers


@pytest.fixture(scope="module")
def compiled():
    torch._dynamo.reset()
    model = tiny_model()
    fast = dp.compile(model, dp.PassConfig(), options=EMULATE)
    ids, pos, cu = packed([11, 29, 6])
    ref = eager(model, ids, pos, cu)
    model.reset_cache()
    out = fast(ids, pos, cu)
    return model, fast, dp.last_report(), out, ref


def test_tiny_model_sites_and_logits(compiled):
    model, fast, rep, out, ref = compiled
    # mHC: stats and post per sub-block (attention, FFN), a collapse per sub-block plus the final norm's;
    # one wo_a, Q store and KV store per layer
    assert rep.sites == {"mhc_stats": 2 * L, "mhc_collapse": 2 * L + 1, "mhc_post": 2 * L, "wo_a": L,
                         "q_rope_store": L, "kv_rope_store": L}, rep.to_markdown()
    posts = [r for r in rep.rows if r.kind == "mhc_post"]
    assert sorted(r.layer for r in posts) == [0, 0, 1, 1]
    assert all(r.status == "rewritten" and r.provider for r in posts)
    # emulated casts + the reference/interpreted providers: within bf16 tolerance of eager
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert "dsv41.mhc_post" in rep.after and "dsv41" not in rep.before
    assert rep.pass_seconds["mhc"] > 0 and rep.total_seconds < 60


def test_one_graph_for_many_token_counts():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model()
    # reference providers: this is about graphs and guards, and the interpreter is slow at M = 1000
    fast = dp.compile(model, dp.PassConfig(providers=("reference",)), options=EMULATE)
    ids, pos, cu = packed([11, 29, 6])
    fast(ids, pos, cu)
    n0 = unique_graphs()
    assert n0 == 1
    for m in (2, 3, 17, 64, 129, 1000):
        ids, pos, cu = packed([m], seed=m)
        model.reset_cache()
        out = fast(ids, pos, cu)
        assert out.shape == (m, 256)
    assert unique_graphs() == n0  # the graph compiled for 46 tokens serves them all
    ids, pos, cu = packed([1])
    fast(ids, pos, cu)
    assert unique_graphs() <= n0 + 1  # M = 1 may specialize into its own graph


def test_mhc_off_equals_plain_compile():
    torch._dynamo.reset()
    model = tiny_model()
    ids, pos, cu = packed([9, 20])
    fast = dp.compile(model, dp.PassConfig(mhc=False), options=EMULATE)
    model.reset_cache()
    out = fast(ids, pos, cu)
    rep = dp.last_report()
    assert not [r for r in rep.rows if r.kind.startswith("mhc")], rep.to_markdown()
    assert "dsv41.mhc" not in rep.after  # no mHC fused op of any kind
    assert rep.sites == {"wo_a": L, "q_rope_store": L, "kv_rope_store": L}, rep.to_markdown()
    torch._dynamo.reset()
    plain = torch.compile(model, options=EMULATE)
    model.reset_cache()
    with torch.inference_mode():
        ref = plain(ids, pos, cu)
    assert torch.equal(out, ref)


def test_backend_by_name_and_inductor_options_leave_global_config_alone():
    import torch._inductor.config as icfg

    before = icfg.post_grad_custom_post_pass
    torch._dynamo.reset()

    def block(y, res, post, comb):
        out = post.unsqueeze(-1) * y.unsqueeze(1) + (comb.unsqueeze(-1) * res.unsqueeze(2)).sum(1)
        return out.to(torch.bfloat16)

    args = (torch.randn(5, 32).bfloat16(), torch.randn(5, 4, 32).bfloat16(), torch.rand(5, 4), torch.rand(5, 4, 4))
    with torch.inference_mode():
        out = torch.compile(block, backend="dsv41")(*args)
        assert dp.last_report().sites == {"mhc_post": 1}
        torch._dynamo.reset()
        out2 = torch.compile(block, options=dp.inductor_options(dp.PassConfig()))(*args)
        assert dp.last_report().sites == {"mhc_post": 1}
    assert torch.equal(out, out2)
    assert icfg.post_grad_custom_post_pass is before


def test_batch_invariant_options():
    import torch._inductor.config as icfg

    opts = dp.inductor_options(dp.PassConfig(batch_invariant=True))
    for name in ("deterministic", "batch_invariant"):
        assert opts.get(name) is (True if hasattr(icfg, name) else None)
    assert "deterministic" not in dp.inductor_options(dp.PassConfig(batch_invariant=False))


def test_pass_config_validation():
    with pytest.raises(ValueError, match="unknown"):
        dp.PassConfig(providers=("cuda", "reference"))
    with pytest.raises(ValueError, match="reference"):
        dp.PassConfig(providers=("triton",))
    with pytest.raises(ValueError, match="end with 'reference'"):
        dp.PassConfig(providers=("reference", "triton"))  # triton would never run
    with pytest.raises(ValueError, match="end with 'reference'"):
        dp.PassConfig(providers=())
    with pytest.raises(ValueError, match="tuple of names"):
        dp.PassConfig(providers="reference")
    assert dp.PassConfig(providers=["triton", "reference"]).providers == ("triton", "reference")


def test_pass_config_flags_are_bools():
    # a string is truthy whatever it says: batch_invariant="false" compiled in batch-invariant mode
    with pytest.raises(ValueError, match="batch_invariant must be True, False or None, got 'false'"):
        dp.PassConfig(batch_invariant="false")
    with pytest.raises(ValueError, match="static_weights must be True or False, got 'no'"):
        dp.PassConfig(static_weights="no")
    # numpy's bool (a flag read from an array) is kept as a bool: it failed the uuid's JSON inside the compile
    np = pytest.importorskip("numpy")
    cfg = dp.PassConfig(mhc=np.bool_(True), batch_invariant=np.bool_(False))
    assert cfg.mhc is True and cfg.batch_invariant is False
    assert dp.pass_manager.PostGradPassManager(cfg).uuid() == \
        dp.pass_manager.PostGradPassManager(dp.PassConfig(batch_invariant=False)).uuid()


def test_a_config_that_is_not_a_pass_config_is_refused_at_once():
    # dp.compile(model, {options}) failed only at the first call, with "'dict' object has no attribute
    # 'resolved_batch_invariant'"
    for make in (lambda c: dp.compile(lambda x: x * 2, c), dp.make_backend, dp.inductor_options):
        with pytest.raises(TypeError, match="config must be a dsv41_passes.PassConfig, got dict"):
            make({"fx_graph_cache": False})


def test_options_owning_the_pass_slot_are_refused_at_once():
    # dp.compile took them and raised only at the first call
    with pytest.raises(ValueError, match="may not set post_grad_custom_post_pass"):
        dp.compile(lambda x: x * 2, options={"post_grad_custom_post_pass": None})


@pytest.mark.parametrize("bad", ["20", 20.0, 2.5, True, 0])
def test_pass_config_sinkhorn_iters_is_an_int(bad):
    # "20" raised a bare "'<' not supported"; a float was accepted and no stats site could ever match it
    with pytest.raises(ValueError, match="hc_sinkhorn_iters must be an int >= 1"):
        dp.PassConfig(hc_sinkhorn_iters=bad)


def test_pass_config_keeps_a_numpy_sinkhorn_count_as_an_int():
    # numpy's int (read from an array) failed the uuid's JSON inside the compile
    np = pytest.importorskip("numpy")
    cfg = dp.PassConfig(hc_sinkhorn_iters=np.int64(20), batch_invariant=False)
    assert type(cfg.hc_sinkhorn_iters) is int
    assert dp.pass_manager.PostGradPassManager(cfg).uuid() == \
        dp.pass_manager.PostGradPassManager(dp.PassConfig(batch_invariant=False)).uuid()


def test_register_twice_and_through_the_entry_point():
    """``dp.register()`` may be called again (the import already registered the backend), and a process that
    names the backend before importing the package gets it through the entry point."""
    script = ("import torch\n"
              "f = torch.compile(lambda x: x * 2, backend='dsv41')\n"
              "print(f(torch.ones(2)).tolist())\n"
              "import dsv41_passes as dp\n"
              "dp.register(); dp.register()\n"
              "print('registered')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "[2.0, 2.0]" in out.stdout and "registered" in out.stdout, out.stderr[-2000:]
    dp.register()
    dp.register()


@pytest.mark.parametrize("argv,msg", [
    (["demo", "--layers", "5"], "1 to 4 layers"),
    (["inspect", "--layers", "0"], "1 to 4 layers"),
    (["inspect", "--providers", "triton"], "end with 'reference'"),
    (["inspect", "--providers", "cuda,reference"], "unknown"),
])
def test_cli_rejects_bad_flags_with_a_usage_error(argv, msg, capsys):
    from dsv41_passes import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_a_fixed_size_slot_table_keeps_one_graph_for_every_batch():
    """seq_slots as a [max_num_seqs] table (entries past the batch unused): batches of 2, 3 and 1 sequences run one
    graph, each within bf16 tolerance of eager with the same table."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(num_hidden_layers=1)
    fast = dp.compile(model, dp.PassConfig(providers=("reference",)), options=EMULATE)
    table = torch.tensor([3, 0, 5, 1, 2, 4, 6, 7])
    for lengths in ([5, 7], [3, 4, 5], [8]):
        ids, pos, cu = packed(lengths)
        model.reset_cache()
        out = fast(ids, pos, cu, table)
        model.reset_cache()
        torch.testing.assert_close(out, eager(model, ids, pos, cu, table), rtol=2e-2, atol=2e-2)
    assert unique_graphs() == 1


def test_family_warning_blames_grad_mode_only_for_a_training_graph():
    # AOTAutograd compiles a training graph's forward with grad off, so the pass cannot read grad mode itself: the
    # warning has to say so where the forward saves activations, and not where nothing needs a gradient
    def proj(x, w):
        return (x @ w).relu()

    suffix = "grad mode is on: saved activations block the patterns"
    cfg = dp.PassConfig(mhc=False, rope_store=False, batch_invariant=False)
    x = torch.randn(3, 8)
    with torch._inductor.config.patch(force_disable_caches=True):
        for needs_grad, expect in ((True, True), (False, False)):
            torch._dynamo.reset()
            torch.compile(proj, options=dp.inductor_options(cfg))(x, torch.randn(8, 8, requires_grad=needs_grad))
            warnings = [w for w in dp.last_report().warnings if "family 'wo_a'" in w]
            assert len(warnings) == 1 and (suffix in warnings[0]) is expect, (needs_grad, warnings)
