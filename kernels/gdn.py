"""Gated delta rule (the GDN recurrence), torch reference over packed variable-length sequences.

Per value head h, with state S [dk, dv] (fp32):  S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;
o_t = S^T q_t.  q and k arrive l2-normalised (q also scaled by dk^-1/2); they have H key heads and value head j uses
key head j // (HV // H). The state pool is [slots, HV, dk, dv]; each sequence reads its initial state from its slot
and writes its final state back in place (slots are zeroed by the engine when a sequence starts fresh).

The prefill (chunk_gated_delta_rule): every chunk of every sequence is computed at once (intra-chunk work batched);
only the chunk-to-chunk state hand-over loops, over chunk index, batched across sequences. Its snapshots: (sequence i,
offset o, slot) with 0 < o < its length and o a multiple of SNAPSHOT_ALIGN: the state after sequence i's first o
tokens is also written to `slot` (the prefix cache's snapshots inside a chunk).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from tinyserve.kernels import PoolLayer, gdn_cpu, use_cpu_kernel, use_triton
from tinyserve.kernels.verify_layout import VerifyLayout, pad_to_layout


def _expand_heads(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    r = num_v_heads // x.shape[-2]
    return x if r == 1 else x.repeat_interleave(r, dim=-2)


def gdn_gating(ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gates of a GDN layer from its in_proj_ba projection ba [T, 2 HV] (b | a): the log-decay
    g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), each [T, HV] fp32 (math in fp32: in 16 bits
    exp(A_log) can overflow). The Triton kernel is one launch for what is seven ops here."""
    if use_triton(ba):
        from tinyserve.kernels import gdn_triton
        return gdn_triton.gdn_gating(ba, A_log, dt_bias)
    b, a = ba.float().split([A_log.shape[0], A_log.shape[0]], dim=-1)
    return -A_log.float().exp() * F.softplus(a + dt_bias.float()), torch.sigmoid(b)


TORCH_CHUNK = 32         # the torch prefill's chunk length (below)
SNAPSHOT_ALIGN = 16      # a state snapshot inside a prefill falls on a chunk end: chunks are never shorter than this


