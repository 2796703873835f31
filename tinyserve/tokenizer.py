"""Tokenizer and chat template.

`tokenizers` does the encoding; the checkpoint's jinja2 chat template is rendered with the same semantics as
Hugging Face transformers (sandboxed, trim_blocks + lstrip_blocks, loopcontrols, a `tojson` that keeps non-ASCII),
so a prompt built here is the prompt the model was trained on. The detokenizer turns a growing list of token ids
into text (generation.IncrementalDetokenizer) from each token's bytes (Tokenizer.token_bytes).
"""
from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

log = logging.getLogger("tinyserve.tokenizer")

# The tags the reasoning and tool-call parsers read in the output text. Qwen's tokenizers make them ordinary added
# tokens, but some fine-tunes flag them special, and detokenizing with skip_special_tokens would drop them: decode
# keeps them by id whatever the flags say.
PARSER_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character map that byte-level BPE (tokenizers' ByteLevel) spells tokens in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# ---------------------------------------------------------------------------------------------------------------
# chat template environment (Hugging Face semantics)
# ---------------------------------------------------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and forces ASCII; chat templates expect plain json.dumps.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTagExtension(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some HF templates to mark assistant text): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTagExtension])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data


def _pick_template(raw: Any, source: Path) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"}: take "default" (as transformers does)."""
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{source}: chat_template is a list without a template named 'default' "
                             f"(found {sorted(str(n) for n in named)})")
        return named["default"]
    raise ValueError(f"{source}: chat_template must be a string or a list of named templates")


