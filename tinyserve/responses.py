"""OpenAI's Responses API without HTTP: POST /v1/responses as an Endpoint (what Codex speaks: wire_api =
"responses").

Stateless: nothing is stored, so `previous_response_id` and `store: true` get a 400 telling the client to resend
the whole history in `input` (Codex sends `store: false` and the full history every turn). A Responses request is
translated into the chat request the chat route builds (chat.ChatRequest), so all protocols render the same prompt
through the same template and share the prefix cache; the answer is split by the same qwen3 reasoning and
qwen3_coder tool parsers (chat.ChatFormat) and written as Responses output items.

Mapping (request):
  instructions (string)              -> a system message first; it and the system / developer messages that open
                                        `input` are joined ("\\n\\n") into one system message
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
                                        the other include values name outputs never made here: accepted
  max_output_tokens, temperature, top_p, stream; metadata, parallel_tool_calls (false: one call at most),
  truncation, user are checked and echoed on the response; prompt_cache_key, safety_identifier, service_tier,
  max_tool_calls (built-in tools only), context_management and stream_options.include_obfuscation are type-checked
  and change nothing (docs/api.md); background and stored prompts are refused; model: any name is accepted (Codex
  sends its own), responses carry the served name; unknown fields are ignored.
Mapping (response): output items reasoning ("rs_...", summary [], content [reasoning_text]), message ("msg_...",
one output_text part), function_call ("fc_...", call_id "call_...", arguments a JSON string) and custom_tool_call
("ctc_...", input a string); status "incomplete"
with incomplete_details.reason "max_output_tokens" when the generation was cut by the token limit (its last item is
"incomplete" too). usage.output_tokens_details.reasoning_tokens counts the generated tokens up to the one that closes
the think block. A stream ends with response.completed whatever the status (the openai client's
get_final_response() needs it), carrying the same response the blocking call returns; every event carries the item
as it was at that event.
"""
from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from .parsers import THINK_END
from .chat import (FREEFORM_INPUT, ChatFormat, ChatRequest, ChatStreamChoice, TranslatedRequest, chat_tools,
                   freeform_input, freeform_tool, function_tool, function_tools, leave_out, named_tool)
from .protocol import (APIError, ChoiceResult, Delta, Endpoint, GenerationOptions, ImageInput, Meta, NamedEventStream,
                       Usage, bad_request, boolean_field, ignored_fields, image_from_url, integer_field,
                       logprob_content, number_field, parse_response_format, refused_fields, stream_options_field)
from .sampling import MAX_LOGPROBS, SamplingParams
from .tokenizer import SYSTEM_IMAGE_ERROR, SYSTEM_ROLES, ContentJoiner, MessageError, Tokenizer, tool_call_arguments

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text")
UNSUPPORTED_PARTS = ("input_file", "input_audio")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
ITEMS = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
         "reasoning")
TEXT_FORMATS = ("text", "json_object", "json_schema")
STATELESS = ("this server is stateless: it stores no responses, so send the whole conversation in `input` "
             "(with store: false) instead of")


# ---------------------------------------------------------------------------------------------------------------
# Requests

@dataclass
class ResponsesRequest(TranslatedRequest):
    echo: dict[str, Any]              # request fields the response object repeats
    logprobs: bool = False            # include message.output_text.logprobs (with the top_logprobs alternatives)


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


def _function_call(item: dict, p: str) -> dict[str, Any]:
    call_id, name = _string(item, "call_id", p), _string(item, "name", p)
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
            call_id, name = _string(item, "call_id", p), _string(item, "name", p)
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


def _merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """instructions and the system / developer messages that open the input -> one system message (templates take
    one system message, first)."""
    k = 0
    while k < len(messages) and messages[k]["role"] == "system":
        k += 1
    if k < 2:
        return messages
    text = "\n\n".join(m["content"] for m in messages[:k] if m["content"])
    return [{"role": "system", "content": text}] + messages[k:]


def _tools(body: dict, custom: dict[str, dict[str, Any]], left_out: list[str]
           ) -> tuple[list[dict[str, Any]] | None, Any, list[dict[str, Any]], Any]:
    """Responses tools + tool_choice -> chat tools + tool_choice, and both as the response echoes them. Custom
    tools' input formats land in `custom` (by name), the types of the tools left out in `left_out`."""
    echoed: list[dict[str, Any]] = []

    def read(tool: dict[str, Any], p: str) -> dict[str, Any] | None:
        kind = tool.get("type")
        if kind == "function":
            fn = function_tool(tool, p)
            echoed.append({"type": "function", "name": fn["function"]["name"],
                           "description": fn["function"].get("description"),
                           "parameters": fn["function"]["parameters"], "strict": tool.get("strict")})
            return fn
        if kind == "custom":
            fn, fmt = freeform_tool(tool, p)
            custom[fn["function"]["name"]] = fmt
            echoed.append({"type": "custom", "name": fn["function"]["name"],
                           "description": tool.get("description"), "format": fmt})
            return fn
        if not isinstance(kind, str) or not kind:
            raise bad_request(f"{p}.type must be \"function\", \"custom\" or a hosted tool's type; got {kind!r}",
                              f"{p}.type")
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
        if (choice["name"] in custom) != (kind == "custom"):
            raise bad_request(f"tool_choice names {kind} tool {choice['name']!r}, which is not a {kind} tool in "
                              "tools", "tool_choice")
        chat_choice = named_tool(tools, choice["name"], "tool_choice", noun=f"{kind} tool")
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
    """include: what to add to the output. message.output_text.logprobs is honoured; the others name outputs this
    server never makes (encrypted reasoning, hosted tools' results, stored images), so there is nothing to add."""
    value = body.get("include")
    if value is None:
        return False
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request("include must be a list of strings", "include")
    unknown = [v for v in value if v not in INCLUDABLE]
    if unknown:
        raise bad_request(f"include: {unknown[0]!r} is not one of {', '.join(INCLUDABLE)}", "include")
    return "message.output_text.logprobs" in value


