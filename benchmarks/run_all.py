"""Every kernel family plus the end-to-end prefill benchmark in one device call, then one report.

    source .devsite/setup.sh && python benchmarks/run_all.py            # all stages, < ~9 min
    python benchmarks/run_all.py --stages mhc wo_a --ms 4096 128          # a subset
    python benchmarks/run_all.py --from-json a.json b.json                # no GPU: re-render only

Stages run as subprocesses, each with its own time limit (unused seconds roll over to later
stages, all capped by --total-limit); a stage that fails or times out is recorded and the run goes
on. Writes into --out: run_all-<device>-<date>.json (versions, stage records, normalized rows, the
raw per-stage JSON), run_all-<device>-<date>.md, PNG plots (benchmarks/plots.py) and one log per
stage; with $OUT set, copies of all of them there too.

Normalized row: family, op, variant (ours | eager | inductor | tilekernels | cublas), impl (the
bench's own name), M, ms, roofline_ms, frac_roofline (roofline_ms / ms), check (True / False /
None when not checked), note, source.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"  # = common.RESULTS, without importing torch in this process
STAGES = ["mhc", "rope_store", "wo_a", "prefill"]
LIMITS = {"mhc": 110, "rope_store": 80, "wo_a": 110, "prefill": 230}  # seconds; sum 530
TOTAL_LIMIT = 540
MS = [65536, 16384, 4096, 128]
PREFILL_MS = [16384, 4096, 65536]  # the example's own order: the largest last, dropped first by its budget
BUDGET_FRAC = 0.5  # the prefill example starts no new M after this share of its limit (its JSON: after each M)
ANCHORS = ["eager", "inductor", "tilekernels", "cublas"]


# ----------------------------------------------------------------------------- stage runner
@dataclass
class Stage:
    name: str
    cmd: list[str]
    limit: float
    bench: str | None = None  # common.write_result name: its JSON is found in RESULTS by mtime
    json_path: Path | None = None  # or the explicit path the command writes
    budget_arg: str | None = None  # a flag given BUDGET_FRAC of the stage's actual limit, in seconds
    record: dict[str, Any] = field(default_factory=dict)


def stage_commands(names: list[str], ms: list[int], limits: dict[str, float], out: Path, date: str,
                   prefill_ms: list[int] = PREFILL_MS, prefill_args: tuple[str, ...] = ()) -> list[Stage]:
    py, m, pm = sys.executable, [str(x) for x in ms], [str(x) for x in prefill_ms]
    prefill_json = out / f"run_all-prefill-{date}.json"
    table = {
        "mhc": ([py, "benchmarks/bench_mhc.py", "--ms", *m], "mhc", None),
        "rope_store": ([py, "benchmarks/bench_rope_store.py", "--tp", "4", "--m", *m], "rope_store", None),
        "wo_a": ([py, "benchmarks/bench_wo_a.py", "--tp", "4", "--m", *m], "wo_a", None),
        "prefill": ([py, "examples/03_prefill_benchmark.py", "--json", str(prefill_json), "--ms", *pm,
                     *prefill_args], None, prefill_json),
    }
    return [Stage(n, table[n][0], limits[n], table[n][1], table[n][2], "--budget-s" if n == "prefill" else None)
            for n in names]


def snapshot(folder: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in folder.glob("*.json")} if folder.is_dir() else {}


def find_new_json(folder: Path, before: dict[Path, int], bench: str) -> Path | None:
    """The newest JSON in ``folder`` written since ``before`` whose "benchmark" is ``bench``."""
    new = [p for p, t in snapshot(folder).items() if before.get(p) != t]
    for p in sorted(new, key=lambda p: p.stat().st_mtime_ns, reverse=True):
        try:
            if json.loads(p.read_text()).get("benchmark") == bench:
                return p
        except (OSError, ValueError):
            continue
    return None


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the stage's own process group (start_new_session), nothing else
    except ProcessLookupError:
        pass


def run_stage(stage: Stage, limit: float, log: Path) -> dict[str, Any]:
    """Run one command in its own process group; kill the whole group at ``limit`` seconds."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(stage.cmd)}  (limit {limit:.0f} s)\n")
        f.flush()
        proc = subprocess.Popen(stage.cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=max(limit, 1))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGKILL)
            rc = proc.wait()
        except BaseException:  # Ctrl-C: do not leave the stage running
            _kill_group(proc, signal.SIGKILL)
            raise
    secs = time.monotonic() - t0
    status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
    return dict(stage=stage.name, cmd=shlex.join(stage.cmd), limit_s=round(limit, 1), seconds=round(secs, 1),
                rc=rc, status=status, log=str(log))


