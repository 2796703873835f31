"""Qwen3-Next / Qwen3.5 hybrid model: Gated DeltaNet layers + gated full attention, dense MLP or MoE, NEXTN head.

One file for both families, the forward only: which checkpoint tensor fills which parameter (and the FP8 layout of
the weights kept FP8) is models/weights.py's. Weights use one layout inside the engine whatever the checkpoint
family: GDN input projections are stored split and contiguous ([q | k | v | z] and [b | a]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.kernels.pointwise import apply_rotary, gated_rms_norm, l2_norm, rms_norm, silu_and_mul
from tinyserve.kernels.attention import paged_attention_decode, paged_attention_prefill, store_kv
from tinyserve.kernels.conv import causal_conv1d_decode, causal_conv1d_prefill, causal_conv1d_verify
from tinyserve.kernels.gdn import (chunk_gated_delta_rule, recurrent_gated_delta_rule_decode,
                                   recurrent_gated_delta_rule_verify)
from tinyserve.kernels.linear import linear
from tinyserve.kernels.moe import fused_experts, route
from tinyserve.kernels import PoolLayer
from tinyserve.kernels.verify_layout import VerifyLayout
from tinyserve.models.config import ModelConfig  # noqa: F401 - re-exported
from tinyserve.models.qwen_vision import VisionConfig, VisionTower, mrope_cos_sin
from tinyserve.models.weights import QuantizedWeights, TextWeights, allocate, empty_param


@dataclass
class ForwardBatch:
    """One step's packed tokens: no padding; sequence i owns tokens cu_seqlens[i]:cu_seqlens[i+1].

    The first `num_decode` sequences decode one token each; the next `num_verify` are verifies (a decode with NEXTN's
    drafts after its own token), whose GDN layers run the decode recurrence token by token and keep the state after
    each token (`verify`, a kernels.verify_layout.VerifyLayout, token rows counted from the first verify token); the
    rest are prefill chunks. For attention each verify token is a decode row whose context ends at its own position
    (split-K over a long context, where a prefill tile would be one program per KV head).
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
    num_verify: int = 0              # verifies: decodes with drafts after them
    verify: VerifyLayout | None = None
    # Decode attention's bound on the decode and verify rows' lengths (None: their max). A static batch (static.py,
    # CUDA graphs) fixes it to the context length, so nothing in its forward changes from step to step.
    decode_max_len: int | None = None
    # GDN state snapshots inside the prefill chunks: (prefill sequence i, counted from the first prefill, offset o
    # from its chunk's start, state slot): the conv and SSM state after its first o tokens are also written there.
    prefill_snapshots: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_seqs(self) -> int:
        return self.page_table.shape[0]

    @property
    def prefill_start(self) -> int:
        # the first token row of the prefill chunks, after the decode and verify tokens
        return self.cu_seqlens[self.num_decode + self.num_verify] if self.has_prefill else self.input_ids.shape[0]

    @property
    def has_prefill(self) -> bool:
        return self.num_seqs > self.num_decode + self.num_verify

    @classmethod
    def of_shape(cls, T: int, max_len: int, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, seq_lens: torch.Tensor, page_table: torch.Tensor,
                 state_slots: torch.Tensor, out_slots: torch.Tensor | None = None,
                 token_lens: torch.Tensor | None = None) -> ForwardBatch:
        """B = page_table.shape[0] sequences of T tokens each (token rows i*T .. i*T+T-1 are sequence i's), all
        decodes (T = 1) or all verifies, described by tensors alone: no host list or count, so torch.compile traces
        one graph for every batch size (static_forward). max_len bounds the decode attention's context; T > 1
        also reads out_slots (where the state after each token goes) and token_lens (the keys each token sees)."""
        B = page_table.shape[0]
        verify = None
        if T > 1:
            rows = torch.arange(B * T, device=input_ids.device)
            verify = VerifyLayout(rows=rows.view(B, T), valid=None, in_slots=state_slots, out_slots=out_slots,
                                  token_seq=rows // T, token_lens=token_lens)
        return cls(input_ids=input_ids, positions=positions, cu_seqlens=[], seq_lens=[], seq_lens_t=seq_lens,
                   page_table=page_table, slot_mapping=slot_mapping, state_slots=[], state_slots_t=state_slots,
                   num_decode=B if T == 1 else 0, num_verify=0 if T == 1 else B, verify=verify,
                   decode_max_len=max_len)


class Pools(NamedTuple):
    """The KV and state pools as the forward reads them (kv_pool.buffer, state_pool.conv / .ssm), as tensors: what
    a compiled or captured step passes (its graphs are keyed on tensors, not on the pool objects)."""
    buffer: torch.Tensor
    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


class Rotary:
    """The tables of the partial NeoX rotary embedding on the first rotary_dim dims of each head (applied by
    kernels.pointwise.apply_rotary)."""

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
    scale, 1 + w in fp32: computed once at load (WeightLoaders.add_norm), not on every step (scaled_rms_norm)."""
    return empty_param(shape, torch.float32, device)


def scaled_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm(x, scale, eps, zero_centred=False)


def _linear_weight(shape, dtype, device) -> nn.Parameter:
    """A weight that only kernels.linear reads ([N, K]), or a MoE layer's stacked experts that only the fused MoE
    reads ([E, N, K]): it may be kept as FP8 or 4-bit instead (weights.QuantizedWeights)."""
    p = empty_param(shape, dtype, device)
    p.is_linear_weight = True
    return p


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

    def forward(self, x: torch.Tensor, batch: ForwardBatch, conv_state: PoolLayer,
                ssm_state: PoolLayer) -> torch.Tensor:
        T = x.shape[0]
        mixed, z = linear(x, self.in_proj_qkvz).split([2 * self.kd + self.vd, self.vd], dim=-1)
        b, a = linear(x, self.in_proj_ba).float().split([self.nv, self.nv], dim=-1)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())

        nd, nv = batch.num_decode, batch.num_verify    # the first nd tokens decode, the next nv verify
        parts = []
        if nd:
            u = causal_conv1d_decode(mixed[:nd], self.conv_weight, conv_state, batch.state_slots_t[:nd])
            q, k, v = self._split_heads(u)
            parts.append(recurrent_gated_delta_rule_decode(q, k, v, g[:nd], beta[:nd], ssm_state,
                                                           batch.state_slots_t[:nd]))
        vs, ve = nd, batch.prefill_start                 # the verifies' tokens
        if nv:
            u = causal_conv1d_verify(mixed[vs:ve], self.conv_weight, conv_state, batch.verify)
            q, k, v = self._split_heads(u)
            parts.append(recurrent_gated_delta_rule_verify(q, k, v, g[vs:ve], beta[vs:ve], ssm_state, batch.verify))
        if batch.has_prefill:
            cu = [c - ve for c in batch.cu_seqlens[nd + nv:]]
            slots, snaps = batch.state_slots[nd + nv:], batch.prefill_snapshots
            u = causal_conv1d_prefill(mixed[ve:], self.conv_weight, conv_state, cu, slots, snaps)
            q, k, v = self._split_heads(u)
            parts.append(chunk_gated_delta_rule(q, k, v, g[ve:], beta[ve:], ssm_state, cu, slots, snapshots=snaps))
        o = parts[0] if len(parts) == 1 else torch.cat(parts)
        y = gated_rms_norm(o, z.reshape(T, self.nv, self.dv), self.norm_weight, self.cfg.rms_norm_eps)
        return linear(y.reshape(T, self.vd), self.out_proj)

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(linear(x, self.router), self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
        out = fused_experts(x, self.experts_gate_up, self.experts_down, weights, experts)        # fp32
        shared = self.shared_expert(x) * torch.sigmoid(linear(x, self.shared_expert_gate))
        return (out + shared.float()).to(x.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: the mixer (GDN or gated attention), then the MLP (dense or MoE)."""

    def __init__(self, cfg: ModelConfig, kind: str, moe: bool, dtype, device) -> None:
        super().__init__()
        self.kind, self.dtype = kind, dtype
        H = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = norm_scale((H,), device)
        self.post_attention_layernorm = norm_scale((H,), device)
        self.mixer = (GatedDeltaNet(cfg, dtype, device) if kind == "linear_attention"
                      else GatedAttention(cfg, dtype, device))
        self.mlp = SparseMoE(cfg, dtype, device) if moe else DenseMLP(H, cfg.intermediate_size, dtype, device)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, *pools) -> torch.Tensor:
        # pools: the mixer's (a GDN layer's conv and SSM state layers; an attention layer's KV layer, rotary tables)
        h = x + self.mixer(scaled_rms_norm(x, self.input_layernorm, self.eps), batch, *pools)
        return h + self.mlp(scaled_rms_norm(h, self.post_attention_layernorm, self.eps))


