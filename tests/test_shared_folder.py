"""One cache folder for several servers (file_index.py): a run one writes is a hit for the others while they run,
writers never corrupt each other (every blob complete or absent), the folder's size_gb holds for the folder as a whole
(least recently used first across writers), and a blob another server deleted under a reader is a miss, not an error.

First the mechanism on FileTier objects sharing a folder (each one's own index, as two processes have), then two real
server processes on one folder: a prompt served by one is a file hit on the other without a restart, both writing the
same runs at once, and one evicting what the other reads.

Last, the faults of a network share (the issue's list): ESTALE, EIO, timeouts, a full disk, a blob evicted or replaced
by another box during a read, a half-written file of a box that died, clocks apart, two boxes with small budgets.
Injected at the file system calls the file tier makes (`Share`: its `open` and the file object's reads and writes;
this machine's kernel has neither an NFS server nor client, so no real export); the other box is another FileTier or
plain file operations on the same folder. Each is a miss or a skipped write: no good blob deleted, no token changed
(engines compared with a cold run), writes resume by themselves.
"""
from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import tinyserve.file_index as file_index
import tinyserve.file_tier as file_tier_module
from conftest import engine_for, tokens
from server_util import ServerProcess, free_port, http, server_config
from tinyserve.blob import HEADER, MAGIC, STATE_SUFFIX, SUFFIX, Blob, chain_hashes
from tinyserve.file_index import STALE_TMP_S, tmp_name
from tinyserve.file_tier import FileTier
from tinyserve.sampling import SamplingParams

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
    # then b reads the folder (its device and host tiers flushed), newest prompt first: the folder keeps the newest
    # runs (of either server), and each miss writes runs that push older ones out. (In the rounds above both servers
    # often compute a prompt at once and then hit their own device tier, so whether any of those reads the folder
    # depends on timing.)
    wait_until(lambda: all(complete(p) for p in blob_files(folder)), "the writes finished")
    status, _, raw = http("POST", b.base_url + "/flush_cache", {})
    assert status == 200, raw
    reread = [ask(b.base_url, p) for p in prompts[::-1]][::-1]
    for i, r in enumerate(reread):
        by_prompt[i].append(r["choices"][0]["token_ids"])
    for i, outs in by_prompt.items():                    # cold, warm, from either server, reread: the same tokens
        assert all(o == outs[0] for o in outs), i
    hits = sum(r["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["file"] for r in answers + reread)
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


def test_a_blob_another_server_writes_while_we_write_ours_is_listed(tmp_path, monkeypatch):
    """Our own writes change the folder's mtime, and a change we caused needs no listing; another server's rename
    landing while we write a blob changes it too. It must not pass for ours: a later listing finds that blob."""
    a, b = tier(tmp_path), tier(tmp_path)
    assert a.index.refresh(force=True)               # a knows the folder as it is (b's start changed it)
    share = Share(monkeypatch)
    toks, hashes, other = run_of(2)

    def b_writes_meanwhile(path, data):
        b._write_blob(other)                         # b's whole write, rename included, while a's file is open
    share.on("write", b_writes_meanwhile, match=lambda name: name.startswith(".tmp-"), times=1)
    a.write(run_of(1)[2])
    assert a.flush(30)
    assert (tmp_path / name_of(other)).exists() and a.num_blobs == 1
    a.index.listed_at = 0.0
    assert a.index.refresh() and a.num_blobs == 2
    (got,) = a.read_chain(hashes, toks, 0, PAGE)
    assert torch.equal(got.kv, other.kv)
    a.close(), b.close()


# ---------------------------------------------------------------------------------------------------------------
# Faults of a network share, injected at the file system calls (this kernel has no NFS: no nfs / nfsd file system)

def oserror(code: int) -> OSError:
    return OSError(code, os.strerror(code))


class Share:
    """The folder as a network share's faults show it: rules run at the file tier's `open` of a file, and at the
    file object's reads ("read" before the bytes come, "after_read" after: it may return other bytes), writes and
    close, and raise there what NFS raises. The file tier's code is not changed: its module's `open` is this one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rules: list[dict] = []
        self.opened: list[str] = []                   # names opened for reading
        monkeypatch.setattr(file_tier_module, "open", self._open, raising=False)

    def on(self, when: str, action, match=lambda name: name.endswith((SUFFIX, STATE_SUFFIX)),
           times: int | None = None) -> None:
        self.rules.append({"when": when, "action": action, "match": match, "times": times})

    def fail(self, when: str, error, **kw) -> None:
        """Raise error() at every `when` of a matching file."""
        def action(path, data):
            raise error()
        self.on(when, action, **kw)

    def fire(self, when: str, path: Path, data=None):
        for rule in list(self.rules):
            if rule["when"] == when and rule["match"](path.name) and rule["times"] != 0:
                if rule["times"] is not None:
                    rule["times"] -= 1
                out = rule["action"](path, data)
                data = data if out is None else out
        return data

    def _open(self, path, mode="r", *args, **kwargs):
        path = Path(path)
        if "r" in mode:
            self.opened.append(path.name)
        self.fire("open", path)
        return FaultyFile(builtins.open(path, mode, *args, **kwargs), self, path)


class FaultyFile:
    def __init__(self, f, share: Share, path: Path) -> None:
        self.f, self.share, self.path = f, share, path

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()
        self.share.fire("close", self.path)

    def fileno(self) -> int:
        return self.f.fileno()

    def read(self, *args) -> bytes:
        self.share.fire("read", self.path)
        return self.share.fire("after_read", self.path, self.f.read(*args))

    def write(self, data) -> int:
        self.share.fire("write", self.path, data)
        return self.f.write(data)


class Clock:
    """This box's clock, `skew` seconds off the folder's (the file tier's modules' time module, `skewed`)."""

    def __init__(self, skew: float) -> None:
        self.skew = skew

    def time(self) -> float:
        return time.time() + self.skew

    def __getattr__(self, name: str):
        return getattr(time, name)


def skewed(monkeypatch: pytest.MonkeyPatch, skew: float) -> None:
    for module in (file_index, file_tier_module):
        monkeypatch.setattr(module, "time", Clock(skew))


@pytest.fixture
def deletes(monkeypatch) -> list[str]:
    """Names of the blob files the file tier's index deleted (eviction or a bad blob), in order: the unlinks that
    removed a file (of two boxes unlinking one file at once, one does)."""
    out: list[str] = []
    real = file_index.unlink

    def unlink(path: Path) -> bool:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return True
        except OSError:
            return real(path)                # what the file tier does with a file it cannot delete
        out.append(path.name)
        return True
    monkeypatch.setattr(file_index, "unlink", unlink)
    return out


def blob_size(tmp_path: Path) -> int:
    probe = tier(tmp_path / "size-probe")
    probe.write(run_of(0)[2])
    assert probe.flush(30)
    probe.close()
    return blob_files(tmp_path / "size-probe")[0].stat().st_size


def name_of(blob: Blob) -> str:
    return f"{blob.start_hash.hex()}-{blob.end_hash.hex()}{SUFFIX}"


# ---- engines: a token result is compared with a cold run

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
SESSIONS = {name: tokens(250, seed) for name, seed in (("A", 1), ("B", 2), ("C", 3))}


@pytest.fixture(scope="module")
def cold(hybrid_model) -> dict[str, list[int]]:
    eng = engine_for(hybrid_model, engine={"page_size": 16, "kv_cache_tokens": 4096}, cache={"enabled": False})
    out = {name: eng.generate([p], GREEDY)[0] for name, p in SESSIONS.items()}
    eng.close()
    return out


def box(model, folder: Path):
    """A server on the folder: a file tier behind a device pool too small for two sessions."""
    return engine_for(model, engine={"page_size": 16, "kv_cache_tokens": 400, "max_running_requests": 1},
                      cache={"file": {"dir": str(folder), "size_gb": 1.0, "prefetch_policy": "wait_complete"}})


def serve(eng, name: str):
    (req,) = eng.run_requests([SESSIONS[name]], GREEDY)
    return req


def from_file(req) -> int:
    return req.report["cached_by_tier"]["file"]


def a_new_box_reads(model, folder: Path, cold: dict, names: str) -> None:
    """A box started on the folder now serves each session from it, with the cold tokens and no read error."""
    again = box(model, folder)
    for name in names:
        r = serve(again, name)
        assert r.output_ids == cold[name] and from_file(r) > 0, name
    assert again.cache.file.stats.errors == 0
    again.close()


@pytest.fixture(scope="module")
def stored(hybrid_model, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A folder where a box stored sessions A and B (one blob each)."""
    folder = tmp_path_factory.mktemp("stored")
    eng = box(hybrid_model, folder)
    names = {}
    for name in "AB":
        before = set(os.listdir(folder))
        serve(eng, name)
        assert eng.cache.file.flush(30)
        (names[name],) = set(os.listdir(folder)) - before
    eng.close()
    return folder, names


@pytest.fixture
def shared(stored, tmp_path) -> tuple[Path, dict[str, Path]]:
    """A copy of the stored folder: the share this test's boxes use."""
    src, names = stored
    folder = tmp_path / "share"
    shutil.copytree(src, folder)
    return folder, {k: folder / v for k, v in names.items()}


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in blob_files(folder)}


READ_FAULTS = {
    "ESTALE at open": ("open", lambda: oserror(errno.ESTALE)),
    "ESTALE at read": ("read", lambda: oserror(errno.ESTALE)),      # also once more through the name
    "EIO at read": ("read", lambda: oserror(errno.EIO)),
    "ETIMEDOUT at read": ("read", lambda: oserror(errno.ETIMEDOUT)),
    "TimeoutError at read": ("read", lambda: TimeoutError(errno.ETIMEDOUT, "soft mount: server not responding")),
    "EACCES at open": ("open", lambda: oserror(errno.EACCES)),
    "short read": ("after_read", None),
}


@pytest.mark.parametrize("fault", list(READ_FAULTS))
def test_a_read_that_fails_is_a_miss_that_leaves_the_blob(hybrid_model, cold, shared, monkeypatch, deletes, fault):
    """ESTALE, EIO, a timeout, EACCES or a short read: the request is served cold (same tokens), the blob is not
    deleted nor counted bad, it is not read again by the next request, and once the share is well it is a hit."""
    folder, blobs = shared
    before = contents(folder)
    share = Share(monkeypatch)
    when, error = READ_FAULTS[fault]
    if error is None:
        share.on(when, lambda path, data: data[:len(data) // 2])
    else:
        share.fail(when, error)
    eng = box(hybrid_model, folder)
    tier = eng.cache.file
    for name in "AB":
        r = serve(eng, name)
        assert r.output_ids == cold[name] and from_file(r) == 0
    reads = share.opened.count(blobs["A"].name)
    r = serve(eng, "A")                                  # off the device by now; its blob failed a moment ago
    assert r.output_ids == cold["A"] and share.opened.count(blobs["A"].name) == reads
    assert tier.stats.errors == 0 and tier.stats.read_failures >= 2
    assert tier.num_blobs == 2 and not deletes
    assert tier.flush(30) and contents(folder) == before  # nothing deleted, nothing rewritten
    eng.close()

    share.rules.clear()                                 # the share is well again: a box that reads it now hits
    a_new_box_reads(hybrid_model, folder, cold, "AB")


@pytest.mark.parametrize("other_box", ["replaces it", "evicts it"])
def test_a_blob_another_box_replaces_or_evicts_during_a_read(hybrid_model, cold, shared, monkeypatch, deletes,
                                                             other_box):
    """Between our open and our read another box renames a new copy of the run over the blob, or evicts it; NFS
    answers the read with ESTALE. Read again through the name: the new copy is a hit (and stays); a blob gone is a
    plain miss: no error, nothing deleted by us."""
    folder, blobs = shared
    good = blobs["A"].read_bytes()

    def other(path: Path, data) -> None:
        if other_box == "replaces it":
            tmp = folder / tmp_name()
            tmp.write_bytes(good)
            os.replace(tmp, path)
        else:
            path.unlink()
        raise oserror(errno.ESTALE)
    share = Share(monkeypatch)
    share.on("read", other, match=lambda name: name == blobs["A"].name, times=1)
    eng = box(hybrid_model, folder)
    tier = eng.cache.file
    r = serve(eng, "A")
    assert r.output_ids == cold["A"]
    assert tier.stats.errors == tier.stats.read_failures == 0 and not deletes
    if other_box == "replaces it":
        assert from_file(r) > 0 and blobs["A"].read_bytes() == good
    else:
        assert from_file(r) == 0
        assert tier.flush(30) and complete(blobs["A"])   # computed, so written again
    assert blobs["B"].read_bytes() == (folder / blobs["B"].name).read_bytes() and complete(blobs["B"])
    eng.close()


@pytest.mark.parametrize("meanwhile", ["nothing", "another box renames a good copy in"])
def test_a_half_written_blob_under_its_name(hybrid_model, cold, shared, monkeypatch, deletes, meanwhile):
    """A box died (or its server lost power) after renaming a blob whose data never all reached the disk: the half
    that is there fails its checks, so it is a miss (counted) and is deleted; but not when, between our read and our
    delete, another box renamed a good copy into its place: that one stays, and serves this very request (a miss
    looks for the exact name on disk)."""
    folder, blobs = shared
    good = blobs["A"].read_bytes()
    blobs["A"].write_bytes(good[:len(good) // 2])
    share = Share(monkeypatch)
    if meanwhile != "nothing":
        def rename_good_in(path: Path, data: bytes) -> None:
            tmp = folder / tmp_name()
            tmp.write_bytes(good)
            os.replace(tmp, path)
        share.on("after_read", rename_good_in, match=lambda name: name == blobs["A"].name, times=1)
    eng = box(hybrid_model, folder)
    r = serve(eng, "A")
    assert r.output_ids == cold["A"] and (from_file(r) == 0) == (meanwhile == "nothing")
    assert eng.cache.file.stats.errors == 1
    assert deletes == ([blobs["A"].name] if meanwhile == "nothing" else [])
    assert eng.cache.file.flush(30) and complete(blobs["A"])  # the good copy, or ours written again
    eng.close()
    a_new_box_reads(hybrid_model, folder, cold, "A")


def test_a_dead_boxs_temporary_files_are_never_read_and_go_only_when_old_by_the_folders_clock(tmp_path, monkeypatch):
    """A box died before renaming: its temporary file (even a whole blob's bytes) is no blob. It goes once it is
    STALE_TMP_S old by the folder's clock (a file this box just wrote), whatever this box's own clock says."""
    toks, hashes, blob = run_of(1)
    w = tier(tmp_path / "w")
    w.write(blob)
    assert w.flush(30)
    w.close()
    whole = blob_files(tmp_path / "w")[0].read_bytes()
    folder = tmp_path / "share"
    folder.mkdir()
    dead = {"whole": folder / (tmp_name().rsplit("-", 1)[0] + "-deadbox"),
            "half": folder / (tmp_name().rsplit("-", 1)[0] + "-deadbox")}
    dead["whole"].write_bytes(whole)
    dead["half"].write_bytes(whole[:len(whole) // 2])
    skewed(monkeypatch, +86400)                                # this box's clock a day ahead: they look old to it
    a = tier(folder)
    assert a.num_blobs == 0 and a.read_chain(hashes, toks, 0, PAGE) == []
    assert all(p.exists() for p in dead.values())              # fresh by the folder's clock: a writer may be alive
    a.close()
    old = time.time() - 2 * STALE_TMP_S
    for p in dead.values():
        os.utime(p, (old, old))
    skewed(monkeypatch, -86400)                                # a day behind: they look new to it
    b = tier(folder)
    assert not any(p.exists() for p in dead.values()) and b.stats.errors == 0
    b.close()


@pytest.mark.parametrize("skew", [+86400.0, -86400.0])
def test_this_boxs_clock_off_by_a_day_stamps_nothing_with_it(tmp_path, monkeypatch, skew):
    """Writes and reads stamp blobs with the folder's clock (a read touches with no time given: the file server's
    on NFS), so a box whose clock is a day off neither makes the blobs it reads immortal nor the first to go."""
    skewed(monkeypatch, skew)
    runs = [run_of(i) for i in range(3)]
    w = tier(tmp_path)
    for _, _, blob in runs:
        w.write(blob)
        assert w.flush(30)
    w.close()
    assert all(abs(p.stat().st_mtime - time.time()) < 60 for p in blob_files(tmp_path))
    for age, (_, _, blob) in zip((3000, 2000, 1000), runs):      # run 0 the least recently used
        os.utime(tmp_path / name_of(blob), (time.time() - age, time.time() - age))
    a = tier(tmp_path, 1 << 30)
    assert a.flush(30)
    toks, hashes, _ = runs[0]
    assert len(a.read_chain(hashes, toks, 0, PAGE)) == 1          # now the most recently used
    assert abs((tmp_path / name_of(runs[0][2])).stat().st_mtime - time.time()) < 60
    a.index.size_bytes = 2 * (tmp_path / name_of(runs[0][2])).stat().st_size
    with a.index.lock:
        a.index.evict_to_limit()
    assert {p.name for p in blob_files(tmp_path)} == {name_of(runs[0][2]), name_of(runs[2][2])}
    assert abs(a.index.folder_now() - time.time()) < 60
    a.close()


def test_another_boxs_files_stamped_far_in_the_future_or_past(tmp_path, deletes):
    """Another box's blobs with mtimes a day ahead (its clock ran ahead) are counted only while they are there: once
    that box evicts them, ours forgets them at its next listing and deletes nothing for bytes that are gone. One a
    day in the past that we read is ours to keep like any blob just used."""
    one = blob_size(tmp_path)
    folder = tmp_path / "share"
    a, b = tier(folder, 4 * one), tier(folder, 4 * one)
    mine = [run_of(i) for i in range(1, 4)]
    theirs = [run_of(i) for i in range(10, 13)]
    for _, _, blob in mine[:2]:
        a.write(blob)
        assert a.flush(30)
    for _, _, blob in theirs[:2]:
        b.write(blob)
        assert b.flush(30)
        future = time.time() + 86400
        os.utime(folder / name_of(blob), (future, future))
    assert a.index.refresh(force=True) and a.num_blobs == 4
    for _, _, blob in theirs[:2]:                     # b evicts them (or a third box does)
        with b.index.lock:
            b.index.remove(blob.start_hash, blob.end_hash)
    a.index.listed_at = 0.0                            # a listing is due at a's next write
    a.write(mine[2][2])
    assert a.flush(30)
    assert {p.name for p in blob_files(folder)} == {name_of(blob) for _, _, blob in mine}
    assert a.used_bytes == 3 * one and deletes == [name_of(blob) for _, _, blob in theirs[:2]]   # b's, not a's

    toks, hashes, past = theirs[2]                     # a day in the past, then read by a
    b.write(past)
    assert b.flush(30)
    old = time.time() - 86400
    os.utime(folder / name_of(past), (old, old))
    assert len(a.read_chain(hashes, toks, 0, PAGE)) == 1
    a.index.listed_at = 0.0
    a.write(run_of(4)[2])                              # five blobs for room of four: the least recently used goes
    assert a.flush(30)
    assert deletes[2:] == [name_of(mine[0][2])] and (folder / name_of(past)).exists()
    assert a.stats.errors == b.stats.errors == 0
    a.close(), b.close()


@pytest.mark.parametrize("code,at", [(errno.ENOSPC, "write"), (errno.EDQUOT, "close"), (errno.EFBIG, "write")])
def test_a_full_disk_makes_room_and_the_write_goes_on(tmp_path, deletes, code, at):
    """A disk smaller than size_gb (or a quota): a write that finds it full evicts the least recently used blobs
    it needs room for and is tried again, so writes go on without a pause or a restart."""
    one = blob_size(tmp_path)
    folder = tmp_path / "share"
    folder.mkdir()
    capacity = 3 * one + one // 2

    def full(path: Path, data) -> None:            # NFS may tell only at close
        pending = len(data) if data is not None else 0
        if sum(p.stat().st_size for p in folder.iterdir()) + pending > capacity:
            raise oserror(code)
    with pytest.MonkeyPatch.context() as mp:
        share = Share(mp)
        share.on(at, full, match=lambda name: name.startswith(".tmp-"))
        a = tier(folder, 10 * one)
        runs = [run_of(i) for i in range(1, 7)]
        for _, _, blob in runs:
            a.write(blob)
            assert a.flush(30)
            assert folder_bytes(folder) <= capacity and a.writable
        assert {p.name for p in blob_files(folder)} == {name_of(blob) for _, _, blob in runs[3:]}
        assert deletes == [name_of(blob) for _, _, blob in runs[:3]]        # least recently used first, one each
        assert a.stats.write_failures == 0 and not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]
        for toks, hashes, blob in runs[3:]:
            (got,) = a.read_chain(hashes, toks, 0, PAGE)
            assert torch.equal(got.kv, blob.kv)
        a.close()


def test_a_disk_full_of_others_data_pauses_writes_until_space_frees(hybrid_model, cold, tmp_path, monkeypatch):
    """The disk is full of what is not ours to delete: the write is skipped (tokens unchanged), writes pause, and
    once space frees they resume by themselves, no restart: a later session is stored and hits on another box."""
    folder = tmp_path / "share"
    disk_full = [True]

    def full(path: Path, data) -> None:
        if disk_full[0]:
            raise oserror(errno.ENOSPC)
    share = Share(monkeypatch)
    share.on("write", full, match=lambda name: name.startswith(".tmp-"))
    eng = box(hybrid_model, folder)
    tier_ = eng.cache.file
    assert serve(eng, "A").output_ids == cold["A"]
    assert tier_.flush(30) and not tier_.writable and eng.stats().cache.file.writable is False
    assert serve(eng, "B").output_ids == cold["B"]
    assert tier_.flush(30) and not blob_files(folder) and tier_.stats.write_failures >= 1
    disk_full[0] = False                                 # space frees
    wait_until(lambda: tier_.writable, "writes resumed", timeout=10)
    assert serve(eng, "C").output_ids == cold["C"]
    assert tier_.flush(30) and len(blob_files(folder)) == 1 and tier_.writable
    eng.close()
    a_new_box_reads(hybrid_model, folder, cold, "C")


def test_two_boxes_with_small_budgets_share_a_folder_without_a_storm(tmp_path, deletes):
    """Both count the whole folder against their size_gb and evict in one order, the files' ages. While the folder
    is within it, nothing is deleted, another box's blobs included; past it each write deletes exactly what it must,
    the least recently used, whoever wrote it; a blob another box read lately is passed over;
    the folder never exceeds the budget. Then both write at once: the folder still ends within it, with at most a
    blob or two more deleted than needed (two boxes evicting for the same excess at the same moment)."""
    one = blob_size(tmp_path)
    folder = tmp_path / "share"
    a, b = tier(folder, 4 * one), tier(folder, 4 * one)
    order: list[str] = []                                # least recently used first, by the files' mtimes
    expected: list[str] = []                             # what exact LRU eviction deletes

    def put(t: FileTier, i: int) -> None:
        time.sleep(0.01)                                 # mtimes apart (a coarse file system clock)
        t.index.listed_at = 0.0                          # each write lists the folder (what RESCAN_S later does)
        blob = run_of(i)[2]
        t.write(blob)
        assert t.flush(30)
        order.append(name_of(blob))
        while len(order) > 4:
            expected.append(order.pop(0))
        assert folder_bytes(folder) <= 4 * one and t.used_bytes <= 4 * one

    for i in range(2):
        put(a, i)
        put(b, 100 + i)
    assert len(blob_files(folder)) == 4 and not deletes  # within budget: b's blobs survive a's writes and back
    for i in range(2, 8):
        put(a, i)
        if i == 4:                                        # a reads b's oldest: b's next write passes it over
            time.sleep(0.01)
            toks, hashes, blob = run_of(100 + 2)
            assert order[0] == name_of(blob) and len(a.read_chain(hashes, toks, 0, PAGE)) == 1
            order.append(order.pop(0))
        put(b, 100 + i)
    assert deletes == expected and len(deletes) == 16 - 4
    assert {p.name for p in blob_files(folder)} == set(order) and all(complete(folder / n) for n in order)

    deletes.clear()
    with ThreadPoolExecutor(2) as pool:
        def many(job):
            t, base = job
            for i in range(base, base + 8):
                t.index.listed_at = 0.0
                t.write(run_of(i)[2])
                assert t.flush(30)
        list(pool.map(many, [(a, 200), (b, 300)]))
    for t in (a, b):
        t.index.listed_at = 0.0
        t._keep_size()
    left = blob_files(folder)
    assert 2 <= len(left) <= 4 and folder_bytes(folder) <= 4 * one and all(complete(p) for p in left)
    assert len(deletes) <= 16 + 4 - len(left) + 2
    assert a.stats.errors == b.stats.errors == 0
    a.close(), b.close()
