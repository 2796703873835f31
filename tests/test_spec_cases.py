"""Speculative decoding's known failure cases, from peers' 2026 bug reports, each against a cold, unspeculated,
uncached engine as the oracle (greedy tokens equal):

- a prefill of exactly 1 + k tokens taken for a decode (vLLM #53051): every prompt length 1 .. k + 2, alone and
  batched, cold and from the prefix cache, eager and through the static (CUDA graph) path;
- a step without drafts right after accepted ones reading the wrong state (vLLM #52942, #40738): requests whose
  speculation pauses (the load rises above speculative.max_running) and resumes in the middle of accepted runs;
- a warm second pass over an eval differing from the first (SGLang #16053): 50 prompts twice on one engine;
- acceptance collapsing and staying low (vLLM #36872, #53180): a NEXTN head that disagrees for a while and then
  agrees again gets back to deep drafting, probes back off while it disagrees, and the head's own KV is written
  at every position whoever computed it, so a cached prefix drafts as well as a fresh one;
- grammar-constrained requests with speculation on (vLLM #46249): constrained and speculating requests in one batch.

Checkpoints get a NEXTN head that agrees with the model by construction (checkpoints.make_agreeing_head), as in
test_spec.py; at mix 0 every draft is accepted, at mix 0.3 about two in three.
"""
from __future__ import annotations

import json
import shutil
from typing import Callable

import jsonschema
import pytest
import torch

from checkpoints import make_agreeing_head, make_qwen3_5_text, make_qwen3_next
from conftest import PinnedCost, TEST_DEVICE, assert_no_leaks, engine_for, nextn, static_steps, tokens
from tinyserve.engine import Engine
from tinyserve.loader import load_model
from tinyserve.request import Request, Status
from tinyserve.sampling import Constraint, SamplingParams
from tinyserve.spec import ALPHA_START, PROBE_EVERY, PROBE_EVERY_MAX

K = 3                                                    # speculative.num_steps
FAMILIES = {"qwen3_5": make_qwen3_5_text, "qwen3_next": make_qwen3_next}


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def agreeing_model(folder, family: str = "qwen3_5", **head):
    path, _ = FAMILIES[family](folder, with_mtp=True, max_position_embeddings=2048)
    make_agreeing_head(path, **head)
    return load_model(path, torch.float32, TEST_DEVICE)


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    """Drafts accepted about two times in three."""
    return agreeing_model(tmp_path_factory.mktemp(request.param), request.param, mix=0.3)


@pytest.fixture(scope="module")
def exact_model(tmp_path_factory):
    """Every draft accepted: each verify commits k + 1 tokens."""
    return agreeing_model(tmp_path_factory.mktemp("exact"), mix=0.0)


def spec_engine(model, page_size: int = 16, static: bool = False, engine: dict | None = None,
                cache: dict | None = None, **speculative) -> Engine:
    eng = engine_for(model, engine={"page_size": page_size, "kv_cache_tokens": 4096, **(engine or {})},
                     cache=cache or {}, speculative={"num_steps": K, "max_running": 0, **speculative})
    nextn(eng).step_cost = PinnedCost()                  # the depth follows acceptance alone, not timing
    if static:                                           # the CUDA-graph path, run eagerly (the CPU test switch)
        static_steps(eng)
    return eng


def cold_engine(model, page_size: int = 16) -> Engine:
    return engine_for(model, engine={"page_size": page_size, "kv_cache_tokens": 4096}, cache={"enabled": False})


