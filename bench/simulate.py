"""The prefix cache at real scale, by simulation: agent traces replayed through the real scheduler, radix tree and
tiers with the byte sizes of a Qwen3.5-27B-shaped model, and a stand-in for the forward pass.

    python bench/simulate.py                                  # both traces under systemd/production.toml
    python bench/simulate.py --trace seed --set cache.state_track_interval=512 --set plan.HOST_STATE_SHARE=0.1
    python bench/simulate.py --variants knobs --policies engine,pinned    # the tables of docs/cache-sizing.md

What is real and what stands in
-------------------------------
Real: `Engine._step` (the one step loop), `Scheduler`, `PrefixCache`, `RadixCache` (`TieredRadixCache` with tiers),
`HostTier`, `FileTier`, `PageAllocator`, `StatePool`, `KVPool`, built by build.assemble / build.prefix_cache from the
TOML config and a `MemoryPlan` that `MemoryPlan.resolve` makes for a header-only Qwen3.5-27B folder (what
`tinyserve --check` prints): KV pages, device snapshot slots, NEXTN verify slots, host pages and host snapshots, file
bytes. Every eviction, promotion, backup and file read is the engine's own code.

Stand-ins:
- The model: `StandInRunner` replaces `ModelRunner`. No weights, no compute: each sequence that samples gets one
  token, a hash of its last tokens and position (deterministic: an agent resends the output as history). It never
  drafts (NEXTN), so a decode commits one token per step; the cost model prices a decode step by MTP's accept length.
- The pools' tensors: the engine is handed a stand-in ModelConfig with one GDN and one attention layer of width 1
  (the real vocabulary and EOS ids), so the KV pool holds the plan's 4,224 pages but each is 2 x 64 floats, a state
  slot is a few floats, and the host tier's rows are as small (a few MB in all). Counts (pages, slots, host rows,
  file blobs) are the plan's and the engine's; bytes are the counts times the plan's per-page
  (`kv_bytes_per_token * page_size`) and per-slot (`state_bytes_per_slot`) sizes. The host tier's and the state
  pool's copy methods are wrapped to count calls; the file tier's size accounting (what `cache.file.size_gb` evicts
  against) takes the size each blob would have at real scale.
- The file tier writes real blobs into a temporary folder (tiny tensors, real token ids, names, headers, CRCs) and
  reads them back through its own reader thread, so file hits are the tier's own lookups; only sizes are scaled.
  Writes are flushed after every step (the writer is assumed to keep up; the report shows the disk time it needs).
- The host tier never meets memory pressure (`min_free_gb` is set aside: a 64 GB box that runs nothing else).
- The device budget: `engine.kv_cache_tokens = 0` derives the KV pool from free GPU memory, which a CPU cannot. The
  config's own state slots plus the seed's 270K tokens of KV is taken as the budget (production.toml's comment),
  and variants with more state slots take their memory from the KV pool (plan_27b). `--card` sizes it as the plan
  does for a 48 GB card with the FP8 weights kept FP8 (card_kv_tokens: ~406K tokens).
- Time: a virtual clock. Each step costs the cost model's compute time for its batch plus the tier copies the step
  made on the engine thread (host<->device and file uploads over PCIe, the copy a file write gathers, device
  snapshot copies). A file-tier read starts when its request arrives and runs on one reader at NVMe speed; the
  request is not admitted before it lands (SimPrefixCache._ready: the engine's policy plus the virtual read time).
The engine builds every object as it would; `_adopt` then switches a few to subclasses here that only add counters
and the virtual-time gate. Nothing decides differently from the engine: eviction, snapshot placement and the write
policy are the engine's code as it stands in the working tree, unless `--policy` says otherwise: `lru` puts back the
plain LRU snapshot eviction of commit cc0853a to compare against, `pinned` the engine before the home-box fix (a
running request's lock pinned the snapshots on its path; see SimRadix and docs/cache-sizing.md).

Cost model (CostModel; every figure is a flag)
----------------------------------------------
- Prefill: FLOPs = 2 x (weights outside the embedding) per token + 4 x heads x head_dim x attention layers per
  (token, earlier token) + the LM head per sampled token, at one effective rate calibrated so that a cold 50K-token
  prefill takes 7.73 s (the seed's measurement, and production.toml's "a 50K-prefix miss costs ~8 s").
  That puts a cold 170K prefill at ~36 s.
- Decode: a step reads the FP8 weights (1 byte per value), its KV and its state at 1.0 TB/s (RTX 4090-class), plus
  2 ms of step overhead, divided by MTP's accept length 2.5 tokens per step (the seed posts: 1.75-2.5 with thinking).
- Host <-> device 20 GB/s (PCIe 4.0 x16, pinned); file reads 2.5 GB/s (NVMe), writes 1.5 GB/s; host memcpy
  10 GB/s (a file write's copy is gathered on the engine thread, from the host tier when there is one, else from
  the device over PCIe); device snapshot copies at memory speed.
- Not modelled: GDN chunk kernels (a few ms per 8K tokens), overlap of copies with compute (tinyserve copies on the
  step thread between forwards, so the model adds them), CUDA graph effects, the file writer falling behind.

Traces (seed_trace, coding_trace; `scale` shrinks every token count, for the CPU test)
--------------------------------------------------------------------------------------
- seed: a 170K-token prefix shared by 4 sessions; each turn adds 2-8K tokens (the answer, 200-1500 tokens, plus
  the next tool result / message), 50 turns in all, 2-20 s of tool time between a session's turns.
- coding: 12 sessions of a coding agent on a 20K-token system + tools prefix, arriving ~75 s apart, 6-24 turns each
  (answers 100-1000 tokens, tool results 0.2-6K); a session spawns a sub-agent (fresh context on the same prefix)
  with p 0.12 per turn, rewinds 1-3 turns (the next prompt extends an older turn) with p 0.08, and compacts its
  history to a 3K summary when it passes 100K tokens.

Per request the report has the TTFT (arrival to first token, queueing included) and the "own" TTFT (its file read,
then admission to first token: its copies and prefill, without the wait behind other requests).

The small-scale check (tests/test_simulate.py): the same traces, shrunk, through a real Engine on the CPU (a tiny
checkpoint, the real runner) and through sim_engine with the same plan sizes, both by `replay` on the same clock:
per-request cached tokens and their device / host / file split, the tree's counters, what each tier holds and the
file tier's byte accounting must be equal.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import heapq
import itertools
import math
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent

import tinyserve.plan as planmod  # noqa: E402
from tinyserve.blob import HEADER  # noqa: E402
from tinyserve.build import assemble  # noqa: E402
from tinyserve.cache import PrefixCache  # noqa: E402
from tinyserve.config import Config, from_dict, load, to_dict  # noqa: E402
from tinyserve.engine import Engine, RequestError  # noqa: E402
from tinyserve.file_tier import FileTier  # noqa: E402
from tinyserve.models.config import ModelConfig  # noqa: E402
from tinyserve.plan import GIB, MemoryPlan  # noqa: E402
from tinyserve.radix import Node, RadixCache  # noqa: E402
from tinyserve.request import Request, Status  # noqa: E402
from tinyserve.runner import SeqOutput  # noqa: E402
from tinyserve.sampling import SamplingParams  # noqa: E402
from tinyserve.scheduler import ScheduledSeq  # noqa: E402
from tinyserve.tiers import TieredNode, TieredRadixCache  # noqa: E402

GB = 1e9
SEED_KV_TOKENS = 270336          # the seed's device pool (~270K tokens, fp8 KV, 48 GB card): 4224 pages of 64
HOME_BOX_AVAILABLE = 64 * GIB    # host memory the plan may assume (a 64 GB home box)


# ---------------------------------------------------------------------------------------------------------- sizes
@dataclass(frozen=True)
class Sizes:
    """Real byte sizes (from the plan) of what the tiers move."""
    page_size: int
    page_bytes: int              # one KV page, every attention layer (NEXTN's included)
    snap_bytes: int              # one state snapshot (conv + SSM state of every GDN layer)

    @classmethod
    def of(cls, plan: MemoryPlan) -> "Sizes":
        return cls(plan.page_size, plan.kv_bytes_per_token * plan.page_size, plan.state_bytes_per_slot)

    def blob_bytes(self, n_tokens: int, n_pages: int, snapshot: bool) -> int:
        """Size of a file-tier blob at real scale: header, token ids, KV pages, the snapshot if any."""
        return HEADER.size + 4 * n_tokens + n_pages * self.page_bytes + (self.snap_bytes if snapshot else 0)


# ----------------------------------------------------------------------------------------------------- cost model
@dataclass
class CostModel:
    """Seconds for a step's compute and for the tiers' copies. See the module docstring for the sources."""
    weight_values: int                 # every weight value of the checkpoint (embedding, LM head, NEXTN included)
    vocab: int
    hidden: int
    attn_layers: int
    heads: int
    head_dim: int
    kv_bytes_per_token: int            # read by a decode step (plan.kv_bytes_per_token)
    state_bytes: int                   # one request's GDN state, read and written by a decode step
    anchor_tokens: int = 50_000        # a cold prefill of this many tokens ...
    anchor_seconds: float = 7.73       # ... takes this long: the effective FLOP rate follows
    weight_bytes_per_value: float = 1.0  # FP8 weights
    mem_bw: float = 1.0e12             # device memory, bytes/s
    accept_len: float = 2.5            # MTP: tokens committed per decode step
    step_overhead_s: float = 0.002
    pcie_bw: float = 20e9              # host <-> device
    nvme_read_bw: float = 2.5e9
    nvme_write_bw: float = 1.5e9
    host_copy_bw: float = 10e9         # host memcpy (file writes gathered from the host tier)

    @classmethod
    def for_model(cls, mc: ModelConfig, weight_values: int, plan: MemoryPlan, **kw: Any) -> "CostModel":
        return cls(weight_values=weight_values, vocab=mc.vocab_size, hidden=mc.hidden_size,
                   attn_layers=len(mc.attn_layer_ids), heads=mc.num_attention_heads, head_dim=mc.head_dim,
                   kv_bytes_per_token=plan.kv_bytes_per_token, state_bytes=plan.state_bytes_per_slot, **kw)

    def instant_transfers(self) -> "CostModel":
        """Copies and reads cost nothing (the CPU check compares hit counts, where only the order of events counts)."""
        inf = math.inf
        return dataclasses.replace(self, mem_bw=inf, pcie_bw=inf, nvme_read_bw=inf, nvme_write_bw=inf,
                                   host_copy_bw=inf)

    @property
    def head_flops(self) -> float:
        return 2.0 * self.vocab * self.hidden

    @property
    def token_flops(self) -> float:
        """Dense FLOPs per token outside attention and the LM head."""
        return 2.0 * max(1, self.weight_values - 2 * self.vocab * self.hidden)

    @property
    def attn_flops(self) -> float:
        """FLOPs per (token, earlier token) pair: QK^T and PV over every attention layer."""
        return 4.0 * self.heads * self.head_dim * self.attn_layers

    def chunk_flops(self, start: int, n: int, samples: bool) -> float:
        return n * self.token_flops + self.attn_flops * n * (start + (n + 1) / 2) + (self.head_flops if samples
                                                                                    else 0.0)

    @property
    def flops_per_s(self) -> float:
        return self.chunk_flops(0, self.anchor_tokens, True) / self.anchor_seconds

    def prefill_seconds(self, start: int, n: int) -> float:
        """Compute time of prefilling n tokens after `start` cached ones, alone (no queueing, no copies)."""
        return self.chunk_flops(start, n, True) / self.flops_per_s

    def step_seconds(self, seqs: list[ScheduledSeq]) -> float:
        flops = kv_read = 0.0
        decodes = 0
        for s in seqs:
            flops += self.chunk_flops(s.start, s.num_tokens, s.samples)
            if s.is_decode:
                decodes += 1
                kv_read += s.start * self.kv_bytes_per_token + 2 * self.state_bytes
        mem = (self.weight_values * self.weight_bytes_per_value + kv_read) / self.mem_bw
        t = max(flops / self.flops_per_s, mem) + self.step_overhead_s
        if decodes == len(seqs):             # a decode-only step: MTP commits accept_len tokens per step
            t /= self.accept_len
        return t


class Clock:
    """The simulation's virtual time, in seconds."""

    def __init__(self) -> None:
        self.now = 0.0


