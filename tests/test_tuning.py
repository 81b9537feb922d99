"""Tactic cache: round trip, rejected files, merge rules, disabled mode, batch-invariant mode."""

import json
import warnings

import pytest

import dsv41_passes as dp
from dsv41_passes import tuning
from dsv41_passes.lowering import tactic_candidates

DEFAULT = {"BLOCK": 64, "num_warps": 4}
KEY = {"d": 5120, "n": 4}
# real configs of one op: a file may hold only configs a kernel can launch
POST = tactic_candidates()["mhc_post"]
WO_A = tactic_candidates()["wo_a"]


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("DSV41_TACTICS", raising=False)
    tuning.clear()
    yield
    tuning.clear()


def test_buckets():
    assert [tuning.bucket(m) for m in (1, 2, 3, 4, 5, 4096, 4097, 65536, 70000)] == [
        1, 2, 4, 4, 8, 4096, 8192, 65536, 65536
    ]
    assert tuning.buckets(16) == [1, 2, 4, 8, 16] and tuning.buckets()[-1] == 65536


def test_round_trip(tmp_path):
    tuning.record("mhc_post", 4096, KEY, POST[3])
    assert tuning.tactic("mhc_post", 3000, KEY, DEFAULT) == POST[3]
    assert tuning.tactic("mhc_post", 5000, KEY, DEFAULT) == DEFAULT  # another bucket
    assert tuning.tactic("mhc_post", 3000, {"d": 4096, "n": 4}, DEFAULT) == DEFAULT  # another shape
    path = tmp_path / "t.json"
    assert dp.save_tactics(path) == 1
    tuning.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file this process wrote loads without a warning
        assert dp.load_tactics(path) == 1
    assert tuning.tactic("mhc_post", 2049, KEY, DEFAULT) == POST[3]
    meta = json.loads(path.read_text())["meta"]
    assert {"device", "capability", "torch", "triton", "tilelang", "dsv41_passes"} <= set(meta)


def test_batch_invariant_mode_ignores_tuned_entries():
    tuning.record("mhc_post", 4096, KEY, {"BLOCK": 256, "num_warps": 8})
    assert tuning.tactic("mhc_post", 4096, KEY, DEFAULT, batch_invariant=True) == DEFAULT


def test_metadata_mismatch_is_rejected_with_a_warning(tmp_path):
    tuning.record("mhc_post", 64, KEY, {"BLOCK": 128, "num_warps": 4})
    path = tmp_path / "t.json"
    dp.save_tactics(path)
    data = json.loads(path.read_text())
    for field, value in (("device", "NVIDIA B200"), ("torch", "2.99.0"), ("triton", "9.9.9"), ("capability", [10, 0])):
        bad = json.loads(json.dumps(data))
        bad["meta"][field] = value
        p = tmp_path / f"bad_{field}.json"
        p.write_text(json.dumps(bad))
        tuning.clear()
        with pytest.warns(UserWarning, match=f"tuned elsewhere.*{field}"):
            assert dp.load_tactics(p) == 0
        assert tuning.entries() == {}


@pytest.mark.parametrize(
    "text", ["{not json", json.dumps({"meta": {}}), json.dumps([1, 2]), json.dumps({"meta": {}, "entries": {"k": 3}}),
             json.dumps({"meta": None, "entries": {}}), json.dumps({"meta": [], "entries": {}})]
)
def test_corrupt_file_is_rejected_never_a_crash(tmp_path, text):
    p = tmp_path / "c.json"
    p.write_text(text)
    with pytest.warns(UserWarning, match="corrupt"):
        assert dp.load_tactics(p) == 0


def test_missing_file_warns(tmp_path):
    with pytest.warns(UserWarning, match="does not exist"):
        assert dp.load_tactics(tmp_path / "nope.json") == 0


