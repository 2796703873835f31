"""The engine end to end on a tiny Qwen3.5 checkpoint (fp32 CPU): batch invariance, preemption, chunked-prefill
boundaries, admission limits, sampling and stopping rules, logprobs against transformers, and the async API
(streaming, cancel, validation, a responsive event loop)."""
from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from checkpoints import make_qwen3_5_text, make_qwen3_next, update_config
from conftest import TEST_DEVICE, engine_for, merge
from tinyserve.engine import Engine, TokenEvent
from tinyserve.loader import load_model
from tinyserve.sampling import SamplingParams

CTX = 512
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder, hf = make_qwen3_5_text(tmp_path_factory.mktemp("q35"), max_position_embeddings=CTX)
    return folder, hf


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt[0], torch.float32, TEST_DEVICE)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """Qwen3-Next: MoE, interleaved GDN projections."""
    folder, _ = make_qwen3_next(tmp_path_factory.mktemp("qnext"), max_position_embeddings=CTX)
    return load_model(folder, torch.float32, TEST_DEVICE)


@pytest.fixture(params=["dense", "moe"])
def any_model(request):
    return request.getfixturevalue("model" if request.param == "dense" else "moe_model")


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(1000 * seed + n)).tolist()


def make_engine(loaded_model, **tables) -> Engine:
    """An engine with these tests' defaults, overridden by TOML tables (engine={...}, cache={...}, model={...})."""
    defaults = {"engine": {"page_size": 16, "kv_cache_tokens": 4096, "max_running_requests": 8,
                           "chunked_prefill_size": 256}}
    return engine_for(loaded_model, **merge(defaults, tables))


def assert_idle_and_no_leaks(eng: Engine) -> None:
    """Nothing running or waiting; once the prefix cache (if any) is emptied every page and state slot is free."""
    s = eng.stats()
    assert s.num_running == 0 and s.num_waiting == 0
    assert eng.flush_cache()
    s = eng.stats()
    assert s.kv_pages_used == 0 and eng.allocator.num_free == eng.allocator.num_pages
    assert s.state_slots_used == 0


async def collect(stream) -> list[TokenEvent]:
    events: list[TokenEvent] = []
    async for evs in stream:
        assert evs, "a stream item carries at least one token"
        events += evs
    return events


def run_streams(eng: Engine, prompts: list[list[int]], params) -> list[tuple[list[TokenEvent], object]]:
    """Submit every prompt through the async API; returns (events, the finished RequestStream) per request."""
    plist = params if isinstance(params, list) else [params] * len(prompts)

    async def main():
        await eng.start()
        try:
            streams = [eng.submit(p, sp) for p, sp in zip(prompts, plist)]
            events = await asyncio.gather(*(collect(s) for s in streams))
            return list(zip(events, streams))
        finally:
            await eng.stop()
    return asyncio.run(main())


# ---------------------------------------------------------------------------------------------------------------
# Scheduling: the batch a request runs in never changes its tokens
# ---------------------------------------------------------------------------------------------------------------
MIXED = [3, 17, 64, 65, 100, 130, 200, 9]


@pytest.mark.parametrize("page_size", [1, 16])
def test_batch_invariance(any_model, page_size):
    model = any_model
    prompts = [prompt(n) for n in MIXED]
    params = SamplingParams(max_tokens=8, **GREEDY)
    alone = [make_engine(model, engine={"page_size": page_size}).generate([p], params)[0] for p in prompts]
    eng = make_engine(model, engine={"page_size": page_size})
    together = eng.generate(prompts, params)
    assert together == alone
    assert all(len(o) == 8 for o in together)
    assert_idle_and_no_leaks(eng)


