"""A toy serving loop: packed prefill, then greedy decode steps, one compiled graph for every batch size.

    python examples/05_serve_loop.py [--batch-invariant] [--steps N] [--new-tokens A B C]

Each step packs whatever sequences are active into one token dimension; the
compiled graph serves every token count (M = 1 gets its own graph once).
With --batch-invariant a sequence's logits do not depend on what else is in the batch.
"""

import argparse

import torch
from torch._dynamo.utils import counters

import dsv41_passes as dp
from dsv41_passes.reference import DeepseekV41Config, DeepseekV41ForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, nargs=3, default=[3, 5, 7], metavar=("A", "B", "C"),
                    help="tokens each of the three sequences decodes (at most --steps)")
    args = ap.parse_args()
    cfg = DeepseekV41Config.tiny()
    model = DeepseekV41ForCausalLM(cfg, max_num_tokens=1024, max_num_seqs=8).eval()
    fast = dp.compile(model, dp.PassConfig(batch_invariant=args.batch_invariant or None))

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (5, 17, 9)]
    seqs = [p.tolist() for p in prompts]
    ids = torch.cat(prompts)
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    cu = torch.tensor([0, *torch.tensor([len(p) for p in prompts]).cumsum(0).tolist()])
    logits = fast(ids, pos, cu, torch.arange(len(prompts)))  # sequence b lives in cache slot b
    nxt = [logits[e - 1].argmax().item() for e in cu[1:].tolist()]
    sizes = {len(ids)}  # the token counts the compiled model ran
    for step in range(args.steps):
        active = [b for b in range(len(seqs)) if step < args.new_tokens[b]]  # sequences finish at different steps
        if not active:  # every sequence has finished (--steps past the largest --new-tokens): no empty batch
            break
        for b in active:
            seqs[b].append(nxt[b])
        ids = torch.tensor([nxt[b] for b in active])
        pos = torch.tensor([len(seqs[b]) - 1 for b in active])
        logits = fast(ids, pos, torch.arange(len(active) + 1), torch.tensor(active))
        sizes.add(len(active))
        for i, b in enumerate(active):
            nxt[b] = logits[i].argmax().item()
        print(f"step {step}: {len(active)} active, tokens {ids.tolist()}")
    graphs = ", ".join(g for g, ok in (("one for M >= 2", any(m >= 2 for m in sizes)), ("one for M = 1", 1 in sizes))
                       if ok)
    print(f"Dynamo graphs compiled: {counters['stats']['unique_graphs']} ({graphs})")
    # the last graph compiled: M = 1's where a step had one sequence left
    print(f"{'decode graph (M = 1)' if 1 in sizes else 'graph (M >= 2)'} rewrote:", dp.last_report().sites)


if __name__ == "__main__":
    main()