def snapshot_alignment(device: torch.device) -> int | None:
    """The multiple of tokens, from a prefill chunk's start, at which the prefill ops also write the state to a
    snapshot slot in the same forward (`snapshots` below), or None where they cannot (the Triton kernels keep
    only a low-precision state per chunk: the scheduler ends the chunk at the snapshot instead)."""
    return None if use_triton(torch.empty(0, device=device)) else SNAPSHOT_ALIGN


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor | PoolLayer, cu_seqlens: list[int], slot_ids: list[int],
                           chunk_size: int = 64, snapshots: Sequence[tuple[int, int, int]] = ()) -> torch.Tensor:
    """Prefill: q, k [T, H, dk]; v [T, HV, dv]; g, beta [T, HV] (fp32, g = log-decay <= 0) -> o [T, HV, dv]."""
    state = PoolLayer.of(state).rows
    if use_triton(q):
        assert not snapshots, "the Triton prefill takes no snapshots inside a chunk (snapshot_alignment)"
        from tinyserve.kernels import gdn_triton
        return gdn_triton.chunk_gated_delta_rule(q, k, v, g, beta, state, cu_seqlens, slot_ids, chunk_size)
    T, HV, dv = v.shape
    longest = max(cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(slot_ids)))
    # 32-token chunks on the CPU: the intra-chunk work grows with the chunk's length, the hand-over loop with their
    # number; 32 was 1.1-1.5x faster than 64 from 8 prompts of 40 tokens to one of 2,000 (2-core EPYC, fp32)
    C = min(chunk_size, TORCH_CHUNK, max(16, 1 << (longest - 1).bit_length()))   # a short prefill: less padding
    for _, offset, _ in snapshots:                                  # every snapshot on a chunk end
        assert offset % SNAPSHOT_ALIGN == 0, f"a snapshot at {offset} tokens is not on a {SNAPSHOT_ALIGN} boundary"
        C = math.gcd(C, offset)
    device = v.device
    q = _expand_heads(q, HV).float()
    k = _expand_heads(k, HV).float()
    vf, g, beta = v.float(), g.float(), beta.float()

    # Gather tokens into [num_chunks, C] slots (padding points at an appended all-zero row: g=0, beta=0, k=0 leave
    # the state untouched, so padded tail positions are harmless). The layout is the same for every GDN layer of a
    # step, so it is built once per step (cached on the step's cu_seqlens).
    lay = _chunk_layout(tuple(cu_seqlens), C, T, device)
    idx = lay.idx                                                         # [NC, C]

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
    S = state.index_select(0, slots).float()                              # [N, HV, dk, dv]
    out = torch.empty_like(U)
    last_decay = G_last.exp()[..., None, None]
    due: dict[int, list[tuple[int, int]]] = {}                            # chunk position -> (sequence, slot)
    for i, offset, slot in snapshots:
        due.setdefault(offset // C - 1, []).append((i, slot))
    for c, (sel, seqs) in enumerate(lay.steps):                           # chunk position c = 0, 1, ...
        S_c = S[seqs]
        V_new = U[sel] - W[sel] @ S_c
        out[sel] = q_decayed[sel] @ S_c + QK[sel] @ V_new
        S[seqs] = S_c * last_decay[sel] + k_tail[sel].transpose(-1, -2) @ V_new
        for i, slot in due.get(c, ()):
            state[slot] = S[i].to(state.dtype)
    state.index_copy_(0, slots, S.to(state.dtype))

    o = out.transpose(1, 2).reshape(-1, HV, dv)                           # [NC*C, HV, dv]
    # real tokens sit in token order among the padded positions: one gather (a view when nothing is padded)
    return o[lay.real].to(v.dtype)


Index = slice | torch.Tensor


@dataclass(frozen=True)
class _ChunkLayout:
    idx: torch.Tensor                        # [NC, C] token of each chunk position (T = the zero padding row)
    steps: list[tuple[Index, Index]]         # per chunk position c: (chunks at c, their sequences)
    real: Index                              # flat chunk positions of the T real tokens, in token order


@functools.lru_cache(maxsize=8)
def _chunk_layout(cu_seqlens: tuple[int, ...], C: int, T: int, device: torch.device) -> _ChunkLayout:
    lens = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(cu_seqlens) - 1)]
    n_chunks = [(n + C - 1) // C for n in lens]
    first_chunk = [sum(n_chunks[:i]) for i in range(len(lens))]
    idx_rows = []
    for i, n in enumerate(lens):
        tok = torch.full((n_chunks[i] * C,), T, dtype=torch.long)
        tok[:n] = torch.arange(cu_seqlens[i], cu_seqlens[i] + n)
        idx_rows.append(tok.view(n_chunks[i], C))
    idx = torch.cat(idx_rows).to(device)
    steps: list[tuple[Index, Index]] = []
    for c in range(max(n_chunks)):
        seqs = [i for i in range(len(lens)) if n_chunks[i] > c]
        if len(seqs) == 1:                   # views instead of gathers (always so for a lone prefill)
            steps.append((slice(first_chunk[seqs[0]] + c, first_chunk[seqs[0]] + c + 1),
                          slice(seqs[0], seqs[0] + 1)))
        else:
            steps.append((torch.tensor([first_chunk[i] + c for i in seqs], device=device),
                          torch.tensor(seqs, device=device)))
    flat = idx.reshape(-1)
    # exactly T positions are real: if the first T are, all padding is at the end and a slice will do
    real: Index = slice(0, T) if bool((flat[:T] < T).all()) else (flat < T).nonzero().squeeze(1)
    return _ChunkLayout(idx, steps, real)


def slot_run(slot_ids: torch.Tensor, pool: torch.Tensor) -> int | None:
    """The first slot when slot_ids are consecutive ascending slots of a CPU pool (then `pool.narrow` is a view of
    exactly those rows); None otherwise. Reading the ids is free on the CPU; a GPU kernel indexes directly, and so
    does a compiled step (torch.compile), whose gather and scatter fuse with the update."""
    if pool.device.type != "cpu" or torch.compiler.is_dynamo_compiling():
        return None
    ids = slot_ids.tolist()
    return ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None


def recurrent_gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, state: torch.Tensor | PoolLayer,
                                      slot_ids: torch.Tensor) -> torch.Tensor:
    """One token per sequence. q, k [N, H, dk]; v [N, HV, dv]; g, beta [N, HV]; state [slots, HV, dk, dv]."""
    pool = PoolLayer.of(state)
    state = pool.rows
    if use_triton(v):
        from tinyserve.kernels import gdn_triton
        return gdn_triton.recurrent_gated_delta_rule_decode(q, k, v, g, beta, state, slot_ids)
    if use_cpu_kernel(v) and gdn_cpu.usable(v, pool):        # each state read once and written once (gdn_cpu.c)
        return gdn_cpu.decode(q, k, v, g, beta, pool, slot_ids, slot_ids)
    HV = v.shape[1]
    q = _expand_heads(q, HV).float()
    k = _expand_heads(k, HV).float()
    # One gathered fp32 copy of the states, updated in place, written back once (no per-op temporaries of the
    # state's size: it is the largest tensor a decode step touches after the weights). Slots that form one run
    # (the usual case: slots are handed out in admission order, decodes run in it) are updated in place through
    # a view: no gather, no write-back.
    first = slot_run(slot_ids, state) if state.dtype == torch.float32 else None
    S = state.narrow(0, first, slot_ids.numel()) if first is not None else state.index_select(0, slot_ids)
    if S.dtype != torch.float32:
        S = S.float()
    out = _delta_rule_step(S, q, k, g.float(), beta.float(), v.float())
    if first is None:
        pool.put((slot_ids,), S)
    return out.to(v.dtype)


