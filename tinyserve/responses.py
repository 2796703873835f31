"""OpenAI's Responses API: POST /v1/responses (what Codex speaks: wire_api = "responses"), a route handler that reads
top to bottom, the request parsing and the answer (response object and stream events) beside it.

Stateless: nothing is stored, so `previous_response_id` and `conversation` get a 400 telling the client to resend
the whole history in `input` (Codex sends `store: false` and the full history every turn). `store: true` (OpenAI's
default, which gateways such as SMG write into every body) is accepted and answered with `store: false`: the
response says it was not kept. A worker that kept responses would tie a conversation to its memory, and a gateway
sending the next turn elsewhere, or a worker restarted, would break it (docs/api.md). A Responses request is
translated into the chat request the chat route builds (chat.ChatRequest), so all protocols render the same prompt
through the same template and share the prefix cache; the answer is split by the same qwen3 reasoning and
qwen3_coder tool parsers (chat.ChatFormat) and written as Responses output items.

Mapping (request):
  instructions (string)              -> a system message first; it and the system / developer messages that open
                                        `input` are joined ("\\n\\n") into one system message; a later one is a
                                        user turn in its place (tokenizer.normalise_messages)
  input: a string                    -> one user message
  input: message items               -> role user | assistant | system | developer (developer -> system), content a
                                        string or input_text / output_text parts (joined with "\\n", as the chat route
                                        joins text parts); input_file / input_audio -> 400 (not supported)
  input_image parts (user messages,  -> the image marker in place (tokenizer.ContentJoiner), the image in
  function_call_output output)          request.images: image_url a data: URL (http(s) only with
                                        server.fetch_image_urls); detail is ignored; file_id -> 400; in a system /
                                        developer message -> 400
  function_call items                -> the assistant turn's tool_calls (arguments: a JSON string)
  function_call_output items         -> "tool" messages
  reasoning items                    -> the assistant turn's reasoning_content (content reasoning_text, else the
                                        summary_text; encrypted_content is opaque and dropped). The template shows it
                                        only for turns after the last user query, as Qwen3 does
  consecutive reasoning / assistant message / function_call items form one assistant turn
  tools: function                    -> OpenAI chat function tools
  tools: custom (freeform, Codex's   -> a function tool with one string parameter `input` (its description says the
  apply_patch)                          input is free text, and gives the format's grammar); the model's call of it
                                        is a custom_tool_call item whose input is that string
  tools of any other type            -> hosted tools this server cannot run (web_search, file_search, local_shell,
                                        image_generation, ...): left out of the prompt, logged once per type,
                                        counted in tinyserve:tools_left_out; echoed on the response as sent
  tools: namespace (a group of        -> its function and custom tools, each shown to the model as NAMESPACE.NAME;
  function / custom tools: Codex's      a call of one comes back under its own name with "namespace" set, and a
  multi_agent_v1)                       function_call / custom_tool_call item with a namespace renders as that name
  custom_tool_call items             -> the assistant turn's tool_calls ({"input": ...} as the arguments)
  custom_tool_call_output items      -> "tool" messages, as function_call_output
  tool_choice                        -> auto | none | required | {"type": "function" | "custom", "name"}; required
                                        and a named tool force one call (with the qwen3_coder parser on, decoding is
                                        constrained to one call whose arguments follow the tool's parameters, or
                                        whose input follows the custom tool's Lark / regex grammar; grammar.py)
  reasoning.effort                   -> "none": enable_thinking false; any other effort: the template's default
  text.format                        -> text | json_object | json_schema {name, schema, strict}; json_object and
                                        json_schema constrain decoding (grammar.py): the answer after any reasoning
                                        is one-line JSON matching the schema (unless max_output_tokens cuts it)
  include message.output_text.logprobs (+ top_logprobs) -> each output_text part's logprobs (the answer's tokens,
                                        those of the think block left out), on every text delta of a stream too;
                                        the other include values name outputs never made here: accepted (one
                                        this server does not know is logged once)
  max_output_tokens, temperature, top_p, stream; metadata, parallel_tool_calls (false: one call at most),
  truncation, user are checked and echoed on the response; prompt_cache_key, safety_identifier, service_tier,
  max_tool_calls (built-in tools only), context_management and stream_options.include_obfuscation are type-checked
  and change nothing (docs/api.md); background and stored prompts are refused; model: any name is accepted (Codex
  sends its own), responses carry the served name; unknown fields are ignored.
Mapping (response): output items reasoning ("rs_...", summary [], content [reasoning_text]), message ("msg_...",
one output_text part), function_call ("fc_...", call_id "call_...", arguments a JSON string) and custom_tool_call
("ctc_...", input a string); status "incomplete" with incomplete_details.reason "max_output_tokens" when the
generation was cut by the token limit (its last item is "incomplete" too, unless it is a call: a call the limit cut
is dropped, so one that is there is whole). usage.output_tokens_details.reasoning_tokens counts the generated tokens
up to the one that closes the think block. A stream ends with response.completed whatever the status (the openai
client's get_final_response() needs it), carrying the same response the blocking call returns; every event carries
the item as it was at that event.

One idea in one module (the request, its handler and its answer), past 600 lines for that.
"""
from __future__ import annotations

