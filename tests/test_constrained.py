"""Grammar-constrained decoding (grammar.py, llguidance): the mask against a per-row reference, the matcher's
vocabulary and EOS rules, the engine (batched with free rows, preemption, the reasoning switch), the HTTP routes
(chat response_format and Responses text.format, streamed and not, batched with unconstrained requests, 400s) and
forced tool calls (the qwen3_coder call grammar against the parser; chat tool_choice required / named, Anthropic
any / tool, Responses required / named, streamed and not, batched with unconstrained requests, bad tool schemas).

The demo model is random, so its free output is noise: every constrained output parsing and validating shows the
constraint at work. The schemas are small and bounded (an enum and a one-digit integer; one-line JSON), so every
constrained output closes well within max_tokens."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import jsonschema
import pytest
import torch

from server_util import ServerProcess, free_port, http, lazy_import, server_config
from tinyserve.grammar import GrammarCompiler, MaskBuffer
from tinyserve.sampling import Constraint, SamplingBatch, SamplingParams, apply_mask, sample, unpack_bitmask
openai = lazy_import("openai")

SCHEMA = {"type": "object",
          "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}
MAX_TOKENS = 64            # the longest SCHEMA output is ~15 demo tokens
SEEDS = range(30)


# ---------------------------------------------------------------------------------------------------------------
# Fixtures

@pytest.fixture(scope="module")
def demo_folder(xdg):
    from tinyserve.demo import ensure_demo_checkpoint
    return ensure_demo_checkpoint()


@pytest.fixture(scope="module")
def tokenizer(demo_folder):
    from tinyserve.tokenizer import Tokenizer
    return Tokenizer.from_folder(demo_folder)


def demo_engine(**engine):
    from tinyserve import config as config_mod
    from tinyserve.build import build_engine
    eng = {"max_running_requests": 8, "page_size": 16, "kv_cache_tokens": 8192, "chunked_prefill_size": 512,
           "compile_steps": False, **engine}
    return build_engine(config_mod.from_dict({"model": {"path": "demo", "device": "cpu",
                                                              "context_length": 1024},
                                                    "engine": eng, "cache": {"enabled": False}}))


@pytest.fixture(scope="module")
def engine(xdg):
    return demo_engine()


def valid(text: str, schema: dict = SCHEMA) -> dict:
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


# ---------------------------------------------------------------------------------------------------------------
# The mask

@pytest.mark.parametrize("B,V,rows", [(1, 5, [0]), (4, 37, [1, 3]), (6, 100, [0, 1, 2, 3, 4, 5]), (3, 64, [2])])
def test_mask_matches_per_row_reference(B, V, rows):
    g = torch.Generator().manual_seed(B * V)
    logits = torch.randn(B, V, generator=g)
    words = (V + 31) // 32
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), words), generator=g, dtype=torch.int64).to(torch.int32)
    allowed = unpack_bitmask(bits, V)
    ref = logits.clone()
    for i, r in enumerate(rows):                      # the reference: one row, one token at a time
        for v in range(V):
            word = int(bits[i, v // 32]) & 0xFFFFFFFF
            assert bool(allowed[i, v]) == bool((word >> (v % 32)) & 1)
            if not (word >> (v % 32)) & 1:
                ref[r, v] = float("-inf")
    out = apply_mask(logits, torch.tensor(rows), allowed)
    assert torch.equal(out, ref)
    assert not torch.equal(logits, out) or bool(allowed.all())      # out of place


def test_sample_picks_only_allowed_tokens():
    B, V = 4, 70
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(0))
    bits = torch.zeros(2, 3, dtype=torch.int32)
    bits[0, 1] = 1 << 5                               # row 1 may only pick token 37
    bits[1, 2] = (1 << 2) | (1 << 3)                  # row 3: tokens 66, 67
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((0.0, 1.0, 0.0, 1.0))]
    free = sample(logits, SamplingBatch.build(params, [[1]] * B, [[]] * B, [1, 2, 3, 4], [0], V))
    for seed in range(20):
        sb = SamplingBatch.build([replace(p, seed=seed) for p in params], [[1]] * B, [[]] * B,
                                 [seed] * B, [0], V, masks=([1, 3], bits))
        tok = sample(logits, sb).tokens.tolist()
        assert tok[1] == 37 and tok[3] in (66, 67)
        assert tok[0] == free.tokens[0] and tok[2] == free.tokens[2]        # free rows untouched


def test_matcher_masks_extra_ids_and_allows_eos_only_when_accepting(tokenizer):
    V = tokenizer.vocab_size + 40                     # the model's vocabulary may be larger than the tokenizer's
    eos = tokenizer.eos_token_ids
    comp = GrammarCompiler(tokenizer, V, eos)
    state = comp.state(Constraint.json_schema(SCHEMA))
    buf = MaskBuffer(state.vocab_size, rows=1)

    def allowed() -> set[int]:
        return set(unpack_bitmask(buf.fill([state]), V)[0].nonzero().flatten().tolist())

    first = allowed()
    assert first and not first & set(eos) and max(first) < tokenizer.vocab_size
    assert all(tokenizer.decode([t]).startswith("{") for t in first)
    for t in tokenizer.encode('{"color": "red", "n": 7'):
        assert state.advance(t)
        assert not allowed() & set(eos) and max(allowed()) < tokenizer.vocab_size
    assert state.advance(tokenizer.encode("}")[0])
    assert allowed() == set(eos)
    assert comp.compile(Constraint.json_schema(SCHEMA)) is comp.compile(Constraint.json_schema(SCHEMA))  # cached


def test_bad_schemas_raise_value_error(tokenizer):
    comp = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    for bad in ({"type": "objectx"}, {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}):
        with pytest.raises(ValueError):
            comp.state(Constraint.json_schema(bad))
    with pytest.raises(ValueError):
        comp.state(Constraint("yaml"))


# ---------------------------------------------------------------------------------------------------------------
# The engine

def test_engine_batched_with_free_rows(engine, tokenizer):
    prompt = tokenizer.encode("Give me a color and a number.")
    c = Constraint.json_schema(SCHEMA)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s, constraint=c if s % 2 else None)
              for s in range(16)]
    reqs = engine.run_requests([prompt] * 16, params)
    alone = engine.run_requests([prompt], [params[1]])[0]
    for s, r in enumerate(reqs):
        if s % 2:
            assert r.finish_reason == "stop"
            valid(tokenizer.decode(r.output_ids))
        else:
            assert r.grammar is None
    assert alone.output_ids == reqs[1].output_ids      # batching with free rows does not change a constrained one
    free = engine.run_requests([prompt] * 4, [replace(p, max_tokens=20) for p in params[0:8:2]])
    assert not any(_parses(tokenizer.decode(r.output_ids)) for r in free)    # free output is noise


def _parses(text: str) -> bool:
    try:
        valid(text)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.mark.slow
def test_engine_preemption_keeps_the_matcher_right(xdg, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "array", "minItems": 12, "maxItems": 12,
                                                     "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
              "required": ["a"], "additionalProperties": False}
    c = Constraint.json_schema(schema)
    prompts = [tokenizer.encode(f"request {i}: " + "a list of digits please " * 8)[:60] for i in range(8)]
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, constraint=c) for i in range(8)]
    reference = demo_engine().run_requests(prompts, params)
    tight = demo_engine(kv_cache_tokens=256)          # 16 pages of 16: two or three requests fit at once
    out = tight.run_requests(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    for r, ref in zip(out, reference):
        assert r.finish_reason == "stop"
        valid(tokenizer.decode(r.output_ids), schema)
        assert r.output_ids == ref.output_ids


def test_engine_constraint_starts_after_think_end(engine, tokenizer, monkeypatch):
    """Reasoning on: free up to the model's </think>, constrained after. The random model is nudged to emit
    </think> as its first token (the mask would forbid it: JSON starts with "{")."""
    think_end = tokenizer.token_to_id("</think>")
    real = engine.model.compute_logits
    calls = {"n": 0}

    def nudged(hidden):
        logits = real(hidden)
        calls["n"] += 1
        if calls["n"] == 1:                           # the step that samples the first token
            logits[:, think_end] += 1e4
        return logits

    monkeypatch.setattr(engine.model, "compute_logits", nudged)
    c = replace(Constraint.json_schema(SCHEMA), start_after=think_end)
    (r,) = engine.run_requests([tokenizer.encode("think first")],
                               [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, constraint=c)])
    assert r.output_ids[0] == think_end and r.finish_reason == "stop"
    valid(tokenizer.decode(r.output_ids[1:]))

    calls["n"] = 0                                    # without start_after the first token is held to the grammar
    (r,) = engine.run_requests([tokenizer.encode("think first")],
                               [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3,
                                               constraint=Constraint.json_schema(SCHEMA))])
    assert r.output_ids[0] != think_end
    valid(tokenizer.decode(r.output_ids))


def test_engine_rejects_bad_constraints(engine, tokenizer):
    from tinyserve.engine import RequestError
    from tinyserve.build import build_engine
    prompt = tokenizer.encode("x")
    for params in (SamplingParams(constraint=Constraint.json_schema({"type": "objectx"})),
                   SamplingParams(constraint=Constraint("json_object"), ignore_eos=True),
                   SamplingParams(constraint=Constraint("json_object"), min_tokens=2)):
        with pytest.raises(RequestError) as e:
            engine.submit(prompt, params)
        assert e.value.field == "response_format"


def test_chat_prompt_opening_think_sets_start_after(tokenizer):
    from tinyserve.chat import ChatFormat
    from tinyserve.openai_api import parse_chat_request
    from tinyserve.tokenizer import Tokenizer
    thinking = Tokenizer(hf=tokenizer.hf, chat_template="{{ messages[0].content }}<think>\n",
                         eos_token_ids=tokenizer.eos_token_ids)
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    for tok, expected in ((thinking, tokenizer.token_to_id("</think>")), (tokenizer, None)):
        req = parse_chat_request(dict(body), "tinyserve")
        ChatFormat().prompt_ids(req, tok)
        assert req.options.params.constraint.start_after == expected
        assert req.options.params.constraint.schema == json.dumps(SCHEMA, sort_keys=True)


# ---------------------------------------------------------------------------------------------------------------
# The HTTP routes

@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("constrained")
    cfg = server_config(free_port(), {"parsers": {"reasoning": "qwen3", "tool_call": "qwen3_coder"},
                                      "engine": {"max_running_requests": 8}})
    proc = ServerProcess(folder, cfg, env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "A color and a number, as JSON."}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}


def chat_json(client, seed: int, stream: bool, response_format=SCHEMA_FORMAT,
              max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
    kw = dict(model="tinyserve", messages=MESSAGES, max_tokens=max_tokens, temperature=1.0, seed=seed)
    if response_format is not None:
        kw["response_format"] = response_format
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_alone(client, stream):
    for seed in SEEDS:
        text, finish = chat_json(client, seed, stream)
        assert finish == "stop", text
        valid(text)


def concurrently(run, jobs: list[tuple]) -> list:
    """[run(*job) for job in jobs], 8 requests in flight at a time (the server runs 8 at once): a seeded request's
    output does not depend on what it is batched with (test_*_batched_with_free_requests checks it), so many seeds
    cost a few batched steps instead of one request's steps after another. The first exception is raised."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda job: run(*job), jobs))