def run_stages(stages: list[Stage], out: Path, date: str, total_limit: float = TOTAL_LIMIT,
               results: Path = RESULTS) -> list[dict[str, Any]]:
    """Run stages in order. Each gets its limit plus seconds earlier stages left unused, within the total."""
    t_start, bank = time.monotonic(), 0.0
    for st in stages:
        left = total_limit - (time.monotonic() - t_start)
        limit = min(st.limit + bank, left)
        log = out / f"run_all-{st.name}-{date}.log"
        if st.budget_arg:
            st.cmd = [*st.cmd, st.budget_arg, f"{BUDGET_FRAC * limit:.0f}"]
        if limit < 1:
            st.record = dict(stage=st.name, cmd=shlex.join(st.cmd), status="skipped (no time left)", log=None)
        else:
            print(f"=== {st.name}: {shlex.join(st.cmd)} (limit {limit:.0f} s)", flush=True)
            before = snapshot(results)
            mtime = st.json_path.stat().st_mtime_ns if st.json_path and st.json_path.exists() else None
            st.record = run_stage(st, limit, log)
            bank = max(0.0, limit - st.record["seconds"])
            fresh = st.json_path and st.json_path.exists() and st.json_path.stat().st_mtime_ns != mtime
            js = st.json_path if fresh else None  # not a stale file from an earlier run
            if st.bench and js is None:
                js = find_new_json(results, before, st.bench)
            st.record["json"] = str(js) if js else None
            if st.record["status"] == "ok" and js is None:
                st.record["status"] = "no json"
            print(f"=== {st.name}: {st.record['status']} rc={st.record['rc']} {st.record['seconds']} s", flush=True)
            print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:]), flush=True)
    return [st.record for st in stages]


# ----------------------------------------------------------------------------- normalization
def _row(family, op, variant, impl, m, ms, roof, check, note, source) -> dict[str, Any]:
    ms = float(ms) if isinstance(ms, (int, float)) else None
    roof = float(roof) if isinstance(roof, (int, float)) and roof > 0 else None
    frac = roof / ms if roof and ms else None
    return dict(family=family, op=op, variant=variant, impl=impl, M=m, ms=ms, roofline_ms=roof,
                frac_roofline=frac, check=check, note=note, source=source)


def norm_mhc(doc: dict, source: str) -> list[dict[str, Any]]:
    rows = doc.get("rows", [])
    roofs = {(r["unit"], r["M"]): r.get("ms") for r in rows if r.get("variant", "").startswith("roofline")}
    out = []
    for r in rows:
        name = r.get("variant", "")
        if name.startswith("roofline"):
            continue
        first = name.split(" ")[0]
        variant = first if first in ("eager", "inductor", "tilekernels") else "ours"  # triton / tilelang: ours
        c = str(r.get("check", "-"))
        check = True if c == "PASS" else (None if c == "-" else False)
        out.append(_row("mhc", f"mhc_{r['unit']}", variant, name, r["M"], r.get("ms"), roofs.get((r["unit"], r["M"])),
                        check, "" if check else c, source))
    return out


def _wide(family: str, op: str, r: dict, cols: dict[str, tuple[str, str, str | None]], source: str) -> list[dict]:
    """One wide row -> long rows. cols: column -> (variant, impl, key in row["correct"] or None)."""
    ok = r.get("correct", {})
    out = []
    for col, (variant, impl, ck) in cols.items():
        if col not in r and (ck is None or ck not in ok):
            continue
        check = ok.get(ck) if ck else None
        out.append(_row(family, op, variant, impl, r["M"], r.get(col), r.get("roofline"), check,
                        "" if check is not False else "check failed", source))
    return out


def norm_rope_store(doc: dict, source: str) -> list[dict[str, Any]]:
    cols = {"ours": ("ours", "triton (default config)", "ours"), "ours_pass": ("ours", "dsv41 pass", "ours_pass"),
            "tuned": ("ours", "triton (tuned config)", None),  # the tuner keeps only checked configs
            "eager": ("eager", "eager", "eager"), "inductor": ("inductor", "inductor", "inductor")}
    out = []
    for r in doc.get("rows", []):
        op = f"q_rope_store tp{r.get('tp')}" if r.get("path") == "q" else "kv_rope_store"
        out += _wide("rope_store", op, r, cols, source)
    return out


