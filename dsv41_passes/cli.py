"""Command line.

``python -m dsv41_passes inspect --model tiny [--layers N] [--dump DIR]``
    compile the embedded tiny model with the passes, print the rewrite report
    (sites per kind and layer, provider, skipped sites with reasons) and the
    largest |logits - eager| on a packed batch. ``--dump`` writes the graphs
    before/after, every registered pattern, the report, and the rewritten region
    as GraphML and DOT.
``python -m dsv41_passes demo``
    run the tiny reference model eagerly on a packed batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _tiny(layers: int):
    from .reference import DeepseekV41Config, DeepseekV41ForCausalLM

    cfg = DeepseekV41Config.tiny(num_hidden_layers=layers)
    return cfg, DeepseekV41ForCausalLM(cfg, max_num_tokens=256, max_num_seqs=4).eval()


def _packed(cfg, lengths=(11, 29, 6)):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return ids, pos, cu


def _demo(args: argparse.Namespace) -> int:
    cfg, model = _tiny(args.layers)
    ids, pos, cu = _packed(cfg)
    t = time.perf_counter()
    with torch.inference_mode():
        logits = model(ids, pos, cu)
    print(f"tiny DeepSeek-V4.1: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, hc_mult {cfg.hc_mult}")
    print(f"packed batch {list(cu.diff().tolist())} -> logits {tuple(logits.shape)} "
          f"in {1e3 * (time.perf_counter() - t):.1f} ms")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import dsv41_passes as dp

    if args.model != "tiny":
        print(f"unknown model {args.model!r}; only the embedded 'tiny' preset is available", file=sys.stderr)
        return 2
    cfg, model = _tiny(args.layers)
    ids, pos, cu = _packed(cfg)
    with torch.inference_mode():
        eager = model(ids, pos, cu)
    model.reset_cache()
    pc = dp.PassConfig(
        mhc=not args.no_mhc,
        rope_store=not args.no_rope_store,
        wo_a=not args.no_wo_a,
        batch_invariant=True if args.batch_invariant else None,
        providers=tuple(args.providers.split(",")),
        dump_dir=args.dump,
    )
    t = time.perf_counter()
    fast = dp.compile(model, pc, options={"emulate_precision_casts": True})
    out = fast(ids, pos, cu)
    compile_s = time.perf_counter() - t
    rep = dp.last_report()
    print(f"tiny DeepSeek-V4.1, {cfg.num_hidden_layers} layers; packed batch {cu.diff().tolist()}; "
          f"compile + first call {compile_s:.1f} s")
    print(rep.to_markdown())
    err = (out - eager).abs().max().item()
    print(f"max |logits - eager| = {err:.3e} (logits max {eager.abs().max().item():.2f})")
    if args.dump:
        import networkx as nx

        os.makedirs(args.dump, exist_ok=True)
        region = rep.rewritten_region()
        nx.write_graphml(region, os.path.join(args.dump, "rewritten_region.graphml"))
        with open(os.path.join(args.dump, "rewritten_region.dot"), "w", encoding="utf-8") as f:
            f.write("digraph rewritten {\n")
            for n, a in region.nodes(data=True):
                style = ', style=filled, fillcolor="#ffd479"' if a.get("fused") else ""
                f.write(f'  "{n}" [label="{n}\\n{a.get("target", "")}"{style}];\n')
            for u, v in region.edges():
                f.write(f'  "{u}" -> "{v}";\n')
            f.write("}\n")
        print(
            f"wrote graphs, patterns, report and the rewritten region ({region.number_of_nodes()} nodes) to {args.dump}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41_passes")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the embedded tiny model eagerly on a packed batch")
    d.add_argument("--layers", type=int, default=2)
    d.set_defaults(fn=_demo)
    i = sub.add_parser("inspect", help="compile the tiny model with the passes and print the rewrite report")
    i.add_argument("--model", default="tiny")
    i.add_argument("--layers", type=int, default=2)
    i.add_argument("--dump", default=None, help="directory for graphs, patterns, report, GraphML/DOT")
    i.add_argument("--providers", default="tilelang,triton,reference")
    i.add_argument("--batch-invariant", action="store_true")
    i.add_argument("--no-mhc", action="store_true")
    i.add_argument("--no-rope-store", action="store_true")
    i.add_argument("--no-wo-a", action="store_true")
    i.set_defaults(fn=_inspect)
    args = p.parse_args(argv)
    from .reference import DeepseekV41Config

    most = len(DeepseekV41Config.tiny().compress_ratios)
    if not 1 <= args.layers <= most:
        p.error(f"--layers: the tiny model has 1 to {most} layers, got {args.layers}")
    if args.cmd == "inspect":
        if args.dump:
            try:
                os.makedirs(args.dump, exist_ok=True)
            except OSError as e:
                p.error(f"--dump: cannot make directory {args.dump} ({e.strerror or e})")
            if not os.access(args.dump, os.W_OK):
                p.error(f"--dump: directory {args.dump} is not writable")
        args.providers = ",".join(n.strip() for n in args.providers.split(","))
        try:
            from .config import PassConfig

            PassConfig(providers=tuple(args.providers.split(",")))
        except ValueError as e:
            p.error(f"--providers: {e}")
    return args.fn(args)