import asyncio
import copy
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from aiohttp import web

from .chat import (FREEFORM_INPUT, ChatFormat, ChatRequest, ChatStreamChoice, chat_tools, count_reasoning_tokens,
                   freeform_input, freeform_tool, function_tool, function_tools, leave_out, named_tool)
from .generation import Choice, Meta, Piece, Usage
from .http_images import prepare_images
from .parsers import THINK_END
from .protocol import (APIError, Fields, GenerationOptions, ImageInput, bad_request, boolean, image_from_url, integer,
                       json_response, logprob_content, note_markers, note_openai_beta, number, parse_response_format,
                       read_field, read_json, serving, sse, sse_named_event, start_generation, stream_options_field,
                       unused_fields)
from .sampling import MAX_LOGPROBS, SamplingParams
from .tokenizer import SYSTEM_IMAGE_ERROR, SYSTEM_ROLES, ContentJoiner, MessageError, Tokenizer, tool_call_arguments

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
UNSUPPORTED_PARTS = ("input_file", "input_audio")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ITEMS = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
         "reasoning")
TEXT_FORMATS = ("text", "json_object", "json_schema")
STATELESS = ("this server is stateless: it keeps no responses (store: true is answered with store: false), so "
             "send the whole conversation in `input` instead of")


# ---------------------------------------------------------------------------------------------------------------
# Requests

@dataclass
class ResponsesRequest:
    chat: ChatRequest                 # what the chat template and the parsers take
    echo: dict[str, Any]              # request fields the response object repeats
    logprobs: bool = False            # include message.output_text.logprobs (with the top_logprobs alternatives)
    # the tools of `namespace` groups, by the name the model sees ("NAMESPACE.NAME") -> (namespace, name)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)


def qualified_name(namespace: str | None, name: str) -> str:
    """The name the model sees for a tool of a namespace group (and writes in its calls): NAMESPACE.NAME."""
    return f"{namespace}.{name}" if namespace else name


