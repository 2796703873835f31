"""Cache tiers (issue 5): host memory (L2) and a file folder (L3) behind the radix tree, state snapshots included.

Every test compares against a cold run (enable_prefix_cache=False): a hit from any tier must give exactly the same
greedy tokens. Real files on disk in tmp_path, real engines on tiny fp32 checkpoints, a real server process for the
restart test and a real SIGKILL for the crash test.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoints import make_qwen3_5_text
from conftest import TEST_DEVICE, engine_for, merge, tokens
from server_util import ServerProcess, free_port, http, server_config
from tinyserve.blob import SUFFIX, chain_hashes, model_fingerprint
from tinyserve.engine import Engine
from tinyserve.build import engine_for_model
from tinyserve.file_tier import FileTier
from tinyserve.loader import load_model
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
GIB = 1 << 30
SESSION = 250                  # prompt tokens of one session; three of them do not fit a 400-token device pool


@pytest.fixture(scope="module")
def model(hybrid_model):
    return hybrid_model


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Same shapes, other weights: its blobs must never be taken for ours."""
    folder, _ = make_qwen3_5_text(tmp_path_factory.mktemp("other"), max_position_embeddings=2048, seed=7)
    return load_model(folder, torch.float32, TEST_DEVICE)


SESSIONS = {name: tokens(SESSION, seed) for name, seed in (("A", 1), ("B", 2), ("C", 3))}


@pytest.fixture(scope="module")
def cold(model):
    """Greedy tokens of each session from an engine without any cache."""
    eng = engine_for(model, engine={"page_size": 16, "kv_cache_tokens": 4096}, cache={"enabled": False})
    return {name: eng.generate([p], GREEDY)[0] for name, p in SESSIONS.items()}


def small_engine(model, page_size: int = 16, host: dict | None = None, file: dict | None = None,
                 host_state_share: float | None = None) -> Engine:
    """A device pool too small for two sessions, one request at a time; `host` and `file` are the [cache.host]
    and [cache.file] tables."""
    file = {"prefetch_policy": "wait_complete", **(file or {})}   # run_requests steps at once: wait for the read
    return engine_for(model, engine={"page_size": page_size, "kv_cache_tokens": 400, "max_running_requests": 1},
                      cache={"host": host or {}, "file": file}, host_state_share=host_state_share)


def host_tier(eng: Engine):
    return eng.cache.host


def file_tier(eng: Engine):
    return eng.cache.file


def run(eng: Engine, name: str):
    (req,) = eng.run_requests([SESSIONS[name]], GREEDY)
    return req


def blob_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX))


def assert_all_free(eng: Engine) -> None:
    assert eng.flush_cache()
    assert eng.allocator.num_free == eng.allocator.num_pages
    assert eng.state_pool.num_free == eng.state_pool.num_slots
    assert eng.state_pool.num_free_snapshots == eng.state_pool.num_snapshot_slots
    eng.cache.check()
    assert eng.cache.stats().cached_pages == 0 and eng.cache.stats().snapshots_held == 0
    if host_tier(eng) is not None:
        assert host_tier(eng).num_free_pages == host_tier(eng).num_pages
        assert host_tier(eng).num_free_snapshots == host_tier(eng).num_snapshots


# ---------------------------------------------------------------------------------------------------------------
# 1. The users' experiment: A, B, C, then A again; host hit, control without tiers, file hit after a restart

