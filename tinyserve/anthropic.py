"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, each a route handler that reads top to
bottom, the request parsing and the answer (body and stream events) beside them.

A Messages request is translated into the chat request the OpenAI route builds (chat.ChatRequest), so all protocols
render the same prompt through the same template and share the prefix cache; the answer is split by the same qwen3
reasoning and qwen3_coder tool parsers (chat.ChatFormat) and written as Anthropic content blocks.

Mapping (request):
  system (string or text blocks)   -> one system message first; a text block starting with
                                      "x-anthropic-billing-header:" (Claude Code's per-request hash) is dropped:
                                      it would change every prompt's prefix
  a system message in messages     -> (Claude Code's environment and reminders, the mid-conversation-system beta) a
                                      user turn in its place (tokenizer.late_system_text: Qwen's templates take a
                                      system message only first, and moving it there would change the prompt's start
                                      every turn); its tool_addition / tool_removal blocks (the
                                      mid-conversation-tool-changes beta) render there as the tools the model may
                                      call from then on, or no longer, and the tool parser follows them
  text blocks                      -> content (joined with "\\n", as the chat route joins text parts)
  image blocks (user, and inside   -> the image marker in place (tokenizer.ContentJoiner), the image in
  tool_result content)                request.images: source base64 (media_type png | jpeg | webp | gif) or url
                                      (data: URLs; http(s) only with server.fetch_image_urls); in system: 400
  tool_use (assistant)             -> tool_calls; tool_result (user) -> a "tool" message ("Error: " first when
                                      is_error); a tool_reference block in it (tool search) -> the line
                                      "Tool loaded: NAME" (every tool is in the prompt from the first turn, deferred
                                      or not, so the prompt's start never changes)
  thinking (assistant)             -> reasoning_content (the template shows it only for turns after the last user
                                      query, as Qwen3 does); a block whose text was omitted carries it in its
                                      signature (THINKING_SIGNATURE); redacted_thinking is opaque
                                      and dropped
  document blocks                  -> 400 (not supported)
  tools of type "custom" (or none) -> OpenAI function tools; server tools (web_search_20250305, code_execution,
                                      web_fetch, tool_search, bash / text_editor ...) are left out of the prompt,
                                      logged once per type, counted in tinyserve:tools_left_out
  tools[].input_schema             -> the function's parameters; tool_choice auto | any | tool | none -> "auto" |
                                      "required" | named | no tools in the prompt. any / tool force one tool_use
                                      (with the qwen3_coder parser on, decoding is constrained to one call whose
                                      input follows the tool's input_schema; grammar.py)
  thinking.type enabled|adaptive / disabled -> enable_thinking true / false; absent: the template's default (Qwen3.5
                                      thinks); budget_tokens is accepted and not enforced; display "summarized"
                                      (the whole thinking is shown) or "omitted" (blocks come with empty text, the
                                      text in the signature)
  model                            -> any name is accepted (Claude Code sends its own); responses carry the served
                                      name
  a last assistant message         -> a prefill: the prompt is cut after its text and the answer continues it
  output_config.format             -> json_schema: the text after any thinking is constrained to the schema (as
  (and the older output_format)       response_format; the SDK's messages.parse); output_config.effort accepted
  tool_choice.disable_parallel_tool_use -> at most one tool_use block
  context_management               -> its edits are applied (context_edits.py) and reported
  anthropic-beta header            -> every value accepted: BETAS says what each known one means here, an unknown
                                      one is logged once (a flag only allows fields; each field is checked where
                                      it is read); anthropic-version likewise
  metadata, service_tier, cache_control, inference_geo, speed: type-checked, no effect (docs/api.md); container,
                                      mcp_servers: 400; safeguards (checks Anthropic runs over tool calls): none
                                      run here, each type logged once
A prompt longer than the context is a 400 worded as Anthropic's ("prompt is too long: N tokens > M maximum"):
Claude Code reads the numbers to compact the conversation.

Mapping (response): content blocks thinking, text and tool_use ("toolu_..." ids) in the order the model wrote them;
stop_reason end_turn | max_tokens | stop_sequence | tool_use. Usage follows Anthropic's split: input_tokens is the
uncached part of the prompt, cache_read_input_tokens the prompt tokens served from the prefix cache,
cache_creation_input_tokens 0 (writing the cache costs nothing extra here), so their sum is the prompt length; with
the thinking-token-count beta, output_tokens_details.thinking_tokens counts the generated tokens of the think block.
A request's context_management edits are reported as Anthropic reports them (applied_edits), on the message and on
the stream's message_delta.

Thinking blocks carry a signature: "" (nothing to sign) when their text is shown; with thinking.display "omitted" the
block's text is empty and the signature carries it (THINKING_SIGNATURE), so that a client sending the block back
gives the model its own reasoning again and the prompt stays the one the prefix cache holds.

One idea in one module (the request, its handlers and its answer), past 600 lines for that.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, AsyncIterator

from aiohttp import web

from .chat import (ChatFormat, ChatRequest, ChatStreamChoice, chat_tools, count_reasoning_tokens, function_tool,
                   function_tools, leave_out, named_tool)
from .context_edits import Edit, apply_edits, parse_edits
from .engine import ContextError
from .generation import Choice, Meta, Piece, Usage
from .http_images import prepare_images
from .protocol import (APIError, Fields, GenerationOptions, ImageInput, bad_request, boolean, header_values,
                       image_bytes, image_from_url, integer, json_response, note_markers, number,
                       parse_response_format, read_field, read_json, serving, sse, sse_named_event, start_generation,
                       stop_strings, unused_fields)
from .sampling import SamplingParams
from .tokenizer import SYSTEM_IMAGE_ERROR, ContentJoiner, Tokenizer

if TYPE_CHECKING:
    from .sampling import Constraint

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
log = logging.getLogger("tinyserve.anthropic")

# The anthropic-beta values this server knows (Claude Code sends a list on every request), each with what it means
# here. A value not in this table is accepted and logged once (read_betas): a beta lets a client send new fields,
# and each field is checked, or refused by name, where it is read.
BETAS = {
    "claude-code-20250219": "Claude Code's requests: nothing changes",
    "interleaved-thinking-2025-05-14": "thinking between tool calls: the parsers read reasoning wherever it is",
    "context-management-2025-06-27": "context_management edits are applied (context_edits.py)",
    "effort-2025-11-24": "output_config.effort is accepted (Qwen's templates take no effort)",
    "thinking-token-count-2026-05-13": "usage.output_tokens_details.thinking_tokens",
    "advanced-tool-use-2025-11-20": "defer_loading tools and tool_reference blocks (every tool is in the prompt)",
    "tool-search-tool-2025-10-19": "defer_loading tools and tool_reference blocks (every tool is in the prompt)",
    "mid-conversation-system-2026-04-07": "system messages in messages: a user turn in place",
    "mid-conversation-tool-changes-2026-07-01": "tool_addition / tool_removal blocks in system messages",
    "prompt-caching-2024-07-31": "cache_control is accepted: the prefix cache needs no marks",
    "extended-cache-ttl-2025-04-11": "cache_control ttl is accepted: the prefix cache keeps what fits",
    "token-efficient-tools-2025-02-19": "tool calls stream as they are parsed",
    "fine-grained-tool-streaming-2025-05-14": "tool calls stream as they are parsed",
    "output-128k-2025-02-19": "max_tokens is cut to what the context holds",
    "context-1m-2025-08-07": "the context is model.context_length",
    "structured-outputs-2025-11-13": "output_config.format / output_format json_schema (constrained decoding)",
    "structured-outputs-2025-12-15": "output_config.format / output_format json_schema (constrained decoding)",
    "web-search-2025-03-05": "server tools are left out of the prompt (tinyserve:tools_left_out)",
    "web-fetch-2025-09-10": "server tools are left out of the prompt (tinyserve:tools_left_out)",
    "code-execution-2025-05-22": "server tools are left out of the prompt (tinyserve:tools_left_out)",
    "code-execution-2025-08-25": "server tools are left out of the prompt (tinyserve:tools_left_out)",
    "prompt-caching-scope-2026-01-05": "cache_control scope is accepted: the prefix cache needs no marks",
    "afk-mode-2026-01-31": "Claude Code's unattended mode: nothing changes",
    "dangerous-tool-use-2026-09-03": "safeguards dangerous_tool_use is accepted and not run (Anthropic's own check)",
}
VERSIONS = ("2023-06-01",)           # anthropic-version: the one the Messages API has
THINKING_DISPLAYS = ("summarized", "omitted")


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def read_betas(headers: Any) -> set[str]:
    """The anthropic-beta values a request names, and its anthropic-version, noted (protocol.note_markers): a value
    outside BETAS or VERSIONS is logged once, never refused. Where a known beta changes what the answer holds
    (thinking-token-count), parse_messages_request honours it."""
    note_markers("anthropic-version", header_values(headers, "anthropic-version"), VERSIONS)
    return note_markers("anthropic-beta", header_values(headers, "anthropic-beta"), BETAS)


# ---------------------------------------------------------------------------------------------------------------
# Requests

@dataclass
class MessagesRequest:
    """A Messages request, as the chat request it renders as."""

    chat: ChatRequest                  # what the chat template and the parsers take
    omit_thinking: bool = False        # thinking.display "omitted": blocks carry their text in the signature
    edits: list[Edit] = field(default_factory=list)              # context_management
    applied_edits: list[dict[str, Any]] = field(default_factory=list)   # what they cleared, once rendered
    count_thinking_tokens: bool = False   # the thinking-token-count beta: usage.output_tokens_details


def _text_blocks(value: Any, param: str, allowed: tuple[str, ...] = ("text",)) -> list[dict[str, Any]]:
    """A string or a list of blocks -> the list of blocks (a string is one text block); types are checked."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a string or a list of content blocks", param)
    for j, block in enumerate(value):
        p = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "document":
            raise bad_request(f"{p}: document blocks are not supported by this server", f"{p}.type")
        if kind == "image" and param == "system":
            raise bad_request(f"{p}: {SYSTEM_IMAGE_ERROR}", p)
        if kind not in allowed:
            raise bad_request(f"{p}.type must be one of {', '.join(allowed)}; got {kind!r}", f"{p}.type")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise bad_request(f"{p}.text must be a string", f"{p}.text")
    return value


def _join(blocks: list[dict[str, Any]]) -> str:
    return "\n".join(b["text"] for b in blocks)


def _system(value: Any) -> str | None:
    if value is None:
        return None
    blocks = _text_blocks(value, "system")
    if isinstance(value, list):
        blocks = [b for b in blocks if not b["text"].lstrip().startswith(BILLING_HEADER_PREFIX)]
    text = _join(blocks)
    return text if blocks else None


def _image(block: dict[str, Any], p: str, fetch: bool) -> ImageInput:
    """{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return image_bytes(source.get("media_type"), source.get("data"), p)
    if kind == "url":
        return image_from_url(source.get("url"), p, fetch)
    if kind == "file":
        raise bad_request(f"{p}: file sources (the Files API) are not supported; send the image as a base64 source",
                          p)
    raise bad_request(f'{p}.source must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", "url"}}',
                      p)


def _tool_result(block: dict[str, Any], p: str, images: list[ImageInput], fetch: bool) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str):
        raise bad_request(f"{p}.tool_use_id must be a string", f"{p}.tool_use_id")
    content = block.get("content")
    out = ContentJoiner()
    if content is not None:
        for k, b in enumerate(_text_blocks(content, f"{p}.content", ("text", "image", "tool_reference"))):
            if b["type"] == "image":
                images.append(_image(b, f"{p}.content[{k}]", fetch))
                out.image()
            elif b["type"] == "tool_reference":
                if not isinstance(b.get("tool_name"), str) or not b["tool_name"]:
                    raise bad_request(f"{p}.content[{k}].tool_name must be a non-empty string",
                                      f"{p}.content[{k}].tool_name")
                out.text(f"Tool loaded: {b['tool_name']}")
            else:
                out.text(b["text"])
    text = out.result()
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def _tool_use(block: dict[str, Any], p: str) -> dict[str, Any]:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not name:
        raise bad_request(f"{p}.name must be a non-empty string", f"{p}.name")
    if call_id is not None and not isinstance(call_id, str):
        raise bad_request(f"{p}.id must be a string", f"{p}.id")
    if not isinstance(args, dict):
        raise bad_request(f"{p}.input must be an object", f"{p}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


USER_BLOCKS = ("text", "image", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


SYSTEM_BLOCKS = ("text", "tool_addition", "tool_removal")
# How a system message's tool changes read where they happen (the template shows the first tools in <tools>)
ADDED_TOOL = "This function can be called from here on, as those in <tools>:\n<tools>\n{}\n</tools>"
REMOVED_TOOL = "The function {} can no longer be called."


def _system_turn(blocks: list[dict[str, Any]], p: str, changes: list[tuple[str, Any]], left_out: list[str]) -> str:
    """A system message inside messages -> its text, with each tool_addition / tool_removal rendered in place;
    the changes are appended to `changes` as ("add", function tool) / ("remove", name), in order."""
    parts = []
    for j, b in enumerate(blocks):
        q = f"{p}.content[{j}]"
        tool = b.get("tool")
        if b["type"] == "text":
            parts.append(b["text"])
        elif b["type"] == "tool_addition":
            if not isinstance(tool, dict) or tool.get("type") != "tool_definition" or \
                    not isinstance(tool.get("definition"), dict):
                raise bad_request(f'{q}.tool must be {{"type": "tool_definition", "definition": {{...}}}}', f"{q}.tool")
            fn = _read_tool(tool["definition"], f"{q}.tool.definition", left_out)
            if fn is not None:
                changes.append(("add", fn))
                parts.append(ADDED_TOOL.format(json.dumps(fn, ensure_ascii=False)))
        else:
            name = tool.get("name") if isinstance(tool, dict) and tool.get("type") == "tool_reference" else None
            if not isinstance(name, str) or not name:
                raise bad_request(f'{q}.tool must be {{"type": "tool_reference", "name": ...}}', f"{q}.tool")
            changes.append(("remove", name))
            parts.append(REMOVED_TOOL.format(name))
    return "\n".join(parts)


def _thinking_text(block: dict[str, Any], q: str) -> str:
    """A thinking block's text; one whose text was omitted in our answer has it in its signature."""
    if not isinstance(block.get("thinking"), str):
        raise bad_request(f"{q}.thinking must be a string", f"{q}.thinking")
    if block["thinking"]:
        return block["thinking"]
    return thinking_from_signature(block.get("signature")) or ""


def _messages(value: Any, images: list[ImageInput], changes: list[tuple[str, Any]], left_out: list[str],
              fetch: bool = False) -> list[dict[str, Any]]:
    """Anthropic turns -> chat messages (OpenAI shape, tool results as "tool" messages, in the client's order); the
    image blocks are appended to `images` in the same order, the system messages' tool changes to `changes`."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{p} must be an object with role and content", p)
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{p}.role must be 'user', 'assistant' or 'system'; got {role!r}", f"{p}.role")
        if "content" not in m:
            raise bad_request(f"{p}.content is required", f"{p}.content")
        if role == "system":                          # Claude Code's environment, reminders and tool changes: a user
            blocks = _text_blocks(m["content"], f"{p}.content", SYSTEM_BLOCKS)     # turn in place (tokenizer)
            out.append({"role": "system", "content": _system_turn(blocks, p, changes, left_out)})
            continue
        allowed = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
        blocks = _text_blocks(m["content"], f"{p}.content", allowed)
        if role == "user":
            turn = ContentJoiner()
            for j, b in enumerate(blocks):
                if b["type"] == "text":
                    turn.text(b["text"])
                    continue
                if b["type"] == "image":
                    images.append(_image(b, f"{p}.content[{j}]", fetch))
                    turn.image()
                    continue
                if not turn.empty:                    # text or images before a result: their own turn, in order
                    out.append({"role": "user", "content": turn.result()})
                    turn = ContentJoiner()
                out.append(_tool_result(b, f"{p}.content[{j}]", images, fetch))
            if not turn.empty or not blocks:
                out.append({"role": "user", "content": turn.result()})
            continue
        msg: dict[str, Any] = {"role": "assistant"}
        texts, reasoning, calls = [], [], []
        for j, b in enumerate(blocks):
            q = f"{p}.content[{j}]"
            if b["type"] == "text":
                texts.append(b["text"])
            elif b["type"] == "thinking":
                reasoning.append(_thinking_text(b, q))
            elif b["type"] == "tool_use":
                calls.append(_tool_use(b, q))
            # redacted_thinking: opaque (encrypted by Anthropic), nothing to render
        msg["content"] = "\n".join(texts)
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _read_tool(tool: dict[str, Any], p: str, left_out: list[str]) -> dict[str, Any] | None:
    """{"name", "description", "input_schema"} (a custom tool) -> an OpenAI function tool; None: a server tool, whose
    type lands in `left_out`."""
    kind = tool.get("type", "custom")
    if kind in ("custom", None):
        return function_tool(tool, p, "input_schema", schema_required=True)
    if not isinstance(kind, str) or not kind:
        raise bad_request(f"{p}.type must be \"custom\" or a server tool's type; got {kind!r}", f"{p}.type")
    leave_out(left_out, kind, "/v1/messages")        # a server tool: nothing here can run it
    return None


def _tools(body: dict, left_out: list[str]) -> tuple[list[dict[str, Any]] | None, Any]:
    """Anthropic tools + tool_choice -> OpenAI function tools + tool_choice (what the template and parser take); the
    types of the server tools left out land in `left_out`."""
    tools = function_tools(body.get("tools"), lambda tool, p: _read_tool(tool, p, left_out))
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind is not None:
        read_field(choice, "disable_parallel_tool_use", boolean)
    if choice is None or kind == "auto":
        return chat_tools(tools, "auto")
    if kind == "none":
        return chat_tools([], "none")                 # no tools offered at all
    # any / tool: like OpenAI's "required" / a named function: decoding is constrained to one call (ChatFormat)
    if kind == "any":
        return chat_tools(tools, "required")
    if kind == "tool":
        return chat_tools(tools, named_tool(tools, choice.get("name"), "tool_choice.name", noun="tool"))
    raise bad_request('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice.type")


def _safeguards(body: dict) -> None:
    """safeguards: checks Anthropic runs on its side over the model's tool calls (Claude Code's auto mode sends
    dangerous_tool_use, the dangerous-tool-use beta, with its permission rules). This server runs none, as it runs
    no server tools: each type is logged once and the request goes on (refusing it would refuse every request of
    the Claude Code releases that send it; the client's own permission prompts still apply)."""
    value = body.get("safeguards")
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(g, dict) and isinstance(g.get("type"), str) for g in value):
        raise bad_request("safeguards must be a list of objects with a type", "safeguards")
    for kind in sorted({g["type"] for g in value} - _SAFEGUARDS_LOGGED):
        _SAFEGUARDS_LOGGED.add(kind)
        log.info("Messages: safeguards of type %r are checks Anthropic runs on its side; this server runs none "
                 "(logged once)", kind)


_SAFEGUARDS_LOGGED: set[str] = set()


def _thinking(body: dict) -> tuple[dict[str, Any], bool]:
    """(template kwargs, whether thinking text is omitted from the answer)."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}, False                              # the template's default
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request('thinking.type must be "enabled", "adaptive" or "disabled"', "thinking.type")
    read_field(thinking, "budget_tokens", integer)  # type-checked; not enforced
    display = thinking.get("display", "summarized")
    if display not in THINKING_DISPLAYS:
        raise bad_request(f"thinking.display must be one of {', '.join(THINKING_DISPLAYS)}; got {display!r}",
                          "thinking.display")
    return {"enable_thinking": kind != "disabled"}, display == "omitted"

# Fields of Anthropic's that change nothing here (docs/api.md says why), and those refused
IGNORED = {"metadata": dict, "service_tier": str, "cache_control": dict, "inference_geo": str, "speed": str,
           "user_profile_id": str, "workspace_id": str}
REFUSED = {"container": lambda v: "no code-execution containers here",
           "mcp_servers": lambda v: "this server connects to no MCP servers (give the tools in tools)"}
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _output_config(body: dict) -> Constraint | None:
    """output_config.format {"type": "json_schema", "schema"}: the text after any thinking is JSON matching the
    schema (constrained decoding, as response_format on the OpenAI routes; messages.parse reads it). The older
    output_format field is taken the same way. output_config.effort is accepted: Qwen's templates take no effort."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("output_config must be an object", "output_config")
    config = config or {}
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"output_config.effort must be one of {', '.join(EFFORTS)}; got {effort!r}",
                          "output_config.effort")
    fmt, where = config.get("format"), "output_config.format"
    if fmt is None and body.get("output_format") is not None:
        fmt, where = body["output_format"], "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(f'{where} must be {{"type": "json_schema", "schema": {{...}}}}', f"{where}.type")
    return parse_response_format(fmt, where, nested=False)


def _call_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, changes: list[tuple[str, Any]]
                ) -> list[dict[str, Any]] | None:
    """The tools the model may call after the system messages' changes (None: no change, the request's tools)."""
    if not changes:
        return None
    callable_now = {t["function"]["name"]: t for t in tools or []}
    for kind, change in changes:
        if kind == "add":
            callable_now[change["function"]["name"]] = change
        else:
            callable_now.pop(change, None)
    forced = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if forced is not None and forced not in callable_now:
        raise bad_request(f"tool_choice names tool {forced!r}, which a system message in messages removed",
                          "tool_choice.name")
    return list(callable_now.values())


def parse_messages_request(body: dict, count_only: bool = False, fetch_image_urls: bool = False,
                           betas: set[str] | None = None) -> MessagesRequest:
    """count_only (count_tokens): no max_tokens, no sampling fields. fetch_image_urls (server.fetch_image_urls):
    http(s) image sources become RemoteImages instead of a 400. betas: the request's anthropic-beta values
    (read_betas). A last message from the assistant is a prefill: the answer continues it (and holds only what
    follows it), as on Anthropic's API."""
    unused_fields(body, REFUSED, IGNORED)
    _safeguards(body)
    images: list[ImageInput] = []
    left_out: list[str] = []
    changes: list[tuple[str, Any]] = []
    messages = _messages(body.get("messages"), images, changes, left_out, fetch_image_urls)
    system = _system(body.get("system"))
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    tools, tool_choice = _tools(body, left_out)
    call_tools = _call_tools(tools, tool_choice, changes)
    edits = parse_edits(body.get("context_management"))
    template_kwargs, omit_thinking = _thinking(body)
    max_tokens = read_field(body, "max_tokens", integer, lo=1)
    if max_tokens is None and not count_only:
        raise bad_request("max_tokens is required", "max_tokens")
    stream = read_field(body, "stream", boolean, False)
    params = SamplingParams(temperature=read_field(body, "temperature", number, 1.0),
                            top_p=read_field(body, "top_p", number, 1.0), top_k=read_field(body, "top_k", integer, 0),
                            speculative=read_field(body, "speculative", boolean, True),
                            constraint=_output_config(body), max_tokens=max_tokens)
    options = GenerationOptions(params=params, max_tokens_field="max_tokens",
                                stop=read_field(body, "stop_sequences", stop_strings, [], one_string=False), n=1, stream=stream,
                                include_usage=True, return_token_ids=False)
    choice = body.get("tool_choice")
    prefill = messages[-1]["role"] == "assistant"
    chat = ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice, template_kwargs=template_kwargs,
                       logprobs=False, top_logprobs=0, options=options, images=images, left_out=left_out,
                       continue_final=prefill, add_generation_prompt=not prefill, call_tools=call_tools,
                       parallel_tool_calls=not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use")))
    return MessagesRequest(chat, omit_thinking=omit_thinking, edits=edits,
                           count_thinking_tokens="thinking-token-count-2026-05-13" in (betas or ()))


# ---------------------------------------------------------------------------------------------------------------
# POST /v1/messages and POST /v1/messages/count_tokens

# Anthropic's own words for a prompt past the context: Claude Code reads the two numbers to compact the conversation.
# Claude Code sends one large max_tokens (e.g. 32000) whatever the model: generation stops at the end of the context
# instead (stop_reason max_tokens), as on Anthropic's own API, rather than a 400 on a small context.
FIELDS = Fields("messages", too_long=lambda n, most: f"prompt is too long: {n} tokens > {most} maximum")


async def messages(request: web.Request) -> web.StreamResponse:
    state, engine = serving(request)
    req = parse_messages_request(await read_json(request), fetch_image_urls=state.cfg.server.fetch_image_urls,
                                 betas=read_betas(request.headers))
    if req.chat.left_out:
        state.metrics.on_tools_left_out(req.chat.left_out)
    chat = ChatFormat.of(state.cfg)
    prompt = await asyncio.to_thread(prompt_ids, chat, req, engine.tokenizer)
    images: list[Any] = []
    if req.chat.images:                               # the ids grow by each image's tokens
        prompt, images = await prepare_images(state, engine, req.chat.images, prompt, FIELDS)
    params = req.chat.options.params
    try:                                              # Claude Code's large max_tokens: cut to what fits (above)
        fits = engine.intake.fit_max_tokens(len(prompt), params.max_tokens, clamp=True)
    except ContextError as e:
        raise FIELDS.context_error(e, [prompt]) from None
    req.chat.options.params = replace(params, max_tokens=fits)
    with start_generation(state, engine, req.chat.options, [prompt], "msg_", FIELDS, images) as gen:
        if req.chat.options.stream:
            return await sse(request, message_events(chat, req, gen.meta, gen.pieces()))
        (choice,) = await gen.collect()
        return json_response(message_body(chat, req, gen.meta, choice, gen.usage()))


async def count_tokens(request: web.Request) -> web.Response:
    """The length of the prompt a Messages request renders to, images included (each counts its tokens, as in the
    generation's usage)."""
    state, engine = serving(request)
    req = parse_messages_request(await read_json(request), count_only=True,
                                 fetch_image_urls=state.cfg.server.fetch_image_urls, betas=read_betas(request.headers))
    ids = await asyncio.to_thread(prompt_ids, ChatFormat.of(state.cfg), req, engine.tokenizer)
    if req.chat.images:
        ids, _ = await prepare_images(state, engine, req.chat.images, ids, FIELDS)
    return json_response({"input_tokens": len(ids)})


def prompt_ids(chat: ChatFormat, req: MessagesRequest, tokenizer: Tokenizer) -> list[int]:
    """The rendered prompt, after the context_management edits (which may need its length first)."""
    ids = chat.prompt_ids(req.chat, tokenizer)
    if not req.edits:
        return ids
    messages, req.applied_edits = apply_edits(req.chat.messages, req.edits, len(ids),
                                              lambda text: len(tokenizer.encode(text)))
    if not req.applied_edits:
        return ids
    req.chat.messages = messages
    return chat.prompt_ids(req.chat, tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# The answer: the message body and the stream's events

THINKING_SIGNATURE = "tinyserve-thinking:"     # + the omitted thinking text, base64 (UTF-8)

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors). Statuses are the server's own
# (a full queue is 503 + Retry-After, not Anthropic's 529); the type says what kind of failure it is.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(err: APIError) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}; the field in question, when known, leads the message."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def omitted_thinking_signature(text: str) -> str:
    return THINKING_SIGNATURE + base64.b64encode(text.encode()).decode()


def thinking_from_signature(signature: Any) -> str | None:
    """The thinking text a signature of ours carries; None for any other signature (Anthropic's own, "")."""
    if not isinstance(signature, str) or not signature.startswith(THINKING_SIGNATURE):
        return None
    try:
        return base64.b64decode(signature[len(THINKING_SIGNATURE):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def usage_body(req: MessagesRequest, usage: Usage, thinking_tokens: int) -> dict[str, Any]:
    cached = usage.cached_tokens or 0
    body: dict[str, Any] = {"input_tokens": usage.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": cached, "output_tokens": usage.completion_tokens}
    if req.count_thinking_tokens:
        body["output_tokens_details"] = {"thinking_tokens": thinking_tokens}
    return body


def tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or "").removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:                      # the parser writes JSON; never fail an answer over it
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str | None, stop_string: str | None, called_tools: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return ("tool_use" if called_tools else "end_turn"), None


def _thinking_block(req: MessagesRequest, text: str) -> dict[str, Any]:
    if req.omit_thinking:
        return {"type": "thinking", "thinking": "", "signature": omitted_thinking_signature(text)}
    return {"type": "thinking", "thinking": text, "signature": ""}


def _context_management(req: MessagesRequest) -> dict[str, Any]:
    return {"context_management": {"applied_edits": req.applied_edits}} if req.edits else {}


def message_body(chat: ChatFormat, req: MessagesRequest, meta: Meta, r: Choice, usage: Usage) -> dict[str, Any]:
    answer = chat.split(req.chat, r)
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        content.append(_thinking_block(req, answer.reasoning))
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    for call in answer.calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    reason, sequence = stop_reason(r.finish_reason, r.stop_string, bool(answer.calls))
    thinking = count_reasoning_tokens(r.token_ids, meta.token_text, answer.reasoning, answer.reasoning_end)
    return {"id": meta.request_id, "type": "message", "role": "assistant", "model": meta.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_body(req, usage, thinking), **_context_management(req)}


async def message_events(chat: ChatFormat, req: MessagesRequest, meta: Meta, pieces: AsyncIterator[Piece]
                         ) -> AsyncIterator[bytes]:
    """The stream: MessagesStream's events as SSE, each named by its type (the last one ends the stream)."""
    out = MessagesStream(chat, req, meta)
    async for p in pieces:
        for event in out.piece(p):
            yield sse_named_event(event)
    for event in out.end(meta.usage()):
        yield sse_named_event(event)


class MessagesStream:
    """message_start, ping, then content_block_start / _delta / _stop per block, message_delta, message_stop.

    message_start waits for the first piece: by then the prefill has run and the cached prompt tokens are known, so
    its usage is already the final split of the input (message_delta repeats it with output_tokens)."""

    def __init__(self, chat: ChatFormat, req: MessagesRequest, meta: Meta) -> None:
        self.req, self.meta = req, meta
        self.choice = ChatStreamChoice(chat, req.chat)
        self.started = False
        self.block: str | None = None                 # type of the open block
        self.index = -1                               # its index
        self.thinking = ""                            # the open thinking block's text (its signature when omitted)
        self.token_ids: list[int] = []
        self.reasoning = ""
        self.reason: tuple[str, str | None] = ("end_turn", None)

    def _usage(self, usage: Usage | None = None, output_tokens: int | None = None) -> dict[str, Any]:
        if usage is None:
            usage = self.meta.usage() if self.meta.usage is not None else Usage(len(self.meta.prompts[0]), 0)
        parser = self.choice.reasoning
        thinking = count_reasoning_tokens(self.token_ids, self.meta.token_text, self.reasoning,
                                          parser.end_offset if parser is not None else None)
        body = usage_body(self.req, usage, thinking)
        if output_tokens is not None:
            body["output_tokens"] = output_tokens
        return body

    def _start(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        message = {"id": self.meta.request_id, "type": "message", "role": "assistant", "model": self.meta.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": self._usage(output_tokens=0)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        out = []
        if self.block == "thinking":                  # Anthropic's clients expect the block's signature before
            signature = omitted_thinking_signature(self.thinking) if self.req.omit_thinking else ""   # its stop
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "signature_delta", "signature": signature}})
        self.block = None
        return out + [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.index += 1
        self.block = block["type"]
        self.thinking = ""
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _piece(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if "reasoning_content" in piece:
            text = piece["reasoning_content"]
            self.reasoning += text
            if self.block != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += text
            if not self.req.omit_thinking:
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "thinking_delta", "thinking": text}})
        elif "content" in piece:
            if self.block != "text":
                out += self._open({"type": "text", "text": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": piece["content"]}})
        elif "tool_calls" in piece:
            call = piece["tool_calls"][0]
            if "id" in call:                          # a new call: its own block
                out += self._open({"type": "tool_use", "id": tool_use_id(call["id"]),
                                   "name": call["function"]["name"], "input": {}})
            fragment = call["function"].get("arguments") or ""
            if fragment:
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": fragment}})
        return out

    def piece(self, d: Piece) -> list[dict[str, Any]]:
        out = self._start()
        self.token_ids += d.token_ids
        final = d.finish_reason is not None
        for piece in self.choice.pieces(d.text, final, truncated=d.finish_reason == "length"):
            out += self._piece(piece)
        if final:
            self.reason = stop_reason(d.finish_reason, d.stop_string, self.choice.called_tools)
        return out

    def end(self, usage: Usage) -> list[dict[str, Any]]:
        reason, sequence = self.reason
        return self._start() + self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": self._usage(usage), **_context_management(self.req)},
            {"type": "message_stop"}]