def in_batches_of_8(run, jobs: list[tuple]) -> None:
    """run(*job) for every job, 8 threads at a time: the engine runs each 8 as one batch."""
    for i in range(0, len(jobs), 8):
        threads = [threading.Thread(target=run, args=job) for job in jobs[i:i + 8]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


@pytest.mark.slow
def test_chat_json_schema_batched_with_free_requests(client):
    results: dict[tuple[int, bool, bool], tuple[str, str]] = {}

    def run(seed: int, stream: bool, constrained: bool) -> None:
        results[seed, stream, constrained] = chat_json(client, seed, stream, SCHEMA_FORMAT if constrained else None)

    jobs = [(s, s % 3 == 0, c) for s in SEEDS for c in (True, False)]
    in_batches_of_8(run, jobs)
    assert len(results) == len(jobs)
    for (seed, stream, constrained), (text, finish) in results.items():
        if constrained:
            assert finish == "stop", text
            valid(text)
            assert (text, finish) == chat_json(client, seed, stream)      # the same alone
    assert not any(_parses(t) for (_, _, c), (t, _) in results.items() if not c)


@pytest.mark.slow
def test_chat_json_object(client):
    """Any JSON object: the random model may fill strings for long (no bound), so only the outputs that finished
    must parse; some do."""
    finished = 0
    jobs = [(client, seed, seed % 2 == 1, {"type": "json_object"}, 400) for seed in range(10)]
    for text, finish in concurrently(chat_json, jobs):
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
            finished += 1
        else:
            assert text.startswith("{")
    assert finished >= 3


def test_chat_response_format_text_is_free(client):
    text, _ = chat_json(client, 0, False, {"type": "text"})
    assert not _parses(text)


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
    ({"type": "xml"}, "response_format.type"),
    ("json", "response_format.type"),
])
def test_chat_bad_response_format_is_400(server, fmt, param):
    status, _, body = http("POST", server.base_url + "/v1/chat/completions",
                           {"messages": MESSAGES, "max_tokens": 8, "response_format": fmt})
    assert status == 400, body
    assert json.loads(body)["error"]["param"] == param


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_responses_text_format_json_schema(client, stream):
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}}

    def one() -> str:
        kw = dict(model="tinyserve", input="A color and a number.", max_output_tokens=MAX_TOKENS,
                  temperature=1.0, text=fmt)
        if stream:
            text = ""
            for ev in client.responses.create(stream=True, **kw):
                if ev.type == "response.output_text.delta":
                    text += ev.delta
            return text
        r = client.responses.create(**kw)
        assert r.status == "completed"
        return r.output_text
    for text in concurrently(one, [()] * 10):
        valid(text)


