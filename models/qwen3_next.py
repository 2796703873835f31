"""Qwen3-Next / Qwen3.5 hybrid model: Gated DeltaNet layers + gated full attention, dense MLP or MoE, NEXTN head.

One file for both families. Weights use one layout inside the engine whatever the checkpoint family:
GDN input projections are stored split and contiguous ([q | k | v | z] and [b | a]); Qwen3-Next's interleaved
per-key-head-group rows are reordered once at load time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.kernels.activation import silu_and_mul
from tinyserve.kernels.attention import paged_attention_decode, paged_attention_prefill, store_kv
from tinyserve.kernels.rotary import apply_rotary
from tinyserve.kernels.conv import causal_conv1d_decode, causal_conv1d_prefill, causal_conv1d_verify
from tinyserve.kernels.fp8_weight import Fp8Weight
from tinyserve.kernels.gdn import (chunk_gated_delta_rule, recurrent_gated_delta_rule_decode,
                                   recurrent_gated_delta_rule_verify)
from tinyserve.kernels.linear import linear
from tinyserve.kernels.moe import fused_experts, route
from tinyserve.kernels.norm import gated_rms_norm, l2_norm, rms_norm
from tinyserve.kernels.pool_layer import PoolLayer
from tinyserve.kernels.verify_layout import VerifyLayout
from tinyserve.models.config import ModelConfig  # noqa: F401 - re-exported
from tinyserve.models.qwen_vision import VisionConfig, VisionTower, mrope_cos_sin
from tinyserve.models.weights import WeightLoaders, empty_param


@dataclass
class ForwardBatch:
    """One step's packed tokens: no padding; sequence i owns tokens cu_seqlens[i]:cu_seqlens[i+1].

    The first `num_decode` sequences contribute exactly one token each (decode); the next `num_verify` are
    speculative verifies (the last accepted token plus the drafts), whose GDN layers run the decode recurrence token
    by token and keep the state after each token (`verify`, a kernels.verify_layout.VerifyLayout, token rows counted
    from the first verify token); the rest are prefill chunks. For attention each verify token is a decode row whose
    context ends at its own position (split-K over a long context, where a prefill tile would be one program per KV
    head).
    Tensors are laid out for the GPU path too (int32 page table, int64 slot mapping, int32 state slots).
    """

    input_ids: torch.Tensor          # [T] int64
    positions: torch.Tensor          # [T] int64 absolute position of each token
    cu_seqlens: list[int]            # [N+1] query offsets
    seq_lens: list[int]              # [N] context length after this step (cached + new)
    seq_lens_t: torch.Tensor         # [N] int32, same values on the device
    page_table: torch.Tensor         # [N, max_pages] int32 (unused entries 0)
    slot_mapping: torch.Tensor       # [T] int64 flat KV slot (page * page_size + offset) of each new token
    state_slots: list[int]           # [N] GDN state slot of each sequence
    state_slots_t: torch.Tensor      # [N] int64, same values on the device
    num_decode: int                  # leading sequences with one token each
    num_verify: int = 0              # speculative verifies after them
    verify: VerifyLayout | None = None
    # Images (Qwen3.5): rotary positions as (t, h, w) rows [3, T] when a sequence in the batch has images (None:
    # `positions` for all three), and the packed rows that take vision features instead of the pad's embedding
    # (for the NEXTN head: the rows whose next token, the one it embeds, is an image token).
    mrope_positions: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None       # [n] int64
    image_embeds: torch.Tensor | None = None     # [n, H]
    # Decode attention's bound on the decode and verify rows' lengths (None: their max). A static batch (static.py,
    # CUDA graphs) fixes it to the context length, so nothing in its forward changes from step to step.
    decode_max_len: int | None = None
    # GDN state snapshots inside the prefill chunks: (prefill sequence i, counted from the first prefill, offset o
    # from its chunk's start, state slot): the conv and SSM state after its first o tokens are also written there.
    prefill_snapshots: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def prefill_start(self) -> int:
        """The first token row of the prefill chunks (after the decode and verify tokens)."""
        return self.cu_seqlens[self.num_decode + self.num_verify]

    @property
    def has_prefill(self) -> bool:
        return self.num_seqs > self.num_decode + self.num_verify


class Rotary:
    """The tables of the partial NeoX rotary embedding on the first rotary_dim dims of each head (applied by
    kernels.rotary.apply_rotary)."""

    def __init__(self, rotary_dim: int, theta: float, device) -> None:
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device)
                                         / rotary_dim))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)           # [T, 1, rd]


def norm_scale(shape, device) -> nn.Parameter:
    """A zero-centred RMSNorm's weight w (every norm but the GDN output norm multiplies by 1 + w), held as that
    scale, 1 + w in fp32: computed once at load (WeightLoaders.add_norm), not on every step."""
    return empty_param(shape, torch.float32, device)


def scaled_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm by a norm_scale (1 + w already added)."""
    return rms_norm(x, scale, eps, zero_centred=False)


