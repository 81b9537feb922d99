import json

import pytest
import torch

from dsv41_passes.reference import DeepseekV41Config, DeepseekV41ForCausalLM


def test_tiny_has_both_rope_tables_and_groups():
    c = DeepseekV41Config.tiny()
    assert 2 <= c.num_hidden_layers <= 4 and c.hc_mult == 4 and c.o_groups >= 2
    ratios = c.compress_ratios[: c.num_hidden_layers]
    assert 0 in ratios and any(r > 0 for r in ratios)
    assert c.padded_heads % c.q_head_pad_multiple == 0 and c.padded_heads > c.local_heads


def test_flash_tp4_meta_shapes():
    c = DeepseekV41Config.flash(tp_size=4)
    with torch.device("meta"):
        m = DeepseekV41ForCausalLM(c, max_num_tokens=16, max_num_seqs=1)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    expect = {
        "embed.weight": (129280 // 4, 5120),
        "layers.0.hc_attn_fn": (24, 20480),
        "layers.0.hc_attn_base": (24,),
        "layers.0.hc_attn_scale": (3,),
        "layers.0.hc_ffn_fn": (24, 20480),
        "layers.0.attn_norm.weight": (5120,),
        "layers.0.attn.wq_a.weight": (1280, 5120),
        "layers.0.attn.q_norm.weight": (1280,),
        "layers.0.attn.wq_b.weight": (16 * 512, 1280),
        "layers.0.attn.wkv.weight": (512, 5120),
        "layers.0.attn.kv_norm.weight": (512,),
        "layers.0.attn.wo_a.weight": (2048, 4096),
        "layers.0.attn.wo_b.weight": (5120, 2048),
        "layers.0.attn.attn_sink": (16,),
        "layers.0.ffn.gate.weight": (384, 5120),
        "layers.0.ffn.gate.bias": (384,),
        "layers.0.ffn.experts.95.w1.weight": (2304, 5120),
        "layers.0.ffn.experts.0.w2.weight": (5120, 2304),
        "layers.0.ffn.shared_experts.w1.weight": (2304 // 4, 5120),
        "layers.39.ffn_norm.weight": (5120,),
        "norm.weight": (5120,),
        "head.weight": (129280 // 4, 5120),
    }
    for k, v in expect.items():
        assert shapes[k] == v, (k, shapes[k], v)
    assert "layers.0.ffn.experts.96.w1.weight" not in shapes  # another rank's expert
    assert "layers.40.attn_norm.weight" not in shapes
    assert m.layers[0].attn.q_buffer.shape == (16, 64, 512)  # 16 local heads padded to 64
    assert m.freqs_cis_0.dtype == torch.complex64 and m.freqs_cis_0.shape[-1] == 32
    assert m.layer_table[0] != m.layer_table[2]  # ratio-0 and compressed layers use different tables


def test_full_flash_shapes():
    c = DeepseekV41Config.flash()
    assert c.mix_hc == 24 and c.group_in_dim == 4096 and c.rms_norm_eps == 1e-20
    assert len(c.compress_ratios) == 43


def test_from_json_nested_text_config(tmp_path):
    cfg = {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]},
        "text_config": {
            "model_type": "deepseek_v41_text",
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "compress_ratios": [0, 1],
            "num_attention_heads": 4,
            "head_dim": 64,
            "qk_rope_head_dim": 16,
            "o_groups": 2,
            "rope_scaling": {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1},
            "some_new_key": 7,
        },
        "vision_config": {"hidden_size": 1024},
    }
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    c = DeepseekV41Config.from_json(p)
    assert c.hidden_size == 128 and c.num_hidden_layers == 2 and c.weight_block_size == (32, 32)
    assert c.rope_scaling["type"] == "yarn" and c.extra["some_new_key"] == 7
    assert "vision_config" not in c.extra


@pytest.mark.parametrize(
    "bad", [dict(hc_mult=0), dict(qk_rope_head_dim=15), dict(o_groups=3), dict(tp_size=3), dict(compress_ratios=[0])]
)
def test_bad_config_is_rejected(bad):
    with pytest.raises(ValueError, match="DeepseekV41Config"):
        DeepseekV41Config.tiny(**bad)


def test_to_dict_from_dict_round_trip_through_json():
    """A config read from an HF-style dict (extras, a quantization block size) survives to_dict -> JSON -> from_dict
    (the extras nested one level deeper and the block size came back a list)."""
    C = DeepseekV41Config
    hf = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
          "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]},
          "text_config": {"hidden_size": 5120}}
    for cfg in (C.from_dict(hf), C.tiny(), C.flash(tp_size=4)):
        again = C.from_dict(json.loads(json.dumps(cfg.to_dict())))
        assert again == cfg
    assert sorted(C.from_dict(hf).extra) == ["architectures", "model_type", "quantization_config"]