class MessageError(ValueError):
    """A chat message the template cannot take; `param` says where (e.g. messages[1].content[0])."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# One image in a prompt, as Qwen3.5's template renders an image part: one pad, which the engine widens to the image's
# token count (multimodal.Images.prepare).
IMAGE_MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
SYSTEM_IMAGE_ERROR = "System message cannot contain images."      # the template's own words
SYSTEM_ROLES = ("system", "developer")


class ContentJoiner:
    """One message's content as a string, built part by part in order: "\\n" between consecutive text parts (as vLLM
    joins them), IMAGE_MARKER for each image with nothing around it (as Qwen's template renders one). Every protocol
    builds content through here, so the same parts give the same prompt whichever API sent them."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._after_text = False

    def text(self, text: str) -> None:
        if self._after_text:
            self._pieces.append("\n")
        self._pieces.append(text)
        self._after_text = True

    def image(self) -> None:
        self._pieces.append(IMAGE_MARKER)
        self._after_text = False

    @property
    def empty(self) -> bool:
        """No part at all (an empty text part counts as a part)."""
        return not self._pieces

    def result(self) -> str:
        return "".join(self._pieces)


def content_text(content: Any, param: str, images: bool = True) -> str | None:
    """A message's content as one string (None stays None: templates render it as nothing).

    Text parts are joined with "\\n", as vLLM does (Qwen's templates would concatenate them with nothing between);
    an image_url part becomes IMAGE_MARKER in place (ContentJoiner). The API and apply_chat_template both come
    through here, so a prompt is the same whichever path built it. The images themselves are the caller's: this
    renders where they go. images=False (a system message): an image part is a MessageError.
    """
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MessageError(f"{param} must be a string or a list of content parts", param)
    out = ContentJoiner()
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(part, str):                    # a bare string part (vLLM accepts it too)
            out.text(part)
        elif kind == "text" and isinstance(part.get("text"), str):
            out.text(part["text"])
        elif kind == "image_url":
            if not images:
                raise MessageError(f"{param}[{j}]: {SYSTEM_IMAGE_ERROR}", f"{param}[{j}]")
            out.image()
        else:
            kind = kind if isinstance(part, dict) else type(part).__name__
            raise MessageError(f"{param}[{j}]: unsupported content part type {kind!r} "
                               "(text and image_url parts are supported)", f"{param}[{j}]")
    return out.result()


def late_system_text(text: str) -> str:
    """A system message sent after the conversation started (Claude Code's environment and reminders, a late
    "developer" message) as the text of a user turn in its place. Qwen's templates take a system message only first
    ("System message must be at the beginning."); moving it there would change the prompt's start on every turn and
    lose the prefix cache, so it stays where it was sent, marked as the system's as Claude Code marks system text
    inside user turns."""
    return f"<system-reminder>\n{text}\n</system-reminder>"


def tool_call_arguments(arguments: Any, param: str) -> dict:
    """An earlier tool call's arguments as a mapping: templates iterate `arguments | items` (vLLM parses them too)."""
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise MessageError(f"{param} is not valid JSON", param) from None
    if not isinstance(arguments, dict):
        raise MessageError(f"{param} must be a JSON object", param)
    return arguments


# OpenAI-shaped messages -> what Qwen-style templates expect, without touching the caller's dicts: content parts
# joined, images as IMAGE_MARKER (content_text), tool-call arguments parsed (tool_call_arguments). Qwen's templates
# take one system message, first ("System message must be at the beginning."): the system messages that open the
# conversation are joined into one, and a later one becomes a user turn in its place (late_system_text). A message of
# text alone is taken as it is. Raises MessageError.
def normalise_messages(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise MessageError(f"messages[{i}] must be an object", f"messages[{i}]")
        if msg.get("role") in SYSTEM_ROLES:
            _add_system(out, msg, i)
        elif isinstance(msg.get("content"), (str, type(None))) and not isinstance(msg.get("tool_calls"), list):
            out.append(msg)
        else:
            out.append(_normalise_parts(msg, i))
    return out


def _add_system(out: list[dict], msg: dict, i: int) -> None:
    """A system message: the one that opens the conversation (joined with those right before it), or a user turn in
    its place once the conversation started."""
    if not out:                                      # templates know "system", not OpenAI's "developer"
        out.append(_normalise_parts({**msg, "role": "system"}, i, images=False))
        return
    text = content_text(msg.get("content"), f"messages[{i}].content", images=False)
    if len(out) == 1 and out[0].get("role") == "system":
        out[0]["content"] = "\n\n".join(t for t in (out[0].get("content"), text) if t)
    else:
        out.append({"role": "user", "content": late_system_text(text or "")})


def _normalise_parts(msg: dict, i: int, images: bool = True) -> dict:
    """A copy of msg with its content parts joined and its tool calls' arguments parsed."""
    msg = dict(msg)
    if "content" in msg:
        msg["content"] = content_text(msg["content"], f"messages[{i}].content", images=images)
    calls = msg.get("tool_calls")
    if isinstance(calls, list):
        new_calls = []
        for j, call in enumerate(calls):
            if isinstance(call, dict) and isinstance(call.get("function"), dict):
                fn = dict(call["function"])
                fn["arguments"] = tool_call_arguments(fn.get("arguments"),
                                                      f"messages[{i}].tool_calls[{j}].function.arguments")
                call = {**call, "function": fn}
            new_calls.append(call)
        msg["tool_calls"] = new_calls
    return msg


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------

_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _decoder_kinds(hf: HFTokenizer) -> set[str]:
    """The types of the tokenizer's decoder and of the decoders inside a Sequence."""
    if hf.decoder is None:
        return set()
    spec = json.loads(hf.decoder.__getstate__())
    return {d.get("type") for d in [spec, *spec.get("decoders", [])]}


@dataclass
class Tokenizer:
    """A checkpoint's tokenizer.json + chat template + end-of-sequence ids."""

    hf: HFTokenizer
    chat_template: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    special_tokens: dict[str, str] = field(default_factory=dict)   # bos_token, eos_token, ... -> token text
    name: str = ""

    def __post_init__(self) -> None:
        special = {i: t.content for i, t in self.hf.get_added_tokens_decoder().items() if t.special}
        # what skip_special_tokens drops: the special tokens but the parser markers
        self.skipped_ids = frozenset(i for i, text in special.items() if text not in PARSER_MARKERS)
        self._env = _make_environment()
        # the bytes a token adds to the text, cached: the detokenizer and logprobs ask for the same ids again
        self.token_bytes: Callable[[int], bytes] = functools.cache(self._token_bytes)
        self._added = {i: t.content for i, t in self.hf.get_added_tokens_decoder().items()}
        kinds = _decoder_kinds(self.hf)
        self._byte_level = "ByteLevel" in kinds
        if kinds != {"ByteLevel"}:                     # every Qwen checkpoint's is
            log.warning("the tokenizer's decoder is %s, not a byte-level BPE's: streamed text is each token's bytes "
                        "(IncrementalDetokenizer), which may differ from a whole decode at the start of a text",
                        "+".join(sorted(k or "?" for k in kinds)) or "none")
        self._template: jinja2.Template | None = None
        if self.chat_template is not None:
            try:
                self._template = self._env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ValueError(f"chat template of {self.name or 'tokenizer'} does not parse: {e.message} "
                                 f"(line {e.lineno})") from e

    @classmethod
    def from_folder(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{folder}: no tokenizer.json (a checkpoint folder needs one)")
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust library raises plain Exception subclasses
            raise ValueError(f"{tok_file}: cannot be loaded by `tokenizers` ({e})") from e

        config_file = folder / "tokenizer_config.json"
        tok_config = _read_json(config_file) if config_file.is_file() else {}

        # The template: chat_template.jinja wins over tokenizer_config.json (as in transformers).
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(tok_config.get("chat_template"), config_file)

        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_content(tok_config.get(key))
            if text is not None:
                special[key] = text

        # Eos ids: generation_config.json (int or list) plus the tokenizer's eos token.
        eos: list[int] = []
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            raw = _read_json(gen_file).get("eos_token_id")
            for v in ([raw] if isinstance(raw, int) else raw or []):
                if not isinstance(v, int):
                    raise ValueError(f"{gen_file}: eos_token_id must be an int or a list of ints, got {raw!r}")
                if v not in eos:
                    eos.append(v)
        if "eos_token" in special:
            eos_id = hf.token_to_id(special["eos_token"])
            if eos_id is None:
                raise ValueError(f"{config_file}: eos_token {special['eos_token']!r} is not in the vocabulary")
            if eos_id not in eos:
                eos.append(eos_id)
        return cls(hf=hf, chat_template=template, eos_token_ids=eos, special_tokens=special, name=str(folder))

    # ---- encode / decode ----
    @property
    def turn_start_id(self) -> int | None:
        """The token that opens each message of a rendered chat (ChatML's <|im_start|>, which every Qwen template
        writes), if the vocabulary has it."""
        return self.hf.token_to_id("<|im_start|>")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """skip_special_tokens drops the special tokens but the parser markers (PARSER_MARKERS)."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.skipped_ids]
        return self.hf.decode(list(ids), skip_special_tokens=False)

    # The bytes a token adds to the text (a piece of a character, for a byte token), so that the detokenizer and a
    # client reading logprobs rebuild characters that span tokens: a byte-level BPE piece mapped back through the
    # byte alphabet, a byte-fallback token <0xNN> its byte, an added token its own text.
    def _token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.hf.id_to_token(token_id) or ""     # "": an id past the vocabulary has no bytes
        if self._byte_level and _UNICODE_TO_BYTE.keys() >= set(piece):
            return bytes(map(_UNICODE_TO_BYTE.__getitem__, piece))
        if fallback := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("\u2581", " ").encode()       # SentencePiece's word marker is a space

    def token_text(self, token_id: int) -> str:
        """A token as logprobs show it: its text, or, when its bytes are not whole UTF-8 characters, OpenAI's
        "bytes:\\xNN..." spelling (U+FFFD would make different byte tokens look alike)."""
        data = self.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    # ---- chat template ----
    # The prompt text. `template_kwargs` (e.g. enable_thinking) are passed to the template as variables.
    # continue_final_message: the last message is a prefill the model continues (as transformers does it: the
    # rendering is cut right after that message's content, so its end-of-turn markup goes). Raises ValueError with
    # the template's own message when the template rejects the conversation, or fails on it (e.g. `'x' + none` on a
    # message it did not expect: bad input, not a server fault).
    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **template_kwargs: Any) -> str:
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        if self._template is None:
            raise ValueError(f"{self.name or 'this tokenizer'} has no chat template "
                             "(no chat_template.jinja and no chat_template in tokenizer_config.json)")
        try:
            text = self._template.render(**{**self.special_tokens, **template_kwargs, "tools": tools or None,
                                            "messages": normalise_messages(messages),
                                            "add_generation_prompt": add_generation_prompt})
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e.message or e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e
        return _cut_after_final(text, messages) if continue_final_message else text


def _cut_after_final(rendered: str, messages: list[dict]) -> str:
    """The rendered prompt up to the end of the last message's content (the whitespace around it aside: templates
    strip it, as Qwen's do)."""
    final = (content_text(messages[-1].get("content"), "messages[-1].content") or "") if messages else ""
    final = final.strip()
    if not final or final not in rendered:
        raise ValueError("the last message cannot be continued: its content is empty or the template does not "
                         "render it as sent")
    return rendered[:rendered.rindex(final) + len(final)]