def test_responses_bad_schema_is_400(server):
    status, _, body = http("POST", server.base_url + "/v1/responses",
                           {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                               "schema": {"type": "objectx"}}}})
    assert status == 400, body
    assert json.loads(body)["error"]["param"] == "text.format"


# ---------------------------------------------------------------------------------------------------------------
# Forced tool calls (tool_choice required / named; Anthropic any / tool; Responses required / named)

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7},
                          "metric": {"type": "boolean"}},
           "required": ["city", "days"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name}.", "parameters": schema}}
         for name, schema in TOOL_SCHEMAS.items()]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TOOL_MAX_TOKENS = 160      # the longest forced call is ~60 demo tokens
TOOL_SEEDS = range(20)
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


def test_tool_call_grammar_follows_the_parser(tokenizer):
    from tinyserve.tool_calls import Qwen3CoderToolParser
    comp = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    note = {**WEATHER, "properties": {**WEATHER["properties"], "note": {"type": "string"},
                                      "opts": {"type": "object", "properties": {"a": {"type": "integer"}},
                                               "required": ["a"], "additionalProperties": False}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": note}},
             {"type": "function", "function": {"name": "noop"}}]

    def accepts(text: str, constraint: Constraint) -> bool:
        state = comp.state(constraint)
        return all(state.advance(t) for t in tokenizer.encode(text)) and state.matcher.is_accepting()

    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n7\n"
            "</parameter>\n<parameter=note>\n\nsome\n</par text\n\n</parameter>\n<parameter=opts>\n{\"a\": 5}\n"
            "</parameter>\n</function>\n</tool_call>")
    anyone, named = Constraint.tool_call(tools), Constraint.tool_call(tools, "get_weather")
    assert accepts(call, anyone) and accepts(call, named)
    _, calls = Qwen3CoderToolParser(tools).parse(call)
    args = json.loads(calls[0]["function"]["arguments"])
    assert args == {"city": "Rome", "days": 7, "note": "\nsome\n</par text\n", "opts": {"a": 5}}
    jsonschema.validate(args, note)
    noop = "<tool_call>\n<function=noop>\n</function>\n</tool_call>"
    assert accepts(noop, anyone) and not accepts(noop, named)
    for bad in (call.replace("\n7\n", "\n8\n"),                               # out of range
                call.replace("Rome", "Bern"),                                 # not in the enum
                call.replace("some", "a</function>b"),                        # would end the call early
                call.replace('{"a": 5}', '{"a": 5, "b": 1}'),                 # additionalProperties false
                call.replace("<parameter=city>\nRome\n</parameter>\n", ""),   # a required parameter missing
                call + "\n",                                                  # nothing after the call
                "Sure. " + call):                                             # nor before it
        assert not accepts(bad, anyone), bad
    # what comes after </tool_call>: EOS only
    state = comp.state(named)
    for t in tokenizer.encode(call):
        assert state.advance(t)
    buf = MaskBuffer(state.vocab_size, rows=1)
    allowed = set(unpack_bitmask(buf.fill([state]), tokenizer.vocab_size)[0].nonzero().flatten().tolist())
    assert allowed == set(tokenizer.eos_token_ids)


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": {"a>b": {"type": "string"}}},                      # not a tag name
    {"type": "object", "properties": {"a": {"type": "string", "enum": ["x</parameter>"]}}},
    {"type": "object", "properties": {"a": {"type": "integerx"}}},                        # llguidance rejects it
    {"type": "object", "properties": "nope"},
])
def test_bad_tool_schemas_raise_value_error(tokenizer, parameters):
    comp = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    with pytest.raises(ValueError):
        comp.state(Constraint.tool_call([{"type": "function", "function": {"name": "f", "parameters": parameters}}]))


