"""The prefix cache as the scheduler sees it: a few calls (the `Cache` protocol), and a null cache when it is off.

    arrival:    on_arrival(req)     start reading the prompt's file-tier blobs in the background
                ready(req)          may req be admitted now? (the prefetch policy)
    admission:  admit(req)          promote host / file copies onto the device, match, share the matched pages,
                                    copy the state snapshot, lock the path; returns the Admission to apply
    scheduling: snapshots_due(req, end)   prefill positions before `end` where a state snapshot is due;
                snapshot_slot(req, pos, evict)   a slot for the forward to write one into, inside a prefill chunk;
                keep_snapshot(req, pos) / drop_snapshot(req, pos)   after that forward (or not at all)
    each step:  advance(req, pos, is_decode, slot)   take the state snapshots that fall due (from `slot`, the
                                    state at pos: a speculative verify keeps one per verified token)
    end:        finish(req)         cache what the request computed;  release(req): unlock (also on preemption)
    misses:     take_divergences()  prompts that left a cached path since the last call, one per branch point
    room:       make_room(pages)    evict unlocked cached pages until `pages` are free
    memory:     relief_due(), relieve_host_memory()   the host tier gives memory back when the machine runs short

The cache keeps each request's bookkeeping (a CacheRun) by request id, from arrival to release. The tree itself and
its invariants are in radix.py; the tiers and their copies in host_tier.py and file_tier.py.
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tinyserve.blob import Blob
from tinyserve.config import Config
from tinyserve.file_tier import FileStats, FileTier
from tinyserve.host_tier import HostStats, HostTier
from tinyserve.kv import PageAllocator
from tinyserve.radix import Match, Node, RadixCache
from tinyserve.request import TIERS, Request
from tinyserve.state import StatePool


@dataclass(eq=False)
class CacheRun:
    """One request's prefix-cache bookkeeping, from arrival to release."""
    node: Node | None = None                # the cached node this run resumed from (locked while running)
    snapshot_points: list[int] = field(default_factory=list)   # prefill positions where a snapshot is taken
    resume_points: set[int] = field(default_factory=set)       # those that resume requests: the prompt's end,
                                                               # a branch point (kept longer than interval ones)
    track_slot: int | None = None           # copy of the state at the last page boundary
    track_pos: int = -1
    written: dict[int, int] = field(default_factory=dict)      # position -> snapshot slot a forward writes into
    read: Future | None = None              # file-tier blobs being read for this prompt
    read_first_page: int = 0
    read_deadline: float = 0.0


@dataclass
class Admission:
    """Where an admitted request starts: what admit() found cached, for the scheduler to apply to the request."""
    pages: list[int]                     # device pages holding the cached prefix (the request holds a reference)
    num_computed: int                    # tokens those pages hold: prefill starts here
    cached_tokens: int                   # prompt tokens taken from the cache
    cached_by_tier: dict[str, int]       # split of cached_tokens over the tiers they were loaded from


DIVERGENCE_CONTEXT = 8      # tokens kept either side of the point where a prompt leaves a cached path


@dataclass
class Divergence:
    """A prompt that left a cached path that goes on: it shares `position` tokens with the path, then differs.
    The tokens are cache ids (token ids, and image keys >= the vocabulary size); the engine decodes them."""
    request_id: str
    position: int                # the prompt's first token that differs from the cached path
    prompt_tokens: int
    cached_tokens: int           # prompt tokens the request takes from the cache (whole pages with a state)
    before: list[int]            # the shared tokens just before `position`
    prompt_after: list[int]      # the prompt from `position`
    cached_after: list[int]      # the cached path from `position` (along its most recently used branch)


@dataclass
class CacheStats:
    query_tokens: int = 0
    hit_tokens: int = 0
    divergences: int = 0         # prompts that left a cached path that goes on (Divergence)
    cached_pages: int = 0
    snapshots_held: int = 0
    snapshots_evicted: int = 0
    host: HostStats | None = None
    file: FileStats | None = None


def read_deadline(prompt_tokens: int) -> float:
    """How long a request waits for its file-tier read before it is computed instead: SGLang's timeout rule,
    1 s plus 0.25 s per 1000 prompt tokens."""
    return time.monotonic() + 1.0 + 0.25 * prompt_tokens / 1000


