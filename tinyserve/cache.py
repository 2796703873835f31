"""The prefix cache as the scheduler sees it: eight calls. `Cache` answers them as the null cache (cache.enabled =
false: every request starts from an empty state and nothing is kept); `PrefixCache` answers them from the radix
tree, its state snapshots and its tiers (`DevicePrefixCache`: with no tier, nothing to read ahead).

    arrival:    on_arrival(req)          start reading the prompt's file-tier blobs in the background
                admissible(waiting)      the waiting requests that may be admitted now, in order (the prefetch policy)
    admission:  admit(req)               resume req from its longest usable cached prefix: pages shared, state copied,
                                         req.num_computed and req.cached_tokens set, the path locked
    prefill:    plan_prefill(req, n, align)   how far the next prefill chunk goes, and the snapshots its forward
                                         writes inside it (their slots; one not written goes back at advance)
    room:       make_room(pages)         evict unlocked cached pages until `pages` are free
    each step:  advance(req, pos, slot)  req has computed up to pos: keep the snapshots written inside the chunk,
                                         take those due at pos (planned; past the prompt every state_track_interval)
                                         from `slot` (default: its state slot), the state there
    end:        finish(req)              cache what the request computed, up to its last page boundary, with the
                                         state there
                drop(req)                unlock, give back the tracking slot and the snapshot slots never written,
                                         stop the read (after finish; abort, preemption)

The engine also asks for stats(), flush(), close() and, when has_upkeep, every second upkeep_due() / upkeep() (the
host tier giving memory back when the machine runs short). The cache keeps each request's bookkeeping (a CacheRun) by request id,
from arrival to drop. The tree and its invariants are in radix.py; with a host or a file tier, the tree is tiers.py's
TieredRadixCache (what goes to a tier and when, promotion, host eviction), the tiers' copies in host_tier.py and
file_tier.py; where prompts leave cached paths in divergences.py.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from tinyserve.blob import Blob
from tinyserve.config import Config
from tinyserve.divergences import Divergence, Divergences
from tinyserve.file_tier import FileStats, FileTier
from tinyserve.host_tier import HostStats, HostTier
from tinyserve.pools import PageAllocator, StatePool
from tinyserve.radix import Node, RadixCache
from tinyserve.radix_check import check_tree
from tinyserve.request import Request
from tinyserve.snapshot_worth import KEPT_INTERVALS
from tinyserve.tiers import TieredRadixCache

TIERS = ("device", "host", "file")     # where cached tokens come from (req.report["cached_by_tier"])


@dataclass
class CacheStats:
    query_tokens: int = 0
    hit_tokens: int = 0
    divergences: int = 0         # prompts that left a cached path that goes on (divergences.py)
    cached_pages: int = 0
    snapshots_held: int = 0
    snapshots_evicted: int = 0
    host: HostStats | None = None
    file: FileStats | None = None


class Cache:
    """The null cache, and the calls every cache answers (see the module docstring)."""
    has_upkeep = False          # whether the engine asks upkeep_due() while serving

    def __init__(self, state_pool: StatePool) -> None:
        self.state_pool = state_pool

    # ---- the scheduler's calls ----
    def on_arrival(self, req: Request) -> None:
        pass

    def admissible(self, waiting: Iterable[Request]) -> Iterator[Request]:
        return iter(waiting)

    def admit(self, req: Request) -> None:
        self.state_pool.zero(req.state_slot)

    def plan_prefill(self, req: Request, n: int, align: int | None) -> tuple[int, list[tuple[int, int]]]:
        return n, []

    def make_room(self, pages: int) -> None:
        pass

    def advance(self, req: Request, pos: int, slot: int | None = None) -> None:
        pass

    def finish(self, req: Request) -> None:
        pass

    def drop(self, req: Request) -> None:
        pass

    # ---- the engine's ----
    def stats(self) -> CacheStats:
        return CacheStats()

    def flush(self, include_file: bool = False) -> bool:
        return True

    def close(self, timeout: float = 10.0) -> None:
        pass

    def upkeep_due(self) -> bool:
        return False

    def upkeep(self) -> None:
        pass

    def check(self) -> None:
        pass


@dataclass(eq=False)
class CacheRun:
    """One request's prefix-cache bookkeeping, from arrival to drop."""
    node: Node | None = None                # the deepest cached node its prompt matched (locked while running)
    snapshot_points: list[int] = field(default_factory=list)   # prefill positions where a snapshot is taken
    resume_points: set[int] = field(default_factory=set)       # those that resume requests: the prompt's end,
                                                               # a branch point (kept longer than interval ones)
    kept_points: set[int] = field(default_factory=set)         # the last interval ones before the prompt's end
    prompt_end: int = 0                     # tokens known at admission: later positions are decodes
    stamp: int = 0                          # the tree's stamp for this request's resume points (RadixCache.claim)
    track_slot: int | None = None           # copy of the state at the last page boundary
    track_pos: int = -1
    written: dict[int, int] = field(default_factory=dict)      # position -> snapshot slot a forward writes into
    read: Future | None = None              # file-tier blobs being read for this prompt
    read_first_page: int = 0
    read_deadline: float = 0.0
    read_again: bool = False                # read once more (the tree lost part of its prefix while it waited)