def _string(item: dict, name: str, p: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{p}.{name} must be a non-empty string", f"{p}.{name}")
    return value


def _input_image(part: dict, p: str, fetch: bool) -> ImageInput:
    """{"type": "input_image", "image_url": "data:...", "detail"}: detail means nothing to Qwen's processor."""
    if part.get("file_id") is not None:
        raise bad_request(f"{p}: file_id is not supported (this server stores no files); send the image as a data: "
                          "URL in image_url", p)
    if "image_url" not in part:
        raise bad_request(f"{p}.image_url is required (a data: URL)", p)
    return image_from_url(part["image_url"], p, fetch)


def _parts_text(value: Any, param: str, allowed: tuple[str, ...], key: str = "text",
                images: list[ImageInput] | None = None, fetch: bool = False) -> str:
    """A string, or a list of parts of the allowed types -> their text joined with "\\n". With `images` (a list),
    input_image parts are accepted too: the image marker goes in place and the image is appended to it."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param)
    out = ContentJoiner()
    for j, part in enumerate(value):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images is not None:
            images.append(_input_image(part, p, fetch))
            out.image()
            continue
        if kind in UNSUPPORTED_PARTS:
            raise bad_request(f"{p}: {kind} parts are not supported by this server", f"{p}.type")
        if kind not in allowed:
            raise bad_request(f"{p}.type must be one of {', '.join(allowed)}; got {kind!r}", f"{p}.type")
        if not isinstance(part.get(key), str):
            raise bad_request(f"{p}.{key} must be a string", f"{p}.{key}")
        out.text(part[key])
    return out.result()


def _reject_images(content: Any, param: str) -> None:
    """A system / developer message may not hold images (the template's own rule)."""
    for j, part in enumerate(content if isinstance(content, list) else []):
        if isinstance(part, dict) and part.get("type") == "input_image":
            raise bad_request(f"{param}[{j}]: {SYSTEM_IMAGE_ERROR}", f"{param}[{j}]")


def _reasoning_text(item: dict, p: str) -> str:
    content = item.get("content")
    if content:
        return _parts_text(content, f"{p}.content", ("reasoning_text",))
    summary = item.get("summary")
    return _parts_text(summary, f"{p}.summary", ("summary_text",)) if summary else ""


def _namespace(item: dict, p: str) -> str | None:
    value = item.get("namespace")
    if value is not None and (not isinstance(value, str) or not value):
        raise bad_request(f"{p}.namespace must be a non-empty string", f"{p}.namespace")
    return value


def _function_call(item: dict, p: str) -> dict[str, Any]:
    call_id, name = _string(item, "call_id", p), qualified_name(_namespace(item, p), _string(item, "name", p))
    try:
        args = tool_call_arguments(item.get("arguments"), f"{p}.arguments")
    except MessageError as e:
        raise bad_request(str(e), e.param) from None
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _input(value: Any, images: list[ImageInput], fetch: bool = False) -> list[dict[str, Any]]:
    """Responses input items -> chat messages (OpenAI shape, in the client's order); the input_image parts are
    appended to `images` in the same order."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []

    def assistant() -> dict[str, Any]:
        """The open assistant turn: reasoning, text and calls that follow each other belong to one turn."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(value):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{p} must be an object (a message or another input item)", p)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{p}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{p}.role")
            if "content" not in item:
                raise bad_request(f"{p}.content is required", f"{p}.content")
            if role in SYSTEM_ROLES:
                _reject_images(item["content"], f"{p}.content")
            user_images = images if role == "user" else None          # assistant turns: text parts only
            text = _parts_text(item["content"], f"{p}.content", TEXT_PARTS, images=user_images, fetch=fetch)
            if role == "assistant":
                turn = assistant()
                turn["content"] = "\n".join(t for t in (turn["content"], text) if t)
            else:
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            assistant().setdefault("tool_calls", []).append(_function_call(item, p))
        elif kind == "custom_tool_call":
            call_id = _string(item, "call_id", p)
            name = qualified_name(_namespace(item, p), _string(item, "name", p))
            if not isinstance(item.get("input"), str):
                raise bad_request(f"{p}.input must be a string", f"{p}.input")
            arguments = {FREEFORM_INPUT: item["input"]}       # rendered as the model writes such a call
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _string(item, "call_id", p)
            if "output" not in item:
                raise bad_request(f"{p}.output is required", f"{p}.output")
            text = _parts_text(item["output"], f"{p}.output", TEXT_PARTS, images=images, fetch=fetch)
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            text = _reasoning_text(item, p)
            turn = assistant()
            if text:
                turn["reasoning_content"] = "\n".join(t for t in (turn.get("reasoning_content"), text) if t)
        else:
            raise bad_request(f"{p}.type must be one of {', '.join(ITEMS)}; got {kind!r}", f"{p}.type")
    return out


def _tools(body: dict, custom: dict[str, dict[str, Any]], left_out: list[str], namespaced: dict[str, tuple[str, str]]
           ) -> tuple[list[dict[str, Any]] | None, Any, list[dict[str, Any]], Any]:
    """Responses tools + tool_choice -> chat tools + tool_choice, and both as the response echoes them. Custom
    tools' input formats land in `custom` (by name), the types of the tools left out in `left_out`, the tools of
    namespace groups in `namespaced` (the model sees each as NAMESPACE.NAME)."""
    echoed: list[dict[str, Any]] = []

    def read_one(tool: dict[str, Any], p: str, namespace: str | None = None) -> dict[str, Any]:
        """A function or custom tool -> the function tool the template shows (under its qualified name)."""
        name = tool.get("name")
        if namespace is not None and isinstance(name, str) and name:
            namespaced[qualified_name(namespace, name)] = (namespace, name)
            tool = {**tool, "name": qualified_name(namespace, name)}
        if tool.get("type") == "custom":
            fn, fmt = freeform_tool(tool, p)
            custom[fn["function"]["name"]] = fmt
            return fn
        return function_tool(tool, p)

    def read(tool: dict[str, Any], p: str) -> dict[str, Any] | list[dict[str, Any]] | None:
        kind = tool.get("type")
        if kind == "function":
            fn = read_one(tool, p)
            echoed.append({"type": "function", "name": fn["function"]["name"],
                           "description": fn["function"].get("description"),
                           "parameters": fn["function"]["parameters"], "strict": tool.get("strict")})
            return fn
        if kind == "custom":
            fn = read_one(tool, p)
            echoed.append({"type": "custom", "name": fn["function"]["name"],
                           "description": tool.get("description"), "format": custom[fn["function"]["name"]]})
            return fn
        if kind == "namespace":                      # a group of function / custom tools the client runs (Codex's
            namespace = _string(tool, "name", p)     # multi_agent_v1): each offered as NAMESPACE.NAME
            inner = tool.get("tools")
            if not isinstance(inner, list) or not inner:
                raise bad_request(f"{p}.tools must be a non-empty list of function or custom tools", f"{p}.tools")
            fns = []
            for j, member in enumerate(inner):
                q = f"{p}.tools[{j}]"
                if not isinstance(member, dict) or member.get("type") not in ("function", "custom"):
                    raise bad_request(f'{q}.type must be "function" or "custom"', f"{q}.type")
                fns.append(read_one(member, q, namespace))
            echoed.append(tool)
            return fns
        if not isinstance(kind, str) or not kind:
            raise bad_request(f"{p}.type must be \"function\", \"custom\", \"namespace\" or a hosted tool's type; "
                              f"got {kind!r}", f"{p}.type")
        leave_out(left_out, kind, "/v1/responses")   # a hosted tool: nothing here can run it
        echoed.append(tool)
        return None

    tools = function_tools(body.get("tools"), read)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    chat_choice = choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind not in ("function", "custom") or not isinstance(choice.get("name"), str):
            hosted = f" ({kind!r} is a hosted tool this server cannot run)" if isinstance(kind, str) and kind \
                not in ("function", "custom", "allowed_tools") else ""
            raise bad_request('tool_choice must be "auto", "none", "required" or {"type": "function" | "custom", '
                              f'"name": ...}}{hosted}', "tool_choice")
        name = qualified_name(_namespace(choice, "tool_choice"), choice["name"])
        if (name in custom) != (kind == "custom"):
            raise bad_request(f"tool_choice names {kind} tool {name!r}, which is not a {kind} tool in tools",
                              "tool_choice")
        chat_choice = named_tool(tools, name, "tool_choice", noun=f"{kind} tool")
    elif choice not in ("auto", "none", "required"):
        raise bad_request(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name": ...}}; '
                          f"got {choice!r}", "tool_choice")
    offered, chat_choice = chat_tools(tools, chat_choice)
    return offered, chat_choice, echoed, choice


def _reasoning(body: dict) -> tuple[dict[str, Any], dict[str, Any]]:
    """(template kwargs, the response's reasoning echo)."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return {}, {"effort": None, "summary": None}
    if not isinstance(reasoning, dict):
        raise bad_request("reasoning must be an object", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"reasoning.effort must be one of {', '.join(EFFORTS)}; got {effort!r}", "reasoning.effort")
    kwargs = {"enable_thinking": False} if effort == "none" else {}   # other efforts: the template's default
    return kwargs, {"effort": effort, "summary": None}


def _text(body: dict) -> dict[str, Any]:
    text = body.get("text")
    if text is None:
        return {"format": {"type": "text"}}
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise bad_request('text must be {"format": {"type": ...}}', "text")
    fmt = fmt or {"type": "text"}
    if fmt.get("type") not in TEXT_FORMATS:
        raise bad_request(f"text.format.type must be one of {', '.join(TEXT_FORMATS)}; got {fmt.get('type')!r}",
                          "text.format.type")
    parse_response_format(fmt, "text.format", nested=False)       # the checks; the constraint is built below
    return {"format": fmt}


INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url",
              "web_search_call.action.sources", "web_search_call.results", "code_interpreter_call.outputs",
              "computer_call_output.output.image_url", "file_search_call.results")
IGNORED = {"prompt_cache_key": str, "prompt_cache_retention": str, "safety_identifier": str, "service_tier": str,
           "context_management": list, "max_tool_calls": int}
REFUSED = {"background": lambda v: "responses run in the foreground (background: false)" if v else None,
           "prompt": lambda v: "stored prompt templates are not available; send instructions and input"}


def _include(body: dict) -> bool:
    """include: what to add to the output. message.output_text.logprobs is honoured; the other values name outputs
    this server never makes (encrypted reasoning, hosted tools' results, stored images), so there is nothing to add,
    and a value this server does not know is logged once (protocol.note_markers), not refused."""
    value = body.get("include")
    if value is None:
        return False
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request("include must be a list of strings", "include")
    note_markers("Responses include", set(value), INCLUDABLE)
    return "message.output_text.logprobs" in value


def _check_stateless(body: dict) -> None:
    """What would need a stored response is refused; `store` itself is only type-checked: true asks to keep this
    response, which is not done, and the response's own `store: false` says so (as vLLM does by default)."""
    if body.get("previous_response_id") is not None:
        raise bad_request(f"{STATELESS} previous_response_id", "previous_response_id")
    read_field(body, "store", boolean, False)
    if body.get("conversation") is not None:
        raise bad_request(f"{STATELESS} conversation", "conversation")


def parse_responses_request(body: dict, fetch_image_urls: bool = False) -> ResponsesRequest:
    """fetch_image_urls (server.fetch_image_urls): http(s) image URLs become RemoteImages instead of a 400."""
    _check_stateless(body)
    unused_fields(body, REFUSED, IGNORED)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, got {model!r}", "model")
    if "input" not in body or body["input"] is None:
        raise bad_request("input is required (a string or a list of items)", "input")
    images: list[ImageInput] = []
    messages = _input(body["input"], images, fetch_image_urls)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    custom: dict[str, dict[str, Any]] = {}
    left_out: list[str] = []
    namespaced: dict[str, tuple[str, str]] = {}
    tools, tool_choice, echoed_tools, echoed_choice = _tools(body, custom, left_out, namespaced)
    template_kwargs, reasoning = _reasoning(body)
    text = _text(body)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("metadata must be an object", "metadata")
    truncation = body.get("truncation")
    if truncation is not None and truncation not in ("auto", "disabled"):
        raise bad_request(f'truncation must be "auto" or "disabled"; got {truncation!r}', "truncation")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("user must be a string", "user")
    max_tokens = read_field(body, "max_output_tokens", integer, lo=1)
    logprobs = _include(body)
    top_logprobs = read_field(body, "top_logprobs", integer, 0, lo=0, hi=MAX_LOGPROBS)
    params = SamplingParams(temperature=read_field(body, "temperature", number, 1.0),
                            top_p=read_field(body, "top_p", number, 1.0),
                            constraint=parse_response_format(text["format"], "text.format", nested=False),
                            speculative=read_field(body, "speculative", boolean, True),
                            logprobs=top_logprobs if logprobs else None, max_tokens=max_tokens)
    stream = read_field(body, "stream", boolean, False)
    read_field(body, "stream_options", stream_options_field, stream=stream, allowed=("include_obfuscation",))
    options = GenerationOptions(params=params, max_tokens_field="max_output_tokens", stop=[],
                                n=1, stream=stream, include_usage=True, return_token_ids=False)
    parallel = read_field(body, "parallel_tool_calls", boolean, True)
    chat = ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice, template_kwargs=template_kwargs,
                       logprobs=logprobs, top_logprobs=top_logprobs, options=options, images=images, custom_tools=custom,
                       left_out=left_out, parallel_tool_calls=parallel)
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "metadata": metadata or {},
            "parallel_tool_calls": parallel, "previous_response_id": None,
            "reasoning": reasoning, "store": False, "temperature": params.temperature, "text": text,
            "tool_choice": echoed_choice, "tools": echoed_tools, "top_logprobs": top_logprobs, "top_p": params.top_p,
            "truncation": truncation or "disabled", "user": user}
    return ResponsesRequest(chat, echo, logprobs, namespaced)


