"""The chat request that every chat protocol becomes, and the model's side of it: the prompt rendered through the
chat template, the answer split into reasoning, content and tool calls.

OpenAI chat completions (openai_api.py), Anthropic Messages (anthropic.py) and Responses (responses.py) each
translate their request into a ChatRequest: messages and function tools in OpenAI chat's shape, which is what the
chat template takes. So the three render the same prompt for the same conversation and share the prefix cache.
ChatFormat renders it (and sets the forced-tool-call constraint), then splits what the model wrote with the qwen3
reasoning and qwen3_coder tool-call parsers of the config's [parsers] table: a whole answer (`message`) or one
streamed choice at a time (ChatStreamChoice). Each protocol writes the pieces in its own shape.

Tools: each protocol writes a small reader for one tool object of its own shape; `function_tools` runs it over the
list and `function_tool` checks the name and the JSON schema the same way for all. Each maps its tool_choice onto
"auto" | "none" | "required" | a named function (`named_tool` checks the name), and `chat_tools` checks the pair as
the tool parser and the grammar take it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .parsers import Qwen3CoderToolParser, Qwen3ReasoningParser, make_tool_parser, prompt_opens_reasoning
from .protocol import (ChoiceResult, GenerationOptions, ImageInput, bad_request, constraint_after_reasoning,
                       forced_tool_call)
from .tokenizer import Tokenizer


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any                  # "auto" | "none" | "required" | {"type": "function", "function": {"name"}}
    template_kwargs: dict[str, Any]
    logprobs: bool
    top_logprobs: int
    options: GenerationOptions
    starts_in_reasoning: bool = False  # set once the prompt is rendered: the template opened <think> itself
    images: list[ImageInput] = field(default_factory=list)   # the image parts, in prompt order
    continue_final: bool = False       # the last (assistant) message is continued, not closed (a prefill)
    add_generation_prompt: bool = True
    parallel_tool_calls: bool = True   # False: at most one tool call per answer (the first)
    echo: str = ""                     # vLLM's echo of a continued message: its text goes before the answer

    @property
    def enable_thinking(self) -> bool:
        return bool(self.template_kwargs.get("enable_thinking", True))


@dataclass
class TranslatedRequest:
    """A request of another protocol (Anthropic Messages, Responses), translated into the chat request it renders
    as; the generation skeleton reads its options and images there."""

    chat: ChatRequest                 # what the chat template and the parsers take

    @property
    def options(self) -> GenerationOptions:
        return self.chat.options

    @property
    def images(self) -> list[ImageInput]:
        return self.chat.images


# ---------------------------------------------------------------------------------------------------------------
# Tools: every protocol's tool list and tool_choice, as the template, the tool parser and the grammar take them

ToolReader = Callable[[dict[str, Any], str], dict[str, Any]]   # (one tool object, its param) -> a function tool


def function_tools(value: Any, read: ToolReader, shape: str = "an object") -> list[dict[str, Any]]:
    """A protocol's `tools` -> OpenAI function tools. `read(tool, param)` checks one tool object of the protocol's
    shape and returns its function tool (through function_tool); an entry that is no object must be `shape`."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{p} must be {shape}", p)
        out.append(read(tool, p))
    return out


def function_tool(fields: dict[str, Any], where: str, schema_key: str = "parameters", schema_required: bool = False
                  ) -> dict[str, Any]:
    """{"type": "function", "function": {"name", "description", "parameters"}} from a tool's name, description and
    JSON schema (under `schema_key`; an absent optional one takes no arguments). Errors name `where`.name and
    `where`.`schema_key`."""
    name = fields.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
    schema = fields.get(schema_key)
    if schema is None and not schema_required:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.{schema_key} must be a JSON schema object", f"{where}.{schema_key}")
    fn: dict[str, Any] = {"name": name}
    if isinstance(fields.get("description"), str):
        fn["description"] = fields["description"]
    fn["parameters"] = schema
    return {"type": "function", "function": fn}


def named_tool(tools: list[dict[str, Any]], name: Any, param: str, noun: str = "function") -> dict[str, Any]:
    """A tool_choice naming one tool -> the chat tool_choice; the name must be one of the tools'."""
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {noun} {name!r}, which is not in tools", param)
    return {"type": "function", "function": {"name": name}}