def oracle(model, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Each request alone on a cold engine without speculation or prefix cache."""
    cold = cold_engine(model)
    return [cold.generate([p], [sp.__class__(**{**sp.__dict__, "speculative": False})])[0]
            for p, sp in zip(prompts, params)]


def drive(eng: Engine, arrivals: list[tuple[int, list[int], SamplingParams]],
          drafts: dict[str, list[tuple[int, ...]]] | None = None,
          before_step: Callable[[int], None] = lambda step: None) -> tuple[list[Request], dict[str, list[int]]]:
    """Run requests offline step by step, each arriving at its step. Returns the requests and, per request, the
    number of drafts each of its steps verified (0: a plain decode). drafts: filled with (outputs so far, *drafts)
    of each request after each step that left it drafts, by request id. before_step(step) runs before each."""
    reqs: list[Request] = []
    drafted: dict[str, list[int]] = {}
    counted: dict[str, int] = {}
    pending, step = sorted(arrivals, key=lambda a: a[0]), 0
    while pending or any(r.status != Status.FINISHED for r in reqs):
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            req = eng.intake.make_request(prompt, params, None)
            eng.scheduler.add(req)
            reqs.append(req)
            drafted[req.request_id] = []
        before_step(step)
        for ev in eng._step():
            if ev.tokens:                      # the drafts this step verified: the growth of the request's count
                total = (ev.report or {}).get("draft_tokens", 0)
                drafted[ev.request_id].append(total - counted.get(ev.request_id, 0))
                counted[ev.request_id] = total
        if drafts is not None:
            for r in reqs:
                made = r.drafts
                if r.status == Status.RUNNING and made is not None and made.tokens:
                    drafts.setdefault(r.request_id, []).append((len(r.output_ids), *made.tokens))
        step += 1
    return reqs, drafted


def accepted_all(eng: Engine) -> bool:
    st = nextn(eng).totals
    return st.num_accepted_tokens == st.num_draft_tokens > 0


# ---------------------------------------------------------------------------------------------------------------
# vLLM #53051: a prefill of 1 + k tokens is a prefill, not a decode (nor a verify)

@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_every_prompt_length_up_to_k_plus_2(model, page_size, static):
    """Prompts of 1 .. k + 2 tokens (so one of exactly 1 + k), alone, then all in one batch, then again (page size 1:
    from the prefix cache); cached prefixes of one and two pages followed by 1 .. k + 2 new tokens (the hit leaves
    exactly those to compute); a long prompt whose prefill comes in chunks of exactly 1 + k tokens: every request
    has the cold, unspeculated tokens."""
    prompts = [tokens(n, 500 + n) for n in range(1, K + 3)]
    params = [greedy(12)] * len(prompts)
    want = oracle(model, prompts, params)
    eng = spec_engine(model, page_size, static)
    for p, w in zip(prompts, want):                      # alone, cold
        assert eng.generate([p], greedy(12)) == [w], len(p)
        assert eng.flush_cache()
    assert eng.generate(prompts, params) == want         # together, cold
    assert eng.generate(prompts, params) == want         # together, again
    bases = [tokens(16, 650), tokens(32, 651)]
    eng.generate(bases, greedy(10))                      # cached: one and two pages, with the state there
    longer = [base + tokens(n, 600 + n) for base in bases for n in range(1, K + 3)]
    reqs = eng.run_requests(longer, [greedy(10)] * len(longer))
    assert [r.output_ids for r in reqs] == oracle(model, longer, [greedy(10)] * len(longer))
    # the whole base (page size 1: up to its last token, where its prompt's state was kept)
    assert all(r.cached_tokens >= len(r.prompt_ids) // 16 * 16 - 1 for r in reqs), [r.cached_tokens for r in reqs]
    chunked = spec_engine(model, page_size, static, engine={"chunked_prefill_size": K + 1})
    long = [tokens(4 * (K + 1) + 2, 700), tokens(K + 1, 701)]
    assert chunked.generate(long, [greedy(10)] * 2) == oracle(model, long, [greedy(10)] * 2)
    assert nextn(eng).totals.num_accepted_tokens > 0
    assert_no_leaks(eng)
    assert_no_leaks(chunked)


# ---------------------------------------------------------------------------------------------------------------
# vLLM #52942, #40738: a step without drafts right after accepted runs

@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_plain_steps_right_after_accepted_runs(exact_model, page_size, static):
    """Speculation only while one request runs (speculative.max_running = 1): A drafts alone with every draft
    accepted; B and C arrive in the middle of its runs, so every request decodes plainly (depth 0) from the next
    step, the state after A's last accepted token its own; they finish and A drafts again. Then the same with a
    stop token and max_tokens ending inside the runs around the pause. Every request has the cold tokens."""
    a = tokens(21, 800)
    arrivals = [(0, a, greedy(60)), (4, tokens(9, 801), greedy(12)), (5, a[:13] + tokens(4, 802), greedy(9)),
                (9, tokens(30, 803), greedy(5, speculative=False))]
    want = oracle(exact_model, [p for _, p, _ in arrivals], [sp for _, _, sp in arrivals])
    eng = spec_engine(exact_model, page_size, static, max_running=1)
    reqs, drafted = drive(eng, arrivals)
    assert [r.output_ids for r in reqs] == want
    steps = drafted[reqs[0].request_id]
    first_pause = steps.index(0, 1)                      # after the prompt's step (no drafts to verify)
    assert all(steps[1:first_pause]) and K in steps[1:first_pause], steps    # accepted runs ...
    resumed = next(i for i in range(first_pause, len(steps)) if steps[i])
    assert resumed > first_pause + 2 and max(steps[resumed:]) == K, steps   # ... a pause, then runs again
    assert accepted_all(eng)
    assert_no_leaks(eng)


def nextn_kv(eng: Engine, ids: list[int]) -> torch.Tensor:
    """The NEXTN layer's K and V [2, tokens, heads, dim] that the prefix cache holds for ids (whole pages)."""
    m = eng.cache.tree.match(ids + [0])
    kv = eng.kv_pool.layer(nextn(eng).kv_layer)[torch.tensor(m.pages, dtype=torch.long)]
    return kv.transpose(0, 1).flatten(1, 2)


# ---------------------------------------------------------------------------------------------------------------
# SGLang #16053: a warm second pass over an eval gives the first pass's tokens

def eval_set(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """50 prompts as an eval sends them: three shared instructions with a question each (some asked twice), and
    bare prompts of 1 .. 60 tokens; greedy, and one in five sampled with a seed."""
    rng = torch.Generator().manual_seed(seed)
    heads = [tokens(n, seed + n) for n in (40, 70, 100)]
    prompts: list[list[int]] = []
    for i in range(50):
        n = int(torch.randint(1, 31, (1,), generator=rng))
        if i % 10 == 9:
            prompts.append(list(prompts[i - 5]))                       # asked twice in one pass
        elif i % 4 == 3:
            prompts.append(tokens(2 * n, seed + 100 + i))              # no shared instruction
        else:
            prompts.append(heads[i % 3] + tokens(n, seed + 100 + i))
    params = [SamplingParams(max_tokens=8 + i % 9, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              if i % 5 == 4 else greedy(8 + i % 9) for i in range(50)]
    return prompts, params


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_warm_second_pass_gives_the_first_passs_tokens(model, page_size):
    """The same 50 requests twice on one engine with NEXTN and the prefix cache (room for most of them): both
    passes give the cold, unspeculated tokens for the greedy requests, with the seeded sampled ones in the same
    batches, and the second pass is served from the cache.

    A sampled request's tokens with speculation depend on how deep it drafted at each step, which depends on the
    pages free at that moment, so a seeded sampled request repeats its tokens only under the same conditions (its
    distribution is the unspeculated one: test_spec.py); greedy tokens never change."""
    prompts, params = eval_set(1200)
    greedy_rows = [i for i, sp in enumerate(params) if sp.temperature == 0]
    cold = cold_engine(model, page_size).generate([prompts[i] for i in greedy_rows],
                                                  [params[i] for i in greedy_rows])
    eng = spec_engine(model, page_size, engine={"kv_cache_tokens": 6000, "chunked_prefill_size": 64},
                      cache={"state_track_interval": 32, "state_slots": 160})
    first = eng.run_requests(prompts, params)
    second = eng.run_requests(prompts, params)
    for run in (first, second):
        assert [run[i].output_ids for i in greedy_rows] == cold
        assert [len(r.output_ids) for r in run] == [sp.max_tokens for sp in params]
    assert sum(r.cached_tokens for r in second) > sum(r.cached_tokens for r in first) > 0
    assert nextn(eng).totals.num_accepted_tokens > 0
    assert_no_leaks(eng)


# ---------------------------------------------------------------------------------------------------------------
# vLLM #46249: grammar-constrained requests next to speculating ones

SCHEMA = {"type": "object",
          "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo_spec(xdg, tmp_path_factory):
    """The demo checkpoint (a real tokenizer, so grammars compile) with an agreeing head, and its tokenizer."""
    from tinyserve.demo import ensure_demo_checkpoint
    from tinyserve.tokenizer import Tokenizer
    folder = tmp_path_factory.mktemp("demo") / "model"
    shutil.copytree(ensure_demo_checkpoint(), folder)
    make_agreeing_head(folder, mix=0.3)
    return load_model(folder, torch.float32, TEST_DEVICE), Tokenizer.from_folder(folder)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_constrained_and_speculating_requests_in_one_batch(demo_spec, page_size, static):
    """JSON-schema requests (sampled, seeded) in the same batches as greedy and sampled speculating requests, twice
    (the second time from the prefix cache): every constrained output is valid JSON of the schema and the tokens it
    has alone without speculation or cache; the greedy ones are the cold tokens; constrained requests never draft
    (their grammar is not applied to drafts), the others do."""
    model, tok = demo_spec
    prompt = tok.encode("Give me a color and a number.")
    c = Constraint.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=64, temperature=1.0, seed=i, constraint=c) if i % 3 == 0 else
              greedy(24) if i % 3 == 1 else SamplingParams(max_tokens=24, temperature=0.7, seed=i, ignore_eos=True)
              for i in range(12)]
    prompts = [prompt if i % 2 else prompt + tok.encode(f" Request {i}.") for i in range(12)]
    checked = [i for i, sp in enumerate(params) if sp.temperature == 0 or sp.constraint is not None]
    cold = engine_for(model, tok, engine={"page_size": page_size, "kv_cache_tokens": 4096}, cache={"enabled": False})
    want = {i: cold.generate([prompts[i]], [params[i]])[0] for i in checked}
    eng = engine_for(model, tok, engine={"page_size": page_size, "kv_cache_tokens": 4096},
                     speculative={"num_steps": K, "max_running": 0})
    nextn(eng).step_cost = PinnedCost()
    if static:
        static_steps(eng)
    for _ in range(2):
        reqs, drafted = drive(eng, [(i // 4, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
        for i in checked:
            assert reqs[i].output_ids == want[i], i
        for i, (r, sp) in enumerate(zip(reqs, params)):
            if sp.constraint is not None:
                assert r.finish_reason == "stop" and not any(drafted[r.request_id]), i
                jsonschema.validate(json.loads(tok.decode(r.output_ids)), SCHEMA)
            else:
                assert any(drafted[r.request_id]), i
    assert sum(r.cached_tokens for r in reqs) > 0 and nextn(eng).totals.num_accepted_tokens > 0
    assert_no_leaks(eng)


@pytest.fixture(scope="module", params=list(FAMILIES))
def attentive_model(request, tmp_path_factory):
    """A head whose own attention layer counts (head_layer): its drafts read its KV at every earlier position."""
    return agreeing_model(tmp_path_factory.mktemp("attentive"), request.param, mix=0.0, head_layer=1.0)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("first", ["paused", "plain"])
def test_a_cached_prefix_drafts_as_if_it_had_speculated(attentive_model, page_size, first):
    """The NEXTN head's own KV exists at every position the model computed, whoever computed it: a prefix cached
    by a request whose speculation paused under load ("paused": B and C arrive while A runs, above
    speculative.max_running = 1) or by a request that never speculates ("plain": speculative = false) gives a later
    speculating request that continues it the drafts it gets where the prefix was computed speculating throughout."""
    a = tokens(37, 900)
    if first == "paused":
        arrivals = [(0, a, greedy(40)), (3, tokens(9, 901), greedy(14)), (3, tokens(5, 902), greedy(14))]
    else:
        arrivals = [(0, a, greedy(40, speculative=False))]

    def continuation(max_running: int, speculative: bool) -> tuple[list[int], list]:
        eng = spec_engine(attentive_model, page_size, max_running=max_running)
        first_run = [(s, p, sp.__class__(**{**sp.__dict__, "speculative": speculative})) for s, p, sp in arrivals]
        (req, *_), _ = drive(eng, first_run)
        kv = nextn_kv(eng, a + req.output_ids)
        drafts: dict[str, list] = {}
        nextn(eng).alpha = ALPHA_START        # where a new request's depth starts follows the engine's rounds so far
        (turn2,), _ = drive(eng, [(0, a + req.output_ids + tokens(6, 903), greedy(30))], drafts)
        assert turn2.cached_tokens >= len(a) + 32 - page_size
        assert_no_leaks(eng)
        return kv, turn2.output_ids, drafts[turn2.request_id]

    kv, out, drafts = continuation(1 if first == "paused" else 0, first == "paused")
    fresh_kv, fresh_out, fresh_drafts = continuation(0, True)
    assert kv.shape == fresh_kv.shape and torch.allclose(kv, fresh_kv, atol=1e-4), (kv - fresh_kv).abs().amax(-1)
    assert out == fresh_out
    assert drafts == fresh_drafts


# ---------------------------------------------------------------------------------------------------------------
# vLLM #36872, #53180: acceptance that collapses must be able to come back, and a head that never agrees costs little

def test_a_probe_is_judged_by_its_own_verify():
    """In the engine a round's verify comes a step after its depth was chosen, so the next depth is chosen before
    the probe's outcome is known: a failed probe still doubles the wait, a good one resets it."""
    from conftest import PinnedCost as Cost
    from tinyserve.spec import DepthControl
    d = DepthControl(K, alpha=0.0)
    depths = [d.next_depth(Cost()) for _ in range(PROBE_EVERY)]
    assert depths[-1] == 1                               # the probe ...
    assert d.next_depth(Cost()) == 0                     # ... the next step's depth, chosen first ...
    d.observe(1, 0)                                      # ... then the probe's verify: rejected
    assert d.probe_every == 2 * PROBE_EVERY
    depths = [d.next_depth(Cost()) for _ in range(2 * PROBE_EVERY - 1)]
    assert depths[-1] == 1 and d.next_depth(Cost()) == 0
    d.observe(1, 1)                                      # accepted: back to the short wait
    assert d.probe_every == PROBE_EVERY and d.alpha > 0


def probe_steps(steps: list[int]) -> list[int]:
    """Indexes of the one-draft rounds among plain steps (the probes of a request whose depth fell to 0)."""
    return [i for i, d in enumerate(steps) if d == 1 and i > 0 and steps[i - 1] == 0]


def test_probes_back_off_while_the_head_disagrees(tmp_path):
    """A random head: the depth falls to 0, and the wait between probes doubles after each failed one; a request
    that comes after starts from the wait the last probe left, not from PROBE_EVERY."""
    folder, _ = make_qwen3_5_text(tmp_path, with_mtp=True, max_position_embeddings=2048)
    model = load_model(folder, torch.float32, TEST_DEVICE)
    eng = spec_engine(model)
    arrivals = [(0, tokens(20, 1000), greedy(8 * PROBE_EVERY)), (10 * PROBE_EVERY, tokens(20, 1001), greedy(80))]
    reqs, drafted = drive(eng, arrivals)
    assert [r.output_ids for r in reqs] == oracle(model, [p for _, p, _ in arrivals], [sp for _, _, sp in arrivals])
    steps = drafted[reqs[0].request_id]
    probes = probe_steps(steps)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 2 and all(b >= 2 * a - 1 for a, b in zip(gaps, gaps[1:])), (steps, gaps)
    assert gaps[-1] >= 2 * PROBE_EVERY and len(probes) <= 4, (steps, gaps)   # not one every PROBE_EVERY steps
    later = drafted[reqs[1].request_id]
    assert len(later) > 2 * PROBE_EVERY and not probe_steps(later[:2 * PROBE_EVERY]), later
    assert_no_leaks(eng)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_depth_recovers_when_the_head_agrees_again(exact_model, static):
    """The exact head drafts deep; its fc is scrambled for a stretch (every draft rejected: the depth falls to 0 and
    probes back off), then restored: the next probe is accepted and the request drafts k deep again. The tokens
    are the cold ones throughout."""
    fc = exact_model.mtp.fc
    good = fc.detach().clone()
    bad = torch.randn(good.shape, generator=torch.Generator().manual_seed(0)) * good.abs().max()
    arrivals = [(0, tokens(25, 1100), greedy(40 + 8 * PROBE_EVERY))]
    want = oracle(exact_model, [arrivals[0][1]], [arrivals[0][2]])
    restore_at = 4 * PROBE_EVERY

    def head(step: int) -> None:
        if step in (4, restore_at):
            with torch.no_grad():
                fc.copy_(bad if step == 4 else good)

    eng = spec_engine(exact_model, static=static)
    try:
        reqs, drafted = drive(eng, arrivals, before_step=head)
    finally:
        with torch.no_grad():
            fc.copy_(good)
    assert [r.output_ids for r in reqs] == want
    steps = drafted[reqs[0].request_id]
    assert steps[1:4].count(K) >= 2, steps                        # deep, while the head agrees
    probes = probe_steps(steps[:restore_at])
    assert 0 in steps[4:restore_at] and probes, steps             # fell to 0, probing
    wait = 2 * (probes[-1] - probes[-2]) if len(probes) > 1 else 2 * PROBE_EVERY    # after the last failed probe
    back = next((i for i in range(restore_at, len(steps)) if steps[i] == K), None)
    assert back is not None and back - probes[-1] <= wait + 6, steps   # the next probe, then a few rounds
    assert steps[back:].count(K) >= 3, steps
    assert_no_leaks(eng)


# ---------------------------------------------------------------------------------------------------------------
# Through the server: constrained and speculating requests at once, and the per-request acceptance histogram

def test_server_constrained_next_to_speculating_and_the_acceptance_histogram(xdg, tmp_path):
    """A server with NEXTN on the demo model (a head that always agrees): JSON-schema chat requests run at the same
    time as speculating completions; the constrained ones validate, the free ones have the text they have without
    speculation. /metrics has one acceptance-length observation per request that verified drafts, in the buckets
    of a head that agrees (1 + the depth tokens a round, at least 2)."""
    import openai
    from concurrent.futures import ThreadPoolExecutor
    from server_util import PinnedCostServer, free_port, http, server_config
    from tinyserve.demo import ensure_demo_checkpoint
    folder = tmp_path / "model"
    shutil.copytree(ensure_demo_checkpoint(), folder)
    make_agreeing_head(folder, mix=0.0)
    cfg = server_config(free_port(), {"model": {"path": str(folder)},
                                      "speculative": {"num_steps": K, "max_running": 0}})
    with PinnedCostServer(tmp_path, cfg) as srv:      # drafts priced as offline: depth by acceptance alone
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}

        def constrained(seed: int) -> str:
            r = client.chat.completions.create(model="tinyserve", messages=[{"role": "user", "content": "pick"}],
                                               max_tokens=64, temperature=1.0, seed=seed, response_format=fmt)
            return r.choices[0].message.content

        def free(prompt: str, speculative: bool = True) -> str:
            r = client.completions.create(model="tinyserve", prompt=prompt, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True, "speculative": speculative})
            return r.choices[0].text

        prompts = ["Once upon a time", "The weather today", "In the beginning"]
        plain = [free(p, speculative=False) for p in prompts]
        with ThreadPoolExecutor(6) as pool:
            texts = [pool.submit(constrained, s) for s in range(3)]
            spec = [pool.submit(free, p) for p in prompts]
            for t in texts:
                jsonschema.validate(json.loads(t.result()), SCHEMA)
            assert [s.result() for s in spec] == plain
        _, _, body = http("GET", srv.base_url + "/metrics")
        metrics = body.decode()

        def value(name: str) -> float:
            import re
            m = re.search(rf"^tinyserve:{name} (\S+)$", metrics, re.M)
            assert m, metrics
            return float(m.group(1))
        # every draft accepted; drafts priced as offline, so the depth grows to k: k + 1 tokens a round but the
        # first and last rounds
        assert value("spec_decode_num_accepted_tokens_total") == value("spec_decode_num_draft_tokens_total") > 0
        assert value("spec_decode_request_accept_length_count") == len(prompts)   # plain and constrained: none
        assert 'tinyserve:spec_decode_request_accept_length_bucket{le="1.75"} 0.0' in metrics
        assert value("spec_decode_request_accept_length_sum") / len(prompts) > 3.0
