"""GPU checks of the guards (issue 7) at V4.1-Flash shapes.

1. Batch-invariant mode, every fused op: a fixed row's outputs are bitwise identical at
   M = 1, 7, 4096, 65536 with the row placed at different positions among random rows.
2. Dynamic M: one DeepSeek-V4.1-Flash layer (TP4 per-rank shapes, 4 local experts) compiled once
   serves 12 token counts in [2, 65536] with one Dynamo graph, and the kernel caches stop growing
   after the first token counts.

    python benchmarks/check_guards.py [--smoke]     (--smoke: small shapes, CPU interpreter allowed)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dsv41_passes as dp  # noqa: E402
from dsv41_passes import tuning  # noqa: E402
from dsv41_passes.lowering.registry import encode_mode  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
PROVIDERS = "tilelang,triton,reference"
BI = encode_mode(True)


class Shapes:
    def __init__(self, smoke: bool):
        self.d = 64 if smoke else 5120
        self.n = 4
        self.h, self.hpad, self.hd, self.rd = (4, 8, 64, 16) if smoke else (16, 64, 512, 64)
        self.g, self.r = (2, 32) if smoke else (2, 1024)
        self.ms = (1, 7, 33) if smoke else (1, 7, 4096, 65536)


def _rand(shape, dtype, gen, dev, scale=1.0):
    return (torch.randn(shape, generator=gen, device=dev) * scale).to(dtype)


def _gen(dev, seed):
    return torch.Generator(device=dev).manual_seed(seed)


def op_cases(s: Shapes, dev):
    """name -> (build(m, gen) -> args, token-indexed arg positions, outputs(args, result, row) -> tensors)."""
    g0 = _gen(dev, 7)
    k = s.n * s.d
    fn = _rand((24, k), F32, g0, dev, 0.5 / k**0.5)
    scale = torch.rand(3, generator=g0, device=dev) + 0.5
    base = _rand((24,), F32, g0, dev, 0.5)
    w = 1 + 0.1 * torch.randn(s.d, generator=g0, device=dev)
    wo = _rand((s.g * s.r, s.h // s.g * s.hd), BF16, g0, dev, (s.h // s.g * s.hd) ** -0.5)
    kvw = 1 + 0.1 * torch.randn(s.hd, generator=g0, device=dev)
    mmw = _rand((s.d, 256), BF16, g0, dev, s.d**-0.5)

    def comb(m, gen):
        return torch.softmax(torch.randn(m, 4, 4, generator=gen, device=dev), -1)

    def tables(m, gen):
        a = torch.rand(m, s.rd // 2, generator=gen, device=dev) * 6.283
        return a.cos(), a.sin()

    def rows(res, r):
        return [t[r] for t in (res if isinstance(res, (tuple, list)) else (res,))]

    cases = {
        "mhc_post": (lambda m, gen: [_rand((m, s.d), BF16, gen, dev), _rand((m, 4, s.d), BF16, gen, dev),
                                     2 * torch.rand(m, 4, generator=gen, device=dev), comb(m, gen)],
                     (0, 1, 2, 3), lambda a, res, r: rows(res, r)),
        "mhc_stats": (lambda m, gen: [_rand((m, 4, s.d), BF16, gen, dev), fn, scale, base, 20, 1e-6, 1e-20],
                      (0,), lambda a, res, r: rows(res, r)),
        "mhc_collapse": (lambda m, gen: [_rand((m, 4, s.d), BF16, gen, dev),
                                         torch.rand(m, 4, generator=gen, device=dev), w, 1e-20],
                         (0, 1), lambda a, res, r: rows(res, r)),
        "mhc_pre": (lambda m, gen: [_rand((m, 4, s.d), BF16, gen, dev),
                                    torch.rand(m, 4, generator=gen, device=dev), fn, scale,
                                    base, w, 20, 1e-6, 1e-20, 1e-20], (0, 1), lambda a, res, r: rows(res, r)),
        "mhc_boundary": (lambda m, gen: [_rand((m, s.d), BF16, gen, dev), _rand((m, 4, s.d), BF16, gen, dev),
                                         2 * torch.rand(m, 4, generator=gen, device=dev), comb(m, gen),
                                         torch.rand(m, 4, generator=gen, device=dev), fn, scale, base, w,
                                         20, 1e-6, 1e-20, 1e-20],
                         (0, 1, 2, 3, 4), lambda a, res, r: rows(res, r)),
        "q_rope_store": (lambda m, gen: [torch.zeros(m, s.hpad, s.hd, dtype=BF16, device=dev),
                                         _rand((m, s.h, s.hd), BF16, gen, dev), *tables(m, gen)],
                         (1, 2, 3), lambda a, res, r: [a[0][r]]),
        "kv_rope_quant_store": (lambda m, gen: [torch.zeros(m + 1, s.hd, dtype=BF16, device=dev),
                                                _rand((m, s.hd), BF16, gen, dev), kvw, 1e-20, *tables(m, gen),
                                                torch.arange(m, device=dev), 32],
                                (1, 4, 5), lambda a, res, r: [res[r], a[0][r]]),
        "wo_a": (lambda m, gen: [_rand((m, s.h, s.hd), BF16, gen, dev), wo, *tables(m, gen), s.rd],
                 (0, 2, 3), lambda a, res, r: rows(res, r)),
        "bi_mm": (lambda m, gen: [_rand((m, s.d), BF16, gen, dev), mmw],
                  (0,), lambda a, res, r: rows(res, r)),
    }
    return cases


def check_row_invariance(s: Shapes, dev) -> list[tuple[str, str]]:
    results = []
    for name, (build, token_args, outputs) in op_cases(s, dev).items():
        op = getattr(torch.ops.dsv41, name, None)
        if op is None:
            results.append((name, "op not registered"))
            continue
        fixed = build(1, _gen(dev, 123))
        ref = None
        status = "PASS"
        for m in s.ms:
            for p in sorted({0, m - 1}):
                args = build(m, _gen(dev, 1000 + m + p))
                for i in token_args:
                    args[i][p] = fixed[i][0]
                res = op(*args, PROVIDERS, BI)
                got = [t.clone() for t in outputs(args, res, p)]
                if ref is None:
                    ref = got
                elif not all(torch.equal(a, b) for a, b in zip(ref, got)):
                    status = f"FAIL at M={m}, row {p}"
                    break
            if status != "PASS":
                break
        from dsv41_passes.lowering import choose

        prov, _ = choose(name, PROVIDERS, True, *build(1, _gen(dev, 0)))
        results.append((name, f"{status} ({prov.name if prov else '?'})"))
        print(f"  {name:22s} {results[-1][1]}", flush=True)
    return results


def check_dynamic_m(dev) -> str:
    """One Flash layer (TP4 per rank) compiled once for 12 token counts."""
    from torch._dynamo.utils import counters

    from dsv41_passes.reference import DeepseekV41Config
    from dsv41_passes.reference.model import BatchMeta, Block
    from dsv41_passes.reference.rope import layer_rope_params, rope_table

    cfg = DeepseekV41Config.flash(tp_size=4, n_routed_experts=16, max_position_embeddings=65536)
    with torch.device(dev):
        block = Block(cfg, 2, 65536, 2).eval()
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.02)
        block.hc_attn_scale.data.fill_(1.0)
        block.hc_ffn_scale.data.fill_(1.0)
        for nrm in (block.attn_norm, block.ffn_norm, block.attn.q_norm, block.attn.kv_norm):
            nrm.weight.data.fill_(1.0)
        base, scaling = layer_rope_params(cfg, 2)
        table = rope_table(cfg.qk_rope_head_dim, 65536, base, scaling).to(dev)
    w = cfg.sliding_window

    def layer(h, pre, positions, cu):
        meta = BatchMeta(positions, cu, None, w, 2 * w)
        return block(h, pre, table[positions], meta)

    fast = dp.compile(layer, dp.PassConfig())
    torch._dynamo.reset()
    counters.clear()

    def sweep(ms):
        lines = []
        for m in ms:
            lengths = [m - m // 2, m // 2] if m > 1 else [m]
            pos = torch.cat([torch.arange(n) for n in lengths]).to(dev)
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
            h = torch.randn(m, 4, cfg.hidden_size, device=dev).to(BF16)
            pre = torch.rand(m, 4, device=dev)
            t = time.perf_counter()
            fast(h, pre, pos, cu)
            torch.cuda.synchronize() if dev.type == "cuda" else None
            lines.append(f"M={m}: {time.perf_counter() - t:.2f}s graphs={counters['stats']['unique_graphs']}")
        print("  " + "; ".join(lines), flush=True)

    first = (2, 3, 17, 100, 1000, 4096, 9999, 20000, 32768, 50001, 65535, 65536)
    sweep(first)  # compiles the graph and every kernel binary the token counts need (a warm-up)
    sizes_warm = tuning.kernel_cache_sizes()
    graphs_warm = counters["stats"]["unique_graphs"]
    sweep(tuple(m - 1 for m in first[1:]) + (777,))  # twelve new token counts
    sizes_end = tuning.kernel_cache_sizes()
    print(f"  kernel caches after the first sweep: {sizes_warm}; after new token counts: {sizes_end}")
    for i, rep in enumerate(dp.reports()[-3:]):
        print(f"  report {i}: sites {rep.sites}")
    ok = counters["stats"]["unique_graphs"] == graphs_warm == 1 and sizes_end == sizes_warm
    return "PASS" if ok else f"FAIL (graphs {counters['stats']['unique_graphs']})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--layer-only", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = Shapes(args.smoke or dev.type != "cuda")
    inv = []
    if not args.layer_only:
        print(f"row invariance in batch-invariant mode, M in {s.ms}:")
        inv = check_row_invariance(s, dev)
    layer = "skipped"
    if not args.skip_layer and dev.type == "cuda":
        print("dynamic M on one Flash layer (TP4 per rank):")
        layer = check_dynamic_m(dev)
    print("\nsummary")
    for name, st in inv:
        print(f"  row invariance {name:22s} {st}")
    print(f"  one graph + no new binaries for 12 M in [2, 65536]: {layer}")


if __name__ == "__main__":
    main()
