"""Plain-PyTorch DeepSeek-V4.1 text decoder, serving style.

``forward(input_ids [M], positions [M], cu_seqlens [B+1] | None)`` takes several
sequences packed into one token dimension and returns fp32 logits ``[M, vocab]``.
Parameter names equal DeepSeek's reference checkpoint names.

Exact (the three subgraphs the passes rewrite):

* mHC with the V4.1 shifted pre (one-hot initial pre, final collapse with the
  last FFN's pre): see :mod:`.mhc`;
* Q: ``wq_a -> q_norm -> wq_b -> [M, H, D]``, interleaved RoPE on the last
  ``qk_rope_head_dim`` dims in fp32 (complex spelling, the layer's own table),
  written into a Q buffer whose heads are padded to ``q_head_pad_multiple``
  (pad heads stay zero);
* KV: ``wkv -> kv_norm -> RoPE -> FP8-e4m3 round trip with UE8M0 per-32 scales``
  over all head dims, stored into a sliding-window cache by slot index;
* output: inverse RoPE on the tail, ``einsum("mgd,grd->mgr")`` over the
  ``o_groups`` (WO-A), flatten, WO-B.

Simplified (stated here and in the README):

* attention is the sliding window only (``sliding_window`` keys per query, with
  the learned ``attn_sink``); the compressor, the sparse indexer and the
  compressed KV cache are not modelled. Compressed layers still use their own
  (YaRN) RoPE table;
* no Engram memory, no DSpark/MTP drafter, no vision tower, no MoE
  image-token bias (``gate_temp`` is applied);
* the linear layers run in bf16 on dequantized weights: the FP8 GEMMs' per-block
  activation quantization (e.g. ``act_quant(z)`` before WO-B) is not modelled (the
  KV path's FP8 round trip is);
* the MoE runs every expert densely on every token with a zero weight for the
  experts a token did not select (the same result as sparse dispatch, and no
  data-dependent Python control flow, so ``torch.compile(fullgraph=True)`` takes
  the whole forward);
* ``tp_size > 1`` builds one rank's shards (for shapes and kernel sizes); such a
  model does not run, since it has no collectives.

Window cache layout: ``kv_cache [max_num_seqs * W + 1, D]`` bf16 per layer.
Sequence ``b`` of a call uses cache rows ``seq_slots[b] * W + pos % W`` (``seq_slots`` may be longer than the
batch: entries past it are unused, so a fixed ``[max_num_seqs]`` table keeps one compiled graph for every batch,
while a ``[B]`` one gets a graph of its own at B = 1, as every size-1 input does under Dynamo); a token
that is not among the last ``W`` tokens of its sequence in this call is written
to the final scratch row instead (never read). Each sequence's tokens must have
consecutive positions; the cache holds the ``W`` positions before a sequence's
first token in the call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import DeepseekV41Config
from .mhc import hc_collapse, hc_mixes, hc_post
from .quant import fp8_block_qdq
from .rope import apply_rotary_complex, layer_rope_params, rope_table


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics, fp32 weight multiply, one rounding to the input dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False, dtype=torch.bfloat16)


KEY_CHUNK = 128  # head_dim columns of the window keys gathered at a time


class BatchMeta:
    """Per-token bookkeeping of a packed batch, computed once per forward."""

    def __init__(
        self,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        seq_slots: torch.Tensor | None,
        window: int,
        scratch_slot: int,
    ) -> None:
        m = positions.shape[0]
        dev = positions.device
        tok = torch.arange(m, device=dev)
        if cu_seqlens is None:
            seq_id = torch.zeros(m, dtype=torch.long, device=dev)
            start_pos = positions[:1].expand(m)
            last_pos = positions[-1:].expand(m)
        else:
            torch._check(
                cu_seqlens.shape[0] - 1 <= scratch_slot // window,
                lambda: "more sequences in the batch than the model's max_num_seqs",
            )
            seq_id = torch.searchsorted(cu_seqlens, tok, right=True) - 1  # no size-B tensor: B = 1 needs no own graph
            start_pos = positions[cu_seqlens[seq_id]]
            last_pos = positions[cu_seqlens[seq_id + 1] - 1]
        if seq_slots is not None and cu_seqlens is not None:
            torch._check(seq_slots.shape[0] >= cu_seqlens.shape[0] - 1, lambda: "seq_slots is shorter than the batch")
        slot_of_seq = seq_id if seq_slots is None else seq_slots[seq_id]
        base = slot_of_seq * window
        # keys of query i: positions p_i - w for w in [0, W)
        w = torch.arange(window, device=dev)
        key_pos = positions[:, None] - w
        self.key_valid = key_pos >= 0
        self.key_is_new = key_pos >= start_pos[:, None]
        self.key_new_idx = (tok[:, None] - w).clamp_min(0)
        self.key_cache_idx = base[:, None] + key_pos.remainder(window)
        keep = (last_pos - positions) < window
        self.slot_mapping = torch.where(keep, base + positions.remainder(window), scratch_slot)


class Attention(nn.Module):
    def __init__(self, config: DeepseekV41Config, layer_id: int, max_num_tokens: int, max_num_seqs: int) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.n_heads = c.local_heads
        self.head_dim = c.head_dim
        self.rope_dim = c.qk_rope_head_dim
        self.n_groups = c.local_groups
        self.o_rank = c.o_lora_rank
        self.window = c.sliding_window
        self.kv_block = c.kv_quant_block
        self.softmax_scale = c.head_dim**-0.5
        self.wq_a = _linear(c.hidden_size, c.q_lora_rank)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = _linear(c.q_lora_rank, self.n_heads * c.head_dim)
        self.wkv = _linear(c.hidden_size, c.head_dim)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = _linear(c.group_in_dim, self.n_groups * c.o_lora_rank)
        self.wo_b = _linear(self.n_groups * c.o_lora_rank, c.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.register_buffer(
            "q_buffer", torch.zeros(max_num_tokens, c.padded_heads, c.head_dim, dtype=torch.bfloat16), persistent=False
        )
        self.register_buffer(
            "kv_cache", torch.zeros(max_num_seqs * self.window + 1, c.head_dim, dtype=torch.bfloat16), persistent=False
        )

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        m = x.shape[0]
        h, d, rd = self.n_heads, self.head_dim, self.rope_dim
        torch._check(m <= self.q_buffer.shape[0], lambda: "more tokens than the model's max_num_tokens")
        # Q: low-rank projection, RoPE on the tail, store into the head-padded buffer
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(m, h, d)
        q[..., -rd:] = apply_rotary_complex(q[..., -rd:], freqs_cis)
        self.q_buffer[:m, :h] = q
        # KV: norm, RoPE, FP8 round trip, window-cache store
        kv = self.kv_norm(self.wkv(x))
        kv[..., -rd:] = apply_rotary_complex(kv[..., -rd:], freqs_cis)
        kv = fp8_block_qdq(kv, self.kv_block)
        # the window's keys [M, W, D], read before this call's store, in head_dim chunks: no tensor of
        # M * W * D elements (2^31 at M = 32768 for V4.1), which would make Inductor guard its
        # 32-bit indexing on M and recompile for long prefills
        keys = [
            torch.where(
                meta.key_is_new[..., None], kv[:, c : c + KEY_CHUNK][meta.key_new_idx],
                self.kv_cache[:, c : c + KEY_CHUNK][meta.key_cache_idx],
            )
            for c in range(0, d, KEY_CHUNK)
        ]
        self.kv_cache.index_copy_(0, meta.slot_mapping, kv)
        o = self._window_attention(self.q_buffer[:m, :h], keys, meta.key_valid)
        # output: inverse RoPE, grouped low-rank WO-A, WO-B
        o[..., -rd:] = apply_rotary_complex(o[..., -rd:], freqs_cis, inverse=True)
        og = o.view(m, self.n_groups, h * d // self.n_groups)  # (not -1: M may be 0)
        wa = self.wo_a.weight.view(self.n_groups, self.o_rank, -1)
        z = torch.einsum("mgd,grd->mgr", og, wa)
        return self.wo_b(z.flatten(1))

    def _window_attention(self, q: torch.Tensor, keys: list[torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
        """Softmax attention with a per-head sink over the window; ``keys`` are head_dim chunks (K = V)."""
        kf = [k.float() for k in keys]
        qf = q.float().split(KEY_CHUNK, dim=-1)
        s = sum(torch.einsum("mhd,mwd->mhw", qc, kc) for qc, kc in zip(qf, kf)) * self.softmax_scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        sink = self.attn_sink.view(1, -1, 1)
        mx = torch.maximum(s.amax(-1, keepdim=True), sink)
        p = torch.exp(s - mx)
        p = p / (p.sum(-1, keepdim=True) + torch.exp(sink - mx))
        return torch.cat([torch.einsum("mhw,mwd->mhd", p, kc) for kc in kf], dim=-1).to(q.dtype)


class Gate(nn.Module):
    """sqrt(softplus) scores of the logits / ``gate_temp``, top-k on score + bias (noaux_tc), normalised (top-k > 1),
    routed scaling."""

    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        self.topk = config.num_experts_per_tok
        self.route_scale = config.routed_scaling_factor
        self.norm_topk = config.norm_topk_prob
        self.temp = config.gate_temp
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.bfloat16))
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        if self.temp != 1.0:  # (the graph at the default temperature is the one without it)
            logits = logits / self.temp
        scores = F.softplus(logits).sqrt()
        idx = (scores + self.bias).topk(self.topk, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm_topk and self.topk > 1:  # DeepSeek's reference: a single expert keeps its raw score
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.route_scale, idx


class Expert(nn.Module):
    """SwiGLU with DeepSeek's ``swiglu_limit`` clamp (fp32 activation)."""

    def __init__(self, dim: int, inter: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = _linear(dim, inter)
        self.w2 = _linear(inter, dim)
        self.w3 = _linear(dim, inter)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.w1(x).float()
        up = self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        y = F.silu(gate) * up
        if weight is not None:
            y = y * weight
        return self.w2(y.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, config: DeepseekV41Config) -> None:
        super().__init__()
        c = config
        self.n_experts = c.n_routed_experts
        self.gate = Gate(c)
        # this rank's experts keep their global index in the parameter names
        self.experts = nn.ModuleList(
            [
                Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit) if e < c.local_experts else None
                for e in range(c.n_routed_experts)
            ]
        )
        shared_inter = c.moe_intermediate_size * c.n_shared_experts // c.tp_size
        self.shared_experts = Expert(c.hidden_size, shared_inter, c.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        dense = torch.zeros(x.shape[0], self.n_experts, dtype=torch.float32, device=x.device)
        dense = dense.scatter(1, idx, weights)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            if expert is not None:
                y = y + expert(x, dense[:, e : e + 1]).float()
        y = y + self.shared_experts(x).float()
        return y.to(x.dtype)


class Block(nn.Module):
    def __init__(self, config: DeepseekV41Config, layer_id: int, max_num_tokens: int, max_num_seqs: int) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.shifted = c.mhc_shifted_pre
        self.hc_iters, self.hc_eps, self.norm_eps = c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps
        k = c.hc_mult * c.hidden_size
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(c.mix_hc, k, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.empty(c.mix_hc, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c, layer_id, max_num_tokens, max_num_seqs)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn = MoE(c)

    def _mixes(self, h: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc_mixes(
            h,
            getattr(self, f"hc_{site}_fn"),
            getattr(self, f"hc_{site}_scale"),
            getattr(self, f"hc_{site}_base"),
            self.hc_iters,
            self.hc_eps,
            self.norm_eps,
        )

    def forward(
        self, h: torch.Tensor, pre: torch.Tensor, freqs_cis: torch.Tensor, meta: BatchMeta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        res = h
        a_pre, a_post, a_comb = self._mixes(h, "attn")
        x = hc_collapse(h, pre if self.shifted else a_pre)
        x = self.attn(self.attn_norm(x), freqs_cis, meta)
        h = hc_post(x, res, a_post, a_comb)
        res = h
        f_pre, f_post, f_comb = self._mixes(h, "ffn")
        x = hc_collapse(h, a_pre if self.shifted else f_pre)
        x = self.ffn(self.ffn_norm(x))
        h = hc_post(x, res, f_post, f_comb)
        return h, f_pre


class DeepseekV41ForCausalLM(nn.Module):
    """DeepSeek-V4.1 text decoder. See the module docstring for what is exact and what is simplified."""

    def __init__(
        self,
        config: DeepseekV41Config,
        max_num_tokens: int = 4096,
        max_num_seqs: int = 8,
        seed: int | None = 0,
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        self.max_num_seqs = max_num_seqs
        self.embed = nn.Embedding(c.vocab_size // c.tp_size, c.hidden_size, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(
            [Block(c, i, max_num_tokens, max_num_seqs) for i in range(c.num_hidden_layers)]
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size // c.tp_size, bias=False, dtype=torch.float32)
        # one RoPE table per distinct (base, scaling); layers index into them
        tables: dict[tuple, int] = {}
        self.layer_table: list[int] = []
        for i in range(c.num_hidden_layers):
            base, scaling = layer_rope_params(c, i)
            key = (base, tuple(sorted((scaling or {}).items())))
            if key not in tables:
                tables[key] = len(tables)
                self.register_buffer(
                    f"freqs_cis_{tables[key]}",
                    rope_table(c.qk_rope_head_dim, c.max_position_embeddings, base, scaling),
                    persistent=False,
                )
            self.layer_table.append(tables[key])
        if seed is not None and not self.embed.weight.is_meta:
            self.init_weights(seed)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Random weights with the scales a trained model roughly has (for tests and demos)."""
        g = torch.Generator().manual_seed(seed)

        def fill(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
            p.copy_((torch.randn(p.shape, generator=g) * std + mean).to(p.dtype))

        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name == "embed.weight":
                fill(p, 1.0)
            elif leaf.endswith("_fn"):
                fill(p, 0.5 / math.sqrt(p.shape[1]))
            elif leaf.endswith("_base"):
                fill(p, 0.5)
            elif leaf.endswith("_scale"):
                fill(p, 0.3, 1.0)
            elif name.endswith("norm.weight"):
                fill(p, 0.1, 1.0)
            elif leaf == "attn_sink":
                fill(p, 0.5)
            elif name.endswith("gate.bias"):
                fill(p, 0.1)
            else:  # linear weights
                fill(p, 1.0 / math.sqrt(p.shape[1]))
        self.reset_cache()

    @torch.no_grad()
    def reset_cache(self) -> None:
        for layer in self.layers:
            layer.attn.kv_cache.zero_()
            layer.attn.q_buffer.zero_()

    # --------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        seq_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        c = self.config
        if c.tp_size != 1:
            raise NotImplementedError("a tp_size > 1 model holds one rank's shards and cannot run alone")
        m = input_ids.shape[0]
        meta = BatchMeta(positions, cu_seqlens, seq_slots, c.sliding_window, self.max_num_seqs * c.sliding_window)
        freqs = [getattr(self, f"freqs_cis_{t}")[positions] for t in range(len(set(self.layer_table)))]
        h = self.embed(input_ids).unsqueeze(1).repeat(1, c.hc_mult, 1)
        pre = torch.zeros(m, c.hc_mult, dtype=torch.float32, device=h.device)
        pre[:, 0] = 1.0
        for layer, t in zip(self.layers, self.layer_table):
            h, pre = layer(h, pre, freqs[t], meta)
        y = hc_collapse(h, pre)
        return F.linear(self.norm(y).float(), self.head.weight)
