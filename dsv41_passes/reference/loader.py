"""Load DeepSeek-style safetensors checkpoints into :class:`DeepseekV41ForCausalLM`.

Accepts one ``.safetensors`` file, or a directory holding either a
``*.safetensors.index.json`` (``weight_map`` -> shard file) or plain
``*.safetensors`` files. Tensor names are the model's parameter names.
FP8 (e4m3) weights carry a ``<module>.scale`` tensor (fp32 or e8m0) with one
scale per ``weight_block_size`` block; MXFP4 weights (int8 ``[N, K/2]``, two e2m1
codes a byte, V4.1's routed experts) carry one with a scale per row and 32 columns.
Both are dequantized on load: fp32 products, rounded once to the parameter's dtype.
``ignore`` names prefixes of checkpoint tensors the model has no place for (V4.1's
compressor, indexer, Engram, MTP layers...): skipped, while a missing model tensor
stays an error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from .quant import MXFP4_BLOCK, dequant_fp8_weight, dequant_mxfp4_weight

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
            try:
                with open(index[0], encoding="utf-8") as f:
                    wm = json.load(f)["weight_map"]
                return {k: path / v for k, v in wm.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index[0]}: not a safetensors index with a weight_map ({type(e).__name__}: "
                                      f"{e})") from None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {path}")
    else:
        raise CheckpointError(f"checkpoint path {path} does not exist")
    out: dict[str, Path] = {}
    for fp in files:
        with _open(fp) as f:
            for k in f.keys():
                if k in out:
                    raise CheckpointError(f"tensor {k} is in two files, {out[k]} and {fp}")
                out[k] = fp
    return out


def _open(fp: Path):
    """``safe_open``, its errors (a truncated or damaged file) as :class:`CheckpointError`."""
    try:
        return safe_open(os.fspath(fp), framework="pt")
    except Exception as e:  # safetensors raises its own SafetensorError (not exported on every version)
        raise CheckpointError(f"{fp}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _scale_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "scale"


_FP8_NAMES = {"F8_E4M3"}
_FP4_NAMES = {"I8", "U8"}  # MXFP4: e2m1 pairs packed in bytes
_PLAIN_NAMES = {"BF16", "F32", "F16"}
_SCALE_NAMES = {"F32", "F8_E8M0"}


def _header(fp: Path, names: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a file's header; a name the file lacks is a :class:`CheckpointError`."""
    out = {}
    with _open(fp) as f:
        keys = set(f.keys())
        for name in names:
            if name not in keys:
                raise CheckpointError(f"{name}: the index puts it in {fp}, which does not hold it")
            sl = f.get_slice(name)
            out[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def _check_before_copying(path: object, shards: dict[str, Path], params: dict[str, torch.Tensor],
                          block: tuple[int, int]) -> None:
    """Every shard file present, every tensor's dtype and shape right, every FP8 weight's scale there with its
    dtype and block grid: all read from the files' headers, and all problems named at once, before the model is
    touched."""
    problems: list[str] = []
    absent = sorted({os.fspath(fp) for fp in shards.values() if not fp.is_file()})
    if absent:
        raise CheckpointError(f"checkpoint {path}: its index names shard files that do not exist: {', '.join(absent)}")
    loaded = [n for n in sorted(params) if n in shards]
    by_file: dict[Path, list[str]] = {}
    for name in loaded + [sc for sc in map(_scale_name, loaded) if sc in shards]:  # the weights, then their scales
        by_file.setdefault(shards[name], []).append(name)
    heads: dict[str, tuple[str, tuple[int, ...]]] = {}
    for fp, names in by_file.items():
        heads |= _header(fp, names)
    bn, bk = block
    for name in loaded:
        dtype, shape = heads[name]
        want = tuple(params[name].shape)
        fp4 = dtype in _FP4_NAMES
        if dtype not in _FP8_NAMES | _FP4_NAMES | _PLAIN_NAMES:
            problems.append(f"{name} has unsupported dtype {dtype}")
        elif fp4 and (len(want) != 2 or want[1] % MXFP4_BLOCK):
            problems.append(f"{name} is {dtype} (MXFP4) but the model's {want} is not [N, K] with K a multiple of "
                            f"{MXFP4_BLOCK}")
        elif dtype not in _PLAIN_NAMES:
            sname, kind = _scale_name(name), "MXFP4" if fp4 else "FP8"
            if sname not in shards:
                problems.append(f"{name} is {kind} but its scale tensor {sname} is missing")
            elif len(want) == 2:
                sdt, sshape = heads[sname]
                grid = (want[0], want[1] // MXFP4_BLOCK) if fp4 else (-(-want[0] // bn), -(-want[1] // bk))
                if sdt not in _SCALE_NAMES:
                    problems.append(f"{sname} has dtype {sdt}, a scale must be F32 or F8_E8M0")
                if sshape != grid:
                    blocks = f"1x{MXFP4_BLOCK}" if fp4 else f"{bn}x{bk}"
                    problems.append(f"{sname} has shape {sshape}, {name}'s {blocks} blocks need {grid}")
        packed = (want[0], want[1] // 2) if fp4 and len(want) == 2 else want
        if shape != packed:
            problems.append(f"{name} has shape {shape} in the checkpoint, the model expects {packed}"
                            + (f" (MXFP4 of {want})" if fp4 else ""))
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model (nothing was loaded): "
                              + "; ".join(problems))


@torch.no_grad()
def load_checkpoint(
    model: nn.Module, path: str | os.PathLike[str], strict: bool = True, progress: bool = False,
    ignore: tuple[str, ...] = (),
) -> None:
    """Copy a checkpoint into ``model`` in place.

    Raises :class:`CheckpointError` naming every missing, unexpected or
    mis-shaped tensor (``strict=False`` tolerates missing and unexpected names;
    ``ignore``: prefixes of checkpoint tensors to skip, missing ones still count).
    """
    block = tuple(getattr(getattr(model, "config", None), "weight_block_size", (128, 128)))
    if isinstance(ignore, str):
        raise TypeError("ignore takes a tuple of name prefixes, not one string")
    shards = {k: v for k, v in _shard_map(Path(path)).items() if not k.startswith(tuple(ignore))}
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
    _check_before_copying(path, shards, params, block)

    handles: dict[Path, object] = {}
    try:
        for name in tqdm(sorted(params), disable=not progress, desc="loading"):
            if name not in shards:
                continue
            fp = shards[name]
            if fp not in handles:
                handles[fp] = _open(fp).__enter__()
            t = handles[fp].get_tensor(name)
            dst = params[name]
            if t.dtype in (*_FP8, torch.int8, torch.uint8):  # (dtypes, shapes and scales were checked before)
                sname = _scale_name(name)
                sfp = shards[sname]
                if sfp not in handles:
                    handles[sfp] = _open(sfp).__enter__()
                sc = handles[sfp].get_tensor(sname)
                try:
                    # rounded once, to the parameter's dtype (an fp32 one keeps a non-power-of-two scale's bits)
                    t = (dequant_fp8_weight(t, sc, block, dst.dtype) if t.dtype in _FP8
                         else dequant_mxfp4_weight(t, sc, dst.dtype))
                except ValueError as e:
                    raise CheckpointError(f"{sname}: {e}") from None
            dst.copy_(t.to(dst.dtype))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