def test_loading_never_drops_or_overrides_entries_tuned_here(tmp_path):
    tuning.record("mhc_post", 64, KEY, POST[0])
    tuning.record("mhc_post", 65536, KEY, POST[1])  # the large-prefill tactic
    first = tmp_path / "first.json"
    dp.save_tactics(first)
    tuning.clear()
    tuning.record("mhc_post", 64, KEY, POST[2])  # tuned again in this process
    tuning.record("wo_a", 16, {"g": 2}, WO_A[0])
    assert dp.load_tactics(first) == 1  # only the entry this process lacks
    assert dp.load_tactics(first) == 0  # a second load changes nothing
    assert tuning.tactic("mhc_post", 64, KEY, DEFAULT) == POST[2]
    assert tuning.tactic("mhc_post", 65536, KEY, DEFAULT) == POST[1]
    assert tuning.tactic("wo_a", 16, {"g": 2}, {}) == WO_A[0]


def test_entries_no_kernel_can_launch_are_dropped_with_a_warning(tmp_path):
    """A hand-edited file: an entry with a key its kernel does not know (it raised KeyError at launch), an unknown
    op, a bucket that is no power of two, a malformed key. Each is dropped with a warning; the valid one loads."""
    tuning.record("mhc_post", 64, KEY, POST[0])
    path = tmp_path / "t.json"
    dp.save_tactics(path)
    data = json.loads(path.read_text())
    (good,) = data["entries"]
    broken = {k: v for k, v in POST[1].items() if k != "BLOCK_D"}
    data["entries"].update({
        "mhc_post|d=5120,n=4|128": broken,
        "mhc_post|d=5120,n=4|256": dict(POST[1], BLOCK_Z=2),
        "mhc_posts|d=5120,n=4|64": POST[1],
        "mhc_post|d=5120,n=4|100": POST[1],
        "mhc_post": POST[1],
    })
    path.write_text(json.dumps(data))
    tuning.clear()
    with pytest.warns(UserWarning, match=r"5 entries dropped.*'mhc_post\|d=5120,n=4\|128'.*not one of mhc_post's"):
        assert dp.load_tactics(path) == 1
    assert tuning.entries() == {good: POST[0]}
    assert tuning.tactic("mhc_post", 128, KEY, DEFAULT) == DEFAULT  # not the entry without BLOCK_D


def test_every_op_reads_tactics_under_a_name_with_candidates():
    """The warm-up's tunables record only candidates of ops ``tactic_candidates`` knows (else a saved file would not
    load back)."""
    from dsv41_passes.lowering import tunables_for
    from dsv41_passes.reference import DeepseekV41Config

    known = tactic_candidates()
    for t in tunables_for(DeepseekV41Config.tiny(), "cpu"):
        if len(t.candidates) > 1:  # (only these are ever recorded)
            assert t.candidates == known[t.op], t.op


def test_disabled_cache(monkeypatch, tmp_path):
    tuning.record("mhc_post", 64, KEY, {"BLOCK": 128, "num_warps": 4})
    path = tmp_path / "t.json"
    dp.save_tactics(path)
    monkeypatch.setenv("DSV41_TACTICS", "off")
    assert tuning.tactic("mhc_post", 64, KEY, DEFAULT) == DEFAULT
    tuning.record("mhc_post", 128, KEY, {"BLOCK": 1})
    assert list(tuning.entries().values()) == [{"BLOCK": 128, "num_warps": 4}]  # the record was a no-op
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert dp.load_tactics(path) == 0
        assert dp.save_tactics(tmp_path / "x.json") == 0
    assert len(w) == 2 and not (tmp_path / "x.json").exists()


def test_warmup_covers_the_bucket_max_tokens_falls_in(monkeypatch):
    """max_tokens = 3000 falls in the 4096 bucket: it is warmed up too (the buckets stopped at 2048, so calls of 2049
    to 3000 tokens compiled and ran untuned); a bucket where no candidate runs records nothing."""
    import dsv41_passes.lowering as lowering

    ran = []

    def fake(config, device=None):
        def run(inputs, cfg):
            if cfg["B"] == 3:
                raise RuntimeError("does not fit")
            ran.append((inputs, cfg["B"]))

        return [tuning.Tunable("fake_op", {"d": 1}, lambda m, dev: m, run, [{"B": 1}, {"B": 2}], {"B": 0}),
                tuning.Tunable("fake_none", {"d": 1}, lambda m, dev: m, run, [{"B": 3}, {"B": 3}], {"B": 0},
                               lambda m: {"B": 5})]

    monkeypatch.setattr(lowering, "tunables_for", fake)
    tuning.clear()
    chosen = dp.warmup(object(), max_tokens=3000, device="cpu", progress=False)
    assert list(chosen["fake_op"])[-1] == 4096 == tuning.bucket(3000)
    assert tuning.tactic("fake_op", 3000, {"d": 1}, {"B": 0}) in ({"B": 1}, {"B": 2})
    assert all(cfg == {"B": 5} for cfg in chosen["fake_none"].values())  # what an untuned call runs
    assert tuning.tactic("fake_none", 3000, {"d": 1}, {"B": 0}) == {"B": 0}  # nothing recorded
    tuning.clear()


