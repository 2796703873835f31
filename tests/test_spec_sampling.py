"""Tests for the speculative-decoding (NEXTN / MTP) sampling math: draw_drafts and verify_drafts.

Greedy: exact token equality with plain greedy decoding. Sampled: verify with k = 0 equals `sample`, and
draft + verify is lossless in distribution (chi-square over many seeds, with negative controls that show the
test catches a wrong accept rule). No model is needed: target and draft logits are synthetic.
"""

from __future__ import annotations

import dataclasses

import torch
import pytest

from tinyserve.sampling import SamplingBatch, SamplingParams, sample
from tinyserve.verify import ACCEPT_SALT, DRAFT_SALT, VerifyResult, draw_drafts, verify_drafts

V = 32


def rand_logits(B, vocab=V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, vocab, generator=g) * scale


def build(params, prompt=None, output=None, seeds=None, eos=(0,), vocab=V):
    B = len(params)
    prompt = prompt if prompt is not None else [[] for _ in range(B)]
    output = output if output is not None else [[] for _ in range(B)]
    seeds = seeds if seeds is not None else list(range(B))
    return SamplingBatch.build(params, prompt, output, seeds, list(eos), vocab, "cpu")


def verify_batch(params, drafts, outputs=None, prompts=None, seeds=None, eos=(0,), vocab=V):
    """The engine's virtual rows: request i gets k_i + 1 rows, row j with output_ids = outputs_i + drafts_i[:j]."""
    n = len(params)
    outputs = outputs if outputs is not None else [[] for _ in range(n)]
    prompts = prompts if prompts is not None else [[] for _ in range(n)]
    seeds = seeds if seeds is not None else list(range(n))
    rp, rpr, ro, rs = [], [], [], []
    for i, d in enumerate(drafts):
        for j in range(len(d) + 1):
            rp.append(params[i])
            rpr.append(prompts[i])
            ro.append(outputs[i] + d[:j])
            rs.append(seeds[i])
    return SamplingBatch.build(rp, rpr, ro, rs, list(eos), vocab, "cpu")


def peaked(argmaxes, vocab=V, seed=0):
    """Logits rows whose argmax is the given token (random elsewhere, below it)."""
    x = rand_logits(len(argmaxes), vocab, seed, scale=1.0)
    for r, t in enumerate(argmaxes):
        x[r, t] = 10.0
    return x


GREEDY = SamplingParams(temperature=0.0)


# --------------------------------------------------------------------------------------------------------------
# Greedy


def test_salts_differ_from_each_other_and_zero():
    assert len({DRAFT_SALT, ACCEPT_SALT, 0}) == 3


def test_greedy_perfect_match():
    drafts = [[5, 9, 3]]
    res = verify_drafts(peaked([5, 9, 3, 12]), verify_batch([GREEDY], drafts), drafts, None)
    assert isinstance(res, VerifyResult)
    assert res.tokens == [[5, 9, 3, 12]] and res.accepted == [3]


@pytest.mark.parametrize("mismatch", [1, 2, 3])  # 1: the first draft is wrong; 3 (= k): the last one
def test_greedy_mismatch_commits_the_argmax(mismatch):
    target = [5, 9, 3, 12]
    drafts = [target[:3]]
    drafts[0][mismatch - 1] = 7
    res = verify_drafts(peaked(target), verify_batch([GREEDY], drafts), drafts, None)
    assert res.accepted == [mismatch - 1]
    assert res.tokens == [target[:mismatch]]  # the accepted drafts, then the argmax that replaced d_mismatch


def test_greedy_empty_drafts():
    res = verify_drafts(peaked([4]), verify_batch([GREEDY], [[]]), [[]], None)
    assert res.tokens == [[4]] and res.accepted == [0]


