"""Top-k, top-p and min-p: which tokens a sampled row may draw, and the draw from them (sampling.py's last step,
and the verify step's draws). No full-vocabulary sort anywhere: a sort of 248,320 logits (Qwen3.5's vocabulary)
costs as much on a CPU as a small model's forward."""
from __future__ import annotations

import itertools
import math
from typing import Protocol

import torch

from tinyserve.draws import draw, random_uniform, row_uniform


class SamplingBatch(Protocol):
    """What these filters read of sampling.SamplingBatch: per row, as [B] tensors."""
    temperature: torch.Tensor | None
    top_k: torch.Tensor | None           # int64, the vocabulary size where off
    top_p: torch.Tensor | None           # float32, 1.0 where off
    min_p: torch.Tensor | None           # float32, 0.0 where off
    seeds: torch.Tensor | None           # int64: the coins' seeds (draws.py)
    positions: torch.Tensor | None       # int64: the index of this draw in the row's output


def top_n(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, n, dim=-1) (values sorted, descending) for n much smaller than a long last dim. The n blocks
    of the row with the largest maxima hold its n largest values (fewer than n values lie above the n-th largest, so
    fewer than n blocks have a larger max, and any tie for it is kept), so the row is read once for its block maxima
    and only those n blocks (and the short tail) are searched: for 8 rows of 248,320 logits, 6x faster than
    torch.topk for n = 5, 2.8x for n = 20 (2-core EPYC)."""
    B, V = x.shape
    L = max(16, min(1024, V // (8 * max(n, 1))))          # block length: n blocks are at most ~1/8 of the row
    nb = V // L
    if n < 1 or nb < 2 * n or not x.is_contiguous():
        return torch.topk(x, n, dim=-1)
    blocks = x[:, :nb * L].view(B, nb, L)
    chosen = torch.topk(blocks.amax(dim=-1), n, dim=-1).indices                      # [B, n]
    cand = blocks.gather(1, chosen[..., None].expand(B, n, L)).reshape(B, n * L)
    cand_ids = (chosen[..., None] * L + torch.arange(L, device=x.device)).reshape(B, n * L)
    if nb * L < V:                                                                    # the tail, always searched
        cand = torch.cat([cand, x[:, nb * L:]], dim=1)
        cand_ids = torch.cat([cand_ids, torch.arange(nb * L, V, device=x.device).expand(B, -1)], dim=1)
    vals, at = torch.topk(cand, n, dim=-1)
    return vals, cand_ids.gather(1, at)


# Above 4x this vocab size top-p first tries the top _TOP_P_PROBE tokens, then the mass histogram (_top_p_keep).
_TOP_P_PROBE = 256
# The mass histogram: buckets of equal width in log-probability below the row's best token, down to the row's
# worst token or _TOP_P_SPAN nats (the last bucket takes everything deeper); only the tokens of the bucket where the
# mass crosses top_p are sorted.
_TOP_P_BUCKETS = 4096
_TOP_P_SPAN = 32.0


def _scaled(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """x / temperature per row; a pass over [S, V] saved when every row has temperature 1, and a multiply where
    one is needed (a division costs three times as much on a CPU)."""
    if bool((batch.temperature == 1.0).all()):
        return x
    return x * (1.0 / batch.temperature)[:, None]


def candidates(x: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, top-k, top-p, min-p for the sampled rows ([S, V] logits after penalties).

    Returns (values, ids): ids is None when values cover the whole vocab ([S, V]); otherwise values / ids are
    [S, K] candidates sorted descending, and every token outside them is excluded. Removed entries are -inf.
    Order as in SGLang: top-k, top-p on the renormalised top-k set, then min-p relative to the top token.
    No full-vocabulary sort: a sort of [8, 4096] costs milliseconds on a CPU, and one of 248,320 logits (Qwen3.5's
    vocabulary) as much as a small model's forward. Every row with a top-k: the top kmax tokens. Top-p on a large
    vocabulary: the top _TOP_P_PROBE tokens when they hold the mass, else the exact selection of _top_p_keep.
    """
    x = _scaled(x, batch)
    neg_inf = float("-inf")
    V = x.shape[1]
    vals, ids = x, None
    if batch.top_k is not None or batch.top_p is not None:
        kmax = int(batch.top_k.max()) if batch.top_k is not None else V
        full_probs = None                   # the probe's probabilities over the whole vocabulary
        if kmax < V:
            # Every row has a top-k: nothing beyond rank kmax can survive.
            vals, ids = top_n(x, kmax)
        elif batch.top_p is not None and V > 4 * _TOP_P_PROBE:
            # Probe the top K tokens. Rows with top_k <= K have their whole top-k set inside. Rows without top-k
            # whose top K already hold more than top_p of the mass: every later token has more than top_p ahead
            # of it, so top-p removes it. Any other row: the whole vocabulary, without a sort.
            full_probs = torch.softmax(x, dim=-1)
            unlimited = batch.top_k >= V if batch.top_k is not None else None
            # K tokens hold at most K times the best one's mass: when that is short of top_p, skip the probe.
            may_fit = full_probs.amax(dim=-1) * _TOP_P_PROBE > batch.top_p
            short_k = batch.top_k <= _TOP_P_PROBE if unlimited is not None else None
            if not bool((may_fit if short_k is None else may_fit | short_k).all()):
                return _min_p(_whole_vocab_top_k_top_p(x, batch, full_probs), batch), None
            vals, ids = top_n(x, _TOP_P_PROBE)
            whole, full_probs = full_probs, full_probs.gather(1, ids)
            mass = full_probs.sum(dim=-1)
            ok = mass > batch.top_p if short_k is None else short_k | (unlimited & (mass > batch.top_p))
            if not bool(ok.all()):
                return _min_p(_whole_vocab_top_k_top_p(x, batch, whole), batch), None
        else:
            vals, ids = torch.sort(x, dim=-1, descending=True)
        if batch.top_k is not None:
            kth = vals.gather(1, (batch.top_k.clamp(max=vals.shape[1]) - 1)[:, None])
            vals = vals.masked_fill(vals < kth, neg_inf)  # ties with the k-th value are kept
        if batch.top_p is not None:
            # The candidates hold each row's whole (top-k) distribution, but for the probe's rows without a top-k,
            # whose mass is normalised over the whole vocabulary.
            probs = torch.softmax(vals, dim=-1)
            if full_probs is not None:
                probs = full_probs if batch.top_k is None else torch.where(unlimited[:, None], full_probs, probs)
            ahead = torch.cumsum(probs, dim=-1) - probs  # mass strictly ahead of each token
            # Keep a token while the mass ahead of it is at most top_p; the first token always stays.
            remove = ahead > batch.top_p[:, None]
            remove[:, 0] = False
            vals = vals.masked_fill(remove, neg_inf)
    return _min_p(vals, batch), ids


