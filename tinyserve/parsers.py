"""The Qwen3 reasoning parser (`<think>...</think>`), what vLLM and SGLang call `--reasoning-parser qwen3`.

A small state machine fed with text deltas. It holds back only what could still turn into a tag (or a call start),
so a stream never shows half a tag, and the non-streaming `parse` runs the very same machine over the whole text, so
streaming and non-streaming always agree. Bad model output never raises: what cannot be parsed is plain text.

A tool call ends the reasoning even without `</think>` (models often call from inside their think block; the
calls are tool_calls, not reasoning). The one exception: when the model closes its thinking later and calls after
that, the calls written while thinking were drafts and stay reasoning (llama.cpp reads them the same way).
The tool calls themselves are tool_calls.py's.

Whether the answer starts inside a think block: `prompt_opens_reasoning` is true when the generation prompt ends inside
a think block it opened (the template wrote `<think>` for the model). The generation prompt is what the prompt
(rendered with add_generation_prompt) has past its common start with the prompt rendered without; a `<think>` the
conversation itself holds (a file a tool read, a user's question about the tag) does not count. A template that
renders the same either way (or no second rendering) leaves the whole prompt to judge by.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .tool_calls import CUT, WAIT, YES, call_start

THINK_START, THINK_END = "<think>", "</think>"


def _partial_suffix(text: str, tag: str) -> int:       # the longest tail of text that starts tag (0: none)
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# True when the generation prompt (what `prompt` has past its common start with `without_generation_prompt`) ends
# inside a think block it opened.
def prompt_opens_reasoning(prompt: str, without_generation_prompt: str = "") -> bool:
    generation = prompt[len(os.path.commonprefix([prompt, without_generation_prompt])):] or prompt
    return generation.rfind(THINK_START) > generation.rfind(THINK_END)


@dataclass
class Qwen3ReasoningParser:
    """Splits model output into reasoning_content and content: `feed` takes the next text delta (final: the last
    one, which releases whatever is still held back) and gives (reasoning_delta, content_delta), either maybe ''.

    Newlines that only frame the sections (after `<think>`, before `</think>`, after `</think>`) are dropped.
    A `<think>` is recognised only before any content: once the answer has started, tags are plain text.
    The machine runs one mode after the other (each a _mode_* method that says whether it handed over to another
    mode), until it waits for more text or has taken it all.
    """

    # the prompt already opened `<think>` (Qwen3.5 / Qwen3-Thinking templates), so the output begins inside the
    # think block and only contains `</think>` (prompt_opens_reasoning)
    starts_in_reasoning: bool = False
    enabled: bool = True              # False for `enable_thinking: false` requests: everything is content
    # the functions the request's tool parser reads calls of; a call of one of them ends the reasoning
    tool_names: set[str] | None = None
    _mode: str = field(default="before", init=False)            # before | reasoning | call | content
    _section_start: bool = field(default=True, init=False)      # at the start of a section: strip framing newlines
    _repeat_checked: bool = field(default=False, init=False)    # whether a repeated leading <think> was looked for
    _buf: str = field(default="", init=False)
    _line_start: bool = field(default=True, init=False)         # whether _buf[0] starts a line
    _ws_before_call: str = field(default="", init=False)        # mode call: whitespace between reasoning and call
    _consumed: int = field(default=0, init=False)               # output characters before _buf
    saw_reasoning: bool = field(default=False, init=False)
    # once known, where in the whole output the think block ended (past `</think>`, or where the call that ended it
    # starts); None while inside it or when there was none
    end_offset: int | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.tool_names = set(self.tool_names or ())
        self._mode, self.saw_reasoning = ("reasoning", self.enabled) if self.starts_in_reasoning else ("before", False)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        if not self.enabled:
            return "", delta
        self._buf += delta
        reasoning, content = [], []                   # what each mode hands out
        for last in (False, True) if final else (False,):    # what is certain first, then what was held back
            while getattr(self, f"_mode_{self._mode}")(last, reasoning, content):
                pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:             # the end of the output: what was held back
        return self.feed("", final=True)

    def parse(self, text: str) -> tuple[str | None, str]:
        """Whole output -> (reasoning, or None when there was none, content)."""
        p = Qwen3ReasoningParser(self.starts_in_reasoning, self.enabled, self.tool_names)
        reasoning, content = p.feed(text, final=True)   # as a stream would: the text, then its end
        self.end_offset = p.end_offset
        return reasoning or None, content

    def _take(self, n: int) -> str:                   # consume the first n characters of the buffer
        head, self._buf = self._buf[:n], self._buf[n:]
        self._consumed += n
        if kept := head.rstrip(" \t"):
            self._line_start = kept.endswith("\n")
        return head

    def _first_call(self, limit: int, final: bool) -> tuple[str, int] | None:
        """The first call start (YES / CUT) or possible one (WAIT) at an index below `limit`."""
        buf, pos = self._buf, 0
        while 0 <= (i := buf.find("<", pos)) < limit:
            verdict, _, _ = call_start(buf, i, self.tool_names, self._line_start, final)
            if verdict in (YES, CUT, WAIT):
                return verdict, i
            pos = i + 1
        return None

    # Nothing yet: a <think> after whitespace alone opens the reasoning; anything else starts the answer.
    def _mode_before(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        buf = self._buf
        i = buf.find(THINK_START)
        if i >= 0 and not buf[:i].strip():            # only whitespace before <think>: drop it
            self._take(i + len(THINK_START))
            self._mode, self._section_start, self.saw_reasoning = "reasoning", True, True
            return True
        hold = 0 if final else _partial_suffix(buf, THINK_START)
        if not buf[:len(buf) - hold].strip() and not final:
            return False                              # whitespace so far: a <think> may follow
        self._mode, self._section_start = "content", False   # the answer started without thinking
        return True

    def _mode_reasoning(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """Inside the think block, up to </think> or a call that ends it; what may still become either waits."""
        if self._section_start and not self._open_section(final):
            return False
        buf = self._buf
        i = buf.find(THINK_END)
        call = self._first_call(i if i >= 0 else len(buf), final) if self.tool_names else None
        if call is not None and call[0] != WAIT:      # a call ends the reasoning (unless it was a draft)
            self._end_at_call(buf[:call[1]], reasoning)
            return True
        if call is None and i >= 0:
            reasoning.append(buf[:i].rstrip("\n"))
            self._take(i + len(THINK_END))
            self.end_offset = self._consumed
            self._mode, self._section_start = "content", True
            return True
        if final:
            reasoning.append(buf)
            self._take(len(buf))
            return False
        end = call[1] if call is not None else len(buf) - _partial_suffix(buf, THINK_END)
        keep = buf[:end].rstrip()                     # whitespace may frame a </think> or a call
        reasoning.append(keep)
        self._take(len(keep))
        return False

    def _open_section(self, final: bool) -> bool:
        """The think block's start: its framing newlines go, and so does a <think> the model repeats after the
        prompt's; False while that cannot be told yet."""
        stripped = self._buf.lstrip("\n")
        self._take(len(self._buf) - len(stripped))
        if not self._repeat_checked:
            if stripped.startswith(THINK_START):
                self._take(len(THINK_START))
                stripped = self._buf.lstrip("\n")
                self._take(len(self._buf) - len(stripped))
                self._repeat_checked = True
            elif final or not THINK_START.startswith(stripped):
                self._repeat_checked = True
        if not final and (not stripped or not self._repeat_checked):
            return False
        self._section_start = False
        return True

    def _end_at_call(self, text: str, reasoning: list[str]) -> None:
        """A call right after `text` ends the reasoning; the whitespace between them waits with the call (it goes
        back to the reasoning if the call turns out a draft)."""
        kept = text.rstrip()
        reasoning.append(kept)
        self._ws_before_call = text[len(kept):]
        self._take(len(text))
        self.end_offset = self._consumed
        self._mode = "call"

    def _mode_call(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        """A call started inside the think block: a real call unless the model closes the block later and calls
        after it (then everything up to </think> was drafted while thinking)."""
        buf = self._buf
        t = buf.find(THINK_END)
        if t >= 0:
            after = t + len(THINK_END)
            later = self._first_call_after(after, final)
            if later is None and not final:
                return False
            if later:                                 # drafts: they stay reasoning
                reasoning.append(self._ws_before_call + buf[:t].rstrip("\n"))
                self._take(after)
                self.end_offset = self._consumed
                self._mode, self._section_start = "content", True
                return True
            content.append(buf[:t] + buf[after:])     # the stray </think> is dropped
            self._take(len(buf))
            self._mode, self._section_start = "content", False
            return False
        if not final:
            return False
        content.append(buf)
        self._take(len(buf))
        self._mode, self._section_start = "content", False
        return False

    # The answer: everything (but the newlines that frame its start).
    def _mode_content(self, final: bool, reasoning: list[str], content: list[str]) -> bool:
        if self._section_start:
            stripped = self._buf.lstrip("\n")
            self._take(len(self._buf) - len(stripped))
            if not stripped and not final:
                return False
            self._section_start = False
        content.append(self._take(len(self._buf)))
        return False

    def _first_call_after(self, start: int, final: bool) -> bool | None:
        """After the </think> that follows a call made while thinking: does another call come? None: can't tell
        yet (only when not final)."""
        rest, pos = self._buf[start:], 0                # the answer starts a line there, as the tool parser sees it
        while (i := rest.find("<", pos)) >= 0:
            verdict, _, _ = call_start(rest, i, self.tool_names, True, final)
            if verdict in (YES, CUT):
                return True
            if verdict == WAIT:
                return None
            pos = i + 1
        return False if final else None
