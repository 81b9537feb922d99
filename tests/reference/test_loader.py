import json

import pytest
import torch
from safetensors.torch import save_file

from dsv41_passes.reference import CheckpointError, DeepseekV41Config, DeepseekV41ForCausalLM, load_checkpoint


def quantize_fp8_block(w: torch.Tensor, block=(32, 32)):
    """Test helper: DeepSeek-style FP8 block quantization with power-of-two (e8m0-exact) scales."""
    n, k = w.shape
    bn, bk = block
    wf = w.float().reshape(n // bn, bn, k // bk, bk)
    amax = wf.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    q = (wf / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(n, k)
    return q, scale


def _state(model):
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny():
    return DeepseekV41Config.tiny()


@torch.inference_mode()
def test_round_trip_with_fp8_block_weight(tmp_path, tiny):
    src = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=1)
    sd = _state(src)
    fp8_name = "layers.0.attn.wq_b.weight"
    q, scale = quantize_fp8_block(sd[fp8_name])
    # the model that produced the checkpoint runs with the dequantized weight
    with torch.no_grad():
        deq = (q.float().reshape(8, 32, 1, 32) * scale[:, None, :, None]).reshape(q.shape).to(torch.bfloat16)
        src.get_parameter(fp8_name).copy_(deq)
    sd[fp8_name] = q
    sd[fp8_name[: -len("weight")] + "scale"] = scale
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001.safetensors": names[:half], "model-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, tmp_path / fname)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}})
    )
    dst = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=2)
    load_checkpoint(dst, tmp_path)
    assert dst.get_parameter(fp8_name).dtype == torch.bfloat16
    ids, pos = torch.randint(0, 256, (19,)), torch.arange(19)
    src.reset_cache()
    dst.reset_cache()
    assert torch.equal(src(ids, pos), dst(ids, pos))


def test_single_file_and_errors(tmp_path, tiny):
    src = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=1)
    sd = _state(src)
    path = tmp_path / "model.safetensors"
    save_file(sd, path)
    dst = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=2)
    load_checkpoint(dst, path)
    assert torch.equal(dst.layers[1].hc_ffn_fn, src.layers[1].hc_ffn_fn)

    missing = dict(sd)
    del missing["layers.1.attn.wkv.weight"]
    save_file(missing, tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors: layers\.1\.attn\.wkv\.weight"):
        load_checkpoint(dst, tmp_path / "missing.safetensors")

    extra = dict(sd, **{"layers.0.attn.compressor.wkv.weight": torch.zeros(2, 2)})
    save_file(extra, tmp_path / "extra.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected tensors: layers\.0\.attn\.compressor\.wkv\.weight"):
        load_checkpoint(dst, tmp_path / "extra.safetensors")
    load_checkpoint(dst, tmp_path / "extra.safetensors", strict=False)

    bad = dict(sd, **{"layers.0.hc_attn_fn": torch.zeros(24, 100)})
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.0\.hc_attn_fn has shape \(24, 100\).*expects \(24, 256\)"):
        load_checkpoint(dst, tmp_path / "bad.safetensors")

    noscale = dict(sd, **{"layers.0.attn.wkv.weight": sd["layers.0.attn.wkv.weight"].to(torch.float8_e4m3fn)})
    save_file(noscale, tmp_path / "noscale.safetensors")
    with pytest.raises(
        CheckpointError,
        match=r"layers\.0\.attn\.wkv\.weight is FP8 but its scale tensor layers\.0\.attn\.wkv\.scale is missing",
    ):
        load_checkpoint(dst, tmp_path / "noscale.safetensors")

    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(dst, tmp_path / "nope")


def test_every_problem_named_before_anything_is_loaded(tmp_path, tiny):
    """Two mis-shaped tensors: both are named, and the model is untouched (the first ones used to be copied before
    the error); an index naming a missing shard is a CheckpointError too."""
    src = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=1)
    sd = _state(src)
    sd["norm.weight"] = torch.zeros(3)
    sd["layers.1.attn.wo_b.weight"] = torch.zeros(5, 7, dtype=torch.bfloat16)
    save_file(sd, tmp_path / "two.safetensors")
    dst = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=2)
    before = _state(dst)
    with pytest.raises(CheckpointError, match=r"nothing was loaded.*layers\.1\.attn\.wo_b\.weight.*norm\.weight"):
        load_checkpoint(dst, tmp_path / "two.safetensors")
    assert all(torch.equal(v, before[k]) for k, v in _state(dst).items())

    shard = tmp_path / "sharded"
    shard.mkdir()
    save_file(_state(src), shard / "a.safetensors")
    index = {"weight_map": {k: ("a.safetensors" if i % 2 else "b.safetensors") for i, k in enumerate(sorted(sd))}}
    (shard / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard files that do not exist"):
        load_checkpoint(dst, shard)


def test_scale_problems_and_damaged_files_before_anything_is_loaded(tmp_path, tiny):
    """An FP8 weight's scale of the wrong grid or dtype, an index without a weight_map, a tensor the index puts in a
    file that lacks it, a truncated file and a tensor in two files: each a CheckpointError, the model untouched."""
    src = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=1)
    dst = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=2)
    before = _state(dst)
    fp8 = "layers.1.attn.wq_a.weight"  # late in name order: the tensors before it used to be copied first
    q, scale = quantize_fp8_block(_state(src)[fp8])
    for bad, why in ((scale[:1, :1], r"shape \(1, 1\).*32x32 blocks need"),
                     (scale.to(torch.int32), "dtype I32, a scale must be F32 or F8_E8M0")):
        sd = _state(src)
        sd[fp8], sd[fp8[: -len("weight")] + "scale"] = q, bad
        save_file(sd, tmp_path / "fp8.safetensors")
        with pytest.raises(CheckpointError, match=why):
            load_checkpoint(dst, tmp_path / "fp8.safetensors")
        assert all(torch.equal(v, before[k]) for k, v in _state(dst).items())

    sd = _state(src)
    names = sorted(sd)
    d = tmp_path / "noindex"
    d.mkdir()
    save_file({k: sd[k] for k in names[:3]}, d / "a.safetensors")
    save_file({k: sd[k] for k in names[2:]}, d / "b.safetensors")
    with pytest.raises(CheckpointError, match=f"{names[2]} is in two files"):
        load_checkpoint(dst, d)
    (d / "b.safetensors").write_bytes((d / "b.safetensors").read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(dst, d)

    d = tmp_path / "index"
    d.mkdir()
    save_file({k: sd[k] for k in names[:3]}, d / "a.safetensors")
    save_file({k: sd[k] for k in names[3:]}, d / "b.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="with a weight_map"):
        load_checkpoint(dst, d)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "a.safetensors" for k in names}}))
    with pytest.raises(CheckpointError, match=f"{names[3]}: the index puts it in .*a.safetensors"):
        load_checkpoint(dst, d)
    assert all(torch.equal(v, before[k]) for k, v in _state(dst).items())


