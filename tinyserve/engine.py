"""The engine: submit() returns an async stream of tokens; one step loop batches every running request.

Threads of a serving process, and what each may do:
  1. main:               the asyncio event loop: HTTP, SSE streaming, submit / cancel, and `_dispatch`, which hands
                         each step's tokens to the request streams. No torch compute.
  2. tinyserve-engine:   the one compute thread (`compute_thread()`), from start to exit: loads and dequantizes the
                         weights, allocates the pools, warms up (build.py), runs every step, every device <-> host
                         tier copy, every flush, and `Engine.call` jobs. A second thread running torch ops would start a second
                         OpenMP team, and on a 2-core machine both crawl (84 -> 54 tokens/s measured).
  3. torch's OpenMP workers, owned by the engine thread.
  4. tokenizer workers:  asyncio's default executor: chat templates, encode, decode (tokenizers; no torch).
  5. tinyserve-file-write: encodes and writes file-tier blobs from CPU copies the engine thread made (bytes only);
                         a timer thread hands it one more listing of a shared folder after its last write.
  6. tinyserve-file-read:  reads and checks file-tier blobs; tensors are views of the bytes read (no compute).
  6b. tinyserve-images (2): decode and preprocess request images (PIL, numpy; `prepare_images`; no torch compute).
  6c. tinyserve-status:  every 5 s hands the status page's sample (`engine.call(engine.stats)`) to the event loop.
  6d. tinyserve-compile: after start, compiles the CPU step graphs NEXTN needs that were not saved (compiled.py):
                         dynamo's tracing and inductor's compiler only, no torch compute; publishes each graph.
  7. aiohttp and asyncio internals (DNS resolver threads etc.), unused by us.
The event loop and the engine thread share only thread-safe queues: new requests, aborts and `call` jobs go in
(`_new`, `_aborts`, `_calls`, drained at the top of each step, so an abort frees its pages at the next step
boundary), and StepEvents come out through `loop.call_soon_threadsafe`. Everything the engine owns (scheduler,
pools, prefix cache) is touched on the engine thread only.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol

from tinyserve.cache import TIERS, Cache, CacheStats
from tinyserve.config import Config
from tinyserve.copies import CopyStream
from tinyserve.images import ProcessedImage
from tinyserve.pools import KVPool, PageAllocator, StatePool
from tinyserve.plan import MemoryPlan
from tinyserve.request import ContextError, Intake, Request, RequestError, Status
from tinyserve.runner import ModelRunner, SeqOutput
from tinyserve.sampling import SamplingParams
from tinyserve.scheduler import ScheduledSeq, Scheduler

__all__ = ["ContextError", "Engine", "EngineInfo", "EngineStats", "RequestError", "RequestStream",
           "StepEvent", "TokenEvent", "compute_thread"]

log = logging.getLogger("tinyserve.engine")

IDLE_WAIT_S = 0.05        # how long an idle engine thread sleeps between checks when a file-tier read may land
UPKEEP_S = 1.0           # how often a serving engine asks the cache whether it has upkeep (host memory) to do


@dataclass
class TokenEvent:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class StepEvent:
    """What one step did to one request, handed from the engine thread to the event loop."""
    request_id: str
    tokens: list[TokenEvent]
    finish_reason: str | None = None     # set when the request finished with this step
    cached_tokens: int = 0
    report: dict[str, Any] = field(default_factory=dict)   # the request's report now (a copy of Request.report)


@dataclass(frozen=True)
class EngineInfo:
    """The server's set-up as the status page and /metrics show it: fixed at start."""
    model: str                           # model.path
    served_name: str
    device: str
    dtype: str
    kv_dtype: str
    context_length: int
    kv_tokens: int                       # the device KV pool
    speculative: str                     # "nextn, N steps" ("" = off)
    idle_release_s: float
    plan_bytes: dict[str, int]           # the memory plan by part (weights, KV pool, state, snapshots, tiers)

    @classmethod
    def of(cls, cfg: Config, plan: MemoryPlan) -> EngineInfo:
        slot, page = plan.state_bytes_per_slot, plan.page_size * plan.kv_bytes_per_token
        steps = cfg.speculative.num_steps
        return cls(cfg.model.path, cfg.model.served_name, plan.device, plan.dtype, plan.kv_dtype, plan.context_length,
                   plan.kv_tokens, f"nextn, {steps} steps" if steps else "", cfg.engine.idle_release_s, {
                       "weights": plan.weights_bytes, "kv_pool": plan.kv_pages * page,
                       "state_slots": (plan.state_slots + plan.verify_slots) * slot,
                       "snapshot_slots": plan.snapshot_slots * slot,
                       "host_tier": plan.host_pages * page + plan.host_snapshots * slot,
                       "file_tier": plan.file_bytes})


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int
    kv_pages_total: int
    state_slots_used: int
    state_slots_total: int
    num_preemptions: int
    cache: CacheStats
    info: EngineInfo | None = None
    nextn: Any = None                    # spec.NextNStats (None: NEXTN is off)
    images: Any = None                   # multimodal.ImageStats (None: no vision tower)
    idle: Any = None                     # idle.IdleStats (None: engine.idle_release_s = 0)


