"""Cache tiers behind the radix tree: host memory (L2) and a persistent folder (L3), state snapshots included.

Host tier: one arena allocated at start from `cache.host.size_gb`, split explicitly between KV pages and state
snapshots. Pages keep the device pool's page-major layout, so one page (all attention layers) is one contiguous
block, and moving any set of pages is one bounds-checked indexed copy (`_copy_rows`), the same for every page
size and dtype. Device <-> host copies run in the step thread between forwards (a memcpy; nothing else touches
those rows then), so a page or slot is never freed while a copy reads it.

File tier: one blob per cached run of pages (a radix node), named by the hash chain at its start and end:
`<start>-<end>.tsb`. The chain is seeded by a fingerprint of the model (config, tensor names, shapes, dtypes),
the KV dtype, the page size and the format version, so another model or setting never hits. A blob has a header
(magic, version, fingerprint, the two chain hashes, lengths, CRC32 of the payload), then the run's token ids, its
KV pages and, when the node had one, the state snapshot at its end. Blobs are written to a temporary name and
renamed, by one background writer thread; the folder is indexed from its listing at start (temporary files of a
killed writer are deleted); a truncated, corrupt or foreign blob is a miss: counted, logged once, deleted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tinyserve.config import WRITE_POLICIES
from tinyserve.kv import KVPool
from tinyserve.state import StatePool

log = logging.getLogger("tinyserve.tiers")

FORMAT_VERSION = 1
MAGIC = b"TSKVBLOB"
# magic, version, fingerprint, start hash, end hash, n_tokens, n_pages, kv bytes, conv bytes, ssm bytes, crc32
HEADER = struct.Struct("<8sI32s32s32sIIQQQI")
SUFFIX = ".tsb"


def _copy_rows(dst: torch.Tensor, dst_idx: list[int], src: torch.Tensor, src_idx: list[int]) -> None:
    """dst[dst_idx] = src[src_idx], checked: same row shape and dtype, indices in range, equal counts."""
    assert len(dst_idx) == len(src_idx), "copy with mismatched index counts"
    assert dst.shape[1:] == src.shape[1:] and dst.dtype == src.dtype, \
        f"tier copy between incompatible layouts {tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} {dst.dtype}"
    if not dst_idx:
        return
    assert 0 <= min(dst_idx) and max(dst_idx) < dst.shape[0], "tier copy: destination row out of range"
    assert 0 <= min(src_idx) and max(src_idx) < src.shape[0], "tier copy: source row out of range"
    # Pages come off free lists in ascending order, so index pairs usually form long runs that step together:
    # copy those as contiguous slices (no gather buffer, full memcpy speed); scattered sets gather once.
    runs, start = [], 0
    for i in range(1, len(dst_idx) + 1):
        if i == len(dst_idx) or dst_idx[i] != dst_idx[i - 1] + 1 or src_idx[i] != src_idx[i - 1] + 1:
            runs.append((dst_idx[start], src_idx[start], i - start))
            start = i
    if len(runs) * 8 <= len(dst_idx) or len(runs) == 1:
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
    capacity: int = 0
    used_snapshots: int = 0      # host only
    capacity_snapshots: int = 0
    blobs: int = 0               # file only
    writable: bool = True        # file only: False once a write failed (serving goes on)


class HostTier:
    """Pinned (on CUDA) host arena for KV pages and state snapshots, with free lists."""

    def __init__(self, kv_pool: KVPool, state_pool: StatePool, num_pages: int, num_snapshots: int) -> None:
        """num_pages / num_snapshots: the memory plan's split of cache.host.size_gb."""
        self.kv_pool, self.state_pool = kv_pool, state_pool
        pin = kv_pool.buffer.is_cuda and torch.cuda.is_available()
        page_bytes, snap_bytes = kv_pool.bytes_per_page, state_pool.bytes_per_slot
        self.num_pages, self.num_snapshots = num_pages, num_snapshots
        buf = kv_pool.buffer
        self.kv = torch.zeros((self.num_pages,) + tuple(buf.shape[1:]), dtype=buf.dtype, pin_memory=pin)
        self.conv = torch.zeros((self.num_snapshots,) + tuple(state_pool.conv.shape[1:]),
                                dtype=state_pool.conv.dtype, pin_memory=pin)
        self.ssm = torch.zeros((self.num_snapshots,) + tuple(state_pool.ssm.shape[1:]),
                               dtype=state_pool.ssm.dtype, pin_memory=pin)
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._free_snaps = list(range(self.num_snapshots - 1, -1, -1))
        self.page_bytes, self.snap_bytes = page_bytes, snap_bytes
        self.stats = TierStats()

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_snapshots(self) -> int:
        return len(self._free_snaps)

    def alloc_pages(self, n: int) -> list[int] | None:
        if n > len(self._free_pages):
            return None
        return [self._free_pages.pop() for _ in range(n)]

    def free_pages(self, pages: list[int]) -> None:
        self._free_pages.extend(pages)

    def alloc_snapshot(self) -> int | None:
        return self._free_snaps.pop() if self._free_snaps else None

    def free_snapshot(self, slot: int) -> None:
        self._free_snaps.append(slot)

    def report(self) -> TierStats:
        return dataclasses.replace(self.stats, used=self.num_pages - self.num_free_pages, capacity=self.num_pages,
                                   used_snapshots=self.num_snapshots - self.num_free_snapshots,
                                   capacity_snapshots=self.num_snapshots)

    def _timed(self, nbytes: int, outward: bool):
        t0 = time.perf_counter()

        def done() -> None:
            self.stats.seconds += time.perf_counter() - t0
            if outward:
                self.stats.bytes_out += nbytes
            else:
                self.stats.bytes_in += nbytes
        return done

    def save_pages(self, device_pages: list[int], host_pages: list[int]) -> None:
        done = self._timed(len(host_pages) * self.page_bytes, outward=False)
        _copy_rows(self.kv, host_pages, self.kv_pool.buffer, device_pages)
        done()

    def load_pages(self, host_pages: list[int], device_pages: list[int]) -> None:
        done = self._timed(len(host_pages) * self.page_bytes, outward=True)
        _copy_rows(self.kv_pool.buffer, device_pages, self.kv, host_pages)
        done()

    def save_snapshot(self, device_slot: int, host_slot: int) -> None:
        done = self._timed(self.snap_bytes, outward=False)
        _copy_rows(self.conv, [host_slot], self.state_pool.conv, [device_slot])
        _copy_rows(self.ssm, [host_slot], self.state_pool.ssm, [device_slot])
        done()

    def load_snapshot(self, host_slot: int, device_slot: int) -> None:
        done = self._timed(self.snap_bytes, outward=True)
        _copy_rows(self.state_pool.conv, [device_slot], self.conv, [host_slot])
        _copy_rows(self.state_pool.ssm, [device_slot], self.ssm, [host_slot])
        done()


