"""The peers' published test cases for the Qwen3-Coder XML tool-call format and the qwen3 reasoning format, run
against tinyserve's parsers the way the server chains them (chat.ChatFormat / ChatStreamChoice: reasoning parser,
then tool parser), whole and streamed at every split into two chunks, one character at a time and at random
chunkings. Every case must give the same reasoning, content and calls in all of them.

Transcribed (inputs and expected outputs; the code is ours) from:
  vllm-project/vllm  tests/tool_parsers/test_qwen3coder_tool_parser.py             [vllm-coder]
  vllm-project/vllm  tests/tool_parsers/test_qwen3_xml_coder_shared.py             [vllm-shared]
  vllm-project/vllm  tests/reasoning/test_qwen3_reasoning_parser.py                [vllm-reasoning]
  vllm-project/vllm  tests/reasoning/test_qwen3_tool_call_recovery.py              [vllm-recovery]
  sgl-project/sglang test/registered/function_call/test_qwen3_coder_detector/      [sglang]
                     test_cases.py and the Qwen3CoderDetector unit tests
  ggml-org/llama.cpp tests/test-chat.cpp, the Qwen3-Coder and Qwen3.5 blocks      [llama.cpp]
  and the raw outputs quoted in public bug reports (vllm #57699, ollama #18530, sglang #40739, ollama #18421).

Deliberate differences from a peer's convention (each case notes which applies):
  ws       whitespace between content and a call, between calls and after the last call is dropped (vLLM keeps a
           "\\n" between parallel calls, SGLang keeps the text's trailing newlines; llama.cpp compares stripped).
  none     no content is "" here (vLLM returns None); the API writes null when there are tool calls.
  declared a call of a function the request does not declare stays text (vLLM's parser, built without tools,
           calls anything); the transcribed cases declare the function they call.
  prompt   whether the answer starts inside a think block is read from the template's generation prompt, not
           guessed from the output: vLLM's "prefix format" cases (output with `</think>` but no `<think>`) are run
           with the prompt that opened the block; without it such text is content.
  open     an output that opens `<think>` and never closes it is reasoning, streamed or not (vLLM returns it as
           content when not streaming and as reasoning when streaming).
  order    a call made inside the think block, followed by `</think>` and text: the call, then the text as content
           (vLLM moves the text before the call; the message has the same content and calls).
  stream   arguments stream one whole parameter at a time, once the rest of the call confirms it (vLLM streams
           values as they grow); the concatenation is the same JSON. A value with no markup in it is confirmed by its
           call's closing tags, so the delta that closes the call carries its last argument (vLLM's speculative-decode
           case below); one that quotes markup waits for what follows.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from tinyserve.chat import ChatFormat, ChatRequest, ChatStreamChoice
from tinyserve.generation import Choice
from tinyserve.protocol import GenerationOptions
from tinyserve.sampling import SamplingParams


def tool(name: str, props: dict[str, Any] | None = None, required: list[str] | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"type": "object"}
    if props is not None:
        params["properties"] = props
    if required is not None:
        params["required"] = required
    return {"type": "function", "function": {"name": name, "parameters": params}}


S, I = {"type": "string"}, {"type": "integer"}
# vLLM's sample tools
WEATHER = tool("get_current_weather", {"city": S, "state": S, "unit": {"type": "string",
                                                                      "enum": ["fahrenheit", "celsius"]}},
               ["city", "state"])
AREA = tool("calculate_area", {"shape": S, "dimensions": {"type": "object"}, "precision": I})
TYPES = tool("test_types", {"int_param": I, "float_param": {"type": "float"}, "bool_param": {"type": "boolean"},
                            "str_param": S, "obj_param": {"type": "object"}})
WRITE_FILE = tool("write_file", {"path": S, "content": S})
GET_WEATHER = tool("get_weather", {"city": S})
ANYOF = tool("test_anyof", {
    "anyof_int": {"anyOf": [I, {"type": "null"}], "default": 5},
    "anyof_str": {"anyOf": [S, {"type": "null"}]},
    "anyof_array": {"anyOf": [{"type": "array", "items": S}, {"type": "null"}]},
    "anyof_obj": {"anyOf": [{"type": "object"}, {"type": "null"}]},
    "type_as_array": {"type": ["integer", "null"]},
    "multi_non_null": {"anyOf": [S, I, {"type": "null"}]}})
# SGLang's
SG_WEATHER = tool("get_current_weather", {"location": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                          "days": I}, ["location"])
SQL = tool("sql_interpreter", {"query": S, "dry_run": {"type": "boolean"}})
TODO_WRITE = tool("TodoWrite", {"todos": {"type": "array", "items": {"type": "object", "properties": {
    "content": S, "status": S}, "required": ["content", "status"]}}})
# llama.cpp's
SPECIAL = tool("special_function", {"arg1": I}, ["arg1"])
SPECIAL_OPT = tool("special_function_with_opt", {"arg1": I, "arg2": I}, ["arg1"])
PYTHON = tool("python", {"code": S}, ["code"])
HTML = tool("html", {"markup": S}, ["markup"])
TODO_LIST = tool("todo_list", {"todos": {"type": "array"}}, ["todos"])
EDIT = tool("edit", {"filename": S, "oldString": S, "newString": S}, ["filename", "oldString", "newString"])
TERMINAL = tool("run_in_terminal", {"command": S}, ["command"])
EMPTY_ARGS = tool("empty_args", {})
EMPTY_NO_PROPS = tool("empty_args_no_props")
REQ2_OPT4 = tool("tool_2req_4opt", {"req1": S, "req2": I, "opt1": S, "opt2": I, "opt3": S, "opt4": I},
                 ["req1", "req2"])
REQ2_OPT5 = tool("tool_2req_5opt", {"req1": S, "req2": I, "opt1": S, "opt2": I, "opt3": S, "opt4": I, "opt5": S},
                 ["req1", "req2"])


@dataclass
class Case:
    id: str
    tools: list[dict[str, Any]]
    text: str
    content: str
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    reasoning: str | None = None
    starts: bool | None = None        # None: no reasoning parser; else whether the prompt opened <think>
    conventions: tuple[str, ...] = ()  # the deliberate differences (module docstring) this case touches


DALLAS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
V_CALL = ("<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n"
          "</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>")
ORLANDO = V_CALL.replace("Dallas", "Orlando").replace("TX", "FL")
CIRCLE = ("<tool_call>\n<function=calculate_area>\n<parameter=shape>\ncircle\n</parameter>\n<parameter=dimensions>\n"
          "{\"radius\": 15.5}\n</parameter>\n<parameter=precision>\n3\n</parameter>\n</function>\n</tool_call>")
RECT = ("<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n<parameter=dimensions>\n"
        "{\"width\": 10, \n \"height\": 20}\n</parameter>\n<parameter=precision>\n2\n</parameter>\n</function>\n"
        "</tool_call>")
MISSING_CLOSE = ("Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\n"
                 "Dallas\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n"
                 "</function>\n</tool_call>")
XML_TAGS = ('char_deltas = [\n    "<tool_call>\\n",\n    "<parameter=query>\\n",\n    "\\n</parameter>\\n",\n'
            '    "</function>\\n",\n]\n')
PARAM_LINES = ('TOOL_CALL_TEMPLATE = """\n</parameter>\n<parameter=new_string>\n#!/usr/bin/env python3\n'
               '</parameter>\n"""\n')