class NextNHead(nn.Module):
    """NEXTN (MTP) draft head: hidden state at p + embedding of token p+1 -> the hidden its draft logits for token
    p+2 come from.

    u = fc([norm_e(embed(x_{p+1})) | norm_h(h_p)]); u = full-attention decoder layer(u) (own KV, one more layer of
    the KV pool); out = norm(u). Shares embed_tokens, the rotary tables and lm_head with the target model: the caller
    embeds the tokens (Qwen3NextForCausalLM.embed) and makes the tables (.cos_sin).
    """

    def __init__(self, cfg: ModelConfig, dtype, device) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.eps, self.dtype = cfg.rms_norm_eps, dtype
        self.fc = _linear_weight((H, 2 * H), dtype, device)
        self.pre_fc_norm_embedding = norm_scale((H,), device)
        self.pre_fc_norm_hidden = norm_scale((H,), device)
        self.layers = nn.ModuleList([DecoderLayer(cfg, "full_attention", cfg.num_experts > 0, dtype, device)
                                     for _ in range(cfg.num_mtp_layers)])
        self.norm = norm_scale((H,), device)

    def _input(self, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """fc of the next token's embedding beside the hidden state."""
        e = scaled_rms_norm(embedded, self.pre_fc_norm_embedding, self.eps)
        return linear(torch.cat([e, scaled_rms_norm(hidden, self.pre_fc_norm_hidden, self.eps)], dim=-1), self.fc)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: PoolLayer,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The head's output after its norm [T, H]: what its logits are computed from, and the hidden the next draft
        step takes in place of the target's (a chain of drafts). embedded: the tokens at p+1, embedded; hidden: the
        hidden rows at p; batch describes positions p in the head's own KV layer `kv`."""
        u = self._input(embedded, hidden)
        for layer in self.layers:
            u = layer(u, batch, kv, cos_sin)
        return scaled_rms_norm(u, self.norm, self.eps)

    def write_kv(self, embedded: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: PoolLayer,
                 cos_sin: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Only the head's KV at these positions, as forward writes it (no draft is made from them): its attention,
        output projection and MLP are skipped."""
        if len(self.layers) != 1:           # a second layer's KV needs the first one's output
            self(embedded, hidden, batch, kv, cos_sin)
            return
        layer = self.layers[0]
        u = scaled_rms_norm(self._input(embedded, hidden), layer.input_layernorm, self.eps)
        layer.mixer.write_kv_only(u, batch, kv, cos_sin)


class Qwen3NextForCausalLM(nn.Module):
    """The whole text model (Qwen3-Next and Qwen3.5, dense or MoE) over a paged KV pool and a GDN state pool.

    quantized: the linear weights to hold as FP8 or 4-bit; the parameters are then laid out on "meta" first and
    given their memory once it is known which are quantized (weights.allocate; a bf16 copy of a 27B model would
    not fit the card it is meant for).

    forward(batch, kv_pool, state_pool) returns the final hidden states [T, H] (after model.norm). Images (Qwen3.5)
    add two inputs: rope_positions, the (t, h, w) rotary rows [3, T] of a batch with an image (M-RoPE), and embeds,
    the packed rows that take the vision tower's features instead of the pad's embedding, with those features
    ([n] int64, [n, H])."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 quantized: QuantizedWeights | None = None) -> None:
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        H, V = cfg.hidden_size, cfg.vocab_size
        where = "meta" if quantized else device
        self.embed_tokens = empty_param((V, H), dtype, where)
        self.layers = nn.ModuleList([DecoderLayer(cfg, t, cfg.is_moe_layer(i), dtype, where)
                                     for i, t in enumerate(cfg.layer_types)])
        self.norm = norm_scale((H,), where)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else _linear_weight((V, H), dtype, where)
        self.mtp = NextNHead(cfg, dtype, where) if cfg.num_mtp_layers > 0 else None
        if quantized:
            allocate(self, quantized)
        self.visual = None
        if cfg.vision_config is not None:
            self.visual = VisionTower(VisionConfig.from_dict(cfg.vision_config), dtype, device)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, device)
        # index of each layer inside its pool: attention layers -> KV pool layer, GDN layers -> state pool layer
        self.pool_index = {i: cfg.attn_layer_ids.index(i) if t == "full_attention" else cfg.gdn_layer_ids.index(i)
                           for i, t in enumerate(cfg.layer_types)}

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors this model loads (canonical name -> shape): weights.TextWeights' list."""
        return TextWeights(self).expected()

    # ---- forward ----
    def forward(self, batch: ForwardBatch, kv_pool, state_pool, rope_positions: torch.Tensor | None = None,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # the final hidden states [T, H] (after model.norm); an image's inputs: the class docstring
        x = self.embed(batch.input_ids, embeds)
        cos_sin = self.cos_sin(batch.positions, rope_positions)
        for i, layer in enumerate(self.layers):
            j = self.pool_index[i]
            if layer.kind == "linear_attention":
                x = layer(x, batch, PoolLayer(state_pool.conv, j), PoolLayer(state_pool.ssm, j))
            else:
                x = layer(x, batch, PoolLayer(kv_pool.buffer, j), cos_sin)
        return scaled_rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def static_forward(self, T: int, max_len: int | None, kv: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor,
                       *tensors: torch.Tensor) -> torch.Tensor:
        # the forward on ForwardBatch.of_shape's batch (max_len None: the page table's width in tokens): what the
        # CPU compiles (a plain decode: the runner's batch as it is) and CUDA graphs capture (static.py)
        pools = Pools(kv, conv, ssm)
        return self(ForwardBatch.of_shape(T, max_len or tensors[4].shape[1] * kv.shape[3], *tensors), pools, pools)

    def embed(self, input_ids: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> torch.Tensor:
        # rows embeds[0] take embeds[1] (image pads: the vision tower's features, as transformers' masked_scatter)
        x = F.embedding(input_ids, self.embed_tokens)
        if embeds is not None:
            x[embeds[0]] = embeds[1].to(x.dtype)
        return x

    def cos_sin(self, positions: torch.Tensor, rope_positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # M-RoPE over (t, h, w) rows when a batch has image positions; otherwise the rows are equal: 1-D RoPE
        if rope_positions is None:
            return self.rotary.cos_sin(positions)
        return mrope_cos_sin(rope_positions, self.rotary.inv_freq, self.cfg.mrope_section,
                             self.cfg.mrope_interleaved)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Vision features [sum of tokens, H] of images in the order given (each attends only to itself)."""
        assert self.visual is not None, "this checkpoint has no vision tower"
        return self.visual(pixel_values.to(self.device, self.visual.dtype), grids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head)
