"""Continuous batching: which requests run this step and how many tokens each, with chunked prefill and preemption.

Each step is one packed batch: every running request that is decoding contributes one token (decodes first), then
prefill chunks fill the rest of the `chunked_prefill_size` token budget, admitting waiting requests in arrival
order while there are free running slots, state slots and pages. When a decode needs a page and none is free, the
newest running request is preempted: its pages and state slot are freed and it waits again at the front of the
queue; when it comes back it recomputes prompt + tokens generated so far, so its output does not change.

NEXTN: a decoding request that holds drafts (`req.draft`, made by the runner at the end of its last step) is
scheduled as a verify of 1 + len(draft) tokens, after the plain decodes, when its pages and one spare state slot per
draft (the state after each verified token) are free without preempting anyone; otherwise it decodes plainly and the
drafts are dropped. Decoding requests that may draft also take `lookahead` pages ahead when free, for the draft
chain's own KV positions.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyserve.cache import Cache
from tinyserve.kv import PageAllocator
from tinyserve.request import Request, Status
from tinyserve.state import StatePool


@dataclass
class ScheduledSeq:
    req: Request
    start: int            # first position computed this step
    num_tokens: int       # tokens computed this step
    samples: bool         # this chunk reaches the end of the known tokens, so a token is sampled after it
    is_decode: bool       # one new token after the request's own previous one (decided here, once)
    draft: list[int] = field(default_factory=list)          # NEXTN drafts verified after the last token
    verify_slots: list[int] = field(default_factory=list)   # state slot after each of the 1 + len(draft) tokens
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # a prefill's (position, snapshot slot): the
    #                                                                 state there, written by the forward itself

    @property
    def is_verify(self) -> bool:
        return bool(self.draft)


class Scheduler:
    def __init__(self, allocator: PageAllocator, state_pool: StatePool, page_size: int, max_running: int,
                 chunked_prefill_size: int, cache: Cache, lookahead: int = 0, snapshot_align: int | None = None) -> None:
        self.allocator, self.state_pool, self.cache = allocator, state_pool, cache
        # a prefill chunk runs past a due state snapshot that lies a multiple of this from its start (the forward
        # writes the state there into the cache's slot: kernels.gdn.snapshot_alignment); None: chunks end there
        self.snapshot_align = snapshot_align
        self.lookahead = lookahead            # NEXTN: tokens of pages a decode takes ahead for its draft chain
        self.page_size, self.max_running = page_size, max_running
        self.chunk_budget = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admit_counter = 0
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
        self.release(req)
        req.status, req.finish_reason = Status.FINISHED, req.finish_reason or "abort"

    def release(self, req: Request) -> None:
        """Give back a request's pages, state slot and cache locks (finish, abort, preemption)."""
        self.cache.release(req)
        if req.pages:
            self.allocator.release(req.pages)
            req.pages = []
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None
        req.num_computed = 0
        req.draft, req.draft_q = [], None          # drafts continue the state just given up
        if req.images is not None:                 # vision features held for a prefill that stops here
            for item in req.images.items:
                item.features = None

    @staticmethod
    def _decoding(req: Request) -> bool:
        return req.num_computed == req.num_tokens - 1 and len(req.output_ids) > 0

    # ---- one step ----
    def schedule(self) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        # 1. decodes, oldest first; a decode that cannot get a page preempts the newest running request. Verifies
        #    go after the plain decodes (the model's packed layout).
        decoding = [r for r in self.running if self._decoding(r)]
        prefilling = [r for r in self.running if not self._decoding(r)]
        verifies: list[ScheduledSeq] = []
        for req in sorted(decoding, key=lambda r: r.admit_order):
            if req.status != Status.RUNNING:
                continue                                   # preempted by an older request in this loop
            if req.draft:
                verify = self._verify(req)
                if verify is not None:
                    verifies.append(verify)
                    continue
                req.draft, req.draft_q = [], None
            if not self._grow(req, 1):
                continue
            if self.lookahead and req.params.speculative:
                self._grow_free(req, 1 + self.lookahead)  # best effort: room for the draft chain's positions
            batch.append(ScheduledSeq(req, req.num_computed, 1, True, is_decode=True))
        batch += verifies
        budget = self.chunk_budget - sum(s.num_tokens for s in batch)
        # 2. running requests still prefilling, oldest first; one that finds no free page preempts newer requests
        #    (not yet in this batch), so the pool can never fill up with half-prefilled requests and stall
        starved = False
        for req in sorted(prefilling, key=lambda r: r.admit_order):
            if budget <= 0 or req.status != Status.RUNNING:
                continue
            chunk = self._prefill_chunk(req, budget)
            if chunk is None:
                scheduled = {id(s.req) for s in batch}
                newer = [r for r in self.running if r.admit_order > req.admit_order and id(r) not in scheduled]
                if newer:
                    self.preempt(max(newer, key=lambda r: r.admit_order))
                    chunk = self._prefill_chunk(req, budget)
            if chunk is not None:
                batch.append(chunk)
                budget -= chunk.num_tokens
            else:
                starved = True
        # 3. admit waiting requests in arrival order (not while a running request waits for pages); one whose
        #    file-tier read is in flight holds the line, or is passed over under the best_effort policy
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_running or starved:
                break
            if not self.cache.ready(req):
                if self.cache.skips_unready:
                    continue
                break
            slot = self.state_pool.alloc()
            if slot is None:
                break
            req.state_slot = slot
            start = self.cache.admit(req)              # the cached prefix it resumes from
            req.pages, req.num_computed = start.pages, start.num_computed
            req.cached_tokens, req.cached_by_tier = start.cached_tokens, start.cached_by_tier
            chunk = self._prefill_chunk(req, budget)
            if chunk is None:                              # not even one page free: wait for room
                self.release(req)
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self._admit_counter += 1
            req.admit_order = self._admit_counter
            self.running.append(req)
            batch.append(chunk)
            budget -= chunk.num_tokens
        return batch

    def _pages_for(self, req: Request, new_tokens: int) -> int:
        need = -(-(req.num_computed + new_tokens) // self.page_size)
        return max(0, need - len(req.pages))

    def _prefill_chunk(self, req: Request, budget: int) -> ScheduledSeq | None:
        """The next chunk of req's prefill that fits the budget and the free pages (allocated here); None if not one
        token fits. A state snapshot due inside it is written by the forward into a snapshot slot where it lies on
        the kernels' alignment and the cache has a slot; otherwise the chunk ends there (the next one starts from
        it, and the snapshot is taken after the step)."""
        start = req.num_computed
        n = min(req.num_tokens - start, budget)
        snapshots: list[tuple[int, int]] = []
        for pos in self.cache.snapshots_due(req, start + n):
            slot = None
            if self.snapshot_align and (pos - start) % self.snapshot_align == 0:
                slot = self.cache.snapshot_slot(req, pos, evict=not snapshots)
            if slot is None:
                n = pos - start
                break
            snapshots.append((pos, slot))
        self.cache.make_room(self._pages_for(req, n))
        free_tokens = self.allocator.num_free * self.page_size + (len(req.pages) * self.page_size - start)
        n = min(n, free_tokens)
        kept = [s for s in snapshots if s[0] < start + n]              # positions ascend: a prefix
        for pos, _ in snapshots[len(kept):]:                           # cut off by the free pages: a later chunk's
            self.cache.drop_snapshot(req, pos)
        if n <= 0:
            return None
        pages = self.allocator.alloc(self._pages_for(req, n))
        assert pages is not None
        req.pages += pages
        return ScheduledSeq(req, start, n, start + n == req.num_tokens, is_decode=False, snapshots=kept)

    def _verify(self, req: Request) -> ScheduledSeq | None:
        """req's drafts as a verify, when its pages and a state slot per draft are free without preempting."""
        n = 1 + len(req.draft)
        if len(req.draft) > self.state_pool.num_free or not self._grow_free(req, n + self.lookahead) \
                and not self._grow_free(req, n):
            return None
        slots = [req.state_slot] + [self.state_pool.alloc() for _ in req.draft]
        return ScheduledSeq(req, req.num_computed, n, True, is_decode=True, draft=list(req.draft),
                            verify_slots=slots)

    def _grow_free(self, req: Request, n: int) -> bool:
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
            victim = max(self.running, key=lambda r: r.admit_order)
            self.preempt(victim)
            if victim is req:
                return False
        if need:
            req.pages += self.allocator.alloc(need)
        return True

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.status = Status.WAITING
        req.cached_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- after the forward ----
    def advance(self, seqs: list[ScheduledSeq], committed: list[int] | None = None) -> None:
        """Record the step's computed tokens; the cache takes the snapshots that fall due at the new positions.
        committed[i]: tokens the engine kept of seq i's output (a verify keeps its first `committed` inputs: the
        last accepted token and the accepted drafts, cut at a stop)."""
        for i, s in enumerate(seqs):
            if s.is_verify:
                self._advance_verify(s, committed[i])
            elif s.req.status == Status.RUNNING:
                for pos, _ in s.snapshots:                 # written inside the chunk
                    self.cache.keep_snapshot(s.req, pos)
                s.req.num_computed = s.start + s.num_tokens
                self.cache.advance(s.req, s.req.num_computed, s.is_decode)

    def _advance_verify(self, s: ScheduledSeq, kept: int) -> None:
        """The state after the last kept input becomes the request's state (a slot swap: no copy), the others go
        back to the pool; the cache's snapshots inside the run are taken from the state at exactly their position.
        The KV written for rejected drafts lies past num_computed, in the request's own pages, and is overwritten."""
        req = s.req
        for j in range(kept):
            self.cache.advance(req, s.start + j + 1, True, slot=s.verify_slots[j])
        req.num_computed = s.start + kept
        req.state_slot = s.verify_slots[kept - 1]
        for j, slot in enumerate(s.verify_slots):
            if j != kept - 1:
                self.state_pool.free(slot)

    def finish(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        self.cache.finish(req)
        self.release(req)
        req.status, req.finish_reason = Status.FINISHED, reason
