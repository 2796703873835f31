"""Device <-> host copies of the cache tiers on a stream of their own, ordered against compute by events.

On CUDA a tier copy runs on its own stream, so the engine thread never waits for it and the GPU overlaps it with
the forward that follows:
- a save (device -> pinned host rows) first waits, on the GPU, for the work the compute stream has queued so far
  (the forward that wrote those pages), then copies, then records an event;
- a load (host -> device) runs on the copy stream too, and the compute stream waits for it (a GPU-side wait) before
  anything queued later reads the pages.
Design invariant 4: a device page or state slot that a save still reads stays reserved until its event completes.
Here that is a fence, not a delay: whoever hands such a page or slot out again to be written (the page allocator,
the state pool's alloc / copy / zero) first makes the compute stream wait for the save's event; host rows a save
still writes are read on the CPU (file-tier writer) only after their event completes, and rows are moved on the CPU
(compaction) only once every copy is done. Blobs read from the file tier go up through two pinned staging buffers.
SGLang's
write-back crashes of the seed's posts were a device page reused while its copy to the host still read it.

`CopyStream` is the immediate one (the CPU: every copy is done when the call returns). `CudaCopyStream` is the
real one. `DeferredCopyStream` runs each copy only when something waits for it: a CPU stand-in for a slow copy
stream, so the tests can show that no fence is missing (a missing one lets a later write reach the copy first).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


def index_runs(dst_idx: list[int], src_idx: list[int]) -> list[tuple[int, int, int]]:
    """(dst start, src start, length) of each stretch where both index lists step by one together."""
    runs, start = [], 0
    for i in range(1, len(dst_idx) + 1):
        if i == len(dst_idx) or dst_idx[i] != dst_idx[i - 1] + 1 or src_idx[i] != src_idx[i - 1] + 1:
            runs.append((dst_idx[start], src_idx[start], i - start))
            start = i
    return runs


def scattered(runs: list[tuple[int, int, int]], rows: int) -> bool:
    """Whether rows copied as these runs are better gathered: many short runs (pages come off free lists in
    ascending order, so runs are usually long; a churned pool of one-token pages gives one row each)."""
    return len(runs) > 1 and len(runs) * 8 > rows


def staged_rows(dst: torch.Tensor, dst_idx: list[int], src: torch.Tensor, src_idx: list[int], device_side: str,
                cross: Callable[[torch.Tensor, torch.Tensor], None], max_bytes: int) -> None:
    """dst[dst_idx] = src[src_idx] between device rows and host rows when the device side is scattered: in chunks
    of at most max_bytes, the device rows are gathered into (device_side "src") or scattered from ("dst") a
    contiguous device buffer by one device op, and only the host side's runs cross (`cross(dst, src)`: one copy
    each; host rows come off free lists in runs), so a scattered set costs a few large copies, not one per row."""
    row_bytes = src[0].numel() * src.element_size()
    per_chunk = max(1, max_bytes // row_bytes)
    dev = (src if device_side == "src" else dst).device
    for c in range(0, len(dst_idx), per_chunk):
        d_idx, s_idx = dst_idx[c:c + per_chunk], src_idx[c:c + per_chunk]
        n = len(d_idx)
        if device_side == "src":                       # device -> host: gather, then the host runs
            buf = src.index_select(0, _index(s_idx, dev))
            for d, b, k in index_runs(d_idx, list(range(n))):
                cross(dst[d:d + k], buf[b:b + k])
        else:                                          # host -> device: the host runs, then scatter
            buf = torch.empty((n,) + tuple(dst.shape[1:]), dtype=dst.dtype, device=dev)
            for b, s, k in index_runs(list(range(n)), s_idx):
                cross(buf[b:b + k], src[s:s + k])
            dst.index_copy_(0, _index(d_idx, dev), buf)


def _index(ids: list[int], device: torch.device) -> torch.Tensor:
    """Row ids on `device`; to a GPU through pinned memory, so the engine thread does not wait for the stream."""
    t = torch.tensor(ids, dtype=torch.long)
    return t.to(device) if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class CopyStream:
    """Tier copies done at once (the CPU path): nothing is ever pending."""

    asynchronous = False                # copies may still run after the call that issued them returns

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (device, contiguous) = src (pageable host memory: a blob read from the file tier)."""
        self.copy(dst, src)

    def copy_rows(self, dst: torch.Tensor, dst_idx: list[int], src: torch.Tensor, src_idx: list[int]) -> None:
        """dst[dst_idx] = src[src_idx] between device rows and pinned host rows, inside saving() / loading(): a copy
        per run of rows that step together."""
        for d, s, n in index_runs(dst_idx, src_idx):
            self.copy(dst[d:d + n], src[s:s + n])

    def upload_rows(self, dst: torch.Tensor, dst_idx: list[int], src: torch.Tensor) -> None:
        """dst[dst_idx] = src (a blob's rows, in order, in pageable host memory), inside loading()."""
        for d, s, n in index_runs(dst_idx, list(range(len(dst_idx)))):
            self.upload(dst[d:d + n], src[s:s + n])

    @contextlib.contextmanager
    def saving(self, pages: list[int] = (), slots: list[int] = (), host_pages: list[int] = (),
               host_snapshots: list[int] = ()) -> Iterator[None]:
        """Copies from device pages / state slots into host rows, inside the with-block."""
        yield

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Copies from host rows into device pages / slots, inside the with-block."""
        yield

    def fence_pages(self, pages: list[int]) -> None:
        """Device pages about to be written by compute: after any save that still reads them."""

    def fence_slots(self, slots: list[int]) -> None:
        """State slots about to be written by compute: after any save that still reads them."""

    def host_ready(self, host_pages: list[int] = (), host_snapshots: list[int] = ()) -> None:
        """Host rows about to be read or moved on the CPU: wait until the saves writing them are done."""

    def synchronize(self) -> None:
        """Every copy queued so far is done."""


class _Pending(CopyStream):
    """Bookkeeping shared by the asynchronous streams: the last save event of each device page, state slot and
    host row (an event covers every copy queued before it on the one copy stream)."""

    asynchronous = True

    def __init__(self) -> None:
        self._pages: dict[int, object] = {}
        self._slots: dict[int, object] = {}
        self._host_pages: dict[int, object] = {}
        self._host_snaps: dict[int, object] = {}

    # what each stream implements: enter / leave the copy stream, record an event after what is queued on it,
    # make compute wait for an event or for everything queued, make the host wait for an event, test one
    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        raise NotImplementedError

    def _record(self) -> object:
        raise NotImplementedError

    def _compute_waits(self, event: object) -> None:
        raise NotImplementedError

    def _compute_waits_all(self) -> None:
        raise NotImplementedError

    def _host_waits(self, event: object) -> None:
        raise NotImplementedError

    def _done(self, event: object) -> bool:
        raise NotImplementedError

    @contextlib.contextmanager
    def saving(self, pages=(), slots=(), host_pages=(), host_snapshots=()) -> Iterator[None]:
        self._begin()
        try:
            yield
        finally:                            # also when a copy failed part-way: those queued before it still run
            self._end()
            event = self._record()
            for table, keys in ((self._pages, pages), (self._slots, slots), (self._host_pages, host_pages),
                                (self._host_snaps, host_snapshots)):
                for k in keys:
                    table[k] = event
            self._prune()

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        self._begin()
        try:
            yield
        finally:                            # also when a copy failed part-way (see saving)
            self._end()
            self._compute_waits_all()

    def _fence(self, table: dict[int, object], keys: list[int]) -> None:
        for k in keys:
            event = table.pop(k, None)
            if event is not None:
                self._compute_waits(event)

    def fence_pages(self, pages: list[int]) -> None:
        self._fence(self._pages, pages)

    def fence_slots(self, slots: list[int]) -> None:
        self._fence(self._slots, slots)

    def host_ready(self, host_pages=(), host_snapshots=()) -> None:
        for table, keys in ((self._host_pages, host_pages), (self._host_snaps, host_snapshots)):
            for k in keys:
                event = table.pop(k, None)
                if event is not None:
                    self._host_waits(event)

    def synchronize(self) -> None:
        self._host_waits_all()                  # saves and loads alike
        for table in (self._pages, self._slots, self._host_pages, self._host_snaps):
            table.clear()

    def _host_waits_all(self) -> None:
        raise NotImplementedError

    def _prune(self, every: int = 256) -> None:
        """Forget completed events now and then (the tables would otherwise grow with every page ever saved)."""
        if sum(map(len, (self._pages, self._slots, self._host_pages, self._host_snaps))) < every:
            return
        for table in (self._pages, self._slots, self._host_pages, self._host_snaps):
            for k in [k for k, e in table.items() if self._done(e)]:
                del table[k]


STAGING_BYTES = 32 << 20        # each of the two pinned buffers file-tier blobs go to the device through


class CudaCopyStream(_Pending):
    """The copies on a CUDA stream of their own; host rows are pinned, so they do not block the engine thread."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.stream = torch.cuda.Stream(device)
        self._outer: list = []
        self._staging: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._turn = 0                              # chunks staged so far (they alternate between the two)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def copy_rows(self, dst: torch.Tensor, dst_idx: list[int], src: torch.Tensor, src_idx: list[int]) -> None:
        """As CopyStream's, but a scattered device side goes through device buffers (staged_rows), on this stream."""
        runs = index_runs(dst_idx, src_idx)
        if not scattered(runs, len(dst_idx)):
            for d, s, n in runs:
                self.copy(dst[d:d + n], src[s:s + n])
            return
        staged_rows(dst, dst_idx, src, src_idx, "src" if src.is_cuda else "dst", self.copy, STAGING_BYTES)

    def upload_rows(self, dst: torch.Tensor, dst_idx: list[int], src: torch.Tensor) -> None:
        if not scattered(index_runs(dst_idx, list(range(len(dst_idx)))), len(dst_idx)):
            return super().upload_rows(dst, dst_idx, src)
        staged_rows(dst, dst_idx, src, list(range(len(dst_idx))), "dst", self.upload, STAGING_BYTES)

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Through two pinned staging buffers taken in turn, STAGING_BYTES at a time: the engine thread fills one
        (a memcpy) while the other's chunk goes to the device; a buffer is refilled once its event says its chunk
        has left. Bounded pinned memory, however large the blob (torch's pinned cache would keep every blob's)."""
        if not self._staging:
            self._staging = [(torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True), None)
                             for _ in range(2)]
        src_bytes = src.contiguous().view(-1).view(torch.uint8)
        dst_bytes = dst.view(-1).view(torch.uint8)
        for off in range(0, src_bytes.numel(), STAGING_BYTES):
            self._turn += 1                         # across calls too: a call's first chunk takes the idle buffer
            i = self._turn
            buf, event = self._staging[i % 2]
            if event is not None:
                event.synchronize()
            n = min(STAGING_BYTES, src_bytes.numel() - off)
            buf[:n].copy_(src_bytes[off:off + n])
            dst_bytes[off:off + n].copy_(buf[:n], non_blocking=True)
            self._staging[i % 2] = (buf, self._record())

    def _begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())      # see what the forwards wrote
        ctx = torch.cuda.stream(self.stream)
        ctx.__enter__()
        self._outer.append(ctx)

    def _end(self) -> None:
        self._outer.pop().__exit__(None, None, None)

    def _record(self) -> object:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _compute_waits(self, event) -> None:
        torch.cuda.current_stream().wait_event(event)

    def _compute_waits_all(self) -> None:
        torch.cuda.current_stream().wait_stream(self.stream)

    def _host_waits(self, event) -> None:
        event.synchronize()

    def _host_waits_all(self) -> None:
        self.stream.synchronize()

    def _done(self, event) -> bool:
        return event.query()


class DeferredCopyStream(_Pending):
    """A CPU stand-in for a copy stream that lags behind: copies queue up and run, in order, only when something
    waits for them (a fence, a load's end, a host read). Tests run the engine on it to show every wait is there."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: list[Callable[[], None]] = []
        self.done = 0                       # copies run so far (an event is a position in the queue)
        self.most_pending = 0               # the longest the queue of copies not yet run has been
        self._depth = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self._depth == 0:                # not inside saving() / loading(): an ordinary copy
            dst.copy_(src)
            return
        self.queue.append(lambda: dst.copy_(src))     # reads src when it runs, as a late copy engine would
        self.most_pending = max(self.most_pending, len(self.queue) - self.done)

    def _begin(self) -> None:
        self._depth += 1

    def _end(self) -> None:
        self._depth -= 1

    def _record(self) -> int:
        return len(self.queue)

    def _run_to(self, position: int) -> None:
        while self.done < position:
            self.queue[self.done]()
            self.queue[self.done] = None    # type: ignore[call-overload]
            self.done += 1

    def _compute_waits(self, event: int) -> None:
        self._run_to(event)

    def _compute_waits_all(self) -> None:
        self._run_to(len(self.queue))

    def _host_waits(self, event: int) -> None:
        self._run_to(event)

    def _host_waits_all(self) -> None:
        self._run_to(len(self.queue))

    def _done(self, event: int) -> bool:
        return self.done >= event


def copy_stream_for(device: torch.device) -> CopyStream:
    return CudaCopyStream(device) if device.type == "cuda" else CopyStream()