# ------------------------------------------------------------------------------------------------------ counters
@dataclass
class Counters:
    """What the tiers did, in real bytes (the simulated engine's hooks bump these)."""
    device_snapshot_copies: int = 0      # StatePool.copy: snapshot taken, resumed from, or tracked at a page edge
    device_pages_evicted: int = 0        # pages leaving the device tree (demoted to host or dropped)
    device_snapshots_dropped: int = 0    # snapshots leaving with their node (alloc_snapshot's own are the tree's)
    host_pages_saved: int = 0            # device -> host copies (write-through backups, demotions)
    host_pages_loaded: int = 0           # host -> device (host hits)
    host_snapshots_saved: int = 0
    host_snapshots_loaded: int = 0
    file_to_device_bytes: int = 0        # blobs read back, uploaded into device pages / snapshot slots
    file_snapshots_loaded: int = 0
    file_read_bytes: int = 0             # blob bytes read from disk (real scale)
    file_blobs_written: int = 0
    file_write_bytes: int = 0            # blob bytes queued for the disk (real scale)
    file_write_snapshot_bytes: int = 0

    def host_bytes(self, sizes: Sizes) -> tuple[int, int]:
        """(device -> host, host -> device) bytes."""
        return (self.host_pages_saved * sizes.page_bytes + self.host_snapshots_saved * sizes.snap_bytes,
                self.host_pages_loaded * sizes.page_bytes + self.host_snapshots_loaded * sizes.snap_bytes)


