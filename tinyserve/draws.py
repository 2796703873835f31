"""Seeded draws: counter-based random numbers and the inverse-CDF draw of a token.

A coin is a hash of (seed, output position, counter), so a request's draw at position p depends only on its own
seed and p: not on the batch it shares, its row, or preemption. No generator state is kept anywhere.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def as_int64(x: int) -> int:
    """Reinterpret an unsigned 64-bit constant as the signed value torch.int64 stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


# splitmix64 constants (Steele, Lea, Flood 2014), as signed int64 so torch accepts them.
_GOLDEN = as_int64(0x9E3779B97F4A7C15)
_MIX1 = as_int64(0xBF58476D1CE4E5B9)
_MIX2 = as_int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic for signed ints)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser: a bijective 64-bit mixer with full avalanche. Integer mul wraps mod 2^64."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def random_uniform(seeds: torch.Tensor, positions: torch.Tensor, tokens: int | torch.Tensor) -> torch.Tensor:
    """U(0, 1) float64: element (r, v) = hash(seeds[r], positions[r], v).

    tokens: a count n (counters 0..n-1, result [S, n]) or an [S, K] tensor of counters (result [S, K]); a
    counter's number is the same either way.

    Per row a key is derived from (seed, position); the vocab axis then walks the splitmix64 sequence from that
    key, so every (seed, position, v) gets its own well-mixed 64-bit word. The top 53 bits give the uniform,
    offset by half a step so it is never exactly 0 or 1.
    """
    key = _mix64(_mix64(seeds + _GOLDEN) ^ (positions * _GOLDEN))  # [S]
    if isinstance(tokens, int):
        offsets = torch.arange(1, tokens + 1, dtype=torch.int64, device=seeds.device)[None, :] * _GOLDEN
    else:
        offsets = (tokens.to(torch.int64) + 1) * _GOLDEN
    bits = _mix64(key[:, None] + offsets)
    return (_shr(bits, 11).to(torch.float64) + 0.5) * (2.0 ** -53)


def row_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One U(0, 1) float64 per row, keyed by (seed, position): the coin of that row's draw."""
    zero = torch.zeros(seeds.shape[0], 1, dtype=torch.int64, device=seeds.device)
    return random_uniform(seeds, positions, zero).squeeze(1)


# Rows longer than 4 blocks draw in two steps: block sums, then a cumsum inside the chosen block. A cumsum over
# 248,320 weights is a sequential scan (~1 ns a token on a CPU); a sum is vectorised.
_DRAW_BLOCK = 512


def draw(weights: torch.Tensor, ids: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn by the inverse CDF at u [S] from its weights (>= 0, unnormalised) over the
    candidates ids [S, K], or over the whole vocabulary when ids is None.

    The walk goes in vocab-id order, so a token's share of [0, 1) does not depend on which zero-weight tokens are
    candidates too: the same u draws the same token from the candidates as from the whole vocabulary with the
    rest at zero (up to rounding in the last bit). A zero-weight token is never drawn. One pass over the row: a
    noise value for each of 248,320 tokens (Gumbel-max) costs ten times as much on a CPU."""
    if ids is not None:
        ids, order = torch.sort(ids, dim=-1)
        weights = weights.gather(1, order)
    S, K = weights.shape
    B = _DRAW_BLOCK
    start = torch.zeros(S, dtype=torch.int64, device=weights.device)
    if K > 4 * B:
        whole = K // B * B
        sums = torch.cat([weights[:, :whole].reshape(S, -1, B).sum(dim=-1), weights[:, whole:].sum(-1, True)], 1)
        cum = sums.to(torch.float64).cumsum(dim=-1)
        target = u.to(torch.float64) * cum[:, -1]
        block = torch.searchsorted(cum, target[:, None]).squeeze(1).clamp_(max=cum.shape[1] - 1)
        target = target - torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        start = block * B
        at = start[:, None] + torch.arange(B, device=weights.device)
        cum = (weights.gather(1, at.clamp(max=K - 1)) * (at < K)).to(torch.float64).cumsum(dim=-1)
    else:
        cum = weights.to(torch.float64).cumsum(dim=-1)
        target = u.to(torch.float64) * cum[:, -1]
    # The first entry that reaches the target, kept inside (0, total] against rounding: cum[i - 1] < target
    # <= cum[i] means token i has weight.
    target = torch.minimum(target.clamp(min=1e-300), cum[:, -1])
    at = start + torch.searchsorted(cum, target[:, None]).squeeze(1)
    return at if ids is None else ids.gather(1, at[:, None]).squeeze(1)