def test_greedy_mixed_batch_of_different_k():
    # (target argmaxes per row, drafts) per request; k = 3, 0, 2, 1, 4.
    cases = [([1, 2, 3, 4], [1, 2, 3]),       # all accepted -> bonus 4
             ([8], []),                        # k = 0
             ([6, 7, 9], [6, 1]),              # mismatch at 2
             ([11, 12], [10]),                 # mismatch at 1
             ([2, 4, 6, 8, 10], [2, 4, 6, 9])]  # mismatch at k
    drafts = [d for _, d in cases]
    logits = peaked([t for target, _ in cases for t in target])
    res = verify_drafts(logits, verify_batch([GREEDY] * len(cases), drafts), drafts, None)
    assert res.tokens == [[1, 2, 3, 4], [8], [6, 7], [11], [2, 4, 6, 8]]
    assert res.accepted == [3, 0, 1, 0, 3]


def test_greedy_argmax_is_taken_after_penalties():
    # Token 5 has the largest raw logit but is in the prompt: the repetition penalty makes 6 the argmax.
    logits = torch.zeros(2, V)
    logits[:, 5], logits[:, 6] = 4.0, 3.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    res = verify_drafts(logits, verify_batch(params, [[5]], prompts=[[5]]), [[5]], None)
    assert res.tokens == [[6]] and res.accepted == [0]
    # A presence penalty counts the drafts before the row: after accepting 6, row 1's argmax is 5 again.
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0)]
    res = verify_drafts(logits, verify_batch(params, [[5]], outputs=[[5]]), [[5]], None)
    assert res.tokens == [[6]]
    res = verify_drafts(logits, verify_batch(params, [[6]], outputs=[[5]]), [[6]], None)
    assert res.tokens == [[6, 5]] and res.accepted == [1]


def test_greedy_logit_bias_in_draft_and_verify():
    """logit_bias shapes the draft head's pick and the target's check alike, so a forced token is drafted,
    accepted and committed, and a banned one is never committed."""
    target, draft = peaked([3, 3, 3]), peaked([3])
    forced = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    tokens, q = draw_drafts(draft, build([forced]))
    assert tokens.tolist() == [7] and q is None
    res = verify_drafts(target, verify_batch([forced], [[7, 7]]), [[7, 7]])
    assert res.tokens == [[7, 7, 7]] and res.accepted == [2]
    banned = SamplingParams(temperature=0.0, logit_bias={3: -100.0})
    res = verify_drafts(target, verify_batch([banned], [[3, 3]]), [[3, 3]])
    assert res.accepted == [0] and res.tokens[0][0] != 3


def test_greedy_min_tokens_counts_the_drafts():
    # eos (0) has the top logit; min_tokens = 2: suppressed at output positions 0 and 1, allowed at 2.
    logits = torch.zeros(3, V)
    logits[:, 0], logits[:, 3] = 9.0, 5.0
    params = [SamplingParams(temperature=0.0, min_tokens=2)]
    res = verify_drafts(logits, verify_batch(params, [[3, 3]]), [[3, 3]], None)
    assert res.tokens == [[3, 3, 0]]


class ToyModel:
    """Deterministic 'model': the logits for a context are a table lookup on its last two tokens."""

    def __init__(self, vocab: int, seed: int, base: "ToyModel | None" = None, noise: float = 0.0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, vocab, generator=g) * 2
        if base is not None:  # a drafter: the target's table plus noise, so it is right most of the time
            self.table = base.table + noise * self.table

    def __call__(self, contexts: list[list[int]]) -> torch.Tensor:
        return torch.stack([self.table[c[-2], c[-1]] for c in contexts])


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_spec_decoding_equals_plain_greedy(k):
    vocab, steps = 16, 40
    target = ToyModel(vocab, seed=1)
    drafter = ToyModel(vocab, seed=2, base=target, noise=0.6)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, min_tokens=5,
                             stop_token_ids=[1]),
              SamplingParams(temperature=0.0, frequency_penalty=0.7),
              SamplingParams(temperature=0.0)]
    prompts = [[3, 4], [5, 5, 6], [7, 8]]
    n = len(params)

    plain = [[] for _ in range(n)]
    for _ in range(steps):
        logits = target([p + o for p, o in zip(prompts, plain)])
        for o, t in zip(plain, sample(logits, build(params, prompts, plain, vocab=vocab)).tokens.tolist()):
            o.append(t)

    spec = [[] for _ in range(n)]
    ks = [k, max(k - 1, 0), k + 1]  # a different depth per request
    accepted_total = 0
    while min(len(o) for o in spec) < steps:
        drafts = [[] for _ in range(n)]
        for j in range(max(ks)):
            rows = [i for i in range(n) if j < ks[i]]
            if not rows:
                break
            outs = [spec[i] + drafts[i] for i in rows]
            batch = build([params[i] for i in rows], [prompts[i] for i in rows], outs, vocab=vocab)
            tokens, q = draw_drafts(drafter([prompts[i] + o for i, o in zip(rows, outs)]), batch)
            assert q is None  # all greedy
            for i, t in zip(rows, tokens.tolist()):
                drafts[i].append(t)
        contexts = [prompts[i] + spec[i] + drafts[i][:j] for i in range(n) for j in range(ks[i] + 1)]
        res = verify_drafts(target(contexts), verify_batch(params, drafts, spec, prompts, vocab=vocab), drafts)
        for i in range(n):
            assert len(res.tokens[i]) == res.accepted[i] + 1
            spec[i] += res.tokens[i]
        accepted_total += sum(res.accepted)
    assert [o[:steps] for o in spec] == plain
    assert accepted_total > 0  # the drafter is good enough that the accept path is exercised