def read_deadline(prompt_tokens: int) -> float:
    """How long a request waits for its file-tier read before it is computed instead: SGLang's timeout rule,
    1 s plus 0.25 s per 1000 prompt tokens."""
    return time.monotonic() + 1.0 + 0.25 * prompt_tokens / 1000


class PrefixCache(Cache):
    """The radix tree with its tiers, state snapshots and prefetch policy, behind the scheduler's calls.

    The prefetch policy (cache.file.prefetch_policy): reading a cached prefix back is far faster than computing it,
    so no policy starts a request's prefill while its file-tier read is in flight, except when waiting runs out:
    - wait_complete: until the read is done; the requests behind it wait too;
    - timeout: up to the deadline (1 s + 0.25 s per 1000 tokens), then compute; the requests behind it wait;
    - best_effort: like timeout, but the requests queued behind it go first meanwhile.

    A prefill chunk's state snapshots (plan_prefill): one due inside the chunk is written by its forward where it
    lies a multiple of the kernels' alignment from the chunk's start and a slot is found; otherwise the chunk ends
    at it (the next one starts from it, and advance takes it after the step). The first snapshot of a chunk may take
    the slot of the cached snapshot least worth keeping, as advance's would (a full cache must not cut every prefill
    at its snapshots); a snapshot is weighed against the others only once it is in the tree, after the step.

    Admission plans a request's snapshots: every state_track_interval, and its resume points: the page-aligned end
    of its prompt, a branch point (cached KV but no state there yet), and where the request says a state helps
    (Request.resume_hints: the last message's start, where the same conversation with that message changed resumes;
    before the first image: the same text with another picture; after the last one: other text after the same
    pictures). The last interval snapshots before the prompt's end are kept with its resume points (kept_points,
    snapshot_worth.KEPT_INTERVALS): a next turn that changes the last message part-way resumes within one interval of
    the change."""

    def __init__(self, cfg: Config, allocator: PageAllocator, state_pool: StatePool, page_size: int, hybrid: bool,
                 host: HostTier | None = None, file: FileTier | None = None,
                 wake: Callable[[], None] = lambda: None,
                 describe: Callable[[Divergence], str] | None = None) -> None:
        super().__init__(state_pool)
        # the tree alone, or with the tiers' policy when there is a tier: no tier code runs without one
        self.tree = RadixCache(allocator, state_pool, page_size, hybrid) if host is None and file is None else \
            TieredRadixCache(allocator, state_pool, page_size, hybrid, host, file, cfg.cache.host.write_policy)
        self.allocator, self.host, self.file = allocator, host, file
        self.page_size, self.hybrid = page_size, hybrid
        self.track_interval = cfg.cache.state_track_interval
        self.prefetch_policy = cfg.cache.file.prefetch_policy
        self.wake = wake                     # called from the reader thread when a read lands
        self.has_upkeep = host is not None
        self.runs: dict[str, CacheRun] = {}  # request id -> its bookkeeping, from arrival to drop
        self.divergences = Divergences(describe)

    # ---- arrival: file-tier prefetch ----
    def on_arrival(self, req: Request) -> None:
        """Start reading the file-tier blobs that continue what the tree already holds of this prompt."""
        run = self.runs[req.request_id] = CacheRun()
        if self.file is None or len(req.cache_ids) <= self.page_size:
            return
        self._prefetch(req, run, self.tree.coverage(req.cache_ids) // self.page_size)

    def _prefetch(self, req: Request, run: CacheRun, first: int) -> None:
        run.read, run.read_first_page = self.file.prefetch(req.cache_ids, first, self.page_size), first
        run.read_deadline = read_deadline(len(req.cache_ids))
        run.read.add_done_callback(lambda _: self.wake())

    def admissible(self, waiting: Iterable[Request]) -> Iterator[Request]:
        """The waiting requests in order, each as soon as it may be admitted (the prefetch policy: the class
        docstring)."""
        for req in waiting:
            if self._ready(req):
                yield req
            elif self.prefetch_policy != "best_effort":
                return

    def _ready(self, req: Request) -> bool:
        run = self.runs.get(req.request_id)
        if run is None or run.read is None:
            return True
        if run.read.done():
            return not self._read_again(req, run)
        return self.prefetch_policy != "wait_complete" and time.monotonic() >= run.read_deadline

    def _read_again(self, req: Request, run: CacheRun) -> bool:
        """Whether a landed read is read again: the read continues what the tree held of the prompt at arrival, and
        while the request waited in line the tree may have lost part of that (evicted for the requests before it,
        written to the folder on the way out); then the blobs from what the tree holds now are read, once."""
        if run.read_again:
            return False
        run.read_again = True
        first = self.tree.coverage(req.cache_ids) // self.page_size
        if first >= run.read_first_page:
            return False
        self._prefetch(req, run, first)
        return True

    # ---- admission ----
    def admit(self, req: Request) -> None:
        run = self.runs.setdefault(req.request_id, CacheRun())
        ids = req.cache_ids if req.reuse_cache else []     # nothing reused: the whole prompt is computed
        loaded = self._load(run, ids) if self.host is not None or run.read is not None else {}
        m = self.tree.match(ids)
        if m.branch is not None:
            self.divergences.note(req, m)
        if m.node.snapshot is not None:
            self.state_pool.copy(m.node.snapshot, req.state_slot)
        else:
            self.state_pool.zero(req.state_slot)
        self.allocator.retain(m.pages)
        cached = min(m.length, len(req.prompt_ids))
        by_tier = {t: max(0, min(end, cached) - start) for t, (start, end) in loaded.items()} if loaded else {}
        self.tree.lock(m.deepest, +1)                   # up to the branch point: the tokens it passes over stay
        run.node = m.deepest
        ps, end = self.page_size, req.num_tokens
        points = set(range(self.track_interval, end, self.track_interval))
        run.resume_points = {(end - 1) // ps * ps}         # page-aligned end of the prompt
        if m.kv_length > m.length:
            run.resume_points.add(m.kv_length)             # branch point: cached KV but no state there yet
        run.resume_points |= {p // ps * ps for p in req.resume_hints if 0 < p // ps * ps < end}   # hinted
        run.kept_points = set(sorted(p for p in points if p < (end - 1) // ps * ps)[-KEPT_INTERVALS:])  # docstring
        run.snapshot_points = sorted(p for p in points | run.resume_points if p > m.length)
        run.prompt_end, run.stamp = end, self.tree.stamp()
        self.tree.claim(ids[:m.length], run.resume_points | run.kept_points, run.stamp)
        req.pages, req.num_computed, req.cached_tokens = list(m.pages), m.length, cached
        req.report["cached_by_tier"] = dict.fromkeys(TIERS, 0) | by_tier | {"device": cached - sum(by_tier.values())}

    def _load(self, run: CacheRun, ids: list[int]) -> dict[str, tuple[int, int]]:
        """Bring what the host tier and the file-tier read hold of ids onto the device: tier -> the token range it
        brought."""
        blobs: list[Blob] = []
        if run.read is not None and run.read.done() and run.read.exception() is None:
            blobs = run.read.result()
        run.read = None
        if self.host is not None or (blobs and ids):
            return self.tree.promote(ids, blobs if ids else [], run.read_first_page)
        return {}

    # ---- prefill chunks ----
    def plan_prefill(self, req: Request, n: int, align: int | None) -> tuple[int, list[tuple[int, int]]]:
        run, start = self.runs[req.request_id], req.num_computed     # admitted: its run is there
        for slot in run.written.values():        # planned for a chunk that did not run (no pages for it)
            self.state_pool.free_snapshot(slot)
        run.written.clear()
        snapshots: list[tuple[int, int]] = []
        for pos in [p for p in run.snapshot_points if start < p < start + n]:
            slot = None
            if align and (pos - start) % align == 0:
                slot = self._snapshot_slot(run, pos, evict=not snapshots)
            if slot is None:
                return pos - start, snapshots
            snapshots.append((pos, slot))
        return n, snapshots

    def _snapshot_slot(self, run: CacheRun, pos: int, evict: bool) -> int | None:
        if not evict:
            slot = self.state_pool.alloc_snapshot()
        elif (slot := self.tree.alloc_snapshot(resume=pos in run.resume_points | run.kept_points)) is not None:
            self.state_pool.fence([slot])        # the forward writes it: a save of its old snapshot must be done
        if slot is not None:
            run.written[pos] = slot
        return slot

    def make_room(self, pages: int) -> None:
        if self.allocator.num_free < pages:
            self.tree.evict_pages(pages)

    # ---- after each step ----
    def advance(self, req: Request, pos: int, slot: int | None = None) -> None:
        run, ps = self.runs[req.request_id], self.page_size
        for at in sorted(run.written):
            written = run.written.pop(at)
            if at < pos:                             # cache tokens [0, at) with the state the forward wrote
                self.tree.insert(req.cache_ids[:at], req.pages[:at // ps], written, resume=at in run.resume_points,
                                 claim=run.stamp if at in run.resume_points | run.kept_points else 0)
            else:                                    # the chunk was cut before it: a later one takes it
                self.state_pool.free_snapshot(written)
        slot = req.state_slot if slot is None else slot
        if pos in run.snapshot_points or (pos > run.prompt_end and pos % self.track_interval == 0):
            self._snapshot(req, pos, slot, resume=pos in run.resume_points, claim=run.stamp,
                           keep=pos in run.kept_points)
        elif self.hybrid and ps > 1 and pos % ps == 0:
            # keep the state at the last page boundary, a prefill's included: a prompt that ends on one and a
            # request that stops before the next cache the prompt's last page with it
            if run.track_slot is None:
                run.track_slot = self.tree.alloc_snapshot()
            if run.track_slot is not None:
                self.state_pool.copy(slot, run.track_slot)
                run.track_pos = pos

    def _snapshot(self, req: Request, pos: int, slot: int | None = None, resume: bool = True, claim: int = 0,
                  keep: bool = False) -> None:
        """Cache tokens [0, pos) of req with a copy of `slot` (default: its state slot), its state at pos.
        resume: pos resumes requests (a prompt end, a branch point, the request's end), not just an interval;
        claim: the request's stamp; keep: one of its kept interval snapshots (it may take a resume point's slot)."""
        if not self.hybrid:                                # no recurrent state: the KV pages are enough
            self.tree.insert(req.cache_ids[:pos], req.pages[:pos // self.page_size], None)
            return
        snap = self.tree.alloc_snapshot(resume=resume or keep)   # other intervals never push out a resume point
        if snap is None:
            return
        self.state_pool.copy(req.state_slot if slot is None else slot, snap)
        self.tree.insert(req.cache_ids[:pos], req.pages[:pos // self.page_size], snap, resume=resume,
                         claim=claim if resume or keep else 0)

    # ---- end ----
    def finish(self, req: Request) -> None:
        run, ps = self.runs[req.request_id], self.page_size
        end = req.num_computed // ps * ps
        if end == 0:
            return
        if end == req.num_computed:
            self._snapshot(req, end, claim=run.stamp)
        elif run.track_pos == end:
            slot, run.track_slot, run.track_pos = run.track_slot, None, -1
            self.tree.insert(req.cache_ids[:end], req.pages[:end // ps], slot, resume=True, claim=run.stamp)
        elif not self.hybrid:
            self.tree.insert(req.cache_ids[:end], req.pages[:end // ps], None)

    def drop(self, req: Request) -> None:
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

    # ---- the engine's: host memory (cache.host.min_free_gb), the whole cache ----
    def upkeep_due(self) -> bool:
        """Must the host tier give memory back (or may an episode end)? Cheap (one probe), any thread."""
        return self.host is not None and self.host.relief_due()

    def upkeep(self) -> None:
        """Engine thread: the host tier gives memory back, evicting through the tree."""
        if self.host is not None:
            self.host.relieve(self.tree)

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
        return CacheStats(query_tokens=t.query_tokens, hit_tokens=t.hit_tokens, divergences=self.divergences.count,
                          cached_pages=t.num_pages, snapshots_held=t.num_snapshots,
                          snapshots_evicted=t.snapshots_evicted, host=self.host.report() if self.host else None,
                          file=self.file.report() if self.file else None)

    def check(self) -> None:
        check_tree(self.tree)


class DevicePrefixCache(PrefixCache):
    """PrefixCache without a host or a file tier (build.prefix_cache picks it then): no file-tier read to start on
    arrival or to wait for, so arrival and admission order are the null cache's."""
    on_arrival = Cache.on_arrival
    admissible = Cache.admissible
