"""File tier (L3) behind the radix tree: a persistent folder of blobs (blob.py), state snapshots included.

Blobs are written to a temporary name and renamed, by one background writer thread; the folder is indexed from its
listing at start (temporary files of a killed writer are deleted), the blobs' sizes and ages read in the background,
and the least recently used go beyond `cache.file.size_gb`; a truncated, corrupt or foreign blob is a miss: counted,
logged once, deleted. Several servers may share one folder (file_index.py: what each one's index learns, and how
the folder as a whole keeps its size); a blob another server deleted under a reader is a miss too, not an error.

On a network share a read can fail with the blob sound (NFS: ESTALE when another box replaced or deleted it, EIO or a
timeout on a soft mount): such a read is a miss that leaves the file alone (an ESTALE is read once more through its
name first); only content that fails its checks proves a blob bad. A write that fails skips that blob; a full disk
(ENOSPC, EDQUOT, EFBIG) first evicts what the write needs and tries once more; otherwise writes pause (1 s, doubling
to a minute; a folder gone or read-only: a minute) and resume by themselves.

A page is stored once: when a cached run is split (a prompt branched off inside it), both halves keep the blob that
holds them, and a later read uses the matching prefix of a blob that leaves the prompt's path (`read_chain`). A
blob holds a state snapshot at its end only, so the state at such a cut (a branch point) is a state blob of its
own.

The engine thread hands the writer CPU copies (`save_run`, `save_state`: from the host tier's copy where there is
one, else from the device) and uploads what the reader thread read into device pages and a snapshot slot (`load`,
on the copy stream). The tiers' policy over the radix tree (tiers.py) decides what is written and when.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import heapq
import logging
import math
import os
import struct
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinyserve.blob import FORMAT_VERSION, HEADER, MAGIC, Blob, blob_name, chain_hashes, encode
from tinyserve.copies import CopyStream
from tinyserve.file_index import IO_RETRY_S, RESCAN_S, Entry, FolderIndex, tmp_name, unlink
from tinyserve.host_tier import HostTier
from tinyserve.pools import KVPool, StatePool
from tinyserve.plan import GIB

log = logging.getLogger("tinyserve.tiers")

PROBE_LIMIT = 256          # blobs whose first page one read_chain call looks up (for a prefix)
WRITE_RETRY_S = 1.0        # writes pause this long after a failed one, doubling with each failure in a row ...
WRITE_RETRY_MAX_S = 60.0   # ... up to this; a folder that is gone, not a folder or read-only: this at once
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
NOT_WRITABLE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EROFS, errno.EACCES, errno.EPERM})


@dataclass
class FileStats:
    """The file tier's counters and occupancy, as /metrics shows them."""
    hit_tokens: int = 0          # prompt tokens loaded from blobs
    bytes_in: int = 0            # blob bytes written
    bytes_out: int = 0           # blob bytes read
    seconds: float = 0.0         # time spent reading and writing
    errors: int = 0              # corrupt, truncated or foreign blobs (each deleted)
    read_failures: int = 0       # reads that failed with an I/O error (a miss; the file left as it is)
    write_failures: int = 0      # writes that failed (the blob skipped; a full disk, an I/O error, the folder gone)
    used: int = 0                # bytes held
    capacity: int = 0            # bytes it may hold (cache.file.size_gb)
    blobs: int = 0
    writable: bool = True        # False while writes are paused after a failed one (serving goes on)