def generate_bounded(eng: Engine, prompts: list[list[int]], params: SamplingParams, max_steps: int = 3000):
    """Engine.generate with a step cap, so a scheduler that stops making progress fails instead of hanging."""
    reqs = [eng.intake.make_request(p, params) for p in prompts]
    for r in reqs:
        eng.scheduler.add(r)
    for _ in range(max_steps):
        if all(r.finish_reason is not None for r in reqs):
            return [r.output_ids for r in reqs]
        eng._step()
    s = eng.scheduler
    raise AssertionError(f"no progress after {max_steps} steps: running (computed, pages, outputs) "
                         f"{[(r.num_computed, len(r.pages), len(r.output_ids)) for r in s.running]}, "
                         f"{len(s.waiting)} waiting, {eng.allocator.num_free} free pages")


@pytest.mark.slow
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preemption_keeps_outputs_and_frees_everything(any_model, prefix_cache):
    model = any_model
    prompts = [prompt(55 + i, seed=1) for i in range(8)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    reference = make_engine(model, cache={"enabled": False}).generate(prompts, params)
    # 16 pages of 16: at most two of these 95..102-token requests fit at once
    eng = make_engine(model, engine={"kv_cache_tokens": 256, "chunked_prefill_size": 512},
                      cache={"enabled": prefix_cache})
    out = generate_bounded(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert out == reference
    assert_idle_and_no_leaks(eng)


def test_chunked_prefill_sizes_give_identical_output(model):
    prompts = [prompt(n, seed=2) for n in (30, 50, 9)]
    params = SamplingParams(max_tokens=6, **GREEDY)
    outs = [make_engine(model, engine={"chunked_prefill_size": c}).generate(prompts, params) for c in (1, 7, 64)]
    assert outs[0] == outs[1] == outs[2]


def test_one_running_request_at_a_time(model):
    prompts = [prompt(n, seed=3) for n in (20, 5, 40)]
    params = SamplingParams(max_tokens=7, **GREEDY)
    eng = make_engine(model, engine={"max_running_requests": 1})
    out = eng.generate(prompts, params)
    assert out == make_engine(model).generate(prompts, params)
    assert_idle_and_no_leaks(eng)


# ---------------------------------------------------------------------------------------------------------------
# Sampling and stopping through the engine
# ---------------------------------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_across_batches(model):
    p = prompt(25, seed=4)
    sp = lambda seed: SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
    alone = make_engine(model).generate([p], sp(7))[0]
    others = [prompt(n, seed=5) for n in (3, 60, 33)]
    batch = make_engine(model).generate(others[:2] + [p] + others[2:],
                                   [sp(1), SamplingParams(max_tokens=5, **GREEDY), sp(7), sp(2)])
    assert batch[2] == alone
    different = make_engine(model).generate([p] * 3, [sp(8), sp(9), sp(10)])
    assert any(o != alone for o in different)
    assert len({tuple(o) for o in different}) > 1


def test_stop_token_and_max_tokens_finish_reasons(model):
    p = prompt(12, seed=6)
    free = make_engine(model).generate([p], SamplingParams(max_tokens=10, **GREEDY))[0]
    k = next(i for i in range(2, 10) if free[i] not in free[:i])           # first occurrence of some token
    (ev_stop, res_stop), (ev_len, res_len) = run_streams(
        make_engine(model), [p, p], [SamplingParams(max_tokens=10, stop_token_ids=[free[k]], **GREEDY),
                                SamplingParams(max_tokens=4, **GREEDY)])
    assert [e.token_id for e in ev_stop] == free[:k + 1]       # the stop token is emitted, then the request ends
    assert res_stop.finish_reason == "stop" and res_stop.completion_tokens == k + 1
    assert [e.token_id for e in ev_len] == free[:4]
    assert res_len.finish_reason == "length" and res_len.completion_tokens == 4
    assert res_len.prompt_tokens == 12


@pytest.fixture(scope="module")
def eos_model(ckpt, tmp_path_factory, model):
    """The same weights with eos set to a token greedy decoding of EOS_PROMPT emits at output index 3."""
    p = prompt(10, seed=7)
    free = make_engine(model).generate([p], SamplingParams(max_tokens=12, **GREEDY))[0]
    k = next(i for i in range(3, 12) if free[i] not in free[:i])
    folder = tmp_path_factory.mktemp("eos") / "ckpt"
    shutil.copytree(ckpt[0], folder)
    update_config(folder, eos_token_id=free[k])
    m = load_model(folder, torch.float32, "cpu")
    assert m.cfg.eos_token_ids == [free[k]]
    return m, p, free, k


def test_eos_min_tokens_and_ignore_eos(eos_model):
    m, p, free, k = eos_model
    eos = free[k]
    greedy = dict(temperature=0)
    (ev, res), = run_streams(make_engine(m), [p], SamplingParams(max_tokens=12, **greedy))
    assert [e.token_id for e in ev] == free[:k + 1] and res.finish_reason == "stop"

    (ev, res), = run_streams(make_engine(m), [p], SamplingParams(max_tokens=12, ignore_eos=True, **greedy))
    assert [e.token_id for e in ev] == free and res.finish_reason == "length"

    (ev, res), = run_streams(make_engine(m), [p], SamplingParams(max_tokens=12, min_tokens=k + 2, **greedy))
    toks = [e.token_id for e in ev]
    assert len(toks) >= k + 2 and eos not in toks[:k + 1]
    assert toks[:k] == free[:k]                                # unchanged until eos would have been picked
    assert (res.finish_reason == "stop" and toks[-1] == eos) or (res.finish_reason == "length" and len(toks) == 12)


def test_logprobs_match_transformers(model, ckpt):
    hf = ckpt[1]
    p = prompt(15, seed=8)
    (ev0, _), (ev3, _) = run_streams(make_engine(model), [p, p],
                                     [SamplingParams(max_tokens=5, logprobs=0, **GREEDY),
                                                            SamplingParams(max_tokens=5, logprobs=3, **GREEDY)])
    toks = [e.token_id for e in ev0]
    assert toks == [e.token_id for e in ev3]
    with torch.no_grad():
        logits = hf(torch.tensor([p + toks])).logits[0, len(p) - 1:-1]
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, (a, b) in enumerate(zip(ev0, ev3)):
        assert a.top_logprobs is None
        assert abs(a.logprob - ref[i, toks[i]].item()) < 1e-4
        assert abs(b.logprob - ref[i, toks[i]].item()) < 1e-4
        assert len(b.top_logprobs) == 3
        ids = [t for t, _ in b.top_logprobs]
        lps = [lp for _, lp in b.top_logprobs]
        assert ids[0] == toks[i]                               # greedy: the chosen token is the most likely
        assert lps == sorted(lps, reverse=True)
        assert ids == ref[i].topk(3).indices.tolist()
        for t, lp in b.top_logprobs:
            assert abs(lp - ref[i, t].item()) < 1e-4
    (ev, _), = run_streams(make_engine(model), [p], SamplingParams(max_tokens=2, **GREEDY))
    assert all(e.logprob is None and e.top_logprobs is None for e in ev)


# ---------------------------------------------------------------------------------------------------------------
# Async API
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [32, 256])
def test_prompt_logprobs_match_transformers(model, ckpt, chunk):
    """params.prompt_logprobs: every prompt token's logprob and top-n, from the prefill's own rows (chunked or not),
    equal transformers' log_softmax; a prompt whose prefix is cached is still computed whole for them, and a request
    that does not ask gets none."""
    hf = ckpt[1]
    p = prompt(100, seed=4)
    eng = make_engine(model, engine={"chunked_prefill_size": chunk})
    eng.generate([p[:80]], SamplingParams(max_tokens=1, **GREEDY))        # caches most of the prompt
    (events, result), (_, plain) = run_streams(eng, [p, p], [SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY),
                                                            SamplingParams(max_tokens=2, **GREEDY)])
    assert "prompt_logprobs" not in plain.report and result.cached_tokens == 0 and len(events) == 2
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].double(), dim=-1)
    got = result.report["prompt_logprobs"]
    assert len(got) == len(p) - 1                                  # the first prompt token has no logprob
    for q, (lp, top) in enumerate(got):
        assert abs(lp - ref[q, p[q + 1]].item()) < 1e-4
        assert [t for t, _ in top] == ref[q].topk(3).indices.tolist()
        assert all(abs(v - ref[q, t].item()) < 1e-4 for t, v in top)
    assert_idle_and_no_leaks(eng)