def _e2m1(code: torch.Tensor) -> torch.Tensor:
    """The OCP e2m1 value of each 4-bit code, from its bits (sign, 2 exponent, 1 mantissa)."""
    sign = 1 - 2 * (code >> 3).float()
    e, m = ((code >> 1) & 3).float(), (code & 1).float()
    return sign * torch.where(e == 0, m * 0.5, torch.exp2(e - 1) * (1 + m / 2))


def test_mxfp4_expert_weight_and_ignored_prefixes(tmp_path, tiny):
    """A routed expert's weight as V4.1 stores it (int8 [N, K/2], low nibble first, e8m0 scale [N, K/32]) loads
    exactly; tensors the model has no place for are an error unless their prefix is ignored."""
    src = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=1)
    sd = _state(src)
    name = "layers.1.ffn.experts.0.w1.weight"
    n, k = sd[name].shape
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (n, k), generator=g)
    exps = torch.randint(-8, 3, (n, k // 32), generator=g).float()
    want = (_e2m1(codes) * torch.exp2(exps).repeat_interleave(32, 1)).to(torch.bfloat16)
    sd[name] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    sd[name[: -len("weight")] + "scale"] = torch.exp2(exps).to(torch.float8_e8m0fnu)
    sd["mtp.0.emb.weight"] = torch.zeros(2, 2)
    save_file(sd, tmp_path / "fp4.safetensors")
    dst = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=2)
    with pytest.raises(CheckpointError, match=r"unexpected tensors: mtp\.0\.emb\.weight"):
        load_checkpoint(dst, tmp_path / "fp4.safetensors")
    with pytest.raises(TypeError, match="tuple of name prefixes"):
        load_checkpoint(dst, tmp_path / "fp4.safetensors", ignore="mtp.")
    load_checkpoint(dst, tmp_path / "fp4.safetensors", ignore=("mtp.",))
    assert torch.equal(dst.get_parameter(name), want)
    assert torch.equal(dst.get_parameter("embed.weight"), src.get_parameter("embed.weight"))

    sd[name[: -len("weight")] + "scale"] = torch.exp2(exps[:, :1]).to(torch.float8_e8m0fnu)
    save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.scale has shape .*1x32 blocks need"):
        load_checkpoint(dst, tmp_path / "bad.safetensors", ignore=("mtp.",))


@torch.inference_mode()
def test_fp8_weight_into_an_fp32_parameter_keeps_the_fp32_products(tmp_path, tiny):
    """An FP8 weight with fp32 scales that are not powers of two, loaded into an fp32 parameter (the LM head): the
    products land in fp32 (they were rounded to bf16 first, then widened)."""
    src = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=1)
    sd = _state(src)
    name = "head.weight"
    assert sd[name].dtype == torch.float32
    q, scale = quantize_fp8_block(sd[name])
    scale = scale * 1.2345678  # not a power of two: a product needs more than bf16's 8 bits
    sd[name], sd["head.scale"] = q, scale
    save_file(sd, tmp_path / "model.safetensors")
    dst = DeepseekV41ForCausalLM(tiny, max_num_tokens=64, seed=2)
    load_checkpoint(dst, tmp_path / "model.safetensors")
    n, k = q.shape
    want = (q.float().reshape(n // 32, 32, k // 32, 32) * scale[:, None, :, None]).reshape(n, k)
    assert torch.equal(dst.get_parameter(name), want)
