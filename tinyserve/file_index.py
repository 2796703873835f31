"""The index of a file-tier folder: its blobs by chain hashes, least recently used first, with their sizes.

One folder may serve several servers at once (two cards in one box, or boxes on a network share), all with the
same model fingerprint. Nothing but the folder is shared, so each server keeps its own index and the folder stays
the truth:
- a blob is complete or absent: written under a temporary name of its writer's own (`tmp_name`) and renamed into
  place, so two servers writing the same run at once each rename a whole blob over the other's;
- an index learns of blobs the others wrote by listing the folder again (`refresh`, at most every RESCAN_S) and,
  on a miss in between, by looking for the exact names a prompt's runs would have (`probe`);
- `size_bytes` is the folder's, not one writer's: a refresh counts every blob in it, and each writer evicts least
  recently used first by the files' own mtimes (a read touches its blob's mtime), looking again before it deletes
  (`evict_to_limit`): a blob another server used meanwhile goes to the back of the line, one already gone is only
  forgotten;
- so every writer evicts in one order, the folder's, and two that evict at once pick the same victims (the second
  finds them gone and only forgets them) rather than each deleting as much again: times are the folder's clock
  (the file server's on NFS), never compared with this box's. A read touches its blob with the server's time
  (`os.utime(path)`, no times given), a write and a touch record the mtime the file got, an mtime in the future
  (a box whose clock ran ahead stamped it) counts as now, and "used since" is a changed mtime. Blobs others
  deleted leave the count at the next listing whatever their mtimes (`Entry.known_at`, this process's monotonic
  clock), so bytes that are gone never drive a delete;
- a blob that went away under a reader is a miss (file_tier.py); a read that fails with an I/O error is a miss
  that leaves the file alone (`Entry.retry_at`); only a blob whose content fails its checks is deleted, and only
  when the file under its name is still the one read (`remove(..., only_if=...)`).
"""
from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import stat
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from tinyserve.blob import STATE_SUFFIX, SUFFIX, blob_name

log = logging.getLogger("tinyserve.tiers")

RESCAN_S = 1.0             # the least time between two listings of the folder (a miss or a write asks for one)
STAT_BATCH = 2000          # blobs updated per hold of the lock by a stat job
STALE_TMP_S = 3600.0       # another host's temporary file this old (the folder's clock) is left by a writer that died
IO_RETRY_S = 30.0          # a blob whose read failed with an I/O error is not read again for this long (a soft mount's
                           # timeout costs every request that tries it)
_HOST = socket.gethostname()
_NAME_LEN = 2 * 64 + 1 + len(SUFFIX)
_STATE_LEN = 64 + len(STATE_SUFFIX)

Key = tuple[bytes, bytes]  # (start hash, end hash) of a blob


@dataclass(slots=True)
class Entry:
    name: str                   # file name in the folder (a Path per blob would cost more than the listing)
    size: int = -1              # bytes; -1 until stat'ed (blobs found by a listing are stat'ed in the background)
    last_use: float = 0.0       # the file's mtime when last seen (the folder's clock): our write or read, or another's
    next_hash: bytes | None = None   # chain hash after the blob's first page (None: not looked up yet)
    known_at: float = 0.0       # time.monotonic() when this process last wrote, read or found it on disk
    retry_at: float = 0.0       # time.monotonic() before which a read that failed with an I/O error is not retried


def parse_name(name: str) -> Key | None:
    """A blob's (start, end) hashes from its file name; None for any other file."""
    try:
        if len(name) == _NAME_LEN and name[64] == "-" and name.endswith(SUFFIX):
            return bytes.fromhex(name[:64]), bytes.fromhex(name[65:129])
        if len(name) == _STATE_LEN and name.endswith(STATE_SUFFIX):
            at = bytes.fromhex(name[:64])
            return at, at
    except ValueError:
        pass
    return None


def tmp_name() -> str:
    """A temporary file name no other writer uses: `.tmp-<uuid>-<pid>-<host>` (who wrote it, for `stale_tmp`)."""
    return f".tmp-{uuid.uuid4().hex}-{os.getpid()}-{_HOST}"


