"""Prefill benchmark: N DeepSeek-V4.1 decoder layers at V4.1-Flash TP4 per-rank shapes (GPU).

Three backends on the same layers and inputs: eager, torch.compile (Inductor default) and
torch.compile with the dsv41 passes (``dp.compile``), each compiled once with a dynamic token
count. Per token count M it reports milliseconds per layer for

  layer    the whole decoder layer: mHC, attention (projections, RoPE/store, the windowed
           attention core, WO-A/WO-B) and the MoE as the reference implements it
  outside  the same layer with the MoE and the attention core (key gather from the window
           cache + softmax attention) replaced by an opaque copy of their input: what is left
           is the part the passes rewrite plus the projections around it (eager still gathers
           the keys it then drops; the compiled graphs drop the gather)

and, from one profiled call per backend and scope, the time in each fused family (the
``dsv41::`` ops) and in library GEMMs (``aten::mm`` and kin: the projections, and under
Inductor default also the mHC projection, which the passes fuse). The MoE runs its local experts densely (no sparse dispatch in the
reference), so the routed experts are cut to 8 (2 on this rank; each token goes through both,
about the 1.5 expert FFNs a rank computes per token under top-6 of 384) plus the shared expert.

    python examples/03_prefill_benchmark.py                 # GPU: 4 layers, M = 16384 4096 65536
    python examples/03_prefill_benchmark.py --dry-run       # CPU: tiny shapes, checks the plumbing
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dsv41_passes as dp  # noqa: E402
from dsv41_passes.reference import DeepseekV41Config  # noqa: E402
from dsv41_passes.reference.model import BatchMeta, Block  # noqa: E402
from dsv41_passes.reference.rope import layer_rope_params, rope_table  # noqa: E402

FAMILY_OF = {"mhc": "mhc", "q_rope": "rope_store", "kv_rope": "rope_store", "wo_a": "wo_a"}


@torch.library.custom_op("dsv41_bench::stand_in", mutates_args=())
def stand_in(x: torch.Tensor) -> torch.Tensor:
    """A copy no compiler can see through: replaces the MoE / attention core in the 'outside' runs."""
    return x.clone()


@stand_in.register_fake
def _(x):
    return torch.empty_like(x)


class StandInFFN(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stand_in(x)


class Layers(nn.Module):
    """``n`` decoder blocks on one packed batch, as the model's forward runs them (no embedding, no head)."""

    def __init__(self, cfg: DeepseekV41Config, n: int, first: int, max_tokens: int, outside_only: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(Block(cfg, first + i, max_tokens, 2) for i in range(n))
        tables = {}
        self.table_of = []
        for i in range(n):
            base, scaling = layer_rope_params(cfg, first + i)
            key = repr((base, scaling))
            if key not in tables:
                tables[key] = len(tables)
                self.register_buffer(f"table_{tables[key]}", rope_table(cfg.qk_rope_head_dim, max_tokens, base, scaling),
                                     persistent=False)
            self.table_of.append(tables[key])
        if outside_only:
            for b in self.blocks:
                b.ffn = StandInFFN()
                b.attn._window_attention = lambda q, keys, valid: stand_in(q)

    def forward(self, h, pre, positions, cu):
        w = self.cfg.sliding_window
        meta = BatchMeta(positions, cu, None, w, 2 * w)
        freqs = [getattr(self, f"table_{t}")[positions] for t in range(max(self.table_of) + 1)]
        for b, t in zip(self.blocks, self.table_of):
            h, pre = b(h, pre, freqs[t], meta)
        return h, pre


def build(cfg, n, first, max_tokens, dev, outside_only, seed=0):
    torch.manual_seed(seed)
    with torch.device(dev):
        layers = Layers(cfg, n, first, max_tokens, outside_only).eval()
    with torch.no_grad():
        for name, p in layers.named_parameters():
            if name.endswith("_scale") or "norm" in name:
                p.fill_(1.0)
            elif name.endswith("_fn"):
                p.normal_(std=0.5 / p.shape[1] ** 0.5)
            else:
                p.normal_(std=p.shape[-1] ** -0.5 if p.dim() == 2 else 0.02)
    return layers


def inputs(cfg, m, dev, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = [m - m // 2, m // 2] if m > 1 else [m]
    pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    h = torch.randn(m, cfg.hc_mult, cfg.hidden_size, generator=g).to(dev, torch.bfloat16)
    pre = torch.softmax(torch.randn(m, cfg.hc_mult, generator=g), -1).to(dev)
    return h, pre, pos, cu


def time_ms(fn, dev, reps, warmup=2):
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e3 / reps
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]


GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm")


def breakdown_ms(fn, dev, warmup=True) -> dict[str, float]:
    """Milliseconds per call by kind (profiler, one call): each fused family's ``dsv41::`` ops and
    the library GEMMs (``aten::mm`` and kin)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if warmup:
        fn()
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        us = ev.device_time_total if cuda else ev.cpu_time_total
        if ev.key.startswith("dsv41::"):
            op = ev.key.split("::", 1)[1]
            kind = next((f for k, f in FAMILY_OF.items() if op.startswith(k)), "other_fused")
        elif ev.key in GEMMS:
            kind = "gemm"
        else:
            continue
        out[kind] = out.get(kind, 0.0) + us / 1e3
    return out


def compiled(backend: str, module: nn.Module):
    if backend == "eager":
        return module
    if backend == "inductor":  # the token dim dynamic, as dp.compile marks it
        fn = torch.compile(module)

        def run(*args):
            for a in args[:3]:
                torch._dynamo.mark_dynamic(a, 0)
            return fn(*args)

        return run
    return dp.compile(module, dp.PassConfig())


def plot(rows, fams, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms_list = sorted({r["M"] for r in rows})
    backends = ["eager", "inductor", "dsv41"]
    fig, axes = plt.subplots(1, len(ms_list), figsize=(4.2 * len(ms_list), 4), squeeze=False)
    for ax, m in zip(axes[0], ms_list):
        get = {(r["backend"], r["scope"]): r["ms_per_layer"] for r in rows if r["M"] == m}
        x = range(len(backends))
        out = [get.get((b, "outside"), 0.0) for b in backends]
        core = [max(get.get((b, "layer"), 0.0) - o, 0.0) for b, o in zip(backends, out)]
        ax.bar(x, out, color="#d95f02", label="outside MoE + attention core")
        ax.bar(x, core, bottom=out, color="#bbbbbb", label="MoE + attention core (layer - outside)")
        f = fams.get(str(m), {})
        if f:
            bottom = 0.0
            for fam, col in (("mhc", "#1b9e77"), ("rope_store", "#7570b3"), ("wo_a", "#e7298a")):
                v = f.get(fam, 0.0)
                ax.bar([2.33], [v], width=0.3, bottom=bottom, color=col, label=f"dsv41 {fam}")
                bottom += v
        ax.set_xticks(list(x), backends)
        ax.set_title(f"M = {m}")
        ax.set_ylabel("ms per layer")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, payload: dict) -> None:
    """The rows with the date, command line and versions (``complete`` False while token counts are left)."""
    from benchmarks.common import versions

    path.parent.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    path.write_text(json.dumps({"benchmark": "prefill", "date": date, "argv": sys.argv, "versions": versions(),
                                **payload}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ms", type=int, nargs="+", default=[16384, 4096, 65536])
    ap.add_argument("--backends", nargs="+", default=["eager", "inductor", "dsv41"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=float(os.environ.get("PREFILL_BUDGET_S", 1e9)),
                    help="stop starting new token counts after this many seconds")
    ap.add_argument("--json", default=None, help="write the rows here (default: benchmarks/results/prefill-...)")
    ap.add_argument("--plot", default=None, help="PNG path (default: beside the JSON)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, one layer, --ms gives how many token counts (1 or 2)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    if args.dry_run:
        dev = torch.device("cpu")
        cfg = DeepseekV41Config.tiny(n_routed_experts=4, num_experts_per_tok=2)
        args.ms, args.layers, args.reps, first = [40, 24][: len(args.ms) if len(args.ms) < 3 else 2], 1, 1, 0
        max_tokens = 64
        warmup = 0  # each backend's first call (timed apart) is the warm-up: every interpreted call costs seconds
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a GPU (or --dry-run)")
        dev = torch.device("cuda")
        cfg = DeepseekV41Config.flash(tp_size=4, n_routed_experts=8, max_position_embeddings=max(args.ms))
        first, max_tokens = 2, max(args.ms)
        warmup = 2
    torch.set_grad_enabled(False)
    rows, fams, checks, breakdown = [], {}, {}, {}
    models = {scope: build(cfg, args.layers, first, max_tokens, dev, scope == "outside") for scope in ("layer", "outside")}
    runners = {(b, s): compiled(b, models[s]) for b in args.backends for s in models}
    for m in args.ms:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"M={m}: skipped (time budget of {args.budget_s:.0f} s spent)", flush=True)
            continue
        x = inputs(cfg, m, dev)
        outs = {}
        for (b, s), fn in runners.items():
            for mod in models.values():
                for blk in mod.blocks:
                    blk.attn.kv_cache.zero_()
            with torch.inference_mode():
                t0 = time.perf_counter()
                try:
                    outs[(b, s)] = fn(*x)[0].float()
                except torch.OutOfMemoryError:  # eager's broadcasts at M = 65536 do not fit an 80 GB card (run 209)
                    outs.pop((b, s), None)
                    torch.cuda.empty_cache()
                    print(f"M={m:6d} {b:8s} {s:8s} out of device memory: skipped", flush=True)
                    continue
                first_call = time.perf_counter() - t0
                ms = time_ms(lambda: fn(*x), dev, args.reps, warmup) / args.layers
                parts = {k: v / args.layers for k, v in breakdown_ms(lambda: fn(*x), dev, warmup > 0).items()}
                breakdown.setdefault(f"{b} {s}", {})[str(m)] = parts
                if b == "dsv41" and s == "layer":
                    fams[str(m)] = {k: v for k, v in parts.items() if k in ("mhc", "rope_store", "wo_a")}
            rows.append({"M": m, "backend": b, "scope": s, "ms_per_layer": ms, "first_call_s": first_call})
            print(f"M={m:6d} {b:8s} {s:8s} {ms:9.3f} ms/layer  (first call {first_call:.1f} s)", flush=True)
        for (b, s), o in outs.items():  # the MoE's top-k may flip on near ties, so 'layer' can differ more
            ref = outs.get(("eager", s))
            if ref is not None and b != "eager":
                err = ((o - ref).abs().max() / ref.abs().max()).item()
                checks[f"{b} {s} M={m}"] = err
                print(f"M={m:6d} {b:8s} {s:8s} max |h - eager| / max |eager| = {err:.2e}", flush=True)
        if args.json:  # what is measured so far survives a run cut by a time limit
            write_json(Path(args.json), {"rows": rows, "families_ms_per_layer": fams,
                                         "breakdown_ms_per_layer": breakdown, "checks": checks, "complete": False})
    # summary
    print("\n| M | backend | layer ms | outside MoE+attn ms | dsv41 families ms (mhc / rope_store / wo_a) |")
    print("|---|---|---|---|---|")
    get = {(r["M"], r["backend"], r["scope"]): r["ms_per_layer"] for r in rows}
    summary = []
    for m in sorted({r["M"] for r in rows}):
        for b in args.backends:
            f = fams.get(str(m), {}) if b == "dsv41" else {}
            fs = " / ".join(f"{f.get(k, 0.0):.3f}" for k in ("mhc", "rope_store", "wo_a")) if f else "-"
            print(f"| {m} | {b} | {get.get((m, b, 'layer'), float('nan')):.3f} | "
                  f"{get.get((m, b, 'outside'), float('nan')):.3f} | {fs} |")
        if (m, "inductor", "outside") in get and (m, "dsv41", "outside") in get:
            s = {"M": m, "outside_speedup_vs_inductor": get[(m, "inductor", "outside")] / get[(m, "dsv41", "outside")],
                 "layer_speedup_vs_inductor": get[(m, "inductor", "layer")] / get[(m, "dsv41", "layer")]}
            if (m, "eager", "layer") in get:
                s["layer_speedup_vs_eager"] = get[(m, "eager", "layer")] / get[(m, "dsv41", "layer")]
            summary.append(s)
            print(f"M={m}: outside MoE + attention core {s['outside_speedup_vs_inductor']:.2f}x shorter than "
                  f"Inductor default; whole layer {s['layer_speedup_vs_inductor']:.2f}x")
    print("\nprofiled ms per layer (one call): fused families and library GEMMs")
    for key, per_m in breakdown.items():
        for m, parts in per_m.items():
            print(f"  {key:18s} M={m:>6s} " + "  ".join(f"{k} {v:.3f}" for k, v in sorted(parts.items())))
    payload = {"rows": rows, "families_ms_per_layer": fams, "breakdown_ms_per_layer": breakdown,
               "summary": summary, "checks": checks,
               "shapes": {"layers": args.layers, "tp": cfg.tp_size, "hidden": cfg.hidden_size,
                          "local_heads": cfg.local_heads, "routed_experts": cfg.n_routed_experts,
                          "local_experts": cfg.local_experts, "dry_run": args.dry_run}}
    if args.dry_run and not args.json:  # dry runs never land in benchmarks/results
        import tempfile

        args.json = str(Path(tempfile.mkdtemp(prefix="dsv41-prefill-")) / "prefill-dry-run.json")
    if args.json:
        path = Path(args.json)
        write_json(path, dict(payload, complete=True))
    else:
        from benchmarks.common import write_result

        path = write_result("prefill", payload)
    print(f"wrote {path}")
    png = Path(args.plot) if args.plot else path.with_suffix(".png")
    try:
        dev_name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (dry run)"
        plot(rows, fams, png, f"{args.layers} layers, V4.1-Flash TP4 per rank, {dev_name}, {time.strftime('%Y-%m-%d')}")
        print(f"wrote {png}")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], png.name).write_bytes(png.read_bytes())
    except ImportError as e:
        print(f"no plot: {e}")


if __name__ == "__main__":
    main()