def run_job(fut: Future, fn: Callable[..., Any], args: tuple) -> None:
    """fn(*args) into fut, unless it was cancelled; an exception goes to whoever waits on the future."""
    if fut.set_running_or_notify_cancel():
        try:
            fut.set_result(fn(*args))
        except BaseException as e:           # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(e)


class ComputeThread:
    """The one thread that runs torch compute in a serving process. A daemon that never exits: a SIGTERM during a
    long load ends the process at once, and no OpenMP team is left spinning by a finished thread."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="tinyserve-engine", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            run_job(*self._jobs.get())


_compute: ComputeThread | None = None
_compute_lock = threading.Lock()


def compute_thread() -> ComputeThread:
    """The process's compute thread (made on first use)."""
    global _compute
    with _compute_lock:
        if _compute is None:
            _compute = ComputeThread()
        return _compute


@dataclass(eq=False)
class RequestStream:
    """One submitted request as the event loop sees it: an async iterator over lists of its new TokenEvents, which
    ends when the request finishes, and its counts so far (Engine._dispatch keeps them)."""
    request_id: str
    prompt_tokens: int
    _engine: Engine = field(repr=False)
    _req: Request = field(repr=False)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    # what the cache and the optional parts report of the request: "cached_by_tier" (the cache's split of
    # cached_tokens by the tier they came from), "prompt_logprobs" (prompt_logprobs.py's, with the first tokens),
    # NEXTN's counts ("draft_rounds", "draft_tokens", "accepted_draft_tokens": spec.py)
    report: dict[str, Any] = field(default_factory=lambda: {"cached_by_tier": dict.fromkeys(TIERS, 0)})
    _queue: asyncio.Queue[list[TokenEvent] | None] = field(default_factory=asyncio.Queue, repr=False)

    async def __aiter__(self) -> AsyncIterator[list[TokenEvent]]:
        while (events := await self._queue.get()) is not None:
            yield events

    def cancel(self) -> None:
        if self.finish_reason is None:
            self._engine._abort(self._req)


class ImageEncoder(Protocol):                # multimodal.Images
    def encode(self, seqs: list[ScheduledSeq]) -> dict[Request, Exception]: ...
    def stats(self) -> Any: ...


class GrammarMatchers(Protocol):             # grammar.Grammar
    def advance(self, req: Request, tokens: list[int]) -> str | None: ...


class DraftCounters(Protocol):               # spec.NextN
    def stats(self) -> Any: ...


class IdlePools(Protocol):                   # idle.IdleRelease
    def timeout(self) -> float | None: ...
    def release(self) -> None: ...
    def wake(self) -> bool: ...
    def stats(self) -> Any: ...


