"""The scripts in examples/ run from a fresh process and print what they promise."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ALL_KINDS = {"mhc_stats", "mhc_collapse", "mhc_post", "q_rope_store", "kv_rope_store", "wo_a"}


# runs the script as ``python script args`` would (argv, __main__, its folder first on sys.path), after installing
# the tests' interpreter speed-up where the kernels run interpreted (example 01: 75 s without it, 49 s with it)
_BOOT = ("import os, runpy, sys; script = sys.argv[1]; sys.argv = sys.argv[1:]; "
         "sys.path[0] = os.path.dirname(script)\n"
         "if os.environ.get('TRITON_INTERPRET') == '1':\n"
         f"    sys.path.insert(1, {str(ROOT / 'tests')!r}); import interpreter_speedup; interpreter_speedup.install()\n"
         "runpy.run_path(script, run_name='__main__')")


def _run(name: str, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-c", _BOOT, str(EXAMPLES / name), *args], capture_output=True, text=True,
                       env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stdout


def _max_error(out: str) -> float:
    m = re.search(r"max \|logits - eager\| = (\S+)", out)
    assert m, out[-2000:]
    return float(m.group(1))


@pytest.mark.slow
def test_01_compile_and_compare():
    out = _run("01_compile_and_compare.py")
    assert "| wo_a | 0 |" in out and "| mhc_post | 1 |" in out, out[-2000:]  # report table rows
    counts = re.search(r"rewritten sites: (.*);", out).group(1)
    assert "wo_a: 2" in counts and "mhc_post: 4" in counts, counts
    assert _max_error(out) < 0.05, out[-2000:]


@pytest.mark.slow
def test_02_inspect_rewritten_graphs(tmp_path):
    out = _run("02_inspect_rewritten_graphs.py", "--out", str(tmp_path))
    png = tmp_path / "layer0_rewritten_region.png"
    assert f"wrote {png}" in out, out[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, len(data)
    for f in ("graph0.before.txt", "graph0.after.txt", "graph0.report.json"):
        assert f"wrote {tmp_path / 'dump' / f}" in out and (tmp_path / "dump" / f).stat().st_size > 0, f
    before, after = map(int, re.search(r"(\d+) nodes before the passes, (\d+) after", out).groups())
    assert 0 < after < before, (before, after)
    per_layer = dict(re.findall(r"^\s+layer (\d+): (.+)$", out, re.M))
    for layer in ("0", "1"):
        assert set(re.findall(r"(\w+) \d+", per_layer.get(layer, ""))) == ALL_KINDS, out[-2000:]
    # mhc_pre, the two stores, wo_a and two boundaries (each post fused with the next sub-block's pre)
    assert re.search(r"layer 0: 6 fused ops \(mhc_pre, .*wo_a.*mhc_boundary, mhc_boundary\)", out), out[-2000:]


@pytest.mark.slow
def test_04_load_checkpoint():
    out = _run("04_load_checkpoint.py")
    assert re.search(r"checkpoint: \d+ tensors, [1-9]\d* FP8 weights with block scales", out), out[-2000:]
    sites = ast.literal_eval(re.search(r"sites rewritten: (\{.*\})", out).group(1))
    assert set(sites) == ALL_KINDS and all(v > 0 for v in sites.values()), sites
    assert _max_error(out) < 0.05, out[-2000:]


def test_02_layer_out_of_range_is_a_usage_error_before_compiling(tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "02_inspect_rewritten_graphs.py"), "--layer", "2", "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "--layer 2: the tiny model has layers 0 to 1" in r.stderr, r
    assert not (tmp_path / "dump").exists()  # nothing compiled


def test_04_missing_checkpoint_is_a_clear_error(tmp_path):
    """Before it says anything else (it used to print that it assumed the tiny config first)."""
    missing = tmp_path / "nope"
    r = subprocess.run([sys.executable, str(EXAMPLES / "04_load_checkpoint.py"), "--checkpoint", str(missing)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode != 0 and r.stdout == "" and f"checkpoint {missing} does not exist" in r.stderr, r


@pytest.mark.slow
def test_05_serve_loop_one_graph_per_token_regime():
    # the three sequences finish after 1, 2 and 3 decode steps: M = 3 then 2 (the prefill's graph) then 1
    out = _run("05_serve_loop.py", "--steps", "3", "--new-tokens", "1", "2", "3")
    assert re.findall(r"^step \d+: (\d+) active", out, re.M) == ["3", "2", "1"], out[-2000:]
    assert "Dynamo graphs compiled: 2 (one for M >= 2, one for M = 1)" in out, out[-2000:]
    decode = re.search(r"decode graph \(M = 1\) rewrote: (\{.*\})", out).group(1)
    assert "'wo_a': 2" in decode and "'q_rope_store': 2" in decode, decode


@pytest.mark.slow
def test_05_serve_loop_stops_when_every_sequence_has_finished():
    # --steps past the largest --new-tokens: the loop used to run the model on an empty batch and crash
    out = _run("05_serve_loop.py", "--steps", "3", "--new-tokens", "1", "1", "1")
    assert re.findall(r"^step \d+: (\d+) active", out, re.M) == ["3"], out[-2000:]
    # no step had one sequence left: one graph, and the summary does not call it the decode graph
    assert "Dynamo graphs compiled: 1 (one for M >= 2)" in out and "graph (M >= 2) rewrote: {" in out, out[-2000:]


@pytest.mark.slow
def test_06_install_into_inductor():
    out = _run("06_install_into_inductor.py")
    assert "rewritten sites: mhc_post: 1, mhc_stats: 1" in out, out[-2000:]


@pytest.mark.slow
def test_03_prefill_benchmark_dry_run(tmp_path):
    # 03 is a GPU benchmark; --dry-run runs one tiny layer on CPU. --json keeps its output out of the repo.
    result = tmp_path / "prefill.json"
    out = _run("03_prefill_benchmark.py", "--dry-run", "--ms", "40", "--json", str(result))
    assert f"wrote {result}" in out and (tmp_path / "prefill.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out[-2000:]
    data = json.loads(result.read_text())
    got = {(r["backend"], r["scope"]) for r in data["rows"] if r["M"] == 40 and r["ms_per_layer"] > 0}
    assert got == {(b, s) for b in ("eager", "inductor", "dsv41") for s in ("layer", "outside")}, got
    fams = data["families_ms_per_layer"]["40"]
    assert all(fams.get(f, 0) > 0 for f in ("mhc", "rope_store", "wo_a")), fams
    assert data["checks"]["dsv41 outside M=40"] < 0.05, data["checks"]
    assert data["summary"][0]["M"] == 40


@pytest.mark.slow
def test_04_checkpoint_with_its_own_sinkhorn_count(tmp_path):
    # the passes' hc_sinkhorn_iters must be the loaded model's: the example used PassConfig()'s 20, and every
    # mhc_stats site of a checkpoint with another count stayed unrewritten
    import importlib.util

    from dsv41_passes.reference import DeepseekV41Config

    spec = importlib.util.spec_from_file_location("ex04", EXAMPLES / "04_load_checkpoint.py")
    ex04 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex04)
    ex04.write_checkpoint(tmp_path, DeepseekV41Config.tiny(num_hidden_layers=1, hc_sinkhorn_iters=3))
    out = _run("04_load_checkpoint.py", "--checkpoint", str(tmp_path))
    sites = ast.literal_eval(re.search(r"sites rewritten: (\{.*\})", out).group(1))
    assert sites.get("mhc_stats") == 2 and "sites skipped" not in out, out[-2000:]
