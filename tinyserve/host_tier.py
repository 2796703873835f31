"""Host tier (L2) behind the radix tree: KV pages and state snapshots in host memory (pinned on CUDA).

A budget from `cache.host.size_gb`, split explicitly between KV pages and state snapshots, taken in segments as it
fills and given back (LRU entries evicted, whole segments freed) when the machine's available memory falls below
`cache.host.min_free_gb`. Pages keep the device pool's page-major layout, so one page (all attention layers) is one
contiguous block, and moving a set of pages is a bounds-checked indexed copy per segment (`_copy_rows`), the same
for every page size and dtype. Device <-> host copies are issued by the step thread between forwards onto a copy
stream (copies.py: on CUDA a stream of their own with events, overlapped with compute; on the CPU done at once); a
device page or slot a save still reads is fenced before it is written again (invariant 4).
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from tinyserve.copies import CopyStream, index_runs, scattered
from tinyserve.pools import KVPool, StatePool
from tinyserve.plan import GIB, host_available_bytes

log = logging.getLogger("tinyserve.tiers")

# The host tier takes and gives back memory in segments of about this size, one kind of row each (KV pages or state
# snapshots; large snapshots get a larger power-of-two segment, see _rows_per_segment). A power of two: CUDA's
# pinned-memory allocator rounds blocks up to one.
SEGMENT_BYTES = 256 << 20


def _copy_rows(dst: torch.Tensor, dst_idx: list[int], src: torch.Tensor, src_idx: list[int],
               stream: CopyStream | None = None) -> None:
    """dst[dst_idx] = src[src_idx], checked: same row shape and dtype, indices in range, equal counts. With an
    asynchronous copy stream, through its copy_rows (run by run, or through device buffers for a scattered set)."""
    assert len(dst_idx) == len(src_idx), "copy with mismatched index counts"
    assert dst.shape[1:] == src.shape[1:] and dst.dtype == src.dtype, \
        f"tier copy between incompatible layouts {tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} {dst.dtype}"
    if not dst_idx:
        return
    assert 0 <= min(dst_idx) and max(dst_idx) < dst.shape[0], "tier copy: destination row out of range"
    assert 0 <= min(src_idx) and max(src_idx) < src.shape[0], "tier copy: source row out of range"
    if stream is not None and stream.asynchronous:
        stream.copy_rows(dst, dst_idx, src, src_idx)
        return
    # Pages come off free lists in ascending order, so index pairs usually form long runs that step together:
    # copy those as contiguous slices (no gather buffer, full memcpy speed); scattered sets gather once.
    runs = index_runs(dst_idx, src_idx)
    if not scattered(runs, len(dst_idx)):
        for d, s_, n in runs:
            dst[d:d + n].copy_(src[s_:s_ + n])
        return
    si = torch.tensor(src_idx, dtype=torch.long, device=src.device)
    rows = src.index_select(0, si).to(dst.device, non_blocking=False)
    dst.index_copy_(0, torch.tensor(dst_idx, dtype=torch.long, device=dst.device), rows)


@dataclass
class HostStats:
    """The host tier's counters and occupancy, as /metrics shows them."""
    hit_tokens: int = 0          # prompt tokens loaded back from the tier
    bytes_in: int = 0            # device -> host (backups, demotions)
    bytes_out: int = 0           # host -> device (loads)
    seconds: float = 0.0         # time spent issuing those copies
    used: int = 0                # KV pages held
    capacity: int = 0            # KV pages it may hold now (lowered while memory is short)
    used_snapshots: int = 0
    capacity_snapshots: int = 0
    allocated_bytes: int = 0     # memory held now (whole segments)
    budget_bytes: int = 0        # the most it may hold (cache.host.size_gb as planned)
    min_free_bytes: int = 0      # cache.host.min_free_gb
    pressure_events: int = 0     # episodes of the machine's available memory below the floor
    released_bytes: int = 0      # memory given back in those episodes