def stale_tmp(folder: Path, name: str, now: float) -> bool:
    """Is this temporary file left by a writer that died? Ours (this host): its process is gone. Another host's: its
    mtime is more than STALE_TMP_S before `now`, the folder's time (not this box's clock: boxes' clocks may be hours
    apart, and a writer alive on a box behind ours would lose its file). A name without a writer (an older
    tinyserve's): yes."""
    parts = name[5:].split("-", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return True
    pid, host = int(parts[1]), parts[2]
    if host == _HOST:
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:                 # alive, someone else's
            return False
    try:
        return now - os.stat(folder / name).st_mtime > STALE_TMP_S
    except OSError:
        return False


class FolderIndex:
    """Blobs by start hash, then end hash; an LRU order over them; the bytes they hold. Every method takes `lock`
    itself except those named as called under it (the caller holds it)."""

    def __init__(self, folder: Path, size_bytes: int) -> None:
        self.folder, self.size_bytes = folder, size_bytes
        self.lock = threading.Lock()
        self.by_start: dict[bytes, dict[bytes, Entry]] = {}
        self.lru: OrderedDict[Key, None] = OrderedDict()      # least recently used first
        self.count = 0
        self.total = 0                                        # bytes of the blobs whose size is known
        self.listed_at = 0.0                                  # time.monotonic() of the last listing
        self.seen_mtime: int | None = None                    # the folder's mtime after the last change we know of
        self._listing = threading.Lock()                      # one listing at a time
        self.undeletable: set[str] = set()                    # bad blobs we could not delete: never indexed again
        self.clock_offset = 0.0                               # the folder's clock minus ours (time.time())

    # ---- the folder's clock ----
    def saw_mtime(self, mtime: float) -> None:
        """A file we just wrote or touched has this mtime: the folder's clock (the file server's on NFS) now."""
        self.clock_offset = mtime - time.time()

    def folder_now(self) -> float:
        """The folder's time now, as the files we wrote last told it."""
        return time.time() + self.clock_offset

    def _age_key(self, mtime: float, now: float) -> float:
        """Where an mtime sorts in the LRU order: one in the future (stamped by a box whose clock ran ahead) is now."""
        return min(mtime, now)

    # ---- listing ----
    def folder_mtime(self) -> int | None:
        try:
            return os.stat(self.folder).st_mtime_ns
        except OSError:
            return None

    def own_change(self, before: int | None) -> None:
        """After we added or deleted a blob (before: the folder's mtime just before we did): the folder's mtime now is
        one we know the cause of (a listing is needed only when it changes again: another server wrote or deleted),
        unless it had changed already since we last knew it: then what another server did is still to be listed.
        Call it around one file system call: another server's change between `before` and the stat here passes for
        ours (a window of microseconds; a probe for the exact names still finds its blobs)."""
        if before == self.seen_mtime:
            self.seen_mtime = self.folder_mtime()

    def _list(self) -> tuple[float, list[tuple[Key, str]]] | None:
        """(time.monotonic() before the listing, [(key, name)] of every blob in the folder); stale temporary files
        are deleted on the way. None when the folder cannot be listed."""
        started = self.listed_at = time.monotonic()
        self.seen_mtime = self.folder_mtime()
        try:
            names = os.listdir(self.folder)
        except OSError:
            return None
        found: list[tuple[Key, str]] = []
        now = self.folder_now()
        for name in names:
            key = parse_name(name)
            if key is not None:
                found.append((key, name))
            elif name.startswith(".tmp-") and stale_tmp(self.folder, name, now):
                unlink(self.folder / name)
        return started, found

    def scan(self) -> list[Key]:
        """At start: index the folder from its names alone (one listing, no per-file stat or open), so a restart with
        100,000 blobs serves hits at once; returns them for `stat_found`, which reads their sizes and ages."""
        listing = self._list()
        if listing is None:
            return []
        collecting = gc.isenabled()
        gc.disable()            # 100,000 new objects would run the collector over them again and again (~40% here)
        try:
            with self.lock:
                for (start, end), name in listing[1]:
                    ends = self.by_start.get(start)
                    if ends is None:
                        self.by_start[start] = {end: Entry(name)}
                    elif end not in ends:
                        ends[end] = Entry(name)
                    else:
                        continue
                    self.lru[(start, end)] = None
                    self.count += 1
        finally:
            if collecting:
                gc.enable()
        return [key for key, _ in listing[1]]

    def stat_found(self, found: list[Key]) -> None:
        """Sizes and ages of blobs indexed by a listing, LRU order by age (blobs read or rewritten since stay the most
        recent), then evict down to size_bytes. The lock is taken in short batches, so the engine thread's lookups
        never wait long. A blob that went away meanwhile leaves the index."""
        stats: list[tuple[float, int, bytes, bytes]] = []
        gone: list[Key] = []
        try:
            fd = os.open(self.folder, os.O_RDONLY)
        except OSError:                                  # the folder gone or unreadable now: sizes stay unknown
            return
        try:
            for start, end in found:
                try:
                    st = os.stat(blob_name(start, end), dir_fd=fd)
                    stats.append((st.st_mtime, st.st_size, start, end))
                except OSError:
                    gone.append((start, end))
        finally:
            os.close(fd)
        now = self.folder_now()
        stats.sort(key=lambda t: self._age_key(t[0], now), reverse=True)   # newest first: each goes to the front,
        for i in range(0, len(stats), STAT_BATCH):                          # the oldest ends first
            with self.lock:
                for mtime, size, start, end in stats[i:i + STAT_BATCH]:
                    entry = self.by_start.get(start, {}).get(end)
                    if entry is None or entry.size >= 0:         # removed, or rewritten since the listing
                        continue
                    entry.size = size
                    self.total += size
                    if entry.last_use == 0.0:                     # not read since the listing
                        entry.last_use = mtime
                        self.lru.move_to_end((start, end), last=False)
        with self.lock:
            for start, end in gone:
                entry = self.by_start.get(start, {}).get(end)
                if entry is not None and entry.size < 0:
                    self.forget(start, end)
        self.evict_in_batches()

    def refresh(self, force: bool = False) -> bool:
        """List the folder again (unless the last listing is younger than RESCAN_S, or the folder's mtime says that
        nobody changed it since): blobs other servers wrote join the index (stat'ed here: few are new), blobs they
        deleted leave it. True when it listed."""
        if not force and time.monotonic() - self.listed_at < RESCAN_S:
            return False
        if not force and self.seen_mtime is not None and self.folder_mtime() == self.seen_mtime:
            self.listed_at = time.monotonic()          # a server alone on its folder never lists it again
            return False
        if not self._listing.acquire(blocking=False):
            return False
        try:
            listing = self._list()
            if listing is None:
                return False
            started, found = listing
            present = {key for key, _ in found}
            with self.lock:
                new = [(key, name) for key, name in found if key[1] not in self.by_start.get(key[0], {})]
                vanished = [key for key in self.lru if key not in present]
            self._add_found(new)
            with self.lock:
                for start, end in vanished:      # not one we wrote or read after the listing began (our clock only:
                    entry = self.by_start.get(start, {}).get(end)   # an mtime a skewed box stamped says nothing here)
                    if entry is not None and entry.known_at < started:
                        self.forget(start, end)
            return True
        finally:
            self._listing.release()

    def probe(self, start: bytes, ends: list[bytes]) -> bool:
        """Look on disk for the exact blobs start -> each of `ends` (not in the index: another server wrote them
        since the last listing); index those found. True if any was."""
        found = []
        with self.lock:
            known = self.by_start.get(start, {})
            ends = [e for e in ends if e not in known]
        for end in ends:
            name = blob_name(start, end)
            if os.path.exists(self.folder / name):
                found.append(((start, end), name))
        self._add_found(found)
        return bool(found)

    def _add_found(self, found: list[tuple[Key, str]]) -> None:
        """Index blobs another server wrote, with their sizes and ages (a file gone before its stat is skipped)."""
        stats = []
        for key, name in found:
            try:
                st = os.stat(self.folder / name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and name not in self.undeletable:
                stats.append((key, Entry(name, st.st_size, st.st_mtime, known_at=time.monotonic())))
        with self.lock:
            for (start, end), entry in stats:
                if end not in self.by_start.get(start, {}):
                    self.add(start, end, entry)
                    self._by_age(start, end, entry.last_use)

    def _by_age(self, start: bytes, end: bytes, last_use: float) -> None:
        """Under lock: move a blob just added at the back of the LRU order in front of those used after it (few:
        the blobs written or read since), so that every server on the folder evicts in the same order."""
        newer = []
        now = self.folder_now()
        last_use = self._age_key(last_use, now)
        for k in reversed(self.lru):
            if k == (start, end):
                continue
            entry = self.by_start[k[0]][k[1]]
            if self._age_key(entry.last_use, now) <= last_use:
                break
            newer.append(k)
        for k in reversed(newer):
            self.lru.move_to_end(k)

    # ---- entries (called under lock) ----
    def get(self, start: bytes, end: bytes) -> Entry | None:
        return self.by_start.get(start, {}).get(end)

    def add(self, start: bytes, end: bytes, entry: Entry) -> None:
        old = self.by_start.setdefault(start, {}).get(end)
        if old is not None:
            self.total -= max(0, old.size)
        else:
            self.count += 1
        self.by_start[start][end] = entry
        self.lru[(start, end)] = None
        self.lru.move_to_end((start, end))
        self.total += max(0, entry.size)

    def forget(self, start: bytes, end: bytes) -> Entry | None:
        entry = self.by_start.get(start, {}).pop(end, None)
        if entry is None:
            return None
        if not self.by_start[start]:
            del self.by_start[start]
        del self.lru[(start, end)]
        self.count -= 1
        self.total -= max(0, entry.size)
        return entry

    def remove(self, start: bytes, end: bytes, only_if: tuple[int, int, int] | None = None) -> None:
        """Forget a blob and delete its file. only_if (inode, size, mtime_ns of the file a reader found bad): delete
        only that file, not one another server renamed into its place since (a good copy of the same run)."""
        entry = self.forget(start, end)
        if entry is None:
            return
        path = self.folder / entry.name
        if only_if is not None:
            try:
                st = os.stat(path)
            except OSError:                 # gone already, or cannot be looked at now: left alone
                return
            if (st.st_ino, st.st_size, st.st_mtime_ns) != only_if:
                return
        before = self.folder_mtime()
        if unlink(path):
            self.own_change(before)
        else:
            self.undeletable.add(entry.name)

    def touch(self, start: bytes, end: bytes, entry: Entry, mtime: float) -> None:
        """We read this blob; mtime: the file's after our touch (the folder's clock)."""
        entry.last_use, entry.known_at, entry.retry_at = mtime, time.monotonic(), 0.0
        if (start, end) in self.lru:
            self.lru.move_to_end((start, end))

    def evict_to_limit(self, most: int | None = None, limit: int | None = None) -> bool:
        """Remove least recently used blobs while the folder is over `limit` (size_bytes unless given; at most `most`
        of them); True if more remain to go. Each candidate is looked at first: gone (another server evicted it) is
        only forgotten; used by another server since we last saw it (its mtime changed to a later one) goes to the
        back of the line, once per call; one that cannot be looked at now (an I/O error) goes to the back too, and
        is never deleted on a guess."""
        limit = self.size_bytes if limit is None else limit
        n, second_chances, unknown = 0, len(self.lru), len(self.lru)
        while self.total > limit and self.lru:
            if most is not None and n >= most:
                return True
            start, end = next(iter(self.lru))
            entry = self.by_start[start][end]
            try:
                st = os.stat(self.folder / entry.name)
            except FileNotFoundError:
                self.forget(start, end)
                continue
            except OSError as e:
                if e.errno == errno.ESTALE:          # NFS: the name now leads to no file (another server deleted it)
                    self.forget(start, end)
                    continue
                if unknown <= 0:
                    return False
                unknown -= 1
                self.lru.move_to_end((start, end))
                continue
            if second_chances > 0 and st.st_mtime > entry.last_use:
                second_chances -= 1
                self.total += st.st_size - max(0, entry.size)
                entry.size, entry.last_use = st.st_size, st.st_mtime
                self.lru.move_to_end((start, end))
                continue
            self.remove(start, end)
            n += 1
        return False

    def make_room(self, need: int) -> int:
        """The disk is full (ENOSPC, EDQUOT): evict least recently used blobs worth `need` bytes; returns the bytes the
        index no longer counts (0: nothing to evict)."""
        before = self.total
        self.evict_to_limit(limit=max(0, self.total - need))
        return before - self.total

    def evict_in_batches(self) -> None:
        """evict_to_limit, taking the lock for STAT_BATCH blobs at a time."""
        while True:
            with self.lock:
                if not self.evict_to_limit(STAT_BATCH):
                    return

    def clear(self) -> None:
        """Delete every indexed blob."""
        with self.lock:
            for start, end in list(self.lru):
                self.remove(start, end)


def unlink(path: Path) -> bool:
    """Delete a cache file; a folder we may not change (read-only, or a stray directory by that name) is left as
    it is (False): the index no longer lists it, and serving goes on."""
    try:
        path.unlink(missing_ok=True)
        return True
    except OSError as e:
        log.warning("file tier: could not delete %s (%s)", path, e)
        return False