# ---------------------------------------------------------------------------------------------------------------
# POST /v1/responses

FIELDS = Fields("input", "max_output_tokens", renamed={"response_format": "text.format"})


async def create_response(request: web.Request) -> web.StreamResponse:
    state, engine = serving(request)
    note_openai_beta(request.headers)
    req = parse_responses_request(await read_json(request), state.cfg.server.fetch_image_urls)
    if req.chat.left_out:
        state.metrics.on_tools_left_out(req.chat.left_out)
    chat = ChatFormat.of(state.cfg)
    prompt = await asyncio.to_thread(prompt_ids, chat, req, engine.tokenizer)
    images: list[Any] = []
    if req.chat.images:                               # the ids grow by each image's tokens
        prompt, images = await prepare_images(state, engine, req.chat.images, prompt, FIELDS)
    with start_generation(state, engine, req.chat.options, [prompt], "resp_", FIELDS, images) as gen:
        if req.chat.options.stream:
            return await sse(request, response_events(chat, req, gen.meta, gen.pieces()))
        (choice,) = await gen.collect()
        return json_response(response_of(chat, req, gen.meta, choice, gen.usage()))


def prompt_ids(chat: ChatFormat, req: ResponsesRequest, tokenizer: Tokenizer) -> list[int]:
    try:
        return chat.prompt_ids(req.chat, tokenizer)
    except APIError as e:                             # the template rejected the history: it came from `input`
        if e.param == "messages":
            e.param = "input"
            e.message = e.message.replace("the messages", "the input")
        raise


