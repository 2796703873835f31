"""The nesting of a JSON request body, measured on its bytes before parsing (protocol.parse_body refuses a body past
MAX_JSON_DEPTH with a 400).

Python's json parser recurses per level of nesting, and so does much of what reads a body after it (templates,
schema compilers): a body nested thousands deep would raise RecursionError (a 500) wherever it first got deep. So the
nesting is measured first, in numpy; only a body with more brackets than MAX_JSON_DEPTH is measured at all.
"""
from __future__ import annotations

import re

import numpy as np

MAX_JSON_DEPTH = 64               # nesting of a request body: far past any real request, far below the recursion limit
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")   # a \uD800-\uDFFF escape: maybe a lone surrogate
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
