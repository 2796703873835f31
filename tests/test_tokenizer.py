"""tinyserve.tokenizer: chat template semantics (checked against transformers), eos ids, incremental detokenizing."""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest

from tinyserve.demo import write_demo_tokenizer_files
from tinyserve.generation import IncrementalDetokenizer
from tinyserve.tokenizer import (IMAGE_MARKER, MessageError, Tokenizer, content_text,
                                 normalise_messages, tool_call_arguments)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city, ünïcode kept",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]

CONVERSATIONS = {
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 你好"}],
    "user_only": [{"role": "user", "content": "Hello"}],
    "multi_turn_reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": {"city": "Oslo", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "snow"},
    ],
}


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("demo_tok")
    write_demo_tokenizer_files(folder)
    return folder


@pytest.fixture(scope="module")
def tok(demo_folder) -> Tokenizer:
    return Tokenizer.from_folder(demo_folder)


@pytest.fixture(scope="module")
def hf_tok(demo_folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(demo_folder))


def _folder_with(tmp_path: Path, demo_folder: Path, template_config=None, jinja: str | None = None,
                 gen_eos=None) -> Path:
    """A copy of the demo tokenizer with a different template / generation_config."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizer.json").write_bytes((demo_folder / "tokenizer.json").read_bytes())
    cfg = json.loads((demo_folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    if template_config is not None:
        cfg["chat_template"] = template_config
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    if gen_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    return tmp_path


# ---------------------------------------------------------------------------------------------------------------
# chat template


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"add_generation_prompt": False}])
def test_template_matches_transformers(tok, hf_tok, name, with_tools, kwargs):
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    kwargs = dict(kwargs)
    agp = kwargs.pop("add_generation_prompt", True)
    ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, **kwargs)
    theirs = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp, tokenize=False, **kwargs)
    assert ours == theirs
    assert tok.encode(ours) == hf_tok.encode(ours, add_special_tokens=False)


def test_template_system_user_and_generation_prompt(tok):
    text = tok.apply_chat_template(CONVERSATIONS["system_user"])
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi 你好<|im_end|>\n"
                    "<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(CONVERSATIONS["system_user"], add_generation_prompt=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]


def test_template_enable_thinking_false(tok):
    on = tok.apply_chat_template(CONVERSATIONS["user_only"])
    off = tok.apply_chat_template(CONVERSATIONS["user_only"], enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(CONVERSATIONS["user_only"], enable_thinking=True) == on


def test_template_tools_and_tool_results(tok):
    text = tok.apply_chat_template(CONVERSATIONS["tool_round_trip"], tools=TOOLS)
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools\n")
    assert '{"name": "get_weather", "description": "Weather for a city, ünïcode kept"' in text  # no \u escapes
    assert "<function=example_function_name>" in text
    assert ("Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n") in text
    # consecutive tool results share one user turn
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nsnow\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text


def test_template_accepts_openai_shapes(tok):
    """Arguments as a JSON string and content as text parts render like their plain forms (parts joined by
    newlines, as vLLM does)."""
    plain = json.loads(json.dumps(CONVERSATIONS["tool_round_trip"]))
    plain[1]["content"] = "Weather in Paris\nand Oslo?"
    openai = json.loads(json.dumps(plain))
    for call in openai[2]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    openai[1]["content"] = [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "and Oslo?"}]
    assert tok.apply_chat_template(openai, tools=TOOLS) == tok.apply_chat_template(plain, tools=TOOLS)
    assert isinstance(openai[2]["tool_calls"][0]["function"]["arguments"], str)   # caller's dicts untouched
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].*input_audio"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    # an image part renders as Qwen's template renders one, in place with nothing around it (the caller gives the
    # engine the image itself); a system message may not hold one
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    text = tok.apply_chat_template([{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])
    assert f"<|im_start|>user\n{IMAGE_MARKER}What is this?<|im_end|>\n" in text
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: System message cannot contain images"):
        tok.apply_chat_template([{"role": "system", "content": [image]}, {"role": "user", "content": "hi"}])


def test_message_normaliser():
    """The one normaliser the API and apply_chat_template share: text parts joined by "\n", arguments parsed,
    errors naming where they are."""
    assert content_text([{"type": "text", "text": "a"}, "b", {"type": "text", "text": ""}], "c") == "a\nb\n"
    assert content_text("as is", "c") == "as is" and content_text(None, "c") is None
    # images: the marker in place, no newline on either side (text parts keep theirs)
    assert content_text(["a", {"type": "image_url"}, "b", "c"], "c") == f"a{IMAGE_MARKER}b\nc"
    with pytest.raises(MessageError, match="input_audio") as e:
        content_text(["ok", {"type": "input_audio"}], "messages[2].content")
    assert e.value.param == "messages[2].content[1]"
    with pytest.raises(MessageError, match="System message cannot contain images") as e:
        content_text(["ok", {"type": "image_url"}], "messages[0].content", images=False)
    assert e.value.param == "messages[0].content[1]"
    with pytest.raises(MessageError) as e:
        content_text(5, "messages[0].content")
    assert e.value.param == "messages[0].content"
    assert tool_call_arguments('{"city": "Oslo"}', "a") == {"city": "Oslo"} and tool_call_arguments(" ", "a") == {}
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(MessageError) as e:
            tool_call_arguments(bad, "messages[1].tool_calls[0].function.arguments")
        assert e.value.param == "messages[1].tool_calls[0].function.arguments"
    messages = [{"role": "user", "content": ["a", "b"]}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    out = normalise_messages(messages)
    assert out[0]["content"] == "a\nb" and out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert "content" not in out[1] and messages[0]["content"] == ["a", "b"]      # caller's dicts untouched


def test_template_errors_become_value_errors(tok):
    with pytest.raises(ValueError, match="Unexpected message role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="No messages provided"):
        tok.apply_chat_template([])
    with pytest.raises(ValueError, match="Unexpected message role"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="chat template error"):   # a TypeError inside the template
        tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 3}}]}])


def test_environment_features(tmp_path, demo_folder):
    jinja = ("{{ messages[0].content | tojson }}|{{ {'k': 'é'} | tojson(indent=2) }}|"
             "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
             "{{ bos_token is defined }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ enable_thinking }}|"
             "{% generation %}gen{% endgeneration %}")
    tok = Tokenizer.from_folder(_folder_with(tmp_path, demo_folder, jinja=jinja))
    out = tok.apply_chat_template([{"role": "user", "content": "ça <b>"}, {"role": "assistant", "content": "x"}],
                                  enable_thinking=True)
    assert out == '"ça <b>"|{\n  "k": "é"\n}|user|False|<|im_end|>|4|True|gen'


def test_template_sandboxed(tmp_path, demo_folder):
    jinja = "{{ messages.__class__.__mro__ }}{% set x = messages.append(1) %}"
    tok = Tokenizer.from_folder(_folder_with(tmp_path, demo_folder, jinja=jinja))
    with pytest.raises(ValueError, match="chat template error"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_sources(tmp_path, demo_folder):
    # a list of named templates: "default" is used
    folder = _folder_with(tmp_path / "a", demo_folder, template_config=[
        {"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}])
    assert Tokenizer.from_folder(folder).apply_chat_template([]) == "DEFAULT"
    # chat_template.jinja wins over tokenizer_config.json
    folder = _folder_with(tmp_path / "b", demo_folder, template_config="CONFIG", jinja="FILE")
    assert Tokenizer.from_folder(folder).apply_chat_template([]) == "FILE"
    # no template at all
    tok = Tokenizer.from_folder(_folder_with(tmp_path / "c", demo_folder))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # a list without "default"
    with pytest.raises(ValueError, match="default"):
        Tokenizer.from_folder(_folder_with(tmp_path / "d", demo_folder, template_config=[{"name": "x", "template": ""}]))
    # a template that does not parse names the problem
    with pytest.raises(ValueError, match="does not parse"):
        Tokenizer.from_folder(_folder_with(tmp_path / "e", demo_folder, jinja="{% for %}"))


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# ids


def test_eos_ids_union(tmp_path, tok, demo_folder):
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert set(tok.eos_token_ids) == {im_end, eot}
    t = Tokenizer.from_folder(_folder_with(tmp_path / "int", demo_folder, gen_eos=5))
    assert t.eos_token_ids == [5, im_end]          # int form + tokenizer_config eos_token
    t = Tokenizer.from_folder(_folder_with(tmp_path / "dup", demo_folder, gen_eos=[im_end, 7]))
    assert t.eos_token_ids == [im_end, 7]          # no duplicates
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_folder(_folder_with(tmp_path / "bad", demo_folder, gen_eos="x"))


def test_encode_decode_and_vocab(tok):
    text = "<|im_start|>user\nHello 世界 👋<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_start|>")     # special tokens in text are recognised
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user\nHello 世界 👋\n"
    assert tok.vocab_size == 663
    assert tok.id_to_token(tok.token_to_id("</think>")) == "</think>"
    assert tok.token_to_id("not-a-token-at-all") is None


# ---------------------------------------------------------------------------------------------------------------
# incremental detokenizer

SAMPLE = "Hi 你好 🎉 — naïve café ✓ Paris is sunny 🌞🌧️ end."


def _chunkings(n: int, seed: int) -> list[list[int]]:
    """Split points for n ids: one at a time, all at once, and random groupings."""
    out = [[1] * n, [n]]
    rng = random.Random(seed)
    for _ in range(20):
        sizes, left = [], n
        while left:
            k = rng.randint(1, min(4, left))
            sizes.append(k)
            left -= k
        out.append(sizes)
    return out


def _run(det: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    chunks, pos = [], 0
    for k in sizes:
        chunks.append(det.add(ids[pos:pos + k]))
        pos += k
    chunks.append(det.flush())
    return chunks


def test_detokenizer_never_splits_characters(tok):
    ids = tok.encode(SAMPLE)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # the sample really has byte-level pieces
    for sizes in _chunkings(len(ids), seed=1):
        chunks = _run(IncrementalDetokenizer(tok), ids, sizes)
        assert all("\ufffd" not in c for c in chunks)
        assert "".join(chunks) == tok.decode(ids) == SAMPLE


def test_detokenizer_holds_back_only_an_incomplete_character(tok):
    ids = tok.encode(SAMPLE * 3)
    det, sent = IncrementalDetokenizer(tok), ""
    for k, i in enumerate(ids):
        sent += det.add([i])
        whole = tok.decode(ids[:k + 1])
        if not whole.endswith("\ufffd"):          # every character complete: all of it is out
            assert sent == whole
        else:
            assert whole.startswith(sent) and len(whole) - len(sent) <= 4


def test_detokenizer_follows_the_tokenizers_decode_on_any_ids(tok):
    """Random ids (invalid UTF-8 among them, special tokens skipped or kept): the text sent is what the
    tokenizer's own decode gives for all of them."""
    rng = random.Random(5)
    for trial in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        skip = trial % 4 != 0
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        pos, sent = 0, ""
        while pos < len(ids):
            k = rng.randrange(1, 4)
            sent += det.add(ids[pos:pos + k])
            pos += k
        assert sent + det.flush() == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_special_tokens(tok):
    ids = tok.encode("<think>\nhm\n</think>\n\nok<|im_end|>")
    # the think/tool-call tags are not special (as in Qwen's tokenizers), so the parsers still see them
    assert "".join(_run(IncrementalDetokenizer(tok), ids, [1] * len(ids))) == "<think>\nhm\n</think>\n\nok"
    kept = "".join(_run(IncrementalDetokenizer(tok, skip_special_tokens=False), ids, [1] * len(ids)))
    assert kept == "<think>\nhm\n</think>\n\nok<|im_end|>"


