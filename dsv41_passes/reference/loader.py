"""Load DeepSeek-style safetensors checkpoints into :class:`DeepseekV41ForCausalLM`.

Accepts one ``.safetensors`` file, or a directory holding either a
``*.safetensors.index.json`` (``weight_map`` -> shard file) or plain
``*.safetensors`` files. Tensor names are the model's parameter names.
FP8 (e4m3) weights carry a ``<module>.scale`` tensor (fp32 or e8m0) with one
scale per ``weight_block_size`` block and are dequantized to bf16 on load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from .quant import dequant_fp8_weight

_FP8 = (torch.float8_e4m3fn,)


class CheckpointError(ValueError):
    """A checkpoint does not fit the model; the message names the tensor(s)."""


def _shard_map(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    if path.is_file():
        files = [path]
    elif path.is_dir():
        index = sorted(path.glob("*.safetensors.index.json"))
        if index:
            with open(index[0], encoding="utf-8") as f:
                wm = json.load(f)["weight_map"]
            return {k: path / v for k, v in wm.items()}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {path}")
    else:
        raise CheckpointError(f"checkpoint path {path} does not exist")
    out: dict[str, Path] = {}
    for fp in files:
        with safe_open(os.fspath(fp), framework="pt") as f:
            for k in f.keys():
                out[k] = fp
    return out


def _scale_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "scale"


_FP8_NAMES = {"F8_E4M3"}
_PLAIN_NAMES = {"BF16", "F32", "F16"}


def _check_before_copying(path: object, shards: dict[str, Path], params: dict[str, torch.Tensor]) -> None:
    """Every shard file present, every tensor's dtype and shape right, every FP8 weight's scale there: all read from
    the files' headers, and all problems named at once, before the model is touched."""
    problems: list[str] = []
    absent = sorted({os.fspath(fp) for fp in shards.values() if not fp.is_file()})
    if absent:
        raise CheckpointError(f"checkpoint {path}: its index names shard files that do not exist: {', '.join(absent)}")
    by_file: dict[Path, list[str]] = {}
    for name in sorted(params):
        if name in shards:
            by_file.setdefault(shards[name], []).append(name)
    for fp, names in by_file.items():
        with safe_open(os.fspath(fp), framework="pt") as f:
            for name in names:
                sl = f.get_slice(name)
                dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
                want = tuple(params[name].shape)
                if dtype not in _FP8_NAMES | _PLAIN_NAMES:
                    problems.append(f"{name} has unsupported dtype {dtype}")
                elif dtype in _FP8_NAMES and _scale_name(name) not in shards:
                    problems.append(f"{name} is FP8 but its scale tensor {_scale_name(name)} is missing")
                if shape != want:
                    problems.append(f"{name} has shape {shape} in the checkpoint, the model expects {want}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model (nothing was loaded): "
                              + "; ".join(problems))


@torch.no_grad()
def load_checkpoint(
    model: nn.Module, path: str | os.PathLike[str], strict: bool = True, progress: bool = False
) -> None:
    """Copy a checkpoint into ``model`` in place.

    Raises :class:`CheckpointError` naming every missing, unexpected or
    mis-shaped tensor (``strict=False`` tolerates missing and unexpected names).
    """
    block = tuple(getattr(getattr(model, "config", None), "weight_block_size", (128, 128)))
    shards = _shard_map(Path(path))
    params = dict(model.state_dict(keep_vars=True))
    scale_names = {_scale_name(k) for k in params if k.endswith("weight")}
    missing = sorted(k for k in params if k not in shards)
    unexpected = sorted(k for k in shards if k not in params and k not in scale_names)
    problems = []
    if strict and missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model; " + "; ".join(problems))
    _check_before_copying(path, shards, params)

    handles: dict[Path, object] = {}
    try:
        for name in tqdm(sorted(params), disable=not progress, desc="loading"):
            if name not in shards:
                continue
            fp = shards[name]
            if fp not in handles:
                handles[fp] = safe_open(os.fspath(fp), framework="pt").__enter__()
            t = handles[fp].get_tensor(name)
            dst = params[name]
            if t.dtype in _FP8:  # (dtypes, shapes and the scale's presence were checked before the first copy)
                sname = _scale_name(name)
                sfp = shards[sname]
                if sfp not in handles:
                    handles[sfp] = safe_open(os.fspath(sfp), framework="pt").__enter__()
                try:
                    t = dequant_fp8_weight(t, handles[sfp].get_tensor(sname), block)
                except ValueError as e:
                    raise CheckpointError(f"{sname}: {e}") from None
            dst.copy_(t.to(dst.dtype))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
