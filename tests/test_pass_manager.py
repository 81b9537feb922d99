"""uuid rules, FX graph cache participation, dumps."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dsv41_passes as dp
from dsv41_passes import pass_manager as pm

ROOT = Path(__file__).resolve().parents[1]


def _uuid(config=None):
    return pm.PostGradPassManager(config or dp.PassConfig(batch_invariant=False)).uuid()


def _run(code: str, env: dict | None = None) -> str:
    e = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    e.update(env or {})
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_uuid_stable_across_processes():
    code = (
        "import dsv41_passes as dp; "
        "print(dp.pass_manager.PostGradPassManager(dp.PassConfig(batch_invariant=False)).uuid())"
    )
    a = _run(code).strip()
    b = _run(code).strip()
    assert a == b == _uuid()


@pytest.mark.parametrize(
    "change",
    [dict(mhc=False), dict(rope_store=False), dict(wo_a=False), dict(batch_invariant=True),
     dict(providers=("triton", "reference")), dict(static_weights=True), dict(mhc_boundary=False),
     dict(hc_sinkhorn_iters=19)],
)
def test_uuid_changes_with_each_config_field(change):
    assert _uuid(dp.PassConfig(**{"batch_invariant": False, **change})) != _uuid()


def test_uuid_ignores_dump_dir_and_follows_global_mode(tmp_path):
    assert _uuid(dp.PassConfig(batch_invariant=False, dump_dir=str(tmp_path))) == _uuid()
    follow = dp.PassConfig()
    off = pm.PostGradPassManager(follow).uuid()
    with dp.batch_invariant(True):
        on = pm.PostGradPassManager(follow).uuid()
    assert on != off


def test_uuid_changes_with_sources_and_versions(monkeypatch, tmp_path):
    base = _uuid()
    extra = tmp_path / "kernel.py"
    extra.write_text("x = 1\n")
    files = pm.source_files()
    monkeypatch.setattr(pm, "source_files", lambda: files + [extra])
    monkeypatch.setattr(pm, "_PKG", Path("/"))
    with_file = _uuid()
    extra.write_text("x = 2\n")
    assert _uuid() != with_file != base
    monkeypatch.undo()
    real = pm._versions()
    for name in ("torch", "triton", "tilelang"):
        monkeypatch.setattr(pm, "_versions", lambda n=name: {**real, n: "0.0.0-other"})
        assert _uuid() != base
    monkeypatch.undo()
    assert _uuid() == base
    assert any(f.match("lowering/triton/mhc.py") for f in pm.source_files())
    assert any(f.match("patterns/mhc.py") for f in pm.source_files())
    assert any(f.match("reference/rope.py") for f in pm.source_files())  # patterns trace the reference functions


_CACHE_SCRIPT = """
import json, torch
import dsv41_passes as dp
from torch._dynamo.utils import counters

def block(y, res, post, comb):
    out = post.unsqueeze(-1) * y.unsqueeze(1) + (comb.unsqueeze(-1) * res.unsqueeze(2)).sum(1)
    return out.to(torch.bfloat16)

g = torch.Generator().manual_seed(0)
args = (torch.randn(9, 32, generator=g).bfloat16(), torch.randn(9, 4, 32, generator=g).bfloat16(),
        torch.rand(9, 4, generator=g), torch.rand(9, 4, 4, generator=g))
out = dp.compile(block, dp.PassConfig(batch_invariant=False))(*args)
rep = dp.last_report()
print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "bypass": counters["inductor"]["fxgraph_cache_bypass"], "sites": rep.sites,
                  "from_cache": rep.from_cache, "warnings": rep.warnings, "sum": float(out.float().sum())}))
