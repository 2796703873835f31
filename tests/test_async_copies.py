"""Tier copies on a copy stream of their own (tinyserve/copies.py), design invariant 4: a device page or state slot
that a save to the host still reads is never written before the save is done.

On the CPU every copy is done at once, so the engine here runs on DeferredCopyStream: a stand-in for a copy stream
that lags behind, whose copies run only when something waits for them (a fence, the end of a load, a CPU read of
host rows). Through evictions to the host and loads back, the tokens must be the cold run's; with the fences taken
out, the same traffic corrupts the host copies (the control below), so the test can fail. On CUDA, tests/gpu.sh runs
test_tiers.py with the model on the GPU, where the real stream (CudaCopyStream) is the default."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks, engine_for, tokens
from tinyserve.copies import CopyStream, DeferredCopyStream, copy_stream_for
from tinyserve.engine import Engine
from tinyserve.build import engine_for_model
from tinyserve.config import from_dict
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SESSIONS = [tokens(250, seed) for seed in (11, 12, 13)]
TRAFFIC = [0, 1, 2, 0, 1, 2, 0]                    # three sessions through a pool that holds one: host hits


def tiered(model, stream, file_dir=None) -> Engine:
    cache = {"host": {"size_gb": 0.05, "write_policy": "write_through"}}
    if file_dir:
        cache["file"] = {"dir": str(file_dir), "size_gb": 1.0, "prefetch_policy": "wait_complete"}
    cfg = from_dict({"engine": {"page_size": 16, "kv_cache_tokens": 400, "max_running_requests": 1,
                                "compile_steps": False},
                     "cache": cache})
    return engine_for_model(cfg, model, copy_stream=stream)


def play(eng: Engine) -> list[tuple[list[int], int]]:
    out = []
    for i in TRAFFIC:
        (r,) = eng.run_requests([SESSIONS[i]], GREEDY)
        out.append((r.output_ids, r.report["cached_by_tier"]["host"]))
    return out


def cold_tokens(model) -> list[list[int]]:
    eng = engine_for(model, engine={"page_size": 16, "kv_cache_tokens": 4096}, cache={"enabled": False})
    return [eng.generate([SESSIONS[i]], GREEDY)[0] for i in TRAFFIC]


def test_late_copies_give_the_cold_tokens(hybrid_model, tmp_path):
    """Host hits, and after a restart file hits (blobs written from host rows a late save filled, read back through
    the copy stream)."""
    stream = DeferredCopyStream()
    eng = tiered(hybrid_model, stream, tmp_path)
    got = play(eng)
    cold = cold_tokens(hybrid_model)
    assert [t for t, _ in got] == cold
    assert sum(h for _, h in got) > 0, "no host hit: the traffic did not go through the host tier"
    assert stream.most_pending > 1, "copies were never left pending"
    eng.close()
    assert stream.done == len(stream.queue)                  # close waits for every copy
    assert_no_leaks(eng)
    restarted = tiered(hybrid_model, DeferredCopyStream(), tmp_path)
    for i in (1, 2):
        (r,) = restarted.run_requests([SESSIONS[i]], GREEDY)
        assert r.output_ids == cold[TRAFFIC.index(i)] and r.report["cached_by_tier"]["file"] > 0
    restarted.close()


def test_without_the_fences_late_copies_corrupt_the_host_tier(hybrid_model):
    """The control: pages and slots handed out again without waiting for their saves."""
    stream = DeferredCopyStream()
    eng = tiered(hybrid_model, stream)
    eng.allocator.fence = eng.state_pool.fence = lambda ids: None
    got = play(eng)
    assert sum(h for _, h in got) > 0
    assert [t for t, _ in got] != cold_tokens(hybrid_model)


def test_stream_semantics():
    """A save's copies wait for a fence, a host read or a load's end; events cover what was queued before them."""
    s = DeferredCopyStream()
    dev, host = torch.arange(8.0), torch.zeros(8)
    with s.saving(pages=[3], host_pages=[5]):
        s.copy(host[5:6], dev[3:4])
    with s.saving(slots=[1], host_snapshots=[2]):
        s.copy(host[2:3], dev[1:2])
    assert host.sum() == 0 and len(s.queue) == 2
    s.fence_pages([4])                                       # nothing pending for page 4
    assert s.done == 0
    s.fence_pages([3])                                       # page 3's save runs before it is written again
    assert s.done == 1 and host[5] == 3 and host[2] == 0
    dev[1] = 100.0                                           # written without a fence: the late copy sees it
    s.host_ready(host_snapshots=[2])
    assert host[2] == 100.0
    with s.loading():
        s.copy(dev[0:1], host[5:6])
    assert dev[0] == 3 and s.done == len(s.queue)            # the compute stream waits for a load at once
    s.synchronize()


def test_the_cpu_copies_at_once():
    s = copy_stream_for(torch.device("cpu"))
    assert type(s) is CopyStream and not s.asynchronous
    dst = torch.zeros(2)
    with s.saving(pages=[0]):
        s.copy(dst, torch.ones(2))
    assert dst.sum() == 2


def pools(stream):
    from tinyserve.pools import KVPool, PageAllocator, StatePool
    from tinyserve.host_tier import HostTier
    kv = KVPool(8, 4, 2, 2, 8, torch.float32, "cpu")
    alloc = PageAllocator(8)
    state = StatePool(2, 2, 12, 4, 2, 8, 8, torch.float32, "cpu", num_snapshot_slots=2)
    alloc.fence, state.fence = stream.fence_pages, stream.fence_slots
    host = HostTier(kv, state, num_pages=8, num_snapshots=2, copies=stream)
    return kv, alloc, state, host


def test_a_page_handed_out_again_waits_for_its_save():
    stream = DeferredCopyStream()
    kv, alloc, _, host = pools(stream)
    pages = alloc.alloc(2)
    kv.buffer[pages] = 1.0
    hp = host.alloc_pages(2)
    host.save_pages(pages, hp)                       # queued, not run
    alloc.release(pages)
    again = alloc.alloc(2)                           # the same pages (low ids first): fenced
    assert sorted(again) == sorted(pages)
    kv.buffer[again] = 2.0                           # what the next forward writes
    assert torch.all(host.read_pages(hp) == 1.0)


def test_a_snapshot_slot_handed_over_waits_for_its_save():
    """What the radix tree does when it demotes a snapshot to the host and reuses its device slot at once."""
    stream = DeferredCopyStream()
    _, _, state, host = pools(stream)
    slot = state.alloc_snapshot()
    state.conv[slot], state.ssm[slot] = 1.0, 1.0
    hs = host.alloc_snapshot()
    host.save_snapshot(slot, hs)
    state.copy(0, slot)                              # the slot takes another state: fenced first
    conv, ssm = host.read_snapshot(hs)
    assert torch.all(conv == 1.0) and torch.all(ssm == 1.0)
    state.fence = lambda slots: None                 # the control: without the fence the late copy sees the new state
    slot2 = state.alloc_snapshot()
    state.conv[slot2] = 5.0
    hs2 = host.alloc_snapshot() if host.num_free_snapshots else hs
    host.save_snapshot(slot2, hs2)
    state.zero(slot2)
    assert torch.all(host.read_snapshot(hs2)[0] == 0.0)


def test_the_devices_own_stream_gives_the_cold_tokens(hybrid_model):
    """The copy stream the engine picks itself: at once on the CPU; on CUDA (tests/gpu.sh runs this file with
    TINYSERVE_TEST_DEVICE=cuda) a stream of its own with events, the real thing the stand-in above imitates."""
    eng = tiered(hybrid_model, None)
    assert eng.copies.asynchronous == (hybrid_model.device.type == "cuda")
    got = play(eng)
    assert [t for t, _ in got] == cold_tokens(hybrid_model) and sum(h for _, h in got) > 0
    eng.close()
    assert_no_leaks(eng)


def _scattered_case(seed: int):
    """A 'device' pool of 40 rows and 'host' rows, 23 rows to move: device rows scattered (a churned pool of
    one-token pages), host rows in a few runs (as host free lists give them)."""
    g = torch.Generator().manual_seed(seed)
    device = torch.randn(40, 3, 5, generator=g)
    host = torch.randn(30, 3, 5, generator=g)
    device_rows = torch.randperm(40, generator=g)[:23].tolist()
    host_rows = list(range(2, 12)) + list(range(15, 28))
    return device, device_rows, host, host_rows


def test_scattered_rows_go_through_device_buffers():
    """staged_rows (CudaCopyStream's path for a scattered device side): the same result as row-by-row copies, in
    chunks smaller than the set (a chunk boundary inside a host run), both ways; the host side crosses run by run,
    a few copies, not one per row."""
    from tinyserve.copies import index_runs, scattered, staged_rows
    device, device_rows, host, host_rows = _scattered_case(0)
    assert scattered(index_runs(host_rows, device_rows), len(host_rows))
    crossings = []

    def cross(dst, src):
        crossings.append(dst.shape[0])
        dst.copy_(src)
    row_bytes = 3 * 5 * 4
    want = host.clone()
    want[host_rows] = device[device_rows]
    got = host.clone()
    staged_rows(got, host_rows, device, device_rows, "src", cross, max_bytes=7 * row_bytes)    # save: 4 chunks
    assert torch.equal(got, want) and len(crossings) == 5 and sum(crossings) == 23
    want_dev = device.clone()
    want_dev[device_rows] = host[host_rows]
    got_dev = device.clone()
    crossings.clear()
    staged_rows(got_dev, device_rows, host, host_rows, "dst", cross, max_bytes=7 * row_bytes)  # load
    assert torch.equal(got_dev, want_dev) and sum(crossings) == 23 and len(crossings) == 5


def test_the_streams_row_copies_agree():
    """copy_rows / upload_rows, which the tiers call: the immediate stream's and the deferred one's (run by run)
    give the same rows; on CUDA the real stream's (device buffers for a scattered set) too."""
    device, device_rows, host, host_rows = _scattered_case(1)
    want = device.clone()
    want[device_rows] = host[host_rows]
    streams = [CopyStream(), DeferredCopyStream()]
    if torch.cuda.is_available():
        streams.append(copy_stream_for(torch.device("cuda")))
    for stream in streams:
        dev = device.to("cuda") if getattr(stream, "stream", None) is not None else device.clone()
        pinned = host.pin_memory() if dev.is_cuda else host
        with stream.loading():
            stream.copy_rows(dev, device_rows, pinned, host_rows)
        stream.synchronize()
        assert torch.equal(dev.cpu(), want), type(stream).__name__
        back = torch.zeros_like(pinned)
        with stream.saving(pages=device_rows, host_pages=host_rows):
            stream.copy_rows(back, host_rows, dev, device_rows)
        stream.synchronize()
        assert torch.equal(back[host_rows], host[host_rows]), type(stream).__name__
        blob = host[host_rows]                                     # a file blob: rows in order, pageable memory
        up = torch.zeros_like(dev)
        with stream.loading():
            stream.upload_rows(up, device_rows, blob)
        stream.synchronize()
        assert torch.equal(up.cpu()[device_rows], blob), type(stream).__name__


def test_a_save_that_fails_part_way_still_fences_what_it_queued():
    """A copy that raises inside saving() (a staging buffer it could not allocate): the copies queued before it
    still read the page, so the page stays fenced; inside loading(), compute still waits for what was queued."""
    stream = DeferredCopyStream()
    page, host = torch.ones(4), torch.zeros(4)
    with pytest.raises(RuntimeError):
        with stream.saving(pages=[3], host_pages=[0]):
            stream.copy(host[:2], page[:2])
            raise RuntimeError("out of memory")
    assert host.sum() == 0                     # still queued
    stream.fence_pages([3])                    # page 3 is about to be written: its save runs first
    assert host[:2].sum() == 2
    with pytest.raises(RuntimeError):
        with stream.loading():
            stream.copy(page[2:], host[:2] + 5)
            raise RuntimeError("out of memory")
    assert torch.equal(page, torch.tensor([1.0, 1.0, 6.0, 6.0]))
