"""Warm restart: the file tier indexes its folder from the names alone (no per-blob stat, open or read on the
starting thread), so a folder of many blobs serves the first request after a restart from the file tier at once;
sizes and ages are read in the background before the first write, and eviction then goes oldest first. One blob per
cached run of pages, never one per page. (The 100,000-blob timing is bench/home_box.py's: tests are not timed.)
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest
import torch

from conftest import engine_for, tokens
from tinyserve.blob import HEADER, SUFFIX, chain_hashes
from tinyserve.engine import Engine
from tinyserve.file_index import FolderIndex
from tinyserve.file_tier import FileTier
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SESSION = 250


@pytest.fixture(scope="module")
def model(hybrid_model):
    return hybrid_model


def small_engine(model, folder: Path, policy: str = "write_through", host_gb: float = 0.0) -> Engine:
    return engine_for(model, engine={"page_size": 16, "kv_cache_tokens": 400, "max_running_requests": 1},
                      cache={"host": {"size_gb": host_gb, "write_policy": policy},
                             "file": {"dir": str(folder), "size_gb": 1.0, "prefetch_policy": "wait_complete"}})


def synthetic_blobs(folder: Path, n: int, size: int = 0, seed: int = 0) -> list[Path]:
    """n files named as the file tier names its blobs (random chain hashes: they never match a prompt)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        a = hashlib.sha256(b"start %d %d" % (seed, i)).hexdigest()
        b = hashlib.sha256(b"end %d %d" % (seed, i)).hexdigest()
        p = folder / f"{a}-{b}{SUFFIX}"
        p.write_bytes(b"\0" * size)
        out.append(p)
    return out


def blob_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX))


def file_tier(eng: Engine) -> FileTier:
    return eng.cache.file


class Calls:
    """Counts os.stat and open calls made by the current thread (the engine's, at start)."""

    def __init__(self, monkeypatch) -> None:
        self.stat = self.open = 0
        me = threading.current_thread()
        real_stat, real_open = os.stat, open

        def stat(*a, **k):
            if threading.current_thread() is me:
                self.stat += 1
            return real_stat(*a, **k)

        def opener(*a, **k):
            if threading.current_thread() is me:
                self.open += 1
            return real_open(*a, **k)
        monkeypatch.setattr(os, "stat", stat)
        monkeypatch.setattr("builtins.open", opener)


def make_tier(folder: Path, size_bytes: int = 1 << 30) -> FileTier:
    return FileTier(folder, size_bytes, b"\0" * 32, (1,), torch.float32, (1,), torch.float32, (1,))


@pytest.mark.slow
def test_indexing_reads_names_only(tmp_path, monkeypatch):
    folder = tmp_path / "kv"
    blobs = synthetic_blobs(folder, 3000, size=100)
    (folder / ".tmp-0123abcd").write_bytes(b"half a blob")               # a writer killed mid-write
    (folder / "notes.txt").write_text("not ours")
    (folder / f"{'zz' * 32}-{'00' * 32}{SUFFIX}").write_bytes(b"")       # not hex
    calls = Calls(monkeypatch)
    tier = make_tier(folder)
    assert tier.num_blobs == 3000
    assert calls.stat <= 5 and calls.open <= 2, (calls.stat, calls.open)  # O(1), not O(blobs): names only
    assert not (folder / ".tmp-0123abcd").exists() and (folder / "notes.txt").exists()
    start, end = blobs[7].name[:64], blobs[7].name[65:129]
    assert tier.has(bytes.fromhex(start), bytes.fromhex(end))           # a lookup works before any size is known
    assert tier.flush(60)                                               # the background stat job has run
    assert tier.used_bytes == 3000 * 100 and tier.report().blobs == 3000
    tier.close()


def test_sizes_and_ages_arrive_in_the_background_and_evict_oldest_first(tmp_path):
    folder = tmp_path / "kv"
    blobs = synthetic_blobs(folder, 200, size=100)
    for i, p in enumerate(blobs):                                        # blob i is i seconds newer than blob 0
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    newest_first = list(reversed(blobs))
    tier = make_tier(folder, size_bytes=150 * 100)                       # room for 150 of the 200
    assert tier.flush(60)
    kept = set(blob_files(folder))
    assert kept == set(newest_first[:150]) and tier.num_blobs == 150 and tier.used_bytes == 150 * 100
    # the next eviction takes the oldest blob left
    tier.index.size_bytes = 149 * 100
    with tier.index.lock:
        tier.index.evict_to_limit()
    assert set(blob_files(folder)) == set(newest_first[:149])
    tier.close()