def _adopt(obj: Any, cls: type, **attrs: Any) -> Any:
    """Switch an object the engine built to a simulator subclass (which only adds counters or the virtual gate)."""
    for name in getattr(cls, "hooks", ()):
        assert hasattr(type(obj), name), f"{type(obj).__name__}.{name} is gone: bench/simulate.py needs updating"
    obj.__class__ = cls
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def _count_calls(obj: Any, name: str, bump: Any) -> None:
    """Wrap obj.name (an instance attribute now) so that every call first runs bump(*args)."""
    inner = getattr(obj, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        bump(*args)
        return inner(*args, **kwargs)
    setattr(obj, name, wrapped)


class SimFileTier(FileTier):
    """The file tier, sized at real scale: a blob counts as the bytes it would have with real pages and state
    (its size accounting, and so its eviction against cache.file.size_gb, is the real one), and the real bytes of
    the blobs uploaded to the device are counted."""
    hooks = ("write", "_add", "load")
    sizes: Sizes
    counters: Counters
    meta: dict                             # (start, end) -> (real bytes, has a snapshot)

    def write(self, blob) -> None:
        key = (blob.start_hash, blob.end_hash)
        if self.writable and not self.has(*key):
            snap = blob.conv is not None
            size = self.sizes.blob_bytes(len(blob.tokens), blob.kv.shape[0], snap)
            self.meta[key] = (size, snap)
            c = self.counters
            c.file_blobs_written += 1
            c.file_write_bytes += size
            c.file_write_snapshot_bytes += self.sizes.snap_bytes if snap else 0
        super().write(blob)

    def _add(self, start: bytes, end: bytes, entry) -> None:
        entry.size = self.meta.get((start, end), (entry.size, False))[0]
        super()._add(start, end, entry)

    def load(self, blob, pages: list[int], snapshot: int | None, *args: Any, **kwargs: Any) -> None:
        self.counters.file_to_device_bytes += len(pages) * self.sizes.page_bytes + \
            (self.sizes.snap_bytes if snapshot is not None else 0)
        self.counters.file_snapshots_loaded += snapshot is not None
        super().load(blob, pages, snapshot, *args, **kwargs)

    def snapshots_held(self) -> int:
        with self.index.lock:
            return sum(self.meta.get(k, (0, False))[1] for k in self.index.lru)


POLICIES = ("engine", "lru", "pinned")


class SimRadix(RadixCache):
    """The radix tree with device eviction counters. Snapshot eviction: "engine" is the engine's own; "lru" puts
    back plain LRU (the policy of commit cc0853a, before snapshots were ranked by worth) to compare against;
    "pinned" is the engine's ranking with a running request's lock pinning the snapshots on its path too (the
    engine before the home-box issue's fix: many sessions on one prefix then hold every slot)."""
    hooks = ("_drop_device", "alloc_snapshot")
    counters: Counters
    policy: str

    def _drop_device(self, node: Node) -> None:
        if node.pages is not None:
            self.counters.device_pages_evicted += len(node.pages)
        if node.snapshot is not None:
            self.counters.device_snapshots_dropped += 1
        super()._drop_device(node)

    def _locks_pin(self, alloc: Any, *args: Any, **kwargs: Any) -> int | None:
        """Policy "pinned": run an allocation with every locked node pinned as if an admission were loading it."""
        saved = self.pinned
        self.pinned = saved | {n for n in self.nodes() if n.lock}
        try:
            return alloc(*args, **kwargs)
        finally:
            self.pinned = saved

    def alloc_snapshot(self, *args: Any, **kwargs: Any) -> int | None:
        if self.policy == "engine":
            return super().alloc_snapshot(*args, **kwargs)
        if self.policy == "pinned":
            return self._locks_pin(super().alloc_snapshot, *args, **kwargs)
        slot = self.state_pool.alloc_snapshot()         # cc0853a's RadixCache.alloc_snapshot
        if slot is not None:
            return slot
        held = [n for n in self.nodes() if n.snapshot is not None and n.lock == 0]
        if not held:
            return None
        victim = min(held, key=lambda n: n.last_use)
        self._lru_snapshot_to_host(victim)
        slot, victim.snapshot = victim.snapshot, None
        self.num_snapshots -= 1
        self.snapshots_evicted += 1
        self._drop_stateless_leaves(victim)
        return slot

    def _lru_snapshot_to_host(self, victim: Node) -> None:
        """Policy "lru": cc0853a demoted an evicted snapshot to the host tier (there is none here)."""


class SimTieredRadix(SimRadix, TieredRadixCache):
    """SimRadix over the tree with tiers; "lru" and "pinned" apply to the host tier's snapshots too."""
    hooks = SimRadix.hooks + ("_host_alloc_snapshot",)

    def _lru_snapshot_to_host(self, victim: TieredNode) -> None:
        if self.host is not None and victim.host_snapshot is None and \
                (self._backup_due("evict", victim.hits) or victim.host_pages is not None):
            hs = self._host_alloc_snapshot(protect=victim)
            if hs is not None:
                self.host.save_snapshot(victim.snapshot, hs)
                victim.host_snapshot = hs

    def _host_alloc_snapshot(self, protect: TieredNode | None, *args: Any, **kwargs: Any) -> int | None:
        if self.policy == "engine":
            return super()._host_alloc_snapshot(protect, *args, **kwargs)
        if self.policy == "pinned":
            return self._locks_pin(super()._host_alloc_snapshot, protect, *args, **kwargs)
        slot = self.host.alloc_snapshot()               # cc0853a's RadixCache._host_alloc_snapshot
        if slot is not None:
            return slot
        held = [x for x in self.nodes() if x.host_snapshot is not None and x is not protect
                and (x.snapshot is not None or x.lock == 0)]
        if not held:
            return None
        victim = min(held, key=lambda x: x.last_use)
        slot, victim.host_snapshot = victim.host_snapshot, None
        if victim.pages is None:
            self._drop_stateless_leaves(victim)
        return slot


class SimPrefixCache(PrefixCache):
    """The prefix cache with file-tier reads taking virtual time: a read starts when its request arrives, reads run
    one at a time at NVMe speed, and the request is not ready before its read has landed."""
    hooks = ("on_arrival", "_ready", "admit")
    clock: Clock
    cost: CostModel
    sizes: Sizes
    counters: Counters
    read_ready: dict
    read_time: dict
    reader_free: float

    def on_arrival(self, req: Request) -> None:
        super().on_arrival(req)
        run = self.runs.get(req.request_id)
        if run is None or run.read is None:
            return
        concurrent.futures.wait([run.read])             # the tiny blobs are read at once; time is modelled
        blobs = run.read.result() if run.read.exception() is None else []
        nbytes = sum(self.sizes.blob_bytes(len(b.tokens), b.kv.shape[0], b.conv is not None) for b in blobs)
        self.counters.file_read_bytes += nbytes
        start = max(self.clock.now, self.reader_free)
        self.reader_free = start + nbytes / self.cost.nvme_read_bw
        self.read_ready[req.request_id] = self.reader_free
        self.read_time[req.request_id] = nbytes / self.cost.nvme_read_bw

    def _ready(self, req: Request) -> bool:
        return super()._ready(req) and self.clock.now >= self.read_ready.get(req.request_id, 0.0)

    def next_ready(self) -> float | None:
        later = [t for t in self.read_ready.values() if t > self.clock.now]
        return min(later) if later else None

    def admit(self, req: Request) -> None:
        self.read_ready.pop(req.request_id, None)
        super().admit(req)


# -------------------------------------------------------------------------------------------- model stand-ins
class StandInModel:
    """What build.assemble reads of a model: its config, device and dtype (no parameters, no vision tower)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg, self.device, self.dtype = cfg, torch.device("cpu"), torch.float32
        self.visual = None

    def named_parameters(self):
        return iter(())

    def named_buffers(self):
        return iter(())

    def parameters(self):
        return iter(())

    def modules(self):
        return iter(())

    def named_modules(self):
        return iter(())


def stand_in_config(mc: ModelConfig) -> ModelConfig:
    """The real model's vocabulary and EOS ids with one layer of each kind, one head, width 1: pools of the plan's
    page and slot counts whose tensors are a few floats each."""
    layers = (["linear_attention"] if mc.gdn_layer_ids else []) + ["full_attention"]
    return dataclasses.replace(mc, layer_types=layers, num_hidden_layers=len(layers), num_key_value_heads=1,
                               head_dim=1, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=1,
                               linear_value_head_dim=1, linear_conv_kernel_dim=2)


class StandInRunner:
    """ModelRunner's place: one token per sampled sequence, a hash of the last 4 tokens and the position (the same
    context always gives the same token, whatever the cache did). EOS ids are never produced."""

    def __init__(self, vocab: int, eos_ids: list[int]) -> None:
        self.vocab, self.eos = vocab, set(eos_ids)

    def token(self, req: Request, n: int) -> int:
        p, o = req.prompt_ids, req.output_ids
        ctx = tuple(p[i] if i < len(p) else o[i - len(p)] for i in range(max(0, n - 4), n))
        h = hash((ctx, n)) & 0x7FFFFFFF
        tok = 3 + h % (self.vocab - 3)
        while tok in self.eos:
            tok = 3 + (tok + 1 - 3) % (self.vocab - 3)
        return tok

    def step(self, seqs: list[ScheduledSeq]) -> list[SeqOutput]:
        return [SeqOutput(s, [self.token(s.req, s.start + s.num_tokens)], [0.0]) for s in seqs if s.samples]


class ClockedRunner:
    """Wraps a runner (the real one or the stand-in): each step advances the clock by the cost model's compute
    time and records the prompt tokens each request computed."""

    def __init__(self, inner: Any, cost: CostModel, clock: Clock) -> None:
        self.inner, self.cost, self.clock = inner, cost, clock
        self.calls = 0
        self.computed: dict[str, int] = defaultdict(int)     # request id -> prefill tokens computed
        self.prefill_s = self.decode_s = 0.0

    def step(self, seqs: list[ScheduledSeq]) -> list[SeqOutput]:
        out = self.inner.step(seqs)
        self.calls += 1
        dt = self.cost.step_seconds(seqs)
        self.clock.now += dt
        if all(s.is_decode for s in seqs):
            self.decode_s += dt
        else:
            self.prefill_s += dt
        for s in seqs:
            if not s.is_decode:
                self.computed[s.req.request_id] += s.num_tokens
        return out


# ------------------------------------------------------------------------------------------- the simulated engine
def sim_engine(cfg: Config, plan: MemoryPlan, mc: ModelConfig, cost: CostModel, clock: Clock,
               policy: str = "engine") -> Engine:
    """An Engine with the stand-in model and runner, pools of the plan's counts with tiny tensors, and counters
    (engine.counters). `plan` is the real plan (sizes, reports); the engine is built from a copy whose KV pool has
    one layer of fp32 (the counts stay)."""
    assert policy in POLICIES, policy
    sim_plan = dataclasses.replace(plan, device="sim", dtype="float32", kv_dtype="float32",
                                   kv_layers=1 if plan.kv_layers else 0)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32"))
    engine = assemble(cfg, StandInModel(stand_in_config(mc)), None, sim_plan)
    engine.sizes, engine.cost, engine.clock, engine.policy = Sizes.of(plan), cost, clock, policy
    engine.counters = c = Counters()
    engine.plan = plan
    engine.runner = StandInRunner(mc.vocab_size, engine.eos_token_ids)
    _count_calls(engine.state_pool, "copy", lambda *a: setattr(c, "device_snapshot_copies",
                                                               c.device_snapshot_copies + 1))
    if isinstance(engine.cache, PrefixCache):
        _adopt_cache(engine)
    return engine


def _adopt_cache(engine: Engine) -> None:
    """The engine's prefix cache, tree and tiers switched to their simulator subclasses, in place (the scheduler
    holds the same objects)."""
    cache, c = engine.cache, engine.counters
    host, file = cache.host, cache.file
    common = dict(sizes=engine.sizes, counters=c)
    if host is not None:                                 # every copy between the device and the host tier
        host.min_free_bytes = 0                          # no memory pressure: a 64 GB box runs nothing else
        def bump(field: str, pages: bool):
            return lambda *a: setattr(c, field, getattr(c, field) + (len(a[0]) if pages else 1))
        _count_calls(host, "save_pages", bump("host_pages_saved", True))
        _count_calls(host, "load_pages", bump("host_pages_loaded", True))
        _count_calls(host, "save_snapshot", bump("host_snapshots_saved", False))
        _count_calls(host, "load_snapshot", bump("host_snapshots_loaded", False))
    if file is not None:
        _adopt(file, SimFileTier, meta={}, **common)
    _adopt(cache.tree, SimTieredRadix if isinstance(cache.tree, TieredRadixCache) else SimRadix, counters=c,
           policy=engine.policy)
    _adopt(cache, SimPrefixCache, clock=engine.clock, cost=engine.cost, read_ready={}, read_time={},
           reader_free=0.0, **common)


# ---------------------------------------------------------------------------------------------------- the plan
_HEADER_FOLDER: Path | None = None


CARD_FREE_GIB = 47.4       # a 48 GB card's free memory at start (what `tinyserve --check --gpu-memory-gb 48` assumes)


def header_only_27b() -> Path:
    """A Qwen3.5-27B block-FP8 checkpoint folder of safetensors headers (made once per process)."""
    global _HEADER_FOLDER
    if _HEADER_FOLDER is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from checkpoints import QWEN3_5_27B, make_header_only
        _HEADER_FOLDER = make_header_only(Path(tempfile.mkdtemp(prefix="tinyserve-sim-")) / "q35-27b", QWEN3_5_27B,
                                          fp8_block=(128, 128))
    return _HEADER_FOLDER


def set_key(data: dict, dotted: str, value: Any) -> None:
    *tables, key = dotted.split(".")
    for t in tables:
        data = data.setdefault(t, {})
    data[key] = value


def card_kv_tokens(config: Path, free_gib: float = CARD_FREE_GIB) -> int:
    """The KV pool MemoryPlan.resolve derives for `config` on a 48 GB card with `free_gib` free (FP8 weights kept
    FP8, the config's own state slots)."""
    from tinyserve.loader import read_checkpoint
    mc, weights = read_checkpoint(header_only_27b(), keep_fp8=True)
    data = to_dict(load(config))
    data["model"]["path"] = str(header_only_27b())
    plan = MemoryPlan.resolve(from_dict(data), mc, "cuda", weights, gpu_free_bytes=int(free_gib * GIB),
                              check_host=False)
    return plan.kv_tokens


def state_slots_total(cfg: Config) -> int:
    """Device state slots of a config: working slots, NEXTN verify slots, prefix-cache snapshot slots."""
    e, nextn = cfg.engine, cfg.speculative.num_steps > 0
    snaps = cfg.cache.state_slots or planmod.SNAPSHOTS_PER_RUNNING_REQUEST * e.max_running_requests
    return e.max_running_requests * (1 + (cfg.speculative.num_steps if nextn else 0)) + snaps


def plan_27b(config: Path, file_dir: Path, overrides: dict[str, Any] | None = None,
             kv_tokens: int = SEED_KV_TOKENS) -> tuple[Config, ModelConfig, int, MemoryPlan]:
    """The config (file tier moved to file_dir, overrides applied) and its plan for Qwen3.5-27B on a 48 GB card.

    engine.kv_cache_tokens = 0 derives the pool from free GPU memory, which a CPU cannot. The device memory for the
    KV pool and the state slots is taken to be what `config` itself (without the overrides) gives `kv_tokens` of KV
    (the seed's ~270K tokens by default, as production.toml's comment says; card_kv_tokens() for what a 48 GB card
    would give with FP8 weights). An override that adds state slots (snapshot slots, running requests, NEXTN
    steps) takes their memory from the KV pool, as a derived plan would. Host memory: a 64 GB box."""
    from tinyserve.loader import read_checkpoint
    folder = header_only_27b()
    mc, weights = read_checkpoint(folder, keep_fp8=True)
    values = weights.values
    data = to_dict(load(config))
    data["model"]["path"] = str(folder)
    base = from_dict(data)
    share = planmod.HOST_STATE_SHARE
    for k, v in (overrides or {}).items():
        if k == "plan.HOST_STATE_SHARE":          # a constant of the plan, not a key
            share = v
        else:
            set_key(data, k, v)
    if data["cache"]["file"]["dir"]:
        data["cache"]["file"]["dir"] = str(file_dir)
    if not data["engine"]["kv_cache_tokens"]:
        cfg = from_dict(data)
        per_token = planmod.kv_bytes_per_token(mc, cfg.model.kv_cache_dtype,
                                               mc.num_mtp_layers if cfg.speculative.num_steps else 0)
        extra = (state_slots_total(cfg) - state_slots_total(base)) * \
            planmod.state_bytes_per_slot(mc, cfg.model.dtype)
        ps = cfg.engine.page_size
        data["engine"]["kv_cache_tokens"] = (kv_tokens - math.ceil(extra / per_token)) // ps * ps
        # a pool that gave KV to state slots may hold less than the context: the context is cut to it, as a
        # CUDA plan requires (the traces' requests are far shorter)
        context = data["model"]["context_length"] or mc.max_position_embeddings
        data["model"]["context_length"] = min(context, data["engine"]["kv_cache_tokens"])
    cfg = from_dict(data, source=str(config))
    with mock.patch.object(planmod, "host_available_bytes", lambda: HOME_BOX_AVAILABLE), \
            mock.patch.object(planmod, "HOST_STATE_SHARE", share):
        plan = MemoryPlan.resolve(cfg, mc, "cuda", weights, gpu_free_bytes=int(CARD_FREE_GIB * GIB))
    return cfg, mc, values, plan


# ------------------------------------------------------------------------------------------------------- traces
@dataclass
class Turn:
    session: str
    index: int
    message: list[int]                 # tokens after the base history (a first turn: the prefix + the task)
    max_tokens: int                    # the answer's length (ignore_eos)
    base: tuple[str, int] | None       # the turn whose prompt + answer this prompt extends (None: nothing)
    after: tuple[str, int] | None      # the turn whose end this one waits for (None: arrives at `delay`)
    delay: float                       # seconds after `after` ends (tool time), or the arrival time

    @property
    def key(self) -> tuple[str, int]:
        return (self.session, self.index)


@dataclass
class Trace:
    name: str
    turns: list[Turn]


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _n(x: float, scale: float) -> int:
    return max(1, round(x * scale))


def seed_trace(scale: float = 1.0, vocab: int = 248320, seed: int = 0, sessions: int = 4, turns: int = 50,
               prefix: int = 170_000, context: int = 262_144) -> Trace:
    """The seed's workload: a `prefix`-token prefix shared by `sessions` sessions that grow by 2-8K tokens a turn
    (answer 200-1500 tokens + the next message), `turns` turns in all, 2-20 s of tool time between turns; the
    sessions start within 10 s of each other. Growth is cut so that no session passes 90% of `context`."""
    rng = random.Random(seed)
    shared = _tokens(rng, _n(prefix, scale), vocab)
    per = [turns // sessions + (i < turns % sessions) for i in range(sessions)]
    out: list[Turn] = []
    limit = int(0.9 * context * scale)
    for s in range(sessions):
        name, length = f"s{s}", 0
        start = rng.uniform(0, 10)
        for k in range(per[s]):
            grow = _n(rng.uniform(2000, 8000), scale)
            answer = _n(rng.uniform(200, 1500), scale)
            room = (limit - length) // max(1, per[s] - k)
            grow = max(answer + 1, min(grow, room))
            msg = _tokens(rng, grow - answer, vocab)
            if k == 0:
                out.append(Turn(name, 0, shared + msg, answer, None, None, start))
                length = len(shared) + grow
            else:
                out.append(Turn(name, k, msg, answer, (name, k - 1), (name, k - 1), rng.uniform(2, 20)))
                length += grow
    return Trace("seed", out)


def coding_trace(scale: float = 1.0, vocab: int = 248320, seed: int = 1, sessions: int = 12,
                 prefix: int = 20_000, gap_s: float = 75.0, compact_at: int = 100_000) -> Trace:
    """A coding agent's day: `sessions` sessions on a shared system + tools prefix, arriving ~gap_s apart, 6-24
    turns each; sub-agents (fresh context on the prefix, 3-8 turns) spawned with p 0.12 per turn; rewinds (the
    next prompt extends the turn 1-3 back) with p 0.08; compaction to a 3K summary past `compact_at` tokens."""
    rng = random.Random(seed)
    shared = _tokens(rng, _n(prefix, scale), vocab)
    out: list[Turn] = []
    t = 0.0
    names = iter(range(10_000))

    def session(name: str, turns: int, start: float | None, parent: tuple[str, int] | None, depth: int) -> None:
        lengths: list[int] = []            # context after each turn (prompt + answer)
        base: tuple[str, int] | None = None
        for k in range(turns):
            answer = _n(rng.uniform(100, 1000), scale)
            if k == 0:
                msg = shared + _tokens(rng, _n(rng.uniform(1000, 4000), scale), vocab)
                after = parent
                delay = start if parent is None else rng.uniform(0.5, 3)
                length = len(msg) + answer
                base = None
            else:
                prev = lengths[-1]
                back = 0
                if k >= 3 and rng.random() < 0.08:
                    back = rng.randint(1, min(3, k - 1))
                if prev > compact_at * scale:          # compaction: a new history from the prefix
                    msg = shared + _tokens(rng, _n(3000, scale), vocab)
                    base = None
                    length = len(msg) + answer
                else:
                    msg = _tokens(rng, _n(rng.uniform(200, 6000), scale), vocab)
                    base = (name, k - 1 - back)
                    length = lengths[k - 1 - back] + len(msg) + answer
                after = (name, k - 1)
                delay = rng.uniform(3, 30)
            out.append(Turn(name, k, msg, answer, base, after, delay))
            lengths.append(length)
            if depth == 0 and rng.random() < 0.12:
                session(f"{name}.sub{next(names)}", rng.randint(3, 8), None, (name, k), depth + 1)

    for s in range(sessions):
        t += rng.expovariate(1 / gap_s) if s else 0.0
        session(f"c{s}", rng.randint(6, 24), t, None, 0)
    # a sub-agent's first turn waits for its parent's turn; the parent's next turn waits for the sub-agent's
    # last one (the agent reads its report): make the parent's turn after the spawn depend on it
    last: dict[str, Turn] = {}
    for turn in out:
        last[turn.session] = turn
    spawns = {(t0.after, t0.session) for t0 in out if t0.index == 0 and t0.after is not None}
    for (parent, sub) in spawns:
        for turn in out:
            if turn.session == parent[0] and turn.index == parent[1] + 1:
                turn.after = last[sub].key
    return Trace("coding", out)


# ------------------------------------------------------------------------------------------------------- replay
@dataclass
class Record:
    request_id: str
    session: str
    turn: int
    prompt_tokens: int
    arrival: float
    cached: int = 0
    by_tier: dict[str, int] = field(default_factory=dict)
    admitted: float | None = None       # start of the step that admitted it (the last admission, if preempted)
    first_token: float | None = None
    finish: float | None = None
    read_s: float = 0.0                 # its own file-tier read (modelled)
    ideal: int = 0                      # an unbounded cache's hit: the longest page-aligned prefix shared with a
                                        # request that finished before this one was admitted (not its last token)
    computed: int = 0                   # prompt (and recomputed) tokens prefilled
    output_tokens: int = 0

    @property
    def ttft(self) -> float:
        return (self.first_token or 0.0) - self.arrival

    @property
    def service(self) -> float:
        """TTFT less the wait behind other requests: its own file read, then admission to first token (its tier
        copies and prefill)."""
        return self.read_s + (self.first_token or 0.0) - (self.admitted if self.admitted is not None else
                                                          self.arrival)

    @property
    def source(self) -> str:
        """The deepest tier that served part of the prompt: file, host, device, or miss."""
        t = self.by_tier
        return "file" if t.get("file") else "host" if t.get("host") else "device" if self.cached else "miss"


@dataclass
class Result:
    trace: str
    records: list[Record]
    makespan: float
    prefill_s: float
    decode_s: float
    transfer_s: float
    peak: dict[str, float]
    end: dict[str, float]
    tree: dict[str, int]
    counters: Counters | None
    plan: MemoryPlan
    cost: CostModel


def _occupancy(engine: Engine) -> dict[str, float]:
    """What each tier holds now, in pages / snapshots / blobs and real bytes."""
    tree, host, file = engine.cache.tree, engine.cache.host, engine.cache.file
    sz = Sizes.of(engine.plan)
    occ = {"device_pages": tree.num_pages, "device_snapshots": tree.num_snapshots}
    occ["device_bytes"] = occ["device_pages"] * sz.page_bytes + occ["device_snapshots"] * sz.snap_bytes
    if host is not None:
        occ["host_pages"] = host.num_pages - host.num_free_pages
        occ["host_snapshots"] = host.num_snapshots - host.num_free_snapshots
        occ["host_bytes"] = occ["host_pages"] * sz.page_bytes + occ["host_snapshots"] * sz.snap_bytes
    if file is not None:
        occ["file_bytes"] = file.used_bytes
        occ["file_blobs"] = file.num_blobs
    return occ


def _transfer_counts(engine: Engine) -> dict[str, float]:
    c: Counters | None = getattr(engine, "counters", None)
    if c is None:                                  # a real engine: nothing counted, copies cost nothing here
        return {}
    host_in, host_out = c.host_bytes(engine.sizes)
    return {"pcie": host_in + host_out + c.file_to_device_bytes, "file_write": c.file_write_bytes,
            "snap_copies": c.device_snapshot_copies}


def _transfer_seconds(engine: Engine, cost: CostModel, d: dict[str, float]) -> float:
    """Engine-thread time of a step's tier copies: host <-> device and file uploads over PCIe, the copy a file
    write gathers (from the host tier when there is one, else from the device), device snapshot copies."""
    if not d:
        return 0.0
    host = engine.cache.host is not None
    return d["pcie"] / cost.pcie_bw + d["file_write"] / (cost.host_copy_bw if host else cost.pcie_bw) \
        + d["snap_copies"] * 2 * cost.state_bytes / cost.mem_bw


def replay(engine: Engine, trace: Trace, cost: CostModel, clock: Clock) -> Result:
    """Play the trace through engine._step, the engine's own step, on the virtual clock. Works for a real Engine
    (its runner is wrapped to advance the clock; its tier copies are not timed) and for a sim_engine. A request's
    file-tier read is waited for when it arrives, and file writes are flushed after every step, so the order of
    events never depends on the reader and writer threads."""
    assert hasattr(engine.cache, "tree"), "replay needs the prefix cache (cache.enabled = true)"
    runner = engine.runner = ClockedRunner(engine.runner, cost, clock)
    file = engine.cache.file
    waiting_on: dict[tuple[str, int], list[Turn]] = defaultdict(list)
    heap: list[tuple[float, int, Turn]] = []
    order = 0
    for t in trace.turns:
        if t.after is None:
            heap.append((t.delay, order, t))
            order += 1
        else:
            waiting_on[t.after].append(t)
    heapq.heapify(heap)
    needed = {t.base for t in trace.turns if t.base is not None}
    history: dict[tuple[str, int], list[int]] = {}
    live: dict[int, tuple[Request, Record, Turn]] = {}
    records: list[Record] = []
    peak: dict[str, float] = defaultdict(float)
    seen: set[int] = set()                 # page-chain hashes of every finished request's prompt + output
    ps = engine.plan.page_size
    transfer_s = 0.0
    counts = _transfer_counts(engine)
    sched = engine.scheduler
    while heap or live:
        while heap and heap[0][0] <= clock.now:
            arrival, _, turn = heapq.heappop(heap)
            prompt = (history[turn.base] if turn.base is not None else []) + turn.message
            params = SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)
            req = engine.intake.make_request(prompt, params, f"{turn.session}/{turn.index}")
            rec = Record(req.request_id, turn.session, turn.index, len(prompt), arrival)
            records.append(rec)
            sched.add(req)
            run = engine.cache.runs.get(req.request_id)
            if run is not None and run.read is not None:
                concurrent.futures.wait([run.read])
            live[id(req)] = (req, rec, turn)
        if not sched.has_work():
            if not heap:
                break
            clock.now = heap[0][0]
            continue
        calls, t0 = runner.calls, clock.now
        engine._step()
        if file is not None:
            file.flush(60.0)
        now_counts = _transfer_counts(engine)
        dt = _transfer_seconds(engine, cost, {k: now_counts[k] - counts[k] for k in now_counts})
        counts = now_counts
        clock.now += dt
        transfer_s += dt
        for k, v in _occupancy(engine).items():
            peak[k] = max(peak[k], v)
        if runner.calls == calls:                      # nothing ran: requests wait on (virtual) file reads
            nxt = [heap[0][0]] if heap else []
            ready = getattr(engine.cache, "next_ready", lambda: None)()
            nxt += [ready] if ready is not None else []
            if not nxt:
                raise RuntimeError("the engine cannot schedule its waiting requests and nothing else will happen")
            clock.now = max(clock.now, min(nxt))
        for key, (req, rec, turn) in list(live.items()):
            if rec.admitted is None and req.status != Status.WAITING:
                rec.admitted = t0
                h, prompt = 0, req.prompt_ids
                for i in range(0, (len(prompt) - 1) // ps * ps, ps):
                    h = hash((h, tuple(prompt[i:i + ps])))
                    if h not in seen:
                        break
                    rec.ideal = i + ps
            if rec.first_token is None and req.output_ids:
                rec.first_token = clock.now
            if req.status == Status.FINISHED:
                rec.finish = clock.now
                rec.cached, rec.by_tier = req.cached_tokens, dict(req.report["cached_by_tier"])
                rec.computed = runner.computed.get(req.request_id, 0)
                rec.read_s = getattr(engine.cache, "read_time", {}).get(req.request_id, 0.0)
                rec.output_tokens = len(req.output_ids)
                full = req.prompt_ids + req.output_ids
                h = 0
                for i in range(0, len(full) // ps * ps, ps):
                    h = hash((h, tuple(full[i:i + ps])))
                    seen.add(h)
                if turn.key in needed:
                    history[turn.key] = full
                for nxt_turn in waiting_on.pop(turn.key, []):
                    heapq.heappush(heap, (clock.now + nxt_turn.delay, order, nxt_turn))
                    order += 1
                del live[key]
    tree, host, file = engine.cache.tree, engine.cache.host, engine.cache.file
    end = _occupancy(engine)
    if isinstance(file, SimFileTier):
        end["file_snapshots"] = file.snapshots_held()
    tree_stats = {"hit_tokens": tree.hit_tokens, "query_tokens": tree.query_tokens,
                  "snapshots_evicted": tree.snapshots_evicted,
                  "host_hit_tokens": host.stats.hit_tokens if host else 0,
                  "file_hit_tokens": file.stats.hit_tokens if file else 0,
                  "preemptions": sched.num_preemptions}
    engine.runner = runner.inner
    return Result(trace.name, records, clock.now, runner.prefill_s, runner.decode_s, transfer_s, dict(peak),
                  end, tree_stats, getattr(engine, "counters", None), engine.plan, cost)


def simulate(trace: Trace, config: Path = ROOT / "systemd" / "production.toml",
             overrides: dict[str, Any] | None = None, cost_kw: dict[str, Any] | None = None,
             kv_tokens: int = SEED_KV_TOKENS, policy: str = "engine") -> Result:
    """One trace through a sim_engine for the 27B plan of `config` (+ overrides)."""
    with tempfile.TemporaryDirectory(prefix="tinyserve-sim-file-") as tmp:
        cfg, mc, values, plan = plan_27b(config, Path(tmp), overrides, kv_tokens)
        cost = CostModel.for_model(mc, values, plan, **(cost_kw or {}))
        clock = Clock()
        engine = sim_engine(cfg, plan, mc, cost, clock, policy)
        try:
            return replay(engine, trace, cost, clock)
        finally:
            engine.close(10.0)


# ------------------------------------------------------------------------------------------------------ reports
def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def fmt_table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
    return "\n".join([line(cells[0]), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [line(r) for r in cells[1:]])


def summary(r: Result) -> dict[str, float]:
    prompt = sum(x.prompt_tokens for x in r.records)
    cached = sum(x.cached for x in r.records)
    ttft = [x.ttft for x in r.records]
    return {"requests": len(r.records), "prompt_tokens": prompt, "hit_rate": cached / max(1, prompt),
            "ideal": sum(x.ideal for x in r.records) / max(1, prompt),
            "device": sum(x.by_tier.get("device", 0) for x in r.records) / max(1, prompt),
            "host": sum(x.by_tier.get("host", 0) for x in r.records) / max(1, prompt),
            "file": sum(x.by_tier.get("file", 0) for x in r.records) / max(1, prompt),
            "computed": sum(x.computed for x in r.records),
            "ttft_mean": statistics.fmean(ttft) if ttft else 0.0, "ttft_p50": _pct(ttft, 0.5),
            "ttft_p90": _pct(ttft, 0.9), "ttft_max": max(ttft) if ttft else 0.0, "makespan": r.makespan,
            "own_mean": statistics.fmean(x.service for x in r.records) if r.records else 0.0,
            "own_p50": _pct([x.service for x in r.records], 0.5),
            "own_p90": _pct([x.service for x in r.records], 0.9)}


def tier_table(r: Result) -> str:
    """Per tier: hit rate, bytes and snapshots held (end / peak), what it evicted, TTFT of the requests it served
    (a request counts for the deepest tier that served part of its prompt)."""
    sz, c, p = Sizes.of(r.plan), r.counters or Counters(), r.plan
    prompt = max(1, sum(x.prompt_tokens for x in r.records))
    rows = []
    for tier in ("device", "host", "file"):
        if tier == "host" and "host_pages" not in r.end:
            continue
        if tier == "file" and "file_bytes" not in r.end:
            continue
        hit = sum(x.by_tier.get(tier, 0) for x in r.records)
        served = [x for x in r.records if x.source == tier]
        if tier == "device":
            held = f"{r.end['device_bytes'] / GB:.1f} / {r.peak['device_bytes'] / GB:.1f}"
            cap = f"{p.kv_pages * sz.page_bytes / GB:.1f} + {p.snapshot_slots * sz.snap_bytes / GB:.1f}"
            snaps = f"{r.end['device_snapshots']:.0f} / {r.peak['device_snapshots']:.0f} of {p.snapshot_slots}"
            ev = f"{c.device_pages_evicted * p.page_size / 1e3:.0f}K tok, " \
                 f"{r.tree['snapshots_evicted'] + c.device_snapshots_dropped} snap"
        elif tier == "host":
            held = f"{r.end['host_bytes'] / GB:.1f} / {r.peak['host_bytes'] / GB:.1f}"
            cap = f"{p.host_pages * sz.page_bytes / GB:.1f} + {p.host_snapshots * sz.snap_bytes / GB:.1f}"
            snaps = f"{r.end['host_snapshots']:.0f} / {r.peak['host_snapshots']:.0f} of {p.host_snapshots}; " \
                    f"{c.host_snapshots_loaded} loaded"
            ev = f"{(c.host_pages_saved - r.end['host_pages']) * p.page_size / 1e3:.0f}K tok, " \
                 f"{c.host_snapshots_saved - r.end['host_snapshots']:.0f} snap"
        else:
            held = f"{r.end['file_bytes'] / GB:.1f} / {r.peak['file_bytes'] / GB:.1f}"
            cap = f"{p.file_bytes / GB:.1f}"
            fs = r.end.get("file_snapshots", 0)
            snaps = f"{fs:.0f} in {r.end['file_blobs']:.0f} blobs ({fs * sz.snap_bytes / GB:.1f} GB); " \
                    f"{c.file_snapshots_loaded} loaded"
            ev = f"{c.file_blobs_written - r.end['file_blobs']:.0f} blobs"
        ttft = _served(served)
        rows.append([tier, f"{100 * hit / prompt:.1f}%", held, cap, snaps, ev, ttft])
    rows.append(["(miss)", "", "", "", "", "", _served([x for x in r.records if x.source == "miss"])])
    return fmt_table(["tier", "hit rate", "held GB (end / peak)", "capacity GB (KV + snap)", "snapshots held "
                      "(end / peak)", "evicted", "requests it served: TTFT mean (own)"], rows)


def _served(recs: list[Record]) -> str:
    if not recs:
        return "0 req"
    return f"{len(recs)} req: {statistics.fmean(x.ttft for x in recs):.2f} s " \
           f"({statistics.fmean(x.service for x in recs):.2f} s)"


def report(r: Result, title: str = "") -> str:
    s = summary(r)
    c = r.counters or Counters()
    sz = Sizes.of(r.plan)
    lines = [f"#### {title or r.trace}", "",
             f"{s['requests']} requests, {s['prompt_tokens'] / 1e6:.2f}M prompt tokens; **hit rate "
             f"{100 * s['hit_rate']:.1f}%** (device {100 * s['device']:.1f}%, host {100 * s['host']:.1f}%, file "
             f"{100 * s['file']:.1f}%; an unbounded cache: {100 * s['ideal']:.1f}%); prefill computed "
             f"{s['computed'] / 1e6:.2f}M tokens; **TTFT mean "
             f"{s['ttft_mean']:.2f} s**, p50 {s['ttft_p50']:.2f} s, p90 {s['ttft_p90']:.2f} s, max "
             f"{s['ttft_max']:.1f} s; own TTFT (its file read, copies and prefill, without the wait behind other "
             f"requests) mean {s['own_mean']:.2f} s, p50 {s['own_p50']:.2f} s, p90 {s['own_p90']:.2f} s; modelled "
             f"time {r.makespan / 60:.1f} min (prefill {r.prefill_s:.0f} s, decode {r.decode_s:.0f} s, tier copies "
             f"{r.transfer_s:.1f} s); {r.tree['preemptions']} preemptions.", "",
             tier_table(r), ""]
    host_in, host_out = c.host_bytes(sz)
    busy = c.file_write_bytes / r.cost.nvme_write_bw / max(1e-9, r.makespan)
    lines.append(f"Snapshot bytes: {c.device_snapshot_copies} device snapshot copies "
                 f"({c.device_snapshot_copies * sz.snap_bytes / GB:.0f} GB); device -> host {host_in / GB:.0f} GB "
                 f"({c.host_snapshots_saved * sz.snap_bytes / GB:.0f} GB of it snapshots), host -> device "
                 f"{host_out / GB:.0f} GB; file writes {c.file_write_bytes / GB:.0f} GB in {c.file_blobs_written} "
                 f"blobs ({c.file_write_snapshot_bytes / GB:.0f} GB of it snapshots; the writer busy "
                 f"{100 * busy:.0f}% of the time at {r.cost.nvme_write_bw / GB:.1f} GB/s), file reads "
                 f"{c.file_read_bytes / GB:.1f} GB.")
    return "\n".join(lines)


def per_request_table(r: Result, limit: int | None = None) -> str:
    rows = []
    for x in r.records[:limit]:
        rows.append([x.request_id, x.prompt_tokens, x.cached, x.by_tier.get("device", 0), x.by_tier.get("host", 0),
                     x.by_tier.get("file", 0), x.computed, f"{x.ttft:.2f}", f"{x.service:.2f}",
                     f"{r.cost.prefill_seconds(0, x.prompt_tokens):.1f}"])
    return fmt_table(["request", "prompt", "cached", "device", "host", "file", "computed", "TTFT s", "own s",
                      "cold prefill s"], rows)


def variants_row(title: str, r: Result) -> list[Any]:
    s = summary(r)
    p = r.plan
    c = r.counters or Counters()
    return [title, f"{p.kv_tokens // 1000}K / {p.snapshot_slots} / {p.host_snapshots}",
            f"{100 * s['hit_rate']:.1f}%", f"{100 * s['device']:.1f} / {100 * s['host']:.1f} / {100 * s['file']:.1f}",
            f"{s['computed'] / 1e6:.2f}M", f"{s['ttft_mean']:.2f}", f"{s['ttft_p90']:.2f}", f"{s['own_mean']:.2f}",
            f"{s['own_p50']:.2f}", f"{c.host_snapshots_loaded} / {c.file_snapshots_loaded}",
            f"{c.file_write_bytes / GB:.0f}"]


VARIANTS_HEADER = ["variant", "device KV tok / snap slots / host snaps", "hit rate", "device / host / file %",
                   "computed", "TTFT mean s", "TTFT p90 s", "own TTFT mean s", "own p50 s",
                   "snapshots loaded host / file", "file writes GB"]


# --------------------------------------------------------------------------------------------------------- main
VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "knobs": [                                         # one key at a time, on production.toml
        ("production.toml", {}),
        ("state_track_interval = 512", {"cache.state_track_interval": 512}),
        ("state_track_interval = 8192", {"cache.state_track_interval": 8192}),
        ("host state share 0.1", {"plan.HOST_STATE_SHARE": 0.1}),
        ("host state share 0.5", {"plan.HOST_STATE_SHARE": 0.5}),
        ("write_policy = write_back", {"cache.host.write_policy": "write_back"}),
    ],
    "recommended": [                                   # the old defaults, today's, and two alternatives
        ("interval 512, host state share 0.1",
         {"cache.state_track_interval": 512, "plan.HOST_STATE_SHARE": 0.1}),
        ("production.toml (interval 2048, host state share 0.25)", {}),
        ("production.toml, write_back", {"cache.host.write_policy": "write_back"}),
        ("production.toml, state_slots 16", {"cache.state_slots": 16}),
    ],
    "slots": [                                         # device snapshot slots (with --card: room for them)
        ("production.toml", {}),
        ("state_slots = 16", {"cache.state_slots": 16}),
        ("state_slots = 32", {"cache.state_slots": 32}),
        ("max_running_requests = 2", {"engine.max_running_requests": 2}),
    ],
}


def parse_set(items: list[str]) -> dict[str, Any]:
    import tomllib
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "systemd" / "production.toml")
    ap.add_argument("--trace", choices=["seed", "coding", "both"], default="both")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key with a TOML value (e.g. cache.state_track_interval=2048), or "
                    "the host tier's state share (plan.HOST_STATE_SHARE=0.5)")
    ap.add_argument("--variants", choices=sorted(VARIANTS), help="a set of variants of docs/cache-sizing.md, one "
                    "summary row each (and per --policies)")
    ap.add_argument("--policies", default="", help="comma-separated snapshot policies for --variants "
                    f"({', '.join(POLICIES)}; default: --policy)")
    ap.add_argument("--kv-tokens", type=int, default=SEED_KV_TOKENS,
                    help="device KV pool with the default snapshot slots (default: the seed's 270K)")
    ap.add_argument("--card", action="store_true", help="size the device pool as a 48 GB card would with FP8 "
                    "weights (card_kv_tokens) instead of the seed's 270K")
    ap.add_argument("--policy", choices=POLICIES, default="engine",
                    help="snapshot eviction: the engine's own; plain LRU (commit cc0853a) for comparison; the "
                    "engine's own with running requests' locks pinning snapshots too (before the fix, see SimRadix)")
    ap.add_argument("--requests", action="store_true", help="also print every request")
    ap.add_argument("--seed", type=int, default=0, help="trace seed")
    args = ap.parse_args()
    traces = {"seed": lambda: seed_trace(seed=args.seed), "coding": lambda: coding_trace(seed=args.seed + 1)}
    names = ["seed", "coding"] if args.trace == "both" else [args.trace]
    kv_tokens = card_kv_tokens(args.config) if args.card else args.kv_tokens
    base = parse_set(args.set)
    for name in names:
        trace = traces[name]()
        if args.variants:
            rows = []
            policies = args.policies.split(",") if args.policies else [args.policy]
            for (title, overrides), policy in itertools.product(VARIANTS[args.variants], policies):
                title += f" [{policy}]" if len(policies) > 1 or policy != "engine" else ""
                t0 = time.perf_counter()
                try:
                    r = simulate(trace, args.config, {**base, **overrides}, kv_tokens=kv_tokens, policy=policy)
                    rows.append(variants_row(title, r))
                except RequestError:                     # the variant's pool cannot hold the trace's longest request
                    rows.append([title, "does not fit: KV pool < longest request"] +
                                [""] * (len(VARIANTS_HEADER) - 2))
                print(f"  {name}: {' | '.join(map(str, rows[-1]))} ({time.perf_counter() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
            print(f"#### {name} trace: variants\n\n{fmt_table(VARIANTS_HEADER, rows)}\n", flush=True)
            continue
        t0 = time.perf_counter()
        r = simulate(trace, args.config, base, kv_tokens=kv_tokens, policy=args.policy)
        print(report(r, f"{name} trace, {args.config.name}" + (f" with {args.set}" if args.set else "")))
        if args.requests:
            print()
            print(per_request_table(r))
        print(f"\nplan: {r.plan}\n(simulated in {time.perf_counter() - t0:.0f} s)\n", flush=True)


if __name__ == "__main__":
    main()