def norm_wo_a(doc: dict, source: str) -> list[dict[str, Any]]:
    out = []
    for r in doc.get("rows", []):
        cols = {"eager": ("eager", "eager", "eager"), "inductor": ("inductor", "inductor", "inductor"),
                "cublas_bmm": ("cublas", "cublas_bmm (GEMM only)", None)}
        for k in sorted(set(r) | set(r.get("correct", {}))):  # a failed variant may have a check but no time
            if k.startswith("ours_") and k != "ours_best":
                cols[k] = ("ours", k[5:], k)
            elif k.startswith("tuned_"):
                cols[k] = ("ours", f"{k[6:]} (tuned config)", None)
        out += _wide("wo_a", f"wo_a tp{r.get('tp')}", r, cols, source)
    return out


def norm_prefill(doc: dict, source: str) -> list[dict[str, Any]]:
    out, errs = [], doc.get("checks", {})  # checks: max |h - eager| / max |eager| per "backend scope M=m"
    for r in doc.get("rows", []):
        backend, scope = str(r.get("backend", "?")), str(r.get("scope", "layer"))
        err = errs.get(f"{backend} {scope} M={r.get('M')}")
        out.append(_row("prefill", scope, "ours" if backend == "dsv41" else backend, backend, r.get("M"),
                        r.get("ms_per_layer"), None, None, f"rel diff vs eager {err:.1e}" if err else "", source))
    return out


def kind_of(doc: dict) -> str | None:
    name = doc.get("benchmark")
    if name in ("mhc", "rope_store", "wo_a", "prefill", "run_all"):
        return name
    rows = doc.get("rows") or [{}]
    keys = set(rows[0])
    for kind, probe in (("mhc", "unit"), ("rope_store", "path"), ("wo_a", "cublas_bmm"), ("prefill", "ms_per_layer")):
        if probe in keys:
            return kind
    return None


def normalize(doc: dict, source: str = "") -> list[dict[str, Any]]:
    """Long rows from one bench JSON (mhc, rope_store, wo_a, prefill) or a run_all JSON (its raw parts)."""
    kind = kind_of(doc)
    if kind == "run_all":
        return [r for name, raw in doc.get("raw", {}).items() for r in normalize(raw, f"{source}:{name}")]
    fn = {"mhc": norm_mhc, "rope_store": norm_rope_store, "wo_a": norm_wo_a, "prefill": norm_prefill}.get(kind)
    return fn(doc, source) if fn else []


# a label's note of the M range the op gives that implementation ("from M 8192", "the op's from M 1536", "opt-in"):
# it changes from run to run, the implementation does not
_SPAN = re.compile(r"(?:[,;] |\()(?:the op's [^,;)]*|opt-in|from M \d+)(?=[,;)])")


def impl_key(impl: str) -> str:
    """``impl`` without its M-range note: 'tilelang (persistent mhc_pre, from M 8192)' -> 'tilelang (persistent
    mhc_pre)'."""
    return _SPAN.sub(lambda m: "(" if m.group(0).startswith("(") else "", impl).replace(" ()", "").replace("()", "")


def merge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Later rows win for the same (family, op, variant, implementation, M): a newer file replaces an older one,
    also where the label's M-range note changed between them (``impl_key``)."""
    keyed = {(r["family"], r["op"], r["variant"], impl_key(r["impl"]), r["M"]): r for r in rows}
    return list(keyed.values())


