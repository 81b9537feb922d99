"""Compile the tiny DeepSeek-V4.1 with the dsv41 passes and compare it with eager PyTorch.

    python examples/01_compile_and_compare.py

Three sequences of different lengths are packed into one token dimension (cu_seqlens),
run once eagerly and once through ``dp.compile``. The script prints the rewrite report
(one row per rewritten or skipped site) and the largest absolute logit difference.
Runs on CPU in well under a minute; there every site runs the reference provider (each report row's
``reason`` says why the others declined; the printed table does not show it). ``TRITON_INTERPRET=1`` runs
the Triton kernels under the interpreter instead (slower).
"""

import torch

import dsv41_passes as dp
from dsv41_passes.reference import DeepseekV41Config, DeepseekV41ForCausalLM


def main() -> None:
    cfg = DeepseekV41Config.tiny()
    model = DeepseekV41ForCausalLM(cfg, max_num_tokens=512).eval()

    # Packed batch: sequences of 7, 30 and 12 tokens, each with positions starting at 0.
    lengths = [7, 30, 12]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])  # [0, 7, 37, 49]

    with torch.inference_mode():
        eager = model(ids, pos, cu)

    # The forward writes the KV window cache; clear it so both runs start from the same state.
    model.reset_cache()
    fast = dp.compile(model, dp.PassConfig())  # or: torch.compile(model, backend="dsv41")
    out = fast(ids, pos, cu)

    rep = dp.last_report()
    print(rep.to_markdown())
    print(f"\nsites per kind: {rep.sites}")
    fused = [ln.strip() for ln in rep.after.splitlines() if "dsv41." in ln]
    print(f"{len(fused)} fused-op calls in the rewritten graph")
    print(f"max |logits - eager| = {(out - eager).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