def test_logit_bias_forces_and_bans_tokens(model):
    """+100 makes a token the greedy pick and the only sampled one; -100 bans the greedy pick; each row's bias stays
    its own in a mixed batch (one sparse add), and logprobs stay those of the raw model."""
    p = prompt(20, seed=5)
    eng = make_engine(model)
    base = eng.generate([p], SamplingParams(max_tokens=6, **GREEDY))[0]
    forced = SamplingParams(max_tokens=6, logit_bias={77: 100.0}, **GREEDY)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logit_bias={91: 100})
    banned = SamplingParams(max_tokens=6, logit_bias={t: -100 for t in set(base)}, **GREEDY)
    outs = eng.generate([p, p, p, p], [forced, sampled, banned, SamplingParams(max_tokens=6, **GREEDY)])
    assert outs[0] == [77] * 6 and outs[1] == [91] * 6 and outs[3] == base
    assert not set(outs[2]) & set(base)
    (ev, _), = run_streams(make_engine(model), [p], SamplingParams(max_tokens=1, logprobs=1, logit_bias={77: 100},
                                                                  **GREEDY))
    (raw, _), = run_streams(make_engine(model), [p], SamplingParams(max_tokens=1, logprobs=1, **GREEDY))
    assert ev[0].token_id == 77 and ev[0].top_logprobs == raw[0].top_logprobs


