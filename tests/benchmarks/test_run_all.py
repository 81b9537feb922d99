"""benchmarks/run_all.py and benchmarks/plots.py on CPU: normalization of the committed H200 results,
the Markdown report, the PNG plots, and the stage runner's time limit."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks import plots, run_all

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MHC = RESULTS / "mhc-NVIDIA_H200-2026-11-29-run1-defaults.json"
ROPE = RESULTS / "rope_store-NVIDIA_H200-2026-11-29-run3-defaults.json"
WO_A = RESULTS / "wo_a-NVIDIA_H200-2026-11-29-run3-defaults.json"


def load(path):
    return json.loads(path.read_text())


def rows_of(path):
    return run_all.normalize(load(path), path.name)


def pick(rows, op, m, impl):
    (r,) = [r for r in rows if r["op"] == op and r["M"] == m and r["impl"] == impl]
    return r


def test_mhc_rows():
    raw, rows = load(MHC), rows_of(MHC)
    assert {r["op"] for r in rows} == {"mhc_pre", "mhc_post", "mhc_boundary"}
    assert {r["variant"] for r in rows} == {"ours", "eager", "inductor", "tilekernels"}
    timed = [r for r in raw["rows"] if "ms" in r and not r["variant"].startswith("roofline")]
    assert len([r for r in rows if r["ms"] is not None]) == len(timed)
    for src in timed:  # the bench wrote x_roofline = ms / roofline independently
        r = pick(rows, f"mhc_{src['unit']}", src["M"], src["variant"])
        assert isinstance(r["ms"], float) and r["ms"] == src["ms"]
        assert r["frac_roofline"] == pytest.approx(r["roofline_ms"] / r["ms"])
        assert r["frac_roofline"] == pytest.approx(1 / src["x_roofline"])
        assert r["check"] is (src["check"] == "PASS")
    pre = pick(rows, "mhc_pre", 65536, "triton (mhc_pre, one read)")
    assert pre["variant"] == "ours" and pre["check"] is False
    assert pick(rows, "mhc_pre", 65536, "inductor")["ms"] is None  # an ERROR row keeps no time


def test_rope_store_rows():
    raw, rows = load(ROPE), rows_of(ROPE)
    assert {r["op"] for r in rows} == {"q_rope_store tp4", "kv_rope_store"}
    for src in raw["rows"]:
        op = "q_rope_store tp4" if src["path"] == "q" else "kv_rope_store"
        ours = pick(rows, op, src["M"], "triton (default config)")
        assert ours["variant"] == "ours" and ours["ms"] == src["ours"]
        assert ours["frac_roofline"] == pytest.approx(src["roofline"] / src["ours"])
        assert 100 * ours["frac_roofline"] == pytest.approx(src["pct_roofline"])
        assert ours["check"] is src["correct"]["ours"]
        assert pick(rows, op, src["M"], "inductor")["ms"] == src["inductor"]
        assert pick(rows, op, src["M"], "eager")["roofline_ms"] == src["roofline"]
    assert all(r["ms"] > 0 for r in rows)


def test_wo_a_rows():
    raw, rows = load(WO_A), rows_of(WO_A)
    assert {r["op"] for r in rows} == {"wo_a tp4"}
    assert {r["variant"] for r in rows} == {"ours", "eager", "inductor", "cublas"}
    for src in raw["rows"]:
        best = min((r for r in rows if r["M"] == src["M"] and r["variant"] == "ours" and r["ms"]),
                   key=lambda r: r["ms"])
        assert best["ms"] == src["ours_best"]  # the bench's own best of ours
        assert pick(rows, "wo_a tp4", src["M"], "cublas_bmm (GEMM only)")["ms"] == src["cublas_bmm"]
        assert best["frac_roofline"] == pytest.approx(src["roofline"] / src["ours_best"])
    failed = pick(rows, "wo_a tp4", 65536, "tilelang")  # checked, failed, no time
    assert failed["check"] is False and failed["ms"] is None


def test_summary_and_markdown_numbers():
    rows = rows_of(MHC) + rows_of(ROPE) + rows_of(WO_A)
    md = run_all.markdown(rows, {"date": "2026-11-29", "versions": {"device": "NVIDIA H200"}})
    assert "NVIDIA H200" in md
    for op in ("mhc_pre", "mhc_post", "mhc_boundary", "q_rope_store tp4", "kv_rope_store", "wo_a tp4"):
        assert f"## {op}" in md
    # WO-A at 4096: ours = TileLang 0.167 ms, best anchor cuBLAS 0.08745, roofline 0.08604
    src = next(r for r in load(WO_A)["rows"] if r["M"] == 4096)
    section = md.split("## wo_a tp4")[1]
    assert f"{src['ours_tilelang']:.4g}" in section and f"{src['cublas_bmm']:.4g}" in section
    assert f"{100 * src['roofline'] / src['ours_tilelang']:.3g}%" in section
    assert f"{src['eager'] / src['ours_tilelang']:.2f}x" in section
    # KV at 65536: the fastest anchor is Inductor even though its check failed (the conservative speed-up)
    kv = next(r for r in load(ROPE)["rows"] if r["path"] == "kv" and r["M"] == 65536)
    s = run_all.summarize(rows)["kv_rope_store"][65536]
    assert s["best_anchor"]["variant"] == "inductor" and s["speedup"]["inductor"] == pytest.approx(
        kv["inductor"] / kv["ours"])
    kv_md = md.split("## kv_rope_store")[1].split("##")[0]
    assert f"| {kv['ours']:.4g} |" in kv_md.replace("| ours (ms) ", "|")
    assert f"{kv['inductor'] / kv['ours']:.2f}x" in kv_md
    # mHC post at 4096: ours failed its check in that run: the table says so
    post = md.split("## mhc_post")[1].split("##")[0]
    assert "✗" in post


def test_ours_prefers_a_passing_variant():
    def row(variant, impl, ms, check):
        return run_all._row("x", "op", variant, impl, 4096, ms, 0.5, check, "", "t")

    rows = [row("ours", "fast but wrong", 1.0, False), row("ours", "slow", 2.0, True),
            row("eager", "eager", 8.0, True), row("inductor", "inductor", 4.0, False)]
    s = run_all.summarize(rows)["op"][4096]
    assert s["ours"]["impl"] == "slow" and s["best_anchor"]["variant"] == "inductor"
    assert s["speedup"] == {"eager": 4.0, "inductor": 2.0} and s["frac_roofline"] == 0.25
    md = run_all.markdown(rows, {"date": "d", "versions": {}})
    assert "| ours (ms) | 2 |" in md and "| best anchor (ms) | 4 ✗ |" in md and "| % of roofline | 25% |" in md
    only_wrong = run_all.summarize(rows[:1])["op"][4096]["ours"]
    assert only_wrong["impl"] == "fast but wrong"  # shown (marked failed) when nothing passed


def test_later_file_wins():
    tuned = RESULTS / "rope_store-NVIDIA_H200-2026-11-29-run4-tuned.json"
    rows = run_all.merge(rows_of(ROPE) + rows_of(tuned))
    got = pick(rows, "kv_rope_store", 65536, "triton (default config)")
    assert got["source"] == tuned.name
    assert pick(rows, "kv_rope_store", 16384, "triton (default config)")["source"] == ROPE.name  # only in run 3


def test_merge_replaces_a_row_whose_label_names_another_m_range():
    """run 127's TileLang mhc_pre row says 'from M 8192', run 183's 'the op's from M 1536': the newer one wins."""
    old = RESULTS / "mhc-NVIDIA_H200-2026-12-03-run127.json"
    new = RESULTS / "mhc-pre-boundary-NVIDIA_H200-2026-12-05-run183.json"
    rows = run_all.merge(rows_of(old) + rows_of(new))
    persistent = [r for r in rows if r["op"] == "mhc_pre" and r["M"] == 65536 and "persistent mhc_pre" in r["impl"]]
    assert [r["source"] for r in persistent] == [new.name], persistent
    assert run_all.impl_key("tilelang (fused boundary, one persistent kernel; the op's M 1536 to 32768)") == \
        "tilelang (fused boundary, one persistent kernel)"
    kept = "triton (mhc_pre, 4 streams a dot, BLOCK_M 64)"
    assert run_all.impl_key(kept) == kept


