"""tinyserve.parsers: qwen3 reasoning and qwen3_coder tool calls, streamed in every chunking vs parsed whole."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tinyserve.parsers import Qwen3ReasoningParser, prompt_opens_reasoning
from tinyserve.chat import make_tool_parser
from tinyserve.tool_calls import Qwen3CoderToolParser
from tinyserve.tool_values import convert_parameter


def chunkings(text: str, seed: int = 0, n_random: int = 30) -> list[list[str]]:
    """One char at a time, whole, every single split point, and random splits."""
    out = [list(text), [text]]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


# ---------------------------------------------------------------------------------------------------------------
# reasoning

REASONING_CASES = [
    # (starts_in_reasoning, text, reasoning, content)
    (False, "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.", "Let me add 2 and 2.", "The answer is 4."),
    (False, "\n<think>\n\n</think>\n\nHi", None, "Hi"),
    (False, "No thinking here, <think> is text.", None, "No thinking here, <think> is text."),
    (False, "<think>\nstill thinking when cut off", "still thinking when cut off", ""),
    (False, "<think>a < b and c </thin d\n\n</think>x\n</think>", "a < b and c </thin d", "x\n</think>"),
    (True, "I should greet.\n</think>\n\nHello!", "I should greet.", "Hello!"),
    (True, "<think>\nrepeated tag\n</think>\n\nok", "repeated tag", "ok"),
    (True, "only reasoning, no end", "only reasoning, no end", ""),
    (True, "\n</think>\n\nanswer\n", None, "answer\n"),
    (False, "plain\n", None, "plain\n"),
]


@pytest.mark.parametrize("starts, text, reasoning, content", REASONING_CASES)
def test_reasoning_parse(starts, text, reasoning, content):
    assert Qwen3ReasoningParser(starts_in_reasoning=starts).parse(text) == (reasoning, content)


@pytest.mark.parametrize("starts, text, reasoning, content", REASONING_CASES)
def test_reasoning_streaming_matches_parse(starts, text, reasoning, content):
    for chunks in chunkings(text, seed=len(text)):
        p = Qwen3ReasoningParser(starts_in_reasoning=starts)
        r_out, c_out = "", ""
        for piece in chunks:
            r, c = p.feed(piece)
            r_out, c_out = r_out + r, c_out + c
            # what was sent is never taken back: so no partial tag (nor framing newline) ever leaks
            assert (reasoning or "").startswith(r_out) and content.startswith(c_out), chunks
        r, c = p.finish()
        assert (r_out + r or None, c_out + c) == (reasoning, content), chunks


def test_reasoning_disabled_passes_everything_through():
    p = Qwen3ReasoningParser(enabled=False)
    text = "<think>\nx\n</think>\n\ny"
    assert p.parse(text) == (None, text)
    assert p.feed("<thi") == ("", "<thi") and p.finish() == ("", "")


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------------------------
# tool calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "threshold": {"type": "number"}, "options": {"type": "object"}, "tags": {"type": "array"},
        "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "run_code", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "timeout": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}},
    {"name": "bare_tool", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}},
]

CALL_TEXT = (
    "I'll check both cities.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n<parameter=options>\n{\"lang\": \"fr\", \"hourly\": false}\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=run_code>\n<parameter=code>\ndef f(x):\n    return x < 3  # </param\n\n</parameter>\n"
    "<parameter=timeout>\nnull\n</parameter>\n</function>\n</tool_call>"
)
CALL_EXPECTED = ("I'll check both cities.", [
    ("get_weather", {"city": "Paris", "days": 3, "metric": True, "options": {"lang": "fr", "hourly": False}}),
    ("run_code", {"code": "def f(x):\n    return x < 3  # </param\n", "timeout": None}),
])

TOOL_SAMPLES = [
    (CALL_TEXT, CALL_EXPECTED),
    ("Just an answer, no tools.\n", ("Just an answer, no tools.\n", [])),
    ("<tool_call>\n<function=bare_tool>\n</function>\n</tool_call>", ("", [("bare_tool", {})])),
    # unknown function: the whole block stays text
    ("a <tool_call>\n<function=nope>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call> b",
     ("a <tool_call>\n<function=nope>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call> b", [])),
    # not XML after <tool_call>
    ('<tool_call>\n{"name": "get_weather"}\n</tool_call>', ('<tool_call>\n{"name": "get_weather"}\n</tool_call>', [])),
    # missing </tool_call> (accepted), text after the call
    ("<tool_call>\n<function=bare_tool>\n<parameter=n>\n7\n</parameter>\n</function>\nDone.",
     ("Done.", [("bare_tool", {"n": 7})])),
    # missing </parameter> before </function> (accepted)
    ("<tool_call>\n<function=bare_tool>\n<parameter=n>\n8\n</function>\n</tool_call>", ("", [("bare_tool", {"n": 8})])),
    # a lone '<' and a partial tag in plain content
    ("x < y and <tool_ is text", ("x < y and <tool_ is text", [])),
]


def _collect(deltas: list[dict], calls: dict, content: list[str]) -> None:
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"} and len(d) == 1
        if "content" in d:
            assert d["content"]
            content.append(d["content"])
            continue
        (tc,) = d["tool_calls"]
        if "id" in tc:     # the first delta of a call: id, type, name
            assert tc["index"] == len(calls) and tc["type"] == "function" and tc["id"].startswith("call_")
            assert tc["function"]["arguments"] == ""
            calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
        else:
            assert set(tc["function"]) == {"arguments"}
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]


def _stream(parser: Qwen3CoderToolParser, chunks: list[str], final_content: str | None = None,
            truncated: bool = False) -> tuple[str, list[tuple[str, dict]]]:
    calls: dict[int, dict] = {}
    content: list[str] = []
    for piece in chunks:
        _collect(parser.feed(piece), calls, content)
        if final_content is not None:   # content sent is never taken back (no partial tag leaked)
            assert final_content.startswith("".join(content)), chunks
    _collect(parser.finish(truncated), calls, content)
    return "".join(content), [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


def _whole(parser: Qwen3CoderToolParser, text: str, truncated: bool = False) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parser.parse(text, truncated)
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) > 10
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, expected", TOOL_SAMPLES)
def test_tool_parse(text, expected):
    assert _whole(Qwen3CoderToolParser(TOOLS), text) == expected


@pytest.mark.parametrize("text, expected", TOOL_SAMPLES)
def test_tool_streaming_matches_parse(text, expected):
    for chunks in chunkings(text, seed=len(text), n_random=20):
        assert _stream(Qwen3CoderToolParser(TOOLS), chunks, expected[0]) == expected, chunks


def test_tool_streaming_arguments_are_exactly_the_parsed_string():
    p = Qwen3CoderToolParser(TOOLS)
    _, calls = p.parse(CALL_TEXT)
    deltas = []
    for ch in CALL_TEXT:
        deltas += p.feed(ch)
    deltas += p.finish()
    args: dict[int, str] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert [args[i] for i in sorted(args)] == [c["function"]["arguments"] for c in calls]
    assert calls[0]["function"]["arguments"] == \
        '{"city": "Paris", "days": 3, "metric": true, "options": {"lang": "fr", "hourly": false}}'
    # arguments arrive one complete parameter at a time, once the next tag confirms it ends: the name delta comes
    # before any parameter is closed; a last parameter with no markup in it as soon as `</function>` closes it, and
    # the closing brace with `</tool_call>`
    kinds = ["content" if "content" in d else ("name" if "id" in d["tool_calls"][0] else "args") for d in deltas]
    assert [k for i, k in enumerate(kinds) if k != "content" or i == 0] == \
        ["content", "name"] + ["args"] * 5 + ["name"] + ["args"] * 3
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d]
    assert fragments[1] == '{"city": "Paris"' and fragments[4].endswith("false}") and fragments[5] == "}"
    assert fragments[-2].endswith("null") and fragments[-1] == "}"
    # the call's end comes with the delta that holds it (vLLM's speculative-decode case), not with the end of output
    p = Qwen3CoderToolParser(TOOLS)
    p.feed("<tool_call>\n<function=get_weather>\n")
    done = p.feed("<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in done) == '{"city": "Paris"}'
    # a value that quotes markup still waits for what follows its closing tags
    p = Qwen3CoderToolParser(TOOLS)
    p.feed("<tool_call>\n<function=run_code>\n")
    held = p.feed("<parameter=code>\nprint('<tool_call>')\n</parameter>\n</function>\n</tool_call>")
    assert [d["tool_calls"][0]["function"]["arguments"] for d in held] == [""]          # the name only


def test_tool_ids_unique():
    _, calls = Qwen3CoderToolParser(TOOLS).parse(CALL_TEXT)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=get_weather>\njunk between parameters\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city\nParis</parameter></function></tool_call>",
])
def test_malformed_calls_are_content(text):
    content, calls = Qwen3CoderToolParser(TOOLS).parse(text)
    assert calls == [] and content == text
    for chunks in chunkings(text, n_random=5):
        assert _stream(Qwen3CoderToolParser(TOOLS), chunks) == (text, [])


@pytest.mark.parametrize("text, expected", [
    # cut off in a value: the value is dropped, the call stays a call
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", ("", [("get_weather", {})])),
    # cut off before </function>: every parameter is whole
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
     ("", [("get_weather", {"city": "Paris"})])),
    # cut off in the opener: markup, not an answer
    ("Let me look.\n<tool_call>\n<function=get_weath", ("Let me look.", [])),
    ("<tool_call>", ("", [])),
    # a lone <tool_call> is text; the call after it lacks </function>
    ("<tool_call><tool_call><function=get_weather></tool_call>", ("<tool_call>", [("get_weather", {})])),
])
def test_cut_and_unclosed_calls_are_recovered(text, expected):
    for truncated in (False, True):
        assert _whole(Qwen3CoderToolParser(TOOLS), text, truncated) == expected
        for chunks in chunkings(text, n_random=5):
            assert _stream(Qwen3CoderToolParser(TOOLS), chunks, truncated=truncated) == expected, chunks


def test_streaming_truncated_call_is_closed():
    p = Qwen3CoderToolParser(TOOLS)
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3"
    assert _stream(p, [text]) == ("", [("get_weather", {"city": "Paris"})])


def test_malformed_call_then_good_call():
    text = ("<tool_call>\n<function=nope>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=bare_tool>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>")
    expected = ("<tool_call>\n<function=nope>\n</function>\n</tool_call>", [("bare_tool", {"n": 1})])
    assert _whole(Qwen3CoderToolParser(TOOLS), text) == expected
    for chunks in chunkings(text, n_random=10):
        assert _stream(Qwen3CoderToolParser(TOOLS), chunks) == expected


@pytest.mark.parametrize("schema, text, value", [
    ({"type": "string"}, "42", "42"),
    ({"type": "string"}, "  spaced \n", "  spaced \n"),
    ({"type": "integer"}, " 42 ", 42),
    ({"type": "integer"}, "4.0", 4),
    ({"type": "integer"}, "four", "four"),
    ({"type": "number"}, "2.5", 2.5),
    ({"type": "number"}, "7", 7),
    ({"type": "number"}, "inf", "inf"),
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "no", "no"),
    ({"type": "object"}, '{"a": [1, 2]}', {"a": [1, 2]}),
    ({"type": "object"}, "{'a': None}", {"a": None}),
    ({"type": "object"}, "[1]", "[1]"),
    ({"type": "array"}, "[1, \"x\"]", [1, "x"]),
    ({"type": "array"}, "{1, 2}", "{1, 2}"),               # a Python set is not JSON
    ({"type": "null"}, "null", None),
    ({"type": ["integer", "null"]}, "null", None),
    ({"type": ["integer", "string"]}, "12", 12),
    ({"type": ["integer", "string"]}, "twelve", "twelve"),
    ({"anyOf": [{"type": "number"}, {"type": "string"}]}, "1.5", 1.5),
    (None, "plain", "plain"),
    (None, "12", "12"),                                    # unknown params stay strings...
    (None, '{"k": 1}', {"k": 1}),                          # ...unless they are JSON objects / arrays
    ({"description": "no type"}, "[1, 2]", [1, 2]),
])
def test_schema_typing(schema, text, value):
    out = convert_parameter(text, schema)
    assert out == value and type(out) is type(value)


def test_unknown_parameter_kept():
    _, calls = Qwen3CoderToolParser(TOOLS).parse(
        "<tool_call>\n<function=bare_tool>\n<parameter=n>\n2\n</parameter>\n<parameter=extra>\n5\n</parameter>\n"
        "<parameter=blob>\n{\"x\": 1}\n</parameter>\n</function>\n</tool_call>")
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": 2, "extra": "5", "blob": {"x": 1}}


def test_tool_choice():
    assert make_tool_parser(TOOLS, "none") is None
    assert make_tool_parser(None, "auto") is None and make_tool_parser([], "required") is None
    for choice in ("auto", "required", None):
        assert make_tool_parser(TOOLS, choice).parse(CALL_TEXT)[1]
    named = make_tool_parser(TOOLS, {"type": "function", "function": {"name": "run_code"}})
    content, calls = named.parse(CALL_TEXT)
    assert [c["function"]["name"] for c in calls] == ["run_code"]
    assert calls[0]["function"]["arguments"] == '{"code": "def f(x):\\n    return x < 3  # </param\\n", "timeout": null}'
    assert content.startswith("I'll check both cities.\n\n<tool_call>\n<function=get_weather>")  # dropped to content
    with pytest.raises(ValueError, match="not in tools"):
        make_tool_parser(TOOLS, {"type": "function", "function": {"name": "missing"}})
    with pytest.raises(ValueError, match="tool_choice"):
        make_tool_parser(TOOLS, "sometimes")
    with pytest.raises(ValueError, match="tool_choice"):
        make_tool_parser(TOOLS, {"type": "function"})


def test_template_round_trip(tmp_path: Path):
    """What the demo template renders for an assistant's tool calls parses back to the same calls."""
    from tinyserve.demo import write_demo_tokenizer_files
    from tinyserve.tokenizer import Tokenizer

    write_demo_tokenizer_files(tmp_path)
    tok = Tokenizer.from_folder(tmp_path)
    args = [{"city": "Zürich", "days": 2, "metric": False, "options": {"a": [1, {"b": None}]}, "tags": ["x", "y"]},
            {"code": "print('<tool_call>')\nx = 1\n", "timeout": 30}]
    names = ["get_weather", "run_code"]
    message = {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(zip(names, args))]}
    prompt = tok.apply_chat_template([{"role": "user", "content": "go"}, message], tools=TOOLS,
                                     add_generation_prompt=False)
    output = prompt.split("<|im_start|>assistant\n")[-1].removesuffix("<|im_end|>\n")
    assert _whole(Qwen3CoderToolParser(TOOLS), output) == ("Sure.", list(zip(names, args)))
    assert _stream(Qwen3CoderToolParser(TOOLS), list(output)) == ("Sure.", list(zip(names, args)))