# ---------------------------------------------------------------------------------------------------------------
# The answer: the response object and the stream's events

def response_of(chat: ChatFormat, req: ResponsesRequest, meta: Meta, r: Choice, usage: Usage) -> dict[str, Any]:
    answer = chat.split(req.chat, r)
    output: list[dict[str, Any]] = []
    tokens = count_reasoning_tokens(r.token_ids, meta.token_text, answer.reasoning, answer.reasoning_end)
    if answer.reasoning:
        output.append(reasoning_item(new_id("rs_"), answer.reasoning))
    if answer.content:
        output.append(message_item(new_id("msg_"), answer.content))
        if req.logprobs:                              # the answer's tokens: those after the think block
            output[-1]["content"][0]["logprobs"] = logprob_content(meta, r.events[tokens:])
    calls = answer.calls[:-1] if answer.last_call_cut else answer.calls   # a cut call is no call to run
    for call in calls:
        output.append(call_item(req, call["id"], call["function"]["name"], call["function"]["arguments"]))
    status = status_of(r.finish_reason)
    if status == "incomplete" and not output:
        output.append(message_item(new_id("msg_"), ""))
    # the item the token limit cut is incomplete; a call is whole (a cut one was dropped), as the stream has it
    if status == "incomplete" and output[-1]["type"] not in ("function_call", "custom_tool_call"):
        output[-1]["status"] = "incomplete"
    return response_body(req, meta, output, status, usage_body(usage, tokens))