def _rows_per_segment(row_bytes: int, target: int) -> int:
    """Rows per segment of about `target` bytes. Rows too large for that to fill a segment well (a state snapshot of
    a large model) get a larger power-of-two segment, up to 8x, that they fill to at least 3/4: CUDA's pinned
    allocator rounds every block up to a power of two."""
    row_bytes = max(1, row_bytes)
    size = max(target, 1 << (row_bytes - 1).bit_length())
    while size <= 8 * target:
        rows = size // row_bytes
        if 4 * rows * row_bytes >= 3 * size:
            return rows
        size *= 2
    return max(1, target // row_bytes)


class _Rows:
    """Rows of one shape (a KV page, or a state snapshot: conv + SSM) kept in segments that are allocated as the
    rows fill them and freed whole under memory pressure. Callers hold logical row ids that never change; a row's
    place (segment, offset) may move when segments are compacted before some are freed."""

    def __init__(self, specs: list[tuple[tuple[int, ...], torch.dtype]], total: int, per_segment: int,
                 pin: bool) -> None:
        self.specs, self.total, self.pin = specs, total, pin
        self.per_segment = max(1, min(per_segment, total))
        self.row_bytes = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in specs)
        self.segments: list[list[torch.Tensor]] = []       # per segment: one tensor per spec, [rows, *shape]
        self.limit = total                                 # rows that may be in use now (lowered under pressure)
        self._where = [-1] * total                         # logical id -> physical row (-1: free id)
        self._owner: list[int] = []                        # physical row -> logical id (-1: free row)
        self._free_ids = list(range(total - 1, -1, -1))    # pop() hands out low ids first
        self._free_rows: list[int] = []                    # heap: the lowest free physical row goes first

    @property
    def used(self) -> int:
        return self.total - len(self._free_ids)

    @property
    def max_segments(self) -> int:
        return -(-self.total // self.per_segment)

    def segments_for(self, rows: int) -> int:
        """Segments needed to hold `rows` rows."""
        return -(-rows // self.per_segment)

    def rows_in(self, segments: int) -> int:
        """Rows held by the first `segments` segments."""
        return min(self.total, segments * self.per_segment)

    def bytes_in(self, segments: int) -> int:
        return self.rows_in(segments) * self.row_bytes

    @property
    def allocated_bytes(self) -> int:
        return self.bytes_in(len(self.segments))

    def growth_bytes(self, n: int) -> int:
        """Bytes of the segments to allocate before n more rows fit (0: they fit already)."""
        short, segs = n - len(self._free_rows), len(self.segments)
        while short > 0 and segs < self.max_segments:
            short -= self.rows_in(segs + 1) - self.rows_in(segs)
            segs += 1
        return self.bytes_in(segs) - self.allocated_bytes if short <= 0 else -1

    def _grow(self) -> None:
        i = len(self.segments)
        rows = self.rows_in(i + 1) - self.rows_in(i)
        self.segments.append([torch.empty((rows,) + shape, dtype=dt, pin_memory=self.pin) for shape, dt in self.specs])
        base = i * self.per_segment
        self._owner += [-1] * rows
        for r in range(base, base + rows):
            heapq.heappush(self._free_rows, r)

    def alloc(self, n: int, may_grow: Callable[[int], bool]) -> list[int] | None:
        """n logical ids, or None (nothing taken) when they exceed the limit or their segments may not grow."""
        if n > self.limit - self.used:
            return None
        grow = self.growth_bytes(n)
        if grow < 0 or (grow > 0 and not may_grow(grow)):
            return None
        while len(self._free_rows) < n:
            self._grow()
        ids = [self._free_ids.pop() for _ in range(n)]
        for i in ids:
            row = heapq.heappop(self._free_rows)
            self._where[i], self._owner[row] = row, i
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            row = self._where[i]
            assert row >= 0, f"host tier: double free of row {i}"
            self._where[i], self._owner[row] = -1, -1
            heapq.heappush(self._free_rows, row)
            self._free_ids.append(i)

    def _groups(self, ids: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        """segment -> (offsets in it, positions in ids)."""
        out: dict[int, tuple[list[int], list[int]]] = {}
        for pos, i in enumerate(ids):
            row = self._where[i]
            assert row >= 0, f"host tier: row {i} is not allocated"
            offs, poss = out.setdefault(row // self.per_segment, ([], []))
            offs.append(row % self.per_segment)
            poss.append(pos)
        return out

    def write(self, ids: list[int], srcs: list[torch.Tensor], src_idx: list[int],
              stream: CopyStream | None = None) -> None:
        """rows[ids] = src[src_idx], for each spec's tensor."""
        for seg, (offs, poss) in self._groups(ids).items():
            for k, src in enumerate(srcs):
                _copy_rows(self.segments[seg][k], offs, src, [src_idx[p] for p in poss], stream)

    def read(self, ids: list[int], dsts: list[torch.Tensor], dst_idx: list[int],
             stream: CopyStream | None = None) -> None:
        """dst[dst_idx] = rows[ids], for each spec's tensor."""
        for seg, (offs, poss) in self._groups(ids).items():
            for k, dst in enumerate(dsts):
                _copy_rows(dst, [dst_idx[p] for p in poss], self.segments[seg][k], offs, stream)

    def gather(self, ids: list[int]) -> list[torch.Tensor]:
        """New CPU tensors [len(ids), *shape] with the rows' contents, one per spec."""
        out = [torch.empty((len(ids),) + shape, dtype=dt) for shape, dt in self.specs]
        self.read(ids, out, list(range(len(ids))))
        return out

    def shrink_to(self, keep: int) -> int:
        """Move every used row into the first `keep` segments and free the others; returns the bytes freed.
        The caller has brought the used rows within rows_in(keep)."""
        if keep >= len(self.segments):
            return 0
        cut = self.rows_in(keep)
        assert self.used <= cut, "host tier: shrinking below the rows in use"
        free_low = sorted(r for r in self._free_rows if r < cut)
        moves = [(self._owner[r], r) for r in range(cut, len(self._owner)) if self._owner[r] >= 0]
        for (i, src), dst in zip(moves, free_low):
            for k in range(len(self.specs)):
                self.segments[dst // self.per_segment][k][dst % self.per_segment].copy_(
                    self.segments[src // self.per_segment][k][src % self.per_segment])
            self._where[i], self._owner[dst], self._owner[src] = dst, i, -1
        freed = self.allocated_bytes - self.bytes_in(keep)
        del self.segments[keep:]
        del self._owner[cut:]
        self._free_rows = [r for r in range(cut) if self._owner[r] < 0]
        heapq.heapify(self._free_rows)
        return freed


class HostCopies(Protocol):
    """The tree that holds the tier's copies (tiers.TieredRadixCache), as relieve() sees it."""
    def evict_host(self, pages: int = 0, snapshots: int = 0) -> None:
        """Evict host copies until `pages` pages and `snapshots` snapshot slots are free (or nothing more can go)."""


class HostTier:
    """Host memory (pinned on CUDA) for KV pages and state snapshots, taken in segments as it fills, up to the
    plan's budget, and given back when the machine runs short.

    Memory is a budget (design invariant 8): a segment is allocated only when rows are needed and the machine
    would still have `min_free_bytes` available afterwards (`available_memory()`, /proc/meminfo's MemAvailable
    unless a probe is injected); otherwise the allocation fails and the tier works within what it holds (the radix
    tree evicts its LRU host entries). `relieve(tree)` (engine thread) gives memory back while the machine has less
    than `min_free_bytes` available: it lowers the tier's capacity, has the tree evict LRU host entries down to
    it (`TieredRadixCache.evict_host`), moves the remaining rows into the lowest segments and frees the rest. Such an
    episode is logged once and counted (stats.pressure_events, stats.released_bytes); capacity returns when memory
    does.

    Ids handed to the tree (pages, snapshot slots) are logical: they stay valid when rows move between segments."""

    def __init__(self, kv_pool: KVPool, state_pool: StatePool, num_pages: int, num_snapshots: int, *,
                 min_free_bytes: int = 0, available_memory: Callable[[], int] | None = None,
                 segment_bytes: int | None = None, copies: CopyStream | None = None) -> None:
        """num_pages / num_snapshots: the memory plan's split of cache.host.size_gb (the most ever allocated);
        min_free_bytes: cache.host.min_free_gb (0: no floor); segment_bytes: the allocation unit; copies: the
        stream device <-> host copies run on (copies.py; immediate when None)."""
        self.kv_pool, self.state_pool = kv_pool, state_pool
        self.copies = copies or CopyStream()
        pin = kv_pool.buffer.is_cuda and torch.cuda.is_available()
        self.page_bytes, self.snap_bytes = kv_pool.bytes_per_page, state_pool.bytes_per_slot
        seg = segment_bytes or SEGMENT_BYTES
        buf = kv_pool.buffer
        self._pages = _Rows([(tuple(buf.shape[1:]), buf.dtype)], num_pages,
                            _rows_per_segment(self.page_bytes, seg), pin)
        self._snaps = _Rows([(tuple(state_pool.conv.shape[1:]), state_pool.conv.dtype),
                             (tuple(state_pool.ssm.shape[1:]), state_pool.ssm.dtype)],
                            num_snapshots, _rows_per_segment(self.snap_bytes, seg), pin)
        self.max_pages, self.max_snapshots = num_pages, num_snapshots
        self.min_free_bytes = min_free_bytes
        self.available_memory: Callable[[], int] = available_memory or host_available_bytes
        self.under_pressure = False
        self.stats = HostStats()

    # ---- capacity (what the radix tree sees) ----
    @property
    def num_pages(self) -> int:
        """KV pages the tier may hold now: the budget, or what it keeps while memory is short."""
        return self._pages.limit

    @property
    def num_free_pages(self) -> int:
        return self._pages.limit - self._pages.used

    @property
    def num_snapshots(self) -> int:
        return self._snaps.limit

    @property
    def num_free_snapshots(self) -> int:
        return self._snaps.limit - self._snaps.used

    @property
    def allocated_bytes(self) -> int:
        return self._pages.allocated_bytes + self._snaps.allocated_bytes

    @property
    def budget_bytes(self) -> int:
        return self._pages.bytes_in(self._pages.max_segments) + self._snaps.bytes_in(self._snaps.max_segments)

    @property
    def num_segments(self) -> int:
        return len(self._pages.segments) + len(self._snaps.segments)

    def _may_grow(self, nbytes: int) -> bool:
        """May the tier take nbytes more? Not when the machine would be left below the floor: then the tier keeps
        what it has (the tree evicts within it) until memory comes back."""
        if not self.min_free_bytes:
            return True
        available = self.available_memory()
        if available - nbytes >= self.min_free_bytes:
            return True
        self._enter_pressure(available)
        self._pages.limit = self._pages.rows_in(len(self._pages.segments))
        self._snaps.limit = self._snaps.rows_in(len(self._snaps.segments))
        return False

    def alloc_pages(self, n: int) -> list[int] | None:
        return self._pages.alloc(n, self._may_grow)

    def free_pages(self, pages: list[int]) -> None:
        self._pages.free(pages)

    def alloc_snapshot(self) -> int | None:
        slot = self._snaps.alloc(1, self._may_grow)
        return slot[0] if slot else None

    def free_snapshot(self, slot: int) -> None:
        self._snaps.free([slot])

    def report(self) -> HostStats:
        return dataclasses.replace(self.stats, used=self._pages.used, capacity=self.num_pages,
                                   used_snapshots=self._snaps.used, capacity_snapshots=self.num_snapshots,
                                   allocated_bytes=self.allocated_bytes, budget_bytes=self.budget_bytes,
                                   min_free_bytes=self.min_free_bytes)

    # ---- memory pressure ----
    def _enter_pressure(self, available: int) -> None:
        if self.under_pressure:
            return
        self.under_pressure = True
        self.stats.pressure_events += 1
        log.warning("host tier: the machine has %.2f GiB available, below cache.host.min_free_gb (%.2f GiB): "
                    "giving host memory back (LRU entries evicted, segments freed; %.2f GiB held); further "
                    "releases in this episode are counted in /metrics, not logged", available / GIB,
                    self.min_free_bytes / GIB, self.allocated_bytes / GIB)

    def relief_due(self) -> bool:
        """Should relieve() run? Memory is short, or an episode can end. Cheap (one probe), any thread."""
        if not self.min_free_bytes:
            return False
        available = self.available_memory()
        if available < self.min_free_bytes:                 # something to give back (or an episode to begin)
            return self.allocated_bytes > 0 or not self.under_pressure
        return self.under_pressure and self._can_recover(available)

    def _can_recover(self, available: int) -> bool:
        """Memory is back: one more segment would still leave the floor free."""
        grow = max(self._pages.bytes_in(len(self._pages.segments) + 1) - self._pages.allocated_bytes,
                   self._snaps.bytes_in(len(self._snaps.segments) + 1) - self._snaps.allocated_bytes)
        return available - grow >= self.min_free_bytes

    def relieve(self, tree: HostCopies) -> int:
        """Engine thread. While the machine has less than min_free_bytes available: lower the capacity segment by
        segment (the larger part gives first), have `tree` evict its LRU host entries down to it (the tree's own
        host eviction keeps its invariants: host-only nodes go with their copy, children before parents, a snapshot
        an admission may still load stays; what it cannot evict stays, and so do its segments), compact and free the
        emptied segments, probe again. Ends an episode once memory is back. Returns the bytes given back."""
        if not self.min_free_bytes:
            return 0
        available = self.available_memory()
        if available >= self.min_free_bytes:
            if self.under_pressure and self._can_recover(available):
                self.under_pressure = False
                self._pages.limit, self._snaps.limit = self._pages.total, self._snaps.total
                log.info("host tier: %.2f GiB available again; the tier may grow back to %.2f GiB",
                         available / GIB, self.budget_bytes / GIB)
            return 0
        self._enter_pressure(available)
        pages, snaps = self._pages, self._snaps
        released = 0
        while available < self.min_free_bytes and (pages.segments or snaps.segments):
            keep_p, keep_s, freed = len(pages.segments), len(snaps.segments), 0
            while freed < self.min_free_bytes - available and (keep_p or keep_s):
                if keep_p and (not keep_s or pages.bytes_in(keep_p) >= snaps.bytes_in(keep_s)):
                    keep_p -= 1
                    freed += pages.bytes_in(keep_p + 1) - pages.bytes_in(keep_p)
                else:
                    keep_s -= 1
                    freed += snaps.bytes_in(keep_s + 1) - snaps.bytes_in(keep_s)
            pages.limit, snaps.limit = pages.rows_in(keep_p), snaps.rows_in(keep_s)
            tree.evict_host(pages=0, snapshots=0)          # down to the lowered limits (free counts are < 0)
            keep_p, keep_s = max(keep_p, pages.segments_for(pages.used)), max(keep_s, snaps.segments_for(snaps.used))
            pages.limit, snaps.limit = pages.rows_in(keep_p), snaps.rows_in(keep_s)
            self.copies.synchronize()                      # rows move on the CPU: no copy may still write them
            freed = pages.shrink_to(keep_p) + snaps.shrink_to(keep_s)
            if not freed:                # what is left is held by running requests' paths: try again later
                break
            released += freed
            available = self.available_memory()
        if released and self.kv_pool.buffer.is_cuda and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()         # pinned blocks go back to the OS, not to torch's host cache
        self.stats.released_bytes += released
        return released

    # ---- copies (engine thread) ----
    def _timed(self, nbytes: int, outward: bool):
        t0 = time.perf_counter()

        def done() -> None:
            self.stats.seconds += time.perf_counter() - t0
            if outward:
                self.stats.bytes_out += nbytes
            else:
                self.stats.bytes_in += nbytes
        return done

    # Saves and loads go through the copy stream (copies.py): on CUDA the engine thread does not wait for them, and
    # the stream's fences keep a device page or slot a save still reads from being written meanwhile.
    def save_pages(self, device_pages: list[int], host_pages: list[int]) -> None:
        assert len(device_pages) == len(host_pages), "copy with mismatched index counts"
        done = self._timed(len(host_pages) * self.page_bytes, outward=False)
        with self.copies.saving(pages=device_pages, host_pages=host_pages):
            self._pages.write(host_pages, [self.kv_pool.buffer], device_pages, self.copies)
        done()

    def load_pages(self, host_pages: list[int], device_pages: list[int]) -> None:
        assert len(device_pages) == len(host_pages), "copy with mismatched index counts"
        done = self._timed(len(host_pages) * self.page_bytes, outward=True)
        with self.copies.loading():
            self._pages.read(host_pages, [self.kv_pool.buffer], device_pages, self.copies)
        done()

    def save_snapshot(self, device_slot: int, host_slot: int) -> None:
        done = self._timed(self.snap_bytes, outward=False)
        with self.copies.saving(slots=[device_slot], host_snapshots=[host_slot]):
            self._snaps.write([host_slot], [self.state_pool.conv, self.state_pool.ssm], [device_slot], self.copies)
        done()

    def load_snapshot(self, host_slot: int, device_slot: int) -> None:
        done = self._timed(self.snap_bytes, outward=True)
        with self.copies.loading():
            self._snaps.read([host_slot], [self.state_pool.conv, self.state_pool.ssm], [device_slot], self.copies)
        done()

    def read_pages(self, host_pages: list[int]) -> torch.Tensor:
        """A CPU copy [len(host_pages), *page shape] of host pages (for the file tier's writer)."""
        self.copies.host_ready(host_pages=host_pages)
        return self._pages.gather(host_pages)[0]

    def read_snapshot(self, host_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU copies (conv, ssm) of one host snapshot."""
        self.copies.host_ready(host_snapshots=[host_slot])
        conv, ssm = self._snaps.gather([host_slot])
        return conv[0], ssm[0]

    @property
    def kv(self) -> torch.Tensor:
        """Every KV page by logical id, as one CPU copy (free ids read as zeros): for tests and benchmarks."""
        self.copies.synchronize()
        out = torch.zeros((self.max_pages,) + self._pages.specs[0][0], dtype=self._pages.specs[0][1])
        used = [i for i in range(self.max_pages) if self._pages._where[i] >= 0]
        self._pages.read(used, [out], used)
        return out