@pytest.mark.parametrize("stop", [["Paris"], ["🌞"], ["café ✓", "zzz"], ["ve ca", "naïve"]])
def test_detokenizer_stop_strings(tok, stop):
    ids = tok.encode(SAMPLE)
    first = min(SAMPLE.find(s) for s in stop if s in SAMPLE)
    reason = min((s for s in stop if s in SAMPLE), key=SAMPLE.find)
    for sizes in _chunkings(len(ids), seed=2):
        det = IncrementalDetokenizer(tok, stop=stop)
        seen = ""
        for chunk in _run(det, ids, sizes):
            seen += chunk
            # what was sent never contains a stop string, nor ends in the start of the one that will match
            assert SAMPLE.startswith(seen) and len(seen) <= first
        assert seen == SAMPLE[:first]
        assert det.stopped and det.stop_reason == reason
        assert det.add(ids[:1]) == "" and det.flush() == ""


def test_detokenizer_holds_stop_prefix_until_flush(tok):
    det = IncrementalDetokenizer(tok, stop=["STOP!"])
    out = det.add(tok.encode("wait ST"))
    assert out == "wait " and not det.stopped
    assert det.add(tok.encode("O")) == ""
    assert det.add(tok.encode("P then")) == "STOP then"   # it was not the stop string after all
    assert det.add(tok.encode(" ST")) == " "
    assert det.flush() == "ST" and not det.stopped


