"""One cache folder for several servers (file_index.py): a run one writes is a hit for the others while they run,
writers never corrupt each other (every blob complete or absent), the folder's size_gb holds for the folder as a whole
(least recently used first across writers), and a blob another server deleted under a reader is a miss, not an error.

First the mechanism on FileTier objects sharing a folder (each one's own index, as two processes have), then two real
server processes on one folder: a prompt served by one is a file hit on the other without a restart, both writing the
same runs at once, and one evicting what the other reads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import tokens
from server_util import ServerProcess, free_port, http, server_config
from tinyserve.blob import HEADER, MAGIC, STATE_SUFFIX, SUFFIX, Blob, chain_hashes
from tinyserve.file_index import STALE_TMP_S, tmp_name
from tinyserve.file_tier import FileTier

FP = bytes(range(32))
PAGE = 16
PAGE_SHAPE = (64, 32)


def tier(folder: Path, size_bytes: int = 1 << 30) -> FileTier:
    return FileTier(folder, size_bytes, FP, PAGE_SHAPE, torch.float32, (8, 3), torch.float32, (4, 16))


def run_of(i: int, pages: int = 4) -> tuple[list[int], list[bytes], Blob]:
    toks = tokens(PAGE * pages + 1, 1000 + i)
    hashes = chain_hashes(FP, toks[:PAGE * pages], PAGE)
    kv = torch.randn((pages,) + PAGE_SHAPE, generator=torch.Generator().manual_seed(i))
    return toks, hashes, Blob(hashes[0], hashes[-1], toks[:PAGE * pages], kv)


def blob_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith((SUFFIX, STATE_SUFFIX)))


def complete(path: Path) -> bool:
    """A blob as its writer meant it: header, payload of the length it declares, CRC32 matching (read here with
    nothing of the file tier's own reading code)."""
    data = path.read_bytes()
    magic, _, _, _, _, n_tok, _, kv_len, conv_len, ssm_len, crc = HEADER.unpack_from(data)
    payload = data[HEADER.size:]
    return magic == MAGIC and len(payload) == 4 * n_tok + kv_len + conv_len + ssm_len and zlib.crc32(payload) == crc


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in blob_files(folder))