def test_warmup_compiles_and_tunes_every_op_without_running_the_model(monkeypatch):
    import dsv41_passes.lowering as lowering
    from dsv41_passes.reference import DeepseekV41Config

    real = lowering.tunables_for

    def two_candidates(config, device=None):  # the interpreter makes every timed candidate cost
        ts = real(config, device)
        for t in ts:
            t.candidates = t.candidates[:2]
        return ts

    monkeypatch.setattr(lowering, "tunables_for", two_candidates)
    cfg = DeepseekV41Config.tiny()
    with dp.batch_invariant(True):
        chosen = dp.warmup(cfg, max_tokens=2, device="cpu", progress=False)
    ops = {
        "mhc_post", "mhc_stats", "mhc_collapse", "mhc_pre", "mhc_boundary",
        "q_rope_store", "kv_rope_quant_store", "wo_a",
    }
    assert ops <= set(chosen) and all(list(v) == [1, 2] for v in chosen.values())
    assert tuning.entries() == {}  # batch-invariant mode: defaults only, nothing tuned
    chosen = dp.warmup(cfg, max_tokens=2, device="cpu", progress=False)
    # one tuned entry per op and bucket where a candidate ran (here the first two; none of some ops' fit the tiny
    # shapes, and those buckets keep the untuned config), each the config the warm-up chose
    ents = tuning.entries()
    assert len(ents) >= len(chosen)
    for key, cfg_ in ents.items():
        op, _, b = key.split("|")
        assert chosen[op][int(b)] == cfg_, key


def test_warmup_without_tactics_compiles_what_untuned_calls_run(monkeypatch):
    """DSV41_TACTICS=off: each bucket gets the config an untuned call at that M uses (WO-A's
    depends on M), not the batch-invariant one."""
    from dsv41_passes.lowering.triton import wo_a as tk
    from dsv41_passes.reference import DeepseekV41Config

    monkeypatch.setenv("DSV41_TACTICS", "off")
    # one bucket of each untuned regime up to 128 (every interpreted bucket costs seconds): WO-A's split-K
    # decode config (M <= 16), its 32-row (<= 64) and 64-row (<= 512) tiles; mHC's 16-row blocks (<= 64) and
    # mhc_pre's small-row finish (65 ... 128)
    kept, real = (1, 32, 128), tuning.buckets
    monkeypatch.setattr(tuning, "buckets", lambda *a, **kw: [b for b in real(*a, **kw) if b in kept])
    chosen = dp.warmup(DeepseekV41Config.tiny(), max_tokens=128, device="cpu", progress=False)
    assert all(set(v) == set(kept) for v in chosen.values()), chosen
    assert chosen["wo_a"] == {b: tk.default_config(b) for b in chosen["wo_a"]}
    assert len({repr(cfg) for cfg in chosen["wo_a"].values()}) == len(kept)  # a config of its own per bucket
    from dsv41_passes.lowering import tunables_for
    from dsv41_passes.lowering.triton import mhc as tm

    d = DeepseekV41Config.tiny().hidden_size
    for op in ("mhc_post", "mhc_stats", "mhc_collapse", "mhc_pre", "mhc_boundary"):
        assert chosen[op] == {b: tm.untuned_config(op, b, d, False) for b in kept}, op
    # the tiny model's K slices have an odd chunk count (no split 2): at hidden 1024 the decode configs differ
    mhc = {t.op: t for t in tunables_for(DeepseekV41Config.tiny(hidden_size=1024), "cpu")}
    for op in ("mhc_stats", "mhc_collapse", "mhc_pre", "mhc_boundary"):
        assert mhc[op].untuned(1) == tm.untuned_config(op, 1, 1024, False) != tm.default_config(op), op
    assert any(cfg != tk.BATCH_INVARIANT_CONFIG for cfg in chosen["wo_a"].values())
    assert tuning.entries() == {}


