"""The OpenAI routes against the checks the peers' own API test suites make, run against a real `tinyserve` process
(demo model, no parsers) with the real `openai` client.

Cases are transcribed from vLLM's tests/entrypoints/openai (completion/test_completion.py, chat_completion/
test_chat.py, chat_completion/test_chat_logit_bias_validation.py, chat_completion/test_chat_echo.py,
basic/test_return_token_ids.py; vllm-project/vllm) and llama.cpp's tools/server/tests/unit (test_chat_completion.py,
test_completion.py; ggml-org/llama.cpp), each test naming its source. The demo model's weights are random, so output
quality is left aside (the peers' regexes on generated text); every structural check is kept. Where tinyserve
answers differently on purpose, the test checks tinyserve's answer and docs/api.md says why.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from server_util import ServerProcess, free_port, http, lazy_import, server_config
openai = lazy_import("openai")

CONTEXT = 1024
SYSTEM = {"role": "system", "content": "you are a helpful assistant"}
QUESTION = [SYSTEM, {"role": "user", "content": "what is 1+1?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("openai-api")
    proc = ServerProcess(folder, server_config(free_port(), {"model": {"context_length": CONTEXT}}),
                         env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(xdg):
    from tinyserve.demo import ensure_demo_checkpoint
    from tinyserve.tokenizer import Tokenizer
    return Tokenizer.from_folder(ensure_demo_checkpoint())


def post(server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, _, raw = http("POST", server.base_url + path, body)
    return status, json.loads(raw)


def close(a: list[float | None], b: list[float | None], tol: float = 1e-4) -> bool:
    """Logprob lists equal up to float32 noise (a batch or a chunk boundary changes the last bits)."""
    return len(a) == len(b) and all((x is None) == (y is None) and (x is None or abs(x - y) < tol)
                                    for x, y in zip(a, b))


def extra(obj: Any, name: str) -> Any:
    """A field the openai client does not know (vLLM's extensions), or None."""
    return (obj.model_extra or {}).get(name)


def error_of(server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = post(server, path, body)
    assert status == 400, answer
    return answer["error"]


# ---------------------------------------------------------------------------------------------------------------
# Completions (vLLM completion/test_completion.py)

def test_single_completion(client):
    c = client.completions.create(model="tinyserve", prompt="Hello, my name is", max_tokens=5, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    assert c.id is not None and len(c.choices) == 1
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 5 and c.usage.total_tokens == c.usage.prompt_tokens + 5
    assert c.usage.prompt_tokens_details is not None
    c = client.completions.create(model="tinyserve", prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0)
    assert c.choices[0].text is not None


@pytest.mark.parametrize("logprobs,sizes", [(None, None), (0, (1, 1)), (5, (5, 6))])
def test_completion_logprobs_counts(client, logprobs, sizes):
    """test_no_logprobs / test_zero_logprobs / test_some_logprobs: the chosen token and the top-n."""
    c = client.completions.create(model="tinyserve", prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                                  logprobs=logprobs)
    lp = c.choices[0].logprobs
    if sizes is None:
        assert lp is None
        return
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert sizes[0] <= len(lp.top_logprobs[0]) <= sizes[1]
    assert "".join(lp.tokens) == c.choices[0].text                   # vLLM's test_some_logprobs
    streamed = client.completions.create(model="tinyserve", prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0.0,
                                         logprobs=logprobs, stream=True)
    assert "".join(t for chunk in streamed if chunk.choices[0].logprobs
                   for t in chunk.choices[0].logprobs.tokens) == c.choices[0].text


def test_too_many_completion_logprobs(client):
    """OpenAI's completions take logprobs up to 5 (vLLM allows 20: its test asks 21 and 30)."""
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tinyserve", prompt=[0, 0, 0, 0, 0], max_tokens=5, logprobs=6)
    with pytest.raises(openai.BadRequestError):
        for _ in client.completions.create(model="tinyserve", prompt=[0, 0, 0, 0, 0], max_tokens=5, logprobs=30,
                                           stream=True):
            pass
    assert client.completions.create(model="tinyserve", prompt=[0, 0, 0, 0, 0], max_tokens=5).choices[0].text \
        is not None


def test_completion_streaming(client):
    """The streamed text joins into the blocking call's; finish_reason once, on the last chunk (tinyserve sends
    it on a chunk of its own, text ""; vLLM's last chunk also carries the last token's text)."""
    kw = dict(model="tinyserve", prompt="What is an LLM?", max_tokens=5, temperature=0.0,
              extra_body={"ignore_eos": True})
    single = client.completions.create(**kw).choices[0].text
    chunks, finished = [], 0
    for chunk in client.completions.create(stream=True, **kw):
        chunks.append(chunk.choices[0].text)
        finished += chunk.choices[0].finish_reason is not None
    assert finished == 1 and chunk.choices[0].finish_reason == "length"
    assert "".join(chunks) == single


def test_parallel_sampling(client):
    """test_parallel_no_streaming / test_parallel_streaming: n choices, in index order, each finished once."""
    kw = dict(model="tinyserve", prompt="What is an LLM?", max_tokens=20, n=3, temperature=1.0, seed=42)
    c = client.completions.create(logprobs=0, **kw)
    assert [ch.index for ch in c.choices] == [0, 1, 2] and all(ch.finish_reason for ch in c.choices)
    assert len({ch.text for ch in c.choices}) == 3
    texts, finished = defaultdict(str), 0
    for chunk in client.completions.create(stream=True, **kw):
        texts[chunk.choices[0].index] += chunk.choices[0].text
        finished += chunk.choices[0].finish_reason is not None
    assert finished == 3 and sorted(texts) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [ch.text for ch in c.choices]      # the same seeds give the same draws


def test_completion_stream_options(client):
    kw = dict(model="tinyserve", prompt="What is the capital of France?", max_tokens=5, temperature=0.0,
              extra_body={"ignore_eos": True})
    assert all(c.usage is None for c in client.completions.create(
        stream=True, stream_options={"include_usage": False, "continuous_usage_stats": False}, **kw))
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.completion_tokens == 5 and usage.total_tokens == usage.prompt_tokens + 5
    chunks = list(client.completions.create(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
    assert all(c.usage is not None and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    assert all(c.usage is None for c in client.completions.create(stream=True, stream_options={}, **kw))
    for options in ({"include_usage": None}, {"include_usage": True}, {"continuous_usage_stats": True}):
        with pytest.raises(openai.BadRequestError):                           # stream_options without stream
            client.completions.create(stream=False, stream_options=options, **kw)


@pytest.mark.parametrize("prompts", [["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2])
def test_batch_completions(client, prompts):
    """A list of prompts: one choice per prompt (times n), choice i answering prompt i // n, streamed too. (vLLM's
    n=2 case asks for beam search, which tinyserve refuses by name; here n=2 samples greedily.)"""
    kw = dict(model="tinyserve", prompt=prompts, max_tokens=5, temperature=0.0)
    batch = client.completions.create(**kw)
    assert len(batch.choices) == 2 and batch.choices[0].text == batch.choices[1].text
    batch = client.completions.create(n=2, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[2].text and batch.choices[1].text == batch.choices[3].text
    texts = [""] * 2
    for chunk in client.completions.create(stream=True, **kw):
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts[0] == texts[1]
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        client.completions.create(n=2, extra_body={"use_beam_search": True}, **kw)


def test_batch_usage_and_token_ids(client, tokenizer):
    """Usage adds every prompt; return_token_ids gives each choice its own prompt's ids."""
    prompts = ["The quick brown fox", [5, 6, 7]]
    c = client.completions.create(model="tinyserve", prompt=prompts, max_tokens=3, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = [tokenizer.encode(prompts[0]), prompts[1]]
    assert [ch.prompt_token_ids for ch in c.choices] == ids and extra(c, "prompt_token_ids") is None
    assert c.usage.prompt_tokens == sum(map(len, ids)) and c.usage.completion_tokens == 6


@pytest.mark.parametrize("logprobs_arg", [1, 0])
def test_echo_logprob_completion(client, tokenizer, logprobs_arg):
    for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
        c = client.completions.create(model="tinyserve", prompt=prompt, max_tokens=5, temperature=0.0, echo=True,
                                      logprobs=logprobs_arg, extra_body={"ignore_eos": True})
        prompt_text = tokenizer.decode(prompt, skip_special_tokens=False) if isinstance(prompt, list) else prompt
        assert c.choices[0].text.startswith(prompt_text)
        lp = c.choices[0].logprobs
        assert len(lp.text_offset) > 5
        assert len(lp.token_logprobs) > 5 and lp.token_logprobs[0] is None
        assert len(lp.top_logprobs) > 5 and lp.top_logprobs[0] is None
        for top in lp.top_logprobs[1:]:
            assert max(logprobs_arg, 1) <= len(top) <= logprobs_arg + 1
        assert len(lp.tokens) > 5


def test_echo_scores_a_prompt_as_eval_harnesses_do(client, tokenizer):
    """What lm-evaluation-harness sends for loglikelihood (token-id prompts in a batch, echo, logprobs=1,
    max_tokens=1; and max_tokens=0 in its older versions): the prompt's token_logprobs are exactly what the model
    gives each prompt token, the same whether the prompt was cached or not, and the generated token comes last."""
    context, target = tokenizer.encode("The quick brown fox jumps over"), tokenizer.encode(" the lazy dog")
    full = context + target
    body = {"model": "tinyserve", "prompt": [full, context], "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 1}
    first = client.completions.create(**body)
    again = client.completions.create(**body)             # the prompt is in the prefix cache now
    for c in (first, again):
        lp = c.choices[0].logprobs
        assert len(lp.token_logprobs) == len(full) + 1 and lp.token_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        assert close(c.choices[1].logprobs.token_logprobs[:len(context)], lp.token_logprobs[:len(context)])
    assert close(first.choices[0].logprobs.token_logprobs, again.choices[0].logprobs.token_logprobs)
    # the logprob of each prompt token is the one greedy decoding reports when it is the next token
    greedy = client.completions.create(model="tinyserve", prompt=context, max_tokens=1, temperature=0, logprobs=1)
    picked = greedy.choices[0].logprobs
    echoed = first.choices[1].logprobs
    assert abs(echoed.token_logprobs[len(context)] - picked.token_logprobs[0]) < 1e-4
    only = client.completions.create(model="tinyserve", prompt=full, max_tokens=0, echo=True, logprobs=1)
    ch = only.choices[0]
    assert ch.text == tokenizer.decode(full, skip_special_tokens=False) and ch.finish_reason == "length"
    assert close(ch.logprobs.token_logprobs, first.choices[0].logprobs.token_logprobs[:len(full)])
    assert only.usage.completion_tokens == 0


def test_echo_stream_matches_blocking(client):
    kw = dict(model="tinyserve", prompt="Hello, my name is", max_tokens=4, temperature=0, echo=True, logprobs=1,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[0].choices[0].prompt_token_ids == whole.prompt_token_ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs


def test_refused_completion_fields(server):
    """suffix (no fill-in-the-middle), best_of other than n, vLLM's prompt_logprobs and structured_outputs: refused
    by name (vLLM's test_prompt_logprobs_completion / test_invalid_json_schema expect answers tinyserve does not
    give)."""
    for field, value in [("suffix", "x"), ("best_of", 3), ("prompt_logprobs", 1),
                         ("structured_outputs", {"regex": "[a-z]+"}), ("guided_json", {})]:
        error = error_of(server, "/v1/completions", {"prompt": "x", field: value})
        assert error["param"] == field and field in error["message"]


def test_empty_prompt_list(server):
    """vLLM completion/test_empty_prompt_list.py: an empty list is a 400."""
    assert error_of(server, "/v1/completions", {"prompt": [], "max_tokens": 5})["param"] == "prompt"


# ---------------------------------------------------------------------------------------------------------------
# Chat (vLLM chat_completion/test_chat.py)

@pytest.mark.parametrize("top_logprobs,count", [(None, None), (0, 0), (5, 5)])
def test_chat_logprobs_counts(client, top_logprobs, count):
    kw = {} if top_logprobs is None else {"logprobs": True, "top_logprobs": top_logprobs}
    c = client.chat.completions.create(model="tinyserve", messages=QUESTION, max_completion_tokens=5,
                                       temperature=0.0, **kw)
    lp = c.choices[0].logprobs
    assert (lp is None) if count is None else len(lp.content[0].top_logprobs) == count


def test_too_many_chat_logprobs(client):
    with pytest.raises(openai.BadRequestError):
        for _ in client.chat.completions.create(model="tinyserve", messages=QUESTION, max_completion_tokens=10,
                                                logprobs=True, top_logprobs=21, stream=True):
            pass
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tinyserve", messages=QUESTION, max_completion_tokens=10,
                                       logprobs=True, top_logprobs=30)
    assert client.chat.completions.create(model="tinyserve", messages=QUESTION,
                                          max_completion_tokens=10).choices[0].message is not None


def test_single_chat_session(client):
    c = client.chat.completions.create(model="tinyserve", messages=QUESTION, max_completion_tokens=5, logprobs=True,
                                       top_logprobs=5, extra_body={"ignore_eos": True})
    assert c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 5 and c.usage.total_tokens == c.usage.prompt_tokens + 5
    messages = QUESTION + [{"role": "assistant", "content": c.choices[0].message.content},
                           {"role": "user", "content": "express your result in json"}]
    assert client.chat.completions.create(model="tinyserve", messages=messages,
                                          max_completion_tokens=5).choices[0].message.content is not None


def test_chat_streaming(client):
    kw = dict(model="tinyserve", messages=QUESTION, max_completion_tokens=10, temperature=0.0)
    whole = client.chat.completions.create(**kw).choices[0]
    text, finished = "", 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        if delta.role:
            assert delta.role == "assistant"
        text += delta.content or ""
        finished += chunk.choices[0].finish_reason is not None
    assert finished == 1 and chunk.choices[0].finish_reason == whole.finish_reason
    assert text == whole.message.content


def test_chat_completion_stream_options(client):
    kw = dict(model="tinyserve", messages=QUESTION, max_completion_tokens=10, temperature=0.0)
    assert all(c.usage is None for c in client.chat.completions.create(
        stream=True, stream_options={"include_usage": False}, **kw))
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(stream=False, stream_options=options, **kw)
    last = 0
    for chunk in client.chat.completions.create(stream=True, extra_body={"min_tokens": 10},
                                                stream_options={"include_usage": True,
                                                                "continuous_usage_stats": True}, **kw):
        usage = chunk.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert last == 0 or usage.completion_tokens >= last
        last = usage.completion_tokens
    assert last == 10


def test_chat_fields_as_vllm_takes_them(client):
    """test_response_format_text, test_extra_fields_allowed (an unknown key inside a message), test_complex_message_
    content, test_long_seed (a seed past 64 bits is a 400)."""
    assert client.chat.completions.create(model="tinyserve", messages=QUESTION, max_completion_tokens=3,
                                          response_format={"type": "text"}).choices[0].message.content is not None
    assert client.chat.completions.create(model="tinyserve", messages=[
        {"role": "user", "content": "what is 1+1?", "extra_field": "0"}], temperature=0, seed=0,
        max_completion_tokens=3).choices[0].message is not None
    plain = client.chat.completions.create(model="tinyserve", messages=[{"role": "user", "content": "what is 1+1?"}],
                                           temperature=0, max_completion_tokens=4)
    parts = client.chat.completions.create(model="tinyserve", messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is 1+1?"}]}], temperature=0, max_completion_tokens=4)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    for seed in (-(2 ** 63) - 1, 2 ** 64):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tinyserve", messages=QUESTION, temperature=0, seed=seed)


def test_custom_role_is_refused(server):
    """vLLM passes any role to the template; Qwen's templates know system, user, assistant and tool, so tinyserve
    refuses another role by name instead of rendering a turn the model never saw."""
    error = error_of(server, "/v1/chat/completions", {"messages": [{"role": "my-custom-role", "content": "x"}]})
    assert error["param"] == "messages[0].role"


def test_chat_n_parameter(client):
    c = client.chat.completions.create(model="tinyserve", messages=QUESTION, max_completion_tokens=20,
                                       temperature=0.7, n=3, extra_body={"ignore_eos": True})
    assert [ch.index for ch in c.choices] == [0, 1, 2] and all(ch.message.content for ch in c.choices)
    got = defaultdict(str)
    for chunk in client.chat.completions.create(model="tinyserve", messages=QUESTION, max_completion_tokens=15,
                                                temperature=0.7, n=2, stream=True,
                                                extra_body={"ignore_eos": True}):
        for ch in chunk.choices:
            got[ch.index] += ch.delta.content or ""
    assert got[0] and got[1]
    c = client.chat.completions.create(model="tinyserve", messages=QUESTION, max_completion_tokens=10,
                                       temperature=0.8, n=2, seed=42)
    assert len(c.choices) == 2


# ---------------------------------------------------------------------------------------------------------------
# logit_bias (vLLM chat_completion/test_chat_logit_bias_validation.py; llama.cpp test_chat_completion.py)

VOCAB = 663                     # the demo checkpoint's


def test_chat_logit_bias_valid_and_invalid(client):
    assert client.chat.completions.create(model="tinyserve", messages=QUESTION, max_tokens=5,
                                          logit_bias={str(VOCAB - 1): 1.0}).choices[0].message is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tinyserve", messages=QUESTION, max_tokens=5,
                                       logit_bias={str(VOCAB + 1): 1.0})
    assert e.value.status_code == 400 and str(VOCAB + 1) in str(e.value) and str(VOCAB) in str(e.value)


@pytest.mark.parametrize("bias,names", [({"not_a_token_id": 50}, ["not_a_token_id", "logit_bias"]),
                                        ({"1": "not_a_number"}, ["logit_bias"]),
                                        ({"bad1": 50.0, "bad2": 20.0}, ["bad1", "bad2"]),
                                        ({"1": 101}, ["logit_bias", "100"]), ({"-3": 1}, ["-3"]),
                                        ([1, 2], ["logit_bias"])])
def test_chat_logit_bias_refusals_name_what_is_wrong(server, bias, names):
    error = error_of(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 5, "logit_bias": bias})
    assert error["param"] == "logit_bias" and all(n in error["message"] for n in names)


def test_logit_bias_bans_and_forces_tokens(client, tokenizer):
    """llama.cpp's test_logit_bias: -100 on a set of words keeps them out of a 64-token answer; and +100 forces a
    token, on chat and completions, streamed or not."""
    exclude = ["i", "I", "the", "The", "to", "a", "an", "be", "is", "was", "but", "and", "so", "you", "he", "she",
               "we", "they", "it", "his", "her", "book", "Book"]
    banned = set(tokenizer.encode(" " + " ".join(exclude) + " ")) | set(tokenizer.encode(" ".join(exclude)))
    c = client.chat.completions.create(model="tinyserve", temperature=0.0, messages=[
        {"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}],
        max_tokens=64, logit_bias={str(t): -100 for t in banned}, extra_body={"return_token_ids": True})
    assert c.choices[0].message.content and not set(c.choices[0].token_ids) & banned
    forced = tokenizer.encode(" fox")[-1]
    c = client.completions.create(model="tinyserve", prompt="x", max_tokens=4, temperature=1.0, seed=1,
                                  logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
    assert c.choices[0].token_ids == [forced] * 4
    chunks = client.chat.completions.create(model="tinyserve", messages=QUESTION, max_tokens=3, temperature=0,
                                            logit_bias={str(forced): 100}, stream=True,
                                            extra_body={"return_token_ids": True})
    assert [t for ch in chunks if ch.choices for t in (extra(ch.choices[0], "token_ids") or [])] == [forced] * 3


# ---------------------------------------------------------------------------------------------------------------
# Logprobs text and bytes (llama.cpp test_chat_completion.py test_logprobs / test_logprobs_stream)

def test_logprobs_bytes_rebuild_the_text(client):
    """Each token's bytes are its own, so the answer is the joined bytes even where a character spans tokens (the
    random demo model writes plenty of byte tokens, and bytes that are no UTF-8 at all: U+FFFD in the text, as
    in the bytes decoded); a token inside a character reads "bytes:\\\\x..", and two alternatives with the
    same text stay two entries."""
    kw = dict(model="tinyserve", messages=QUESTION, max_tokens=40, temperature=1.0, seed=7, logprobs=True,
              top_logprobs=10, extra_body={"ignore_eos": True, **NO_THINKING})
    c = client.chat.completions.create(**kw)
    content = c.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == c.choices[0].message.content
    assert any(t.token.startswith("bytes:") for t in content)
    for t in content:
        assert t.logprob <= 0.0 and len(t.top_logprobs) == 10
        assert len({bytes(a.bytes) for a in t.top_logprobs}) == 10
        if not t.token.startswith("bytes:"):
            assert bytes(t.bytes).decode() == t.token
    text, joined = "", b""
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].finish_reason is None and not chunk.choices[0].delta.role:
            assert chunk.choices[0].delta.content is not None      # a string even on a chunk of logprobs only
            text += chunk.choices[0].delta.content
            for t in chunk.choices[0].logprobs.content:
                joined += bytes(t.bytes)
                assert t.logprob <= 0.0 and len(t.top_logprobs) == 10
    assert joined.decode(errors="replace") == text == c.choices[0].message.content


def test_completion_top_logprobs_keep_byte_alternatives(client):
    """Completions' top_logprobs is keyed by token text: byte tokens read "bytes:\\\\x..", so alternatives that are
    parts of different characters no longer collide on U+FFFD."""
    c = client.completions.create(model="tinyserve", prompt="héllo wörld", max_tokens=30, temperature=1.0, seed=3,
                                  logprobs=5, extra_body={"ignore_eos": True})
    tops = c.choices[0].logprobs.top_logprobs
    assert all(5 <= len(top) <= 6 for top in tops)
    assert all("\ufffd" not in key for top in tops for key in top)


# ---------------------------------------------------------------------------------------------------------------
# Streams (llama.cpp test_chat_completion.py test_chat_completion_stream; vLLM basic/test_return_token_ids.py)

def test_chat_stream_shape(server):
    """A role chunk first (content "": OpenAI's; llama.cpp sends null), no role after it, one id for the whole
    stream, the finishing chunk without content, then the usage chunk with no choices."""
    status, _, raw = http("POST", server.base_url + "/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}],
        "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True})
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len({e["id"] for e in events}) == 1
    for e in events[1:-1]:
        choice = e["choices"][0]
        assert "role" not in choice["delta"]
        if choice["finish_reason"] is None:
            assert isinstance(choice["delta"]["content"], str)
        else:
            assert "content" not in choice["delta"] and choice["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


def test_return_token_ids(client, tokenizer):
    prompt = "Complete this sentence with emojis: I love coding 🚀"
    c = client.completions.create(model="tinyserve", prompt=prompt, max_tokens=10, temperature=0, logprobs=1,
                                  extra_body={"return_token_ids": True})
    ch = c.model_dump()["choices"][0]
    assert ch["prompt_token_ids"] == tokenizer.encode(prompt) and ch["token_ids"]
    assert tokenizer.decode(ch["token_ids"]).startswith(ch["text"])
    plain = client.completions.create(model="tinyserve", prompt=prompt, max_tokens=10, temperature=0,
                                      extra_body={"return_token_ids": False}).model_dump()
    assert plain["choices"][0].get("token_ids") is None and plain.get("prompt_token_ids") is None
    # streamed: the first chunk carries the prompt's ids, and the chunks' ids are the logprobs' tokens (each one's
    # share of the text: together they are the text)
    first, ids, pieces, texts = True, [], [], []
    for chunk in client.completions.create(model="tinyserve", prompt="Tell me a short fact about Python:",
                                           max_tokens=30, temperature=0, stream=True, logprobs=1,
                                           extra_body={"return_token_ids": True}):
        ch = chunk.choices[0]
        if first:
            assert ch.prompt_token_ids
            first = False
        else:
            assert getattr(ch, "prompt_token_ids", None) is None
        ids += ch.token_ids
        texts.append(ch.text)
        pieces += ch.logprobs.tokens if ch.logprobs else []
        assert ch.logprobs is None or len(ch.logprobs.tokens) == len(ch.token_ids)
    assert ids and "".join(pieces) == "".join(texts)


def test_chat_return_token_ids_stream(client, tokenizer):
    messages = [{"role": "system", "content": "You like to use emojis in your responses."},
                {"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    c = client.chat.completions.create(model="tinyserve", messages=messages, max_tokens=50, temperature=0,
                                       logprobs=True, extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(c.prompt_token_ids)
    assert "I love cats 🐱" in prompt and c.choices[0].token_ids
    first, content, ids = True, "", []
    for chunk in client.chat.completions.create(model="tinyserve", messages=messages, max_tokens=50, temperature=0,
                                                stream=True, extra_body={"return_token_ids": True}):
        if first:
            assert tokenizer.decode(chunk.prompt_token_ids) == prompt
            first = False
        else:
            assert "prompt_token_ids" not in chunk.model_dump()
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            ids += extra(chunk.choices[0], "token_ids") or []
    assert ids == c.choices[0].token_ids and content == c.choices[0].message.content


# ---------------------------------------------------------------------------------------------------------------
# Prefill, echo and the checks OpenAI makes (vLLM chat_completion/test_chat_echo.py; llama.cpp
# test_chat_template_assistant_prefill)

@pytest.mark.parametrize("echo", [True, False])
def test_continue_final_message_and_echo(client, echo):
    saying = "Here is a common saying about apple. An apple a day, keeps"
    c = client.chat.completions.create(model="tinyserve", max_tokens=8, messages=[
        {"role": "user", "content": "tell me a common saying"}, {"role": "assistant", "content": saying}],
        extra_body={"echo": echo, "continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True})
    assert (saying in c.choices[0].message.content) == echo
    assert c.prompt_token_ids[-1] != 658                          # the prefill is not closed with <|im_end|>


def test_consistency_is_checked(server):
    """OpenAI answers 400 to these combinations; so does tinyserve, naming the field."""
    cases = [({"stream_options": {"include_usage": True}}, "stream_options"),
             ({"tool_choice": "auto"}, "tool_choice"), ({"tool_choice": "required"}, "tool_choice"),
             ({"continue_final_message": True}, "continue_final_message"),
             ({"functions": [{"name": "f"}]}, "functions"), ({"store": True}, "store"),
             ({"modalities": ["text", "audio"]}, "modalities"), ({"reasoning_effort": "huge"}, "reasoning_effort"),
             ({"user": 5}, "user"), ({"metadata": "x"}, "metadata")]
    for extra, param in cases:
        assert error_of(server, "/v1/chat/completions", {"messages": QUESTION, **extra})["param"] == param, extra
    status, _ = post(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2, "tool_choice": "none",
                                                       "user": "u1", "metadata": {"k": "v"}, "store": False,
                                                       "modalities": ["text"], "service_tier": "auto"})
    assert status == 200


def test_models_retrieve(client, server):
    """The SDK's models.retrieve: the served model; another name is a 404 naming what is served."""
    assert client.models.retrieve("tinyserve").id == "tinyserve"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert "tinyserve" in str(e.value)


def test_context_length_exceeded(server):
    """OpenAI's code context_length_exceeded (llama.cpp names its own type exceed_context_size_error)."""
    long = [{"role": "user", "content": "What is the best book " * 200}]
    error = error_of(server, "/v1/chat/completions", {"messages": long})
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    aborted = 'tinyserve:request_finished_total{finish_reason="abort"}'
    before = http("GET", server.base_url + "/metrics")[2].decode()
    error = error_of(server, "/v1/completions", {"prompt": ["x", "word " * 2000]})
    assert error["code"] == "context_length_exceeded" and error["message"].startswith("prompt[1]")
    after = http("GET", server.base_url + "/metrics")[2].decode()
    # every prompt is checked before any is submitted: "x" was neither started nor cancelled
    assert [line for line in before.splitlines() if line.startswith(aborted)] == \
        [line for line in after.splitlines() if line.startswith(aborted)]


def test_invalid_chat_requests(server):
    """llama.cpp's test_invalid_chat_completion_req: each a 400 (llama.cpp allows a 500)."""
    for messages in [None, "string", [123], [{}], [{"role": 123}], [{"role": "system", "content": 123}],
                     [{"role": "system", "content": "test"}, {}]]:
        assert error_of(server, "/v1/chat/completions", {"messages": messages})["param"].startswith("messages")


def test_same_seed_same_text_different_seeds_differ(client):
    """llama.cpp's test_consistent_result_same_seed / test_different_result_different_seed."""
    kw = dict(model="tinyserve", prompt="I believe the meaning of life is", max_tokens=16)
    same = {client.completions.create(seed=42, temperature=0.0, **kw).choices[0].text for _ in range(3)}
    assert len(same) == 1
    texts = [client.completions.create(seed=s, temperature=1.0, extra_body={"ignore_eos": True}, **kw)
             .choices[0].text for s in range(4)]
    assert len(set(texts)) == 4


def test_completion_with_token_input(client, tokenizer):
    """llama.cpp's test_completion_with_tokens_input: token ids, a batch of them, and ids mixed with text in the
    batch give the same greedy text (one prompt mixing ids and text in one sequence is llama.cpp's own: a 400)."""
    text = "I believe the meaning of life is"
    ids = tokenizer.encode(text)
    kw = dict(model="tinyserve", max_tokens=8, temperature=0.0)
    single = client.completions.create(prompt=ids, **kw).choices[0].text
    batch = client.completions.create(prompt=[ids, ids], **kw).choices
    mixed = client.completions.create(prompt=[ids, text], **kw).choices
    assert batch[0].text == batch[1].text == mixed[0].text == mixed[1].text == single
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=[1, 2, 3, text], **kw)
