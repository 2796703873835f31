"""Cache tiers behind the radix tree: host memory (L2) and a persistent folder (L3), state snapshots included.

Host tier: a budget from `cache.host.size_gb`, split explicitly between KV pages and state snapshots, taken in
segments as it fills and given back (LRU entries evicted, whole segments freed) when the machine's available
memory falls below `cache.host.min_free_gb`. Pages keep the device pool's page-major layout, so one page (all
attention layers) is one contiguous block, and moving a set of pages is a bounds-checked indexed copy per segment
(`_copy_rows`), the same for every page size and dtype. Device <-> host copies are issued by the step thread between
forwards onto a copy stream (copies.py: on CUDA a stream of their own with events, overlapped with compute; on the
CPU done at once); a device page or slot a save still reads is fenced before it is written again (invariant 4).

File tier: one blob per cached run of pages (a radix node), named by the hash chain at its start and end:
`<start>-<end>.tsb`. The chain is seeded by a fingerprint of the model (config, tensor names, shapes, dtypes),
the KV dtype, the page size and the format version, so another model or setting never hits. A blob has a header
(magic, version, fingerprint, the two chain hashes, lengths, CRC32 of the payload), then the run's token ids, its
KV pages and, when the node had one, the state snapshot at its end. Blobs are written to a temporary name and
renamed, by one background writer thread; the folder is indexed from its listing at start (temporary files of a
killed writer are deleted); a truncated, corrupt or foreign blob is a miss: counted, logged once, deleted.

A page is stored once: when a cached run is split (a prompt branched off inside it), both halves keep the blob that
holds them, and a later read uses the matching prefix of a blob that leaves the prompt's path (`read_chain`). A
blob holds a state snapshot at its end only, so the state at such a cut (a branch point) is a state blob of its
own: the same format with no tokens and no pages, named `<at>.tss` by its chain hash.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
import dataclasses
import gc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from tinyserve.config import WRITE_POLICIES
from tinyserve.copies import CopyStream, index_runs, scattered
from tinyserve.kv import KVPool
from tinyserve.plan import GIB, host_available_bytes
from tinyserve.state import StatePool

log = logging.getLogger("tinyserve.tiers")

FORMAT_VERSION = 1
MAGIC = b"TSKVBLOB"
# magic, version, fingerprint, start hash, end hash, n_tokens, n_pages, kv bytes, conv bytes, ssm bytes, crc32
HEADER = struct.Struct("<8sI32s32s32sIIQQQI")
SUFFIX = ".tsb"
STATE_SUFFIX = ".tss"      # a state blob: the state snapshot at one chain hash, no pages (start hash = end hash)
PROBE_LIMIT = 256          # file tier: blobs whose first page one read_chain call looks up (for a prefix)
STAT_BATCH = 2000          # file tier: blobs updated per hold of the index lock by the start-up stat job
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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _unlink(path: Path) -> None:
    """Delete a cache file; a folder we may not change (read-only, or a stray directory by that name) is left as
    it is: the index no longer lists it, and serving goes on."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("file tier: could not delete %s (%s)", path, e)