@dataclass
class FileTier:
    """The folder, its index, the writer and reader threads, and the copies between blobs and the device pools."""
    folder: Path
    size_bytes: int
    fingerprint: bytes
    page_shape: tuple[int, ...]
    kv_dtype: torch.dtype
    conv_shape: tuple[int, ...]
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, ...]
    stats: FileStats = field(default_factory=FileStats)
    needs_state: bool = False    # a hybrid model's runs: usable only up to a state snapshot
    probe_every: int = 0         # pages between the points where the tree cuts runs (cache.state_track_interval)
    # the device side: the pools blobs are saved from and loaded into, the stream loads run on, and the host tier
    # whose copies are read in the device's place (no pools: a tier that only stores and reads blobs)
    kv_pool: KVPool | None = field(default=None, repr=False)
    state_pool: StatePool | None = field(default=None, repr=False)
    copies: CopyStream = field(default_factory=CopyStream, repr=False)
    host: HostTier | None = field(default=None, repr=False)

    @classmethod
    def for_pools(cls, folder: Path, size_bytes: int, fingerprint: bytes, kv_pool: KVPool, state_pool: StatePool,
                  copies: CopyStream | None = None, host: HostTier | None = None,
                  needs_state: bool = False, probe_every: int = 0) -> FileTier:
        """A file tier whose blobs hold these pools' pages and snapshots."""
        buf, conv, ssm = kv_pool.buffer, state_pool.conv, state_pool.ssm
        return cls(folder, size_bytes, fingerprint, tuple(buf.shape[1:]), buf.dtype, tuple(conv.shape[1:]),
                   conv.dtype, tuple(ssm.shape[1:]), needs_state=needs_state, probe_every=probe_every, kv_pool=kv_pool,
                   state_pool=state_pool, copies=copies or CopyStream(), host=host)

    def __post_init__(self) -> None:
        self.index = FolderIndex(self.folder, self.size_bytes)
        self._warned: set[str] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-file-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-file-read")
        self._pending: list[Future] = []
        self._queued: set[tuple[bytes, bytes]] = set()          # blobs queued for writing, not yet in the index
        self._settle: threading.Timer | None = None             # a listing due after the last write (shared folder)
        self._resume_at = 0.0                                   # time.monotonic() when paused writes resume
        self._failures = 0                                      # writes failed in a row
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / tmp_name()
            probe.write_bytes(b"")
            try:
                self.index.saw_mtime(probe.stat().st_mtime)     # the folder's clock, for the age of others' files
            finally:
                probe.unlink(missing_ok=True)
        except OSError as e:
            self._pause(f"cache.file.dir {self.folder}", e)
        found = self.index.scan()
        log.info("file tier %s: %d blobs indexed", self.folder, self.num_blobs)
        if found:               # sizes and ages by the writer thread, before its first write
            self._pending.append(self._writer.submit(self._stat_found, found))

    def _stat_found(self, found: list[tuple[bytes, bytes]]) -> None:
        self.index.stat_found(found)
        log.info("file tier %s: %d blobs, %.2f GiB", self.folder, self.num_blobs, self.used_bytes / GIB)

    @property
    def num_blobs(self) -> int:
        return self.index.count

    @property
    def writable(self) -> bool:
        """Are writes on (not paused after a failed one)?"""
        return time.monotonic() >= self._resume_at

    def report(self) -> FileStats:
        return dataclasses.replace(self.stats, used=self.used_bytes, capacity=self.size_bytes, blobs=self.num_blobs,
                                   writable=self.writable)

    @property
    def used_bytes(self) -> int:
        return self.index.total

    def has(self, start: bytes, end: bytes) -> bool:
        """Is this blob stored, or queued for writing?"""
        with self.index.lock:
            return self.index.get(start, end) is not None or (start, end) in self._queued

    # ---- writing (background thread) ----
    def _pause(self, what: str, e: OSError) -> None:
        """A write failed: skip it, and pause writes for a while (they resume by themselves)."""
        self._failures += 1
        self.stats.write_failures += 1
        wait = WRITE_RETRY_MAX_S if e.errno in NOT_WRITABLE else \
            min(WRITE_RETRY_MAX_S, WRITE_RETRY_S * 2 ** (self._failures - 1))
        self._resume_at = time.monotonic() + wait
        if self._failures == 1:
            log.warning("file tier: writing %s failed (%s): file-tier writes paused, tried again after %.0f s, then "
                        "less often while they fail (serving goes on)", what, e, wait)

    def _wrote(self) -> None:
        if self._failures:
            log.info("file tier: writes resumed after %d failed tries", self._failures)
        self._failures = 0

    def write(self, blob: Blob) -> None:
        """Queue a blob for writing (tensors must be CPU copies the caller no longer changes)."""
        key = (blob.start_hash, blob.end_hash)
        with self.index.lock:
            if not self.writable or self.index.get(*key) is not None or key in self._queued:
                return
            self._queued.add(key)
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._writer.submit(self._write_now, blob))

    def _write_now(self, blob: Blob) -> None:
        try:
            self._write_blob(blob)
        finally:
            with self.index.lock:
                self._queued.discard((blob.start_hash, blob.end_hash))

    def _write_blob(self, blob: Blob) -> None:
        t0 = time.perf_counter()
        parts = encode(blob, self.fingerprint)
        size = sum(p.nbytes for p in parts)
        if size > self.size_bytes:
            self._warn_once("size", f"a cached run of {size} bytes exceeds cache.file.size_gb; not written")
            return
        name = blob_name(blob.start_hash, blob.end_hash)
        try:
            try:
                mtime = self._write_file(name, parts)
            except OSError as e:
                if e.errno not in NO_SPACE:
                    raise
                with self.index.lock:           # a full disk: make the room this blob needs, and try once more
                    freed = self.index.make_room(size)
                if not freed:
                    raise
                mtime = self._write_file(name, parts)
        except FileNotFoundError as e:
            if not self.folder.is_dir():
                self._pause(str(self.folder / name), e)
            else:                 # our temporary file went away (a server that took it for a dead writer's): retry later
                self._warn_once("tmp gone", f"file tier: writing {name} failed ({e}); the run is written again "
                                "when it is cached again")
            return
        except OSError as e:
            self._pause(str(self.folder / name), e)
            return
        self._wrote()
        n_pages = blob.kv.shape[0]
        first = struct.pack(f"<{len(blob.tokens) // n_pages}i", *blob.tokens[:len(blob.tokens) // n_pages]) \
            if n_pages else None
        with self.index.lock:
            self._add(blob.start_hash, blob.end_hash, Entry(name, size, mtime, first and hashlib.sha256(
                blob.start_hash + first).digest(), known_at=time.monotonic()))
            self.stats.bytes_in += size
            self.stats.seconds += time.perf_counter() - t0
        self._keep_size()

    def _write_file(self, name: str, parts: list[memoryview]) -> float:
        """Write a blob under a temporary name of ours and rename it into place (another server's copy of the same
        run is replaced whole); the mtime it got, the folder's clock. The temporary file goes when anything fails
        (on NFS a full disk may show only at close)."""
        tmp = self.folder / tmp_name()
        # the folder's mtime changes twice here, each change ours; what another server renames in while we write
        # changes it too, so each of ours is told apart around its own call (own_change), never around the write
        before = self.index.folder_mtime()
        try:
            with open(tmp, "wb") as f:
                self.index.own_change(before)
                for part in parts:
                    f.write(part)
            before = self.index.folder_mtime()
            os.replace(tmp, self.folder / name)
        except BaseException:
            unlink(tmp)           # raises nothing, also when the folder itself is gone or is not a folder
            raise
        self.index.own_change(before)
        try:
            mtime = os.stat(self.folder / name).st_mtime
            self.index.saw_mtime(mtime)
        except OSError:
            mtime = self.index.folder_now()
        return mtime

    def _add(self, start: bytes, end: bytes, entry: Entry) -> None:
        """Index a blob this server wrote (under the index lock)."""
        self.index.add(start, end, entry)

    def _keep_size(self) -> None:
        """After a write: evict down to the folder's size, counting what other servers on it wrote (a listing, at
        most every RESCAN_S; when the last was too recent, one more RESCAN_S after it, so the folder is within its
        size a moment after the last write of any server on it)."""
        if not self.index.refresh() and self._settle is None:
            def settle() -> None:
                self._settle = None
                try:
                    self._writer.submit(self._keep_size)
                except RuntimeError:                # closed meanwhile
                    pass
            self._settle = threading.Timer(RESCAN_S, settle)
            self._settle.daemon = True
            self._settle.start()
        with self.index.lock:
            self.index.evict_to_limit()

    def flush(self, timeout: float) -> bool:
        """Wait (bounded) for queued writes; True when all of them completed."""
        deadline = time.monotonic() + timeout
        with self.index.lock:
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
        if self._settle is not None:
            self._settle.cancel()
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)

    def clear(self) -> None:
        self.flush(30.0)
        self.index.clear()

    # ---- the device side (engine thread: nothing it reads is freed or rewritten meanwhile) ----
    def save_run(self, start: bytes, end: bytes, tokens: list[int], pages: list[int], snapshot: int | None,
                 host_pages: list[int] | None = None, host_snapshot: int | None = None) -> None:
        """Queue a run of pages and the state at its end (if any) for writing, copied from the host tier where it
        has a copy, else from the device; the writer thread owns the copies."""
        if host_pages is not None:
            kv = self.host.read_pages(host_pages)
        else:
            kv = self.kv_pool.buffer[torch.tensor(pages, device=self.kv_pool.buffer.device)].to("cpu")
        self.write(Blob(start, end, list(tokens), kv, *self._state(snapshot, host_snapshot)))

    def save_state(self, at: bytes, snapshot: int | None, host_snapshot: int | None) -> None:
        """Queue a state blob (no pages): the state at chain hash `at`, a point inside a longer stored run."""
        empty = torch.empty((0,) + self.page_shape, dtype=self.kv_dtype)
        self.write(Blob(at, at, [], empty, *self._state(snapshot, host_snapshot)))

    def _state(self, snapshot: int | None, host_snapshot: int | None) -> tuple[torch.Tensor | None, ...]:
        """CPU copies (conv, ssm) of a snapshot, from the host tier where it has a copy; (None, None) for none."""
        if host_snapshot is not None:
            return self.host.read_snapshot(host_snapshot)
        if snapshot is None:
            return None, None
        return (self.state_pool.conv[snapshot].to("cpu", copy=True),
                self.state_pool.ssm[snapshot].to("cpu", copy=True))

    def load(self, blob: Blob, pages: list[int], snapshot: int | None) -> None:
        """Copy a blob read back into device pages (and its state into a snapshot slot), on the copy stream through
        pinned staging (after any save still reading a slot handed over; the next forward waits for it)."""
        buf = self.kv_pool.buffer
        assert blob.kv.shape[0] == len(pages) and blob.kv.shape[1:] == buf.shape[1:], "blob and pages disagree"
        with self.copies.loading():
            self.copies.upload_rows(buf, pages, blob.kv)
            if snapshot is not None:
                self.copies.upload(self.state_pool.conv[snapshot], blob.conv)
                self.copies.upload(self.state_pool.ssm[snapshot], blob.ssm)

    # ---- reading ----
    def _warn_once(self, kind: str, msg: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", msg)

    def _bad(self, start: bytes, end: bytes, why: str, seen: tuple[int, int, int] | None) -> None:
        """The blob's content failed its checks (seen: the file read, by inode, size and mtime): a miss, and the file
        goes, unless another server renamed a new copy into its place since (seen None: whatever is there)."""
        self.stats.errors += 1
        self._warn_once(why, f"file tier: {why} blob {start.hex()[:12]}-{end.hex()[:12]}: treated as a miss "
                        "and deleted (further ones are counted, not logged)")
        with self.index.lock:
            self.index.remove(start, end, only_if=seen)

    def _failed(self, start: bytes, end: bytes, e: Exception) -> None:
        """Reading a blob failed, not its checks (an I/O error, a timeout, a file handle gone stale): a miss; the
        file stays, and this server reads it again after IO_RETRY_S."""
        self.stats.read_failures += 1
        why = errno.errorcode.get(getattr(e, "errno", None) or 0, type(e).__name__)
        self._warn_once(f"read {why}", f"file tier: reading blob {start.hex()[:12]}-{end.hex()[:12]} failed ({e}): "
                        f"a miss, the file left as it is and read again after {IO_RETRY_S:.0f} s (further {why} "
                        "failures are counted, not logged)")
        with self.index.lock:
            entry = self.index.get(start, end)
            if entry is not None:
                entry.retry_at = time.monotonic() + IO_RETRY_S

    def _readable(self, entry: Entry, now: float) -> bool:
        return entry.retry_at <= now

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
        page, learned = first_page, -1
        while page < len(hashes) - 1:
            now = time.monotonic()
            with self.index.lock:
                ends = {e: en for e, en in self.index.by_start.get(hashes[page], {}).items() if self._readable(en, now)}
            candidates = [(where[e], e, en) for e, en in ends.items() if e in where and where[e] > page]
            if candidates:
                end_page, end, entry = max(candidates, key=lambda c: c[0])
                try:
                    blob = self._read(hashes[page], end, entry, tokens[page * page_size:end_page * page_size],
                                      end_page - page)
                except Exception as e:            # noqa: BLE001 - whatever goes wrong reading a file, it is only a miss
                    self._failed(hashes[page], end, e)
                    blob = None
                if blob is None:
                    continue                      # gone from the index, or not read again for now: the next candidate
            else:
                parts = self._read_prefix(hashes, tokens, page, page_size, ends, where)
                if not parts:
                    if learned < page and self._learn(hashes, page):
                        learned = page            # another server wrote what continues here: look once more
                        continue
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

    def _learn(self, hashes: list[bytes], page: int) -> bool:
        """A miss at hashes[page]: did another server on the folder write what continues there? A new listing when
        the last is RESCAN_S old, else a look for the exact names of the runs a server with our settings cuts this
        prompt into (its state-track points and its end). True when the index learned of any blob."""
        before = self.index.count
        if self.index.refresh():
            return self.index.count != before
        every = self.probe_every
        ends = [hashes[q] for q in range(page + 1, len(hashes)) if (every and q % every == 0) or q == len(hashes) - 1]
        return self.index.probe(hashes[page], ends)

    def _read_prefix(self, hashes: list[bytes], tokens: list[int], page: int, page_size: int,
                     ends: dict[bytes, Entry], where: dict[bytes, int]) -> list[Blob]:
        """The matching prefix of a blob starting at hashes[page] that leaves the chain; only blobs whose first page
        is the chain's are read (looked up from the header, once per blob, the PROBE_LIMIT most recently used).
        Without needs_state, the whole match. needs_state (a hybrid model resumes only where a state exists):
        looked for only when the chain passes a point where another blob or a state blob starts (a branch point
        cached before: its state or its continuation starts there), nothing unless one lies within the match, and
        the match comes as two runs: up to the deepest such point, and the rest (KV without a state: the radix
        tree takes the branch point's state there, and knows those pages are stored)."""
        last = len(hashes) - 1
        with self.index.lock:
            cuts = [q for q in range(page + 1, last + 1) if hashes[q] in self.index.by_start]
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
            except Exception as e:                # noqa: BLE001 - whatever goes wrong reading a file, it is only a miss
                self._failed(start, end, e)
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

    def _next_hash(self, start: bytes, end: bytes, entry: Entry) -> bytes | None:
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
        with self.index.lock:
            entry = self.index.get(at, at)
        if entry is None or not self._readable(entry, time.monotonic()):
            return
        try:
            state = self._read(at, at, entry, [])
        except Exception as e:                    # noqa: BLE001 - whatever goes wrong reading a file, it is only a miss
            self._failed(at, at, e)
            return
        if state is not None and state.conv is not None:
            blob.conv, blob.ssm, blob.stored_state = state.conv, state.ssm, (at, at)

    @staticmethod
    def _read_file(path: Path) -> tuple[bytes, tuple[int, int, int]]:
        """A file's bytes and which file they are (inode, size, mtime_ns). An ESTALE (NFS: another server replaced
        or deleted the file we had a handle to) is tried once more through the name. Bytes fewer than the file's
        size (it changed while read) are an OSError, not a truncated blob."""
        for retry in (False, True):
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    data = f.read()
                break
            except OSError as e:
                if e.errno != errno.ESTALE or retry:
                    raise
        if len(data) != st.st_size:
            raise OSError(errno.EIO, f"read {len(data)} of {st.st_size} bytes", str(path))
        return data, (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self, start: bytes, end: bytes, entry: Entry, expect_tokens: list[int] | None,
              expect_pages: int | None = None) -> Blob | None:
        """Read and verify one blob (expect_tokens: its tokens, None: any; expect_pages: its pages). A file gone is
        a plain miss, a read that fails raises (the caller's miss, the file left alone), and content that fails its
        checks is a miss that deletes it."""
        t0 = time.perf_counter()
        path = self.folder / entry.name
        try:
            data, seen = self._read_file(path)
        except FileNotFoundError:                 # another server on the folder evicted it: a plain miss
            with self.index.lock:
                self.index.forget(start, end)
            return None
        except IsADirectoryError:                 # a folder under a blob's name holds no blob
            self._bad(start, end, "not a file", None)
            return None
        if len(data) < HEADER.size:
            self._bad(start, end, "truncated", seen)
            return None
        magic, version, fp, s, e, n_tok, n_pages, kv_len, conv_len, ssm_len, crc = HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER.size:]
        if magic != MAGIC or version != FORMAT_VERSION or fp != self.fingerprint or s != start or e != end:
            self._bad(start, end, "foreign", seen)
            return None
        if len(payload) != 4 * n_tok + kv_len + conv_len + ssm_len:
            self._bad(start, end, "truncated", seen)
            return None
        if zlib.crc32(payload) != crc:
            self._bad(start, end, "corrupt", seen)
            return None
        tokens = list(struct.unpack_from(f"<{n_tok}i", payload))
        page_numel = math.prod(self.page_shape)
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        conv_bytes = math.prod(self.conv_shape) * torch.empty((), dtype=self.conv_dtype).element_size()
        ssm_bytes = math.prod(self.ssm_shape) * 4
        if (expect_tokens is not None and tokens != expect_tokens) or kv_len != n_pages * page_numel * elem or \
                (conv_len, ssm_len) not in ((0, 0), (conv_bytes, ssm_bytes)) or \
                (expect_pages is not None and n_pages != expect_pages):
            self._bad(start, end, "mismatched", seen)
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
        try:                                # a use, stamped with the folder's clock (NFS: the server's), not ours
            os.utime(path)
            mtime = os.stat(path).st_mtime
            self.index.saw_mtime(mtime)
        except OSError:
            mtime = self.index.folder_now()
        with self.index.lock:
            self.index.touch(start, end, entry, mtime)
        self.stats.bytes_out += len(data)
        self.stats.seconds += time.perf_counter() - t0
        return Blob(start, end, tokens, kv, conv, ssm, stored_run=(start, end),
                    stored_state=(start, end) if conv is not None else None)