WEIGHT_SAMPLES = 4096      # values read from each tensor for the weight digest


@torch.no_grad()
def weights_digest(model) -> bytes:
    """Digest of a strided sample of every parameter's values. Two checkpoints of the same architecture (a fine-tune,
    another seed) differ almost everywhere, so a sample tells them apart, while hashing all weights of a 27B model
    would cost tens of seconds at every start."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda t: t[0]):
        flat = p.detach().reshape(-1)
        n = flat.numel()
        if n > WEIGHT_SAMPLES:
            idx = torch.linspace(0, n - 1, WEIGHT_SAMPLES, device=flat.device).long()
            flat = flat.index_select(0, idx)
        h.update(name.encode())
        h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.digest()


def model_fingerprint(model, kv_dtype: torch.dtype, page_size: int) -> bytes:
    """Identity of everything that decides the bytes of a cached page: a blob from any other set-up never hits.
    Config, tensor names/shapes/dtypes and a sample of the weight values (another checkpoint of the same
    architecture must not hit), KV dtype, page size and the format version."""
    desc = {
        "format": FORMAT_VERSION,
        "config": asdict(model.cfg),
        "tensors": sorted((n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()),
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


@dataclass
class Blob:
    """One run of pages read back from the file tier (CPU tensors), or to be written."""
    start_hash: bytes
    end_hash: bytes
    tokens: list[int]
    kv: torch.Tensor                      # [n_pages, *page shape]
    conv: torch.Tensor | None = None      # [*slot shape] state snapshot at the run's end
    ssm: torch.Tensor | None = None


@dataclass
class _Entry:
    path: Path
    size: int
    last_use: float


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

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._index: dict[bytes, dict[bytes, _Entry]] = {}      # start hash -> end hash -> blob
        self._total = 0
        self._warned: set[str] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-file-write")
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-file-read")
        self._pending: list[Future] = []
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
        if not self.folder.is_dir():
            return
        for p in self.folder.iterdir():
            if p.name.startswith(".tmp-"):           # left by a writer that was killed mid-write
                _unlink(p)
                continue
            if not p.name.endswith(SUFFIX):
                continue
            try:
                start, end = p.name[:-len(SUFFIX)].split("-")
                st = p.stat()
                self._add(bytes.fromhex(start), bytes.fromhex(end), _Entry(p, st.st_size, st.st_mtime))
            except (ValueError, OSError):
                continue
        log.info("file tier %s: %d blobs, %.2f GiB", self.folder, self.num_blobs, self._total / (1 << 30))

    def _add(self, start: bytes, end: bytes, entry: _Entry) -> None:
        old = self._index.setdefault(start, {}).get(end)
        if old is not None:
            self._total -= old.size
        self._index[start][end] = entry
        self._total += entry.size

    def _remove(self, start: bytes, end: bytes) -> None:
        entry = self._index.get(start, {}).pop(end, None)
        if entry is None:
            return
        if not self._index[start]:
            del self._index[start]
        self._total -= entry.size
        _unlink(entry.path)

    @property
    def num_blobs(self) -> int:
        with self._lock:             # the writer thread changes the index
            return sum(len(v) for v in self._index.values())

    def report(self) -> TierStats:
        return dataclasses.replace(self.stats, used=self.used_bytes, capacity=self.size_bytes, blobs=self.num_blobs,
                                   writable=self.writable)

    @property
    def used_bytes(self) -> int:
        return self._total

    def has(self, start: bytes, end: bytes) -> bool:
        with self._lock:
            return end in self._index.get(start, {})

    # ---- writing (background thread) ----
    def _disable_writes(self, why: str) -> None:
        if self.writable:
            log.warning("%s: file-tier writes disabled, serving goes on", why)
        self.writable = False

    def write(self, blob: Blob) -> None:
        """Queue a blob for writing (tensors must be CPU copies the caller no longer changes)."""
        if not self.writable or self.has(blob.start_hash, blob.end_hash):
            return
        with self._lock:
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
        t0 = time.perf_counter()
        parts = self._encode(blob)
        size = sum(p.nbytes for p in parts)
        if size > self.size_bytes:
            self._warn_once("size", f"a cached run of {size} bytes exceeds cache.file.size_gb; not written")
            return
        name = f"{blob.start_hash.hex()}-{blob.end_hash.hex()}{SUFFIX}"
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
        with self._lock:
            self._add(blob.start_hash, blob.end_hash, _Entry(self.folder / name, size, time.time()))
            self._evict_to_limit()
            self.stats.bytes_in += size
            self.stats.seconds += time.perf_counter() - t0

    def _evict_to_limit(self) -> None:
        while self._total > self.size_bytes:
            start, end, _ = min(((s, e, en) for s, d in self._index.items() for e, en in d.items()),
                                key=lambda t: t[2].last_use)
            self._remove(start, end)

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
        first gap or bad blob. hashes = chain_hashes(...) of tokens."""
        where = {h: i for i, h in enumerate(hashes)}
        out: list[Blob] = []
        page = first_page
        while page < len(hashes) - 1:
            with self._lock:
                candidates = [(where[e], e, en) for e, en in self._index.get(hashes[page], {}).items()
                              if e in where and where[e] > page]
            if not candidates:
                break
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
            out.append(blob)
            page = end_page
        return out

    def _read(self, start: bytes, end: bytes, entry: _Entry, expect_tokens: list[int]) -> Blob | None:
        t0 = time.perf_counter()
        try:
            data = entry.path.read_bytes()
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
        if tokens != expect_tokens or kv_len != n_pages * page_numel * elem or \
                (conv_len, ssm_len) not in ((0, 0), (conv_bytes, ssm_bytes)):
            self._bad(start, end, "mismatched")
            return None
        off = 4 * n_tok

        def tensor(nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
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
        entry.last_use = now
        try:
            os.utime(entry.path, (now, now))
        except OSError:
            pass
        self.stats.bytes_out += len(data)
        self.stats.seconds += time.perf_counter() - t0
        return Blob(start, end, tokens, kv, conv, ssm)


# The one table of write policies (cache.host.write_policy, in config.py's order): at which event a device node is
# backed up to the host tier (and from there, or straight from the device without a host tier, to the file tier).
BACKUP_EVENT = dict(zip(WRITE_POLICIES, ("insert", "hit", "evict")))


class Tiers:
    """The tiers below the device and every copy between them and the device pools. All copies run on the engine
    thread between forwards, so nothing they read is freed or rewritten meanwhile; the file tier gets CPU copies
    that its writer thread owns."""

    def __init__(self, kv_pool: KVPool, state_pool: StatePool, host: HostTier | None, file: FileTier | None,
                 write_policy: str) -> None:
        assert write_policy in BACKUP_EVENT, write_policy
        self.kv_pool, self.state_pool = kv_pool, state_pool
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
            kv = self.host.kv[host_pages].clone()
        else:
            kv = self.kv_pool.buffer[torch.tensor(pages, device=self.kv_pool.buffer.device)].to("cpu")
        conv = ssm = None
        if host_snapshot is not None:
            conv, ssm = self.host.conv[host_snapshot].clone(), self.host.ssm[host_snapshot].clone()
        elif snapshot is not None:
            conv = self.state_pool.conv[snapshot].to("cpu", copy=True)
            ssm = self.state_pool.ssm[snapshot].to("cpu", copy=True)
        self.file.write(Blob(start, end, list(tokens), kv, conv, ssm))

    def load_blob(self, blob: Blob, pages: list[int], snapshot: int | None) -> None:
        """Copy a blob read from the file tier into device pages (and its state into a snapshot slot)."""
        buf = self.kv_pool.buffer
        buf.index_copy_(0, torch.tensor(pages, device=buf.device), blob.kv.to(buf.device))
        if snapshot is not None:
            self.state_pool.conv[snapshot].copy_(blob.conv)
            self.state_pool.ssm[snapshot].copy_(blob.ssm)
