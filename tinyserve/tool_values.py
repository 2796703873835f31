"""A tool-call parameter's text -> its JSON value, typed by the tool's JSON schema (tool_calls.py's parser calls
`convert_parameter` on each value it reads; grammar.py reads a parameter's types with `schema_types`). Lenient as
vLLM's qwen3_coder parser is: text that does not fit its declared type stays a string."""
from __future__ import annotations

import ast
import json
import math
from typing import Any


def schema_types(schema: Any) -> list[str]:
    """JSON-schema types a parameter allows ('type' as a string or list, or via anyOf / oneOf)."""
    if not isinstance(schema, dict):
        return []
    types: list[str] = []
    t = schema.get("type")
    for v in ([t] if isinstance(t, str) else t if isinstance(t, list) else []):
        if isinstance(v, str) and v not in types:
            types.append(v)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            for v in schema_types(sub):
                if v not in types:
                    types.append(v)
    return types


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError, RecursionError):
        return False


def _parse_container(text: str, kind: type | tuple[type, ...]) -> Any:
    """JSON first, then a Python literal (models sometimes write {'a': 1}); None when it is neither."""
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except Exception:  # noqa: BLE001 - any failure means "not this format"; literal_eval raises many kinds
            continue
        if isinstance(value, kind) and _json_safe(value):
            return value
    return None


_NO_VALUE = object()


def _parse_number(s: str) -> int | float | object:
    """An int when the text is one, else a finite float, else _NO_VALUE."""
    try:
        return int(s)
    except ValueError:
        try:
            f = float(s)
        except ValueError:
            return _NO_VALUE
        return f if math.isfinite(f) else _NO_VALUE


def _convert_typed(text: str, kind: str) -> Any:
    s = text.strip()
    if kind in ("integer", "number"):
        value = _parse_number(s)
        if kind == "integer" and isinstance(value, float):
            return int(value) if value.is_integer() else _NO_VALUE
        return value
    if kind == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _NO_VALUE)
    if kind == "null":
        return None if s.lower() in ("null", "none") else _NO_VALUE
    if kind in ("object", "array"):
        value = _parse_container(s, dict if kind == "object" else list)
        if value is None and s[:1] == '"':            # a JSON string holding the container (double-encoded)
            inner = _parse_container(s, str)
            value = _parse_container(inner, dict if kind == "object" else list) if inner else None
        return _NO_VALUE if value is None else value
    return _NO_VALUE


# Type names that are not JSON Schema's but that tool definitions use (vLLM reads them the same way).
_TYPE_ALIASES = {"float": "number", "double": "number", "int": "integer", "long": "integer", "bool": "boolean",
                 "dict": "object", "list": "array", "str": "string"}


def convert_parameter(text: str, schema: dict | None) -> Any:
    """A parameter's text -> its JSON value, typed by the parameter's schema.

    Strings stay strings; integer/number/boolean/object/array/null are parsed; text that does not fit its declared
    type is kept as a string. Unknown parameters stay strings unless they parse as a JSON object or array.
    """
    types = [_TYPE_ALIASES.get(t, t) for t in schema_types(schema)]
    if not types:
        if text.strip()[:1] in ("{", "["):
            value = _parse_container(text.strip(), (dict, list))
            if value is not None:
                return value
        return text
    if "null" in types and text.strip().lower() in ("null", "none"):
        return None
    for kind in ("integer", "number", "boolean", "object", "array"):
        if kind in types:
            value = _convert_typed(text, kind)
            if value is not _NO_VALUE:
                return value
    return text