def test_chat_sets_the_tool_call_constraint(tokenizer):
    from tinyserve.chat import ChatFormat
    from tinyserve.openai_api import parse_chat_request
    from tinyserve.tokenizer import Tokenizer
    thinking = Tokenizer(hf=tokenizer.hf, chat_template="{{ messages[0].content }}<think>\n",
                         eos_token_ids=tokenizer.eos_token_ids)

    def constraint(choice, chat=ChatFormat("qwen3", "qwen3_coder"), tok=tokenizer, **extra):
        req = parse_chat_request({"messages": TOOL_MESSAGES, "tools": TOOLS, "tool_choice": choice, **extra},
                                 "tinyserve")
        chat.prompt_ids(req, tok)
        return req.options.params.constraint

    assert [t["name"] for t in json.loads(constraint("required").schema)] == ["get_weather", "get_time"]
    assert [t["name"] for t in json.loads(constraint(NAMED).schema)] == ["get_weather"]
    assert constraint("required").kind == "tool_call" and constraint("required").start_after is None
    assert constraint(NAMED, tok=thinking).start_after == tokenizer.token_to_id("</think>")
    assert constraint("auto") is None and constraint("none") is None
    assert constraint("required", chat=ChatFormat("qwen3", "")) is None            # no tool parser: nothing forced
    # the call is the answer: it replaces a response_format
    assert constraint("required", response_format=SCHEMA_FORMAT).kind == "tool_call"
    assert constraint("auto", response_format=SCHEMA_FORMAT).kind == "json_schema"