# --------------------------------------------------------------------------------------------------------------
# Sampled rows: k = 0 is `sample`, determinism, filters


MIXED = [SamplingParams(temperature=0.8),
         SamplingParams(temperature=0.0),
         SamplingParams(temperature=1.2, top_k=4, presence_penalty=0.5),
         SamplingParams(top_p=0.8, repetition_penalty=1.2),
         SamplingParams(min_p=0.1, frequency_penalty=0.3, min_tokens=3)]


def test_k0_equals_sample_token_for_token():
    n = 200
    params = [dataclasses.replace(MIXED[i % len(MIXED)], logprobs=0) for i in range(n)]   # the chosen logprobs
    outputs = [[(i * 7) % V, (i * 3) % V][: i % 3] for i in range(n)]
    prompts = [[1, 2, 3]] * n
    seeds = [1000 + i for i in range(n)]
    logits = rand_logits(n, seed=11)
    ref = sample(logits, build(params, prompts, outputs, seeds))
    res = verify_drafts(logits, verify_batch(params, [[]] * n, outputs, prompts, seeds), [[]] * n, None)
    assert [t[0] for t in res.tokens] == ref.tokens.tolist()
    assert res.accepted == [0] * n
    assert [lp[0] for lp in res.logprobs] == pytest.approx(ref.logprobs.tolist(), abs=1e-6)
    # All-sampled batch too (no greedy rows, sample_rows is None).
    sp = [SamplingParams(temperature=0.9, top_k=5)] * n
    ref = sample(logits, build(sp, seeds=seeds))
    res = verify_drafts(logits, verify_batch(sp, [[]] * n, seeds=seeds), [[]] * n)
    assert [t[0] for t in res.tokens] == ref.tokens.tolist()
    # no row asks for logprobs: none computed (a logsumexp over the vocabulary per token saved)
    assert ref.logprobs is None and all(lp == [None] for lp in res.logprobs)


def test_draw_drafts_greedy_and_sampled_rows():
    logits = rand_logits(len(MIXED), seed=12)
    batch = build(MIXED, [[1, 2]] * len(MIXED), [[3]] * len(MIXED), seeds=[5] * len(MIXED))
    tokens, q = draw_drafts(logits, batch)
    assert tokens.dtype == torch.int64 and q.dtype == torch.float32 and q.shape == (len(MIXED), V)
    assert tokens[1] == logits[1].argmax()
    for r in (0, 2, 3, 4):
        assert q[r].sum().item() == pytest.approx(1.0, abs=1e-5)
        assert q[r, tokens[r]] > 0  # the draft is in the support of its q
    assert int((q[2] > 0).sum()) == 4  # top-k = 4
    # Not the target's own draw: a different noise stream.
    many = [SamplingParams(temperature=1.0)] * 300
    flat = torch.zeros(300, V)
    b = build(many, seeds=list(range(300)))
    assert (draw_drafts(flat, b)[0] != sample(flat, b).tokens).float().mean() > 0.8
    assert draw_drafts(torch.zeros(2, V), build([GREEDY, GREEDY]))[1] is None


