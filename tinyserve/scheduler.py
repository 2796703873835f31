"""Continuous batching: which requests run this step and how many tokens each, with chunked prefill and preemption.

Each step is one packed batch: every running request that is decoding contributes one token (decodes first), then
prefill chunks fill the rest of the `chunked_prefill_size` token budget, admitting waiting requests in arrival
order while there are free running slots, state slots and pages. When a decode needs a page and none is free, the
newest running request is preempted: its pages and state slot are freed and it waits again at the front of the
queue; when it comes back it recomputes prompt + tokens generated so far, so its output does not change.

With NEXTN (`nextn`, spec.NextN; None when off) a decode may carry the drafts made after its last step: a verify,
computed in the same step when their pages and one spare state slot each (the state after every token, so the step
can keep any prefix of them) are free without preempting anyone; otherwise it decodes plainly. Verifies go after the
plain decodes (the model's packed layout). After the step the engine says how many of each sequence's tokens it kept
(`advance`): the state after the last kept one becomes the request's, the KV past it is overwritten later.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Protocol

from tinyserve.cache import Cache
from tinyserve.pools import PageAllocator, StatePool
from tinyserve.request import Request, Status


BY_AGE = attrgetter("admit_order")        # larger: admitted later (preempted first)


@dataclass
class ScheduledSeq:
    req: Request
    start: int            # first position computed this step
    num_tokens: int       # tokens computed this step
    samples: bool         # this chunk reaches the end of the known tokens, so a token is sampled after it
    is_decode: bool       # one new token after the request's own previous one (decided here, once)
    drafts: list[int] = field(default_factory=list)         # a verify's: NEXTN's drafts after its own last token
    state_after: list[int] = field(default_factory=list)    # a verify's: the state slot after each token
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # a prefill's (position, snapshot slot): the
    #                                                                 state there, written by the forward itself


class Drafts(Protocol):                      # spec.NextN
    def drafts(self, req: Request, sched: Scheduler) -> list[int]: ...
    def drop(self, req: Request) -> None: ...


class HeldImages(Protocol):                  # multimodal.Images
    def drop(self, req: Request) -> None: ...


class Scheduler:
    def __init__(self, allocator: PageAllocator, state_pool: StatePool, page_size: int, max_running: int,
                 chunked_prefill_size: int, cache: Cache, snapshot_align: int | None = None) -> None:
        self.allocator, self.state_pool, self.cache = allocator, state_pool, cache
        self.nextn: Drafts | None = None            # NEXTN: each decode's drafts (build.py sets it)
        self.images: HeldImages | None = None       # images: what a request's prefill holds of them goes with it
        # a prefill chunk runs past a due state snapshot that lies a multiple of this from its start (the forward
        # writes the state there into the cache's slot: kernels.gdn.snapshot_alignment); None: chunks end there
        self.snapshot_align = snapshot_align
        self.page_size, self.max_running = page_size, max_running
        self.chunk_budget = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admit_order = itertools.count(1)       # Request.admit_order
        self.num_preemptions = 0

    # ---- queue ----
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.cache.on_arrival(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        if req.status == Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status == Status.RUNNING:
            self.running.remove(req)
        self._free(req)
        req.status, req.finish_reason = Status.FINISHED, req.finish_reason or "abort"

    def _free(self, req: Request) -> None:
        """Give back a request's pages, state slot and hold on the cache (finish, abort, preemption)."""
        self.cache.drop(req)
        self.allocator.release(req.pages)
        req.pages = []
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None
        req.num_computed = 0
        if req.drafts is not None:                      # they continue a state the request gave up
            self.nextn.drop(req)
        if req.images is not None:
            self.images.drop(req)

    # ---- one step ----
    def schedule(self) -> list[ScheduledSeq]:
        """This step's batch: 1. the decodes, oldest first; 2. the running requests still prefilling; 3. waiting
        requests admitted, while the token budget lasts (the module docstring)."""
        plain, verifies, prefilling, budget = [], [], [], self.chunk_budget
        for req in sorted(self.running, key=BY_AGE):
            if req.status != Status.RUNNING:
                continue                                   # preempted by an older request in this loop
            if req.num_computed != req.num_tokens - 1 or not req.output_ids:
                prefilling.append(req)
                continue
            drafts = self.nextn.drafts(req, self) if self.nextn is not None else []
            if drafts and (seq := self._verify(req, drafts)) is not None:
                verifies.append(seq)
                budget -= seq.num_tokens
            elif self._grow(req, 1):
                plain.append(ScheduledSeq(req, req.num_computed, 1, True, is_decode=True))
                budget -= 1
        batch, starved = plain + verifies, False
        if prefilling:
            budget, starved = self._prefills(prefilling, batch, budget)
        if self.waiting and not starved:
            self._admit(batch, budget)
        return batch

    def _prefills(self, prefilling: list[Request], batch: list[ScheduledSeq], budget: int) -> tuple[int, bool]:
        """Chunks of the running requests still prefilling, oldest first, into batch; one that finds no free page
        preempts newer requests (not yet in this batch), so the pool can never fill up with half-prefilled requests
        and stall. Returns the budget left and whether a request found no room (starved)."""
        starved = False
        for req in prefilling:                             # oldest first
            if budget <= 0 or req.status != Status.RUNNING:
                continue
            chunk = self._prefill_chunk(req, budget)
            if chunk is None:
                scheduled = {id(s.req) for s in batch}
                newer = [r for r in self.running if r.admit_order > req.admit_order and id(r) not in scheduled]
                if newer:
                    self.preempt(max(newer, key=BY_AGE))
                    chunk = self._prefill_chunk(req, budget)
            if chunk is not None:
                batch.append(chunk)
                budget -= chunk.num_tokens
            else:
                starved = True
        return budget, starved

    def _admit(self, batch: list[ScheduledSeq], budget: int) -> None:
        # waiting requests in arrival order as the cache lets them in (the prefetch policy), while there are
        # running slots, state slots and pages: their first chunks into batch
        for req in self.cache.admissible(list(self.waiting)):
            if budget <= 0 or len(self.running) >= self.max_running:
                break
            req.state_slot = self.state_pool.alloc()
            if req.state_slot is None:
                break
            self.cache.admit(req)                          # resumes from the cached prefix: pages, num_computed
            chunk = self._prefill_chunk(req, budget)
            if chunk is None:                              # not even one page free: wait for room
                self._free(req)
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            req.admit_order = next(self._admit_order)
            self.running.append(req)
            batch.append(chunk)
            budget -= chunk.num_tokens

    def _pages_for(self, req: Request, new_tokens: int) -> int:
        need = -(-(req.num_computed + new_tokens) // self.page_size)
        return max(0, need - len(req.pages))

    def _prefill_chunk(self, req: Request, budget: int) -> ScheduledSeq | None:
        # the next chunk of req's prefill that fits the budget and the free pages (allocated here; None: not one
        # token fits), ended where the cache says (plan_prefill: a state snapshot it cannot take inside it)
        start = req.num_computed
        n, snapshots = self.cache.plan_prefill(req, min(req.num_tokens - start, budget), self.snapshot_align)
        self.cache.make_room(self._pages_for(req, n))
        n = min(n, (len(req.pages) + self.allocator.num_free) * self.page_size - start)   # its pages and the free ones
        if n <= 0:
            return None
        req.pages += self.allocator.alloc(self._pages_for(req, n))
        return ScheduledSeq(req, start, n, start + n == req.num_tokens, is_decode=False,
                            snapshots=[s for s in snapshots if s[0] < start + n])   # positions ascend: a prefix

    def _verify(self, req: Request, drafts: list[int]) -> ScheduledSeq | None:
        """req's decode with its drafts after it, when their pages and a state slot per draft are free without
        preempting anyone."""
        n = 1 + len(drafts)
        if len(drafts) > self.state_pool.num_free or not self.grow_free(req, n):
            return None
        slots = [req.state_slot] + [self.state_pool.alloc() for _ in drafts]
        return ScheduledSeq(req, req.num_computed, n, True, is_decode=True, drafts=list(drafts), state_after=slots)

    def grow_free(self, req: Request, n: int) -> bool:
        """Pages for n more tokens of req from the free pages only (no eviction, no preemption)."""
        need = self._pages_for(req, n)
        if need > self.allocator.num_free:
            return False
        if need:
            req.pages += self.allocator.alloc(need)
        return True

    def _grow(self, req: Request, n: int) -> bool:
        """Pages for n more tokens of a running request, preempting newer requests if the pool is full."""
        need = self._pages_for(req, n)
        self.cache.make_room(need)                         # cached pages go before any running request
        while need > self.allocator.num_free:
            victim = max(self.running, key=BY_AGE)
            self.preempt(victim)
            if victim is req:
                return False
        if need:
            req.pages += self.allocator.alloc(need)
        return True

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.status = Status.WAITING
        req.cached_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- after the forward ----
    def advance(self, seqs: list[ScheduledSeq], kept: list[int]) -> None:
        # record the step's computed tokens (kept[i]: what the engine kept of seq i's); the cache takes the
        # snapshots due at the new positions
        for s, k in zip(seqs, kept):
            if s.drafts:
                self._advance_verified(s, k)
            elif s.req.status == Status.RUNNING:
                s.req.num_computed = s.start + s.num_tokens
                self.cache.advance(s.req, s.req.num_computed)

    def _advance_verified(self, s: ScheduledSeq, kept: int) -> None:
        """A verify keeps its first `kept` inputs (its own last token and the accepted drafts, cut at a stop): the state after the last of them becomes the request's (a slot swap: no copy), the other
        slots go back, and the cache's snapshots inside the run are taken from the state at exactly their position.
        The KV written past them lies in the request's own pages, and is overwritten."""
        req = s.req
        for j in range(kept):
            self.cache.advance(req, s.start + j + 1, s.state_after[j])
        req.num_computed = s.start + kept
        req.state_slot = s.state_after[kept - 1]
        for j, slot in enumerate(s.state_after):
            if j != kept - 1:
                self.state_pool.free(slot)

    def finish(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        self.cache.finish(req)
        self._free(req)
        req.status, req.finish_reason = Status.FINISHED, reason