class Engine:
    """The parts an engine is made of (built by build.py), the step, and the hand-over to the event loop.

    The optional parts it calls, each None when off (build.py sets them, with the scheduler's and the runner's):
        images   multimodal.Images    encodes the images a step's prefill chunks read, before the step
        grammar  grammar.Grammar      its matchers take each constrained request's kept tokens
        nextn    spec.NextN           its counters (stats); the API asks whether it is on (usage)
        idle     idle.IdleRelease     frees the device pools after engine.idle_release_s without a request
    """

    def __init__(self, cfg: Config, plan: MemoryPlan, model, tokenizer, *, kv_pool: KVPool,
                 allocator: PageAllocator, state_pool: StatePool, copies: CopyStream, cache: Cache,
                 scheduler: Scheduler, runner: ModelRunner, intake: Intake, work: threading.Event) -> None:
        self.cfg, self.plan, self.model, self.tokenizer = cfg, plan, model, tokenizer
        self.served_name = cfg.model.served_name
        self.context_length = plan.context_length
        self.info = EngineInfo.of(cfg, plan)
        self.kv_pool, self.allocator, self.state_pool, self.copies = kv_pool, allocator, state_pool, copies
        self.cache, self.scheduler, self.runner, self.intake = cache, scheduler, runner, intake
        self.images: ImageEncoder | None = None
        self.grammar: GrammarMatchers | None = None
        self.nextn: DraftCounters | None = None
        self.idle: IdlePools | None = None
        self.eos_token_ids = runner.eos_token_ids
        # hand-over between the event loop and the engine thread (see the module docstring)
        self._work = work                                # set when the engine thread has something to do
        self._new: deque[Request] = deque()
        self._aborts: deque[Request] = deque()
        self._calls: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._streams: dict[str, RequestStream] = {}     # unfinished requests; event-loop side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: asyncio.Future | None = None
        self._upkeep: asyncio.Task | None = None         # the cache's upkeep while serving
        self._stopping = False

    # ---- requests (called from the event loop or offline code) ----
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               images: list[ProcessedImage] = ()) -> RequestStream:
        """images: what Images.prepare (multimodal.py) returned for these (expanded) prompt ids."""
        return self.enqueue(self.intake.make_request(prompt_ids, params, request_id, images))

    def enqueue(self, req: Request) -> RequestStream:
        """A request intake.make_request made (and so checked): the engine thread takes it at its next step."""
        stream = RequestStream(req.request_id, len(req.prompt_ids), self, req)
        self._streams[req.request_id] = stream
        self._new.append(req)
        self._work.set()
        return stream

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not finished yet (running or waiting)."""
        return len(self._streams)

    def cancel_all(self) -> None:
        for stream in list(self._streams.values()):
            stream.cancel()

    def _abort(self, req: Request) -> None:
        self._aborts.append(req)
        self._work.set()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the engine thread between two steps (all torch work and everything the engine owns
        stays on that thread) and return its result."""
        return await asyncio.wrap_future(self.call_soon(fn, *args))

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> Future:
        """`call` from any thread: fn(*args) runs on the engine thread between two steps; its Future."""
        fut: Future = Future()
        self._calls.append((fut, fn, args))
        self._work.set()
        return fut

    # ---- the step (engine thread) ----
    def _step(self) -> list[StepEvent]:
        """Take what the event loop handed over (jobs, new requests, aborts), then run one step."""
        while self._calls:
            run_job(*self._calls.popleft())
        events = self._refuse_new() if self._new and self.idle is not None and not self.idle.wake() else []
        while self._new:                                 # before the aborts: a request may be cancelled at once
            self.scheduler.add(self._new.popleft())
        if self._aborts:
            events += self._take_aborts()
        return events + self.run_step(self.scheduler)

    def _refuse_new(self) -> list[StepEvent]:
        """After an idle release the device has no room for the new requests now: they fail (the next ones try
        again)."""
        events = []
        while self._new:
            req = self._new.popleft()
            req.status, req.finish_reason = Status.FINISHED, "error"
            events.append(self._event(req, []))
        return events

    def _take_aborts(self) -> list[StepEvent]:
        events = []
        while self._aborts:
            req = self._aborts.popleft()
            if req.status != Status.FINISHED:
                self.scheduler.abort(req)
                events.append(self._event(req, []))
        return events

    def run_step(self, sched: Scheduler) -> list[StepEvent]:
        """One forward over what `sched` schedules, its tokens committed."""
        seqs, events = sched.schedule(), []
        if self.images is not None and any(s.req.images is not None for s in seqs):
            failed = self.images.encode(seqs)            # an image the tower cannot encode fails its request alone
            events = self._fail_before_step(sched, failed)
            seqs = [s for s in seqs if s.req.status == Status.RUNNING]
        if not seqs:
            return events
        return events + self._commit(sched, seqs, self.runner.step(seqs))

    def _fail_before_step(self, sched: Scheduler, failed: dict[Request, Exception]) -> list[StepEvent]:
        events = []
        for req, error in failed.items():
            log.error("request %s failed before its step: %s", req.request_id, error)
            sched.abort(req)
            req.finish_reason = "error"
            events.append(self._event(req, []))
        return events

    def _commit(self, sched: Scheduler, seqs: list[ScheduledSeq], outputs: list[SeqOutput]) -> list[StepEvent]:
        # each sequence's tokens (a verify may bring several) up to the first that finishes its request; the
        # scheduler advances by what was kept before finished requests leave (the cache keeps what they computed)
        kept: dict[int, tuple[int, str | None]] = {}
        for o in outputs:
            req, p, reason = o.seq.req, o.seq.req.params, None
            for n, tok in enumerate(o.tokens, 1):
                req.output_ids.append(tok)
                made = len(req.output_ids)
                if made >= p.min_tokens and (tok in p.stop_token_ids or not p.ignore_eos and tok in self.eos_token_ids):
                    reason = "stop"
                elif made >= p.max_tokens or req.num_tokens >= self.context_length:
                    reason = "length"
                if reason:
                    break
            if req.grammar is not None and reason is None:   # a token its grammar rejects ends the request
                reason = self.grammar.advance(req, o.tokens[:n])
            kept[id(o.seq)] = n, reason
        sched.advance(seqs, [kept[id(s)][0] if id(s) in kept else 0 for s in seqs])
        events = []
        for o in outputs:
            req, (n, reason), p = o.seq.req, kept[id(o.seq)], o.seq.req.params
            if reason:
                sched.finish(req, reason)
            events.append(self._event(req, [TokenEvent(o.tokens[k], o.logprobs[k] if p.logprobs is not None else None,
                                                       o.top[k] if p.logprobs and o.top is not None else None)
                                            for k in range(n)]))
        return events

    @staticmethod
    def _event(req: Request, tokens: list[TokenEvent]) -> StepEvent:
        finished = req.finish_reason if req.status == Status.FINISHED else None
        return StepEvent(req.request_id, tokens, finished, req.cached_tokens, dict(req.report))

    def _has_work(self) -> bool:
        return bool(self._new or self._aborts or self._calls or self.scheduler.has_work())

    def _serve(self) -> None:
        """The engine thread's loop while serving: step, hand the events over, sleep when there is nothing to do."""
        while not self._stopping:
            self._work.clear()                           # before looking: a submit after this wakes the wait below
            try:
                events = self._step()
            except Exception:                            # a failed step must not kill the server: fail its requests
                log.exception("engine step failed; aborting the running requests")
                events = self._fail_all()
            if events:
                self._loop.call_soon_threadsafe(self._dispatch, events)
            elif not self._has_work():
                # /health answers on the event loop; /metrics and flushes are `call` jobs: none of them is a
                # request, so none restarts idle release's clock or brings its pools back
                timeout = self.idle.timeout() if self.idle is not None else None
                if not self._work.wait(timeout) and not self._has_work() and timeout is not None:
                    self.idle.release()
            elif not self.scheduler.running:             # requests wait on file-tier reads: their landing wakes us
                self._work.wait(IDLE_WAIT_S)
        self.cache.close()

    def _fail_all(self) -> list[StepEvent]:
        events = []
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(req)
            req.finish_reason = "error"
            events.append(self._event(req, []))
        return events

    # ---- async serving (event loop) ----
    async def start(self) -> None:
        """Run the step loop on the process's compute thread (the one that loaded the model, in a server)."""
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._serving = asyncio.wrap_future(compute_thread().submit(self._serve))
        if self.cache.has_upkeep:
            self._upkeep = asyncio.ensure_future(self._cache_upkeep())

    async def stop(self) -> None:
        """Stop the step loop and flush pending file-tier writes (bounded)."""
        if self._serving is None:
            return
        if self._upkeep is not None:
            self._upkeep.cancel()
            self._upkeep = None
        self._stopping = True
        self._work.set()
        await self._serving
        self._serving = None

    async def _cache_upkeep(self) -> None:
        """While serving: every UPKEEP_S, ask the cache whether it has upkeep to do (the host tier: the host's
        available memory fell below cache.host.min_free_gb, a read of /proc/meminfo), and if so run it on the
        engine thread, between two steps. Runs until stop()."""
        while True:
            await asyncio.sleep(UPKEEP_S)
            try:
                if self.cache.upkeep_due():
                    await self.call(self.cache.upkeep)
            except Exception:                             # noqa: BLE001 - serving goes on; the next check retries
                log.exception("prefix cache: its upkeep failed")

    def _dispatch(self, events: list[StepEvent]) -> None:
        for ev in events:
            if (stream := self._streams.get(ev.request_id)) is None:
                continue
            stream.cached_tokens = ev.cached_tokens
            stream.report.update(ev.report)
            if ev.tokens:
                stream.completion_tokens += len(ev.tokens)
                stream._queue.put_nowait(ev.tokens)
            if ev.finish_reason is not None:
                stream.finish_reason = ev.finish_reason
                stream._queue.put_nowait(None)
                del self._streams[ev.request_id]

    # ---- offline API (the calling thread does the compute; not while serving) ----
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Synchronous batch generation (tests, benchmarks)."""
        return [r.output_ids for r in self.run_requests(prompts, params)]

    def run_requests(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                     images: list[list[ProcessedImage]] | None = None) -> list[Request]:
        """Like generate(), returning the finished Requests (outputs, cached_tokens, finish_reason). images: per
        prompt, what Images.prepare (multimodal.py) returned for it."""
        assert self._serving is None, "run_requests() is offline only; use submit() while serving"
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ilist = images if images is not None else [[]] * len(prompts)
        reqs = [self.intake.make_request(p, sp, None, im) for p, sp, im in zip(prompts, plist, ilist)]
        self._new.extend(reqs)                           # taken by the next step, as a served request is
        while any(r.status != Status.FINISHED for r in reqs):
            if not self._step() and not self.scheduler.running:
                self._work.wait(IDLE_WAIT_S)             # a file-tier read is in flight
                self._work.clear()
        return reqs

    def stats(self) -> EngineStats:
        """On the engine thread (`await engine.call(engine.stats)` while serving)."""
        s = self.scheduler
        return EngineStats(num_running=len(s.running), num_waiting=len(s.waiting) + len(self._new),
                           kv_pages_used=self.allocator.num_used, kv_pages_total=self.allocator.num_pages,
                           state_slots_used=self.state_pool.num_slots - self.state_pool.num_free,
                           state_slots_total=self.state_pool.num_slots, num_preemptions=s.num_preemptions,
                           cache=self.cache.stats(), info=self.info,
                           nextn=self.nextn.stats() if self.nextn is not None else None,
                           images=self.images.stats() if self.images is not None else None,
                           idle=self.idle.stats() if self.idle is not None else None)

    def flush_cache(self, include_file: bool = False) -> bool:
        """Empty the prefix cache (device and host tiers; the file tier too when asked); False when a running
        request holds part of it (nothing is freed then). On the engine thread while serving."""
        return self.cache.flush(include_file)

    def close(self, timeout: float = 10.0) -> None:
        """Offline: flush pending file-tier writes (bounded) so a restart finds them."""
        self.copies.synchronize()
        self.cache.close(timeout)