def test_reasoning_then_tools_pipeline():
    """The API chains them: reasoning parser first, its content deltas into the tool parser."""
    text = "<think>\nI need <tool_call> weather.\n</think>\n\n" + CALL_TEXT
    for chunks in chunkings(text, n_random=10)[:60]:
        rp, tp = Qwen3ReasoningParser(), Qwen3CoderToolParser(TOOLS)
        reasoning, calls, content = "", {}, []
        for piece in chunks:
            r, c = rp.feed(piece)
            reasoning += r
            _collect(tp.feed(c), calls, content)
        r, c = rp.finish()
        reasoning += r
        _collect(tp.feed(c) + tp.finish(), calls, content)
        assert reasoning == "I need <tool_call> weather."
        assert ("".join(content), [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())]) \
            == CALL_EXPECTED


# ---------------------------------------------------------------------------------------------------------------
# property tests: arbitrary text never breaks the parsers; streaming always equals parsing whole

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=x>",
           "<parameter=city>", "<parameter=days>", "</parameter>", "</function>", "<", "</", "think>", "tool_",
           "\n", " ", "a", "7", "é", "🎉", "{", "}"]
_texts = st.lists(st.sampled_from(_PIECES), max_size=25).map("".join)


def _split(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(text=_texts, cuts=st.lists(st.integers(0, 10_000), max_size=8), starts=st.booleans())
def test_reasoning_property(text, cuts, starts):
    p = Qwen3ReasoningParser(starts_in_reasoning=starts)
    r_out = c_out = ""
    for piece in _split(text, cuts):
        r, c = p.feed(piece)
        r_out, c_out = r_out + r, c_out + c
    r, c = p.finish()
    assert (r_out + r or None, c_out + c) == Qwen3ReasoningParser(starts_in_reasoning=starts).parse(text)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(text=_texts, cuts=st.lists(st.integers(0, 10_000), max_size=8))
def test_tool_parser_never_raises(text, cuts):
    content, calls = Qwen3CoderToolParser(TOOLS).parse(text)
    for c in calls:
        assert isinstance(json.loads(c["function"]["arguments"]), dict)
    if not calls:
        assert content.strip() == text.strip() or "<tool_call>" in text
    _stream(Qwen3CoderToolParser(TOOLS), _split(text, cuts))  # valid JSON arguments, well-formed deltas


_values = st.lists(st.sampled_from(list("ab <>/=\n{}\"'é🎉") + ["</", "<parameter", "tool_call>"]),
                   max_size=30).map("".join).filter(lambda v: "</parameter>" not in v and "</function>" not in v)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(prefix=st.text(alphabet="ab .\n<", max_size=10).filter(lambda s: "<tool_call>" not in s),
       calls=st.lists(st.tuples(_values, st.one_of(st.none(), st.integers(-5, 10**6))), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_well_formed_calls_round_trip(prefix, calls, cuts):
    text = prefix.rstrip() + ("\n\n" if prefix.strip() else "")
    expected = []
    for code, timeout in calls:
        text += f"<tool_call>\n<function=run_code>\n<parameter=code>\n{code}\n</parameter>\n"
        args = {"code": code}
        if timeout is not None:
            text += f"<parameter=timeout>\n{timeout}\n</parameter>\n"
            args["timeout"] = timeout
        text += "</function>\n</tool_call>\n"
        expected.append(("run_code", args))
    want = (prefix.rstrip() if prefix.strip() else "", expected)
    assert _whole(Qwen3CoderToolParser(TOOLS), text) == want
    assert _stream(Qwen3CoderToolParser(TOOLS), _split(text, cuts), want[0]) == want