def _check_stateless(body: dict) -> None:
    if body.get("previous_response_id") is not None:
        raise bad_request(f"{STATELESS} previous_response_id", "previous_response_id")
    store = boolean_field(body, "store", False)
    if store:
        raise bad_request(f"{STATELESS} store: true", "store")
    if body.get("conversation") is not None:
        raise bad_request(f"{STATELESS} conversation", "conversation")


def parse_responses_request(body: dict, fetch_image_urls: bool = False) -> ResponsesRequest:
    """fetch_image_urls (server.fetch_image_urls): http(s) image URLs become RemoteImages instead of a 400."""
    _check_stateless(body)
    refused_fields(body, REFUSED)
    ignored_fields(body, IGNORED)
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
    messages = _merge_leading_system(messages)
    custom: dict[str, dict[str, Any]] = {}
    left_out: list[str] = []
    tools, tool_choice, echoed_tools, echoed_choice = _tools(body, custom, left_out)
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
    max_tokens = integer_field(body, "max_output_tokens", None, lo=1)
    logprobs = _include(body)
    top_logprobs = integer_field(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    params = SamplingParams(temperature=number_field(body, "temperature", 1.0), top_p=number_field(body, "top_p", 1.0),
                            constraint=parse_response_format(text["format"], "text.format", nested=False),
                            speculative=boolean_field(body, "speculative", True),
                            logprobs=top_logprobs if logprobs else None)
    stream = boolean_field(body, "stream", False)
    stream_options_field(body, stream, ("include_obfuscation",))
    options = GenerationOptions(params=params, max_tokens=max_tokens, max_tokens_field="max_output_tokens", stop=[],
                                n=1, stream=stream, include_usage=True, return_token_ids=False)
    parallel = boolean_field(body, "parallel_tool_calls", True)
    chat = ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice, template_kwargs=template_kwargs,
                       logprobs=logprobs, top_logprobs=top_logprobs, options=options, images=images, custom_tools=custom,
                       left_out=left_out, parallel_tool_calls=parallel)
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "metadata": metadata or {},
            "parallel_tool_calls": parallel, "previous_response_id": None,
            "reasoning": reasoning, "store": False, "temperature": params.temperature, "text": text,
            "tool_choice": echoed_choice, "tools": echoed_tools, "top_logprobs": top_logprobs, "top_p": params.top_p,
            "truncation": truncation or "disabled", "user": user}
    return ResponsesRequest(chat, echo, logprobs)


# ---------------------------------------------------------------------------------------------------------------
# Responses