def test_detokenizer_flush_incomplete_character(tok):
    ids = tok.encode("ok 🎉")
    det = IncrementalDetokenizer(tok)
    assert det.add(ids[:-1]) == "ok "          # the emoji's last byte is missing: held back
    assert det.flush() == "\ufffd"             # at the end it shows as a replacement character


# ---------------------------------------------------------------------------------------------------------------
# continuing a final message, and each token's own bytes (logprobs)

@pytest.mark.parametrize("name", ["multi_turn_reasoning", "tool_round_trip_answered"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_continue_final_message_matches_transformers(tok, hf_tok, name, kwargs):
    """A prefill: the rendering is cut right after the last message's content, as transformers'
    continue_final_message does it."""
    messages = CONVERSATIONS.get(name) or CONVERSATIONS["tool_round_trip"] + [
        {"role": "assistant", "content": "Paris is sunny, and Oslo"}]
    ours = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True, **kwargs)
    theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                        tokenize=False, **kwargs)
    assert ours == theirs and not ours.endswith("<|im_end|>\n")
    with pytest.raises(ValueError, match="cannot both"):
        tok.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot be continued"):
        tok.apply_chat_template(messages + [{"role": "assistant", "content": "  "}], add_generation_prompt=False,
                                continue_final_message=True)


