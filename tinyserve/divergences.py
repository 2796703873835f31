"""Where prompts leave cached paths (docs/cache-misses.md): the prefix cache notes a prompt that shares part of a
cached path and then goes on with other tokens, counts every one (/metrics: prefix_cache_divergences) and logs the
first at each branch point, with the tokens either side of it."""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Callable

from tinyserve.radix import Match, Node
from tinyserve.request import Request

log = logging.getLogger("tinyserve.cache")

DIVERGENCE_CONTEXT = 8      # tokens kept either side of the point where a prompt leaves a cached path


@dataclass
class Divergence:
    """A prompt that left a cached path that goes on: it shares `position` tokens with the path, then differs.
    The tokens are cache ids (token ids, and image keys >= the vocabulary size)."""
    request_id: str
    position: int                # the prompt's first token that differs from the cached path
    prompt_tokens: int
    cached_tokens: int           # prompt tokens the request takes from the cache (whole pages with a state)
    before: list[int]            # the shared tokens just before `position`
    prompt_after: list[int]      # the prompt from `position`
    cached_after: list[int]      # the cached path from `position` (along its most recently used branch)


class Divergences:
    """Counts the prompts that leave a cached path (each request once, whatever admits it again) and logs the first
    at each branch point through `describe` (the tokens as text: describe_divergence with the tokenizer)."""

    def __init__(self, describe: Callable[[Divergence], str] | None = None) -> None:
        self.describe = describe or (lambda d: repr(d))
        self.count = 0
        self._branches_seen: weakref.WeakSet[Node] = weakref.WeakSet()
        self._diverged: weakref.WeakSet[Request] = weakref.WeakSet()

    def note(self, req: Request, m: Match) -> None:
        """req's prompt matched m, which leaves a cached path at m.branch: count it if it is a new prompt (no output
        yet; each request once), and log it if it is the first there."""
        if req.output_ids or req in self._diverged:
            return
        self.count += 1
        self._diverged.add(req)
        if m.branch in self._branches_seen:
            return
        self._branches_seen.add(m.branch)
        ids, at = req.cache_ids, m.walked

        def shared(node: Node) -> int:                 # tokens of node that the prompt has from `at` on
            n = 0
            while n < len(node.tokens) and at + n < len(ids) and node.tokens[n] == ids[at + n]:
                n += 1
            return n

        # the cached continuation closest to the prompt: the branch sharing most of the prompt's next page (the
        # most recently used of equals), then down its most recently used children
        child = max(m.branch.children.values(), key=lambda c: (shared(c), c.last_use))
        position = at + shared(child)
        cached = child.tokens[position - at:]
        node = child
        while len(cached) < DIVERGENCE_CONTEXT and node.children:
            node = max(node.children.values(), key=lambda c: c.last_use)
            cached = cached + node.tokens
        k = DIVERGENCE_CONTEXT
        log.info("prefix cache: %s", self.describe(Divergence(
            req.request_id, position, len(req.prompt_ids), m.length, ids[max(0, position - k):position],
            ids[position:position + k], cached[:k])))


def describe_divergence(d: Divergence, decode: Callable[[list[int]], str] | None, vocab_size: int) -> str:
    """Where a prompt left a cached path, as logged: the tokens as quoted text (special tokens kept), an image's
    run of keys as one <image>. decode: the tokenizer's (None: the ids as they are)."""
    def shown(ids: list[int]) -> str:
        if decode is None:
            return str(ids)
        text, run = "", []
        for i in ids + [-1]:
            if 0 <= i < vocab_size:                    # larger ids are an image's keys
                run.append(i)
                continue
            if i >= 0 and not run and text.endswith("<image>"):
                continue                               # one <image> for an image's run of keys
            text += decode(run) if run else ""
            text += "<image>" if i >= 0 else ""
            run = []
        return repr(text)
    return (f"{d.request_id} leaves a cached path at token {d.position} of {d.prompt_tokens} ({d.cached_tokens} "
            f"tokens reused): ...{shown(d.before)} | the prompt goes on {shown(d.prompt_after)}... | the cache went "
            f"on {shown(d.cached_after)}...")