def _check_call(name: str, arguments: Any, allowed: tuple[str, ...]) -> None:
    assert name in allowed, name
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, TOOL_SCHEMAS[name])


def chat_tools(client, seed: int, stream: bool, tool_choice: Any) -> tuple[list[tuple[str, str]], str, str]:
    """(calls [(name, arguments)], content, finish_reason)"""
    kw = dict(model="tinyserve", messages=TOOL_MESSAGES, tools=TOOLS, tool_choice=tool_choice,
              max_tokens=TOOL_MAX_TOKENS, temperature=1.0, seed=seed)
    if not stream:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        return ([(c.function.name, c.function.arguments) for c in msg.tool_calls or []], msg.content or "",
                r.choices[0].finish_reason)
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, ["", ""])
            entry[0] += (tc.function.name or "") if tc.function else ""
            entry[1] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return [(n, a) for n, a in calls.values()], content, finish


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_chat_forced_tool_call(client, stream, choice):
    tool_choice, allowed = ("required", tuple(TOOL_SCHEMAS)) if choice == "required" else (NAMED, ("get_weather",))
    jobs = [(client, seed, stream, tool_choice) for seed in TOOL_SEEDS]
    for calls, content, finish in concurrently(chat_tools, jobs):
        assert finish == "tool_calls" and len(calls) == 1 and not content, (calls, content, finish)
        _check_call(*calls[0], allowed)