MHC_OPS = {"mhc_post", "mhc_collapse", "mhc_stats", "mhc_pre", "mhc_boundary"}


@pytest.mark.parametrize("overrides,declined", [
    (dict(hidden_size=40), MHC_OPS),  # hidden not a multiple of 16
    (dict(o_lora_rank=24), {"wo_a"}),  # o_rank not a multiple of 16
    (dict(head_dim=48, qk_rope_head_dim=8, kv_quant_block=24), {"kv_rope_quant_store", "kv_rope_quant"}),
])
def test_warmup_leaves_out_kernels_the_model_shapes_do_not_fit(monkeypatch, overrides, declined):
    """Shapes a Triton kernel declines (the op runs the reference provider there) have nothing to build: the warm-up
    crashed inside the kernels instead (an FP8 block of 24: the interpreter's 'arange's range must be a power of 2')."""
    from dsv41_passes.reference import DeepseekV41Config

    monkeypatch.setenv("DSV41_TACTICS", "off")
    chosen = dp.warmup(DeepseekV41Config.tiny(num_hidden_layers=1, **overrides), max_tokens=1, device="cpu",
                       progress=False)
    assert not declined & set(chosen) and "q_rope_store" in chosen, sorted(chosen)


def test_warmup_builds_only_what_the_pass_config_runs(monkeypatch):
    """The warm-up read only the pass config's batch-invariant switch: it built (and timed) kernels of switched-off
    families and providers, which the compiled graphs never run."""
    from dsv41_passes.reference import DeepseekV41Config

    monkeypatch.setenv("DSV41_TACTICS", "off")
    cfg = DeepseekV41Config.tiny(num_hidden_layers=1)
    chosen = dp.warmup(cfg, max_tokens=1, device="cpu", progress=False,
                       pass_config=dp.PassConfig(wo_a=False, mhc_boundary=False))
    assert "wo_a" not in chosen and "mhc_boundary" not in chosen and {"mhc_pre", "q_rope_store"} <= set(chosen)
    chosen = dp.warmup(cfg, max_tokens=1, device="cpu", progress=False,
                       pass_config=dp.PassConfig(mhc=False, rope_store=False))
    assert set(chosen) == {"wo_a"}, chosen
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # no Triton device: nothing to build for the reference
    assert dp.warmup(cfg, max_tokens=1, device="cpu", progress=False,
                     pass_config=dp.PassConfig(providers=("reference",))) == {}
    from dsv41_passes.tuning import _runs_under

    pc = dp.PassConfig()
    assert _runs_under("mhc_pre.tilelang", pc, False) and not _runs_under("mhc_pre.tilelang", pc, True)
    assert _runs_under("wo_a.tilelang", pc, True)
    assert not _runs_under("wo_a.tilelang", dp.PassConfig(providers=("triton", "reference")), False)


def test_warmup_without_a_triton_device_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="warm-up builds the Triton kernels: cpu tensors need CUDA or TRITON_INTER"):
        dp.warmup(_tiny(), max_tokens=2, device="cpu", progress=False)


def test_warmup_given_a_pass_config_for_the_model_says_where_it_goes():
    # dp.warmup(dp.PassConfig()) failed with "'PassConfig' object has no attribute 'hc_mult'"
    with pytest.raises(TypeError, match="the model's config .* pass_config="):
        dp.warmup(dp.PassConfig(), max_tokens=2, device="cpu", progress=False)
    with pytest.raises(TypeError, match="pass_config must be a PassConfig"):
        dp.warmup(_tiny(), max_tokens=2, pass_config=_tiny(), device="cpu", progress=False)


def _tiny():
    from dsv41_passes.reference import DeepseekV41Config

    return DeepseekV41Config.tiny()


def test_save_to_a_directory_leaves_nothing_behind(tmp_path):
    tuning.record("op", 4, KEY, DEFAULT)
    target = tmp_path / "tactics"
    target.mkdir()
    with pytest.raises(OSError):
        dp.save_tactics(target)
    assert [p.name for p in tmp_path.iterdir()] == ["tactics"]  # (the temporary file was left beside it)
