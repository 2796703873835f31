"""Grammar-constrained decoding (JSON output) with llguidance.

Why llguidance: CPU wheels on PyPI with no torch dependency, JSON schema and Lark grammars, and it builds its token
trie straight from an HF `tokenizers` tokenizer.json (xgrammar also ships wheels, but pins torch-side pieces that
would tie our torch version to its releases).

A request's `SamplingParams.constraint` (a frozen `Constraint`, sampling.py) is compiled once at submit into a
`GrammarState` (one llguidance matcher), the request's record (req.grammar). An optional part (`Grammar`, held by
name by the intake, the runner and the engine), called at three places: the intake's `attach` (the matcher, or a
RequestError naming the field), the runner's `masks` (on the engine thread, before sampling, the library writes the
allowed-token bitmask of every constrained row into one preallocated int32 [rows, ceil(V / 32)] buffer,
`MaskBuffer`; sampling unpacks it and applies it to the [B, V] logits in one batched masked_fill) and the engine's
`advance` (each constrained request's matcher consumes its kept token; a token it rejects ends the request). The model's vocabulary may be larger than the tokenizer's: the matcher's vocabulary is
sized to the model's, and ids the tokenizer lacks have no bytes, so they are never allowed. EOS (the engine's eos
ids) is allowed only where the grammar accepts.

Tool calls: kind "tool_call" forces exactly one qwen3_coder call (`<tool_call>\n<function=NAME>\n<parameter=P>\n
VALUE\n</parameter>\n...</function>\n</tool_call>`, then EOS) of one of the given tools (tool_choice required / any)
or of the one named. `tool_call_grammar` builds it as a Lark grammar for llguidance, following how the qwen3_coder
parser (tool_calls.py) reads values: the tool's properties in schema order, the required ones present and the others
optional; a string value (or one with no type) is raw text without `</parameter>`, `</function>` or `<parameter=`
(so the parser can never read it another way; an enum of strings: one of them); any other type is one-line JSON of
its sub-schema (`%json`), which the parser types back. A freeform tool (Responses `custom`) has one parameter,
`input`: raw text, or the text its format's grammar (Lark or regex) accepts, as a sub-grammar of its own.
`<tool_call>` / `</tool_call>` are matched as the tokenizer's own tokens when it has them.

Reasoning: when the prompt opened `<think>`, the constraint starts after the model's `</think>` token; before it the
row is unconstrained (`GrammarState.active` is False).

Preemption: a preempted request keeps its output tokens and recomputes their KV without sampling them again, so the
matcher (which has consumed exactly the output tokens) stays correct; nothing is rolled back.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch
from llguidance import LLMatcher, LLTokenizer

from .request import Request, RequestError
from .sampling import Constraint, SamplingParams
from .tool_calls import FORMAT_SYNTAXES, FREEFORM_INPUT, FUNCTION_END, PARAMETER_END, TOOL_CALL_END, TOOL_CALL_START
from .tool_values import schema_types

log = logging.getLogger("tinyserve.grammar")

KINDS = ("json_object", "json_schema", "tool_call")
# One-line JSON with the usual separators: with llguidance's default (any whitespace between tokens) a model can
# emit whitespace forever and never close the object (vLLM's disable_any_whitespace exists for the same reason).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def constraint_grammar(constraint: Constraint, tool_call_tokens: tuple[int | None, int | None] = (None, None)) -> str:
    """The llguidance grammar of a constraint; ValueError on a kind or schema it cannot take. tool_call_tokens: the
    ids of `<tool_call>` and `</tool_call>` (None: the tokenizer has no such token; the text is matched)."""
    if constraint.kind == "tool_call":
        return tool_call_grammar(json.loads(constraint.schema or "[]"), *tool_call_tokens)
    if constraint.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
    if constraint.kind != "json_schema":
        raise ValueError(f"unknown constraint kind {constraint.kind!r} (expected one of {', '.join(KINDS)})")
    try:
        schema = json.loads(constraint.schema or "")
    except json.JSONDecodeError as e:
        raise ValueError(f"the schema is not valid JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ValueError("the schema must be a JSON object")
    try:
        return LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
    except Exception as e:                            # noqa: BLE001 - the library raises plain exceptions
        raise ValueError(f"the schema cannot be compiled: {e}") from None


def _lark_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


# Raw parameter text up to and including the closing "\n</parameter>": no earlier `</parameter>`, no `</function>`
# and no `<parameter=` (the parser would read a value that swallowed a parameter's opener as a missing
# `</parameter>`), so whatever the grammar lets through, the parser reads back as it was meant.
RAW_VALUE = (r"/(.|\n)*\n<\/parameter>/ & ~/(.|\n)*<\/parameter>(.|\n)+/ & ~/(.|\n)*<\/function>(.|\n)*/"
             r" & ~/(.|\n)*<parameter=(.|\n)*/")


def _tag_name(name: Any, what: str) -> str:
    """A function or parameter name the qwen3_coder format can carry (`<function=NAME>`, stripped by the parser)."""
    if not isinstance(name, str) or not name or name != name.strip() or ">" in name or "\n" in name:
        raise ValueError(f"{what} {name!r} cannot be written as a qwen3_coder tag (it must be non-empty, without "
                         "'>', newlines or surrounding whitespace)")
    return name


def _value_expansion(schema: Any, defs: dict[str, Any], where: str, rules: list[str], rule: str) -> str:
    """The Lark expansion of one parameter's value and its closing "\n</parameter>"."""
    if not isinstance(schema, dict):
        return "RAW_VALUE"
    types = schema_types(schema)
    choices = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema \
        else None
    if choices is not None and choices and all(isinstance(c, str) for c in choices) and set(types) <= {"string"}:
        for c in choices:
            if PARAMETER_END in c or FUNCTION_END in c:
                raise ValueError(f"{where}: the enum value {c!r} cannot be written as a qwen3_coder parameter")
        return "(" + " | ".join(_lark_string(c) for c in choices) + ") " + _lark_string("\n" + PARAMETER_END)
    if not types or "string" in types:
        return "RAW_VALUE"                            # any text is a string (or untyped) value
    sub = {**defs, **schema, "x-guidance": JSON_OPTIONS}
    rules.append(f"{rule}: %json {json.dumps(sub)}")
    return f"{rule} {_lark_string(chr(10) + PARAMETER_END)}"