@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_experiment_host_hit_then_file_hit_after_restart(model, cold, tmp_path, policy, page_size):
    usable = (SESSION - 1) // page_size * page_size
    host, file = {"size_gb": 0.01, "write_policy": policy}, {"dir": str(tmp_path), "size_gb": 1.0}
    eng = small_engine(model, page_size, host=host, file=file)
    for name in "ABC":
        r = run(eng, name)
        assert r.output_ids == cold[name] and r.cached_tokens == 0
    again = run(eng, "A")
    assert again.output_ids == cold["A"]
    assert again.report["cached_by_tier"]["host"] > 0, again.report["cached_by_tier"]
    assert again.cached_tokens == usable == sum(again.report["cached_by_tier"].values())
    assert eng.stats().cache.host.hit_tokens > 0
    eng.close()
    assert blob_files(tmp_path)

    control = small_engine(model, page_size)                # device cache alone: A was evicted, recomputed
    for name in "ABC":
        assert run(control, name).output_ids == cold[name]
    again = run(control, "A")
    assert again.output_ids == cold["A"] and again.cached_tokens == 0

    restarted = small_engine(model, page_size, host=host, file=file)
    assert file_tier(restarted).num_blobs == len(blob_files(tmp_path))
    first = run(restarted, "A")
    assert first.output_ids == cold["A"]
    assert first.report["cached_by_tier"]["file"] > 0, first.report["cached_by_tier"]
    assert first.cached_tokens == usable
    assert file_tier(restarted).stats.errors == 0
    restarted.close()
    assert_all_free(restarted)


def test_write_through_selective_backs_up_on_the_second_hit(model, cold, tmp_path):
    eng = small_engine(model, host={"size_gb": 0.01, "write_policy": "write_through_selective"},
                       file={"dir": str(tmp_path), "size_gb": 1.0})
    run(eng, "A")
    assert host_tier(eng).num_free_pages == host_tier(eng).num_pages       # inserted, not backed up
    file_tier(eng).flush(10)
    assert not blob_files(tmp_path)
    run(eng, "A")                                                         # first hit
    assert host_tier(eng).num_free_pages == host_tier(eng).num_pages
    r = run(eng, "A")                                                     # second hit: backed up now
    assert r.output_ids == cold["A"] and r.report["cached_by_tier"]["device"] > 0
    assert host_tier(eng).num_free_pages < host_tier(eng).num_pages
    file_tier(eng).flush(10)
    assert blob_files(tmp_path)
    run(eng, "B"), run(eng, "C")                                          # evict A from the device
    again = run(eng, "A")
    assert again.output_ids == cold["A"] and again.report["cached_by_tier"]["host"] > 0
    eng.close()
    assert_all_free(eng)


# ---------------------------------------------------------------------------------------------------------------
# 2. File hit after a real restart of the server process