REAL_NAME = 'doc = """\n<parameter=path>\nliteral/value\n</parameter>\n"""\n'
NESTED = ('doc = """\n<tool_call>\n<function=write_file>\n<parameter=path>\nliteral/value.txt\n</parameter>\n'
          '<parameter=content>\nhello\n</parameter>\n</function>\n</tool_call>\n"""\n')
OUT_OF_SCHEMA = ('template = """\n<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n</function>\n'
                 '</tool_call>\n"""\n')
TWO_CALLS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
             "<tool_call>\n<function=get_weather>\n<parameter=city>\nLondon\n</parameter>\n</function>\n</tool_call>")
FINISH_BLOCK = ("<tool_call>\n<function=Finish>\n<parameter=answer>\n204\n</parameter>\n</function>\n</tool_call>")
FINISH = tool("Finish", {"answer": S})
L_CALL = "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>"
L_CALL_OPT = ("<tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n</parameter>\n<parameter=arg2>\n"
              "2\n</parameter>\n</function>\n</tool_call>")
L_PY = ('<tool_call>\n<function=python>\n<parameter=code>\ndef hello():\n    print("Hello, world!")\n\nhello()\n'
        "</parameter>\n</function>\n</tool_call>")
PWD = "<tool_call>\n<function=run_in_terminal>\n<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>"