# ----------------------------------------------------------------------------- summary and Markdown
def _fastest(rows):
    rows = [r for r in rows if r["ms"]]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per kernel op and M: ours = the fastest passing ours row (else the fastest one, marked failed);
    best anchor = the fastest anchor whatever its check (the conservative speed-up)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        if r["family"] != "prefill":
            out.setdefault(r["op"], {}).setdefault(r["M"], {"rows": []})["rows"].append(r)
    for per_m in out.values():
        for s in per_m.values():
            ours = [r for r in s["rows"] if r["variant"] == "ours"]
            s["ours"] = _fastest([r for r in ours if r["check"] is not False]) or _fastest(ours)
            s["anchors"] = {a: _fastest([r for r in s["rows"] if r["variant"] == a]) for a in ANCHORS}
            s["anchors"] = {a: r for a, r in s["anchors"].items() if r}
            s["best_anchor"] = _fastest(list(s["anchors"].values()))
            s["roofline_ms"] = next((r["roofline_ms"] for r in s["rows"] if r["roofline_ms"]), None)
            o = s["ours"]
            s["frac_roofline"] = s["roofline_ms"] / o["ms"] if o and s["roofline_ms"] else None
            s["speedup"] = {a: r["ms"] / o["ms"] for a, r in s["anchors"].items() if o}
    return out


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _mark(r: dict | None) -> str:
    return "" if r is None or r["check"] is not False else " ✗"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], stages: list[dict[str, Any]] | None = None) -> str:
    v = meta.get("versions", {})
    lines = [f"# DeepSeek-V4.1 kernels: {v.get('device', '?')}, {meta.get('date', '?')}", "",
             ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "tilelang", "tile_kernels", "cuda") if v.get(k)), "",
             "ms per call (CUDA-graph replay). ours = the fastest of our variants that passed its check; "
             "✗ = its check failed. Speed-up = anchor ms / ours ms; % of roofline = roofline ms / ours ms.", ""]
    if stages:
        lines += ["| stage | status | rc | s | limit s | command |", "|---|---|---|---|---|---|"]
        lines += [f"| {s['stage']} | {s['status']} | {s.get('rc', '-')} | {s.get('seconds', '-')} | "
                  f"{s.get('limit_s', '-')} | `{s['cmd']}` |" for s in stages]
        lines.append("")
    for op, per_m in summarize(rows).items():
        ms = sorted(per_m, reverse=True)
        cells = {
            "ours (ms)": [fmt_ms(s["ours"] and s["ours"]["ms"]) + _mark(s["ours"]) for s in map(per_m.get, ms)],
            "ours impl": [s["ours"]["impl"] if s["ours"] else "-" for s in map(per_m.get, ms)],
            "best anchor (ms)": [fmt_ms(s["best_anchor"] and s["best_anchor"]["ms"]) + _mark(s["best_anchor"])
                                 for s in map(per_m.get, ms)],
            "best anchor": [s["best_anchor"]["variant"] if s["best_anchor"] else "-" for s in map(per_m.get, ms)],
            "roofline (ms)": [fmt_ms(per_m[m]["roofline_ms"]) for m in ms],
            "% of roofline": [f"{100 * per_m[m]['frac_roofline']:.3g}%" if per_m[m]["frac_roofline"] else "-"
                              for m in ms],
        }
        for a in ANCHORS:
            if any(a in per_m[m]["speedup"] for m in ms):
                cells[f"speed-up vs {a}"] = [f"{per_m[m]['speedup'][a]:.2f}x" if a in per_m[m]["speedup"] else "-"
                                             for m in ms]
        lines += [f"## {op}", "", "| M | " + " | ".join(map(str, ms)) + " |", "|---" * (len(ms) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(c) + " |" for k, c in cells.items()]
        lines.append("")
    lines += prefill_markdown(rows)
    return "\n".join(lines)


def prefill_markdown(rows: list[dict[str, Any]]) -> list[str]:
    pre = [r for r in rows if r["family"] == "prefill"]
    if not pre:
        return []
    scopes = sorted({r["op"] for r in pre}, key=lambda s: (s != "layer", s))
    by = {(r["M"], r["impl"], r["op"]): r["ms"] for r in pre}
    keys = sorted({(r["M"], r["impl"]) for r in pre}, key=lambda k: (-(k[0] or 0), k[1]))
    vs = [(s, a) for s in scopes for a in ("eager", "inductor") if any(r["impl"] == a for r in pre)]
    lines = ["## prefill (ms per layer)", "", "outside = the layer without the MoE and the attention core; "
             "x = that backend's ms / this one's.", "",
             "| M | backend | " + " | ".join(scopes) + "".join(f" | {s}: x vs {a}" for s, a in vs) + " |",
             "|---" * (len(scopes) + len(vs) + 2) + "|"]
    for m, b in keys:
        xs = [(by.get((m, a, s)), by.get((m, b, s))) for s, a in vs]
        lines.append(f"| {m} | {b} | " + " | ".join(fmt_ms(by.get((m, b, s))) for s in scopes) +
                     "".join(f" | {x / y:.2f}x" if x and y else " | -" for x, y in xs) + " |")
    return lines + [""]


# ----------------------------------------------------------------------------- outputs
def write_outputs(rows, raw, meta, stages, out: Path) -> list[Path]:
    from benchmarks import plots  # matplotlib only when rendering

    out.mkdir(parents=True, exist_ok=True)
    stem = f"run_all-{meta['versions'].get('device', 'cpu').replace(' ', '_')}-{meta['date'][:10]}"
    body = {"benchmark": "run_all", **meta, "stages": stages, "rows": rows, "raw": raw}
    paths = [out / f"{stem}.json", out / f"{stem}.md"]
    paths[0].write_text(json.dumps(body, indent=1, default=str))  # key order of raw kept: later files win
    paths[1].write_text(markdown(rows, meta, stages))
    title = f"{meta['versions'].get('device', '?')}, {meta['date'][:10]}"
    paths += plots.render_all(rows, out, stem, title)
    logs = [Path(s["log"]) for s in stages if s.get("log") and Path(s["log"]).parent == out]
    if os.environ.get("OUT") and Path(os.environ["OUT"]).resolve() != out.resolve():  # device runs: hand back
        for p in paths + logs + ([Path(s["json"]) for s in stages if s.get("json")]):
            if p.exists():
                shutil.copy(p, Path(os.environ["OUT"], p.name))
    return paths


def from_json(files: list[str]) -> tuple[list, dict, dict, list]:
    rows, raw, meta, stages = [], {}, {}, []
    for f in files:
        doc = json.loads(Path(f).read_text())
        kind = kind_of(doc) or "unknown"
        if kind == "unknown":
            print(f"skipping {f}: not a mhc / rope_store / wo_a / prefill / run_all result")
            continue
        rows += normalize(doc, Path(f).name)
        parts = doc.get("raw", {}) if kind == "run_all" else {kind: doc}
        for k, part in parts.items():
            raw[k if k not in raw else f"{k}:{Path(f).name}"] = part  # keep every input, in order
        stages += doc.get("stages", []) if kind == "run_all" else []
        if not meta and doc.get("versions"):
            meta = {"date": doc.get("date", "?"), "versions": doc["versions"]}
    return merge(rows), raw, meta or {"date": "?", "versions": {}}, stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", nargs="+", default=STAGES, choices=STAGES)
    ap.add_argument("--ms", type=int, nargs="+", default=MS)
    for s in STAGES:
        ap.add_argument(f"--{s.replace('_', '-')}-limit", type=float, default=LIMITS[s], dest=f"limit_{s}",
                        help=f"seconds (default {LIMITS[s]})")
    ap.add_argument("--total-limit", type=float, default=TOTAL_LIMIT, help="seconds for all stages together")
    ap.add_argument("--prefill-ms", type=int, nargs="+", default=PREFILL_MS)
    ap.add_argument("--prefill-args", default="", help="extra arguments for the prefill example (one string)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--from-json", nargs="+", metavar="FILE", help="re-render existing JSON; run nothing")
    a = ap.parse_args()
    out = a.out.resolve()
    if a.from_json:
        rows, raw, meta, stages = from_json(a.from_json)
    else:
        out.mkdir(parents=True, exist_ok=True)
        date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        limits = {s: getattr(a, f"limit_{s}") for s in STAGES}
        specs = stage_commands(a.stages, a.ms, limits, out, date[:10], a.prefill_ms, shlex.split(a.prefill_args))
        stages = run_stages(specs, out, date[:10], a.total_limit)
        raw, rows = {}, []
        for st in stages:
            if st.get("json"):
                raw[st["stage"]] = json.loads(Path(st["json"]).read_text())
                rows += normalize(raw[st["stage"]], Path(st["json"]).name)
        ver = next((d["versions"] for d in raw.values() if d.get("versions")), None)
        if ver is None:  # no stage wrote JSON: ask this process (starts CUDA here, after the stages)
            from benchmarks.common import versions

            ver = versions()
        meta = {"date": date, "versions": ver, "argv": sys.argv}
    for p in write_outputs(rows, raw, meta, stages, out):
        print(f"wrote {p}")
    print(markdown(rows, meta, stages))


if __name__ == "__main__":
    main()
