"""Continuous batching: which requests run this step and how many tokens each, with chunked prefill and preemption.

Each step is one packed batch: every running request that is decoding contributes one token (decodes first), then
prefill chunks fill the rest of the `chunked_prefill_size` token budget, admitting waiting requests in arrival
order while there are free running slots, state slots and pages. When a decode needs a page and none is free, the
newest running request is preempted: its pages and state slot are freed and it waits again at the front of the
queue; when it comes back it recomputes prompt + tokens generated so far, so its output does not change.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from tinyserve.kv import PageAllocator
from tinyserve.radix import Node, RadixCache
from tinyserve.sampling import SamplingParams
from tinyserve.state import StatePool


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)    # pages holding KV of tokens [0, num_computed)
    state_slot: int | None = None
    num_computed: int = 0                              # tokens whose KV and GDN state are in the pools
    cached_tokens: int = 0                             # prompt tokens taken from the prefix cache
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    admit_order: int = 0                               # larger = admitted later (preempted first)
    # prefix cache bookkeeping
    cache_node: Node | None = None                     # the cached node this run started from (locked)
    snapshot_points: list[int] = field(default_factory=list)   # prefill positions where a state snapshot is taken
    track_slot: int | None = None                      # copy of the state at the last page boundary (decode)
    track_pos: int = -1
    cached_by_tier: dict[str, int] = field(default_factory=dict)   # cached_tokens split: device / host / file
    prefetch: Future | None = None                     # file-tier blobs being read for this prompt
    prefetch_first_page: int = 0
    prefetch_deadline: float = 0.0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_decoding(self) -> bool:
        return self.num_computed == self.num_tokens - 1 and len(self.output_ids) > 0


@dataclass
class ScheduledSeq:
    req: Request
    start: int            # first position computed this step
    num_tokens: int       # tokens computed this step
    samples: bool         # this chunk reaches the end of the known tokens, so a token is sampled after it


class Scheduler:
    def __init__(self, allocator: PageAllocator, state_pool: StatePool, page_size: int, max_running: int,
                 chunked_prefill_size: int, cache: RadixCache | None = None, track_interval: int = 512,
                 prefetch_policy: str = "best_effort") -> None:
        self.allocator, self.state_pool = allocator, state_pool
        self.cache, self.track_interval = cache, track_interval
        self.prefetch_policy = prefetch_policy
        self.page_size, self.max_running = page_size, max_running
        self.chunk_budget = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admit_counter = 0
        self.num_preemptions = 0

    # ---- queue ----
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self._start_prefetch(req)

    def _start_prefetch(self, req: Request) -> None:
        """Start reading the file-tier blobs that continue what the tree already holds of this prompt."""
        file = self.cache.file if self.cache is not None else None
        if file is None or len(req.all_ids) <= self.page_size:
            return
        first = self.cache.coverage(req.all_ids) // self.page_size
        req.prefetch, req.prefetch_first_page = file.prefetch(req.all_ids, first, self.page_size), first
        # SGLang's timeout policy: 1 s plus 0.25 s per 1000 prompt tokens
        req.prefetch_deadline = time.monotonic() + 1.0 + 0.25 * len(req.all_ids) / 1000

    def blocking_prefetches(self) -> list[Future]:
        """File-tier reads that waiting requests are held back for (an idle step waits on these, not spins)."""
        return [r.prefetch for r in self.waiting if r.prefetch is not None and not self._prefetch_ready(r)]

    def _prefetch_ready(self, req: Request) -> bool:
        """May req be admitted now? best_effort never waits; wait_complete waits; timeout waits until the deadline."""
        if req.prefetch is None or req.prefetch.done() or self.prefetch_policy == "best_effort":
            return True
        return self.prefetch_policy == "timeout" and time.monotonic() >= req.prefetch_deadline

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
        if req.cache_node is not None:
            self.cache.lock(req.cache_node, -1)
            req.cache_node = None
        if req.track_slot is not None:
            self.state_pool.free_snapshot(req.track_slot)
            req.track_slot, req.track_pos = None, -1
        if req.pages:
            self.allocator.release(req.pages)
            req.pages = []
        if req.state_slot is not None:
            self.state_pool.free(req.state_slot)
            req.state_slot = None
        req.num_computed = 0

    # ---- one step ----
    def schedule(self) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        # 1. decodes, oldest first; a decode that cannot get a page preempts the newest running request
        for req in sorted([r for r in self.running if r.is_decoding], key=lambda r: r.admit_order):
            if req.status != Status.RUNNING:
                continue                                   # preempted by an older request in this loop
            if not self._grow(req, 1):
                continue
            batch.append(ScheduledSeq(req, req.num_computed, 1, True))
        budget = self.chunk_budget - len(batch)
        # 2. running requests still prefilling, oldest first; one that finds no free page preempts newer requests
        #    (not yet in this batch), so the pool can never fill up with half-prefilled requests and stall
        starved = False
        for req in sorted([r for r in self.running if not r.is_decoding], key=lambda r: r.admit_order):
            if budget <= 0 or req.status != Status.RUNNING:
                continue
            n = self._prefill_chunk(req, budget)
            if n == 0:
                scheduled = {id(s.req) for s in batch}
                newer = [r for r in self.running if r.admit_order > req.admit_order and id(r) not in scheduled]
                if newer:
                    self.preempt(max(newer, key=lambda r: r.admit_order))
                    n = self._prefill_chunk(req, budget)
            if n:
                batch.append(ScheduledSeq(req, req.num_computed, n, req.num_computed + n == req.num_tokens))
                budget -= n
            else:
                starved = True
        # 3. admit waiting requests in arrival order (not while a running request waits for pages)
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not starved:
            req = self.waiting[0]
            if not self._prefetch_ready(req):
                break
            slot = self.state_pool.alloc()
            if slot is None:
                break
            req.state_slot = slot
            self._start_from_cache(req)
            n = self._prefill_chunk(req, budget)
            if n == 0:                                     # not even one page free: wait for room
                self.release(req)
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self._admit_counter += 1
            req.admit_order = self._admit_counter
            self.running.append(req)
            batch.append(ScheduledSeq(req, req.num_computed, n, req.num_computed + n == req.num_tokens))
            budget -= n
        return batch

    def _pages_for(self, req: Request, new_tokens: int) -> int:
        need = -(-(req.num_computed + new_tokens) // self.page_size)
        return max(0, need - len(req.pages))

    def _prefill_chunk(self, req: Request, budget: int) -> int:
        """Tokens of req's remaining prefill that fit the budget and the free pages (allocated here)."""
        n = min(req.num_tokens - req.num_computed, budget)
        later = [p for p in req.snapshot_points if p > req.num_computed]
        if later:                                          # end the chunk where a snapshot is due
            n = min(n, min(later) - req.num_computed)
        if self.cache is not None:
            self.cache.evict_pages(self._pages_for(req, n))
        free_tokens = self.allocator.num_free * self.page_size + (len(req.pages) * self.page_size - req.num_computed)
        n = min(n, free_tokens)
        if n <= 0:
            return 0
        pages = self.allocator.alloc(self._pages_for(req, n))
        assert pages is not None
        req.pages += pages
        return n

    def _grow(self, req: Request, n: int) -> bool:
        """Pages for n more tokens of a running request, preempting newer requests if the pool is full."""
        need = self._pages_for(req, n)
        if self.cache is not None:
            self.cache.evict_pages(need)                   # cached pages go before any running request
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
    def finish(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        if self.cache is not None:
            self._cache_finished(req)
        self.release(req)
        req.status, req.finish_reason = Status.FINISHED, reason

    # ---- prefix cache ----
    def _start_from_cache(self, req: Request) -> None:
        """Resume from the longest usable cached prefix: share its pages, copy its state, skip its prefill."""
        if self.cache is None:
            self.state_pool.zero(req.state_slot)
            return
        blobs = []
        if req.prefetch is not None and req.prefetch.done() and req.prefetch.exception() is None:
            blobs = req.prefetch.result()
        req.prefetch = None
        loaded = self.cache.promote(req.all_ids, blobs, req.prefetch_first_page)
        m = self.cache.match(req.all_ids)
        if m.node.snapshot is not None:
            self.state_pool.copy(m.node.snapshot, req.state_slot)
        else:
            self.state_pool.zero(req.state_slot)
        self.allocator.retain(m.pages)
        req.pages = list(m.pages)
        req.num_computed = m.length
        req.cached_tokens = min(m.length, len(req.prompt_ids))
        by_tier = {t: max(0, min(end, req.cached_tokens) - start) for t, (start, end) in loaded.items()}
        req.cached_by_tier = {"device": req.cached_tokens - sum(by_tier.values()), "host": by_tier.get("host", 0),
                              "file": by_tier.get("file", 0)}
        self.cache.lock(m.node, +1)
        req.cache_node = m.node
        ps, end = self.page_size, req.num_tokens
        points = set(range(self.track_interval, end, self.track_interval))
        points.add((end - 1) // ps * ps)                   # page-aligned end of the prompt
        if m.kv_length > m.length:
            points.add(m.kv_length)                        # branch point: cached KV but no state there yet
        req.snapshot_points = sorted(p for p in points if p > req.num_computed)

    def _snapshot(self, req: Request, pos: int) -> None:
        """Cache tokens [0, pos) of req with a copy of its current state (which is the state at pos)."""
        if not self.cache.hybrid:                          # no recurrent state: the KV pages are enough
            self.cache.insert(req.all_ids[:pos], req.pages[:pos // self.page_size], None)
            return
        slot = self.cache.alloc_snapshot()
        if slot is None:
            return
        self.state_pool.copy(req.state_slot, slot)
        self.cache.insert(req.all_ids[:pos], req.pages[:pos // self.page_size], slot)

    def advance(self, seqs: list[ScheduledSeq]) -> None:
        """Record the step's computed tokens; take the snapshots that fall due at the new positions."""
        ps = self.page_size
        for s in seqs:
            req = s.req
            if req.status != Status.RUNNING:
                continue
            req.num_computed = pos = s.start + s.num_tokens
            if self.cache is None:
                continue
            decode = bool(req.output_ids) and s.num_tokens == 1
            if pos in req.snapshot_points or (decode and pos % self.track_interval == 0):
                self._snapshot(req, pos)
            elif decode and self.cache.hybrid and ps > 1 and pos % ps == 0:   # state at the last page boundary
                if req.track_slot is None:
                    req.track_slot = self.cache.alloc_snapshot()
                if req.track_slot is not None:
                    self.state_pool.copy(req.state_slot, req.track_slot)
                    req.track_pos = pos

    def _cache_finished(self, req: Request) -> None:
        """Cache what a finished request computed, up to its last page boundary, with the state there."""
        ps = self.page_size
        end = req.num_computed // ps * ps
        if end == 0:
            return
        if end == req.num_computed:
            self._snapshot(req, end)
        elif req.track_pos == end:
            slot, req.track_slot, req.track_pos = req.track_slot, None, -1
            self.cache.insert(req.all_ids[:end], req.pages[:end // ps], slot)
        elif not self.cache.hybrid:
            self.cache.insert(req.all_ids[:end], req.pages[:end // ps], None)

    def flush_cache(self) -> bool:
        return self.cache is None or self.cache.flush()