def fake_prefill():
    rows = []
    for m in (16384, 4096):
        for b, layer, outside in (("eager", 9.0, 3.0), ("inductor", 7.0, 2.0), ("dsv41", 5.0, 0.5)):
            rows += [dict(M=m, backend=b, scope="layer", ms_per_layer=layer * m / 16384),
                     dict(M=m, backend=b, scope="outside", ms_per_layer=outside * m / 16384)]
    rows.append(dict(M=128, backend="dsv41"))  # missing keys: kept, not plotted
    return {"benchmark": "prefill", "rows": rows, "checks": {"dsv41 layer M=4096": 2e-3}}  # the example's keys


def test_prefill_checks_reach_the_notes():
    """The example's own JSON (run 131): each row's difference from eager lands in its note."""
    doc = load(RESULTS / "prefill-NVIDIA_H200-2026-12-03-run131.json")
    rows = run_all.normalize(doc, "run131")
    noted = {(r["impl"], r["op"], r["M"]): r["note"] for r in rows if r["note"]}
    assert len(noted) == len(doc["checks"]) > 0
    key = next(iter(doc["checks"]))  # "backend scope M=m"
    b, scope, m = key.split(" ")
    assert noted[(b, scope, int(m[2:]))] == f"rel diff vs eager {doc['checks'][key]:.1e}"


