"""One HTTP request's generation: its engine requests (n choices for each prompt), their tokens made into text, its
usage, its metrics and its log line. The one place where tokens become text: a route handler iterates `pieces()` or
awaits `collect()` and writes what it gets in its protocol's shape (openai_api.py, anthropic.py, responses.py).

    engine step -> the request's token events -> Generation.pieces: each choice's tokens decoded, stop strings
    applied (IncrementalDetokenizer) -> Piece -> the protocol's chunks -> SSE
"""
from __future__ import annotations

import asyncio
import codecs
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Engine, TokenEvent
    from .metrics import Metrics
    from .tokenizer import Tokenizer

log = logging.getLogger("tinyserve.generation")


@dataclass
class Piece:
    """What one choice produced since its last piece; its last piece carries finish_reason."""

    choice: int
    text: str
    token_ids: list[int]
    events: list[TokenEvent]          # token_id, logprob, top_logprobs of each token
    finish_reason: str | None = None
    stop_string: str | None = None    # the stop string that ended the choice (finish_reason "stop")
    prompt_logprobs: list[Any] | None = None   # on a choice's first piece when asked (completions' echo): prompt
                                               # tokens 1.. as (logprob, [(id, logprob) top-n])


@dataclass
class Choice:
    """A whole choice (collect)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_string: str | None = None
    prompt_logprobs: list[Any] | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None                  # None: not known yet (before the prefill)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    accepted_prediction_tokens: int | None = None     # NEXTN drafts accepted / rejected; None: speculation off
    rejected_prediction_tokens: int | None = None


@dataclass
class Meta:
    """What every body and chunk of one HTTP request shares."""

    request_id: str
    created: int
    model: str
    prompts: list[list[int]]                          # every prompt, in order (choice i: prompt i // n)
    token_text: Callable[[int], str]                  # one token as logprobs show it (Tokenizer.token_text)
    token_bytes: Callable[[int], bytes]               # the bytes of one token (Tokenizer.token_bytes)
    usage: Callable[[], Usage] | None = None          # the usage so far, once the generation is submitted


class Generation:
    """Submits n requests for each prompt with params (max_tokens None: the engine fits it to each prompt); the
    engine's RequestError for a parameter out of range comes from the first submit, before anything runs. `images`:
    what engine.images.prepare returned for the (one) prompt; every choice sees the same ones. Choice k * n + i answers
    prompt k (its i-th sample; seeds differ by i).

    `close()` cancels whatever has not finished: the client went away, a stop string ended a choice, or the server
    shuts down. Each choice finishes once: its log line (with its cache match, so prompt drift, 0 cached on every
    turn, shows in the log) and its metrics. Several choices stream through one queue, one task each, in the order
    their pieces come."""

    def __init__(self, engine: Engine, metrics: Metrics, prompts: list[list[int]], params: SamplingParams,
                 n: int, stop: list[str], id_prefix: str, images: Sequence[Any] = ()) -> None:
        self.engine, self.metrics, self.prompts, self.n, self.stop = engine, metrics, prompts, n, stop
        self.meta = Meta(id_prefix + uuid.uuid4().hex, int(time.time()), engine.served_name, prompts,
                         engine.tokenizer.token_text, engine.tokenizer.token_bytes, self.usage)
        self.arrival, self.completion_tokens = time.monotonic(), 0
        requests = []                                 # every one made (and checked) first: a 400 submits none
        for prompt in prompts:
            for i in range(n):
                seed = params.seed if params.seed is None or n == 1 else (params.seed + i) % 2 ** 64
                requests.append(engine.intake.make_request(prompt, replace(params, seed=seed),
                                                           f"{self.meta.request_id}-{len(requests)}", images))
        self.streams = [engine.enqueue(req) for req in requests]      # the engine's streams
        self._open = set(range(len(requests)))                        # the choices not finished yet

    def close(self) -> None:
        for i in list(self._open):
            self.streams[i].cancel()
            self._finished(i, "abort")

    def _finished(self, index: int, reason: str) -> None:
        if index not in self._open:
            return
        self._open.discard(index)
        r = self.streams[index]
        tiers = r.report["cached_by_tier"]
        log.info("%s: %s, prompt %d tokens, %d from the prefix cache (device %d, host %d, file %d), %d generated",
                 r.request_id, reason, r.prompt_tokens, r.cached_tokens, tiers["device"], tiers["host"],
                 tiers["file"], r.completion_tokens)
        self.metrics.on_finished(reason, r.prompt_tokens, tiers, time.monotonic() - self.arrival,
                                 r.report.get("draft_rounds", 0), r.report.get("accepted_draft_tokens", 0))

    def pieces(self) -> AsyncIterator[Piece]:        # every choice's pieces as they come
        return self._choice(0) if len(self.streams) == 1 else self._merged()

    async def _choice(self, index: int) -> AsyncIterator[Piece]:
        stream, detok, last = self.streams[index], IncrementalDetokenizer(self.engine.tokenizer, self.stop), None
        async for events in stream:
            now = time.monotonic()
            self.metrics.on_tokens(len(events), now - (last or self.arrival), last is None,
                                   warm=2 * stream.cached_tokens >= stream.prompt_tokens)
            prompt_logprobs = stream.report.get("prompt_logprobs") if last is None else None   # the first, if asked
            taken, last = len(detok.token_ids), now
            text = detok.add([e.token_id for e in events])
            events = events[:len(detok.token_ids) - taken]     # nothing after a stop string counts
            ids = detok.token_ids[taken:]
            self.completion_tokens += len(ids)
            if detok.stopped:                         # a stop string: the rest is cut, and the request cancelled
                stream.cancel()
                self._finished(index, "stop")
                yield Piece(index, text, ids, events, "stop", detok.stop_reason, prompt_logprobs)
                return
            if text or ids:
                yield Piece(index, text, ids, events, prompt_logprobs=prompt_logprobs)
        reason = stream.finish_reason or "abort"
        self._finished(index, reason)
        yield Piece(index, detok.flush(), [], [], reason)

    async def _merged(self) -> AsyncIterator[Piece]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for piece in self._choice(i):
                    await queue.put(piece)
            except Exception as e:                    # surfaced in the consumer
                await queue.put(e)
            await queue.put(None)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.streams))]
        try:
            open_ = len(tasks)
            while open_:
                item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self) -> list[Choice]:
        choices = [Choice(i) for i in range(len(self.streams))]
        async for p in self.pieces():
            c = choices[p.choice]
            c.text += p.text
            c.token_ids += p.token_ids
            c.events += p.events
            if p.prompt_logprobs is not None:
                c.prompt_logprobs = p.prompt_logprobs
            if p.finish_reason is not None:
                c.finish_reason, c.stop_string = p.finish_reason, p.stop_string
        return choices

    def usage(self) -> Usage:
        firsts = self.streams[::self.n]                         # each prompt's first choice: the others share its
        by_tier = [r.report["cached_by_tier"] for r in firsts]  # prompt (and hit what the first wrote)
        usage = Usage(sum(map(len, self.prompts)), self.completion_tokens, sum(r.cached_tokens for r in firsts),
                      {tier: sum(t[tier] for t in by_tier) for tier in by_tier[0]})
        if self.engine.nextn is not None:             # speculative decoding is on: NEXTN's counts (spec.py)
            reports = [s.report for s in self.streams]
            usage.accepted_prediction_tokens = sum(r.get("accepted_draft_tokens", 0) for r in reports)
            usage.rejected_prediction_tokens = sum(r.get("draft_tokens", 0) for r in reports) - \
                usage.accepted_prediction_tokens
        return usage


@dataclass
class IncrementalDetokenizer:
    """Token ids in, final text out, one step at a time, stop strings applied.

    Each token adds its own bytes to the text (Tokenizer.token_bytes: exact for a byte-level BPE, every Qwen
    checkpoint's), decoded by Python's incremental UTF-8 decoder: a character split across tokens comes out whole once
    its last byte arrives, and a step costs its own token, however long the output. `add` gives the newly final text
    ('' once stopped): with stop strings, what may still start one is held back, and the ids after the one that
    completes a stop string are not taken (token_ids grows by the ids taken). `flush` gives what was held back at the
    end (a trailing partial character as U+FFFD)."""

    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)     # none empty ("" would stop at once: protocol.stop_strings)
    skip_special_tokens: bool = True
    stopped: bool = field(default=False, init=False)
    stop_reason: str | None = field(default=None, init=False)
    token_ids: list[int] = field(default_factory=list, init=False)  # the ids taken so far
    _pending: str = field(default="", init=False)    # decoded text held back: it may start a stop string
    _flushed: bool = field(default=False, init=False)
    _utf8: codecs.IncrementalDecoder = field(default_factory=partial(codecs.getincrementaldecoder("utf-8"), "replace"),
                                             init=False)

    def __post_init__(self) -> None:
        self._skipped = self.tokenizer.skipped_ids if self.skip_special_tokens else frozenset()

    def add(self, token_ids: list[int]) -> str:
        text = ""
        for tid in token_ids:
            if self.stopped or self._flushed:
                break
            self.token_ids.append(tid)
            piece = "" if tid in self._skipped else self._utf8.decode(self.tokenizer.token_bytes(tid))
            text += self._until_stop(piece, False) if self.stop else piece
        return text

    def flush(self) -> str:
        if self.stopped or self._flushed:
            return ""
        self._flushed, tail = True, self._utf8.decode(b"", final=True)
        return self._until_stop(tail, True) if self.stop else tail

    def _until_stop(self, piece: str, final: bool) -> str:
        """What of the held text and this piece can be sent: up to a stop string (and then no more), or all but
        what may start one."""
        text, self._pending = self._pending + piece, ""
        hit, hit_at = None, -1
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (hit_at < 0 or i < hit_at):
                hit, hit_at = s, i
        if hit is not None:
            self.stopped, self.stop_reason = True, hit
            return text[:hit_at]
        hold = 0 if final else self._stop_prefix_len(text)
        self._pending = text[len(text) - hold:]
        return text[:len(text) - hold]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is the start of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