@pytest.mark.slow
def test_chat_forced_tool_calls_batched_with_free_requests(client):
    results: dict[tuple[int, bool, Any], tuple] = {}
    choices = ("required", "auto", json.dumps(NAMED))

    def run(seed: int, stream: bool, choice: str) -> None:
        tc = json.loads(choice) if choice.startswith("{") else choice
        results[seed, stream, choice] = chat_tools(client, seed, stream, tc)

    jobs = [(s, s % 2 == 0, c) for s in range(12) for c in choices]
    in_batches_of_8(run, jobs)
    assert len(results) == len(jobs)
    for (seed, stream, choice), (calls, content, finish) in results.items():
        if choice == "auto":                          # unconstrained: the random model writes no call
            assert not calls and finish != "tool_calls", (calls, content)
            continue
        assert finish == "tool_calls" and len(calls) == 1, (calls, content, finish)
        _check_call(*calls[0], tuple(TOOL_SCHEMAS) if choice == "required" else ("get_weather",))
        tc = json.loads(choice) if choice.startswith("{") else choice
        assert chat_tools(client, seed, stream, tc)[:2] == (calls, content)      # the same alone


def test_chat_bad_tool_schema_is_400(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integerx"}}}}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        status, _, body = http("POST", server.base_url + "/v1/chat/completions",
                               {"messages": MESSAGES, "max_tokens": 8, "tools": tools, "tool_choice": choice})
        assert status == 400, body
        assert json.loads(body)["error"]["param"] == "tools"
    status, _, body = http("POST", server.base_url + "/v1/chat/completions",      # auto: nothing compiled
                           {"messages": MESSAGES, "max_tokens": 8, "tools": tools, "tool_choice": "auto"})
    assert status == 200, body


ANTHROPIC_TOOLS = [{"name": name, "description": f"{name}.", "input_schema": schema}
                   for name, schema in TOOL_SCHEMAS.items()]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_forced_tool_use(server, stream):
    import anthropic
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)

    def one(seed: int):
        choice = {"type": "any"} if seed % 2 else {"type": "tool", "name": "get_weather"}
        kw = dict(model="tinyserve", messages=TOOL_MESSAGES, tools=ANTHROPIC_TOOLS, tool_choice=choice,
                  max_tokens=TOOL_MAX_TOKENS, extra_body={"temperature": 1.0})
        if stream:
            with client.messages.stream(**kw) as s:
                return s.get_final_message()
        return client.messages.create(**kw)
    for seed, msg in enumerate(concurrently(one, [(seed,) for seed in range(8)])):
        allowed = tuple(TOOL_SCHEMAS) if seed % 2 else ("get_weather",)
        assert msg.stop_reason == "tool_use", msg
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert len(uses) == 1 and not [b for b in msg.content if b.type == "text" and b.text], msg.content
        _check_call(uses[0].name, uses[0].input, allowed)


RESPONSES_TOOLS = [{"type": "function", "name": name, "description": f"{name}.", "parameters": schema}
                   for name, schema in TOOL_SCHEMAS.items()]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_function_call(client, stream):
    def one(seed: int):
        choice = "required" if seed % 2 else {"type": "function", "name": "get_weather"}
        kw = dict(model="tinyserve", input="Weather in Paris?", tools=RESPONSES_TOOLS, tool_choice=choice,
                  max_output_tokens=TOOL_MAX_TOKENS, temperature=1.0, store=False)
        if not stream:
            return client.responses.create(**kw)
        r = None
        for ev in client.responses.create(stream=True, **kw):
            if ev.type == "response.completed":
                r = ev.response
        return r
    for seed, r in enumerate(concurrently(one, [(seed,) for seed in range(8)])):
        allowed = tuple(TOOL_SCHEMAS) if seed % 2 else ("get_weather",)
        assert r is not None and r.status == "completed", r
        calls = [item for item in r.output if item.type == "function_call"]
        assert len(calls) == 1 and not [item for item in r.output if item.type == "message"], r.output
        _check_call(calls[0].name, calls[0].arguments, allowed)
