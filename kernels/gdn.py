"""Gated delta rule (the GDN recurrence), torch reference over packed variable-length sequences.

Per value head h, with state S [dk, dv] (fp32):  S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;
o_t = S^T q_t.  q and k arrive l2-normalised (q also scaled by dk^-1/2); they have H key heads and value head j uses
key head j // (HV // H). The state pool is [slots, HV, dk, dv]; each sequence reads its initial state from its slot
and writes its final state back in place (slots are zeroed by the engine when a sequence starts fresh).
"""
from __future__ import annotations

import torch


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    r = num_v_heads // x.shape[-2]
    return x if r == 1 else x.repeat_interleave(r, dim=-2)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, cu_seqlens: list[int], slot_ids: list[int],
                           chunk_size: int = 64) -> torch.Tensor:
    """Prefill form. q, k [T, H, dk]; v [T, HV, dv]; g, beta [T, HV] (fp32, g = log-decay <= 0).

    Every chunk of every sequence is computed at once (intra-chunk work batched); only the chunk-to-chunk state
    hand-over loops, over chunk index, batched across sequences. Returns o [T, HV, dv] in v's dtype.
    """
    T, HV, dv = v.shape
    dk = q.shape[-1]
    C = chunk_size
    device = v.device
    q = _expand_heads(q, HV).float()
    k = _expand_heads(k, HV).float()
    vf, g, beta = v.float(), g.float(), beta.float()

    # Gather tokens into [num_chunks, C] slots (padding points at an appended all-zero row: g=0, beta=0, k=0 leave
    # the state untouched, so padded tail positions are harmless).
    lens = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(slot_ids))]
    n_chunks = [(n + C - 1) // C for n in lens]
    idx_rows, seq_of_chunk, pos_of_chunk = [], [], []
    for i, n in enumerate(lens):
        tok = torch.full((n_chunks[i] * C,), T, dtype=torch.long)
        tok[:n] = torch.arange(cu_seqlens[i], cu_seqlens[i] + n)
        idx_rows.append(tok.view(n_chunks[i], C))
        seq_of_chunk += [i] * n_chunks[i]
        pos_of_chunk += list(range(n_chunks[i]))
    idx = torch.cat(idx_rows).to(device)                                  # [NC, C]

    def gather(x: torch.Tensor) -> torch.Tensor:                          # [T, HV, ...] -> [NC, HV, C, ...]
        padded = torch.cat([x, x.new_zeros((1,) + x.shape[1:])])
        y = padded[idx]                                                    # [NC, C, HV, ...]
        return y.transpose(1, 2)

    qc, kc, vc = gather(q), gather(k), gather(vf)
    gc, bc = gather(g), gather(beta)                                      # [NC, HV, C]
    G = gc.cumsum(-1)
    causal = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    diff = G.unsqueeze(-1) - G.unsqueeze(-2)                              # G_i - G_j
    decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()   # Γ, zero above the diagonal

    kb = kc * bc.unsqueeze(-1)
    A = -(kb @ kc.transpose(-1, -2)) * decay
    A = A.masked_fill(~causal.tril(-1), 0.0)                              # keep strictly lower
    eye = torch.eye(C, device=device)
    Tm = torch.linalg.solve_triangular(eye - A, eye.expand_as(A), upper=False, unitriangular=True)
    U = Tm @ (vc * bc.unsqueeze(-1))                                      # [NC, HV, C, dv]
    W = Tm @ (kb * G.exp().unsqueeze(-1))                                 # [NC, HV, C, dk]
    QK = (qc @ kc.transpose(-1, -2)) * decay                              # lower incl. diagonal
    q_decayed = qc * G.exp().unsqueeze(-1)
    G_last = G[..., -1]                                                   # [NC, HV]
    k_tail = kc * (G_last.unsqueeze(-1) - G).exp().unsqueeze(-1)          # [NC, HV, C, dk]

    slots = torch.tensor(slot_ids, dtype=torch.long, device=state.device)
    S = state[slots].float()                                              # [N, HV, dk, dv]
    out = torch.empty_like(U)
    seq_t = torch.tensor(seq_of_chunk, device=device)
    pos_t = torch.tensor(pos_of_chunk, device=device)
    for c in range(max(n_chunks)):
        sel = (pos_t == c).nonzero().squeeze(1)                            # chunks at position c
        seqs = seq_t[sel]
        S_c = S[seqs]
        V_new = U[sel] - W[sel] @ S_c
        out[sel] = q_decayed[sel] @ S_c + QK[sel] @ V_new
        S[seqs] = S_c * G_last[sel].exp()[..., None, None] + k_tail[sel].transpose(-1, -2) @ V_new
    state[slots] = S.to(state.dtype)

    o = out.transpose(1, 2).reshape(-1, HV, dv)                           # [NC*C, HV, dv]
    flat_idx = idx.reshape(-1)
    keep = flat_idx < T
    result = torch.empty(T, HV, dv, dtype=torch.float32, device=device)
    result[flat_idx[keep]] = o[keep]
    return result.to(v.dtype)


def recurrent_gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """One token per sequence. q, k [N, H, dk]; v [N, HV, dv]; g, beta [N, HV]; state [slots, HV, dk, dv]."""
    HV = v.shape[1]
    q = _expand_heads(q, HV).float().unsqueeze(-2)                       # [N, HV, 1, dk]
    k = _expand_heads(k, HV).float()
    # One gathered fp32 copy of the states, updated in place, written back once (no per-op temporaries of the
    # state's size: it is the largest tensor a decode step touches after the weights).
    S = state.index_select(0, slot_ids)
    if S.dtype != torch.float32:
        S = S.float()
    S.mul_(g.float().exp()[..., None, None])                             # [N, HV, dk, dv]
    pred = (k.unsqueeze(-2) @ S).squeeze(-2)                             # S^T k: [N, HV, dv]
    delta = beta.float().unsqueeze(-1) * (v.float() - pred)
    S.addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))                     # S += k delta^T
    state.index_copy_(0, slot_ids, S.to(state.dtype))
    return (q @ S).squeeze(-2).to(v.dtype)                               # S^T q
