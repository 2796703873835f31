"""The file tier stores each cached page once (the warm-restart item: "blobs never exceed one per cached run of
pages"). A prompt that branches inside a cached run splits its radix node; both halves keep the blob that holds them,
so neither is written again (before: the upper half, and under write_back the lower half too, were written beside
the original blob). After a restart a prompt that branches off an older session still hits: the chain uses the
matching prefix of a blob that leaves the prompt's path, with the state at the branch point from a state blob (a
blob holds a state only at its end). Real engines on a tiny fp32 hybrid checkpoint, real files; every answer is
compared with a cold run's."""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import pytest
import torch

from checkpoints import make_qwen3_5_text
from conftest import engine_for, tokens
from tinyserve.blob import HEADER, STATE_SUFFIX, SUFFIX
from tinyserve.engine import Engine
from tinyserve.loader import load_model
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PS = 16

S1 = tokens(250, 70)
S2 = S1[:128] + tokens(122, 71)          # branches off S1 after 8 pages
S3 = S1[:64] + tokens(150, 72)           # off S1 after 4 pages (inside the upper half S2 left)
S4 = S2[:192] + tokens(58, 73)           # off S2's own run after 12 pages


@pytest.fixture(scope="module")
def model(hybrid_model):
    return hybrid_model


@pytest.fixture(scope="module")
def cold(model):
    eng = engine_for(model, engine={"page_size": PS, "kv_cache_tokens": 4096}, cache={"enabled": False})
    return lambda prompt: eng.generate([prompt], GREEDY)[0]


def file_engine(model, folder: Path, policy: str = "write_through", kv_tokens: int = 4096) -> Engine:
    host = {"size_gb": 0.01, "write_policy": policy} if policy == "write_back" else {"write_policy": policy}
    return engine_for(model, engine={"page_size": PS, "kv_cache_tokens": kv_tokens, "max_running_requests": 1},
                      cache={"host": host, "file": {"dir": str(folder), "size_gb": 1.0,
                                                    "prefetch_policy": "wait_complete"}})


def run(eng: Engine, cold, prompt: list[int]):
    (req,) = eng.run_requests([prompt], GREEDY)
    assert req.output_ids == cold(prompt)
    eng.cache.check()
    return req


def stored(folder: Path) -> tuple[list[tuple[bytes, list[int]]], list[Path]]:
    """(start hash, tokens) of every blob with pages, and the state blobs."""
    runs = []
    for p in sorted(folder.glob(f"*{SUFFIX}")):
        data = p.read_bytes()
        _, _, _, start, end, n_tok, n_pages, *_ = HEADER.unpack_from(data)
        assert n_pages and n_tok == n_pages * PS
        runs.append((start, list(struct.unpack_from(f"<{n_tok}i", data, HEADER.size))))
    return runs, sorted(folder.glob(f"*{STATE_SUFFIX}"))


def page_hashes(start: bytes, toks: list[int]) -> list[bytes]:
    """The chain hash at the end of each page of a run (what names that page in the chain)."""
    out, h = [], start
    for i in range(0, len(toks), PS):
        h = hashlib.sha256(h + struct.pack(f"<{PS}i", *toks[i:i + PS])).digest()
        out.append(h)
    return out


def conversation(eng: Engine, cold) -> list:
    reqs = [run(eng, cold, p) for p in (S1, S2, S3, S4)]
    reqs.append(run(eng, cold, S1 + reqs[0].output_ids + tokens(20, 74)))      # S1's next turn
    return reqs