def chat_tools(tools: list[dict[str, Any]], choice: Any) -> tuple[list[dict[str, Any]] | None, Any]:
    """(tools, tool_choice) for the ChatRequest: None when no tool is offered; a choice the tool parser cannot take
    is a 400 naming tool_choice. "required" and a named function force one call when the tool-call parser is on
    (ChatFormat.prompt_ids sets the grammar constraint); a named function also limits what is parsed as a call."""
    offered = tools or None
    if offered is None and choice not in ("auto", "none"):
        raise bad_request("tool_choice forces a tool call, but no tools are given", "tool_choice")
    try:
        make_tool_parser(offered, choice)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from None
    return offered, choice


# ---------------------------------------------------------------------------------------------------------------
# The model's side: prompt in, answer split

class ChatFormat:
    """The prompt through the chat template, the answer through the parsers. The parser names come from the
    config's [parsers] table ("" = off)."""

    def __init__(self, reasoning_parser: str = "", tool_parser: str = "") -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser

    def prompt_ids(self, req: ChatRequest, tokenizer: Tokenizer) -> list[int]:
        """The rendered prompt; it also settles the request's constraint (a forced tool call, and where it starts)."""
        try:
            text = tokenizer.apply_chat_template(req.messages, tools=req.tools,
                                                 add_generation_prompt=req.add_generation_prompt,
                                                 continue_final_message=req.continue_final, **req.template_kwargs)
        except ValueError as e:                       # e.g. the template's raise_exception on a bad history
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        req.starts_in_reasoning = prompt_opens_reasoning(text)
        if self.tool_parser == "qwen3_coder":
            constraint = forced_tool_call(req.tools, req.tool_choice)
            if constraint is not None:                # the answer is the call: it replaces any response_format
                req.options.params = replace(req.options.params, constraint=constraint)
        req.options.params = constraint_after_reasoning(req.options.params, req.starts_in_reasoning, tokenizer)
        return tokenizer.encode(text)

    # parsers are per choice: they are stateful
    def reasoning(self, req: ChatRequest) -> Qwen3ReasoningParser | None:
        if self.reasoning_parser != "qwen3":
            return None
        return Qwen3ReasoningParser(starts_in_reasoning=req.starts_in_reasoning, enabled=req.enable_thinking)

    def tools(self, req: ChatRequest) -> Qwen3CoderToolParser | None:
        if self.tool_parser != "qwen3_coder":
            return None
        return make_tool_parser(req.tools, req.tool_choice)

    def message(self, req: ChatRequest, r: ChoiceResult) -> tuple[dict[str, Any], str]:
        """Split a finished choice's text into reasoning, content and tool calls (an OpenAI chat message); the
        finish reason to report."""
        message: dict[str, Any] = {"role": "assistant"}
        content: str | None = r.text
        reasoning = self.reasoning(req)
        if reasoning is not None:
            message["reasoning_content"], content = reasoning.parse(r.text)
        finish = r.finish_reason
        tools = self.tools(req)
        if tools is not None and content:
            content, calls = tools.parse(content)
            calls = calls if req.parallel_tool_calls else calls[:1]
            if calls:
                message["tool_calls"] = calls
                if finish == "stop":
                    finish = "tool_calls"
        message["content"] = content if content or "tool_calls" not in message else None
        return message, finish


class ChatStreamChoice:
    """One choice's parsers while streaming: text deltas in, OpenAI chat delta dicts out."""

    def __init__(self, chat: ChatFormat, req: ChatRequest) -> None:
        self.reasoning = chat.reasoning(req)
        self.tools = chat.tools(req)
        self.called_tools = False
        self.parallel_tool_calls = req.parallel_tool_calls

    def pieces(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Deltas for this text: reasoning_content, then content and tool_calls in the order they came."""
        out: list[dict[str, Any]] = []
        content = text
        if self.reasoning is not None:
            reasoning_text, content = self.reasoning.feed(text)
            if final:
                r2, c2 = self.reasoning.finish()
                reasoning_text, content = reasoning_text + r2, content + c2
            if reasoning_text:
                out.append({"reasoning_content": reasoning_text})
        if self.tools is None:
            if content:
                out.append({"content": content})
            return out
        tool_deltas = self.tools.feed(content) if content else []
        if final:
            tool_deltas += self.tools.finish()
        if not self.parallel_tool_calls:              # only the first call goes out
            tool_deltas = [d for d in tool_deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]
        for d in tool_deltas:
            self.called_tools = self.called_tools or "tool_calls" in d
        return out + tool_deltas