async def response_events(chat: ChatFormat, req: ResponsesRequest, meta: Meta, pieces: AsyncIterator[Piece]
                          ) -> AsyncIterator[bytes]:
    """The stream: ResponsesStream's events as SSE, each named by its type (response.completed ends it)."""
    out = ResponsesStream(chat, req, meta)
    for event in out.start():
        yield sse_named_event(event)
    async for p in pieces:
        for event in out.piece(p):
            yield sse_named_event(event)
    for event in out.end(meta.usage()):
        yield sse_named_event(event)


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def usage_body(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
                       ) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def custom_tool_call_item(item_id: str, call_id: str, name: str, input: str, status: str = "completed"
                          ) -> dict[str, Any]:
    return {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": name, "input": input,
            "status": status}


def call_item(req: ResponsesRequest, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A parsed call as its output item: a custom_tool_call for a freeform tool, else a function_call; a tool of a
    namespace group under its own name, with the namespace beside it."""
    if name in req.chat.custom_tools:
        item = custom_tool_call_item(new_id("ctc_"), call_id, name, freeform_input(arguments))
    else:
        item = function_call_item(new_id("fc_"), call_id, name, arguments)
    if name in req.namespaced:
        item["namespace"], item["name"] = req.namespaced[name]
    return item


def response_body(req: ResponsesRequest, meta: Meta, output: list[dict[str, Any]], status: str,
                  usage: dict[str, Any] | None) -> dict[str, Any]:
    """The response object; status in_progress (stream start), completed or incomplete."""
    return {"id": meta.request_id, "object": "response", "created_at": meta.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": meta.model, "output": output, **req.echo, "usage": usage}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesStream:
    """response.created, response.in_progress; per output item output_item.added, (content_part.added, text deltas,
    text done, content_part.done | argument deltas, arguments done | custom tool input delta, input done),
    output_item.done; response.completed with the whole response. Every event carries a sequence_number, and a
    copy of the item as it is at that event (the item itself grows after it)."""

    def __init__(self, chat: ChatFormat, req: ResponsesRequest, meta: Meta) -> None:
        self.req, self.meta = req, meta
        self.choice = ChatStreamChoice(chat, req.chat)
        self.seq = 0
        self.output: list[dict[str, Any]] = []        # items so far; the last one is open while `open`
        self.open = False
        self.token_ids: list[int] = []
        self.reasoning = ""
        self.arguments = ""                           # the open custom tool call's arguments (JSON) so far
        self.finish_reason: str | None = None
        self.pending: list[Any] = []                  # token events not yet given to a text delta (logprobs)
        self.answering = False                        # a text delta went out: the think block is behind
        # a call goes out once it is whole (a call max_output_tokens cuts off is no call to run): (its parser index,
        # its item, its arguments so far)
        self.held: tuple[int, dict[str, Any], str] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        snapshot = response_body(self.req, self.meta, [], "in_progress", None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    # ---- items ----
    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.output.append(item)
        self.open = True
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                               item={**copy.deepcopy(item), "status": "in_progress"}))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        elif item["type"] == "reasoning":
            out.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                   part={"type": "reasoning_text", "text": ""}))
        return out

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        if not self.open:
            return []
        self.open = False
        item = self.output[-1]
        item["status"] = status
        where, out = self._where(), []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                   logprobs=part["logprobs"]))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=dict(part)))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=dict(part)))
        elif item["type"] == "custom_tool_call":       # its input is whole once its arguments are
            item["input"] = freeform_input(self.arguments)
            if item["input"]:
                out.append(self._event("response.custom_tool_call_input.delta", **where, delta=item["input"]))
            out.append(self._event("response.custom_tool_call_input.done", **where, input=item["input"]))
        else:
            out.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                   arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=where["output_index"],
                               item=copy.deepcopy(item)))
        return out

    def _piece(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if "tool_calls" not in piece or "id" in piece["tool_calls"][0]:
            out += self._release(whole=True)          # what follows a call means that call is whole
        last = self.output[-1] if self.open else None
        if "reasoning_content" in piece:
            text = piece["reasoning_content"]
            self.reasoning += text
            if last is None or last["type"] != "reasoning":
                out += self._open(reasoning_item(new_id("rs_"), ""))
            self.output[-1]["content"][0]["text"] += text
            out.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        elif "content" in piece:
            text = piece["content"]
            if last is None or last["type"] != "message":
                out += self._open(message_item(new_id("msg_"), ""))
            logprobs = self._answer_logprobs() if self.req.logprobs else []
            self.output[-1]["content"][0]["text"] += text
            self.output[-1]["content"][0]["logprobs"] += logprobs
            out.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                   logprobs=logprobs))
        elif "tool_calls" in piece:
            call = piece["tool_calls"][0]
            if "id" in call:                          # a new call: its own item, once it is whole
                out += self._close()
                self.held = (call["index"], call_item(self.req, call["id"], call["function"]["name"], ""), "")
            elif self.held is not None:
                index, item, arguments = self.held
                self.held = (index, item, arguments + (call["function"].get("arguments") or ""))
        return out

    def _release(self, whole: bool) -> list[dict[str, Any]]:
        """The held call's events, when it is whole (else it is dropped: the end of output cut it off)."""
        if self.held is None:
            return []
        (_, item, arguments), self.held = self.held, None
        if not whole:
            return []
        out = self._open(item)
        if item["type"] == "custom_tool_call":
            self.arguments = arguments
        elif arguments:
            item["arguments"] = arguments
            out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return out + self._close()

    def _answer_logprobs(self) -> list[dict[str, Any]]:
        """Logprobs of the tokens since the last text delta, the think block's (through the token that closes it)
        left out."""
        events, self.pending = self.pending, []
        if not self.answering:
            self.answering, text = True, ""
            for k, e in enumerate(events):
                text += self.meta.token_text(e.token_id)
                if THINK_END in text:
                    events = events[k + 1:]
                    break
        return logprob_content(self.meta, events)

    def piece(self, d: Piece) -> list[dict[str, Any]]:
        self.token_ids += d.token_ids
        self.pending += d.events
        final = d.finish_reason is not None
        out: list[dict[str, Any]] = []
        for piece in self.choice.pieces(d.text, final, truncated=d.finish_reason == "length"):
            out += self._piece(piece)
        tools = self.choice.tools
        if self.held is not None and (final or tools is None or tools.open_call != self.held[0]):
            out += self._release(whole=tools is None or self.held[0] not in tools.cut_calls)
        if final:
            self.finish_reason = d.finish_reason
        return out

    def end(self, usage: Usage) -> list[dict[str, Any]]:
        status = status_of(self.finish_reason)
        out = self._close(status)
        if status == "incomplete" and not self.output:
            out += self._open(message_item(new_id("msg_"), "")) + self._close(status)
        parser = self.choice.reasoning
        tokens = count_reasoning_tokens(self.token_ids, self.meta.token_text, self.reasoning,
                                        parser.end_offset if parser is not None else None)
        body = response_body(self.req, self.meta, [dict(item) for item in self.output], status,
                             usage_body(usage, tokens))
        return out + [self._event("response.completed", response=body)]