CASES = [
    # ---- vLLM: tests/tool_parsers/test_qwen3coder_tool_parser.py and test_qwen3_xml_coder_shared.py
    Case("vllm-no-tools", [WEATHER, AREA], "This is a test response without any tool calls",
         "This is a test response without any tool calls"),
    Case("vllm-single-tool", [WEATHER, AREA], V_CALL, "", [("get_current_weather", DALLAS)], conventions=("none",)),
    Case("vllm-single-tool-with-content", [WEATHER, AREA], "Sure! Let me check the weather for you." + V_CALL,
         "Sure! Let me check the weather for you.", [("get_current_weather", DALLAS)]),
    Case("vllm-multiline-param", [WEATHER, AREA], RECT, "",
         [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})]),
    Case("vllm-parallel-tools", [WEATHER, AREA], V_CALL + "\n" + ORLANDO, "",
         [("get_current_weather", DALLAS), ("get_current_weather", {"city": "Orlando", "state": "FL",
                                                                    "unit": "fahrenheit"})], conventions=("ws",)),
    Case("vllm-typed-params", [WEATHER, AREA], "Let me calculate that area for you." + CIRCLE,
         "Let me calculate that area for you.",
         [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})]),
    Case("vllm-fallback-no-tags", [WEATHER, AREA],
         "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n"
         "</parameter>\n</function>", "", [("get_current_weather", {"city": "Dallas", "state": "TX"})]),
    Case("vllm-type-conversion", [TYPES],
         "<tool_call>\n<function=test_types>\n<parameter=int_param>\n42\n</parameter>\n<parameter=float_param>\n3.14\n"
         "</parameter>\n<parameter=bool_param>\ntrue\n</parameter>\n<parameter=str_param>\nhello world\n</parameter>\n"
         "<parameter=obj_param>\n{\"key\": \"value\"}\n</parameter>\n</function>\n</tool_call>", "",
         [("test_types", {"int_param": 42, "float_param": 3.14, "bool_param": True, "str_param": "hello world",
                          "obj_param": {"key": "value"}})]),
    Case("vllm-missing-closing-parameter", [WEATHER, AREA], MISSING_CLOSE, "Let me check the weather for you:",
         [("get_current_weather", DALLAS)]),
    Case("vllm-single-quote-object", [TYPES],
         "<tool_call>\n<function=test_types>\n<parameter=obj_param>\n{'key': 'value'}\n</parameter>\n</function>\n"
         "</tool_call>", "", [("test_types", {"obj_param": {"key": "value"}})]),
    Case("vllm-missing-opening-tag", [WEATHER, AREA],
         "I'll check the weather for you.\n\n" + V_CALL.removeprefix("<tool_call>\n"),
         "I'll check the weather for you.", [("get_current_weather", DALLAS)]),
    Case("vllm-no-whitespace-content-before-call", [WEATHER, AREA], "\n\n" + V_CALL.replace(
        "<parameter=unit>\nfahrenheit\n</parameter>\n", ""), "", [("get_current_weather", {"city": "Dallas",
                                                                                           "state": "TX"})]),
    Case("vllm-no-gt-delimiter", [WEATHER],
         "<tool_call>\n<function=get_current_weather\n<parameter=city>Dallas</parameter>\n</function>\n</tool_call>",
         "<tool_call>\n<function=get_current_weather\n<parameter=city>Dallas</parameter>\n</function>\n</tool_call>"),
    Case("vllm-none-tool-calls-filtered", [WEATHER],
         "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>\n<tool_call>\n<function=get_current_weather>"
         "\n<parameter=city>Dallas</parameter>\n<parameter=state>TX</parameter>\n</function>\n</tool_call>",
         "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>",
         [("get_current_weather", {"city": "Dallas", "state": "TX"})]),
    Case("vllm-no-double-serialization", [tool("greet", {"message": S})],
         "<tool_call>\n<function=greet>\n<parameter=message>hello world</parameter>\n</function>\n</tool_call>", "",
         [("greet", {"message": "hello world"})]),
    Case("vllm-speculative-decode-loss", [tool("test", {"city": S})],
         "<tool_call>\n<function=test>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", "",
         [("test", {"city": "Paris"})], conventions=("declared",)),
    Case("vllm-string-null-preserved", [tool("search", {"query": S})],
         "<tool_call>\n<function=search>\n<parameter=query>null</parameter>\n</function>\n</tool_call>", "",
         [("search", {"query": "null"})]),
    Case("vllm-anyof-string-null-keeps-string", [tool("set_code", {"code": {"anyOf": [S, {"type": "null"}]}})],
         "<tool_call>\n<function=set_code>\n<parameter=code>42</parameter>\n</function>\n</tool_call>", "",
         [("set_code", {"code": "42"})]),
    Case("vllm-anyof-integer-null", [tool("set_count", {"count": {"anyOf": [I, {"type": "null"}]}})],
         "<tool_call>\n<function=set_count>\n<parameter=count>42</parameter>\n</function>\n</tool_call>", "",
         [("set_count", {"count": 42})]),
    Case("vllm-anyof-object-not-double-encoded",
         [tool("update_record", {"data": {"anyOf": [{"type": "object"}, {"type": "null"}]}})],
         "<tool_call>\n<function=update_record>\n<parameter=data>{\"key\": \"value\", \"count\": 42}</parameter>\n"
         "</function>\n</tool_call>", "", [("update_record", {"data": {"key": "value", "count": 42}})]),
    Case("vllm-anyof-types", [ANYOF],
         "<tool_call>\n<function=test_anyof>\n<parameter=anyof_int>5</parameter>\n<parameter=anyof_str>hello"
         "</parameter>\n<parameter=anyof_array>[\"a\", \"b\", \"c\"]</parameter>\n<parameter=anyof_obj>"
         "{\"key\": \"value\"}</parameter>\n<parameter=type_as_array>42</parameter>\n<parameter=multi_non_null>"
         "some text</parameter>\n</function>\n</tool_call>", "",
         [("test_anyof", {"anyof_int": 5, "anyof_str": "hello", "anyof_array": ["a", "b", "c"],
                          "anyof_obj": {"key": "value"}, "type_as_array": 42, "multi_non_null": "some text"})]),
    Case("vllm-anyof-streaming", [tool("search_web", {"query": {"anyOf": [S, {"type": "null"}]},
                                                      "count": {"anyOf": [I, {"type": "null"}]},
                                                      "verbose": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}})],
         "<tool_call>\n<function=search_web>\n<parameter=query>vllm tool parser</parameter>\n<parameter=count>10"
         "</parameter>\n<parameter=verbose>true</parameter>\n</function>\n</tool_call>", "",
         [("search_web", {"query": "vllm tool parser", "count": 10, "verbose": True})]),
    Case("vllm-double-encoded-object", [tool("process", {"name": S, "data": {"type": "object"}})],
         "<tool_call>\n<function=process>\n<parameter=name>\nhello\n</parameter>\n<parameter=data>\n"
         "\"{'key': 'value', 'n': 1}\"\n</parameter>\n</function>\n</tool_call>\n", "",
         [("process", {"name": "hello", "data": {"key": "value", "n": 1}})]),
    Case("vllm-xml-structural-tags-in-content", [WRITE_FILE],
         "<tool_call>\n<function=write_file>\n<parameter=path>\ntest.py\n</parameter>\n"
         f"<parameter=content>\n{XML_TAGS}</parameter>\n</function>\n</tool_call>\n", "",
         [("write_file", {"path": "test.py", "content": XML_TAGS.rstrip("\n")})]),
    Case("vllm-param-like-lines-in-content", [WRITE_FILE],
         "<tool_call>\n<function=write_file>\n<parameter=path>\ntest_template.py\n</parameter>\n"
         f"<parameter=content>\n{PARAM_LINES}</parameter>\n</function>\n</tool_call>\n", "",
         [("write_file", {"path": "test_template.py", "content": PARAM_LINES.rstrip("\n")})]),
    Case("vllm-array-with-json-bool", [tool("pick", {"items": {"type": "array"}})],
         "<tool_call>\n<function=pick>\n<parameter=items>\n[\"a\", \"b\", 1, true]\n</parameter>\n</function>\n"
         "</tool_call>", "", [("pick", {"items": ["a", "b", 1, True]})]),
    Case("vllm-two-calls-in-one-chunk", [GET_WEATHER], TWO_CALLS, "",
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})]),
    Case("vllm-python-none-for-nullable-int", [tool("set_count", {"count": {"anyOf": [I, {"type": "null"}]}})],
         "<tool_call>\n<function=set_count>\n<parameter=count>None</parameter>\n</function>\n</tool_call>", "",
         [("set_count", {"count": None})]),
    Case("vllm-two-calls-then-text", [GET_WEATHER], TWO_CALLS + "\nAll done!", "All done!",
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})]),
    Case("vllm-text-after-final-close", [GET_WEATHER],
         "<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</tool_call>\n"
         "I hope this helps!", "I hope this helps!", [("get_weather", {"city": "Paris"})]),
    Case("vllm-real-param-name-literal", [WRITE_FILE],
         "<tool_call>\n<function=write_file>\n<parameter=path>\nfixture.py\n</parameter>\n"
         f"<parameter=content>\n{REAL_NAME}</parameter>\n</function>\n</tool_call>", "",
         [("write_file", {"path": "fixture.py", "content": REAL_NAME.rstrip("\n")})]),
    Case("vllm-full-nested-tool-call", [WRITE_FILE],
         "<tool_call>\n<function=write_file>\n<parameter=path>\nfixture.py\n</parameter>\n"
         f"<parameter=content>\n{NESTED}</parameter>\n</function>\n</tool_call>", "",
         [("write_file", {"path": "fixture.py", "content": NESTED.rstrip("\n")})]),
    Case("vllm-out-of-schema-nested-literal", [WRITE_FILE, tool("foo", {"bar": S})],
         "<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n</function>\n</tool_call>\n\n"
         "<tool_call>\n<function=write_file>\n<parameter=path>\nfixture.py\n</parameter>\n"
         f"<parameter=content>\n{OUT_OF_SCHEMA}</parameter>\n</function>\n</tool_call>", "",
         [("foo", {"bar": "baz"}), ("write_file", {"path": "fixture.py", "content": OUT_OF_SCHEMA.rstrip("\n")})],
         conventions=("declared",)),
    Case("vllm-jinja-phantom-call", [WRITE_FILE],
         "<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n</function>\n"
         "</tool_call>\n\n<tool_call>\n<function=write_file>\n<parameter=path>\nout.txt\n</parameter>\n"
         "<parameter=content>\nhello\n</parameter>\n</function>\n</tool_call>",
         "<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n</function>\n"
         "</tool_call>", [("write_file", {"path": "out.txt", "content": "hello"})]),
    Case("vllm-inline-empty-tool-call", [tool("log", {"msg": S})],
         "I'll show: <tool_call>example</tool_call>. Now real:\n<tool_call>\n<function=log>\n<parameter=msg>\nhi\n"
         "</parameter>\n</function>\n</tool_call>", "I'll show: <tool_call>example</tool_call>. Now real:",
         [("log", {"msg": "hi"})]),
    Case("vllm-anyof-string-null-literal-null", [tool("set_value", {"optional": {"anyOf": [S, {"type": "null"}]}})],
         "<tool_call>\n<function=set_value>\n<parameter=optional>null</parameter>\n</function>\n</tool_call>", "",
         [("set_value", {"optional": None})]),
    Case("vllm-anyof-string-null-literal-None", [tool("set_value", {"optional": {"anyOf": [S, {"type": "null"}]}})],
         "<tool_call>\n<function=set_value>\n<parameter=optional>None</parameter>\n</function>\n</tool_call>", "",
         [("set_value", {"optional": None})]),
    # ---- vLLM: tests/reasoning/test_qwen3_reasoning_parser.py
    Case("vllm-reasoning-with-think", [], "<think>This is a reasoning section</think>This is the rest",
         "This is the rest", reasoning="This is a reasoning section", starts=False),
    Case("vllm-reasoning-without-think", [], "This is the rest", "This is the rest", starts=False),
    Case("vllm-reasoning-complete", [], "<think>This is a reasoning section</think>", "",
         reasoning="This is a reasoning section", starts=False, conventions=("none",)),
    Case("vllm-reasoning-multiline", [], "<think>This is a reasoning\nsection</think>This is the rest\nThat",
         "This is the rest\nThat", reasoning="This is a reasoning\nsection", starts=False),
    Case("vllm-reasoning-only-open-tag", [], "<think>This is a reasoning section", "",
         reasoning="This is a reasoning section", starts=False, conventions=("open", "none")),
    Case("vllm-reasoning-prefix-format", [], "This is a reasoning section</think>This is the rest",
         "This is the rest", reasoning="This is a reasoning section", starts=True, conventions=("prompt",)),
    Case("vllm-reasoning-prefix-format-complete", [], "This is a reasoning section</think>", "",
         reasoning="This is a reasoning section", starts=True, conventions=("prompt", "none")),
    Case("vllm-reasoning-prefix-format-multiline", [], "This is a reasoning\nsection</think>This is the rest\nThat",
         "This is the rest\nThat", reasoning="This is a reasoning\nsection", starts=True, conventions=("prompt",)),
    # ---- vLLM: tests/reasoning/test_qwen3_tool_call_recovery.py
    Case("vllm-recovery-call-inside-think", [FINISH],
         "<think>The verification confirms my solution:\n- s = 2.5 km/h\n- t = 24 minutes\n- Total time at speed 3 "
         "km/h = 204 minutes\n\n" + FINISH_BLOCK + "\n</think>", "", [("Finish", {"answer": "204"})],
         reasoning="The verification confirms my solution:\n- s = 2.5 km/h\n- t = 24 minutes\n- Total time at "
                   "speed 3 km/h = 204 minutes", starts=False),
    Case("vllm-recovery-text-after-think", [FINISH], "<think>verify result\n" + FINISH_BLOCK +
         "</think>Here is the answer.", "Here is the answer.", [("Finish", {"answer": "204"})],
         reasoning="verify result", starts=False, conventions=("order",)),
    Case("vllm-recovery-trailing-text", [FINISH], "<think>verify result\n" + FINISH_BLOCK +
         "</think>assistant trailing text", "assistant trailing text", [("Finish", {"answer": "204"})],
         reasoning="verify result", starts=False, conventions=("order",)),
    Case("vllm-recovery-truncated-reasoning", [FINISH], "verify result\n" + FINISH_BLOCK, "",
         [("Finish", {"answer": "204"})], reasoning="verify result", starts=True, conventions=("prompt",)),
    Case("vllm-recovery-normal-reasoning", [FINISH],
         "<think>Let me think about this carefully.\nThe answer is 42.</think>The answer is 42.", "The answer is 42.",
         reasoning="Let me think about this carefully.\nThe answer is 42.", starts=False),
    Case("vllm-recovery-post-think-content", [FINISH], "<think>some reasoning</think>plain response text",
         "plain response text", reasoning="some reasoning", starts=False),
    # ---- SGLang: Qwen3CoderDetector tests
    Case("sglang-plain-text", [SG_WEATHER, SQL, TODO_WRITE], "This is plain text test", "This is plain text test"),
    Case("sglang-single-tool", [SG_WEATHER, SQL, TODO_WRITE],
         "<function=get_current_weather>\n<parameter=location>Boston</parameter>\n<parameter=unit>celsius</parameter>"
         "\n<parameter=days>3</parameter>\n</function>", "",
         [("get_current_weather", {"location": "Boston", "unit": "celsius", "days": 3})]),
    Case("sglang-single-tool-with-text", [SG_WEATHER, SQL, TODO_WRITE],
         "Text prefix + tool call test\n\n<function=get_current_weather>\n<parameter=location>Boston</parameter>\n"
         "<parameter=unit>celsius</parameter>\n<parameter=days>3</parameter>\n</function>",
         "Text prefix + tool call test", [("get_current_weather", {"location": "Boston", "unit": "celsius",
                                                                   "days": 3})], conventions=("ws",)),
    Case("sglang-double-tool-call", [SG_WEATHER, SQL, TODO_WRITE],
         "Text prefix + double tool call test\n\n<function=get_current_weather>\n<parameter=location>New York"
         "</parameter>\n</function>\n<function=sql_interpreter>\n<parameter=query>SELECT * FROM users</parameter>\n"
         "<parameter=dry_run>True</parameter>\n</function>\n", "Text prefix + double tool call test",
         [("get_current_weather", {"location": "New York"}),
          ("sql_interpreter", {"query": "SELECT * FROM users", "dry_run": True})], conventions=("ws",)),
    Case("sglang-implicit-parameter-close", [SG_WEATHER, SQL, TODO_WRITE],
         "Text prefix + implicit parameter close test\n\n<function=get_current_weather>\n<parameter=location>Paris\n"
         "<parameter=unit>celsius\n<parameter=days>3\n</function>", "Text prefix + implicit parameter close test",
         [("get_current_weather", {"location": "Paris", "unit": "celsius", "days": 3})], conventions=("ws",)),
    Case("sglang-complex-schema", [SG_WEATHER, SQL, TODO_WRITE],
         "Text prefix + complex schema tool call test\n\n<function=TodoWrite>\n<parameter=todos>\n[\n {\"content\": "
         "\"Buy a new car\", \"status\": 'pending'},\n {\"content\": \"Buy a new house\", \"status\": \"completed\"}\n"
         "]\n</parameter>\n</function>\n\n", "Text prefix + complex schema tool call test",
         [("TodoWrite", {"todos": [{"content": "Buy a new car", "status": "pending"},
                                   {"content": "Buy a new house", "status": "completed"}]})], conventions=("ws",)),
    Case("sglang-multiple-tool-calls", [SG_WEATHER, SQL, TODO_WRITE],
         "<tool_call>\n<function=get_current_weather>\n<parameter=location>New York</parameter>\n</function>\n"
         "</tool_call>\n<tool_call>\n<function=sql_interpreter>\n<parameter=query>SELECT * FROM users</parameter>\n"
         "<parameter=dry_run>True</parameter>\n</function>\n</tool_call>", "",
         [("get_current_weather", {"location": "New York"}),
          ("sql_interpreter", {"query": "SELECT * FROM users", "dry_run": True})]),
    Case("sglang-empty-parameter-value", [SG_WEATHER, SQL, TODO_WRITE],
         "<tool_call>\n<function=get_current_weather>\n<parameter=location></parameter>\n</function>\n</tool_call>",
         "", [("get_current_weather", {"location": ""})]),
    Case("sglang-special-characters", [SG_WEATHER, SQL, TODO_WRITE],
         "<tool_call>\n<function=sql_interpreter>\n<parameter=query>SELECT * FROM users WHERE name = 'John \"Doe\"'"
         "</parameter>\n</function>\n</tool_call>", "",
         [("sql_interpreter", {"query": "SELECT * FROM users WHERE name = 'John \"Doe\"'"})]),
    Case("sglang-incomplete-tool-call", [SG_WEATHER, SQL, TODO_WRITE],
         "<tool_call>\n<function=get_current_weather>\n<parameter=location>London", "",
         [("get_current_weather", {})]),
    # ---- llama.cpp: tests/test-chat.cpp, the Qwen3-Coder block
    Case("llamacpp-coder-content", [SPECIAL], "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?"),
    Case("llamacpp-coder-call", [SPECIAL], L_CALL, "", [("special_function", {"arg1": 1})]),
    Case("llamacpp-coder-parallel", [SPECIAL, SPECIAL_OPT], L_CALL + "\n" + L_CALL_OPT, "",
         [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    Case("llamacpp-coder-python", [PYTHON], L_PY, "",
         [("python", {"code": 'def hello():\n    print("Hello, world!")\n\nhello()'})]),
    Case("llamacpp-coder-cjk", [PYTHON],
         "<tool_call>\n<function=python>\n<parameter=code>\n格\n</parameter>\n</function>\n</tool_call>", "",
         [("python", {"code": "格"})]),
    Case("llamacpp-coder-html", [HTML],
         "<tool_call>\n<function=html>\n<parameter=markup>\n<html>\n <head>\n  <title>Hello!</title>\n </head>\n"
         "</html>\n</parameter>\n</function>\n</tool_call>", "",
         [("html", {"markup": "<html>\n <head>\n  <title>Hello!</title>\n </head>\n</html>"})]),
    Case("llamacpp-coder-todo-list", [TODO_LIST],
         "<tool_call>\n<function=todo_list>\n<parameter=todos>\n[{\"item\": \"Check stuff\", \"selected\": false}, "
         "{\"item\": \"Prepare stuff\", \"selected\": true}]\n</parameter>\n</function>\n</tool_call>", "",
         [("todo_list", {"todos": [{"item": "Check stuff", "selected": False},
                                   {"item": "Prepare stuff", "selected": True}]})]),
    Case("llamacpp-coder-optional-order-4", [REQ2_OPT4],
         "<tool_call>\n<function=tool_2req_4opt>\n<parameter=req1>\nhello\n</parameter>\n<parameter=req2>\n42\n"
         "</parameter>\n<parameter=opt4>\n100\n</parameter>\n<parameter=opt2>\n200\n</parameter>\n</function>\n"
         "</tool_call>", "", [("tool_2req_4opt", {"req1": "hello", "req2": 42, "opt4": 100, "opt2": 200})]),
    Case("llamacpp-coder-optional-order-5", [REQ2_OPT5],
         "<tool_call>\n<function=tool_2req_5opt>\n<parameter=req1>\ntest\n</parameter>\n<parameter=req2>\n99\n"
         "</parameter>\n<parameter=opt3>\nc\n</parameter>\n<parameter=opt1>\na\n</parameter>\n<parameter=opt5>\ne\n"
         "</parameter>\n<parameter=opt4>\n4\n</parameter>\n<parameter=opt2>\n2\n</parameter>\n</function>\n"
         "</tool_call>", "",
         [("tool_2req_5opt", {"req1": "test", "req2": 99, "opt3": "c", "opt1": "a", "opt5": "e", "opt4": 4,
                              "opt2": 2})]),
    Case("llamacpp-coder-nullable-string", [tool("set_nullable_str", {"name": {"type": ["string", "null"]}})],
         "<tool_call>\n<function=set_nullable_str>\n<parameter=name>\nhello world\n</parameter>\n</function>\n"
         "</tool_call>", "", [("set_nullable_str", {"name": "hello world"})]),
    Case("llamacpp-coder-nullable-int", [tool("set_nullable_int", {"count": {"type": ["integer", "null"]}})],
         "<tool_call>\n<function=set_nullable_int>\n<parameter=count>\n42\n</parameter>\n</function>\n</tool_call>",
         "", [("set_nullable_int", {"count": 42})]),
    Case("llamacpp-coder-enum-without-type", [tool("set_unit", {"unit": {"enum": ["celsius", "fahrenheit"]}})],
         "<tool_call>\n<function=set_unit>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>", "",
         [("set_unit", {"unit": "celsius"})]),
    Case("llamacpp-coder-bare-function", [SPECIAL],
         "<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>", "",
         [("special_function", {"arg1": 1})]),
    Case("llamacpp-coder-bare-function-parallel", [SPECIAL, SPECIAL_OPT],
         "<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>\n" + L_CALL_OPT,
         "", [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    # ---- llama.cpp: tests/test-chat.cpp, the Qwen3.5 block (its prompt opens <think> unless thinking is off)
    Case("llamacpp-q35-thoughts", [], "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?",
         "Hello, world!\nWhat's up?", reasoning="I'm\nthinking", starts=True),
    Case("llamacpp-q35-call-no-thinking", [SPECIAL], L_CALL, "", [("special_function", {"arg1": 1})],
         starts=False),
    Case("llamacpp-q35-thoughts-then-call", [SPECIAL], "I'm\nthinking\n</think>\n\n" + L_CALL, "",
         [("special_function", {"arg1": 1})], reasoning="I'm\nthinking", starts=True),
    Case("llamacpp-q35-parallel", [SPECIAL, SPECIAL_OPT], L_CALL + "\n" + L_CALL_OPT, "",
         [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})], starts=False),
    Case("llamacpp-q35-python", [PYTHON], L_PY, "",
         [("python", {"code": 'def hello():\n    print("Hello, world!")\n\nhello()'})], starts=False),
    Case("llamacpp-q35-json-after-thinking", [], "I need to output the invoice details in JSON\n</think>\n\n"
         '{"amount": 123.45, "date": "2025-12-03"}', '{"amount": 123.45, "date": "2025-12-03"}',
         reasoning="I need to output the invoice details in JSON", starts=True),
    Case("llamacpp-q35-draft-call-in-reasoning", [PYTHON],
         "Let's call a tool: " + L_PY.replace("Hello, world!", "Not the real call!") + "\n</think>\n\n" + L_PY, "",
         [("python", {"code": 'def hello():\n    print("Hello, world!")\n\nhello()'})],
         reasoning="Let's call a tool: " + L_PY.replace("Hello, world!", "Not the real call!"), starts=True),
    Case("llamacpp-q35-empty-args", [EMPTY_ARGS], "<tool_call>\n<function=empty_args>\n</function>\n</tool_call>",
         "", [("empty_args", {})], starts=False),
    Case("llamacpp-q35-empty-args-no-props", [EMPTY_NO_PROPS],
         "<tool_call>\n<function=empty_args_no_props>\n</function>\n</tool_call>", "",
         [("empty_args_no_props", {})], starts=False),
    Case("llamacpp-q35-call-inside-think", [TERMINAL], "Need to inspect the current directory.\n" + PWD, "",
         [("run_in_terminal", {"command": "pwd"})], reasoning="Need to inspect the current directory.", starts=True),
    Case("llamacpp-q35-reasoning-content-call", [TERMINAL],
         "I should inspect the directory.\n</think>\n\nLet me inspect it now.\n" + PWD, "Let me inspect it now.",
         [("run_in_terminal", {"command": "pwd"})], reasoning="I should inspect the directory.", starts=True),
    Case("llamacpp-q35-value-trailing-newline", [EDIT],
         "<tool_call>\n<function=edit>\n<parameter=filename>\nfoo.c\n</parameter>\n<parameter=oldString>\n#iclunde\n"
         "</parameter>\n<parameter=newString>\n#include\n\n</parameter>\n</function>\n</tool_call>", "",
         [("edit", {"filename": "foo.c", "oldString": "#iclunde", "newString": "#include\n"})], starts=False),
    Case("llamacpp-q35-code-leading-indent", [PYTHON],
         '<tool_call>\n<function=python>\n<parameter=code>\n    print("Hello, world!")\n</parameter>\n</function>\n'
         "</tool_call>", "", [("python", {"code": '    print("Hello, world!")'})], starts=False),
    # ---- bug reports (the raw outputs their reporters quote)
    Case("vllm-57699-missing-close-parameter-before-function", [tool("ThinQ_Connect", {"body": {"type": "object"}},
                                                                     ["body"])],
         "<tool_call>\n<function=ThinQ_Connect>\n<parameter=body>\n{\"airConJobMode\": \"AIR_CLEAN\", "
         "\"windStrength\": \"HIGH\", \"monitoringEnabled\": true}\n</function>\n</tool_call>", "",
         [("ThinQ_Connect", {"body": {"airConJobMode": "AIR_CLEAN", "windStrength": "HIGH",
                                      "monitoringEnabled": True}})]),
    Case("ollama-18530-missing-tool-call-opener", [tool("glob", {"pattern": S}, ["pattern"])],
         "I will first check for all Markdown files in the current directory and its subdirectories, and then list "
         "them using the glob tool.\n\n<function=glob>\n<parameter=pattern>\n**/*.md\n</parameter>\n</function>\n"
         "</tool_call>",
         "I will first check for all Markdown files in the current directory and its subdirectories, and then list "
         "them using the glob tool.", [("glob", {"pattern": "**/*.md"})]),
    Case("sglang-40739-text-after-call", [GET_WEATHER],
         "before<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>after",
         "beforeafter", [("get_weather", {"city": "Paris"})]),
    Case("ollama-18421-number-outside-int64", [tool("calculate", {"x": {"type": "number"}})],
         "<tool_call><function=calculate>\n<parameter=x>\n1e20\n</parameter>\n</function></tool_call>", "",
         [("calculate", {"x": 1e20})]),
]


def request(case: Case) -> ChatRequest:
    options = GenerationOptions(params=SamplingParams(max_tokens=None), max_tokens_field="max_tokens", stop=[],
                                n=1, stream=False, include_usage=False, return_token_ids=False)
    req = ChatRequest(messages=[], tools=case.tools or None, tool_choice="auto", template_kwargs={}, logprobs=False,
                      top_logprobs=0, options=options)
    req.starts_in_reasoning = bool(case.starts)
    return req


def formats(case: Case) -> ChatFormat:
    return ChatFormat("qwen3" if case.starts is not None else "", "qwen3_coder")


def whole(case: Case, finish: str = "stop") -> tuple[str | None, str, list[tuple[str, dict]]]:
    a = formats(case).split(request(case), Choice(0, text=case.text, finish_reason=finish))
    return a.reasoning, a.content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in a.calls]


