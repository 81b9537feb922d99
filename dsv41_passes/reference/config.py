"""DeepSeek-V4.1 text-decoder configuration.

Field names follow the Hugging Face ``config.json`` keys (``text_config`` of
``deepseek_v41``). ``tp_size`` and a few runtime knobs (``q_head_pad_multiple``,
``mhc_shifted_pre``) are ours; they are marked below.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any


def _yarn_default() -> dict[str, Any]:
    return {
        "type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }


@dataclass
class DeepseekV41Config:
    # --- geometry (HF keys) ---
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    # --- manifold-constrained hyper-connections ---
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-20
    # --- positions ---
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = field(default_factory=_yarn_default)
    max_position_embeddings: int = 1048576
    compress_ratios: list[int] = field(
        default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    )
    sliding_window: int = 128
    # --- MoE ---
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    gate_temp: float = 1.0  # V4.1: the gate's logits are divided by it (1.0 in DeepSeek's reference defaults)
    swiglu_limit: float = 10.0
    num_hash_layers: int = 0
    num_nextn_predict_layers: int = 3
    # --- quantization (from quantization_config) ---
    kv_quant_block: int = 32
    weight_block_size: tuple[int, int] = (32, 32)
    # --- ours ---
    tp_size: int = 1  # per-rank shapes: heads, o_groups, experts, vocab are split
    q_head_pad_multiple: int = 64  # Q buffer heads padded to a multiple of this (FlashMLA: 64/128)
    # V4.1 shifted pre; False: each sub-block collapses with its own pre (V4's mHC wiring only: the rest of
    # the model, the final collapse included, stays V4.1's)
    mhc_shifted_pre: bool = True
    initializer_range: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict)  # unknown HF keys, kept verbatim

    # ------------------------------------------------------------------ checks
    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"DeepseekV41Config: {msg}")

        need(self.hc_mult >= 1, f"hc_mult must be >= 1, got {self.hc_mult}")
        need(self.hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters must be >= 1")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim must be even (interleaved pairs)")
        need(0 < self.qk_rope_head_dim <= self.head_dim, "qk_rope_head_dim must be in (0, head_dim]")
        need(self.num_attention_heads % self.o_groups == 0, "num_attention_heads must divide into o_groups")
        need(self.head_dim % self.kv_quant_block == 0, "head_dim must be a multiple of kv_quant_block")
        need(self.tp_size >= 1, "tp_size must be >= 1")
        need(self.num_hidden_layers >= 1, f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        for name in ("num_attention_heads", "o_groups", "n_routed_experts", "vocab_size"):
            need(getattr(self, name) % self.tp_size == 0, f"{name} must be divisible by tp_size={self.tp_size}")
        need(
            len(self.compress_ratios) >= self.num_hidden_layers,
            f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_hidden_layers} layers",
        )
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok > n_routed_experts")
        need(self.gate_temp > 0, f"gate_temp must be > 0, got {self.gate_temp}")
        need(self.scoring_func == "sqrtsoftplus", f"scoring_func {self.scoring_func!r} not supported")

    # ------------------------------------------------------------- per rank
    @property
    def local_heads(self) -> int:
        return self.num_attention_heads // self.tp_size

    @property
    def local_groups(self) -> int:
        return self.o_groups // self.tp_size

    @property
    def padded_heads(self) -> int:
        m = self.q_head_pad_multiple
        return -(-self.local_heads // m) * m

    @property
    def local_experts(self) -> int:
        return self.n_routed_experts // self.tp_size

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def group_in_dim(self) -> int:
        return self.num_attention_heads // self.o_groups * self.head_dim

    # --------------------------------------------------------------- presets
    @classmethod
    def flash(cls, **overrides: Any) -> "DeepseekV41Config":
        """DeepSeek-V4.1-Flash (architecture notes, section 1.2)."""
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> "DeepseekV41Config":
        """CPU-sized model with every layer kind the passes care about.

        Layer 0 is a sliding-window layer (compress ratio 0: theta 1e4, no YaRN),
        layer 1 a compressed layer (ratio 2: compress theta with YaRN), so both
        RoPE tables are used; hc_mult 4, two output groups, four experts.
        """
        base: dict[str, Any] = dict(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            head_dim=64,
            qk_rope_head_dim=16,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=32,
            rope_scaling={
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            max_position_embeddings=4096,
            compress_ratios=[0, 2, 1, 2],
            sliding_window=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            num_nextn_predict_layers=0,
            q_head_pad_multiple=8,
            rms_norm_eps=1e-6,
        )
        base.update(overrides)
        return cls(**base)

    # ------------------------------------------------------------------ json
    @classmethod
    def from_dict(cls, d: dict[str, Any], **overrides: Any) -> "DeepseekV41Config":
        d = dict(d)
        if isinstance(d.get("text_config"), dict):
            top = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
            d = {**top, **d["text_config"]}
        known = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in d.items():
            if k == "extra" and isinstance(v, dict):  # our own to_dict(): its extras stay extras
                extra.update(v)
            elif k in known and k != "extra":
                kw[k] = v
            else:
                extra[k] = v
        if isinstance(kw.get("weight_block_size"), list):  # JSON has no tuples
            kw["weight_block_size"] = tuple(kw["weight_block_size"])
        qc = d.get("quantization_config") or {}
        if "weight_block_size" in qc:
            kw["weight_block_size"] = tuple(qc["weight_block_size"])
        if kw.get("rope_scaling") and "rope_type" in kw["rope_scaling"]:
            rs = dict(kw["rope_scaling"])
            rs.setdefault("type", rs["rope_type"])
            kw["rope_scaling"] = rs
        kw["extra"] = extra
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], **overrides: Any) -> "DeepseekV41Config":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f), **overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "DeepseekV41Config":
        return dataclasses.replace(self, **changes)