class Cache(Protocol):
    """What the scheduler and the engine ask of a prefix cache (see the module docstring)."""

    @property
    def skips_unready(self) -> bool: ...     # the scheduler passes over a request not ready instead of waiting
    def on_arrival(self, req: Request) -> None: ...
    def ready(self, req: Request) -> bool: ...
    def admit(self, req: Request) -> Admission: ...
    def snapshots_due(self, req: Request, end: int) -> list[int]: ...
    def snapshot_slot(self, req: Request, pos: int, evict: bool = False) -> int | None: ...
    def keep_snapshot(self, req: Request, pos: int) -> None: ...
    def drop_snapshot(self, req: Request, pos: int) -> None: ...
    def advance(self, req: Request, pos: int, is_decode: bool, slot: int | None = None) -> None: ...
    def finish(self, req: Request) -> None: ...
    def release(self, req: Request) -> None: ...
    def make_room(self, pages: int) -> None: ...
    def relief_due(self) -> bool: ...
    def relieve_host_memory(self) -> int: ...
    def flush(self, include_file: bool = False) -> bool: ...
    def close(self, timeout: float = 10.0) -> None: ...
    def stats(self) -> CacheStats: ...
    def check(self) -> None: ...
    def take_divergences(self) -> list[Divergence]: ...


class NullCache:
    """cache.enabled = false: every request starts from an empty state and nothing is kept."""

    def __init__(self, state_pool: StatePool) -> None:
        self.state_pool = state_pool

    def on_arrival(self, req: Request) -> None:
        pass

    def ready(self, req: Request) -> bool:
        return True

    skips_unready = False

    def snapshots_due(self, req: Request, end: int) -> list[int]:
        return []

    def snapshot_slot(self, req: Request, pos: int, evict: bool = False) -> int | None:
        return None

    def keep_snapshot(self, req: Request, pos: int) -> None:
        raise AssertionError("no snapshot is due without a prefix cache")

    def drop_snapshot(self, req: Request, pos: int) -> None:
        raise AssertionError("no snapshot is due without a prefix cache")

    def admit(self, req: Request) -> Admission:
        self.state_pool.zero(req.state_slot)
        return Admission([], 0, 0, dict.fromkeys(TIERS, 0))

    def advance(self, req: Request, pos: int, is_decode: bool, slot: int | None = None) -> None:
        pass

    def finish(self, req: Request) -> None:
        pass

    def release(self, req: Request) -> None:
        pass

    def make_room(self, pages: int) -> None:
        pass

    def relief_due(self) -> bool:
        return False

    def relieve_host_memory(self) -> int:
        return 0

    def flush(self, include_file: bool = False) -> bool:
        return True

    def close(self, timeout: float = 10.0) -> None:
        pass

    def stats(self) -> CacheStats:
        return CacheStats()

    def check(self) -> None:
        pass

    def take_divergences(self) -> list[Divergence]:
        return []


