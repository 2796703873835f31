"""The NEXTN (MTP) draft head against the formula of qwen-hybrid.md §3.6, computed here from the raw `mtp.*`
checkpoint tensors with transformers' own full-attention decoder layer class (dense Qwen3.5 and MoE Qwen3-Next):

    e = embed(x_{p+1}); u = fc([rmsnorm_zc(e; pre_fc_norm_embedding) | rmsnorm_zc(h_p; pre_fc_norm_hidden)])
    u = decoder_layer(u)  (own causal attention over the MTP positions); logits = lm_head(rmsnorm_zc(u; mtp.norm))
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

from checkpoints import make_qwen3_5_text, make_qwen3_next
from tinyserve.kernels import PoolLayer
from tinyserve.pools import KVPool, StatePool
from tinyserve.loader import load_model
from tinyserve.models.qwen3_next import ForwardBatch

CASES = {
    "qwen3_5_dense": (lambda p: make_qwen3_5_text(p, with_mtp=True), Qwen3_5DecoderLayer, False),
    "qwen3_next_moe": (lambda p: make_qwen3_next(p, with_mtp=True), Qwen3NextDecoderLayer, True),
}
PAGE = 16


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    make, layer_cls, moe = CASES[request.param]
    folder, hf = make(tmp_path_factory.mktemp(request.param))
    model = load_model(folder, torch.float32, "cpu")
    assert model.mtp is not None and model.cfg.num_mtp_layers == 1
    return hf, layer_cls, moe, model


def zc_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def reference_draft_logits(hf, layer_cls, moe: bool, hidden: torch.Tensor, next_ids: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
    """Draft logits for every position, computed from the raw mtp.* tensors (one causal sequence)."""
    cfg, sd = hf.config, hf.mtp_state_dict
    eps = cfg.rms_norm_eps
    emb = hf.model.embed_tokens.weight
    e = zc_norm(F.embedding(next_ids, emb), sd["mtp.pre_fc_norm_embedding.weight"], eps)
    h = zc_norm(hidden, sd["mtp.pre_fc_norm_hidden.weight"], eps)
    u = F.linear(torch.cat([e, h], dim=-1), sd["mtp.fc.weight"])           # embedding first

    attn_idx = cfg.layer_types.index("full_attention")       # build the class as a full-attention layer
    layer = layer_cls(cfg, attn_idx).eval()
    prefix = "mtp.layers.0."
    lsd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if moe:                                                  # transformers holds the experts stacked
        E = cfg.num_experts
        lsd["mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([lsd.pop(f"mlp.experts.{e}.gate_proj.weight"), lsd.pop(f"mlp.experts.{e}.up_proj.weight")])
            for e in range(E)])
        lsd["mlp.experts.down_proj"] = torch.stack([lsd.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(E)])
    layer.load_state_dict(lsd, strict=True)                  # every mtp.layers.0 tensor, nothing missing
    T = u.shape[0]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        x = u[None]
        pos_emb = hf.model.rotary_emb(x, positions[None])
        y = layer(x, position_embeddings=pos_emb, attention_mask=mask, position_ids=positions[None])[0]
    return F.linear(zc_norm(y, sd["mtp.norm.weight"], eps), hf.lm_head.weight)


def make_batch(ids: list[int], start: int, pages: list[int], slot: int) -> ForwardBatch:
    """One sequence computing positions start..start+len(ids)-1 over the given (scattered) pages."""
    end = start + len(ids)
    slots = [pages[p // PAGE] * PAGE + p % PAGE for p in range(start, end)]
    return ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.arange(start, end), cu_seqlens=[0, len(ids)],
        seq_lens=[end], seq_lens_t=torch.tensor([end], dtype=torch.int32),
        page_table=torch.tensor([pages], dtype=torch.int32), slot_mapping=torch.tensor(slots),
        state_slots=[slot], state_slots_t=torch.tensor([slot]), num_decode=0)


def head_hidden(model, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: KVPool, layer: int,
                kv_only: bool = False) -> torch.Tensor | None:
    """The NEXTN head over batch's positions in KV pool layer `layer` (as spec.py runs it eagerly)."""
    args = (model.embed(next_ids), hidden, batch, PoolLayer(kv.buffer, layer), model.cos_sin(batch.positions))
    return model.mtp.write_kv(*args) if kv_only else model.mtp(*args)


