"""Command line: ``python -m dsv41_passes demo``."""

from __future__ import annotations

import argparse
import time

import torch


def _demo(args: argparse.Namespace) -> int:
    from .reference import DeepseekV41Config, DeepseekV41ForCausalLM

    cfg = DeepseekV41Config.tiny(num_hidden_layers=args.layers)
    model = DeepseekV41ForCausalLM(cfg, max_num_tokens=256, max_num_seqs=4).eval()
    lengths = [11, 29, 6]
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = time.perf_counter()
    with torch.inference_mode():
        logits = model(ids, pos, cu)
    print(f"tiny DeepSeek-V4.1: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, hc_mult {cfg.hc_mult}")
    print(f"packed batch of {len(lengths)} sequences {lengths} -> logits {tuple(logits.shape)} "
          f"in {1e3 * (time.perf_counter() - t):.1f} ms; greedy next tokens "
          f"{[logits[e - 1].argmax().item() for e in cu[1:].tolist()]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41_passes")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run the embedded tiny model on a packed batch")
    d.add_argument("--layers", type=int, default=2)
    d.set_defaults(fn=_demo)
    args = p.parse_args(argv)
    return args.fn(args)