def wait_until(check, what: str, timeout: float = 30.0) -> None:
    """A bounded wait for something other threads or processes do (nothing here is timed)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------------------
# The mechanism, on FileTier objects sharing a folder

def test_a_run_written_by_one_is_read_by_the_other_without_a_restart(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)           # b indexed the folder before a wrote anything
    toks, hashes, blob = run_of(1)
    a.write(blob)
    assert a.flush(30)
    (got,) = b.read_chain(hashes, toks, 0, PAGE)    # a miss in b's index: b looks on disk for the exact name
    assert got.tokens == blob.tokens and torch.equal(got.kv, blob.kv)
    toks2, hashes2, blob2 = run_of(2)
    a.write(blob2)
    assert a.flush(30)
    assert b.index.refresh(force=True) and b.num_blobs == 2    # a new listing learns of every blob
    assert b.stats.errors == 0
    a.close(), b.close()


def test_a_blob_the_other_evicted_is_a_miss_not_an_error(tmp_path):
    a, b = tier(tmp_path), tier(tmp_path)
    toks, hashes, blob = run_of(1)
    a.write(blob)
    assert a.flush(30)
    assert b.index.refresh(force=True) and b.num_blobs == 1
    a.clear()                                        # a deletes it; b's index still lists it
    assert b.read_chain(hashes, toks, 0, PAGE) == []
    assert b.stats.errors == 0 and b.num_blobs == 0
    a.close(), b.close()


def test_eviction_keeps_the_folder_within_its_size_least_recently_used_first_across_writers(tmp_path):
    runs = [run_of(i) for i in range(6)]            # blobs of one size
    probe = tier(tmp_path / "probe")
    probe.write(runs[0][2])
    assert probe.flush(30)
    one = blob_files(tmp_path / "probe")[0].stat().st_size
    probe.close()
    a, b = tier(tmp_path, 4 * one), tier(tmp_path, 4 * one)
    for i in range(3):                               # three from each: six blobs for room of four
        a.write(runs[i][2])
        assert a.flush(30)
        b.write(runs[3 + i][2])
        assert b.flush(30)
    wait_until(lambda: folder_bytes(tmp_path) <= 4 * one, "the folder back within its size")
    left = blob_files(tmp_path)
    # the oldest went first (both servers evict in the order of the files' ages; runs written within one tick of
    # the clock may tie, and two servers evicting for the same excess at once may take one more)
    assert 2 <= len(left) <= 4 and all(complete(p) for p in left)
    newest = runs[5][2]
    assert f"{newest.start_hash.hex()}-{newest.end_hash.hex()}{SUFFIX}" in {p.name for p in left}
    assert a.stats.errors == b.stats.errors == 0
    a.close(), b.close()


def test_a_blob_another_server_read_lately_is_not_the_one_evicted(tmp_path):
    runs = [run_of(i) for i in range(3)]
    w = tier(tmp_path)
    for _, _, blob in runs:
        w.write(blob)
    assert w.flush(30)
    w.close()
    files = {p.name: p for p in blob_files(tmp_path)}
    names = [f"{blob.start_hash.hex()}-{blob.end_hash.hex()}{SUFFIX}" for _, _, blob in runs]
    for age, name in zip((3000, 2000, 1000), names):   # run 0 the oldest, then 1, then 2
        os.utime(files[name], (time.time() - age, time.time() - age))
    a = tier(tmp_path)                                  # a's LRU order by those ages
    assert a.flush(30)
    other = tier(tmp_path)
    toks, hashes, _ = runs[0]
    assert len(other.read_chain(hashes, toks, 0, PAGE)) == 1    # another server reads run 0: its mtime is now
    a.index.size_bytes = 2 * files[names[0]].stat().st_size
    with a.index.lock:
        a.index.evict_to_limit()
    assert {p.name for p in blob_files(tmp_path)} == {names[0], names[2]}      # run 1 went, not run 0
    a.close(), other.close()


def test_two_writers_of_the_same_runs_at_once_leave_whole_blobs(tmp_path):
    runs = [run_of(i, pages=16) for i in range(8)]
    tiers = [tier(tmp_path) for _ in range(4)]
    start = threading.Barrier(len(tiers))

    def write_all(t: FileTier) -> None:
        start.wait()
        for _, _, blob in runs:
            t._write_blob(blob)                          # straight to disk, as each server's writer thread does
    with ThreadPoolExecutor(len(tiers)) as pool:
        list(pool.map(write_all, tiers))
    assert len(blob_files(tmp_path)) == len(runs) and all(complete(p) for p in blob_files(tmp_path))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    reader = tier(tmp_path)
    for toks, hashes, blob in runs:
        (got,) = reader.read_chain(hashes, toks, 0, PAGE)
        assert torch.equal(got.kv, blob.kv)
    for t in tiers + [reader]:
        t.close()


def test_only_a_dead_writers_temporary_files_are_deleted(tmp_path):
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        mine = tmp_name()
        names = {"alive": mine.replace(f"-{os.getpid()}-", f"-{alive.pid}-"),
                 "dead": mine.replace(f"-{os.getpid()}-", f"-{dead.pid}-"),
                 "elsewhere fresh": tmp_name().rsplit("-", 1)[0] + "-otherbox",
                 "elsewhere old": tmp_name().rsplit("-", 1)[0] + "-otherbox",
                 "unnamed": ".tmp-0123abcd"}
        for name in names.values():
            (tmp_path / name).write_bytes(b"half a blob")
        old = time.time() - 2 * STALE_TMP_S
        os.utime(tmp_path / names["elsewhere old"], (old, old))
        t = tier(tmp_path)
        left = {k for k, name in names.items() if (tmp_path / name).exists()}
        assert left == {"alive", "elsewhere fresh"}
        t.close()
    finally:
        alive.kill()
        alive.wait()


# ---------------------------------------------------------------------------------------------------------------
# Two real servers on one folder

def metric(base_url: str, name: str) -> float:
    _, _, body = http("GET", base_url + "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def ask(base_url: str, prompt: list[int]) -> dict:
    status, _, raw = http("POST", base_url + "/v1/completions", {"model": "tinyserve", "prompt": prompt,
                                                                  "max_tokens": 4, "temperature": 0,
                                                                  "return_token_ids": True}, timeout=300)
    assert status == 200, raw
    return json.loads(raw)


@pytest.fixture
def two_servers(xdg, tmp_path):
    """Two servers with the demo model (one fingerprint) on one folder of ~12 runs."""
    folder = tmp_path / "kv"
    servers = []
    for name in ("a", "b"):
        cfg = server_config(free_port(), {"engine": {"kv_cache_tokens": 1024, "max_running_requests": 2},
                                          "cache": {"file": {"dir": str(folder), "size_gb": 0.001}}})
        (tmp_path / name).mkdir()
        servers.append(ServerProcess(tmp_path / name, cfg))
    with ThreadPoolExecutor(2) as pool:                  # both load at once
        list(pool.map(lambda s: s.start(), servers))
    yield folder, servers
    for s in servers:
        assert s.stop() == 0, s.log()


def test_two_servers_share_one_folder(two_servers):
    folder, (a, b) = two_servers
    limit = 0.001 * (1 << 30)
    prompt = tokens(300, 42)
    first = ask(a.base_url, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_until(lambda: blob_files(folder), "a's blobs on disk")
    wait_until(lambda: all(complete(p) for p in blob_files(folder)), "a's writes finished")
    second = ask(b.base_url, prompt)                     # b never restarted
    details = second["usage"]["prompt_tokens_details"]
    assert details["cached_tokens_by_tier"]["file"] > 0, (details, b.log())
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]

    # both write the same runs at once, then each evicts what the other may be reading: 16 prompts of ~60 KB of
    # blobs each for a folder of ~2 MB, sent to both servers together, each prompt twice
    prompts = [tokens(200 + 8 * i, 100 + i) for i in range(16)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda job: ask(job[0].base_url, job[1]),
                                [(s, p) for p in prompts + prompts for s in (a, b)]))
    by_prompt: dict[int, list[list[int]]] = {}
    for (i, _), r in zip([(i, s) for i in list(range(16)) * 2 for s in (a, b)], answers):
        by_prompt.setdefault(i, []).append(r["choices"][0]["token_ids"])
    for i, outs in by_prompt.items():                    # cold, warm, from either server: the same tokens
        assert all(o == outs[0] for o in outs), i
    hits = sum(r["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["file"] for r in answers)
    assert hits > 0
    for s in (a, b):                                     # gone blobs were misses, never errors
        assert metric(s.base_url, 'tinyserve:tier_errors_total{tier="file"}') == 0, s.log()
    wait_until(lambda: folder_bytes(folder) <= limit, f"the folder within size_gb ({folder_bytes(folder)} bytes)")
    assert all(complete(p) for p in blob_files(folder))


def test_a_server_alone_on_its_folder_does_not_list_it_again(tmp_path, monkeypatch):
    listings = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: listings.append(p) or real(p))
    a = tier(tmp_path)
    for i in range(3):
        a.write(run_of(i)[2])
        assert a.flush(30)
    a.index.listed_at = 0.0                          # a listing is due by the clock ...
    assert not a.index.refresh() and len(listings) == 1     # ... but only our own writes changed the folder
    b = tier(tmp_path)
    b.write(run_of(9)[2])
    assert b.flush(30)
    a.index.listed_at = 0.0
    assert a.index.refresh() and a.num_blobs == 4    # another writer changed it: listed
    a.close(), b.close()
