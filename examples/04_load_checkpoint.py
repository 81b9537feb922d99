"""Load a DeepSeek-style safetensors checkpoint, then run it eagerly and compiled with the passes.

    python examples/04_load_checkpoint.py                      # writes a small random checkpoint first
    python examples/04_load_checkpoint.py --save DIR           # ... and keeps it in DIR
    python examples/04_load_checkpoint.py --checkpoint DIR     # loads DIR (config.json + *.safetensors)

Without ``--checkpoint`` the script writes a checkpoint of the tiny config in DeepSeek's
layout: tensors named like the model's parameters, split over two shards with a
``model.safetensors.index.json``, the linear weights of attention and experts stored as FP8
(e4m3) with one power-of-two ``.scale`` per 32 x 32 block, and an HF-style ``config.json``
(block size under ``quantization_config``). ``load_checkpoint`` dequantizes the FP8 weights to
bf16. The loaded model runs on a packed batch eagerly and through ``dp.compile``; the script
prints the sites rewritten and the largest logit difference. Runs on CPU in well under a minute
with the generated checkpoint.
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import dsv41_passes as dp
from dsv41_passes.reference import DeepseekV41Config, DeepseekV41ForCausalLM, load_checkpoint
from dsv41_passes.reference.quant import FP8_MAX, ue8m0_scale

# Linear weights stored as FP8 in the generated checkpoint; norms, mHC, gate, embedding and head
# stay in bf16/fp32, as in DeepSeek's checkpoints.
FP8_PARTS = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.",
             ".ffn.experts.", ".ffn.shared_experts.")


def to_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8-e4m3 weight with one power-of-two fp32 scale per (bn x bk) block: w ~= q * scale."""
    bn, bk = block
    n, k = w.shape
    tiles = w.float().reshape(n // bn, bn, k // bk, bk)
    scale = ue8m0_scale(tiles.abs().amax(dim=(1, 3)))  # [n / bn, k / bk]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, k), scale


def write_checkpoint(path: Path, cfg: DeepseekV41Config, seed: int = 1) -> None:
    path.mkdir(parents=True, exist_ok=True)
    src = DeepseekV41ForCausalLM(cfg, max_num_tokens=16, seed=seed)  # random weights of a plausible scale
    tensors = {k: v.detach().contiguous() for k, v in src.state_dict().items()}  # buffers are not persistent
    bn, bk = cfg.weight_block_size
    n_fp8 = 0
    for name in sorted(tensors):
        w = tensors[name]
        whole_blocks = w.dim() == 2 and w.shape[0] % bn == 0 and w.shape[1] % bk == 0
        if name.endswith(".weight") and any(p in name for p in FP8_PARTS) and whole_blocks:
            tensors[name], tensors[name[: -len("weight")] + "scale"] = to_fp8_blocks(w, (bn, bk))
            n_fp8 += 1

    # Two shards and an index, as large checkpoints are published.
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / fname)
        print(f"wrote {path / fname}")
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    print(f"wrote {path / 'model.safetensors.index.json'}")

    # HF-style config: the block size lives in quantization_config.
    conf = cfg.to_dict()
    conf.pop("extra")
    block = list(conf.pop("weight_block_size"))
    conf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block}
    (path / "config.json").write_text(json.dumps(conf, indent=1))
    print(f"wrote {path / 'config.json'}")
    print(f"checkpoint: {len(tensors)} tensors, {n_fp8} FP8 weights with block scales")


def run(ckpt: Path) -> None:
    if not ckpt.exists():
        raise SystemExit(f"checkpoint {ckpt} does not exist")
    cfg_file = ckpt / "config.json" if ckpt.is_dir() else ckpt.parent / "config.json"
    if cfg_file.exists():
        cfg = DeepseekV41Config.from_json(cfg_file)
    else:
        print(f"no config.json beside {ckpt}; assuming the tiny config")
        cfg = DeepseekV41Config.tiny()
    print(f"config: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, weight blocks {cfg.weight_block_size}")

    model = DeepseekV41ForCausalLM(cfg, max_num_tokens=256, seed=None).eval()  # seed=None: no random init
    load_checkpoint(model, ckpt)  # strict: names every missing, unexpected or mis-shaped tensor
    print(f"loaded {ckpt}")

    # Packed batch of three sequences.
    lengths = [9, 24, 14]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    with torch.inference_mode():
        eager = model(ids, pos, cu)
    model.reset_cache()  # the compiled run starts from the same empty KV cache
    # the mHC stats patterns match only the model's own Sinkhorn count
    out = dp.compile(model, dp.PassConfig(hc_sinkhorn_iters=cfg.hc_sinkhorn_iters))(ids, pos, cu)

    rep = dp.last_report()
    print(f"sites rewritten: {rep.sites}")
    if rep.skipped:
        print(f"sites skipped: {len(rep.skipped)}: "
              + "; ".join(f"{r.kind} at {r.location}: {r.reason}" for r in rep.skipped))
    for w in rep.warnings:
        print(f"WARNING: {w}")
    print(f"max |logits - eager| = {(out - eager).abs().max().item():.3e} (logits max {eager.abs().max().item():.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default=None, help="checkpoint file or directory to load (default: write one)")
    ap.add_argument("--save", default=None, help="where to write the generated checkpoint (default: a temp dir)")
    args = ap.parse_args()
    if args.checkpoint:
        run(Path(args.checkpoint))
    elif args.save:
        write_checkpoint(Path(args.save), DeepseekV41Config.tiny())
        run(Path(args.save))
    else:
        with tempfile.TemporaryDirectory(prefix="dsv41_ckpt_") as d:
            write_checkpoint(Path(d), DeepseekV41Config.tiny())
            run(Path(d))


if __name__ == "__main__":
    main()