def test_a_blob_gone_before_its_stat_leaves_the_index(tmp_path, monkeypatch):
    folder = tmp_path / "kv"
    blobs = synthetic_blobs(folder, 10, size=10)
    gate = threading.Event()
    real = FolderIndex.stat_found

    def held(self, found):
        gate.wait(30)
        return real(self, found)
    monkeypatch.setattr(FolderIndex, "stat_found", held)
    tier = make_tier(folder)
    blobs[0].unlink()
    gate.set()
    assert tier.flush(60)
    assert tier.num_blobs == 9 and tier.used_bytes == 90
    tier.close()


@pytest.mark.slow
def test_restart_among_many_blobs_serves_the_first_request_from_the_file_tier(model, tmp_path):
    folder = tmp_path / "kv"
    prompt = tokens(SESSION, 5)
    cold = engine_for(model, engine={"page_size": 16, "kv_cache_tokens": 4096},
                      cache={"enabled": False}).generate([prompt], GREEDY)[0]
    eng = small_engine(model, folder)
    (first,) = eng.run_requests([prompt], GREEDY)
    assert first.output_ids == cold and first.cached_tokens == 0
    eng.close()
    ours = set(blob_files(folder))
    synthetic_blobs(folder, 20_000)                                      # a long-used folder (empty files: inodes)

    restarted = small_engine(model, folder)
    assert file_tier(restarted).num_blobs == len(ours) + 20_000
    (again,) = restarted.run_requests([prompt], GREEDY)
    assert again.output_ids == cold
    assert again.report["cached_by_tier"]["file"] == (SESSION - 1) // 16 * 16, again.report["cached_by_tier"]
    assert file_tier(restarted).stats.errors == 0                        # no other blob was read
    restarted.close()
    assert len(blob_files(folder)) == len(ours) + 20_000


def blob_header(path: Path):
    magic, version, fp, start, end, n_tok, n_pages, *_ = HEADER.unpack_from(path.read_bytes())
    return start, end, n_tok, n_pages


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_one_blob_per_cached_run_in_a_growing_conversation(model, tmp_path, policy):
    """An agent conversation: each turn resends everything before plus a new message. Every blob is one cached run
    of whole pages (never one per page) and no two blobs hold the same run (one blob per run end)."""
    folder = tmp_path / "kv"
    eng = small_engine(model, folder, policy, host_gb=0.01)
    convo = tokens(120, 20)
    for turn in range(5):
        (req,) = eng.run_requests([convo], GREEDY)
        convo = convo + req.output_ids + tokens(60, 30 + turn)
    other = tokens(200, 99)                                              # another session pushes it off the device
    eng.run_requests([other], GREEDY)
    eng.run_requests([convo[:-60]], GREEDY)
    eng.cache.make_room(eng.allocator.num_pages)                         # write_back: evictions write
    file_tier(eng).flush(30)
    page_size = 16
    heads = [blob_header(p) for p in blob_files(folder)]
    assert heads
    spans: dict[str, list[tuple[int, int]]] = {"convo": [], "other": []}
    for chain_name, toks in (("convo", convo), ("other", other)):
        where = {h: i for i, h in enumerate(chain_hashes(file_tier(eng).fingerprint, toks, page_size))}
        for start_h, end_h, n_tok, n_pages in heads:
            if start_h in where and end_h in where:
                assert n_tok == n_pages * page_size == (where[end_h] - where[start_h]) * page_size
                spans[chain_name].append((where[start_h], where[end_h]))
    assert sum(map(len, spans.values())) == len(heads), "every blob is a run of one of the sessions"
    for runs in spans.values():                      # no page of a session is in two blobs
        runs.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(runs, runs[1:])), runs
    assert len(heads) < (len(convo) + len(other)) // page_size // 4   # runs, not pages
    eng.close()