def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def usage_body(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def count_reasoning_tokens(token_ids: list[int], token_text: Callable[[int], str], reasoning: str | None,
                           reasoning_end: int | None) -> int:
    """Generated tokens that belong to the think block: up to the one that reaches `reasoning_end`, the offset in
    the output text where the block ended (all of them when it never ended); 0 without reasoning."""
    if not reasoning:
        return 0
    if reasoning_end is None:
        return len(token_ids)
    length = 0
    for k, token_id in enumerate(token_ids):
        length += len(token_text(token_id))
        if length >= reasoning_end:
            return k + 1
    return len(token_ids)


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
    """A parsed call as its output item: a custom_tool_call for a freeform tool, else a function_call."""
    if name in req.chat.custom_tools:
        return custom_tool_call_item(_id("ctc_"), call_id, name, freeform_input(arguments))
    return function_call_item(_id("fc_"), call_id, name, arguments)


def response_body(req: ResponsesRequest, meta: Meta, output: list[dict[str, Any]], status: str,
                  usage: dict[str, Any] | None) -> dict[str, Any]:
    """The response object; status in_progress (stream start), completed or incomplete."""
    return {"id": meta.request_id, "object": "response", "created_at": meta.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": meta.model, "output": output, **req.echo, "usage": usage}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class Responses(Endpoint[ResponsesRequest]):
    """POST /v1/responses. The parsers come from the config's [parsers] table, as for /v1/chat/completions."""

    id_prefix = "resp_"
    prompt_field = "input"

    def __init__(self, reasoning_parser: str = "", tool_parser: str = "", fetch_image_urls: bool = False) -> None:
        self.format = ChatFormat(reasoning_parser, tool_parser)
        self.fetch_image_urls = fetch_image_urls

    def parse(self, body: dict, served_name: str) -> ResponsesRequest:
        return parse_responses_request(body, self.fetch_image_urls)

    def error_param(self, req: ResponsesRequest, engine_field: str) -> str:
        if engine_field == "response_format":
            return "text.format"
        return super().error_param(req, engine_field)

    def prompt_ids(self, req: ResponsesRequest, tokenizer: Tokenizer) -> list[int]:
        try:
            return self.format.prompt_ids(req.chat, tokenizer)
        except APIError as e:                         # the template rejected the history: it came from `input`
            if e.param == "messages":
                e.param = "input"
                e.message = e.message.replace("the messages", "the input")
            raise

    def response(self, req: ResponsesRequest, meta: Meta, results: list[ChoiceResult], usage: Usage
                 ) -> dict[str, Any]:
        (r,) = results
        answer = self.format.split(req.chat, r)
        output: list[dict[str, Any]] = []
        tokens = count_reasoning_tokens(r.token_ids, meta.token_text, answer.reasoning, answer.reasoning_end)
        if answer.reasoning:
            output.append(reasoning_item(_id("rs_"), answer.reasoning))
        if answer.content:
            output.append(message_item(_id("msg_"), answer.content))
            if req.logprobs:                          # the answer's tokens: those after the think block
                output[-1]["content"][0]["logprobs"] = logprob_content(meta, r.events[tokens:])
        for call in answer.calls:
            output.append(call_item(req, call["id"], call["function"]["name"], call["function"]["arguments"]))
        status = _status(r.finish_reason)
        if status == "incomplete" and output:
            output[-1]["status"] = "incomplete"
        return response_body(req, meta, output, status, usage_body(usage, tokens))

    def stream(self, req: ResponsesRequest, meta: Meta) -> "ResponsesStream":
        return ResponsesStream(self, req, meta)


class ResponsesStream(NamedEventStream):
    """response.created, response.in_progress; per output item output_item.added, (content_part.added, text deltas,
    text done, content_part.done | argument deltas, arguments done | custom tool input delta, input done),
    output_item.done; response.completed with the whole response. Every event carries a sequence_number, and a
    copy of the item as it is at that event (the item itself grows after it)."""

    def __init__(self, endpoint: Responses, req: ResponsesRequest, meta: Meta) -> None:
        self.req, self.meta = req, meta
        self.choice = ChatStreamChoice(endpoint.format, req.chat)
        self.seq = 0
        self.output: list[dict[str, Any]] = []        # items so far; the last one is open while `open`
        self.open = False
        self.token_ids: list[int] = []
        self.reasoning = ""
        self.arguments = ""                           # the open custom tool call's arguments (JSON) so far
        self.finish_reason: str | None = None
        self.pending: list[Any] = []                  # token events not yet given to a text delta (logprobs)
        self.answering = False                        # a text delta went out: the think block is behind

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def error(self, err: APIError) -> dict[str, Any]:
        return self._event("error", code=err.code or err.type, message=err.message, param=err.param)

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
        last = self.output[-1] if self.open else None
        if "reasoning_content" in piece:
            text = piece["reasoning_content"]
            self.reasoning += text
            if last is None or last["type"] != "reasoning":
                out += self._open(reasoning_item(_id("rs_"), ""))
            self.output[-1]["content"][0]["text"] += text
            out.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        elif "content" in piece:
            text = piece["content"]
            if last is None or last["type"] != "message":
                out += self._open(message_item(_id("msg_"), ""))
            logprobs = self._answer_logprobs() if self.req.logprobs else []
            self.output[-1]["content"][0]["text"] += text
            self.output[-1]["content"][0]["logprobs"] += logprobs
            out.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                   logprobs=logprobs))
        elif "tool_calls" in piece:
            call = piece["tool_calls"][0]
            if "id" in call:                          # a new call: its own item
                out += self._open(call_item(self.req, call["id"], call["function"]["name"], ""))
                self.arguments = ""
            fragment = call["function"].get("arguments") or ""
            if fragment and self.open and self.output[-1]["type"] == "custom_tool_call":
                self.arguments += fragment
            elif fragment and self.open and self.output[-1]["type"] == "function_call":
                self.output[-1]["arguments"] += fragment
                out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=fragment))
        return out

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

    def delta(self, index: int, d: Delta) -> list[dict[str, Any]]:
        self.token_ids += d.token_ids
        self.pending += d.events
        final = d.finish_reason is not None
        out: list[dict[str, Any]] = []
        for piece in self.choice.pieces(d.text, final, truncated=d.finish_reason == "length"):
            out += self._piece(piece)
        if final:
            self.finish_reason = d.finish_reason
        return out

    def end(self, usage: Usage) -> list[dict[str, Any]]:
        status = _status(self.finish_reason)
        out = self._close(status)
        parser = self.choice.reasoning
        tokens = count_reasoning_tokens(self.token_ids, self.meta.token_text, self.reasoning,
                                        parser.end_offset if parser is not None else None)
        body = response_body(self.req, self.meta, [dict(item) for item in self.output], status,
                             usage_body(usage, tokens))
        return out + [self._event("response.completed", response=body)]