def _delta_rule_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     v: torch.Tensor) -> torch.Tensor:
    """One token of the gated delta rule, S [N, HV, dk, dv] updated in place; q, k [N, HV, dk]; v [N, HV, dv];
    g, beta [N, HV] (fp32). Returns o = S'^T q [N, HV, dv], where S' = a S + k delta^T, a = exp(g) and
    delta = beta (v - a S^T k). S is read once for both S^T k and S^T q (o = a S^T q + (q . k) delta), then
    updated in one pass: the state is the largest thing a decode step reads after the weights."""
    a = g.exp().unsqueeze(-1)                                              # [N, HV, 1]
    kS, qS = (torch.stack((k, q), dim=-2) @ S).unbind(-2)                  # S^T k, S^T q: [N, HV, dv]
    delta = beta.unsqueeze(-1) * (v - a * kS)
    out = a * qS + (q * k).sum(-1, keepdim=True) * delta
    S.mul_(a.unsqueeze(-1)).addcmul_(k.unsqueeze(-1), delta.unsqueeze(-2))  # S = a S + k delta^T
    return out


def recurrent_gated_delta_rule_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, state: torch.Tensor | PoolLayer,
                                      lay: VerifyLayout) -> torch.Tensor:
    """Speculative verify: the decode recurrence (the same ops, so the same numbers as decoding the tokens one step
    at a time) over each sequence's 1 + k tokens, batched over sequences, keeping the state after every token in
    its own slot, so the state after the last accepted token can become the sequence's state as it is."""
    pool = PoolLayer.of(state)
    state = pool.rows
    if use_triton(v):
        from tinyserve.kernels import gdn_triton
        return gdn_triton.recurrent_gated_delta_rule_verify(q, k, v, g, beta, state, lay)
    if use_cpu_kernel(v) and gdn_cpu.usable(v, pool):
        # the decode's kernel, one call a token: token 0 reads its sequence's slot, every later one the slot its
        # token before wrote; each writes its own
        qp, kp, vp, gp, bp = (pad_to_layout(x, lay) for x in (q, k, v, g, beta))
        source, out = lay.in_slots, []
        for t, slots in enumerate(_state_slots(lay).unbind(1)):
            out.append(gdn_cpu.decode(qp[:, t], kp[:, t], vp[:, t], gp[:, t], bp[:, t], pool, source, slots))
            source = slots
        return lay.unpad(torch.stack(out, 1))
    HV = v.shape[1]
    qp = pad_to_layout(_expand_heads(q, HV).float(), lay)                 # [N, L, HV, dk]
    kp = pad_to_layout(_expand_heads(k, HV).float(), lay)
    vp, gp, bp = pad_to_layout(v.float(), lay), pad_to_layout(g.float(), lay), pad_to_layout(beta.float(), lay)
    S = state.index_select(0, lay.in_slots)
    S = S.float() if S.dtype != torch.float32 else S                       # [N, HV, dk, dv], a copy
    out = []
    for t, slots in enumerate(_state_slots(lay).unbind(1)):
        out.append(_delta_rule_step(S, qp[:, t], kp[:, t], gp[:, t], bp[:, t], vp[:, t]))
        # each token's state straight into its slot: one scatter of N states per token, which a compiled step
        # vectorizes along the state; a [N, L] buffer written back by one scatter over all N * L slots compiled
        # into a loop over the slots with the recurrence recomputed inside it (7x slower on a 2-core CPU)
        pool.put((slots,), S)
    return lay.unpad(torch.stack(out, 1)).to(v.dtype)


def _state_slots(lay: VerifyLayout) -> torch.Tensor:
    """[N, L]: the slot of each token's state; a padding token (past its sequence's end: a zero token, which leaves
    the state as it is) writes its sequence's last real token's slot again, with the same state."""
    N, L = lay.rows.shape
    if lay.valid is None:
        return lay.out_slots.view(N, L)
    last_real = lay.rows.masked_fill(lay.rows == lay.out_slots.numel(), -1).cummax(1).values
    return lay.out_slots[last_real]
