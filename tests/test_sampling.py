"""Tests for tinyserve.sampling: greedy, seeded reproducibility, distribution, filters, penalties, logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tinyserve.draws import draw, random_uniform
from tinyserve.sampling import SamplingBatch, SamplingParams, apply_penalties, filter_logits, sample, top_n

V = 32


def build(params, prompt=None, output=None, seeds=None, eos=(0,), vocab=V):
    B = len(params)
    prompt = prompt if prompt is not None else [[] for _ in range(B)]
    output = output if output is not None else [[] for _ in range(B)]
    seeds = seeds if seeds is not None else list(range(B))
    return SamplingBatch.build(params, prompt, output, seeds, list(eos), vocab, "cpu")


def rand_logits(B, vocab=V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, vocab, generator=g) * 3


# --------------------------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = rand_logits(5).to(dtype)
    params = [SamplingParams(temperature=0.0) for _ in range(5)]
    batch = build(params)
    assert batch.all_greedy and batch.output_flat is None and batch.seen_flat is None
    assert batch.temperature is None and batch.seeds is None
    res = sample(logits, batch)
    assert res.tokens.dtype == torch.int64
    assert torch.equal(res.tokens, logits.float().argmax(-1))


@pytest.mark.parametrize("change", [{}, {"temperature": 0.5}, {"logprobs": 0}, {"logit_bias": {3: -5.0}},
                                    {"min_tokens": 2}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                                    {"repetition_penalty": 3.0}])
def test_plain_greedy_is_the_raw_argmax(change):
    """SamplingParams.plain_greedy (the runner takes the argmax without the sampler) holds exactly when the
    sampler would give the raw logits' argmax with no logprobs: anything that moves a logit, draws, or asks for
    logprobs takes a greedy request out of it."""
    p = dataclasses.replace(SamplingParams(temperature=0.0, max_tokens=4), **change)
    assert p.plain_greedy == (not change)
    logits = rand_logits(4).abs()
    logits[:, 3] = logits.max(-1).values + 0.5           # each row's argmax, by less than what moves it below
    res = sample(logits, build([p] * 4, prompt=[[3]] * 4, output=[[3]] * 4, eos=(3,)))
    if p.plain_greedy:
        assert torch.equal(res.tokens, logits.argmax(-1)) and res.logprobs is None
    elif "temperature" not in change:                    # the others move token 3's logit or add logprobs
        assert not torch.equal(res.tokens, logits.argmax(-1)) or res.logprobs is not None


def test_mixed_batch_greedy_rows_are_argmax():
    logits = rand_logits(6)
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.0) for r in range(6)]
    res = sample(logits, build(params))
    assert torch.equal(res.tokens[1::2], logits[1::2].argmax(-1))


def test_logits_are_not_modified():
    logits = rand_logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, presence_penalty=1.0,
                             frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=2)] * 3
    sample(logits, build(params, prompt=[[1, 2]] * 3, output=[[3]] * 3))
    assert torch.equal(logits, before)


def test_empty_batch():
    res = sample(torch.zeros(0, V), build([]))
    assert res.tokens.shape == (0,) and res.logprobs is None


# --------------------------------------------------------------------------------------------------------------
# Counter-based randomness


def _splitmix_ref(z: int) -> int:
    m = (1 << 64) - 1
    z &= m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_uniform_matches_python_reference():
    # Guards the int64 wrap-around / logical-shift emulation against an exact big-int implementation.
    m = (1 << 64) - 1
    golden = 0x9E3779B97F4A7C15
    seeds = [0, 7, (1 << 63) + 11, m]
    positions = [0, 3, 1000, 5]
    seeds_t = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds])
    u = random_uniform(seeds_t, torch.tensor(positions), 6)
    for r, (s, p) in enumerate(zip(seeds, positions)):
        key = _splitmix_ref(_splitmix_ref(s + golden) ^ ((p * golden) & m))
        for v in range(6):
            bits = _splitmix_ref(key + (v + 1) * golden)
            assert u[r, v].item() == ((bits >> 11) + 0.5) * 2.0 ** -53


def test_uniform_on_token_subset_equals_full_vocab():
    seeds, pos = torch.tensor([3, 99]), torch.tensor([0, 17])
    full = random_uniform(seeds, pos, V)
    ids = torch.tensor([[5, 0, 31], [2, 2, 30]])
    assert torch.equal(random_uniform(seeds, pos, ids), full.gather(1, ids))
    assert bool((full > 0).all() and (full < 1).all())


def test_same_seed_same_tokens_across_batch_compositions():
    logits_a = rand_logits(1, seed=1)[0]
    logits_b = rand_logits(1, seed=2)[0]
    p_a = SamplingParams(temperature=1.0)
    p_b = SamplingParams(temperature=0.9, top_p=0.95)
    p_g = SamplingParams(temperature=0.0)
    for pos in range(20):
        out_a = [[1] * pos]
        alone = sample(logits_a[None], build([p_a], output=out_a, seeds=[1234])).tokens[0]
        # Different companions, order, row index, greedy neighbours, other positions.
        mixed = sample(torch.stack([logits_b, logits_a, logits_b]),
                       build([p_b, p_a, p_g], output=[[2] * 7, out_a[0], []], seeds=[5, 1234, 9])).tokens[1]
        reordered = sample(torch.stack([logits_a, logits_b]),
                           build([p_a, p_b], output=[out_a[0], [3]], seeds=[1234, 1234])).tokens[0]
        assert alone == mixed == reordered


def test_draw_depends_only_on_seed_and_position():
    # Re-running the same position (e.g. after preemption and recompute) gives the same token.
    logits = torch.zeros(1, V)  # uniform: the token is decided by the noise alone
    p = SamplingParams(temperature=1.0)
    first = [sample(logits, build([p], output=[[4] * k], seeds=[77])).tokens.item() for k in range(30)]
    again = [sample(logits, build([p], output=[[9] * k], seeds=[77])).tokens.item() for k in range(30)]
    assert first == again
    assert len(set(first)) > 10  # positions give fresh draws


def test_different_seeds_differ():
    logits = torch.zeros(200, V)
    params = [SamplingParams(temperature=1.0)] * 200
    a = sample(logits, build(params, seeds=[1] * 200, output=[[0] * k for k in range(200)])).tokens
    b = sample(logits, build(params, seeds=[2] * 200, output=[[0] * k for k in range(200)])).tokens
    assert (a != b).float().mean() > 0.8  # chance agreement is 1/32


def test_large_and_negative_seeds_are_accepted():
    logits = torch.zeros(3, V)
    res = sample(logits, build([SamplingParams()] * 3, seeds=[-1, 2 ** 64 - 1, 2 ** 70 + 5]))
    # -1 and 2**64 - 1 are the same 64 bits.
    assert res.tokens[0] == res.tokens[1]


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * n
    return float(((counts - expected) ** 2 / expected).sum())


def test_distribution_across_seeds_matches_softmax():
    n, T = 4000, 0.8
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    logits = row.expand(n, -1)
    res = sample(logits, SamplingBatch.build([SamplingParams(temperature=T)] * n, [[]] * n, [[]] * n,
                                             list(range(n)), [], 8, "cpu"))
    # df = 7: chi2 > 30 has p ~ 1e-4; the seeds are fixed, so the result is deterministic.
    assert _chi_square(res.tokens, torch.softmax(row / T, -1)) < 30


def test_distribution_across_positions_matches_softmax():
    n, T = 1500, 1.3
    row = torch.tensor([0.2, -1.0, 1.0, 0.0, 0.7, -0.3])
    logits = row.expand(n, -1)
    out = [[0] * k for k in range(n)]
    res = sample(logits, SamplingBatch.build([SamplingParams(temperature=T)] * n, [[]] * n, out, [42] * n,
                                             [], 6, "cpu"))
    assert _chi_square(res.tokens, torch.softmax(row / T, -1)) < 30  # df = 5


def test_distribution_with_top_k_matches_renormalised_softmax():
    n = 3000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    res = sample(row.expand(n, -1), SamplingBatch.build([SamplingParams(top_k=4)] * n, [[]] * n, [[]] * n,
                                                        list(range(n)), [], 8, "cpu"))
    keep = torch.tensor([0, 1, 4, 7])  # the four largest logits
    probs = torch.zeros(8)
    probs[keep] = torch.softmax(row[keep], -1)
    assert set(res.tokens.tolist()) <= set(keep.tolist())
    counts = torch.bincount(res.tokens, minlength=8).double()[keep]
    expected = probs[keep].double() * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 25  # df = 3


# --------------------------------------------------------------------------------------------------------------
# top-k / top-p / min-p


def _many_draws(row: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    vocab = row.numel()
    batch = SamplingBatch.build([params] * n, [[]] * n, [[]] * n, list(range(n)), [], vocab, "cpu")
    return set(sample(row.expand(n, -1), batch).tokens.tolist())


def test_top_k_never_picks_excluded():
    row = rand_logits(1, seed=3)[0]
    allowed = set(torch.topk(row, 5).indices.tolist())
    drawn = _many_draws(row, SamplingParams(temperature=2.0, top_k=5))
    assert drawn <= allowed and len(drawn) > 1
    kept = filter_logits(row[None], build([SamplingParams(temperature=2.0, top_k=5)]))[0]
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == allowed


def _reference_top_p(row: torch.Tensor, top_p: float) -> set[int]:
    probs = torch.softmax(row.double(), -1)
    order = torch.argsort(probs, descending=True).tolist()
    kept, mass = [], 0.0
    for t in order:
        if mass > top_p:
            break
        kept.append(t)
        mass += probs[t].item()
    return set(kept)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.75, 0.95])
def test_top_p_never_picks_excluded(top_p):
    row = rand_logits(1, seed=4)[0]
    allowed = _reference_top_p(row, top_p)
    assert _many_draws(row, SamplingParams(top_p=top_p)) <= allowed
    kept = filter_logits(row[None], build([SamplingParams(top_p=top_p)]))[0]
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == allowed


def test_top_p_keeps_at_least_one_token():
    row = torch.tensor([10.0] + [0.0] * (V - 1))
    assert _many_draws(row, SamplingParams(top_p=1e-6), n=50) == {0}


@pytest.mark.parametrize("peaked", [True, False])
def test_top_p_large_vocab_matches_reference(peaked):
    # Large vocab: a peaked row takes the top-K shortcut, a flat one falls back to a full sort.
    vocab = 2048
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(2, vocab, generator=g) * (8.0 if peaked else 0.5)
    params = [SamplingParams(top_p=0.9, temperature=1.0), SamplingParams(top_p=0.6, temperature=0.5)]
    batch = SamplingBatch.build(params, [[]] * 2, [[]] * 2, [0, 1], [], vocab, "cpu")
    kept = filter_logits(rows, batch)
    for r, p in enumerate(params):
        expected = _reference_top_p(rows[r] / p.temperature, p.top_p)
        assert set(torch.isfinite(kept[r]).nonzero().flatten().tolist()) == expected
    tokens = sample(rows, batch).tokens
    assert all(torch.isfinite(kept[r, tokens[r]]) for r in range(2))


@pytest.mark.parametrize("scale", [0.02, 1.0, 4.0])
def test_top_p_on_qwens_vocabulary_keeps_what_a_full_sort_keeps(scale):
    # 248,320 logits: near-flat rows (what a random model gives), spread ones, peaked ones; one row with
    # suppressed tokens, one without top-p in the same batch.
    vocab = 248_320
    rows = torch.randn(3, vocab, generator=torch.Generator().manual_seed(11)) * scale
    rows[1, ::7] = float("-inf")
    params = [SamplingParams(top_p=0.95), SamplingParams(top_p=0.5, temperature=0.7), SamplingParams()]
    kept = torch.isfinite(filter_logits(rows, SamplingBatch.build(params, [[]] * 3, [[]] * 3, [0, 1, 2], [],
                                                                    vocab, "cpu")))
    assert torch.equal(kept[2], torch.isfinite(rows[2]))
    for r, p in enumerate(params[:2]):
        x = rows[r] / p.temperature
        order = torch.argsort(x, descending=True)
        probs = torch.softmax(x, -1)[order].double()          # float32 probabilities, as sampling has them
        ahead = torch.cumsum(probs, 0) - probs
        n = int((ahead <= p.top_p).sum())                      # a full sort keeps the first n
        k = int(kept[r].sum())
        assert x[kept[r]].min() >= x[~kept[r]].max()          # the kept ones are the best k
        # exactly n, but for tokens whose mass ahead is within float32 rounding of top_p
        differ = ahead[min(k, n):max(k, n)]
        assert bool(((differ - p.top_p).abs() < 1e-5).all()), (k, n)


@pytest.mark.parametrize("top_p, min_p", [(0.9, 0.0), (0.3, 0.0), (0.9, 0.2)])
def test_top_p_draws_on_a_large_vocabulary_follow_the_kept_distribution(top_p, min_p):
    # A large vocabulary without top-k draws by rejection (no top-p set is built): 8 likely tokens, a long flat
    # tail; top_p 0.3 rejects most first draws, so later rounds are exercised too.
    vocab, n = 4096, 3000
    row = torch.full((vocab,), -9.0)
    row[torch.arange(8) * 500] = torch.tensor([2.0, 1.8, 1.5, 1.2, 1.0, 0.8, 0.5, 0.2])
    params = SamplingParams(top_p=top_p, min_p=min_p)
    batch = SamplingBatch.build([params] * n, [[]] * n, [[]] * n, list(range(n)), [], vocab, "cpu")
    kept = filter_logits(row[None], SamplingBatch.build([params], [[]], [[]], [0], [], vocab, "cpu"))[0]
    allowed = torch.isfinite(kept).nonzero().flatten()
    assert 1 < len(allowed) <= 8
    tokens = sample(row.expand(n, -1), batch).tokens
    assert set(tokens.tolist()) <= set(allowed.tolist())
    counts = torch.bincount(tokens, minlength=vocab)[allowed].double()
    expected = torch.softmax(kept[allowed], -1).double() * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 30       # df <= 7: p ~ 1e-4


def test_draw_is_the_inverse_cdf_in_vocabulary_order():
    g = torch.Generator().manual_seed(3)
    perms = torch.stack([torch.randperm(1000, generator=g) for _ in range(3)])
    w = torch.zeros(3, 1000).scatter_(1, perms[:, :300], torch.rand(3, 300, generator=g) + 0.01)
    u = torch.tensor([1e-12, 0.5, 1.0 - 1e-12], dtype=torch.float64)
    tokens = draw(w, None, u)
    assert bool((w.gather(1, tokens[:, None]) > 0).all())                 # never a zero-weight token
    cdf = torch.cumsum(w.double(), 1)
    assert torch.equal(tokens, (cdf < u[:, None] * cdf[:, -1:]).sum(1))
    # From candidates in any order (the 300 positive tokens and 100 zero-weight ones): the same draw.
    cand = perms[:, :400][:, torch.randperm(400, generator=g)]
    assert torch.equal(draw(w.gather(1, cand), cand, u), tokens)


@pytest.mark.parametrize("top_k", [0, 100, 300])
def test_top_p_large_vocab_tail_mass_counts(top_k):
    # The top 256 tokens hold 0.95 of the mass; top-p must still normalise over the whole vocab (or the
    # top-k set): 0.6 on token 0, 0.35 over tokens 1..255 (slowly decreasing), 0.05 over the 1792 others.
    vocab = 2048
    probs = torch.empty(vocab, dtype=torch.float64)
    probs[0] = 0.6
    body = 1.0 - torch.arange(1, 256, dtype=torch.float64) * 1e-4
    probs[1:256] = 0.35 * body / body.sum()
    tail = 1.0 - torch.arange(256, vocab, dtype=torch.float64) * 1e-6
    probs[256:] = 0.05 * tail / tail.sum()
    row = torch.log(probs).float()
    params = SamplingParams(top_p=0.9, top_k=top_k)
    kept = filter_logits(row[None], SamplingBatch.build([params], [[]], [[]], [0], [], vocab, "cpu"))[0]
    ref_row = row.clone()
    if top_k:
        ref_row[torch.topk(row, vocab - top_k, largest=False).indices] = float("-inf")
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == _reference_top_p(ref_row, 0.9)


def test_top_k_then_top_p_on_renormalised_set():
    row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    # top_k=2 renormalises to (4/7, 3/7); top_p=0.5: the second token has 4/7 > 0.5 ahead of it -> dropped.
    kept = filter_logits(row[None], SamplingBatch.build([SamplingParams(top_k=2, top_p=0.5)], [[]], [[]], [0],
                                                       [], 4, "cpu"))[0]
    assert torch.isfinite(kept).tolist() == [True, False, False, False]


def test_min_p_never_picks_excluded():
    row = rand_logits(1, seed=6)[0]
    probs = torch.softmax(row, -1)
    allowed = set((probs >= 0.1 * probs.max()).nonzero().flatten().tolist())
    assert _many_draws(row, SamplingParams(min_p=0.1)) <= allowed
    kept = filter_logits(row[None], build([SamplingParams(min_p=0.1)]))[0]
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == allowed


def test_temperature_scales_logits():
    row = rand_logits(1, seed=7)
    out = filter_logits(row, build([SamplingParams(temperature=0.5)]))
    assert torch.allclose(out, row / 0.5)


# --------------------------------------------------------------------------------------------------------------
# Penalties and min_tokens


def test_penalties_follow_the_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0],
                           [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0),
              SamplingParams()]  # a row without penalties in a penalised batch is untouched
    prompt = [[0, 3], [0]]
    output = [[1, 1, 2, 2, 2, 0], [1, 1]]
    batch = SamplingBatch.build(params, prompt, output, [0, 1], [], 6, "cpu")
    assert batch.has_penalties
    got = apply_penalties(logits, batch)

    expected = logits.clone()
    rp, fp, pp = 2.0, 0.25, 0.5
    for t in {0, 3} | set(output[0]):  # repetition: prompt + output tokens
        x = expected[0, t]
        expected[0, t] = x / rp if x > 0 else x * rp
    for t in set(output[0]):
        expected[0, t] -= fp * output[0].count(t) + pp
    assert torch.allclose(got, expected)
    assert torch.equal(got[1], logits[1])
    # Values by hand for row 0: token 0: 2/2 - 0.25 - 0.5; token 1: -1*2 - 0.5 - 0.5; token 3: -3*2 (prompt only)
    assert got[0].tolist() == pytest.approx([0.25, -3.0, 0.25 - 0.75 - 0.5, -6.0, 1.0, 0.0])


def test_penalties_steer_sampling():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0)]
    batch = SamplingBatch.build(params, [[]], [[0]], [0], [], 4, "cpu")
    assert sample(logits, batch).tokens.item() == 1


def test_no_penalty_tensors_without_penalties():
    batch = build([SamplingParams(temperature=0.5)] * 3, prompt=[[1, 2]] * 3, output=[[3]] * 3)
    assert not batch.has_penalties
    assert batch.output_flat is None and batch.seen_flat is None


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.zeros(4, V)
    logits[:, 0] = 100.0  # eos
    logits[:, 7] = 90.0   # stop id
    logits[:, 3] = 80.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]),  # already has 3 tokens
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7], ignore_eos=True),
              SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[7])]
    output = [[5], [5, 5, 5], [], [5, 5]]
    res = sample(logits, build(params, output=output, eos=[0, 31]))
    assert res.tokens.tolist() == [3, 0, 0, 3]


def test_min_tokens_sampled_rows_never_pick_suppressed():
    logits = torch.zeros(300, V)
    params = [SamplingParams(min_tokens=1, stop_token_ids=[1, 2])] * 300
    tokens = sample(logits, build(params, eos=[0])).tokens
    assert not set(tokens.tolist()) & {0, 1, 2}


# --------------------------------------------------------------------------------------------------------------
# Logprobs


def test_logprobs_are_raw_log_softmax():
    logits = rand_logits(4).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.6, top_k=3, presence_penalty=1.5, repetition_penalty=1.4, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=0)]
    res = sample(logits, build(params, prompt=[[1, 2]] * 4, output=[[3, 4]] * 4))
    logp = torch.log_softmax(logits.float(), -1)
    assert res.logprobs.dtype == torch.float32
    assert torch.allclose(res.logprobs, logp.gather(1, res.tokens[:, None]).squeeze(1), atol=1e-5)
    assert res.top_ids.shape == (4, 5) and res.top_logprobs.shape == (4, 5)
    assert bool((res.top_logprobs[:, :-1] >= res.top_logprobs[:, 1:]).all())
    assert torch.allclose(res.top_logprobs, logp.gather(1, res.top_ids))
    assert torch.equal(res.top_ids, torch.topk(logp, 5).indices)


def test_logprobs_without_top_n():
    logits = rand_logits(2)
    res = sample(logits, build([SamplingParams(logprobs=0), SamplingParams()]))
    assert res.top_ids is None and res.top_logprobs is None
    assert torch.allclose(res.logprobs, torch.log_softmax(logits, -1).gather(1, res.tokens[:, None]).squeeze(1))


# --------------------------------------------------------------------------------------------------------------
# Validation and build errors


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("max_tokens", 0), ("max_tokens", 1.5),
    ("min_tokens", -1), ("min_tokens", 17),
    ("logprobs", -1), ("logprobs", 21),
    ("seed", 1.5), ("seed", "x"),
    ("stop_token_ids", [-1]), ("stop_token_ids", "abc"),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"3": 1.0}), ("logit_bias", {3: 100.5}), ("logit_bias", {3: "x"}),
    ("logit_bias", [3]), ("prompt_logprobs", -1), ("prompt_logprobs", 21),
])
def test_validate_names_the_field(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_validate_accepts_edges():
    for p in [SamplingParams(), SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0),
              SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.1, seed=-5),
              SamplingParams(max_tokens=1, min_tokens=1, logprobs=20), SamplingParams(logprobs=0)]:
        p.validate()


def test_logit_bias_is_one_sparse_add_before_every_filter():
    """Each row gets exactly its own biases (the oracle: a dense [B, V] bias added to the logits), greedy and sampled
    rows alike, and the batch holds only the (row, id) pairs that are set, whatever its size."""
    logits = rand_logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
              SamplingParams(temperature=0.9, top_k=4, seed=1, logit_bias={7: 3.0, 2: -100.0}),
              SamplingParams(temperature=0.0, logit_bias={int(logits[3].argmax()): -100}),
              SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=1.0, logit_bias={9: 100})]
    params = [dataclasses.replace(p, logprobs=0) for p in params]       # the chosen tokens' logprobs too
    batch = build(params)
    assert batch.bias_rows.tolist() == [1, 2, 2, 3, 5] and batch.bias_values.numel() == 5
    dense = torch.zeros(6, V)
    for r, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            dense[r, t] = b
    plain = [SamplingParams(**{**vars(p), "logit_bias": None}) for p in params]
    expected = sample(logits + dense, build(plain))
    res = sample(logits, batch)
    assert torch.equal(res.tokens, expected.tokens)
    assert res.tokens[1] == 5 and res.tokens[5] == 9 and res.tokens[3] != logits[3].argmax()
    assert torch.allclose(res.logprobs, torch.log_softmax(logits, -1).gather(1, res.tokens[:, None]).squeeze(1))
    assert build([SamplingParams()] * 4).bias_rows is None
    with pytest.raises(ValueError, match="logit_bias"):
        build([SamplingParams(logit_bias={V: 1.0})])


def test_build_rejects_bad_inputs():
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatch.build([SamplingParams()], [[]], [[]], [], [], V, "cpu")
    with pytest.raises(ValueError, match="output_ids"):
        build([SamplingParams(presence_penalty=1.0)], output=[[V]])
    with pytest.raises(ValueError, match="vocab"):
        sample(torch.zeros(1, V + 1), build([SamplingParams()]))


def test_all_greedy_build_is_cheap_in_structure():
    # The all-greedy, no-penalty batch carries no per-row tensors at all.
    batch = SamplingBatch.build([SamplingParams(temperature=0.0, logprobs=0)] * 8, [[1] * 50] * 8, [[2] * 10] * 8,
                                list(range(8)), [0], 4096, "cpu")
    tensors = [name for name, value in vars(batch).items() if isinstance(value, torch.Tensor)]
    assert tensors == []
    logits = torch.randn(8, 4096)
    res = sample(logits, batch)
    assert torch.equal(res.tokens, logits.argmax(-1))
    assert torch.allclose(res.logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_top_p_full_vocab_without_sort_matches_reference(scale):
    # Qwen3.5's vocabulary size, rows whose top 256 tokens hold too little mass: the exact selection by mass
    # buckets (no full sort), rows with and without a top-k in one batch, checked against a float64 sort.
    vocab = 248_320
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(3, vocab, generator=g) * scale
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, temperature=0.7),
              SamplingParams(top_p=0.8, top_k=vocab // 2)]
    batch = SamplingBatch.build(params, [[]] * 3, [[]] * 3, [0, 1, 2], [], vocab, "cpu")
    kept = filter_logits(rows, batch)
    for r, p in enumerate(params):
        ref_row = rows[r] / p.temperature
        if p.top_k > 0:
            ref_row = ref_row.masked_fill(ref_row < torch.topk(ref_row, p.top_k).values[-1], float("-inf"))
        got = set(torch.isfinite(kept[r]).nonzero().flatten().tolist())
        probs = torch.softmax(ref_row.double(), -1)
        ordered, order = torch.sort(probs, descending=True)
        ahead = dict(zip(order.tolist(), (torch.cumsum(ordered, 0) - ordered).tolist()))
        want = {t for t, a in ahead.items() if a <= p.top_p}
        # equal but for tokens whose mass ahead is top_p to fp32's rounding of a sum over ~10^4 probabilities
        assert all(abs(ahead[t] - p.top_p) < 1e-4 for t in got ^ want), sorted(ahead[t] for t in got ^ want)
        assert len(got ^ want) <= 4


@pytest.mark.parametrize("V", [248320, 248321, 4096, 1000])
@pytest.mark.parametrize("values", ["normal", "ties", "minus_inf"])
def test_top_n_equals_torch_topk(V, values):
    """The block search returns torch.topk's values exactly (ties and -inf included, a row that is not a whole
    number of blocks, rows too short for blocks), with ids that point at them, each once."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(3, V, generator=g) if values == "normal" else torch.randint(0, 7, (3, V), generator=g).float()
    if values == "minus_inf":
        x[:, ::3] = float("-inf")
    for n in (0, 1, 5, 20, 256):
        expected, _ = torch.topk(x, n, dim=-1)
        vals, ids = top_n(x, n)
        assert torch.equal(vals, expected), n
        assert torch.equal(x.gather(1, ids), vals), n
        assert all(len(set(row)) == n for row in ids.tolist()), n