@pytest.mark.parametrize("policy, kv_tokens", [("write_through", 4096), ("write_back", 4096), ("write_back", 400)])
def test_branching_conversations_store_each_page_once(model, cold, tmp_path, policy, kv_tokens):
    """S1, three prompts branching off it (one two branches deep) and S1's next turn; write_back with a device pool
    of 400 tokens also writes runs as they are evicted, then loads them back from the host and splits them."""
    folder = tmp_path / "kv"
    eng = file_engine(model, folder, policy, kv_tokens)
    conversation(eng, cold)
    tree, file = eng.cache.tree, eng.cache.file
    fingerprint = file.fingerprint
    nodes = [n for n in tree.nodes() if n is not tree.root]
    cached_pages = {h for n in nodes for h in page_hashes(fingerprint, tree._path_tokens(n))[n.start // PS:]}
    eng.cache.make_room(eng.allocator.num_pages)                      # evict everything (write_back writes now)
    file.flush(30)
    runs, states = stored(folder)
    pages = [h for start, toks in runs for h in page_hashes(start, toks)]
    assert len(pages) == len(set(pages)), "a page stored twice"
    assert cached_pages <= set(pages), "every page cached in the tree is stored"
    # the stored runs that hold the tree's nodes (a split node's halves share one) are stored; a run whose nodes
    # the tree dropped since (a session whose states went first) stays stored, once
    stored_runs = {(start, page_hashes(start, toks)[-1]) for start, toks in runs}
    assert {n.file_run for n in nodes} <= stored_runs
    if policy == "write_through":          # 5 prompts, 5 runs; the branch points' states inside S1's and S2's runs
        assert len(runs) == 5 and len(states) == 3
    assert file.num_blobs == len(runs) + len(states)
    eng.close()


def test_after_a_restart_prompts_branching_off_older_sessions_hit_the_file_tier(model, cold, tmp_path):
    folder = tmp_path / "kv"
    eng = file_engine(model, folder)
    conversation(eng, cold)
    eng.close()
    runs, states = stored(folder)
    assert len(runs) == 5 and len(states) == 3

    restarted = file_engine(model, folder)
    file = restarted.cache.file
    S5 = S1[:128] + tokens(90, 75)                      # a new branch at S2's branch point
    S6 = S4[:192] + tokens(40, 76)                      # at S4's, two branches deep
    S7 = S1[:100] + tokens(90, 77)                      # inside S1's run, where no state was ever taken
    expect = {                                          # prompt, tokens from the file tier
        "S2": (S2, 240),                                # S1's blob up to 128, the state there, S2's own run
        "S4": (S4, 240),                                # S1's blob to 128, S2's to 192, S4's own run
        "S5": (S5, 128),                                # S1's blob to 128 and the state there
        "S3": (S3, 208),
        "S6": (S6, 192),
        "S7": (S7, 64),                                 # the deepest state on its path: S3's branch point
    }
    for name, (prompt, hit) in expect.items():
        r = run(restarted, cold, prompt)
        assert r.report["cached_by_tier"]["file"] == r.cached_tokens == hit, (name, r.report["cached_by_tier"])
        restarted.flush_cache()                         # every prompt from the file tier alone
    assert file.stats.errors == 0
    restarted.close()
    # the new prompts wrote only their own runs (S5 and S6 one each from their branch points, S7 two: from where it
    # branched and its request end) and the state where S7 branched: no page of the older sessions again
    runs, states = stored(folder)
    pages = [h for start, toks in runs for h in page_hashes(start, toks)]
    assert len(pages) == len(set(pages)), "a page stored twice"
    assert len(runs) == 5 + 4 and len(states) == 3 + 1


def test_a_prompt_inside_a_stored_run_reads_only_what_it_can_use(model, cold, tmp_path):
    """With no branch point on the prompt's path the partial prefix is not even looked at: a prompt that merely
    starts like a stored session (or misses) reads no blob."""
    folder = tmp_path / "kv"
    eng = file_engine(model, folder)
    run(eng, cold, S1)
    eng.close()
    restarted = file_engine(model, folder)
    file = restarted.cache.file
    r = run(restarted, cold, S1[:150] + tokens(40, 78))
    assert r.cached_tokens == 0 and file.stats.bytes_out == 0
    r = run(restarted, cold, tokens(200, 79))
    assert r.cached_tokens == 0 and file.stats.bytes_out == 0
    restarted.close()


@pytest.fixture(scope="module")
def attention_model(tmp_path_factory):
    folder, _ = make_qwen3_5_text(tmp_path_factory.mktemp("attn"), max_position_embeddings=2048,
                                  layer_types=["full_attention"] * 2, num_hidden_layers=2)
    return load_model(folder, torch.float32)


def test_a_model_without_state_uses_the_whole_matching_prefix(attention_model, tmp_path):
    """Without recurrent state any prefix of a stored run is usable: after a restart, prompts that leave S1's run at
    page 6 and S2's at page 12 (where nothing branched before) get every matching page from them."""
    eng = engine_for(attention_model, engine={"page_size": PS, "kv_cache_tokens": 4096}, cache={"enabled": False})
    cold_attn = lambda prompt: eng.generate([prompt], GREEDY)[0]                   # noqa: E731
    folder = tmp_path / "kv"
    first = file_engine(attention_model, folder)
    for prompt in (S1, S2):
        run(first, cold_attn, prompt)
    first.close()
    restarted = file_engine(attention_model, folder)
    for prompt, hit in ((S1[:100] + tokens(90, 80), 96), (S2[:200] + tokens(40, 81), 192), (S2, 240)):
        r = run(restarted, cold_attn, prompt)
        assert r.report["cached_by_tier"]["file"] == r.cached_tokens == hit, r.report["cached_by_tier"]
        restarted.flush_cache()
    restarted.close()
    runs, _ = stored(folder)
    pages = [h for start, toks in runs for h in page_hashes(start, toks)]
    assert len(pages) == len(set(pages)), "a page stored twice"