def _freeform_input(fmt: Any, where: str, grammars: list[dict[str, str]]) -> str:
    """The Lark expansion of a freeform tool's input and its closing "\n</parameter>": raw text, or a sub-grammar
    (the format's Lark grammar, or its regex) llguidance runs as a grammar of its own."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text"):
        return "RAW_VALUE"
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if kind != "grammar" or syntax not in FORMAT_SYNTAXES or not isinstance(definition, str):
        raise ValueError(f"{where}: format must be {{\"type\": \"text\"}} or {{\"type\": \"grammar\", \"syntax\": "
                         f"\"lark\" | \"regex\", \"definition\"}}")
    name = f"g{len(grammars)}"
    lark = definition if syntax == "lark" else "start: /" + definition.replace("/", "\\/") + "/\n"
    grammars.append({"name": name, "lark_grammar": lark})
    return f"@{name} {_lark_string(chr(10) + PARAMETER_END)}"


def tool_call_grammar(tools: list[dict[str, Any]], open_id: int | None = None, close_id: int | None = None) -> str:
    """The llguidance grammar for exactly one qwen3_coder call of one of tools ([{"name", "parameters"}] or, for a
    freeform tool, [{"name", "format"}]) and nothing after it: a Lark grammar, or llguidance's JSON list of grammars
    when a freeform tool's format brings its own. ValueError naming the tool on a schema that cannot be written
    this way."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("no tool to call")
    rules: list[str] = []
    grammars: list[dict[str, str]] = []
    alternatives = []
    for i, tool in enumerate(tools):
        name = _tag_name(tool.get("name") if isinstance(tool, dict) else None, "the tool name")
        where = f"tool {name!r}"
        parts = [_lark_string(f"<function={name}>\n")]
        if "format" in tool:
            value = _freeform_input(tool["format"], where, grammars)
            rules.append(f"p{i}_0: {_lark_string(f'<parameter={FREEFORM_INPUT}>' + chr(10))} {value} \"\\n\"")
            rules.append(f"f{i}: {parts[0]} p{i}_0")
            alternatives.append(f"f{i}")
            continue
        params = tool.get("parameters")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError(f"{where}: parameters must be a JSON schema object")
        props = params.get("properties") or {}
        required = params.get("required") or []
        if not isinstance(props, dict) or not isinstance(required, list):
            raise ValueError(f"{where}: parameters.properties must be an object and required a list")
        defs = {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}
        names = list(props) + [r for r in required if r not in props]
        for j, pname in enumerate(names):
            pname = _tag_name(pname, f"{where}: the parameter name")
            value = _value_expansion(props.get(pname, {}), defs, f"{where}, parameter {pname!r}", rules,
                                     f"v{i}_{j}")
            rules.append(f"p{i}_{j}: {_lark_string(f'<parameter={pname}>' + chr(10))} {value} \"\\n\"")
            parts.append(f"p{i}_{j}" if pname in required else f"p{i}_{j}?")
        rules.append(f"f{i}: " + " ".join(parts))
        alternatives.append(f"f{i}")
    open_tag = f"<[{open_id}]>" if open_id is not None else _lark_string(TOOL_CALL_START)
    close_tag = f"<[{close_id}]>" if close_id is not None else _lark_string(TOOL_CALL_END)
    head = [
        "%llguidance {}",
        f"start: {open_tag} \"\\n\" ({' | '.join(alternatives)}) {_lark_string(FUNCTION_END + chr(10))} {close_tag}",
        f"RAW_VALUE: {RAW_VALUE}",
    ]
    lark = "\n".join(head + rules) + "\n"
    if not grammars:
        return lark
    return json.dumps({"grammars": [{"lark_grammar": lark}] + grammars})


