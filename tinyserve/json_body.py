"""A request body, as bytes, -> its JSON object; every failure a BodyError that says why (a 400), never a traceback.

Python's json parser recurses per level of nesting, and so does much of what reads a body after it (templates,
schema compilers): a body nested thousands deep would raise RecursionError (a 500) wherever it first got deep. So the
nesting is measured on the bytes before parsing, in numpy, and a body past MAX_JSON_DEPTH is refused; what the
parser itself refuses (bad JSON, not UTF-8, integers longer than Python converts) and strings that cannot be encoded
(a lone surrogate escape) are 400s too. The size is capped before this, by server.max_request_body_mb (a 413).
"""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np


class BodyError(ValueError):
    """Why a body is refused (protocol.read_json answers it as a 400)."""

MAX_JSON_DEPTH = 64               # nesting of a request body: far past any real request, far below the recursion limit


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """A request body -> its JSON object; every failure is a BodyError that says why. The nesting is measured on the
    bytes before parsing (a body nested thousands deep would exhaust the recursion of the parser or of whatever walks it
    after), and strings must be valid Unicode (a lone surrogate escape cannot be encoded for the tokenizer)."""
    depth = json_depth(raw) if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH else 0
    if depth > MAX_JSON_DEPTH:
        raise BodyError(f"the request body is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
    try:
        body = json.loads(raw)
        if _SURROGATE_ESCAPE.search(raw):             # rare: check that every string encodes
            json.dumps(body, ensure_ascii=False).encode()
    except UnicodeError as e:
        raise BodyError(f"the request body is not valid UTF-8 / Unicode: {e}") from None
    except (ValueError, RecursionError) as e:        # JSONDecodeError, an integer too long to convert
        raise BodyError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BodyError("the request body must be a JSON object")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_DEPTH_CHUNK = 1 << 20


def json_depth(raw: bytes) -> int:
    """The deepest nesting of [ and { outside strings in JSON bytes, without parsing them: numpy over 1 MiB chunks,
    carrying whether a chunk starts inside a string or after an odd run of backslashes. Exact for valid JSON (what
    it says of invalid JSON does not matter: the parser rejects that)."""
    depth = deepest = 0
    inside = escaped = False
    for start in range(0, len(raw), _DEPTH_CHUNK):
        a = np.frombuffer(raw, np.uint8, count=min(_DEPTH_CHUNK, len(raw) - start), offset=start)
        pos = np.arange(a.size, dtype=np.int32)
        last_other = np.maximum.accumulate(np.where(a == 0x5C, np.int32(-1), pos))   # last byte that is no \
        before = np.concatenate((np.array([-1], np.int32), last_other[:-1]))
        odd = (pos - 1 - before) % 2 == 1                  # an odd run of backslashes right before the byte
        odd ^= (before == -1) & escaped                   # ... continuing the previous chunk's run
        quotes = np.cumsum((a == 0x22) & ~odd, dtype=np.int32)
        in_string = (quotes % 2 == 1) ^ inside
        step = (((a == 0x5B) | (a == 0x7B)) & ~in_string).astype(np.int32) - \
            (((a == 0x5D) | (a == 0x7D)) & ~in_string)
        level = depth + np.cumsum(step, dtype=np.int32)
        deepest, depth = max(deepest, int(level.max())), int(level[-1])
        inside ^= bool(quotes[-1] % 2)
        run = a.size - 1 - int(last_other[-1])            # backslashes that end this chunk
        escaped = (run % 2 == 1) ^ (escaped and last_other[-1] == -1)
    return deepest