class PrefixCache:
    """The radix tree with its tiers, state snapshots and prefetch policy, behind the scheduler's calls."""

    def __init__(self, cfg: Config, allocator: PageAllocator, state_pool: StatePool, page_size: int, hybrid: bool,
                 host: HostTier | None = None, file: FileTier | None = None,
                 wake: Callable[[], None] = lambda: None) -> None:
        self.tree = RadixCache(allocator, state_pool, page_size, hybrid, host, file, cfg.cache.host.write_policy)
        self.allocator, self.state_pool, self.host, self.file = allocator, state_pool, host, file
        self.page_size = page_size
        self.track_interval = cfg.cache.state_track_interval
        self.prefetch_policy = cfg.cache.file.prefetch_policy
        self.wake = wake                     # called from the reader thread when a read lands
        self.runs: dict[str, CacheRun] = {}  # request id -> its bookkeeping, from arrival to release
        self.num_divergences = 0
        self._divergences: list[Divergence] = []        # to log: the first at each branch point
        self._branches_seen: weakref.WeakSet[Node] = weakref.WeakSet()
        self._diverged: weakref.WeakSet[Request] = weakref.WeakSet()   # counted once, whatever admits it again

    @property
    def hybrid(self) -> bool:
        return self.tree.hybrid

    # ---- arrival: file-tier prefetch ----
    def on_arrival(self, req: Request) -> None:
        """Start reading the file-tier blobs that continue what the tree already holds of this prompt."""
        run = self.runs[req.request_id] = CacheRun()
        if self.file is None or len(req.cache_ids) <= self.page_size:
            return
        first = self.tree.coverage(req.cache_ids) // self.page_size
        run.read, run.read_first_page = self.file.prefetch(req.cache_ids, first, self.page_size), first
        run.read_deadline = read_deadline(len(req.cache_ids))
        run.read.add_done_callback(lambda _: self.wake())

    def ready(self, req: Request) -> bool:
        """May req be admitted now? Reading a cached prefix back is far faster than computing it, so no policy
        starts a request's prefill while its read is in flight, except when waiting runs out:
        - wait_complete: until the read is done;
        - timeout: up to the deadline (1 s + 0.25 s per 1000 tokens), then compute;
        - best_effort: like timeout, but the scheduler admits requests queued behind it meanwhile (the caller
          passes over a request that is not ready instead of waiting in line)."""
        run = self.runs.get(req.request_id)
        if run is None or run.read is None or run.read.done():
            return True
        return self.prefetch_policy != "wait_complete" and time.monotonic() >= run.read_deadline

    @property
    def skips_unready(self) -> bool:
        return self.prefetch_policy == "best_effort"

    # ---- admission ----
    def admit(self, req: Request) -> Admission:
        """Resume from the longest usable cached prefix: share its pages, copy its state, skip its prefill."""
        run = self.runs.setdefault(req.request_id, CacheRun())
        blobs: list[Blob] = []
        if run.read is not None and run.read.done() and run.read.exception() is None:
            blobs = run.read.result()
        run.read = None
        ids = req.cache_ids
        if req.needs_prompt_logprobs:                      # they come from computing the whole prompt
            ids, blobs = [], []
        loaded = self.tree.promote(ids, blobs, run.read_first_page)
        m = self.tree.match(ids)
        if m.branch is not None and not req.output_ids and req not in self._diverged:   # a new prompt, once
            self._note_divergence(req, m)
        if m.node.snapshot is not None:
            self.state_pool.copy(m.node.snapshot, req.state_slot)
        else:
            self.state_pool.zero(req.state_slot)
        self.allocator.retain(m.pages)
        cached = min(m.length, len(req.prompt_ids))
        by_tier = {t: max(0, min(end, cached) - start) for t, (start, end) in loaded.items()}
        self.tree.lock(m.node, +1)
        run.node = m.node
        ps, end = self.page_size, req.num_tokens
        points = set(range(self.track_interval, end, self.track_interval))
        run.resume_points = {(end - 1) // ps * ps}         # page-aligned end of the prompt
        if m.kv_length > m.length:
            run.resume_points.add(m.kv_length)             # branch point: cached KV but no state there yet
        if req.images is not None:                         # before the first image (the same text with another
            edges = req.images.boundaries()                # picture resumes there) and after the last one (other
            run.resume_points |= {edges[0][0] // ps * ps, edges[-1][1] // ps * ps}   # text after the same ones)
            run.resume_points = {p for p in run.resume_points if 0 < p < end}
        run.snapshot_points = sorted(p for p in points | run.resume_points if p > m.length)
        return Admission(list(m.pages), m.length, cached, {"device": cached - sum(by_tier.values()),
                                                           "host": by_tier.get("host", 0),
                                                           "file": by_tier.get("file", 0)})

    def _note_divergence(self, req: Request, m: Match) -> None:
        """Count a prompt that left the cached path at m.branch; keep it for the log if it is the first there."""
        self.num_divergences += 1
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
        self._divergences.append(Divergence(req.request_id, position, len(req.prompt_ids), m.length,
                                            ids[max(0, position - k):position], ids[position:position + k],
                                            cached[:k]))

    def take_divergences(self) -> list[Divergence]:
        """The divergences to log since the last call (the first at each branch point; all are counted)."""
        out, self._divergences = self._divergences, []
        return out

    def snapshots_due(self, req: Request, end: int) -> list[int]:
        """The prefill positions strictly between req's computed tokens and `end` where a state snapshot is due, in
        order (one at `end` itself is taken after the step, by advance)."""
        run = self.runs.get(req.request_id)
        return [p for p in run.snapshot_points if req.num_computed < p < end] if run else []

    def snapshot_slot(self, req: Request, pos: int, evict: bool = False) -> int | None:
        """A snapshot slot for the forward to write req's state at prefill position pos into (then keep_snapshot or
        drop_snapshot; release gives it back if neither came), or None. evict: under pressure the cached snapshot
        least worth keeping gives its slot up, as it would to advance's snapshot after the step (a full cache must
        not cut every prefill at its snapshots); the scheduler asks so once per chunk, because a snapshot is weighed
        against the others only once it is in the tree, after the step."""
        run = self.runs[req.request_id]
        if not evict:
            slot = self.state_pool.alloc_snapshot()
        elif (slot := self.tree.alloc_snapshot(resume=pos in run.resume_points)) is not None:
            self.state_pool.fence([slot])        # the forward writes it: a save of its old snapshot must be done
        if slot is not None:
            run.written[pos] = slot
        return slot

    def keep_snapshot(self, req: Request, pos: int) -> None:
        """The forward wrote req's state at pos: cache tokens [0, pos) with it."""
        run = self.runs[req.request_id]
        slot = run.written.pop(pos)
        self.tree.insert(req.cache_ids[:pos], req.pages[:pos // self.page_size], slot, resume=pos in run.resume_points)

    def drop_snapshot(self, req: Request, pos: int) -> None:
        self.state_pool.free_snapshot(self.runs[req.request_id].written.pop(pos))

    # ---- after each step ----
    def advance(self, req: Request, pos: int, is_decode: bool, slot: int | None = None) -> None:
        """req has computed up to pos, and `slot` (default: its state slot) holds its state there: take the
        snapshots that fall due at pos."""
        run, ps = self.runs[req.request_id], self.page_size
        slot = req.state_slot if slot is None else slot
        if pos in run.snapshot_points or (is_decode and pos % self.track_interval == 0):
            self._snapshot(req, pos, slot, resume=pos in run.resume_points)
        elif self.hybrid and ps > 1 and pos % ps == 0:
            # keep the state at the last page boundary, a prefill's included: a prompt that ends on one and a
            # request that stops before the next cache the prompt's last page with it
            if run.track_slot is None:
                run.track_slot = self.tree.alloc_snapshot()
            if run.track_slot is not None:
                self.state_pool.copy(slot, run.track_slot)
                run.track_pos = pos

    def _snapshot(self, req: Request, pos: int, slot: int | None = None, resume: bool = True) -> None:
        """Cache tokens [0, pos) of req with a copy of `slot` (default: its state slot), its state at pos.
        resume: pos resumes requests (a prompt end, a branch point, the request's end), not just an interval."""
        if not self.hybrid:                                # no recurrent state: the KV pages are enough
            self.tree.insert(req.cache_ids[:pos], req.pages[:pos // self.page_size], None)
            return
        snap = self.tree.alloc_snapshot(resume=resume)     # an interval snapshot never pushes out a resume point
        if snap is None:
            return
        self.state_pool.copy(req.state_slot if slot is None else slot, snap)
        self.tree.insert(req.cache_ids[:pos], req.pages[:pos // self.page_size], snap, resume=resume)

    # ---- end ----
    def finish(self, req: Request) -> None:
        """Cache what a finished request computed, up to its last page boundary, with the state there."""
        run, ps = self.runs[req.request_id], self.page_size
        end = req.num_computed // ps * ps
        if end == 0:
            return
        if end == req.num_computed:
            self._snapshot(req, end)
        elif run.track_pos == end:
            slot, run.track_slot, run.track_pos = run.track_slot, None, -1
            self.tree.insert(req.cache_ids[:end], req.pages[:end // ps], slot, resume=True)
        elif not self.hybrid:
            self.tree.insert(req.cache_ids[:end], req.pages[:end // ps], None)

    def release(self, req: Request) -> None:
        """Unlock the resume node and give back the tracking slot (finish, abort, preemption)."""
        run = self.runs.pop(req.request_id, None)
        if run is None:
            return
        if run.node is not None:
            self.tree.lock(run.node, -1)
        if run.track_slot is not None:
            self.state_pool.free_snapshot(run.track_slot)
        for slot in run.written.values():              # scheduled, never written (an abort before the step)
            self.state_pool.free_snapshot(slot)
        if run.read is not None:
            run.read.cancel()

    def make_room(self, pages: int) -> None:
        self.tree.evict_pages(pages)

    # ---- host memory (cache.host.min_free_gb) ----
    def relief_due(self) -> bool:
        """Must the host tier give memory back (or may an episode end)? Cheap (one probe), any thread."""
        return self.host is not None and self.host.relief_due()

    def relieve_host_memory(self) -> int:
        """Engine thread: the host tier gives memory back, evicting through the tree; returns the bytes freed."""
        return self.host.relieve(self.tree) if self.host is not None else 0

    # ---- whole cache ----
    def flush(self, include_file: bool = False) -> bool:
        """Empty the device and host tiers (and the file tier when asked); False while a running request holds
        part of the tree (nothing is freed then)."""
        if not self.tree.flush():
            return False
        if include_file and self.file is not None:
            self.file.clear()
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Flush pending file-tier writes (bounded) so a restart finds them."""
        if self.file is not None:
            self.file.close(timeout)

    def stats(self) -> CacheStats:
        t = self.tree
        return CacheStats(query_tokens=t.query_tokens, hit_tokens=t.hit_tokens, divergences=self.num_divergences,
                          cached_pages=t.num_pages,
                          snapshots_held=t.num_snapshots, snapshots_evicted=t.snapshots_evicted,
                          host=self.host.report() if self.host else None,
                          file=self.file.report() if self.file else None)

    def check(self) -> None:
        self.tree.check()