def _top_k_set(row, k):
    return set(torch.topk(row, k).indices.tolist())


@pytest.mark.parametrize("one_hot", [False, True])
def test_no_token_outside_top_k_is_committed(one_hot):
    n, k, topk = 300, 3, 3
    params = [SamplingParams(temperature=1.5, top_k=topk)] * n
    target = rand_logits(n * (k + 1), seed=13)
    draft_logits = rand_logits(n * k, seed=14)  # a different top-k set: many drafts have p(d) = 0
    if one_hot:  # arbitrary drafts, anywhere in the vocab
        g = torch.Generator().manual_seed(15)
        drafts = torch.randint(0, V, (n, k), generator=g).tolist()
        q = None
    else:
        drafts = [[] for _ in range(n)]
        qs = []
        for j in range(k):
            tok, qj = draw_drafts(draft_logits[j::k], build(params, output=drafts))
            for d, t in zip(drafts, tok.tolist()):
                d.append(t)
            qs.append(qj)
        q = torch.stack(qs, 1).reshape(n * k, V)
    res = verify_drafts(target, verify_batch(params, drafts), drafts, q)
    outside = 0
    for i in range(n):
        for j, t in enumerate(res.tokens[i]):
            assert t in _top_k_set(target[i * (k + 1) + j], topk)
        outside += sum(d not in _top_k_set(target[i * (k + 1) + j], topk) for j, d in enumerate(drafts[i]))
    assert outside > 50 and sum(res.accepted) > 0  # both paths were exercised


def _spec_round(params, target, draft, seeds, prior=(), use_q=True):
    """Draft k tokens per request (k = draft rows) and verify them; every request sees the same logits rows."""
    n, k, vocab = len(seeds), draft.shape[0], target.shape[1]
    drafts = [[] for _ in range(n)]
    qs = []
    for j in range(k):
        batch = SamplingBatch.build([params] * n, [[]] * n, [list(prior) + d for d in drafts], seeds, [], vocab)
        tok, q = draw_drafts(draft[j].expand(n, -1), batch)
        for d, t in zip(drafts, tok.tolist()):
            d.append(t)
        qs.append(q)
    q = torch.stack(qs, 1).reshape(n * k, vocab) if use_q else None
    vb = verify_batch([params] * n, drafts, [list(prior)] * n, seeds=seeds, eos=(), vocab=vocab)
    return drafts, verify_drafts(target.repeat(n, 1), vb, drafts, q)


def test_seeded_results_do_not_depend_on_calls_or_batch():
    n = 64
    target, draft = rand_logits(3, seed=16, scale=1.0), rand_logits(2, seed=17, scale=1.0)
    p = SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.3)
    seeds = [7 * i + 1 for i in range(n)]
    d1, r1 = _spec_round(p, target, draft, seeds, prior=(4,))
    d2, r2 = _spec_round(p, target, draft, seeds, prior=(4,))
    assert d1 == d2 and r1 == r2
    assert 0 < sum(r1.accepted) < 2 * n  # some accepted, some rejected

    # Request A alone vs. between other requests (greedy, another k, other seeds), at other rows.
    pa, pb, pc = p, GREEDY, SamplingParams(temperature=0.7, top_k=5)
    a_drafts, a_logits = [[3, 9]], target
    alone = verify_drafts(a_logits, verify_batch([pa], a_drafts, [[4]], seeds=[99]), a_drafts,
                          torch.softmax(draft, -1))
    b_logits, c_logits = rand_logits(2, seed=18), rand_logits(1, seed=19)
    logits = torch.cat([b_logits, a_logits, c_logits])
    q = torch.cat([torch.rand(1, V), torch.softmax(draft, -1)])  # B's q row: anything (B is greedy)
    mixed = verify_drafts(logits, verify_batch([pb, pa, pc], [[1], [3, 9], []], [[2], [4], []], seeds=[5, 99, 6]),
                          [[1], [3, 9], []], q)
    assert mixed.tokens[1] == alone.tokens[0] and mixed.accepted[1] == alone.accepted[0]
    assert mixed.logprobs[1] == pytest.approx(alone.logprobs[0])

    # draw_drafts: a row's draft and q do not depend on the other rows either.
    tok_alone, q_alone = draw_drafts(draft[:1], build([pa], output=[[4]], seeds=[99]))
    tok_mixed, q_mixed = draw_drafts(torch.cat([b_logits[:1], draft[:1]]), build([pc, pa], output=[[], [4]],
                                                                                   seeds=[5, 99]))
    assert tok_mixed[1] == tok_alone[0] and torch.allclose(q_mixed[1], q_alone[0])


