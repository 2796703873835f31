"""OpenAI's Responses API without HTTP: POST /v1/responses as an Endpoint (what Codex speaks: wire_api =
"responses").

Stateless: nothing is stored, so `previous_response_id` and `store: true` get a 400 telling the client to resend
the whole history in `input` (Codex sends `store: false` and the full history every turn). A Responses request is
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
Mapping (response): responses_output.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .chat import (FREEFORM_INPUT, ChatFormat, ChatRequest, TranslatedRequest, chat_tools, count_reasoning_tokens,
                   freeform_tool, function_tool, function_tools, leave_out, named_tool)
from .protocol import (APIError, ChoiceResult, Endpoint, GenerationOptions, ImageInput, Meta, Usage, bad_request,
                       boolean, image_from_url, integer, logprob_content, note_markers, note_openai_beta, number,
                       parse_response_format, read_field, stream_options_field, unused_fields)
from .responses_output import (ResponsesStream, call_item, message_item, new_id, reasoning_item, response_body,
                               status_of, usage_body)
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
    if body.get("previous_response_id") is not None:
        raise bad_request(f"{STATELESS} previous_response_id", "previous_response_id")
    store = read_field(body, "store", boolean, False)
    if store:
        raise bad_request(f"{STATELESS} store: true", "store")
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
                            logprobs=top_logprobs if logprobs else None)
    stream = read_field(body, "stream", boolean, False)
    read_field(body, "stream_options", stream_options_field, stream=stream, allowed=("include_obfuscation",))
    options = GenerationOptions(params=params, max_tokens=max_tokens, max_tokens_field="max_output_tokens", stop=[],
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


class Responses(Endpoint[ResponsesRequest]):
    """POST /v1/responses. The parsers come from the config's [parsers] table, as for /v1/chat/completions."""

    id_prefix = "resp_"
    prompt_field = "input"

    def __init__(self, reasoning_parser: str = "", tool_parser: str = "", fetch_image_urls: bool = False) -> None:
        self.format = ChatFormat(reasoning_parser, tool_parser)
        self.fetch_image_urls = fetch_image_urls

    def parse(self, body: dict, served_name: str, headers: Any = None) -> ResponsesRequest:
        note_openai_beta(headers)
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
            output.append(reasoning_item(new_id("rs_"), answer.reasoning))
        if answer.content:
            output.append(message_item(new_id("msg_"), answer.content))
            if req.logprobs:                          # the answer's tokens: those after the think block
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

    def stream(self, req: ResponsesRequest, meta: Meta) -> ResponsesStream:
        return ResponsesStream(self.format, req, meta)