def _linear_weight(shape, dtype, device) -> nn.Parameter:
    """A weight that only kernels.linear reads ([N, K]), or a MoE layer's stacked experts that only the fused MoE
    reads ([E, N, K]): it may be kept as FP8 instead (Fp8Weights)."""
    p = empty_param(shape, dtype, device)
    p.is_linear_weight = True
    return p


@dataclass(frozen=True)
class Fp8Weights:
    """Which linear weights the model holds as FP8 (parameter name -> scale block) and how they multiply."""

    blocks: dict[str, tuple[int, int]]
    act_quant: bool                  # w8a8 (activations quantized per 128-group) or w8a16 (see kernels/fp8.py)


class GatedDeltaNet(nn.Module):
    """Linear-attention mixer. Weights in the engine layout: in_proj_qkvz rows [q | k | v | z], in_proj_ba [b | a]."""

    def __init__(self, cfg: ModelConfig, dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        H, nk, nv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.nk, self.nv, self.dk, self.dv = nk, nv, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kd, self.vd = cfg.key_dim, cfg.value_dim
        K = cfg.linear_conv_kernel_dim
        self.in_proj_qkvz = _linear_weight((2 * self.kd + 2 * self.vd, H), dtype, device)
        self.in_proj_ba = _linear_weight((2 * nv, H), dtype, device)
        self.conv_weight = empty_param((cfg.conv_dim, K), dtype, device)
        self.A_log = empty_param((nv,), torch.float32, device)
        self.dt_bias = empty_param((nv,), torch.float32, device)
        self.norm_weight = empty_param((self.dv,), dtype, device)
        self.out_proj = _linear_weight((H, self.vd), dtype, device)

    def weight_loaders(self) -> WeightLoaders:
        cfg, w = self.cfg, WeightLoaders()
        H, kd, vd, nk, nv, dk, dv = cfg.hidden_size, self.kd, self.vd, self.nk, self.nv, self.dk, self.dv
        r = nv // nk
        if cfg.interleaved_gdn_proj:
            # Qwen3-Next: rows grouped per key head g: [q_g | k_g | v_{g*r..} | z_{g*r..}] -> reorder to [q|k|v|z]
            def qkvz(t: torch.Tensor) -> torch.Tensor:
                t = t.reshape(nk, 2 * dk + 2 * r * dv, H)
                q, k, v, z = t.split([dk, dk, r * dv, r * dv], dim=1)
                return torch.cat([x.reshape(-1, H) for x in (q, k, v, z)])

            def ba(t: torch.Tensor) -> torch.Tensor:
                b, a = t.reshape(nk, 2 * r, H).split([r, r], dim=1)
                return torch.cat([b.reshape(nv, H), a.reshape(nv, H)])
            w.add("in_proj_qkvz.weight", (2 * kd + 2 * vd, H), self.in_proj_qkvz, qkvz)
            w.add("in_proj_ba.weight", (2 * nv, H), self.in_proj_ba, ba)
        else:
            w.add_rows("in_proj_qkv.weight", (2 * kd + vd, H), self.in_proj_qkvz, 0)
            w.add_rows("in_proj_z.weight", (vd, H), self.in_proj_qkvz, 2 * kd + vd)
            w.add_rows("in_proj_b.weight", (nv, H), self.in_proj_ba, 0)
            w.add_rows("in_proj_a.weight", (nv, H), self.in_proj_ba, nv)
        w.add("conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), self.conv_weight)
        w.add("A_log", (nv,), self.A_log)
        w.add("dt_bias", (nv,), self.dt_bias)
        w.add("norm.weight", (dv,), self.norm_weight)
        w.add("out_proj.weight", (H, vd), self.out_proj)
        return w

    def forward(self, x: torch.Tensor, batch: ForwardBatch, conv_state: PoolLayer,
                ssm_state: PoolLayer) -> torch.Tensor:
        T = x.shape[0]
        kd, vd = self.kd, self.vd
        qkvz = linear(x, self.in_proj_qkvz)
        mixed, z = qkvz.split([2 * kd + vd, vd], dim=-1)
        b, a = linear(x, self.in_proj_ba).float().split([self.nv, self.nv], dim=-1)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())

        nd, nv = batch.num_decode, batch.num_verify      # decode tokens are the first nd tokens, then verifies
        parts = []
        if nd:
            u = causal_conv1d_decode(mixed[:nd], self.conv_weight, conv_state, batch.state_slots_t[:nd])
            q, k, v = self._split_heads(u)
            parts.append(recurrent_gated_delta_rule_decode(q, k, v, g[:nd], beta[:nd], ssm_state,
                                                           batch.state_slots_t[:nd]))
        vs, ve = nd, batch.prefill_start                 # the verify tokens
        if nv:
            u = causal_conv1d_verify(mixed[vs:ve], self.conv_weight, conv_state, batch.verify)
            q, k, v = self._split_heads(u)
            parts.append(recurrent_gated_delta_rule_verify(q, k, v, g[vs:ve], beta[vs:ve], ssm_state,
                                                           batch.verify))
        if batch.has_prefill:
            cu = [c - ve for c in batch.cu_seqlens[nd + nv:]]
            slots = batch.state_slots[nd + nv:]
            snaps = batch.prefill_snapshots
            u = causal_conv1d_prefill(mixed[ve:], self.conv_weight, conv_state, cu, slots, snaps)
            q, k, v = self._split_heads(u)
            parts.append(chunk_gated_delta_rule(q, k, v, g[ve:], beta[ve:], ssm_state, cu, slots, snapshots=snaps))
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        y = gated_rms_norm(o, z.reshape(T, self.nv, self.dv), self.norm_weight, self.cfg.rms_norm_eps)
        return linear(y.reshape(T, vd), self.out_proj)

    def _split_heads(self, u: torch.Tensor):
        T = u.shape[0]
        q, k, v = u.split([self.kd, self.kd, self.vd], dim=-1)
        q = l2_norm(q.reshape(T, self.nk, self.dk), self.dk ** -0.5)
        k = l2_norm(k.reshape(T, self.nk, self.dk))
        return q, k, v.reshape(T, self.nv, self.dv)


class GatedAttention(nn.Module):
    """Full attention with q/k zero-centred norms, partial RoPE and a sigmoid output gate; KV in the paged pool.

    qkv_proj rows: [q_proj rows (per head: query hd | gate hd) | k_proj rows | v_proj rows].
    """

    def __init__(self, cfg: ModelConfig, dtype, device) -> None:
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_rows, self.kv_rows = self.nh * 2 * self.hd, self.nkv * self.hd
        self.qkv_proj = _linear_weight((self.q_rows + 2 * self.kv_rows, cfg.hidden_size), dtype, device)
        self.o_proj = _linear_weight((cfg.hidden_size, self.nh * self.hd), dtype, device)
        self.q_norm = norm_scale((self.hd,), device)
        self.k_norm = norm_scale((self.hd,), device)

    def weight_loaders(self) -> WeightLoaders:
        w, H = WeightLoaders(), self.cfg.hidden_size
        w.add_rows("q_proj.weight", (self.q_rows, H), self.qkv_proj, 0)
        w.add_rows("k_proj.weight", (self.kv_rows, H), self.qkv_proj, self.q_rows)
        w.add_rows("v_proj.weight", (self.kv_rows, H), self.qkv_proj, self.q_rows + self.kv_rows)
        w.add("o_proj.weight", (H, self.nh * self.hd), self.o_proj)
        w.add_norm("q_norm.weight", (self.hd,), self.q_norm, self.dtype)
        w.add_norm("k_norm.weight", (self.hd,), self.k_norm, self.dtype)
        return w

    def write_kv(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: PoolLayer,
                 cos_sin: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Project x, store its K and V in the pool; returns (q, gate) for the attention."""
        qg, k, v = linear(x, self.qkv_proj).split([self.q_rows, self.kv_rows, self.kv_rows], dim=-1)
        self._store_kv(k, v, batch, kv_cache, cos_sin)
        return qg.view(x.shape[0], self.nh, 2 * self.hd).split([self.hd, self.hd], dim=-1)

    def write_kv_only(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: PoolLayer,
                      cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """write_kv without the queries: only the K and V rows of qkv_proj are read, not the query and gate rows."""
        w = self.qkv_proj
        if isinstance(w, torch.Tensor):       # an Fp8Weight is not sliced: it multiplies whole
            k, v = linear(x, w[self.q_rows:]).split([self.kv_rows, self.kv_rows], dim=-1)
        else:
            k, v = linear(x, w)[:, self.q_rows:].split([self.kv_rows, self.kv_rows], dim=-1)
        self._store_kv(k, v, batch, kv_cache, cos_sin)

    def _store_kv(self, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, kv_cache: PoolLayer,
                  cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        T = k.shape[0]
        k = apply_rotary(scaled_rms_norm(k.view(T, self.nkv, self.hd), self.k_norm, self.cfg.rms_norm_eps), *cos_sin)
        store_kv(k, v.view(T, self.nkv, self.hd), kv_cache, batch.slot_mapping)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: PoolLayer,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T, eps = x.shape[0], self.cfg.rms_norm_eps
        q, gate = self.write_kv(x, batch, kv_cache, cos_sin)
        q = apply_rotary(scaled_rms_norm(q, self.q_norm, eps), *cos_sin)
        scale = self.hd ** -0.5
        nd, nv, parts = batch.num_decode, batch.num_verify, []
        if nd:
            parts.append(paged_attention_decode(q[:nd], kv_cache, batch.page_table[:nd], batch.seq_lens_t[:nd],
                                                batch.decode_max_len or max(batch.seq_lens[:nd]), scale))
        ve = batch.prefill_start
        if nv:      # each verify token is a decode row of its own length: split-K over a long context, as decode
            lay = batch.verify
            parts.append(paged_attention_decode(q[nd:ve], kv_cache, batch.page_table[nd:nd + nv], lay.token_lens,
                                                batch.decode_max_len or max(batch.seq_lens[nd:nd + nv]), scale,
                                                table_rows=lay.token_seq))
        if batch.has_prefill:
            cu = [c - ve for c in batch.cu_seqlens[nd + nv:]]
            parts.append(paged_attention_prefill(q[ve:], kv_cache, batch.page_table[nd + nv:], cu,
                                                 batch.seq_lens[nd + nv:], scale))
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        o = o.reshape(T, self.nh * self.hd) * torch.sigmoid(gate.reshape(T, self.nh * self.hd))
        return linear(o, self.o_proj)


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, dtype, device) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up = _linear_weight((2 * inter, hidden), dtype, device)
        self.down = _linear_weight((hidden, inter), dtype, device)

    def weight_loaders(self) -> WeightLoaders:
        w, H, I = WeightLoaders(), self.down.shape[0], self.inter
        w.add_rows("gate_proj.weight", (I, H), self.gate_up, 0)
        w.add_rows("up_proj.weight", (I, H), self.gate_up, I)
        w.add("down_proj.weight", (H, I), self.down)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(silu_and_mul(linear(x, self.gate_up)), self.down)


class SparseMoE(nn.Module):
    """Softmax router -> top-k (renormalised) routed experts + a sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, dtype, device) -> None:
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg, self.E, self.I = cfg, E, I
        self.router = _linear_weight((E, H), dtype, device)
        self.experts_gate_up = _linear_weight((E, 2 * I, H), dtype, device)     # per expert: gate rows, up rows
        self.experts_down = _linear_weight((E, H, I), dtype, device)
        self.shared_expert = DenseMLP(H, cfg.shared_expert_intermediate_size, dtype, device)
        self.shared_expert_gate = _linear_weight((1, H), dtype, device)

    def weight_loaders(self) -> WeightLoaders:
        w, E, H, I = WeightLoaders(), self.E, self.cfg.hidden_size, self.I
        w.add("gate.weight", (E, H), self.router)
        for e in range(E):
            w.add_rows(f"experts.{e}.gate_proj.weight", (I, H), self.experts_gate_up, 0, expert=e)
            w.add_rows(f"experts.{e}.up_proj.weight", (I, H), self.experts_gate_up, I, expert=e)
            w.add_rows(f"experts.{e}.down_proj.weight", (H, I), self.experts_down, 0, expert=e)
        w.merge("shared_expert.", self.shared_expert.weight_loaders())
        w.add("shared_expert_gate.weight", (1, H), self.shared_expert_gate)
        return w

    def fused_expert_loaders(self) -> WeightLoaders:
        """Checkpoints that ship the experts already stacked (transformers 5.x / some Qwen3.5-MoE releases)."""
        w = WeightLoaders()
        w.add("experts.gate_up_proj", tuple(self.experts_gate_up.shape), self.experts_gate_up)
        w.add("experts.down_proj", tuple(self.experts_down.shape), self.experts_down)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(linear(x, self.router), self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
        out = fused_experts(x, self.experts_gate_up, self.experts_down, weights, experts)        # fp32
        shared = self.shared_expert(x) * torch.sigmoid(linear(x, self.shared_expert_gate))
        return (out + shared.float()).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kind: str, moe: bool, dtype, device) -> None:
        super().__init__()
        self.kind, self.dtype = kind, dtype
        H = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = norm_scale((H,), device)
        self.post_attention_layernorm = norm_scale((H,), device)
        self.mixer = (GatedDeltaNet(cfg, dtype, device) if kind == "linear_attention"
                      else GatedAttention(cfg, dtype, device))
        self.mlp = SparseMoE(cfg, dtype, device) if moe else DenseMLP(H, cfg.intermediate_size, dtype, device)

    def weight_loaders(self) -> WeightLoaders:
        w, H = WeightLoaders(), self.input_layernorm.shape[0]
        w.add_norm("input_layernorm.weight", (H,), self.input_layernorm, self.dtype)
        w.add_norm("post_attention_layernorm.weight", (H,), self.post_attention_layernorm, self.dtype)
        w.merge("linear_attn." if self.kind == "linear_attention" else "self_attn.", self.mixer.weight_loaders())
        w.merge("mlp.", self.mlp.weight_loaders())
        return w

    def forward(self, x: torch.Tensor, mix: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        h = x + mix(scaled_rms_norm(x, self.input_layernorm, self.eps))
        return h + self.mlp(scaled_rms_norm(h, self.post_attention_layernorm, self.eps))


class NextNHead(nn.Module):
    """NEXTN (MTP) draft head: hidden state at p + embedding of token p+1 -> draft logits for token p+2.

    u = fc([norm_e(embed(x_{p+1})) | norm_h(h_p)]); u = full-attention decoder layer(u) (own KV cache);
    logits = lm_head(norm(u)). Shares embed_tokens and lm_head with the main model.
    """

    def __init__(self, cfg: ModelConfig, dtype, device) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.eps, self.dtype = cfg.rms_norm_eps, dtype
        self.fc = _linear_weight((H, 2 * H), dtype, device)
        self.pre_fc_norm_embedding = norm_scale((H,), device)
        self.pre_fc_norm_hidden = norm_scale((H,), device)
        self.layers = nn.ModuleList([DecoderLayer(cfg, 0, "full_attention", cfg.num_experts > 0, dtype, device)
                                     for _ in range(cfg.num_mtp_layers)])
        self.norm = norm_scale((H,), device)

    def weight_loaders(self) -> WeightLoaders:
        w, H = WeightLoaders(), self.norm.shape[0]
        w.add("fc.weight", (H, 2 * H), self.fc)
        w.add_norm("pre_fc_norm_embedding.weight", (H,), self.pre_fc_norm_embedding, self.dtype)
        w.add_norm("pre_fc_norm_hidden.weight", (H,), self.pre_fc_norm_hidden, self.dtype)
        for i, layer in enumerate(self.layers):
            w.merge(f"layers.{i}.", layer.weight_loaders())
        w.add_norm("norm.weight", (H,), self.norm, self.dtype)
        return w


class Qwen3NextForCausalLM(nn.Module):
    """The whole text model (Qwen3-Next and Qwen3.5, dense or MoE) over a paged KV pool and a GDN state pool."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 fp8: Fp8Weights | None = None) -> None:
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        H, V = cfg.hidden_size, cfg.vocab_size
        # With FP8 weights the text model's parameters are laid out on "meta" first and allocated once it is known
        # which of them are FP8 (a bf16 copy of a 27B model would not fit the card it is meant for).
        where = "meta" if fp8 else device
        self.embed_tokens = empty_param((V, H), dtype, where)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, t, cfg.is_moe_layer(i), dtype, where)
                                     for i, t in enumerate(cfg.layer_types)])
        self.norm = norm_scale((H,), where)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else _linear_weight((V, H), dtype, where)
        self.mtp = NextNHead(cfg, dtype, where) if cfg.num_mtp_layers > 0 else None
        if fp8:
            self._allocate(fp8)
        self.visual = None
        if cfg.vision_config is not None:
            self.visual = VisionTower(VisionConfig.from_dict(cfg.vision_config), dtype, device)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, device)
        # index of each layer inside its pool: attention layers -> KV pool layer, GDN layers -> state pool layer
        self.pool_index = {i: cfg.attn_layer_ids.index(i) if t == "full_attention" else cfg.gdn_layer_ids.index(i)
                           for i, t in enumerate(cfg.layer_types)}
        self._weights = self._build_loaders()

    # ---- weights ----
    def _allocate(self, fp8: Fp8Weights) -> None:
        """Give every parameter laid out on "meta" its memory: an Fp8Weight where `blocks` names it (with an
        experts dimension for stacked experts [E, N, K]), else a tensor of its dtype."""
        unknown = set(fp8.blocks) - {n for n, p in self.named_parameters() if getattr(p, "is_linear_weight", False)}
        assert not unknown, f"not linear weights of this model: {sorted(unknown)}"
        for name, p in list(self.named_parameters()):
            if not p.is_meta:
                continue
            owner, attr = self.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            del owner._parameters[attr]
            if name in fp8.blocks:
                experts = p.shape[0] if p.dim() == 3 else None
                setattr(owner, attr, Fp8Weight(p.shape[-2], p.shape[-1], fp8.blocks[name], self.device,
                                               fp8.act_quant, experts))
            else:
                setattr(owner, attr, empty_param(p.shape, p.dtype, self.device))
        if self.cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens

    def linear_parts(self) -> dict[str, list[tuple[str, int, int]]]:
        """Each linear weight filled by checkpoint tensors copied as they are: parameter name -> [(canonical name,
        first row, rows)], for stacked experts [E, N, K] every expert's parts with their first row within the
        expert. Weights loaded through a reordering (Qwen3-Next's interleaved GDN projections) are not listed, and
        the stacked names a checkpoint may ship instead (`fused_expert_tensors`) are no parts. What the loader
        decides FP8 placement on."""
        names = {id(p): n for n, p in self.named_parameters() if getattr(p, "is_linear_weight", False)}
        out: dict[str, list[tuple[str, int, int]]] = {}
        for canonical, (param, start) in self._weights.parts.items():
            if id(param) in names:
                out.setdefault(names[id(param)], []).append((canonical, start, self._weights.shapes[canonical][0]))
        # a weight is listed only if its parts cover it (a reordered part leaves it out); stacked experts by rows
        # of all experts
        return {n: parts for n, parts in out.items()
                if sum(rows for _, _, rows in parts) == math.prod(self.get_parameter(n).shape[:-1])}

    def _build_loaders(self) -> WeightLoaders:
        w, H, V = WeightLoaders(), self.cfg.hidden_size, self.cfg.vocab_size
        w.add("embed_tokens.weight", (V, H), self.embed_tokens)
        for i, layer in enumerate(self.layers):
            w.merge(f"layers.{i}.", layer.weight_loaders())
        w.add_norm("norm.weight", (H,), self.norm, self.dtype)
        if not self.cfg.tie_word_embeddings:
            w.add("lm_head.weight", (V, H), self.lm_head)
        if self.mtp is not None:
            w.merge("mtp.", self.mtp.weight_loaders())
        if self.visual is not None:
            w.merge("visual.", self.visual.weight_loaders())
        # accepted alternative names (stacked experts); not part of expected_tensors()
        self._fused = WeightLoaders()
        mtp_layers = list(self.mtp.layers) if self.mtp is not None else []
        for prefix, layer in [(f"layers.{i}.", l) for i, l in enumerate(self.layers)] + \
                             [(f"mtp.layers.{i}.", l) for i, l in enumerate(mtp_layers)]:
            if isinstance(layer.mlp, SparseMoE):
                self._fused.merge(prefix + "mlp.", layer.mlp.fused_expert_loaders())
        return w

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        return dict(self._weights.shapes)

    def fused_expert_tensors(self) -> dict[str, tuple[int, ...]]:
        """Stacked-expert names a checkpoint may ship instead of the per-expert ones."""
        return dict(self._fused.shapes)

    def load_tensor(self, name: str, tensor: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Copy one checkpoint tensor in; `scale` (block scales in the target's layout) when it stays FP8."""
        loader = self._weights.loaders.get(name) or self._fused.loaders.get(name)
        if loader is None:
            raise KeyError(f"unexpected tensor {name!r}")
        if scale is None:
            loader(tensor.to(self.device))
        else:
            loader(tensor.to(self.device), scale.to(self.device, torch.float32))

    # ---- forward ----
    def forward(self, batch: ForwardBatch, kv_pool, state_pool) -> torch.Tensor:
        """Returns the final hidden states [T, H] (after model.norm)."""
        x = F.embedding(batch.input_ids, self.embed_tokens)
        if batch.image_rows is not None:    # image pads take the vision tower's features (HF: masked_scatter)
            x[batch.image_rows] = batch.image_embeds.to(x.dtype)
        cos_sin = self.cos_sin(batch)
        for i, layer in enumerate(self.layers):
            j = self.pool_index[i]
            if layer.kind == "linear_attention":
                conv, ssm = PoolLayer(state_pool.conv, j), PoolLayer(state_pool.ssm, j)
                x = layer(x, lambda h: layer.mixer(h, batch, conv, ssm))
            else:
                kv = PoolLayer(kv_pool.buffer, j)
                x = layer(x, lambda h: layer.mixer(h, batch, kv, cos_sin))
        return scaled_rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def cos_sin(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary tables for the batch: M-RoPE over (t, h, w) rows when it has image positions; otherwise the
        rows are equal and M-RoPE is exactly 1-D RoPE."""
        if batch.mrope_positions is None:
            return self.rotary.cos_sin(batch.positions)
        return mrope_cos_sin(batch.mrope_positions, self.rotary.inv_freq, self.cfg.mrope_section,
                             self.cfg.mrope_interleaved)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Vision features [sum of tokens, H] of images in the order given (each attends only to itself)."""
        assert self.visual is not None, "this checkpoint has no vision tower"
        return self.visual(pixel_values.to(self.device, self.visual.dtype), grids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head)

    def mtp_forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_pool,
                    kv_layer: int) -> torch.Tensor:
        """NEXTN draft logits. hidden [T, H] final hidden states at positions p, next_ids [T] tokens at p+1;
        batch describes positions p and the MTP layer's own KV pages in pool layer `kv_layer`."""
        return self.compute_logits(self.mtp_hidden(next_ids, hidden, batch, kv_pool, kv_layer))

    def _mtp_input(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The NEXTN head's fc output: the embedding of the next token next to the hidden state."""
        assert self.mtp is not None, "this checkpoint has no mtp.* weights"
        eps, m = self.cfg.rms_norm_eps, self.mtp
        e = F.embedding(next_ids, self.embed_tokens)
        if batch.image_rows is not None:    # an image token's embedding is its vision feature row, as the target's
            e[batch.image_rows] = batch.image_embeds.to(e.dtype)
        e = scaled_rms_norm(e, m.pre_fc_norm_embedding, eps)
        return linear(torch.cat([e, scaled_rms_norm(hidden, m.pre_fc_norm_hidden, eps)], dim=-1), m.fc)

    def mtp_hidden(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_pool,
                   kv_layer: int) -> torch.Tensor:
        """The NEXTN head's output after mtp.norm [T, H]: what its logits are computed from, and the hidden the
        next draft step takes in place of the target's (a chain of drafts)."""
        u = self._mtp_input(next_ids, hidden, batch)
        cos_sin = self.cos_sin(batch)
        kv = PoolLayer(kv_pool.buffer, kv_layer)
        for layer in self.mtp.layers:
            u = layer(u, lambda h: layer.mixer(h, batch, kv, cos_sin))
        return scaled_rms_norm(u, self.mtp.norm, self.cfg.rms_norm_eps)

    def mtp_kv(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv_pool,
               kv_layer: int) -> None:
        """Only the NEXTN head's KV at these positions, as mtp_hidden writes it (no draft is made from them): its
        attention, output projection and MLP are skipped."""
        if len(self.mtp.layers) != 1:       # a second layer's KV needs the first one's output
            self.mtp_hidden(next_ids, hidden, batch, kv_pool, kv_layer)
            return
        layer = self.mtp.layers[0]
        u = scaled_rms_norm(self._mtp_input(next_ids, hidden, batch), layer.input_layernorm, self.cfg.rms_norm_eps)
        layer.mixer.write_kv_only(u, batch, PoolLayer(kv_pool.buffer, kv_layer), self.cos_sin(batch))