# --------------------------------------------------------------------------------------------------------------
# Losslessness in distribution


# chi-square critical values at alpha = 1e-4 by degrees of freedom (the seeds are fixed, so tests are
# deterministic; a correct rule lands far below these, a wrong one far above).
CHI2_CRIT = {1: 15.137, 2: 18.421, 3: 21.108, 4: 23.513, 5: 25.745, 6: 27.856, 7: 29.878}


def _ref_probs(row, params, output):
    """The target distribution written out independently: logit bias, presence penalty, temperature, top-k,
    top-p."""
    x = row.double().clone()
    for t, bias in (params.logit_bias or {}).items():
        x[t] += bias
    for t in set(output):
        x[t] -= params.presence_penalty
    x = x / params.temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if params.top_k > 0:
        keep[:] = False
        keep[torch.topk(x, params.top_k).indices] = True
    probs = torch.where(keep, torch.softmax(x.masked_fill(~keep, float("-inf")), -1), 0.0)
    if params.top_p < 1.0:
        order = torch.argsort(probs, descending=True).tolist()
        mass, kept = 0.0, []
        for t in order:
            if mass > params.top_p:
                break
            kept.append(t)
            mass += probs[t].item()
        mask = torch.zeros_like(keep)
        mask[kept] = True
        probs = torch.where(mask, probs, 0.0)
        probs = probs / probs.sum()
    return probs


def _chi2(tokens: list[int], expected: torch.Tensor) -> tuple[float, int]:
    """(statistic, df) of observed tokens vs expected counts; tokens in zero-expectation bins count as +inf."""
    counts = torch.bincount(torch.tensor(tokens, dtype=torch.int64), minlength=expected.numel()).double()
    support = expected > 0
    if bool((counts[~support] > 0).any()):
        return float("inf"), int(support.sum()) - 1
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    return float(stat), int(support.sum()) - 1


def _expected_second(target_row, params, prior, firsts):
    """Expected counts of the second committed token given each request's first (= accepted d_1)."""
    vocab = target_row.numel()
    per_first = torch.bincount(torch.tensor(firsts, dtype=torch.int64), minlength=vocab).double()
    return sum(per_first[a] * _ref_probs(target_row, params, list(prior) + [a]) for a in range(vocab)
               if per_first[a] > 0)


VOCAB6 = 6
N_SEEDS = 20000


def _targets():
    g = torch.Generator().manual_seed(21)
    target = torch.randn(3, VOCAB6, generator=g) * 1.2
    draft = torch.randn(2, VOCAB6, generator=g) * 1.2  # a different distribution
    return target, draft


@pytest.mark.slow
@pytest.mark.parametrize("params,prior,use_q", [
    (SamplingParams(temperature=1.0), (), True),
    (SamplingParams(temperature=0.7, top_k=3), (), True),
    (SamplingParams(temperature=1.0, top_p=0.85), (), True),
    (SamplingParams(temperature=1.0, presence_penalty=1.5), (2,), True),
    (SamplingParams(temperature=1.0), (), False),  # one-hot draft (q omitted): exact for any draft too
    (SamplingParams(temperature=1.0, top_p=0.9, logit_bias={1: 2.5, 4: -3.0}), (), True),
], ids=["plain", "top_k", "top_p", "presence", "one_hot", "logit_bias"])
def test_lossless_in_distribution(params, prior, use_q):
    target, draft = _targets()
    seeds = list(range(N_SEEDS))
    drafts, res = _spec_round(params, target, draft, seeds, prior, use_q)

    firsts = [t[0] for t in res.tokens]
    stat, df = _chi2(firsts, N_SEEDS * _ref_probs(target[0], params, list(prior)))
    assert stat < CHI2_CRIT[df], (stat, df)

    ok = [i for i in range(N_SEEDS) if res.accepted[i] >= 1]
    assert len(ok) > N_SEEDS // 10
    seconds = [res.tokens[i][1] for i in ok]
    stat, df = _chi2(seconds, _expected_second(target[1], params, prior, [drafts[i][0] for i in ok]))
    assert stat < CHI2_CRIT[df], (stat, df)
    if params.presence_penalty:  # the penalty after d_1 really changes row 1 (else this case tests nothing new)
        assert not torch.allclose(_ref_probs(target[1], params, [2]), _ref_probs(target[1], params, [2, 0]))