def draw_filtered(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each sampled row's token, drawn from the distribution `candidates` keeps of x ([S, V] logits after
    penalties) with the row's coins of (seed, position)."""
    if batch.top_p is not None and batch.top_k is None and x.shape[1] > 4 * _TOP_P_PROBE:
        return _draw_top_p(_scaled(x, batch), batch)
    vals, ids = candidates(x, batch)
    return draw(torch.softmax(vals, dim=-1), ids, row_uniform(batch.seeds, batch.positions))


def _draw_top_p(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-p (and min-p) draws over whole-vocabulary rows x [S, V], temperature applied, without a sort or a
    mask of the top-p set (the rejection scheme of FlashInfer's top-p sampling).

    A token is in the top-p set when the tokens more likely than it hold at most top_p of the mass. Each round
    draws from the tokens still allowed; a token outside the set is rejected, and so is every token as likely
    as it or less (more mass lies ahead of them), so the next round allows only the more likely ones. The allowed
    tokens always hold the whole set, so the accepted draw follows the top-p distribution exactly (tokens tied with
    the last one kept are all kept, where a sort would keep some). A flat row (a random model keeps most of
    248,320 tokens) accepts in the first round with probability ~top_p: four passes over the row, where building
    the set costs a dozen."""
    S = x.shape[0]
    probs = torch.softmax(x, dim=-1)
    tokens = draw(probs, None, row_uniform(batch.seeds, batch.positions)) if batch.min_p is None else None
    top_p = batch.top_p.tolist()
    min_p = batch.min_p.tolist() if batch.min_p is not None else [0.0] * S
    out = []
    for i in range(S):
        p = probs[i]
        # allowed: p > floor; min-p keeps p >= min_p x the best token's probability
        floor = math.nextafter(float(p.max()) * min_p[i], -math.inf) if min_p[i] > 0 else -1.0
        t = tokens[i] if tokens is not None else None
        for r in itertools.count():
            if t is None:
                u = random_uniform(batch.seeds[i:i + 1], batch.positions[i:i + 1],
                                   torch.full((1, 1), r, dtype=torch.int64, device=x.device))
                t = draw(torch.nn.functional.threshold(p, floor, 0.0)[None], None, u[:, 0])[0]
            pt = float(p[t])
            if top_p[i] >= 1.0 or float(torch.nn.functional.threshold(p, pt, 0.0).sum()) <= top_p[i]:
                break
            floor, t = pt, None
        out.append(t)
    return torch.stack(out)


def _min_p(vals: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.min_p is None:
        return vals
    # p_v < min_p * p_max  <=>  x_v < x_max + log(min_p)   (log 0 = -inf keeps everything)
    limit = vals.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)[:, None]
    return vals.masked_fill(vals < limit, float("-inf"))


def _whole_vocab_top_k_top_p(x: torch.Tensor, batch: SamplingBatch, probs: torch.Tensor | None) -> torch.Tensor:
    """Top-k (where a row has one), then top-p, over whole-vocabulary rows x [S, V]: x with -inf where removed.
    probs: softmax(x) when the caller has it."""
    V, neg_inf = x.shape[1], float("-inf")
    if batch.top_k is not None:
        limited = batch.top_k < V
        if bool(limited.any()):
            kmax = int(batch.top_k[limited].max())
            kth = top_n(x, kmax)[0].gather(1, (batch.top_k.clamp(max=kmax) - 1)[:, None])
            x = x.masked_fill((x < kth) & limited[:, None], neg_inf)    # ties with the k-th value are kept
            probs = None
    return x.masked_fill(~_top_p_keep(x, batch.top_p, probs), neg_inf)


def _top_p_keep(x: torch.Tensor, top_p: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
    """Exact top-p over whole rows x [S, V] without sorting them: bool [S, V], True where the probability mass
    of the tokens ahead of a token (in descending order) is at most top_p, as a full sort and cumsum keep them.

    The mass goes into _TOP_P_BUCKETS buckets by each token's log-probability below the row's best (one
    scatter_add). Every token of a bucket whose cumulative mass, its own included, is at most top_p is kept;
    every token of a bucket after the one where the cumulative mass crosses top_p is removed (more than top_p
    lies ahead of it); only the tokens of that crossing bucket are sorted: a few hundred of 248,320."""
    S, V = x.shape
    if probs is None:
        probs = torch.softmax(x, dim=-1)
    best = x.amax(dim=-1, keepdim=True)
    # Buckets span the row's depth (best - worst), at most _TOP_P_SPAN nats: a flat row spreads over all of them.
    span = (best - x.amin(dim=-1, keepdim=True)).clamp_(min=1e-6, max=_TOP_P_SPAN)
    depth = (best - x).mul_(_TOP_P_BUCKETS / span)                          # +inf where x = -inf
    bucket = depth.clamp_(max=_TOP_P_BUCKETS - 1).to(torch.int64)
    mass = torch.zeros(S, _TOP_P_BUCKETS, dtype=probs.dtype, device=x.device).scatter_add_(1, bucket, probs)
    cum = mass.cumsum(dim=-1)
    crossing = (cum <= top_p[:, None]).sum(dim=-1).clamp_(max=_TOP_P_BUCKETS - 1)
    before = torch.where(crossing > 0, cum.gather(1, (crossing - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    keep = bucket < crossing[:, None]
    off = top_p >= 1.0
    if bool(off.any()):
        keep |= off[:, None]                                                # rows without top-p keep all
    # The crossing bucket's tokens, packed per row into [S, n] (-inf ones have no mass: never kept).
    rows, cols = (bucket == crossing[:, None]).nonzero(as_tuple=True)
    counts = torch.bincount(rows, minlength=S)
    slot = torch.arange(rows.shape[0], device=x.device) - (torch.cumsum(counts, 0) - counts)[rows]
    n = max(int(counts.max()), 1) if rows.numel() else 1
    packed = torch.full((S, n), float("-inf"), device=x.device).index_put_((rows, slot), x[rows, cols])
    ids = torch.zeros(S, n, dtype=torch.int64, device=x.device).index_put_((rows, slot), cols)
    top, order = torch.sort(packed, dim=-1, descending=True)
    ids = ids.gather(1, order)
    p = probs.gather(1, ids) * (top > float("-inf"))                        # padding: no mass
    ahead = before[:, None] + torch.cumsum(p, dim=-1) - p
    kept = (ahead <= top_p[:, None]) & (p > 0)
    keep[torch.arange(S, device=x.device)[:, None].expand_as(ids)[kept], ids[kept]] = True
    return keep
