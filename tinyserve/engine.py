"""The asyncio engine: submit() returns an async stream of tokens; one step loop batches every running request.

The forward step runs in a single worker thread so the event loop (HTTP, streaming) stays responsive. All scheduler
state is touched only inside that thread's `_step`; the event loop hands new requests and aborts over through
thread-safe queues, which `_step` drains first, so an aborted request frees its pages at the next step boundary.
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from collections import deque
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinyserve.kv import FP8_DTYPES, KVPool, PageAllocator
from tinyserve.radix import RadixCache
from tinyserve.tiers import FileTier, HostTier, model_fingerprint
from tinyserve.runner import ModelRunner
from tinyserve.sampling import SamplingParams
from tinyserve.scheduler import Request, Scheduler, Status
from tinyserve.state import StatePool

log = logging.getLogger("tinyserve.engine")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU_DEFAULT_KV_TOKENS = 32768     # the CPU path's modest default when engine.kv_cache_tokens = 0


@dataclass
class TokenEvent:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class RequestResult:
    request_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "file": 0})
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    state_slots_used: int
    state_slots_total: int
    num_preemptions: int
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    cached_pages: int = 0
    snapshots_held: int = 0
    snapshots_evicted: int = 0
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class MemoryPlan:
    device: str
    dtype: str
    weights_bytes: int
    kv_cache_dtype: str
    page_size: int
    kv_pages: int
    kv_bytes_per_token: int
    state_slots: int
    state_bytes_per_slot: int
    context_length: int
    snapshot_slots: int = 0
    host_pages: int = 0
    host_snapshots: int = 0
    file_dir: str = ""
    file_bytes: int = 0
    file_blobs: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size

    def __str__(self) -> str:
        gib = 1 << 30
        return (f"device {self.device} ({self.dtype}); weights {self.weights_bytes / gib:.2f} GiB; "
                f"KV pool {self.kv_tokens} tokens ({self.kv_pages} pages of {self.page_size}, {self.kv_cache_dtype}, "
                f"{self.kv_tokens * self.kv_bytes_per_token / gib:.2f} GiB); "
                f"GDN state {self.state_slots} slots ({self.state_slots * self.state_bytes_per_slot / gib:.2f} GiB); "
                f"prefix-cache state snapshots {self.snapshot_slots} "
                f"({self.snapshot_slots * self.state_bytes_per_slot / gib:.2f} GiB); "
                f"context {self.context_length} tokens"
                + (f"; host tier {self.host_pages * self.page_size} tokens ({self.host_pages} pages) + "
                   f"{self.host_snapshots} snapshots" if self.host_pages else "")
                + (f"; file tier {self.file_dir} up to {self.file_bytes / gib:.2f} GiB "
                   f"(~{self.file_bytes // max(1, self.kv_bytes_per_token)} tokens), {self.file_blobs} blobs found"
                   if self.file_dir else ""))


class RequestStream:
    """Async iterator over lists of new TokenEvents of one request; ends when the request finishes."""

    def __init__(self, engine: "Engine", req: Request, result: RequestResult) -> None:
        self._engine, self._req = engine, req
        self.request_id = req.request_id
        self.result = result
        self._queue: asyncio.Queue[list[TokenEvent] | None] = asyncio.Queue()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> list[TokenEvent]:
        item = await self._queue.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        if self.result.finish_reason is None:
            self._engine._abort(self._req)


class Engine:
    def __init__(self, model, tokenizer, *, page_size: int = 16, kv_tokens: int = CPU_DEFAULT_KV_TOKENS,
                 max_running_requests: int = 8, chunked_prefill_size: int = 2048, context_length: int = 0,
                 kv_cache_dtype: torch.dtype | None = None, served_name: str = "tinyserve",
                 enable_prefix_cache: bool = True, state_track_interval: int = 512, snapshot_slots: int = 0,
                 sleep_on_idle: bool = True, host_cache_gb: float = 0.0, host_state_share: float = 0.0,
                 write_policy: str = "write_through", file_cache_dir: str = "", file_cache_gb: float = 0.0,
                 prefetch_policy: str = "best_effort") -> None:
        cfg = model.cfg
        self.model, self.tokenizer, self.model_config = model, tokenizer, cfg
        self.served_name = served_name
        self.device = model.device
        self.context_length = context_length or cfg.max_position_embeddings
        self.page_size = page_size
        kv_dtype = kv_cache_dtype or model.dtype
        num_pages = max(1, kv_tokens // page_size)
        self.kv_pool = KVPool(num_pages, page_size, len(cfg.attn_layer_ids), cfg.num_key_value_heads, cfg.head_dim,
                              kv_dtype, self.device)
        self.allocator = PageAllocator(num_pages)
        hybrid = bool(cfg.gdn_layer_ids)
        if not enable_prefix_cache:
            snapshot_slots = 0
        elif snapshot_slots == 0:
            snapshot_slots = 4 * max_running_requests if hybrid else 0
        self.state_pool = StatePool(max_running_requests, len(cfg.gdn_layer_ids), cfg.conv_dim,
                                    cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                    cfg.linear_value_head_dim, model.dtype, self.device,
                                    num_snapshot_slots=snapshot_slots)
        self.host_tier = self.file_tier = None
        if enable_prefix_cache and host_cache_gb > 0:
            self.host_tier = HostTier(self.kv_pool, self.state_pool, int(host_cache_gb * (1 << 30)),
                                      host_state_share, hybrid)
        if enable_prefix_cache and file_cache_dir:
            self.file_tier = FileTier(Path(file_cache_dir), int(file_cache_gb * (1 << 30)),
                                      model_fingerprint(model, kv_dtype, page_size),
                                      tuple(self.kv_pool.buffer.shape[1:]), kv_dtype,
                                      tuple(self.state_pool.conv.shape[1:]), self.state_pool.conv.dtype,
                                      tuple(self.state_pool.ssm.shape[1:]))
        self.cache = RadixCache(self.allocator, self.state_pool, page_size, hybrid, self.host_tier, self.file_tier,
                                write_policy, self.kv_pool.buffer) if enable_prefix_cache else None
        self.scheduler = Scheduler(self.allocator, self.state_pool, page_size, max_running_requests,
                                   chunked_prefill_size, self.cache, state_track_interval, prefetch_policy)
        eos = sorted(set(cfg.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", []) or []))
        self.eos_token_ids = eos
        self.runner = ModelRunner(model, self.kv_pool, self.state_pool, eos)
        self.plan = MemoryPlan(
            device=str(self.device), dtype=str(model.dtype).replace("torch.", ""),
            weights_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
            kv_cache_dtype=str(kv_dtype).replace("torch.", ""), page_size=page_size, kv_pages=num_pages,
            kv_bytes_per_token=KVPool.bytes_per_token(len(cfg.attn_layer_ids), cfg.num_key_value_heads,
                                                      cfg.head_dim, kv_dtype),
            state_slots=max_running_requests, state_bytes_per_slot=self.state_pool.bytes_per_slot,
            snapshot_slots=snapshot_slots,
            host_pages=self.host_tier.num_pages if self.host_tier else 0,
            host_snapshots=self.host_tier.num_snapshots if self.host_tier else 0,
            file_dir=file_cache_dir if self.file_tier else "", file_bytes=int(file_cache_gb * (1 << 30)),
            file_blobs=self.file_tier.num_blobs if self.file_tier else 0,
            context_length=self.context_length)
        # hand-over between the event loop and the step thread
        self._new: deque[Request] = deque()
        self._aborts: deque[Request] = deque()
        self._streams: dict[str, RequestStream] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinyserve-step")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._lock = threading.Lock()
        self.sleep_on_idle = sleep_on_idle

    # ---- construction from the TOML config ----
    @classmethod
    def from_config(cls, cfg) -> "Engine":
        from tinyserve.loader import load_model
        from tinyserve.tokenizer import Tokenizer
        device = cfg.model.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("model.device = \"cuda\" but no CUDA device is available")
        dtype = DTYPES.get(cfg.model.dtype) or (torch.bfloat16 if device == "cuda" else torch.float32)
        folder = cfg.model.path
        if folder == "demo":
            from tinyserve.demo import ensure_demo_checkpoint
            folder = ensure_demo_checkpoint()
        model = load_model(Path(folder), dtype, device)
        tokenizer = Tokenizer.from_folder(folder)
        if cfg.speculative.algorithm:   # accepted so production configs stay valid; not built yet: say so
            log.warning("speculative.algorithm: not implemented in this version yet; running without it")
        kv_name = cfg.model.kv_cache_dtype
        kv_dtype = FP8_DTYPES.get(kv_name) or DTYPES.get(kv_name) or dtype
        kv_tokens = cfg.engine.kv_cache_tokens or cls._derive_kv_tokens(model, kv_dtype, cfg, device)
        return cls(model, tokenizer, page_size=cfg.engine.page_size, kv_tokens=kv_tokens,
                   max_running_requests=cfg.engine.max_running_requests,
                   chunked_prefill_size=cfg.engine.chunked_prefill_size,
                   context_length=cfg.model.context_length, kv_cache_dtype=kv_dtype,
                   served_name=cfg.model.served_name, enable_prefix_cache=cfg.cache.enabled,
                   state_track_interval=cfg.cache.state_track_interval, snapshot_slots=cfg.cache.state_slots,
                   sleep_on_idle=cfg.engine.sleep_on_idle, host_cache_gb=cfg.cache.host.size_gb,
                   host_state_share=cfg.cache.host.state_share, write_policy=cfg.cache.host.write_policy,
                   file_cache_dir=cfg.cache.file.dir, file_cache_gb=cfg.cache.file.size_gb,
                   prefetch_policy=cfg.cache.file.prefetch_policy)

    @staticmethod
    def _derive_kv_tokens(model, kv_dtype: torch.dtype, cfg, device: str) -> int:
        if device != "cuda":
            return CPU_DEFAULT_KV_TOKENS
        free, _ = torch.cuda.mem_get_info()
        mc = model.cfg
        per_token = KVPool.bytes_per_token(len(mc.attn_layer_ids), mc.num_key_value_heads, mc.head_dim, kv_dtype)
        state = cfg.engine.max_running_requests * len(mc.gdn_layer_ids) * mc.linear_num_value_heads * \
            mc.linear_key_head_dim * mc.linear_value_head_dim * 4
        budget = free * cfg.engine.mem_fraction_static - state - (1 << 30)   # 1 GiB for activations
        return max(cfg.engine.page_size, int(budget // per_token))

    # ---- requests ----
    def _make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None) -> Request:
        params.validate()
        n = len(prompt_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.model_config.vocab_size - 1})")
        if n + params.max_tokens > self.context_length:
            raise ValueError(f"the prompt has {n} tokens and max_tokens is {params.max_tokens}, which is more than "
                             f"the context length of {self.context_length} tokens")
        pool_tokens = self.kv_pool.num_pages * self.page_size
        if n + params.max_tokens > pool_tokens:
            raise ValueError(f"the prompt has {n} tokens and max_tokens is {params.max_tokens}, which is more than "
                             f"the KV cache holds ({pool_tokens} tokens); raise engine.kv_cache_tokens")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return Request(request_id or uuid.uuid4().hex, list(prompt_ids), params, seed)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        req = self._make_request(prompt_ids, params, request_id)
        result = RequestResult(req.request_id, len(prompt_ids))
        stream = RequestStream(self, req, result)
        self._streams[req.request_id] = stream
        self._new.append(req)
        self._wake()
        return stream

    def _abort(self, req: Request) -> None:
        self._aborts.append(req)
        self._wake()

    def _wake(self) -> None:
        if self._loop is not None and self._wakeup is not None:
            self._loop.call_soon_threadsafe(self._wakeup.set)

    # ---- the step (runs in the worker thread) ----
    def _step(self) -> list[tuple[Request, list[TokenEvent], bool]]:
        with self._lock:                                   # flush_cache() may come from the event loop
            return self._step_locked()

    def _step_locked(self) -> list[tuple[Request, list[TokenEvent], bool]]:
        sched = self.scheduler
        events: list[tuple[Request, list[TokenEvent], bool]] = []
        while self._new:                                   # before the aborts: a request may be cancelled at once
            sched.add(self._new.popleft())
        while self._aborts:
            req = self._aborts.popleft()
            if req.status != Status.FINISHED:
                sched.abort(req)
                events.append((req, [], True))
        seqs = sched.schedule()
        if not seqs:
            pending = sched.blocking_prefetches()
            if pending:   # nothing to run until a file-tier read lands: wait for it (bounded) instead of spinning
                futures.wait(pending, timeout=0.05, return_when=futures.FIRST_COMPLETED)
            return events
        out = self.runner.step(seqs)
        sched.advance(seqs)
        if out.result is None:
            return events
        r = out.result
        tokens = r.tokens.tolist()
        logprobs = r.logprobs.tolist() if r.logprobs is not None else None
        top_ids = r.top_ids.tolist() if r.top_ids is not None else None
        top_lps = r.top_logprobs.tolist() if r.top_logprobs is not None else None
        for row, s in enumerate(out.sampled):
            req = s.req
            p = req.params
            tok = tokens[row]
            ev = TokenEvent(tok)
            if p.logprobs is not None and logprobs is not None:
                ev.logprob = logprobs[row]
                if p.logprobs > 0 and top_ids is not None:
                    ev.top_logprobs = list(zip(top_ids[row][:p.logprobs], top_lps[row][:p.logprobs]))
            req.output_ids.append(tok)
            reason = self._finish_reason(req, tok)
            if reason:
                sched.finish(req, reason)
            events.append((req, [ev], reason is not None))
        return events

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p, n = req.params, len(req.output_ids)
        if n >= p.min_tokens and ((not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids):
            return "stop"
        if n >= p.max_tokens or req.num_tokens >= self.context_length:
            return "length"
        return None

    # ---- async loop ----
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._task = asyncio.create_task(self._run_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._executor.shutdown(wait=True)
        self.close_tiers()

    def close_tiers(self, timeout: float = 10.0) -> None:
        """Flush pending file-tier writes (bounded) so a restart finds them."""
        if self.file_tier is not None:
            self.file_tier.close(timeout)

    async def _run_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._new or self._aborts or self.scheduler.has_work()):
                if not self.sleep_on_idle:             # poll: a new request starts without a wake-up hop
                    await asyncio.sleep(0.0005)
                    continue
                self._wakeup.clear()
                if not (self._new or self._aborts):
                    await self._wakeup.wait()
                continue
            try:
                events = await loop.run_in_executor(self._executor, self._step)
            except Exception:                      # a failed step must not kill the server: fail its requests
                log.exception("engine step failed; aborting the running requests")
                events = await loop.run_in_executor(self._executor, self._fail_all)
            self._dispatch(events)

    def _fail_all(self) -> list[tuple[Request, list[TokenEvent], bool]]:
        events = []
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(req)
            req.finish_reason = "error"
            events.append((req, [], True))
        return events

    def _dispatch(self, events: list[tuple[Request, list[TokenEvent], bool]]) -> None:
        now = time.monotonic()
        for req, tokens, finished in events:
            stream = self._streams.get(req.request_id)
            if stream is None:
                continue
            res = stream.result
            res.cached_tokens = req.cached_tokens
            res.cached_tokens_by_tier.update(req.cached_by_tier)
            if tokens:
                res.completion_tokens += len(tokens)
                if res.first_token_time is None:
                    res.first_token_time = now
                stream._queue.put_nowait(tokens)
            if finished:
                res.finish_reason = req.finish_reason
                res.finish_time = now
                stream._queue.put_nowait(None)
                del self._streams[req.request_id]

    # ---- offline API ----
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Synchronous batch generation (tests, benchmarks). Not for use while the async loop runs."""
        return [r.output_ids for r in self.run_requests(prompts, params)]

    def run_requests(self, prompts: list[list[int]],
                     params: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Like generate(), returning the finished Requests (outputs, cached_tokens, finish_reason)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self._make_request(p, sp, None) for p, sp in zip(prompts, plist)]
        for r in reqs:
            self.scheduler.add(r)
        while any(r.status != Status.FINISHED for r in reqs):
            self._step()
        return reqs

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(num_running=len(s.running), num_waiting=len(s.waiting) + len(self._new),
                           kv_pages_used=self.allocator.num_used, kv_pages_total=self.allocator.num_pages,
                           state_slots_used=self.state_pool.num_slots - self.state_pool.num_free,
                           state_slots_total=self.state_pool.num_slots, num_preemptions=s.num_preemptions,
                           prefix_cache_query_tokens=self.cache.query_tokens if self.cache else 0,
                           prefix_cache_hit_tokens=self.cache.hit_tokens if self.cache else 0,
                           cached_pages=self.cache.num_pages if self.cache else 0,
                           snapshots_held=self.cache.num_snapshots if self.cache else 0,
                           snapshots_evicted=self.cache.snapshots_evicted if self.cache else 0,
                           tiers=self._tier_stats())

    def _tier_stats(self) -> dict[str, dict[str, float]]:
        out = {}
        if self.host_tier is not None:
            h = self.host_tier
            out["host"] = dict(vars(h.stats), used_pages=h.num_pages - h.num_free_pages, capacity_pages=h.num_pages,
                               used_snapshots=h.num_snapshots - h.num_free_snapshots,
                               capacity_snapshots=h.num_snapshots)
        if self.file_tier is not None:
            f = self.file_tier
            out["file"] = dict(vars(f.stats), used_bytes=f.used_bytes, capacity_bytes=f.size_bytes,
                               blobs=f.num_blobs, writable=int(f.writable))
        return out

    def flush_cache(self, include_file: bool = False) -> bool:
        """Empty the prefix cache (device and host tiers; the file tier too when asked); False when a running
        request holds part of it (nothing is freed then)."""
        with self._lock:
            ok = self.scheduler.flush_cache()
        if ok and include_file and self.file_tier is not None:
            self.file_tier.clear()
        return ok