def test_distribution_test_catches_wrong_rules():
    params = SamplingParams(temperature=1.0)
    target, draft = _targets()
    seeds = list(range(N_SEEDS))
    drafts, res = _spec_round(params, target, draft, seeds)
    p0 = N_SEEDS * _ref_probs(target[0], params, [])
    correct, df = _chi2([t[0] for t in res.tokens], p0)
    assert correct < CHI2_CRIT[df]

    # Wrong rule 1: always accept (the first token is then distributed as q).
    always = [d[0] for d in drafts]
    # Wrong rule 2: the right coins, but on rejection resample from p instead of norm(max(0, p - q)).
    plain = sample(target[0].expand(N_SEEDS, -1),
                   SamplingBatch.build([params] * N_SEEDS, [[]] * N_SEEDS, [[]] * N_SEEDS, seeds, [], VOCAB6))
    from_p = [drafts[i][0] if res.accepted[i] >= 1 else t for i, t in enumerate(plain.tokens.tolist())]
    for wrong in (always, from_p):
        stat, _ = _chi2(wrong, p0)
        assert stat > 5 * CHI2_CRIT[df], stat


# --------------------------------------------------------------------------------------------------------------
# Logprobs and errors


def test_logprobs_are_raw_log_softmax_of_target_rows():
    params = [SamplingParams(temperature=0.6, top_k=3, presence_penalty=1.5, logprobs=2),
              SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0, repetition_penalty=1.4, logprobs=0)]
    drafts = [[3, 4], [7], [1, 2, 3], []]
    R = sum(len(d) + 1 for d in drafts)
    logits = rand_logits(R, seed=22).to(torch.bfloat16)
    q = torch.softmax(rand_logits(R - len(drafts), seed=23), -1)
    res = verify_drafts(logits, verify_batch(params, drafts, [[5]] * 4, [[1, 2]] * 4), drafts, q)
    logp = torch.log_softmax(logits.float(), -1)
    r = 0
    for i, d in enumerate(drafts):
        n = params[i].logprobs or 0
        assert len(res.tokens[i]) == len(res.logprobs[i]) == len(res.top[i]) == res.accepted[i] + 1
        for j, t in enumerate(res.tokens[i]):
            assert res.logprobs[i][j] == pytest.approx(logp[r + j, t].item(), abs=1e-5)
            top = res.top[i][j]
            assert len(top) == n
            assert [t for t, _ in top] == torch.topk(logp[r + j], n).indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(torch.topk(logp[r + j], n).values.tolist(), abs=1e-5)
        r += len(d) + 1
    res = verify_drafts(logits, verify_batch([SamplingParams()] * 4, drafts), drafts, q)
    assert res.top is None


def test_bad_shapes_are_rejected():
    drafts = [[1, 2]]
    batch = verify_batch([SamplingParams()], drafts)
    with pytest.raises(ValueError, match="rows"):
        verify_drafts(torch.zeros(3, V), batch, [[1]], torch.zeros(1, V))
    with pytest.raises(ValueError, match="draft_q"):
        verify_drafts(torch.zeros(3, V), batch, drafts, torch.zeros(3, V))
    with pytest.raises(ValueError, match="vocab"):
        verify_drafts(torch.zeros(3, V + 1), batch, drafts, None)