class GrammarState:
    """One request's matcher; advanced on the engine thread with each sampled token."""

    def __init__(self, matcher: LLMatcher, vocab_size: int, think_end_id: int | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size                 # the matcher's (>= the model's): the bitmask width
        self.waiting_for = think_end_id              # None: the constraint applies from the next token on

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def advance(self, token_id: int) -> bool:
        """Consume one sampled token; False if the grammar rejected it (cannot happen with the mask applied)."""
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None
            return True
        return self.matcher.consume_token(token_id)

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


class GrammarCompiler:
    """Per (tokenizer, model vocabulary): the llguidance tokenizer (built once) and compiled grammars (cached)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.ll = LLTokenizer(tokenizer.hf.to_str(), n_vocab=self.vocab_size, eos_token=list(eos_token_ids))
        self.tool_call_tokens = (tokenizer.token_to_id(TOOL_CALL_START), tokenizer.token_to_id(TOOL_CALL_END))
        self._grammars: dict[tuple[str, str | None], str] = {}
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> str:
        key = (constraint.kind, constraint.schema)
        with self._lock:
            grammar = self._grammars.get(key)
        if grammar is None:
            grammar = constraint_grammar(constraint, self.tool_call_tokens)
            err = LLMatcher.validate_grammar(grammar, self.ll)
            if err and not err.startswith("WARNING"):
                raise ValueError(f"the schema cannot be compiled: {err}")
            with self._lock:
                if len(self._grammars) > 256:        # bounded: schemas come from clients
                    self._grammars.clear()
                self._grammars[key] = grammar
        return grammar

    def state(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for one request; ValueError on a bad constraint."""
        matcher = LLMatcher(self.ll, self.compile(constraint), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the schema cannot be compiled: {matcher.get_error()}")
        return GrammarState(matcher, self.vocab_size, constraint.start_after)


class MaskBuffer:
    """A preallocated int32 [rows, words] bitmask that llguidance fills for all constrained rows of a step."""

    def __init__(self, vocab_size: int, rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.buf = torch.empty(rows, self.words, dtype=torch.int32)

    def fill(self, states: list[GrammarState]) -> torch.Tensor:
        """The bitmasks of these (active) states as an int32 [len(states), words] view of the buffer."""
        n = len(states)
        if n > self.buf.shape[0]:
            self.buf = torch.empty(max(n, 2 * self.buf.shape[0]), self.words, dtype=torch.int32)
        out = self.buf[:n]
        nbytes, base = self.words * 4, out.data_ptr()
        # One matcher after the other on the engine thread: a JSON mask takes ~4 us here, and llguidance's thread
        # pool (LLExecutor) measured 4x slower at 8 rows and its workers compete with torch's for the cores.
        for i, s in enumerate(states):
            s.matcher.unsafe_compute_mask_ptr(base + i * nbytes, nbytes)
        return out


class Grammar:
    """Constrained output at the sampler: a matcher for each constrained request, the masks of the constrained rows,
    the matchers advanced as tokens are kept."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._masks: MaskBuffer | None = None      # made on first use
        # llguidance's view of the tokenizer, built once here (~1 s for a 250k vocabulary: not on the event loop)
        self._compiler: GrammarCompiler | None = None
        self._error = "the engine has no tokenizer"
        if tokenizer is not None:
            try:
                self._compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
            except Exception as e:                   # noqa: BLE001 - serve without constrained decoding
                self._error = f"llguidance cannot use this tokenizer ({e})"
                log.warning("constrained decoding (response_format) is off: %s", self._error)

    def attach(self, params: SamplingParams) -> GrammarState:
        """A constrained request's matcher; RequestError(field="response_format", or "tool_choice" / "tools" for a forced tool
        call) on a constraint it cannot take. Compiling a schema runs on the caller's thread (milliseconds for
        API-sized schemas; cached)."""
        tool_call = params.constraint.kind == "tool_call"
        what = "a forced tool call (tool_choice)" if tool_call else "a constrained response_format"
        if params.ignore_eos or params.min_tokens:
            raise RequestError(f"{what} cannot be combined with ignore_eos or min_tokens "
                               "(the grammar decides where the output ends)",
                               "tool_choice" if tool_call else "response_format")
        field = "tools" if tool_call else "response_format"
        if self._compiler is None:
            raise RequestError(f"{field}: constrained decoding is not available: {self._error}", field)
        try:
            return self._compiler.state(params.constraint)
        except ValueError as e:
            raise RequestError(f"{field}: {e}", field) from None

    def masks(self, reqs: list[Request], rows: list[int]) -> tuple[list[int], torch.Tensor] | None:
        """(sampling rows, bitmask) of the requests whose grammar is active this step, filled by llguidance; None
        if none. reqs[i] samples at row rows[i] (a constrained request never speculates: one row)."""
        active = [(row, r.grammar) for r, row in zip(reqs, rows) if r.grammar is not None and r.grammar.active]
        return self._fill(active) if active else None

    def _fill(self, active: list[tuple[int, GrammarState]]) -> tuple[list[int], torch.Tensor]:
        if self._masks is None:
            self._masks = MaskBuffer(active[0][1].vocab_size)
        return [row for row, _ in active], self._masks.fill([g for _, g in active])

    @staticmethod
    def advance(req: Request, tokens: list[int]) -> str | None:
        """req's matcher consumes its kept tokens; one it rejects cannot come with the mask applied: the request ends
        ("stop") rather than sample from an empty mask."""
        for tok in tokens:
            if not req.grammar.advance(tok):
                log.error("request %s: the grammar rejected token %d (%s)", req.request_id, tok, req.grammar.error)
                return "stop"
        return None