def streamed(case: Case, chunks: list[str], finish: str = "stop") -> tuple[str | None, str, list[tuple[str, dict]]]:
    choice = ChatStreamChoice(formats(case), request(case))
    reasoning, content, calls = "", "", {}
    for k, chunk in enumerate(chunks + [""]):
        final = k == len(chunks)
        for piece in choice.pieces(chunk, final, truncated=final and finish == "length"):
            reasoning += piece.get("reasoning_content", "")
            content += piece.get("content", "")
            for tc in piece.get("tool_calls", []):
                entry = calls.setdefault(tc["index"], ["", ""])
                if "id" in tc:
                    assert tc["type"] == "function" and tc["id"].startswith("call_") and not entry[0]
                    entry[0] = tc["function"]["name"]
                entry[1] += tc["function"]["arguments"]
    return reasoning or None, content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))]


def chunkings(text: str, seed: int, n_random: int = 10) -> list[list[str]]:
    """Every split into two chunks, one character at a time, and random chunkings."""
    out = [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 16))))
        out.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    return out


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_peer_case(case):
    expected = (case.reasoning, case.content, case.calls)
    assert whole(case) == expected
    for chunks in chunkings(case.text, seed=len(case.text)):
        assert streamed(case, chunks) == expected, chunks


def test_a_delta_that_closes_the_call_carries_its_arguments():
    """vLLM test_extract_tool_calls_streaming_speculative_decode_loss: one delta (speculative decoding sends several
    tokens at once) holds the parameter and the end of the call; the arguments go out with it, whole."""
    case = Case("vllm-speculative-stream", [tool("test", {"city": S})], "", "")
    choice = ChatStreamChoice(formats(case), request(case))
    first = choice.pieces("<tool_call>\n<function=test>\n", False)
    pieces = choice.pieces("<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>", False)
    calls = [tc for p in first + pieces for tc in p.get("tool_calls", [])]
    assert [tc["function"]["name"] for tc in calls if "id" in tc] == ["test"]
    args = "".join(tc["function"]["arguments"] for tc in calls)
    assert json.loads(args) == {"city": "Paris"}
    assert choice.pieces("", True) == []                  # nothing of the call is left for the end of the output