"""


def test_fx_graph_cache_hit_keeps_the_report(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}
    first = json.loads(_run(_CACHE_SCRIPT, env).strip().splitlines()[-1])
    second = json.loads(_run(_CACHE_SCRIPT, env).strip().splitlines()[-1])
    assert first["miss"] >= 1 and first["hit"] == 0 and first["bypass"] == 0
    assert first["sites"] == {"mhc_post": 1} and not first["from_cache"]
    assert second["hit"] >= 1 and second["miss"] == 0
    assert second["sites"] == {"mhc_post": 1} and second["from_cache"]
    assert second["sum"] == first["sum"]
    # a damaged saved report (or one of an older format) costs the report, not the compile
    saved = list((tmp_path / "inductor").rglob("dsv41_reports/*.json"))
    assert saved
    for f in saved:
        f.write_text(f.read_text()[:10])
    third = json.loads(_run(_CACHE_SCRIPT, env).strip().splitlines()[-1])
    assert third["hit"] >= 1 and third["from_cache"] and third["sum"] == first["sum"]
    assert third["sites"] == {} and "could not be read" in " ".join(third["warnings"])


def test_dump_dir_writes_graphs_patterns_and_report(tmp_path, monkeypatch):
    def block(y, res, post, comb):
        return (torch.einsum("mjk,mjd->mkd", comb, res.float()) + post.unsqueeze(-1) * y.unsqueeze(1)).to(
            torch.bfloat16
        )

    args = (torch.randn(5, 16).bfloat16(), torch.randn(5, 4, 16).bfloat16(), torch.rand(5, 4), torch.rand(5, 4, 4))
    # A warm FX graph cache holding this very graph (compiled without a dump) must not skip the dump.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    dump = tmp_path / "dump"
    with torch._inductor.config.patch(fx_graph_cache=True):
        torch._dynamo.reset()
        dp.compile(block, dp.PassConfig())(*args)
        torch._dynamo.reset()
        dp.compile(block, dp.PassConfig(dump_dir=str(dump)))(*args)
    tmp_path = dump
    names = sorted(p.name for p in tmp_path.iterdir())
    assert {"patterns.txt"} <= set(names)
    assert any(n.endswith(".before.txt") for n in names) and any(n.endswith(".after.txt") for n in names)
    text = (tmp_path / "patterns.txt").read_text()
    assert "mhc_post.broadcast_sum" in text and "CallFunction(aten.sum.dim_IntList" in text
    rep = json.loads(next(tmp_path.glob("*.report.json")).read_text())
    assert [r["kind"] for r in rep["rows"]] == ["mhc_post"]


def test_dump_dir_that_cannot_be_written_is_a_report_warning(tmp_path):
    """dump_dir naming a file: the compile goes on (it raised from inside Inductor) and the report says why."""
    target = tmp_path / "a_file"
    target.write_text("")

    def block(y, res, post, comb):
        return (torch.einsum("mjk,mjd->mkd", comb, res.float()) + post.unsqueeze(-1) * y.unsqueeze(1)).to(
            torch.bfloat16
        )

    args = (torch.randn(5, 16).bfloat16(), torch.randn(5, 4, 16).bfloat16(), torch.rand(5, 4), torch.rand(5, 4, 4))
    torch._dynamo.reset()
    out = dp.compile(block, dp.PassConfig(dump_dir=str(target)))(*args)
    torch.testing.assert_close(out, block(*args), rtol=0, atol=0)
    rep = dp.last_report()
    assert rep.sites == {"mhc_post": 1}
    assert any(f"dump_dir {target}: nothing written" in w for w in rep.warnings)


class _Post(torch.nn.Module):
    def forward(self, y, res, post, comb):
        out = post.unsqueeze(-1) * y.unsqueeze(1) + (comb.unsqueeze(-1) * res.unsqueeze(2)).sum(1)
        return out.to(torch.bfloat16)


class _AttnHolder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_post = _Post()

    def forward(self, *args):
        return self.attn_post(*args)


class _FfnHolder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ffn_post = _Post()

    def forward(self, *args):
        return self.ffn_post(*args)


def test_fx_graph_cache_hit_says_when_the_report_is_another_models(tmp_path, monkeypatch):
    """The graph cache's key leaves node meta out: two models whose graphs differ only in module paths share an
    entry, and the second was given the first one's report (its rows naming the other model's modules) without a
    word. Its sites are right (the passes do not read the paths); the warning says whose rows they are."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    args = (torch.randn(5, 32).bfloat16(), torch.randn(5, 4, 32).bfloat16(), torch.rand(5, 4), torch.rand(5, 4, 4))
    cfg = dp.PassConfig(batch_invariant=False, providers=("reference",))
    with torch._inductor.config.patch(fx_graph_cache=True):
        torch._dynamo.reset()
        dp.compile(_AttnHolder(), cfg)(*args)
        assert [r.location for r in dp.last_report().rows] == ["attn_post"]
        torch._dynamo.reset()
        dp.compile(_FfnHolder(), cfg)(*args)
        rep = dp.last_report()
        assert rep.from_cache and rep.sites == {"mhc_post": 1}, rep.to_markdown()
        assert "other module paths or source lines" in " ".join(rep.warnings), rep.to_markdown()
        torch._dynamo.reset()
        dp.compile(_AttnHolder(), cfg)(*args)  # the same model again: its own report, from the cache
        rep = dp.last_report()
        assert rep.from_cache and [r.location for r in rep.rows] == ["attn_post"], rep.to_markdown()
        assert not any("other module paths" in w for w in rep.warnings), rep.to_markdown()


def test_uuid_changes_with_the_triton_interpreter(monkeypatch):
    # the report (kept beside the FX-graph-cache entry) records the provider picked at compile time, and Triton
    # accepts CPU tensors only under TRITON_INTERPRET=1: a graph compiled under the other setting must not be served
    # with a report naming providers this process does not run
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    on = _uuid()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert _uuid() != on


@torch.library.custom_op("dsv41_test::copy", mutates_args=())
def _other_namespace_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_report_graph_marks_only_the_dsv41_namespace_fused():
    """An op of another namespace whose name holds "dsv41" (examples/03's dsv41_bench::stand_in) was marked fused, so
    ``networkx()`` / ``rewritten_region()`` (the CLI's GraphML and DOT) drew it as one of ours."""
    import torch.fx as fx

    from dsv41_passes.report import graph_to_node_link

    g = fx.Graph()
    x = g.placeholder("x")
    other = g.call_function(torch.ops.dsv41_test.copy.default, (x,))
    ours = g.call_function(torch.ops.dsv41.mhc_post.default, (other,))
    g.output(ours)
    rep = dp.RewriteReport(graph_json=graph_to_node_link(g))
    assert {n for n, a in rep.networkx().nodes(data=True) if a["fused"]} == {ours.name}


def test_report_saved_to_a_directory_leaves_nothing_behind(tmp_path):
    target = tmp_path / "report"
    target.mkdir()
    with pytest.raises(OSError):
        dp.RewriteReport().save(target)
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # (the temporary file was left beside it)
