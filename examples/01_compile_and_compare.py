"""Compile the tiny DeepSeek-V4.1 with the dsv41 passes and look at what was rewritten.

    python examples/compile_and_inspect.py [--dump DIR]
"""

import argparse

import torch

import dsv41_passes as dp
from dsv41_passes.reference import DeepseekV41Config, DeepseekV41ForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=None)
    args = ap.parse_args()
    model = DeepseekV41ForCausalLM(DeepseekV41Config.tiny(), max_num_tokens=512).eval()
    lengths = [7, 30, 12]
    ids = torch.randint(0, 256, (sum(lengths),))
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, 7, 37, 49])
    with torch.inference_mode():
        ref = model(ids, pos, cu)

    model.reset_cache()
    fast = dp.compile(model, dp.PassConfig(dump_dir=args.dump))  # or torch.compile(model, backend="dsv41")
    out = fast(ids, pos, cu)
    rep = dp.last_report()
    print(rep.to_markdown())
    print(f"\nsites per kind: {rep.sites}")
    print(f"max |logits - eager| = {(out - ref).abs().max().item():.3e}")
    fused = [ln.strip() for ln in rep.after.splitlines() if "dsv41." in ln]
    print(f"\n{len(fused)} fused-op calls in the rewritten graph, e.g.\n  " + "\n  ".join(fused[:3]))


if __name__ == "__main__":
    main()