def test_the_suite_covers_every_peer():
    sources = {c.id.split("-")[0] for c in CASES}
    assert {"vllm", "sglang", "llamacpp", "ollama"} <= sources and len(CASES) >= 80


# ---------------------------------------------------------------------------------------------------------------
# The same agreement as a property: any text made of the format's pieces, at any chunking, with the output cut by
# max_tokens or not, streams exactly what the whole text parses to.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=write_file>",
          "<function=nope>", "<function=", "<parameter=city>", "<parameter=path>", "<parameter=content>",
          "<parameter=extra>", "</parameter>", "</function>", "<", "</", ">", "\n", "\n\n", " ", "a", "7", "é", "{",
          "}", '"x"']
PROPERTY_TOOLS = [GET_WEATHER, WRITE_FILE]


@settings(max_examples=600, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=30), cuts=st.lists(st.integers(0, 10_000), max_size=10),
       starts=st.sampled_from([None, False, True]), finish=st.sampled_from(["stop", "length"]))
def test_stream_equals_whole_for_any_text(pieces, cuts, starts, finish):
    text = "".join(pieces)
    case = Case("property", PROPERTY_TOOLS, text, "", starts=starts)
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    expected = whole(case, finish)
    assert streamed(case, chunks, finish) == expected, chunks
    for _, args in expected[2]:                          # every call's arguments are a JSON object, no key twice
        assert isinstance(args, dict)