def pools(model) -> tuple[KVPool, StatePool]:
    cfg = model.cfg
    n_attn = len(cfg.attn_layer_ids)
    kv = KVPool(12, PAGE, n_attn + 1, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    st = StatePool(2, len(cfg.gdn_layer_ids), cfg.conv_dim, cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads,
                   cfg.linear_key_head_dim, cfg.linear_value_head_dim, torch.float32, "cpu")
    return kv, st


@pytest.mark.parametrize("split", [None, 23])
def test_mtp_draft_logits_match_formula(case, split):
    hf, layer_cls, moe, model = case
    L = 50
    ids = torch.randint(0, model.cfg.vocab_size, (L,), generator=torch.Generator().manual_seed(L)).tolist()
    kv, st = pools(model)
    pages = [7, 2, 9, 4]                                    # scattered, out of order
    n_attn = len(model.cfg.attn_layer_ids)
    with torch.inference_mode():
        hidden = model(make_batch(ids, 0, pages, 1), kv, st)          # [L, H], after model.norm
        hf_hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    assert (hidden - hf_hidden).abs().max().item() < 1e-4

    # MTP over positions p = 0..L-2 with x_{p+1} = ids[p+1]; optionally in two chunks (its KV cache continues)
    P = L - 1
    next_ids = torch.tensor(ids[1:])
    cuts = [0, P] if split is None else [0, split, P]
    outs = []
    with torch.inference_mode():
        for a, b in zip(cuts, cuts[1:]):
            batch = make_batch(ids[a:b], a, pages, 1)     # positions p; input_ids unused by the head
            outs.append(model.compute_logits(head_hidden(model, next_ids[a:b], hidden[a:b], batch, kv, n_attn)))
    ours = torch.cat(outs)
    ref = reference_draft_logits(hf, layer_cls, moe, hidden[:P].clone(), next_ids, torch.arange(P))
    assert ours.shape == (P, model.cfg.vocab_size)
    assert (ours - ref).abs().max().item() < 1e-4
    # the MTP layer wrote its own pool layer
    assert kv.buffer[:, n_attn].abs().sum() > 0


def test_mtp_position_offset_cancels(case):
    """HF's generic MTP uses positions p+1 instead of p; with only the MTP layer's own KV, RoPE offsets cancel."""
    hf, layer_cls, moe, model = case
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(20, model.cfg.hidden_size, generator=gen)
    nxt = torch.randint(0, model.cfg.vocab_size, (20,), generator=gen)
    a = reference_draft_logits(hf, layer_cls, moe, hidden, nxt, torch.arange(20))
    b = reference_draft_logits(hf, layer_cls, moe, hidden, nxt, torch.arange(1, 21))
    assert (a - b).abs().max().item() < 1e-4
    kv, _ = pools(model)
    with torch.inference_mode():
        ours = model.compute_logits(head_hidden(model, nxt, hidden, make_batch(list(range(20)), 0, [3, 5], 0), kv,
                                                len(model.cfg.attn_layer_ids)))
    assert (ours - a).abs().max().item() < 1e-4


def test_mtp_kv_writes_the_heads_kv(case):
    """NextNHead.write_kv (a position nothing is drafted from: only its K and V rows of the projection) stores in the
    head's pool layer exactly what its forward stores there, and nothing anywhere else."""
    _, _, _, model = case
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(21, model.cfg.hidden_size, generator=gen)
    nxt = torch.randint(0, model.cfg.vocab_size, (21,), generator=gen)
    n_attn = len(model.cfg.attn_layer_ids)
    full, _ = pools(model)
    kv_only, _ = pools(model)
    with torch.inference_mode():
        for a, b in ((0, 20), (20, 21)):                  # a chunk, then one position (as a quiet decode step)
            batch = make_batch(list(range(a, b)), a, [3, 5], 0)
            head_hidden(model, nxt[a:b], hidden[a:b], batch, full, n_attn)
            head_hidden(model, nxt[a:b], hidden[a:b], batch, kv_only, n_attn, kv_only=True)
    assert full.buffer[:, n_attn].abs().sum() > 0
    # a GEMM over fewer weight rows may sum in another order: equal to rounding
    torch.testing.assert_close(kv_only.buffer, full.buffer, rtol=0, atol=1e-6)