@pytest.mark.slow
def test_file_hit_after_a_real_server_restart(xdg, tmp_path):
    """With the default prefetch policy: the first request after a restart is served from the file tier."""
    cache_dir = tmp_path / "kv"
    cfg = server_config(free_port(), {
        "engine": {"kv_cache_tokens": 1024, "max_running_requests": 2},
        "cache": {"file": {"dir": str(cache_dir), "size_gb": 1.0}}})
    prompt = tokens(300, 42)            # ids < 256 < the demo vocabulary (663)
    body = {"model": "tinyserve", "prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}

    def ask(server: ServerProcess) -> dict:
        status, _, raw = http("POST", server.base_url + "/v1/completions", body, timeout=120)
        assert status == 200, raw
        return json.loads(raw)

    server = ServerProcess(tmp_path, cfg, env={"XDG_CACHE_HOME": str(xdg)}).start()
    try:
        first = ask(server)
    finally:
        assert server.stop() == 0, server.log()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert blob_files(cache_dir), server.log()

    server = ServerProcess(tmp_path, cfg, env={"XDG_CACHE_HOME": str(xdg)}).start()
    try:
        second = ask(server)
    finally:
        assert server.stop() == 0, server.log()
    details = second["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] > 0, details
    assert details["cached_tokens_by_tier"]["file"] > 0, details
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


# ---------------------------------------------------------------------------------------------------------------
# 3. Damage: truncated, flipped and foreign blobs; an unwritable folder; a size limit below one session

def write_sessions(model, folder: Path, names: str = "ABC") -> dict[str, Path]:
    """Run each session once through a file-only engine; returns each session's blob."""
    eng = small_engine(model, file={"dir": str(folder), "size_gb": 1.0})
    out = {}
    for name in names:
        before = set(blob_files(folder))
        run(eng, name)
        file_tier(eng).flush(10)
        (new,) = set(blob_files(folder)) - before
        out[name] = new
    eng.close()
    return out


def test_damaged_blobs_are_misses_counted_and_deleted(model, other_model, cold, tmp_path):
    ours = write_sessions(model, tmp_path / "ours")
    theirs = write_sessions(other_model, tmp_path / "theirs", "C")
    data = {name: p.read_bytes() for name, p in ours.items()}
    # (a) truncated mid-payload, (b) bytes flipped inside the KV, (c) another model's blob under our name
    ours["A"].write_bytes(data["A"][:len(data["A"]) // 2])
    flipped = bytearray(data["B"])
    for i in range(len(flipped) // 2, len(flipped) // 2 + 8):
        flipped[i] ^= 0xFF
    ours["B"].write_bytes(bytes(flipped))
    ours["C"].write_bytes(theirs["C"].read_bytes())

    eng = small_engine(model, host={"write_policy": "write_back"},
                       file={"dir": str(tmp_path / "ours"), "size_gb": 1.0})
    assert file_tier(eng).num_blobs == 3                    # indexed from the listing: nothing read yet
    for n, name in enumerate("ABC", 1):
        r = run(eng, name)
        assert r.output_ids == cold[name]
        assert r.cached_tokens == 0
        assert file_tier(eng).stats.errors == n
        assert not ours[name].exists()                     # write_back: nothing rewrote it yet
    assert eng.stats().cache.file.errors == 3
    eng.close()

    # a damaged blob at the start of a chain does not hide the sound one after it... and a fresh engine serves
    # the sessions again once they were rewritten
    eng = small_engine(model, file={"dir": str(tmp_path / "ours"), "size_gb": 1.0})
    for name in "ABC":
        assert run(eng, name).output_ids == cold[name]
    eng.close()
    again = small_engine(model, file={"dir": str(tmp_path / "ours"), "size_gb": 1.0})
    for name in "ABC":
        r = run(again, name)
        assert r.output_ids == cold[name] and r.report["cached_by_tier"]["file"] > 0
    assert file_tier(again).stats.errors == 0
    again.close()


def test_blob_with_wrong_tokens_under_a_chain_name_is_rejected(model, cold, tmp_path):
    """A blob of session B renamed to session A's name (same fingerprint, wrong tokens): a miss, not B's KV."""
    blobs = write_sessions(model, tmp_path, "AB")
    blobs["A"].write_bytes(blobs["B"].read_bytes())
    eng = small_engine(model, file={"dir": str(tmp_path), "size_gb": 1.0})
    r = run(eng, "A")
    assert r.output_ids == cold["A"] and r.cached_tokens == 0
    assert file_tier(eng).stats.errors == 1
    eng.close()


def test_entries_that_cannot_be_read_or_deleted_are_misses(model, cold, tmp_path):
    """A directory where a blob or a temporary file should be (cannot be read, cannot be unlinked): start and
    serving go on, the blob counts as an error."""
    blobs = write_sessions(model, tmp_path, "A")
    blobs["A"].unlink()
    blobs["A"].mkdir()
    (blobs["A"] / "x").write_text("x")
    (tmp_path / ".tmp-stuck").mkdir()
    (tmp_path / ".tmp-stuck" / "x").write_text("x")
    eng = small_engine(model, file={"dir": str(tmp_path), "size_gb": 1.0})
    for name in "AA":
        assert run(eng, name).output_ids == cold[name]
    assert file_tier(eng).stats.errors == 1
    eng.close()


def test_fingerprint_tells_set_ups_apart(model, other_model):
    fp = model_fingerprint(model, torch.float32, 16)
    assert fp == model_fingerprint(model, torch.float32, 16)
    assert fp != model_fingerprint(other_model, torch.float32, 16)      # same architecture, other weights
    assert fp != model_fingerprint(model, torch.bfloat16, 16)
    assert fp != model_fingerprint(model, torch.float32, 1)


def test_unwritable_folder_disables_writes_and_serving_goes_on(model, cold, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    eng = small_engine(model, host={"size_gb": 0.01}, file={"dir": str(blocker / "kv"), "size_gb": 1.0})
    assert file_tier(eng).writable is False
    assert eng.stats().cache.file.writable is False
    for name in "ABCA":
        assert run(eng, name).output_ids == cold[name]
    eng.close()
    assert_all_free(eng)


def test_folder_that_becomes_unwritable_disables_writes(model, cold, tmp_path):
    """The folder vanishes (replaced by a file) after start: the write fails, writes are disabled, no crash."""
    folder = tmp_path / "kv"
    eng = small_engine(model, file={"dir": str(folder), "size_gb": 1.0})
    assert file_tier(eng).writable
    folder.rmdir()
    folder.write_text("now a file")
    for name in "AB":
        assert run(eng, name).output_ids == cold[name]
    file_tier(eng).flush(10)
    assert file_tier(eng).writable is False
    assert run(eng, "A").output_ids == cold["A"]
    eng.close()


@pytest.mark.parametrize("blobs_that_fit", [0.5, 1.5])
def test_size_limit_below_one_session(model, cold, tmp_path, blobs_that_fit):
    one = write_sessions(model, tmp_path / "probe", "A")["A"].stat().st_size
    limit = int(one * blobs_that_fit)
    folder = tmp_path / "kv"
    eng = small_engine(model, file={"dir": str(folder), "size_gb": limit / GIB})
    for name in "ABCA":
        assert run(eng, name).output_ids == cold[name]
        file_tier(eng).flush(10)
        assert sum(p.stat().st_size for p in blob_files(folder)) <= limit
        assert file_tier(eng).used_bytes <= limit
    assert len(blob_files(folder)) == int(blobs_that_fit)
    eng.close()


# ---------------------------------------------------------------------------------------------------------------
# 4. Load: many concurrent sessions, tiny device pool, tiny host tier, file tier on

@pytest.mark.slow
def test_concurrent_sessions_with_host_evictions_match_uncached(model, tmp_path):
    bases = [tokens(150, 300 + i) for i in range(3)]
    prompts = [bases[i % 3][:100 + 10 * i] + tokens(20 + 5 * i, 400 + i) for i in range(8)]
    kw = dict(page_size=16, max_running_requests=3, chunked_prefill_size=64)
    expected = engine_for(model, engine=dict(kw, kv_cache_tokens=4096), cache={"enabled": False}).generate(
        prompts, GREEDY)
    # host arena: about 12 pages and a few snapshots, far less than the 8 sessions cached
    probe = engine_for(model, engine=dict(kw, kv_cache_tokens=512), cache={"host": {"size_gb": 1e-9}})
    page_bytes = probe.kv_pool.bytes_per_page
    host_gb = 16 * page_bytes / GIB
    cache = {"state_slots": 4, "state_track_interval": 64,
             "host": {"size_gb": host_gb, "write_policy": "write_through"},
             "file": {"dir": str(tmp_path), "size_gb": 1.0}}
    eng = engine_for(model, engine=dict(kw, kv_cache_tokens=512), cache=cache, host_state_share=0.3)
    assert 0 < host_tier(eng).num_pages < 20 and host_tier(eng).num_snapshots >= 1

    async def scenario(ps):
        await eng.start()
        try:
            streams = [eng.submit(p, GREEDY) for p in ps]

            async def collect(s):
                return [e.token_id async for events in s for e in events]
            return await asyncio.gather(*(collect(s) for s in streams)), streams
        finally:
            await eng.stop()

    outs, _ = asyncio.run(scenario(prompts))
    assert outs == expected
    assert_all_free(eng)
    # again, everything from the host and file tiers now (the device cache was flushed)
    cache = merge(cache, {"host": {"write_policy": "write_back"}, "file": {"prefetch_policy": "wait_complete"}})
    eng2 = engine_for(model, engine=dict(kw, kv_cache_tokens=512), cache=cache)
    eng = eng2
    outs, results = asyncio.run(scenario(prompts + prompts[::-1]))
    assert outs == expected + expected[::-1]
    assert sum(r.report["cached_by_tier"]["file"] for r in results) > 0
    assert_all_free(eng)


def test_sequential_sessions_through_a_tiny_host_tier(model, cold, tmp_path):
    """Host arena smaller than one session: host allocation fails or evicts, answers stay exact, nothing leaks."""
    for policy in ("write_through", "write_back"):
        probe = small_engine(model)
        host_gb = 8 * probe.kv_pool.bytes_per_page / GIB
        eng = small_engine(model, host={"size_gb": host_gb, "write_policy": policy}, host_state_share=0.5)
        for name in "ABCABCA":
            assert run(eng, name).output_ids == cold[name]
        assert_all_free(eng)


def host_gb_for(eng: Engine, pages: int, snapshots: int) -> tuple[float, float]:
    """cache.host.size_gb and host_state_share giving exactly `pages` host pages and `snapshots` host snapshots."""
    page, snap = eng.kv_pool.bytes_per_page, eng.state_pool.bytes_per_slot
    size = pages * page + snapshots * snap
    return size / GIB, (snapshots * snap + 0.5) / size


def test_promoting_from_a_full_host_tier_under_write_back(model, cold):
    """A's second run loads A from the host while the device must evict B, whose write-back needs the host room
    A's copy holds: A's copy is pinned while it is read (it was freed and then read: a crash), B is not backed up."""
    probe = small_engine(model)
    gb, share = host_gb_for(probe, pages=(SESSION - 1) // 16 + 1, snapshots=1)
    eng = small_engine(model, host={"size_gb": gb, "write_policy": "write_back"}, host_state_share=share)
    assert host_tier(eng).num_pages == (SESSION - 1) // 16 + 1 and host_tier(eng).num_snapshots == 1
    for name in "ABA":
        r = run(eng, name)
        assert r.output_ids == cold[name]
    assert r.report["cached_by_tier"]["host"] > 0, r.report["cached_by_tier"]
    assert_all_free(eng)


# ---------------------------------------------------------------------------------------------------------------
# 5. kill -9 while writing

WRITER = r"""
import sys, torch
from pathlib import Path
from tinyserve.blob import Blob, chain_hashes
from tinyserve.file_tier import FileTier
folder, fp = Path(sys.argv[1]), bytes.fromhex(sys.argv[2])
tier = FileTier(folder, 1 << 30, fp, (64, 32), torch.float32, (8, 3), torch.float32, (4, 16))
i = 0
while True:
    toks = [3 + i % 250, 3 + i // 250 % 250] + [(i * 7 + j) % 250 + 3 for j in range(16 * 8 - 2)]
    h = chain_hashes(fp, toks, 16)
    g = torch.Generator().manual_seed(i)
    tier.write(Blob(h[0], h[-1], toks, torch.randn((8, 64, 32), generator=g),
                    torch.randn((8, 3), generator=g), torch.randn((4, 16), generator=g)))
    tier.flush(10)
    if i == 5:
        print("ready", flush=True)
    i += 1
"""


def _expected_blob(i: int, fp: bytes) -> tuple[list[int], list[bytes], torch.Tensor]:
    toks = [3 + i % 250, 3 + i // 250 % 250] + [(i * 7 + j) % 250 + 3 for j in range(16 * 8 - 2)]
    g = torch.Generator().manual_seed(i)
    return toks, chain_hashes(fp, toks, 16), torch.randn((8, 64, 32), generator=g)


@pytest.mark.slow
def test_kill_9_while_writing_leaves_a_consistent_folder(tmp_path):
    fp = bytes(range(32))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), fp.hex()], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (tmp_path / ".tmp-0123abcd").write_bytes(b"TSKVBLOB half a blob")   # as a kill inside write() leaves it
    tier = FileTier(tmp_path, 1 << 30, fp, (64, 32), torch.float32, (8, 3), torch.float32, (4, 16))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    n = tier.num_blobs
    assert n >= 6
    by_end = {_expected_blob(i, fp)[1][-1]: i for i in range(2 * n + 10)}     # blobs are written in order
    found = 0
    for p in blob_files(tmp_path):
        i = by_end[bytes.fromhex(p.name[:-len(SUFFIX)].split("-")[1])]
        toks, hashes, kv = _expected_blob(i, fp)
        (blob,) = tier.read_chain(hashes, toks, 0, 16)
        assert blob.tokens == toks and torch.equal(blob.kv, kv)
        found += 1
    assert found == n and tier.stats.errors == 0
    tier.close()


ENGINE_WRITER = r"""
import sys, torch
from tinyserve.config import from_dict
from tinyserve.build import engine_for_model
from tinyserve.loader import load_model
from tinyserve.sampling import SamplingParams
cfg = from_dict({"engine": {"page_size": 16, "kv_cache_tokens": 400, "max_running_requests": 1,
                            "compile_steps": False},
                 "cache": {"file": {"dir": sys.argv[2], "size_gb": 1.0}}})
eng = engine_for_model(cfg, load_model(sys.argv[1], torch.float32))
p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
i = 0
while True:
    g = torch.Generator().manual_seed(1000 + i)
    eng.generate([torch.randint(3, 256, (200,), generator=g).tolist()], p)
    if i == 3:
        eng.cache.file.flush(10)
        print("ready", flush=True)
    i += 1
"""


@pytest.mark.slow
def test_kill_9_of_an_engine_then_restart_serves_what_was_complete(model, tmp_path):
    ckpt = tmp_path / "ckpt"
    make_qwen3_5_text(ckpt, max_position_embeddings=2048)
    folder = tmp_path / "kv"
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_WRITER, str(ckpt), str(folder)], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    own = load_model(ckpt, torch.float32)
    eng = small_engine(own, file={"dir": str(folder), "size_gb": 1.0})
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]
    cold_eng = engine_for(own, engine={"page_size": 16, "kv_cache_tokens": 4096}, cache={"enabled": False})
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i in range(4):                                       # the sessions written before "ready"
        prompt = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(1000 + i)).tolist()
        (r,) = eng.run_requests([prompt], p)
        assert r.output_ids == cold_eng.generate([prompt], p)[0]
        assert r.report["cached_by_tier"]["file"] > 0
    assert file_tier(eng).stats.errors == 0
    eng.close()


# ---------------------------------------------------------------------------------------------------------------
# 6. flush_cache: device and host always, the file tier only when asked

def test_flush_cache_keeps_the_file_tier_unless_asked(model, cold, tmp_path):
    eng = small_engine(model, host={"size_gb": 0.01}, file={"dir": str(tmp_path), "size_gb": 1.0})
    run(eng, "A")
    file_tier(eng).flush(10)
    assert eng.flush_cache()
    assert host_tier(eng).num_free_pages == host_tier(eng).num_pages
    assert file_tier(eng).num_blobs == len(blob_files(tmp_path)) > 0
    r = run(eng, "A")
    by_tier = r.report["cached_by_tier"]
    assert r.output_ids == cold["A"] and by_tier["file"] > 0 and by_tier["host"] == 0
    assert eng.flush_cache(include_file=True)
    assert file_tier(eng).num_blobs == 0 and file_tier(eng).used_bytes == 0 and not blob_files(tmp_path)
    r = run(eng, "A")
    assert r.output_ids == cold["A"] and r.cached_tokens == 0
    eng.close()


def test_a_prefix_evicted_while_its_request_waits_is_read_from_the_folder(model, cold, tmp_path):
    """A again arrives while A's prompt is on the device, so its file-tier read starts past it; B, ahead of it in
    line, evicts A's pages (the folder holds them); once the read lands A reads the folder again from what the
    device still holds, and resumes from the folder instead of computing its prompt."""
    eng = small_engine(model, host={"size_gb": 0}, file={"dir": str(tmp_path), "size_gb": 1.0})
    assert run(eng, "A").output_ids == cold["A"]
    assert file_tier(eng).flush(10.0)                       # A's blobs are in the folder
    b, again = eng.run_requests([SESSIONS["B"], SESSIONS["A"]], GREEDY)     # one at a time: B first
    assert b.output_ids == cold["B"] and again.output_ids == cold["A"]
    assert again.report["cached_by_tier"]["file"] > 0, again.report["cached_by_tier"]
    eng.close()
    assert_all_free(eng)
