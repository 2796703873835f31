"""The draft and verify maths of speculative decoding (NEXTN, spec.py), lossless in distribution: a draft token is
drawn with its distribution q (draw_drafts), and the target keeps a prefix of the drafts and the token after them
(verify_drafts) so that the committed tokens follow exactly what `sampling.sample` would draw (Leviathan et al.
2023, Chen et al. 2023); greedy requests get exactly the greedy tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.draws import draw, random_uniform, row_uniform
from tinyserve.sampling import SamplingBatch, check_logits, process_logits, to_probs, token_logprobs
from tinyserve.top_k_top_p import candidates, draw_filtered

# Speculative decoding (NEXTN): XORed into a request's seed so the draft's draw and the accept coin at an output
# position are independent of the target's own coin there (which draws the bonus / corrected token).
DRAFT_SALT = 0x6A09E667F3BCC908
ACCEPT_SALT = 0xBB67AE8584CAA73B - (1 << 64)        # as the signed int64 torch stores


def draw_drafts(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row and the draft distribution q it was drawn from.

    logits: [B, V] of the draft (NEXTN) head, any float dtype; batch: one row per drafting request, its
    output_ids = committed outputs + the drafts drawn so far (so penalties / min_tokens / position match).
    Greedy rows (temperature 0): argmax of the processed logits (penalties, min_tokens, grammar mask as `sample`).
    Sampled rows: drawn from q = softmax of the processed logits after `sample`'s filters (temperature, top-k,
    top-p, min-p), by the inverse CDF at a coin keyed by (seed ^ DRAFT_SALT, position).
    Returns (tokens [B] int64, q [B, V] float32 full-vocab probabilities, zero outside the kept set; rows of
    greedy requests are zero) - q is None when all rows are greedy.
    """
    B, V = check_logits(logits, batch, "draw_drafts")
    x = process_logits(logits.to(torch.float32), batch)
    if batch.all_greedy:
        return torch.argmax(x, dim=-1), None
    xs = x if batch.sample_rows is None else x.index_select(0, batch.sample_rows)
    vals, ids = candidates(xs, batch)
    # Not the target's coin at this position: that one draws the bonus / corrected token in verify_drafts, and
    # the accept test is only unbiased when the draft is independent of it.
    weights = torch.softmax(vals, dim=-1)
    drawn = draw(weights, ids, row_uniform(batch.seeds ^ DRAFT_SALT, batch.positions))
    q = to_probs(weights, ids, V)  # exactly the distribution `drawn` came from
    if batch.sample_rows is None:
        return drawn, q
    tokens = torch.argmax(x, dim=-1)
    tokens[batch.sample_rows] = drawn
    full_q = torch.zeros(B, V, dtype=torch.float32, device=x.device)
    full_q[batch.sample_rows] = q
    return tokens, full_q


@dataclass
class VerifyResult:
    """What one verify step commits, per request (in the order of `drafts`)."""

    tokens: list[list[int]]       # the accepted drafts, then the bonus / corrected token: accepted[i] + 1 tokens
    accepted: list[int]           # a_i: drafts accepted
    logprobs: list[list[float | None]]   # raw target log_softmax of each committed token (None: no row asks)
    top: list[list[list[tuple[int, float]]]] | None = None  # per committed token its top-n (id, logprob) of the
    # raw target, n = that row's params.logprobs ([] where 0 / None); None when no row asks for a top-n list