def is_png(p: Path) -> bool:
    return p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_plots_write_pngs(tmp_path):
    rows = rows_of(MHC) + rows_of(ROPE) + rows_of(WO_A) + run_all.normalize(fake_prefill(), "prefill.json")
    paths = plots.render_all(rows, tmp_path, "t", "NVIDIA H200, 2026-11-29")
    assert [p.name for p in paths] == ["t-roofline.png", "t-speedup.png", "t-prefill.png"]
    assert all(is_png(p) for p in paths)
    assert plots.prefill_plot(rows_of(MHC), tmp_path / "none.png", "x") is None  # nothing to plot
    md = run_all.markdown(rows, {"date": "d", "versions": {}})
    pre = md.split("## prefill")[1]
    # columns: layer, outside, layer x vs eager / inductor, outside x vs eager / inductor
    assert "| 16384 | dsv41 | 5 | 0.5 | 1.80x | 1.40x | 6.00x | 4.00x |" in pre
    assert any(r["note"] == "rel diff vs eager 2.0e-03" for r in rows if r["M"] == 4096 and r["impl"] == "dsv41")


def test_from_json_cli(tmp_path):
    run_doc = {"benchmark": "run_all", "date": "2026-11-30T00:00:00Z", "versions": {"device": "NVIDIA H200"},
               "stages": [], "raw": {"wo_a": load(WO_A), "prefill": fake_prefill()}}
    f = tmp_path / "in.json"
    f.write_text(json.dumps(run_doc))
    out = tmp_path / "out"
    argv = sys.argv
    sys.argv = ["run_all.py", "--out", str(out), "--from-json", str(f), str(MHC)]
    try:
        run_all.main()
    finally:
        sys.argv = argv
    body = json.loads((out / "run_all-NVIDIA_H200-2026-11-30.json").read_text())
    assert {r["family"] for r in body["rows"]} == {"wo_a", "prefill", "mhc"}
    assert "## wo_a tp4" in (out / "run_all-NVIDIA_H200-2026-11-30.md").read_text()
    assert all(is_png(out / f"run_all-NVIDIA_H200-2026-11-30-{k}.png") for k in ("roofline", "speedup", "prefill"))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_runner_timeout_then_next_stage(tmp_path):
    pidfile = tmp_path / "pid"
    # the slow stage starts a grandchild: the whole process group must go at the limit
    slow = [sys.executable, "-c", "import subprocess, sys, time; "
            f"p = subprocess.Popen(['sleep', '60']); open({str(pidfile)!r}, 'w').write(str(p.pid)); "
            "print('started', flush=True); time.sleep(60)"]
    fast = [sys.executable, "-c", "print('second stage ran')"]
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    stages = [run_all.Stage("slow", slow, 2), run_all.Stage("fast", fast, 30), run_all.Stage("bad", failing, 30)]
    t0 = time.monotonic()
    rec = run_all.run_stages(stages, tmp_path, "d", total_limit=100, results=tmp_path)
    assert time.monotonic() - t0 < 30
    assert [r["status"] for r in rec] == ["timeout", "no json", "failed"]
    assert rec[0]["seconds"] < 15 and rec[2]["rc"] == 3
    assert "started" in Path(rec[0]["log"]).read_text()
    assert "second stage ran" in Path(rec[1]["log"]).read_text()
    deadline = time.monotonic() + 10
    while alive(int(pidfile.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(int(pidfile.read_text()))


def test_runner_total_limit_and_json(tmp_path):
    write = [sys.executable, "-c", "import json, sys; "
             f"open({str(tmp_path / 'wo_a-X-2026-01-01.json')!r}, 'w').write(json.dumps({{'benchmark': 'wo_a'}}))"]
    stale = tmp_path / "wo_a-old.json"  # there before the run, and newer-looking: not this run's
    stale.write_text(json.dumps({"benchmark": "wo_a"}))
    future = time.time_ns() + 3600 * 10**9
    os.utime(stale, ns=(future, future))
    stages = [run_all.Stage("none", [sys.executable, "-c", "pass"], 30, bench="wo_a"),
              run_all.Stage("a", write, 30, bench="wo_a"),
              run_all.Stage("b", [sys.executable, "-c", "import time; time.sleep(60)"], 60),
              run_all.Stage("c", [sys.executable, "-c", "pass"], 60)]
    rec = run_all.run_stages(stages, tmp_path, "d", total_limit=3, results=tmp_path)
    assert rec[0]["status"] == "no json" and rec[0]["json"] is None
    assert rec[1]["status"] == "ok" and rec[1]["json"].endswith("wo_a-X-2026-01-01.json")
    assert rec[2]["status"] == "timeout" and rec[2]["limit_s"] <= 3
    assert rec[3]["status"].startswith("skipped")


def test_stage_commands(tmp_path):
    st = run_all.stage_commands(run_all.STAGES, [4096, 128], run_all.LIMITS, tmp_path, "d", [16384], ["--x"])
    cmds = {s.name: s.cmd[1:] for s in st}
    assert cmds["mhc"] == ["benchmarks/bench_mhc.py", "--ms", "4096", "128"]
    assert cmds["rope_store"] == ["benchmarks/bench_rope_store.py", "--tp", "4", "--m", "4096", "128"]
    assert cmds["wo_a"] == ["benchmarks/bench_wo_a.py", "--tp", "4", "--m", "4096", "128"]
    assert cmds["prefill"] == ["examples/03_prefill_benchmark.py", "--json", str(tmp_path / "run_all-prefill-d.json"),
                               "--ms", "16384", "--x"]
    assert [s.budget_arg for s in st] == [None, None, None, "--budget-s"]
    assert sum(run_all.LIMITS.values()) < 540 and max(run_all.LIMITS, key=run_all.LIMITS.get) == "prefill"
    assert all(os.path.exists(run_all.ROOT / c[0]) for c in cmds.values())
    from benchmarks import common

    assert run_all.RESULTS == common.RESULTS  # where write_result puts the stage JSON


def test_runner_rollover_and_explicit_json(tmp_path):
    out = tmp_path / "p.json"
    out.write_text("{}")  # a stale file from an earlier run
    old = out.stat().st_mtime_ns
    writes = [sys.executable, "-c", f"import sys; open({str(out)!r}, 'w').write('{{}}'); print(sys.argv[1:])"]
    stages = [run_all.Stage("x", [sys.executable, "-c", "import time; time.sleep(0.05)"], 3, json_path=out),
              run_all.Stage("y", writes, 1, json_path=out, budget_arg="--budget-s")]
    os.utime(out, ns=(old - 10**9, old - 10**9))
    rec = run_all.run_stages(stages, tmp_path, "d", total_limit=100, results=tmp_path)
    assert rec[0]["status"] == "no json" and rec[0]["json"] is None  # stale file not taken
    assert rec[1]["status"] == "ok" and rec[1]["json"] == str(out)
    assert rec[1]["limit_s"] > 3  # 1 s of its own plus what stage x left unused
    budget = f"{run_all.BUDGET_FRAC * rec[1]['limit_s']:.0f}"
    assert f"['--budget-s', '{budget}']" in Path(rec[1]["log"]).read_text()  # a share of the limit it got


def test_committed_prefill_result_normalizes_to_its_own_summary():
    path = RESULTS / "prefill-NVIDIA_H200-2026-11-29.json"
    body = load(path)
    rows = run_all.normalize(body, path.name)
    ms = {(r["op"], r["impl"], r["M"]): r["ms"] for r in rows}
    assert len(rows) == 18  # 3 backends x 2 scopes x 3 token counts
    for s in body["summary"]:
        m = s["M"]
        assert ms[("outside", "inductor", m)] / ms[("outside", "dsv41", m)] == pytest.approx(
            s["outside_speedup_vs_inductor"]
        )
        assert ms[("layer", "inductor", m)] / ms[("layer", "dsv41", m)] == pytest.approx(s["layer_speedup_vs_inductor"])
    md = run_all.markdown(rows, {"device": "NVIDIA H200", "date": "2026-11-29"})
    assert "| 16384 | dsv41 | 14.22 | 4.308 |" in md