def test_async_streams_match_generate(model):
    prompts = [prompt(n, seed=9) for n in (4, 40, 90)]
    params = SamplingParams(max_tokens=9, **GREEDY)
    ref = make_engine(model).generate(prompts, params)
    eng = make_engine(model)
    results = run_streams(eng, prompts, params)
    for (events, res), r in zip(results, ref):
        assert [e.token_id for e in events] == r
        assert res.finish_reason == "length" and res.completion_tokens == 9
    assert_idle_and_no_leaks(eng)


async def wait_until(cond, what: str, tries: int = 2000) -> None:
    """Bounded polling (not a timing assertion): the step thread frees resources at the next step boundary."""
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_cancel_mid_generation_frees_pages_and_slot(model):
    eng = make_engine(model)

    async def main():
        await eng.start()
        try:
            other = eng.submit(prompt(20, seed=10), SamplingParams(max_tokens=6, **GREEDY))
            stream = eng.submit(prompt(30, seed=10), SamplingParams(max_tokens=400, **GREEDY))
            got = []
            async for evs in stream:
                got += evs
                if len(got) >= 3:
                    stream.cancel()
                    stream.cancel()                             # idempotent
            assert stream.finish_reason == "abort"
            assert 3 <= len(got) < 400
            other_events = await collect(other)
            assert len(other_events) == 6 and other.finish_reason == "length"
            await wait_until(lambda: eng.stats().num_running == 0 and eng.stats().num_waiting == 0, "idle")
            await eng.call(assert_idle_and_no_leaks, eng)
        finally:
            await eng.stop()
    asyncio.run(main())


def test_cancel_while_waiting_in_queue(model):
    eng = make_engine(model, engine={"max_running_requests": 1})

    async def main():
        await eng.start()
        try:
            first = eng.submit(prompt(20, seed=11), SamplingParams(max_tokens=30, **GREEDY))
            queued = eng.submit(prompt(25, seed=11), SamplingParams(max_tokens=30, **GREEDY))
            it = first.__aiter__()
            await it.__anext__()                   # one step ran: `queued` waits in the scheduler's queue
            assert eng.stats().num_waiting == 1
            queued.cancel()
            assert await collect(queued) == []
            assert queued.finish_reason == "abort" and queued.completion_tokens == 0
            rest = await collect(first)
            assert first.finish_reason == "length" and len(rest) == 29
            await wait_until(lambda: eng.stats().num_running == 0, "idle")
            await eng.call(assert_idle_and_no_leaks, eng)
        finally:
            await eng.stop()
    asyncio.run(main())