@dataclass
class TierStats:
    """A tier's counters and occupancy, as /metrics shows them."""
    hit_tokens: int = 0
    bytes_in: int = 0            # into this tier (backups / writes)
    bytes_out: int = 0           # out of this tier (loads / reads)
    seconds: float = 0.0         # time spent copying / reading / writing
    errors: int = 0              # file tier: corrupt, truncated or foreign blobs (each deleted)
    used: int = 0                # host: KV pages, file: bytes
    capacity: int = 0            # host: KV pages it may hold now (lowered while memory is short), file: bytes
    used_snapshots: int = 0      # host only
    capacity_snapshots: int = 0
    allocated_bytes: int = 0     # host only: memory held now (whole segments)
    budget_bytes: int = 0        # host only: the most it may hold (cache.host.size_gb as planned)
    min_free_bytes: int = 0      # host only: cache.host.min_free_gb
    pressure_events: int = 0     # host only: episodes of the machine's available memory below the floor
    released_bytes: int = 0      # host only: memory given back in those episodes
    blobs: int = 0               # file only
    writable: bool = True        # file only: False once a write failed (serving goes on)


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
        self.row_bytes = sum(_numel(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in specs)
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


class HostTier:
    """Host memory (pinned on CUDA) for KV pages and state snapshots, taken in segments as it fills, up to the
    plan's budget, and given back when the machine runs short.

    Memory is a budget (design invariant 8): a segment is allocated only when rows are needed and the machine
    would still have `min_free_bytes` available afterwards (`available_memory()`, /proc/meminfo's MemAvailable
    unless a probe is injected); otherwise the allocation fails and the tier works within what it holds (the radix
    tree evicts its LRU host entries). `relieve(tree)` (engine thread) gives memory back while the machine has less
    than `min_free_bytes` available: it lowers the tier's capacity, evicts LRU host entries through the tree's own
    host eviction, moves the remaining rows into the lowest segments and frees the rest. Such an episode is logged
    once and counted (stats.pressure_events, stats.released_bytes); capacity returns when memory does.

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
        self.stats = TierStats()

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

    def report(self) -> TierStats:
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

    def relieve(self, tree) -> int:
        """Engine thread. While the machine has less than min_free_bytes available: lower the capacity segment by
        segment (the larger part gives first), evict LRU host entries through `tree` (a RadixCache) down to it,
        compact and free the emptied segments, probe again. Ends an episode once memory is back. Returns the bytes
        given back."""
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
            self._evict(tree)
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

    def _evict(self, tree) -> None:
        """Evict LRU host entries until the rows in use fit the lowered limits, through the tree's own host
        eviction (it keeps the tree's invariants: host-only nodes go with their copy, children before parents, a
        snapshot a running request may still load stays). What it cannot evict stays, and so do its segments."""
        if self._pages.used > self._pages.limit:
            tree._host_alloc_pages(0, protect=None)         # evicts while num_free_pages < 0
        while self._snaps.used > self._snaps.limit:
            slot = tree._host_alloc_snapshot(protect=None)  # alloc fails over the limit: it evicts one and
            if slot is None:                                # hands its slot over, which goes back here
                break
            self.free_snapshot(slot)

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


WEIGHT_SAMPLES = 4096      # values read from each tensor for the weight digest


def _parameters_but_vision(module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and buffers (FP8 weights and their scales are buffers) by name, a model's vision
    tower left out: it decides no text page's KV (image tokens are keyed on a digest of it instead)."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return sorted(((n, p) for n, p in tensors if not n.startswith("visual.")), key=lambda t: t[0])


@torch.no_grad()
def weights_digest(model) -> bytes:
    """Digest of a strided sample of every parameter's values (the vision tower's left out). Two checkpoints of the
    same architecture (a fine-tune, another seed) differ almost everywhere, so a sample tells them apart, while
    hashing all weights of a 27B model would cost tens of seconds at every start."""
    h = hashlib.sha256()
    for name, p in _parameters_but_vision(model):
        flat = p.detach().reshape(-1)
        n = flat.numel()
        if n > WEIGHT_SAMPLES:
            idx = torch.linspace(0, n - 1, WEIGHT_SAMPLES, device=flat.device).long()
            flat = flat.index_select(0, idx)
        h.update(name.encode())
        h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.digest()


_NOT_IN_FINGERPRINT = ("folder", "vision_config", "vision_parameters", "image_token_id", "vision_start_token_id",
                       "vision_end_token_id", "fp8_blocks")      # FP8 kept or not: the weights' digest tells


def model_fingerprint(model, kv_dtype: torch.dtype, page_size: int) -> bytes:
    """Identity of everything that decides the bytes of a cached page: a blob from any other set-up never hits.
    Config, tensor names/shapes/dtypes and a sample of the weight values (another checkpoint of the same
    architecture must not hit), KV dtype, page size and the format version."""
    # where the checkpoint lies and whether its vision tower is loaded change no text page
    config = {k: v for k, v in asdict(model.cfg).items() if k not in _NOT_IN_FINGERPRINT}
    desc = {
        "format": FORMAT_VERSION,
        "config": config,
        "tensors": [(n, list(p.shape), str(p.dtype)) for n, p in _parameters_but_vision(model)],
        "weights": weights_digest(model).hex(),
        "kv_dtype": str(kv_dtype),
        "state_dtype": str(model.dtype),
        "page_size": page_size,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).digest()


def chain_hashes(seed: bytes, tokens: list[int], page_size: int) -> list[bytes]:
    """h[0] = seed; h[i+1] = sha256(h[i] + page i's token ids as int32 LE). One per full page boundary."""
    out = [seed]
    for i in range(len(tokens) // page_size):
        page = struct.pack(f"<{page_size}i", *tokens[i * page_size:(i + 1) * page_size])
        out.append(hashlib.sha256(out[-1] + page).digest())
    return out


def blob_name(start: bytes, end: bytes) -> str:
    """A blob's file name: `<start>-<end>.tsb` for a run of pages, `<at>.tss` for a state blob (start = end)."""
    return f"{start.hex()}{STATE_SUFFIX}" if start == end else f"{start.hex()}-{end.hex()}{SUFFIX}"


@dataclass
class Blob:
    """One run of pages read back from the file tier (CPU tensors), or to be written."""
    start_hash: bytes
    end_hash: bytes
    tokens: list[int]
    kv: torch.Tensor                      # [n_pages, *page shape]
    conv: torch.Tensor | None = None      # [*slot shape] state snapshot at the run's end
    ssm: torch.Tensor | None = None
    stored_run: tuple[bytes, bytes] | None = None     # read back: the stored blob (start, end) holding these pages
                                                      # (longer than the run when its prefix was used)
    stored_state: tuple[bytes, bytes] | None = None   # read back: the stored blob holding the state (None: no state)


@dataclass(slots=True)
class _Entry:
    name: str                   # file name in the folder (a Path per blob would cost more than the listing)
    size: int = -1              # bytes; -1 until read (blobs found at start are stat'ed in the background)
    last_use: float = 0.0       # time.time() of the last write or read; a found blob's mtime
    next_hash: bytes | None = None   # chain hash after the blob's first page (None: not looked up yet)


@dataclass
class FileTier:
    folder: Path
    size_bytes: int
    fingerprint: bytes
    page_shape: tuple[int, ...]
    kv_dtype: torch.dtype
    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, ...]
    writable: bool = True
    stats: TierStats = field(default_factory=TierStats)
    needs_state: bool = False    # a hybrid model's runs: usable only up to a state snapshot (the radix tree sets it)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._index: dict[bytes, dict[bytes, _Entry]] = {}      # start hash -> end hash -> blob
        self._lru: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()   # least recently used first
        self._count = 0
        self._total = 0                                          # bytes of the blobs whose size is known
        self._warned: set[str] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-file-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-file-read")
        self._pending: list[Future] = []
        self._queued: set[tuple[bytes, bytes]] = set()          # blobs queued for writing, not yet in the index
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".tmp-probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._disable_writes(f"cache.file.dir {self.folder} is not writable ({e})")
        self._scan()

    # ---- index ----
    def _scan(self) -> None:
        """Index the folder from its names alone (one listing, no per-file stat or open), so a restart with 100,000
        blobs serves hits at once; their sizes and ages are read by the writer thread before its first write
        (`_stat_found`), which is all eviction needs them for."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return
        name_len, fromhex, index = 2 * 64 + 1 + len(SUFFIX), bytes.fromhex, self._index
        state_len = 64 + len(STATE_SUFFIX)
        found: list[tuple[bytes, bytes]] = []
        collecting = gc.isenabled()
        gc.disable()            # 100,000 new objects would run the collector over them again and again (~40% here)
        try:
            for name in names:
                try:
                    if len(name) == name_len and name[64] == "-" and name.endswith(SUFFIX):
                        start, end = fromhex(name[:64]), fromhex(name[65:129])
                    elif len(name) == state_len and name.endswith(STATE_SUFFIX):
                        start = end = fromhex(name[:64])
                    else:
                        if name.startswith(".tmp-"):     # left by a writer that was killed mid-write
                            _unlink(self.folder / name)
                        continue
                except ValueError:
                    continue
                ends = index.get(start)
                if ends is None:
                    index[start] = {end: _Entry(name)}
                else:
                    ends[end] = _Entry(name)
                found.append((start, end))
            self._lru = OrderedDict.fromkeys(found)
            self._count = len(self._lru)
        finally:
            if collecting:
                gc.enable()
        log.info("file tier %s: %d blobs indexed", self.folder, self._count)
        if found:
            self._pending.append(self._writer.submit(self._stat_found, found))

    def _stat_found(self, found: list[tuple[bytes, bytes]]) -> None:
        """Writer thread, first job: the sizes and ages of the blobs found at start, LRU order by age (blobs read or
        rewritten since the scan stay the most recent), then evict down to size_gb. The index lock is taken in short
        batches, so the engine thread's lookups never wait long. A blob that went away meanwhile leaves the index."""
        stats: list[tuple[float, int, bytes, bytes]] = []
        gone: list[tuple[bytes, bytes]] = []
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            for start, end in found:
                try:
                    st = os.stat(blob_name(start, end), dir_fd=fd)
                    stats.append((st.st_mtime, st.st_size, start, end))
                except OSError:
                    gone.append((start, end))
        finally:
            os.close(fd)
        stats.sort(key=lambda t: t[0], reverse=True)   # newest first: each goes to the front, the oldest ends first
        for i in range(0, len(stats), STAT_BATCH):
            with self._lock:
                for mtime, size, start, end in stats[i:i + STAT_BATCH]:
                    entry = self._index.get(start, {}).get(end)
                    if entry is None or entry.size >= 0:         # removed, or rewritten since the scan
                        continue
                    entry.size = size
                    self._total += size
                    if entry.last_use == 0.0:                     # not read since the scan
                        entry.last_use = mtime
                        self._lru.move_to_end((start, end), last=False)
        with self._lock:
            for start, end in gone:
                entry = self._index.get(start, {}).get(end)
                if entry is not None and entry.size < 0:
                    self._forget(start, end)
        while True:
            with self._lock:
                if not self._evict_to_limit(STAT_BATCH):
                    break
        log.info("file tier %s: %d blobs, %.2f GiB", self.folder, self.num_blobs, self._total / GIB)

    def _add(self, start: bytes, end: bytes, entry: _Entry) -> None:
        old = self._index.setdefault(start, {}).get(end)
        if old is not None:
            self._total -= max(0, old.size)
        else:
            self._count += 1
        self._index[start][end] = entry
        self._lru[(start, end)] = None
        self._lru.move_to_end((start, end))
        self._total += max(0, entry.size)

    def _forget(self, start: bytes, end: bytes) -> _Entry | None:
        entry = self._index.get(start, {}).pop(end, None)
        if entry is None:
            return None
        if not self._index[start]:
            del self._index[start]
        del self._lru[(start, end)]
        self._count -= 1
        self._total -= max(0, entry.size)
        return entry

    def _remove(self, start: bytes, end: bytes) -> None:
        entry = self._forget(start, end)
        if entry is not None:
            _unlink(self.folder / entry.name)

    @property
    def num_blobs(self) -> int:
        return self._count

    def report(self) -> TierStats:
        return dataclasses.replace(self.stats, used=self.used_bytes, capacity=self.size_bytes, blobs=self.num_blobs,
                                   writable=self.writable)

    @property
    def used_bytes(self) -> int:
        return self._total

    def has(self, start: bytes, end: bytes) -> bool:
        """Is this blob stored, or queued for writing?"""
        with self._lock:
            return end in self._index.get(start, {}) or (start, end) in self._queued

    # ---- writing (background thread) ----
    def _disable_writes(self, why: str) -> None:
        if self.writable:
            log.warning("%s: file-tier writes disabled, serving goes on", why)
        self.writable = False

    def write(self, blob: Blob) -> None:
        """Queue a blob for writing (tensors must be CPU copies the caller no longer changes)."""
        key = (blob.start_hash, blob.end_hash)
        with self._lock:
            if not self.writable or blob.end_hash in self._index.get(blob.start_hash, {}) or key in self._queued:
                return
            self._queued.add(key)
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._writer.submit(self._write_now, blob))

    def _encode(self, blob: Blob) -> list:
        """Header + payload parts (views, no concatenated copy); the CRC is computed part by part."""
        def raw(t: torch.Tensor | None):
            return memoryview(t.contiguous().view(torch.uint8).numpy()) if t is not None else memoryview(b"")
        tokens = memoryview(struct.pack(f"<{len(blob.tokens)}i", *blob.tokens))
        kv, conv, ssm = raw(blob.kv), raw(blob.conv), raw(blob.ssm)
        crc = 0
        for part in (tokens, kv, conv, ssm):
            crc = zlib.crc32(part, crc)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.fingerprint, blob.start_hash, blob.end_hash,
                             len(blob.tokens), blob.kv.shape[0], kv.nbytes, conv.nbytes, ssm.nbytes, crc)
        return [memoryview(header), tokens, kv, conv, ssm]

    def _write_now(self, blob: Blob) -> None:
        try:
            self._write_blob(blob)
        finally:
            with self._lock:
                self._queued.discard((blob.start_hash, blob.end_hash))

    def _write_blob(self, blob: Blob) -> None:
        t0 = time.perf_counter()
        parts = self._encode(blob)
        size = sum(p.nbytes for p in parts)
        if size > self.size_bytes:
            self._warn_once("size", f"a cached run of {size} bytes exceeds cache.file.size_gb; not written")
            return
        name = blob_name(blob.start_hash, blob.end_hash)
        tmp = self.folder / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, self.folder / name)
        except OSError as e:
            self._disable_writes(f"writing {self.folder / name} failed ({e})")
            _unlink(tmp)          # raises nothing, also when the folder itself is gone or is not a folder
            return
        n_pages = blob.kv.shape[0]
        first = struct.pack(f"<{len(blob.tokens) // n_pages}i", *blob.tokens[:len(blob.tokens) // n_pages]) \
            if n_pages else None
        with self._lock:
            self._add(blob.start_hash, blob.end_hash, _Entry(name, size, time.time(), first and hashlib.sha256(
                blob.start_hash + first).digest()))
            self._evict_to_limit()
            self.stats.bytes_in += size
            self.stats.seconds += time.perf_counter() - t0

    def _evict_to_limit(self, most: int | None = None) -> bool:
        """Remove least recently used blobs while over size_gb (at most `most` of them); True if more remain to go."""
        n = 0
        while self._total > self.size_bytes and self._lru:
            if most is not None and n >= most:
                return True
            start, end = next(iter(self._lru))
            self._remove(start, end)
            n += 1
        return False

    def flush(self, timeout: float) -> bool:
        """Wait (bounded) for queued writes; True when all of them completed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                f.result(timeout=left)
            except Exception:       # noqa: BLE001 - a failed write was already logged and disabled writes
                pass
        return all(f.done() for f in pending)

    def close(self, timeout: float = 10.0) -> None:
        if not self.flush(timeout):
            log.warning("file tier: pending writes did not finish within %.0f s", timeout)
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)

    def clear(self) -> None:
        self.flush(30.0)
        with self._lock:
            for start in list(self._index):
                for end in list(self._index.get(start, {})):
                    self._remove(start, end)

    # ---- reading ----
    def _warn_once(self, kind: str, msg: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", msg)

    def _bad(self, start: bytes, end: bytes, why: str) -> None:
        self.stats.errors += 1
        self._warn_once(why, f"file tier: {why} blob {start.hex()[:12]}-{end.hex()[:12]}: treated as a miss "
                        "and deleted (further ones are counted, not logged)")
        with self._lock:
            self._remove(start, end)

    def prefetch(self, tokens: list[int], first_page: int, page_size: int) -> Future:
        """Read, in the background, the blobs that continue tokens' chain from page first_page."""
        n_pages = (len(tokens) - 1) // page_size
        hashes = chain_hashes(self.fingerprint, tokens[:n_pages * page_size], page_size)
        return self._reader.submit(self.read_chain, hashes, tokens, first_page, page_size)

    def read_chain(self, hashes: list[bytes], tokens: list[int], first_page: int, page_size: int) -> list[Blob]:
        """Blobs continuing the chain from page `first_page` of tokens, in order, each verified; stops at the
        first gap or bad blob. hashes = chain_hashes(...) of tokens.

        Each page is stored once, so where no blob runs along the chain from a page, the matching prefix of one
        that leaves it (a run another prompt branched off inside, or that this prompt ends inside) is used, cut
        where another blob or a state blob starts on the chain (a point the tree split at before) or, for a model
        without state, as far as it matches (`_read_prefix`). A blob's state is the one at its end, so a run that
        ends without one (a cut, or a run stored before its state existed) takes the state blob there, if any."""
        where = {h: i for i, h in enumerate(hashes)}
        out: list[Blob] = []
        page = first_page
        while page < len(hashes) - 1:
            with self._lock:
                ends = dict(self._index.get(hashes[page], {}))
            candidates = [(where[e], e, en) for e, en in ends.items() if e in where and where[e] > page]
            if candidates:
                end_page, end, entry = max(candidates, key=lambda c: c[0])
                try:
                    blob = self._read(hashes[page], end, entry, tokens[page * page_size:end_page * page_size])
                except Exception as e:            # noqa: BLE001 - whatever is wrong with a file, it is only a miss
                    self._bad(hashes[page], end, f"unreadable ({type(e).__name__})")
                    blob = None
                if blob is not None and blob.kv.shape[0] != end_page - page:
                    self._bad(hashes[page], end, "mismatched")
                    blob = None
                if blob is None:
                    continue                      # the bad blob is gone from the index: try another candidate
            else:
                parts = self._read_prefix(hashes, tokens, page, page_size, ends, where)
                if not parts:
                    break
                for blob in parts:
                    self._attach_state(blob)
                out += parts
                page += sum(blob.kv.shape[0] for blob in parts)
                continue
            if blob.conv is None:
                self._attach_state(blob)
            out.append(blob)
            page = end_page
        return out

    def _read_prefix(self, hashes: list[bytes], tokens: list[int], page: int, page_size: int,
                     ends: dict[bytes, _Entry], where: dict[bytes, int]) -> list[Blob]:
        """The matching prefix of a blob starting at hashes[page] that leaves the chain; only blobs whose first page
        is the chain's are read (looked up from the header, once per blob, the PROBE_LIMIT most recently used).
        Without needs_state, the whole match. needs_state (a hybrid model resumes only where a state exists):
        looked for only when the chain passes a point where another blob or a state blob starts (a branch point
        cached before: its state or its continuation starts there), nothing unless one lies within the match, and
        the match comes as two runs: up to the deepest such point, and the rest (KV without a state: the radix
        tree takes the branch point's state there, and knows those pages are stored)."""
        last = len(hashes) - 1
        with self._lock:
            cuts = [q for q in range(page + 1, last + 1) if hashes[q] in self._index]
        if self.needs_state and not cuts:
            return []
        start = hashes[page]
        off_chain = heapq.nlargest(PROBE_LIMIT, ((en.last_use, e, en) for e, en in ends.items() if e not in where),
                                   key=lambda c: c[0])
        for _, end, entry in off_chain:
            if self._next_hash(start, end, entry) != hashes[page + 1]:
                continue
            try:
                blob = self._read(start, end, entry, None)
            except Exception as e:                # noqa: BLE001 - whatever is wrong with a file, it is only a miss
                self._bad(start, end, f"unreadable ({type(e).__name__})")
                blob = None
            if blob is None:
                continue
            ps, k = page_size, 0
            most = min(blob.kv.shape[0], last - page)
            while k < most and blob.tokens[k * ps:(k + 1) * ps] == tokens[(page + k) * ps:(page + k + 1) * ps]:
                k += 1
            cut = max((q for q in cuts if q <= page + k), default=page) if self.needs_state else page + k
            if cut == page:
                continue
            bounds = [page, cut] + ([page + k] if page + k > cut else [])
            return [Blob(hashes[a], hashes[b], blob.tokens[(a - page) * ps:(b - page) * ps],
                         blob.kv[a - page:b - page], stored_run=(start, end)) for a, b in zip(bounds, bounds[1:])]
        return []

    def _next_hash(self, start: bytes, end: bytes, entry: _Entry) -> bytes | None:
        """The chain hash after a blob's first page, from its header and first page (read once, then kept)."""
        if entry.next_hash is None:
            try:
                with open(self.folder / entry.name, "rb") as f:
                    head = f.read(HEADER.size)
                    magic, version, fp, s, e, n_tok, n_pages, *_ = HEADER.unpack(head)
                    if magic != MAGIC or version != FORMAT_VERSION or fp != self.fingerprint or (s, e) != (start, end) \
                            or not n_pages or n_tok % n_pages:
                        return None                 # a full read would find it bad; this one only looks
                    first = f.read(4 * (n_tok // n_pages))
            except (OSError, struct.error):
                return None
            if len(first) != 4 * (n_tok // n_pages):
                return None
            entry.next_hash = hashlib.sha256(start + first).digest()
        return entry.next_hash

    def _attach_state(self, blob: Blob) -> None:
        """Give a run that ends without a state the state blob stored at its end, if there is one."""
        at = blob.end_hash
        with self._lock:
            entry = self._index.get(at, {}).get(at)
        if entry is None:
            return
        try:
            state = self._read(at, at, entry, [])
        except Exception as e:                    # noqa: BLE001 - whatever is wrong with a file, it is only a miss
            self._bad(at, at, f"unreadable ({type(e).__name__})")
            return
        if state is not None and state.conv is not None:
            blob.conv, blob.ssm, blob.stored_state = state.conv, state.ssm, (at, at)

    def _read(self, start: bytes, end: bytes, entry: _Entry, expect_tokens: list[int] | None) -> Blob | None:
        """Read and verify one blob (expect_tokens: its tokens, None: any)."""
        t0 = time.perf_counter()
        try:
            data = (self.folder / entry.name).read_bytes()
        except OSError:
            self._bad(start, end, "unreadable")
            return None
        if len(data) < HEADER.size:
            self._bad(start, end, "truncated")
            return None
        magic, version, fp, s, e, n_tok, n_pages, kv_len, conv_len, ssm_len, crc = HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER.size:]
        if magic != MAGIC or version != FORMAT_VERSION or fp != self.fingerprint or s != start or e != end:
            self._bad(start, end, "foreign")
            return None
        if len(payload) != 4 * n_tok + kv_len + conv_len + ssm_len:
            self._bad(start, end, "truncated")
            return None
        if zlib.crc32(payload) != crc:
            self._bad(start, end, "corrupt")
            return None
        tokens = list(struct.unpack_from(f"<{n_tok}i", payload))
        page_numel = _numel(self.page_shape)
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        conv_bytes = _numel(self.conv_shape) * torch.empty((), dtype=self.conv_dtype).element_size()
        ssm_bytes = _numel(self.ssm_shape) * 4
        if (expect_tokens is not None and tokens != expect_tokens) or kv_len != n_pages * page_numel * elem or \
                (conv_len, ssm_len) not in ((0, 0), (conv_bytes, ssm_bytes)):
            self._bad(start, end, "mismatched")
            return None
        off = 4 * n_tok

        def tensor(nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            if not nbytes:                  # a state blob's pages
                return torch.empty(shape, dtype=dtype)
            raw = torch.frombuffer(bytearray(payload[off:off + nbytes]), dtype=torch.uint8)
            return raw.view(dtype).reshape(shape)
        kv = tensor(kv_len, self.kv_dtype, (n_pages,) + self.page_shape)
        off += kv_len
        conv = ssm = None
        if conv_len:
            conv = tensor(conv_len, self.conv_dtype, self.conv_shape)
            off += conv_len
            ssm = tensor(ssm_len, torch.float32, self.ssm_shape)
        now = time.time()
        with self._lock:
            entry.last_use = now
            if (start, end) in self._lru:
                self._lru.move_to_end((start, end))
        try:
            os.utime(self.folder / entry.name, (now, now))
        except OSError:
            pass
        self.stats.bytes_out += len(data)
        self.stats.seconds += time.perf_counter() - t0
        return Blob(start, end, tokens, kv, conv, ssm, stored_run=(start, end),
                    stored_state=(start, end) if conv is not None else None)


# The one table of write policies (cache.host.write_policy, in config.py's order): at which event a device node is
# backed up to the host tier (and from there, or straight from the device without a host tier, to the file tier).
BACKUP_EVENT = dict(zip(WRITE_POLICIES, ("insert", "hit", "evict")))


class Tiers:
    """The tiers below the device and every copy between them and the device pools. All copies run on the engine
    thread between forwards, so nothing they read is freed or rewritten meanwhile; the file tier gets CPU copies
    that its writer thread owns."""

    def __init__(self, kv_pool: KVPool, state_pool: StatePool, host: HostTier | None, file: FileTier | None,
                 write_policy: str, copies: CopyStream | None = None) -> None:
        assert write_policy in BACKUP_EVENT, write_policy
        self.kv_pool, self.state_pool = kv_pool, state_pool
        self.copies = copies or CopyStream()
        self.host, self.file, self.write_policy = host, file, write_policy

    def backup_due(self, event: str, hits: int) -> bool:
        """Is a node backed up now? event: "insert" (cached), "hit" (matched again; hits counts its matches),
        "evict" (leaving the device)."""
        due = BACKUP_EVENT[self.write_policy]
        return event == due and (due != "hit" or hits >= 2)

    def write_file(self, start: bytes, end: bytes, tokens: list[int], pages: list[int] | None,
                   host_pages: list[int] | None, snapshot: int | None, host_snapshot: int | None) -> None:
        """Queue one node for the file tier, copied from the host tier where it has a copy, else the device."""
        if host_pages is not None:
            kv = self.host.read_pages(host_pages)
        else:
            kv = self.kv_pool.buffer[torch.tensor(pages, device=self.kv_pool.buffer.device)].to("cpu")
        conv = ssm = None
        if host_snapshot is not None:
            conv, ssm = self.host.read_snapshot(host_snapshot)
        elif snapshot is not None:
            conv = self.state_pool.conv[snapshot].to("cpu", copy=True)
            ssm = self.state_pool.ssm[snapshot].to("cpu", copy=True)
        self.file.write(Blob(start, end, list(tokens), kv, conv, ssm))

    def write_state(self, at: bytes, snapshot: int | None, host_snapshot: int | None) -> None:
        """Queue a state blob (no pages) for the file tier: the state at chain hash `at` (a node whose pages a
        longer stored run holds), copied from the host tier where it has a copy, else the device."""
        if host_snapshot is not None:
            conv, ssm = self.host.read_snapshot(host_snapshot)
        else:
            conv = self.state_pool.conv[snapshot].to("cpu", copy=True)
            ssm = self.state_pool.ssm[snapshot].to("cpu", copy=True)
        buf = self.kv_pool.buffer
        self.file.write(Blob(at, at, [], torch.empty((0,) + tuple(buf.shape[1:]), dtype=buf.dtype), conv, ssm))

    def load_blob(self, blob: Blob, pages: list[int], snapshot: int | None) -> None:
        """Copy a blob read from the file tier into device pages (and its state into a snapshot slot), on the
        copy stream through pinned staging (after any save still reading a slot handed over; the next forward waits
        for it)."""
        buf = self.kv_pool.buffer
        assert blob.kv.shape[0] == len(pages) and blob.kv.shape[1:] == buf.shape[1:], "blob and pages disagree"
        with self.copies.loading():
            self.copies.upload_rows(buf, pages, blob.kv)
            if snapshot is not None:
                self.copies.upload(self.state_pool.conv[snapshot], blob.conv)
                self.copies.upload(self.state_pool.ssm[snapshot], blob.ssm)