def verify_drafts(target_logits: torch.Tensor, batch: SamplingBatch, drafts: list[list[int]],
                  draft_q: torch.Tensor | None = None) -> VerifyResult:
    """Decide which drafts to keep and the token that follows them, without changing the output distribution.

    target_logits: [R, V], rows packed per request: k_i + 1 rows each (k_i = len(drafts[i]), may be 0), row j
    scoring output position len(outputs_i) + j. batch: built over the same R rows, row j of request i with
    output_ids = outputs_i + drafts[i][:j] and the request's params and seed.
    draft_q: [sum k_i, V] float, the q each draft was drawn from (draw_drafts' rows, request-major: request 0's
    d_1..d_k, then request 1's, ...); rows of greedy requests are ignored. None: every draft counts as drawn
    deterministically (one-hot q, e.g. the draft head's argmax): still exact, at a lower acceptance rate.

    Greedy rows: accept d_j while it equals the argmax of processed row j-1; the first mismatch commits that
    argmax; all accepted: the bonus is row k's argmax (exactly what plain greedy decoding gives).
    Sampled rows: accept d_j with probability min(1, p(d_j) / q(d_j)), p = row j-1's distribution as `sample`
    draws it, coin keyed by (seed ^ ACCEPT_SALT, position); the first rejection commits a draw from
    norm(max(0, p - q)) with `sample`'s coin at that position; all accepted: the bonus is `sample`'s draw
    at row k (so k = 0 equals `sample` token for token).
    """
    R, V = check_logits(target_logits, batch, "verify_drafts")
    ks = [len(d) for d in drafts]
    n_drafts = sum(ks)
    if n_drafts + len(ks) != R:
        raise ValueError(f"verify_drafts: {len(ks)} requests with {n_drafts} drafts need {n_drafts + len(ks)} "
                         f"rows, the logits have {R}")
    if draft_q is not None and tuple(draft_q.shape) != (n_drafts, V):
        raise ValueError(f"verify_drafts: draft_q must be [{n_drafts}, {V}], got {list(draft_q.shape)}")
    device = target_logits.device

    # Row r checks the draft that sits at its output position, unless it is its request's last row. Request i's
    # d_j (row start_i + j - 1) is draft_q row start_i - i + j - 1 = r - i: one extra row per earlier request.
    next_draft: list[int] = []
    q_index: list[int] = []
    for i, d in enumerate(drafts):
        r = len(next_draft)
        next_draft += [*d, 0]
        q_index += [r + j - i for j in range(len(d))] + [0]
    has_draft_host = [j < k for k in ks for j in range(k + 1)]
    nd = torch.tensor(next_draft, dtype=torch.int64).to(device)
    has_draft = torch.tensor(has_draft_host, dtype=torch.bool).to(device)

    raw = target_logits.to(torch.float32)
    x = process_logits(raw, batch)
    # Greedy rows: the argmax is both the test and the correction / bonus.
    fix = torch.argmax(x, dim=-1)
    accept = fix == nd
    if not batch.all_greedy:
        rows = batch.sample_rows
        xs, d, hd = (x, nd, has_draft) if rows is None else (x[rows], nd[rows], has_draft[rows])
        bonus = draw_filtered(xs, batch)  # `sample`'s draw, same coins
        if n_drafts == 0:
            fix_s, acc_s = bonus, torch.zeros_like(hd)
        else:
            vals, ids = candidates(xs, batch)
            p = torch.softmax(vals, dim=-1)  # over the candidates (the whole vocab when ids is None)
            cand = ids if ids is not None else torch.arange(V, device=device)[None, :]
            is_d = cand == d[:, None]
            p_d = (p * is_d).sum(dim=-1)
            if draft_q is None:
                q, q_d = is_d.to(torch.float32), torch.ones_like(p_d)
            else:
                qi = torch.tensor(q_index, dtype=torch.int64).to(device)
                qi = qi if rows is None else qi[rows]
                dq = draft_q.to(device=device, dtype=torch.float32)
                q = dq[qi] if ids is None else dq[qi[:, None], ids]
                q_d = dq[qi, d]
            coin = random_uniform(batch.seeds ^ ACCEPT_SALT, batch.positions,
                                  torch.zeros(d.shape[0], 1, dtype=torch.int64, device=device)).squeeze(1)
            # u < p / q, multiplied out: q(d) = 0 (the draft can't have drawn d) accepts iff p(d) > 0.
            acc_s = coin * q_d.to(torch.float64) < p_d.to(torch.float64)
            resid = (p - q).clamp_(min=0.0)
            corrected = draw(resid, ids, row_uniform(batch.seeds, batch.positions))  # from norm(max(0, p - q))
            # No residual mass means p == q, where rejection has probability 0; draw from p then, as the bonus.
            fix_s = torch.where(hd & (resid.sum(dim=-1) > 0), corrected, bonus)
        if rows is None:
            fix, accept = fix_s, acc_s
        else:
            fix[rows] = fix_s
            accept[rows] = acc_s
    accept &= has_draft
    # On the accepted path each row commits its draft; the row that stops the walk commits its `fix`.
    committed = torch.where(accept, nd, fix)
    chosen, top_ids, top_lp = token_logprobs(raw, committed, batch)

    acc_host, tok_host = torch.stack([accept.to(torch.int64), committed]).tolist()
    lp_host = chosen.tolist() if chosen is not None else [None] * len(tok_host)
    tid_host = top_ids.tolist() if top_ids is not None else None
    tlp_host = top_lp.tolist() if top_lp is not None else None
    result = VerifyResult(tokens=[], accepted=[], logprobs=[], top=[] if tid_host is not None else None)
    r = 0
    for k in ks:
        a = 0
        while a < k and acc_host[r + a]:
            a += 1
        end = r + a + 1
        result.tokens.append(tok_host[r:end])
        result.accepted.append(a)
        result.logprobs.append(lp_host[r:end])
        if result.top is not None:
            n = batch.top_n[r] if batch.top_n is not None else batch.max_logprobs
            result.top.append([list(zip(tid_host[j][:n], tlp_host[j][:n])) for j in range(r, end)])
        r += k + 1
    return result