def test_cancel_before_first_step_never_runs(model):
    eng = make_engine(model, engine={"max_running_requests": 1})

    async def main():
        await eng.start()
        try:
            first = eng.submit(prompt(20, seed=12), SamplingParams(max_tokens=8, **GREEDY))
            doomed = eng.submit(prompt(25, seed=12), SamplingParams(max_tokens=8, **GREEDY))
            doomed.cancel()                        # before the step loop has seen either request
            assert await collect(doomed) == []
            assert doomed.finish_reason == "abort"
            assert len(await collect(first)) == 8
            await wait_until(lambda: eng.stats().num_running == 0 and eng.stats().num_waiting == 0, "idle")
            assert doomed._req.output_ids == [], "the cancelled request was computed anyway"
            await eng.call(assert_idle_and_no_leaks, eng)
        finally:
            await eng.stop()
    asyncio.run(main())


def test_submit_validation_errors(model):
    eng = make_engine(model, model={"context_length": 128})
    with pytest.raises(ValueError) as e:
        eng.submit(prompt(100), SamplingParams(max_tokens=40))
    assert "100" in str(e.value) and "40" in str(e.value) and "max_tokens" in str(e.value)
    with pytest.raises(ValueError, match="empty"):
        eng.submit([], SamplingParams())
    for bad in (256, -1, 10_000):
        with pytest.raises(ValueError, match=str(bad)):
            eng.submit([5, bad, 6], SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        eng.submit([5], SamplingParams(max_tokens=-1))
    eng.submit(prompt(100), SamplingParams(max_tokens=28))   # exactly the context: accepted
    assert eng.stats().num_waiting == 1


def test_event_loop_stays_responsive_during_steps(model):
    """A concurrent task keeps running while a long prefill step is in flight (steps run off the loop thread)."""
    eng = make_engine(model, engine={"chunked_prefill_size": 2048})

    async def main():
        await eng.start()
        ticks = 0
        first_token_seen = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not first_token_seen.is_set():
                ticks += 1
                await asyncio.sleep(0)

        try:
            stream = eng.submit(prompt(480, seed=13), SamplingParams(max_tokens=2, **GREEDY))
            task = asyncio.create_task(ticker())
            it = stream.__aiter__()
            await it.__anext__()                   # the whole 480-token prefill is one step
            first_token_seen.set()
            await task
            await collect(stream)
        finally:
            await eng.stop()
        return ticks
    ticks = asyncio.run(main())
    # were the step run on the loop thread, the ticker could only run between steps (a couple of ticks)
    assert ticks > 20, ticks


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the CPU's GEMM routes")
@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bfloat16_on_a_cpu_without_avx512_says_float32_is_faster(ckpt, monkeypatch, caplog, fast_bf16):
    """Where oneDNN has no bfloat16 GEMM (an AVX2-only CPU; monkeypatched here on any CPU), a bfloat16 model starts,
    serves, and says at start that float32 runs faster there."""
    import tinyserve.build as build
    monkeypatch.setattr(build, "ONEDNN_DTYPES", (torch.float32, torch.bfloat16) if fast_bf16 else (torch.float32,))
    bf16 = load_model(ckpt[0], torch.bfloat16, TEST_DEVICE)
    with caplog.at_level("WARNING", logger="tinyserve"):
        eng = make_engine(bf16)
    warned = [r.getMessage() for r in caplog.records if 'model.dtype = "bfloat16"' in r.getMessage()]
    assert bool(warned) == (not fast_bf16), warned
    assert len(eng.generate([prompt(9)], SamplingParams(max_tokens=4, **GREEDY))[0]) == 4