@pytest.mark.parametrize("text", ["héllo 世界 🚀", "plain ascii", "ünïcödé\n\ttabs", "日本語のテキスト", "a🤖b🧠c"])
def test_token_bytes_rebuild_any_text(tok, text):
    """Byte-level BPE: each token's bytes (the byte alphabet mapped back) joined are the text's bytes; a token that
    is part of a character reads "bytes:\\\\xNN" (OpenAI's spelling), a whole one its text, an added one its own."""
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()
    for t in ids:
        data = tok.token_bytes(t)
        try:
            assert tok.token_text(t) == data.decode() == tok.decode([t])
        except UnicodeDecodeError:
            assert tok.token_text(t) == "bytes:" + "".join(f"\\x{b:02x}" for b in data)
    assert tok.token_text(tok.token_to_id("<|im_end|>")) == "<|im_end|>"


def test_token_bytes_of_a_byte_fallback_tokenizer(tmp_path, caplog):
    """SentencePiece-style vocabularies (<0xNN> byte tokens, "▁" for a space): a byte token is its byte."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "a": 257, "\u2581b": 258}
    hf = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.save(str(tmp_path / "tokenizer.json"))
    with caplog.at_level(logging.WARNING, logger="tinyserve.tokenizer"):
        fallback = Tokenizer.from_folder(tmp_path)
    assert "not a byte-level BPE's" in caplog.text     # the streamed text may differ at a text's start: said once
    ids = fallback.encode("a世")
    assert len(ids) == 4 and b"".join(fallback.token_bytes(t) for t in ids) == "a世".encode()
    assert fallback.token_bytes(258) == b" b" and fallback.token_text(1 + 0xE4) == "bytes:\\xe4"
