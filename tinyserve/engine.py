"""The engine: submit() returns an async stream of tokens; one step loop batches every running request.

Threads of a serving process, and what each may do:
  1. main:               the asyncio event loop: HTTP, SSE streaming, submit / cancel, and `_dispatch`, which hands
                         each step's tokens to the request streams. No torch compute.
  2. tinyserve-engine:   the one compute thread (`compute_thread()`), from start to exit: loads and dequantizes the
                         weights, allocates the pools, warms up, runs every step, every device <-> host tier copy,
                         every flush, and `Engine.call` jobs. A second thread running torch ops would start a second
                         OpenMP team, and on a 2-core machine both crawl (84 -> 54 tokens/s measured).
  3. torch's OpenMP workers, owned by the engine thread.
  4. tokenizer workers:  asyncio's default executor: chat templates, encode, decode (tokenizers; no torch).
  5. tinyserve-file-write: encodes and writes file-tier blobs from CPU copies the engine thread made (bytes only).
  6. tinyserve-file-read:  reads and checks file-tier blobs; tensors are views of the bytes read (no compute).
  6b. tinyserve-images (2): decode and preprocess request images (PIL, numpy; `prepare_images`; no torch compute).
  7. aiohttp and asyncio internals (DNS resolver threads etc.), unused by us.
The event loop and the engine thread share only thread-safe queues: new requests, aborts and `call` jobs go in
(`_new`, `_aborts`, `_calls`, drained at the top of each step, so an abort frees its pages at the next step
boundary), and StepEvents come out through `loop.call_soon_threadsafe`. Everything the engine owns (scheduler,
pools, prefix cache) is touched on the engine thread only.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import random
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tinyserve.blob import model_fingerprint, weights_digest
from tinyserve.cache import CacheStats, NullCache, PrefixCache
from tinyserve.config import Config, ConfigError
from tinyserve.copies import CopyStream, copy_stream_for
from tinyserve.file_tier import FileTier
from tinyserve.grammar import GrammarCompiler
from tinyserve.host_tier import HostTier
from tinyserve.images import ImageError, ImageProcessorConfig, ImageSource, ProcessedImage, decode_image, preprocess
from tinyserve.kernels import set_backend as set_kernel_backend, triton_problem, use_triton
from tinyserve.kernels.fp8_weight import Fp8Weight
from tinyserve.kernels.linear import calibrate as calibrate_linear
from tinyserve.kv import KVPool, PageAllocator
from tinyserve.models.config import WeightCount
from tinyserve.multimodal import expand_image_pads, image_keys, request_images
from tinyserve.plan import GIB, MemoryPlan, dtype_name, plan_for, torch_dtype
from tinyserve.request import TIERS, Request, Status
from tinyserve.runner import ModelRunner
from tinyserve.sampling import SamplingParams
from tinyserve.scheduler import Scheduler
from tinyserve.spec import FixedDepth, NextNSetup, SpecStats
from tinyserve.state import StatePool

log = logging.getLogger("tinyserve.engine")

IDLE_WAIT_S = 0.05        # how long an idle engine thread sleeps between checks when a file-tier read may land
HOST_MEMORY_CHECK_S = 1.0  # how often a serving engine compares the host's available memory with its floor


class RequestError(ValueError):
    """A request the engine cannot take. `field` names what is wrong: a SamplingParams field, "prompt" or
    "max_tokens" (the API maps it to the request's own field name)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


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
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    drafted: int = 0                     # NEXTN draft tokens verified for this request in this step
    accepted: int = 0                    # ... of which accepted (the committed tokens are accepted + 1)


@dataclass
class RequestResult:
    request_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    draft_tokens: int = 0                # NEXTN draft tokens verified (usage: accepted + rejected prediction tokens)
    accepted_draft_tokens: int = 0


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
    spec: SpecStats | None = None        # NEXTN counters; None when speculative decoding is off
    pools_released: bool = False         # idle release: the device pools are freed now
    idle_releases: int = 0
    images_received: int = 0             # images in submitted requests
    images_encoded: int = 0              # images through the vision tower (a feature-cache hit skips it)
    image_encode_seconds: float = 0.0


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
            fut, fn, args = self._jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:           # noqa: BLE001 - handed to whoever waits on the future
                    fut.set_exception(e)


_compute: ComputeThread | None = None
_compute_lock = threading.Lock()


def compute_thread() -> ComputeThread:
    """The process's compute thread (made on first use)."""
    global _compute
    with _compute_lock:
        if _compute is None:
            _compute = ComputeThread()
        return _compute


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
    def __init__(self, cfg: Config, model, tokenizer, plan: MemoryPlan, copy_stream: CopyStream | None = None) -> None:
        """copy_stream: where tier copies run (copies.py); by default the device's own (CUDA: a stream of its own,
        the CPU: at once)."""
        mc = model.cfg
        self.cfg, self.model, self.tokenizer, self.plan = cfg, model, tokenizer, plan
        self.served_name = cfg.model.served_name
        self.context_length = plan.context_length
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = sorted(set(mc.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else []))
        self.nextn: NextNSetup | None = None
        if plan.nextn_layers:
            sp = cfg.speculative
            self.nextn = NextNSetup(sp.num_steps, sp.max_running, kv_layer=len(mc.attn_layer_ids))
        self.spec_stats = SpecStats()
        device = model.device
        kv_dtype = torch_dtype(plan.kv_dtype)
        self.kv_pool = KVPool(plan.kv_pages, plan.page_size, plan.kv_layers, mc.num_key_value_heads,
                              mc.head_dim, kv_dtype, device)
        self.allocator = PageAllocator(plan.kv_pages)
        self.state_pool = StatePool(plan.state_slots + plan.verify_slots, len(mc.gdn_layer_ids), mc.conv_dim,
                                    mc.linear_conv_kernel_dim,
                                    mc.linear_num_value_heads, mc.linear_key_head_dim, mc.linear_value_head_dim,
                                    model.dtype, device, num_snapshot_slots=plan.snapshot_slots)
        # tier copies on a stream of their own (CUDA); pages and slots handed out again wait for their saves
        self.copies = copy_stream or copy_stream_for(device)
        self.allocator.fence, self.state_pool.fence = self.copies.fence_pages, self.copies.fence_slots
        self._work = threading.Event()           # set when the engine thread has something to do
        self.cache = self._build_cache(cfg, plan) if cfg.cache.enabled else NullCache(self.state_pool)
        self.scheduler = Scheduler(self.allocator, self.state_pool, plan.page_size, cfg.engine.max_running_requests,
                                   cfg.engine.chunked_prefill_size, self.cache,
                                   lookahead=self.nextn.num_steps if self.nextn else 0)
        self.runner = ModelRunner(model, self.kv_pool, self.state_pool, self.eos_token_ids, self.nextn,
                                  self.context_length)
        self.image_processor = self._image_processor(model) if model.visual is not None else None
        # image tokens' cache keys depend on the tower that makes their features (the file tier's fingerprint
        # leaves the tower out, so text pages are shared whether model.vision is on or off)
        self.vision_fingerprint = weights_digest(model.visual) if model.visual is not None else b""
        try:                             # engine.kernels: the Triton kernels or the torch references
            set_kernel_backend(cfg.engine.kernels)
        except RuntimeError as e:
            raise ConfigError(str(e), "engine.kernels") from None
        if plan.device == "cpu":         # pick this CPU's faster GEMM route on the model's own shapes
            shapes = {tuple(p.shape): p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n}
            log.info("CPU GEMM route: %s", calibrate_linear(list(shapes.values())))
        # hand-over between the event loop and the engine thread (see the module docstring)
        self._new: deque[Request] = deque()
        self._aborts: deque[Request] = deque()
        self._calls: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._streams: dict[str, RequestStream] = {}     # unfinished requests; event-loop side only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: asyncio.Future | None = None
        self._watcher: asyncio.Task | None = None      # the host-memory watcher while serving
        self._stopping = False
        self._last_busy = time.monotonic()             # the last step that ran a request (idle release)
        self.idle_releases = 0
        self.images_received = 0
        # llguidance's view of the tokenizer, built once here (~1 s for a 250k vocabulary: not on the event loop)
        self._grammar: GrammarCompiler | None = None
        self._grammar_error = "the engine has no tokenizer"
        if tokenizer is not None:
            try:
                self._grammar = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
            except Exception as e:                       # noqa: BLE001 - serve without constrained decoding
                self._grammar_error = f"llguidance cannot use this tokenizer ({e})"
                log.warning("constrained decoding (response_format) is off: %s", self._grammar_error)
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        """engine.cuda_graphs on CUDA: decode and NEXTN verify steps go through the runner's static path, whose CUDA
        graphs are captured here, at start (a server is not ready before), one per batch size up to
        engine.max_running_requests and tokens per sequence (1 + the draft steps). They need the Triton kernels
        (the torch references read values on the host)."""
        if self.plan.device != "cuda" or not self.cfg.engine.cuda_graphs:
            return
        if not use_triton(self.kv_pool.buffer):
            why = triton_problem() if self.cfg.engine.kernels == "auto" else ""
            log.log(logging.WARNING if why else logging.INFO, "CUDA graphs are off: engine.kernels = %r runs the "
                    "torch references on CUDA%s", self.cfg.engine.kernels, f" ({why})" if why else "")
            return
        self.runner.enable_static_steps(self.cfg.engine.max_running_requests, capture=True)

    @staticmethod
    def _image_processor(model) -> ImageProcessorConfig:
        """The checkpoint's image processor settings, which must cut patches the way its vision tower takes them."""
        folder, vc = Path(model.cfg.folder), model.visual.cfg
        want = (vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)
        if not any((folder / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
            log.info("%s has no preprocessor_config.json: the image processor takes Qwen3.5's released settings "
                     "with the vision tower's patch sizes", folder)
            return ImageProcessorConfig(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                        temporal_patch_size=vc.temporal_patch_size)
        try:
            proc = ImageProcessorConfig.from_folder(folder)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{folder}: cannot read the image processor config: {e}", "model.path") from None
        if (proc.patch_size, proc.merge_size, proc.temporal_patch_size) != want:
            raise ConfigError(f"{folder}: the image processor cuts patch_size / merge_size / temporal_patch_size "
                              f"{(proc.patch_size, proc.merge_size, proc.temporal_patch_size)}, the vision tower "
                              f"(config.json vision_config) takes {want}", "model.path")
        return proc

    def _build_cache(self, cfg: Config, plan: MemoryPlan) -> PrefixCache:
        host = file = None
        if plan.host_pages or plan.host_snapshots:
            host = HostTier(self.kv_pool, self.state_pool, plan.host_pages, plan.host_snapshots,
                            min_free_bytes=int(cfg.cache.host.min_free_gb * GIB), copies=self.copies)
        if plan.file_dir:
            file = FileTier.for_pools(Path(plan.file_dir), plan.file_bytes,
                                      model_fingerprint(self.model, self.kv_pool.dtype, plan.page_size),
                                      self.kv_pool, self.state_pool, self.copies, host, needs_state=plan.hybrid)
            log.info("file tier %s: %d blobs found", plan.file_dir, file.num_blobs)
        return PrefixCache(cfg, self.allocator, self.state_pool, plan.page_size, plan.hybrid, host, file,
                           wake=self._work.set)

    @classmethod
    def from_config(cls, cfg: Config) -> "Engine":
        """Plan from the checkpoint's headers, then load the weights and build the pools, on the calling thread
        (a server calls this on the compute thread)."""
        from tinyserve.loader import load_model
        from tinyserve.tokenizer import Tokenizer
        folder, _, plan = plan_for(cfg)
        try:
            model = load_model(folder, torch_dtype(plan.dtype), plan.device, vision=cfg.model.vision,
                               fp8_weights=plan.fp8_weights)
            engine = cls(cfg, model, Tokenizer.from_folder(folder), plan)
            engine.price_drafts()             # NEXTN: the first forwards, before serving
        except RuntimeError as e:             # torch.OutOfMemoryError (CUDA) or the CPU allocator's failure
            if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
                raise
            key = "engine.mem_fraction_static" if plan.device == "cuda" else "engine.kv_cache_tokens"
            raise ConfigError(f"out of memory while loading the model, allocating the pools the plan sized "
                              f"({plan}) or running the first steps; lower {key}", key) from None
        return engine

    def price_drafts(self, steps: int = 3) -> None:
        """NEXTN: time single-request decode steps at each draft depth on this machine and model (the runner's
        StepCost, which chooses how deep requests draft), with a throw-away request, before serving."""
        if self.nextn is None:
            return
        prompt = [(7 * i + 3) % self.vocab_size for i in range(64)]
        k = self.nextn.num_steps
        try:
            req = self._make_request(prompt, SamplingParams(max_tokens=(k + 1) * (steps + 2) * (k + 2),
                                                            temperature=0, ignore_eos=True), "price-drafts")
        except RequestError as e:                      # a tiny context or pool: price drafts as they run
            log.info("NEXTN: draft depths not timed at start (%s)", e)
            return
        cache, self.scheduler.cache = self.scheduler.cache, NullCache(self.state_pool)   # nothing of it is kept
        try:
            self.scheduler.add(req)
            while not req.output_ids:                  # the prompt
                self._step()
            for depth in range(k + 1):
                req.depth = FixedDepth(depth)
                for _ in range(steps + 1):             # the first step at a new depth is not steady yet
                    if req.status != Status.RUNNING:
                        break
                    self._step()
            if req.status != Status.FINISHED:
                self.scheduler.abort(req)
        finally:
            self.scheduler.cache = cache
        self.spec_stats = SpecStats()
        log.info("NEXTN: a decode step with 0..%d drafts takes %s ms here", k,
                 ", ".join(f"{t * 1000:.1f}" for t in self.runner.step_cost.seconds))

    @classmethod
    def for_model(cls, cfg: Config, model, tokenizer=None, copy_stream: CopyStream | None = None) -> "Engine":
        """An engine around a model already loaded (tests, notebooks): the plan from cfg and the model's sizes,
        in the model's own dtype."""
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype_name(model.dtype)))
        fp8 = [m for m in model.modules() if isinstance(m, Fp8Weight)]
        fp8_values = sum(m.weight.numel() for m in fp8)
        weights = WeightCount(sum(p.numel() for p in model.parameters()) + fp8_values, fp8_values,
                              sum(m.scale.numel() for m in fp8))
        free = None
        if model.device.type == "cuda":          # free memory as if the weights, loaded already, were not
            free = torch.cuda.mem_get_info(model.device)[0] + weights.bytes(torch.empty((), dtype=model.dtype)
                                                                           .element_size())
        plan = MemoryPlan.resolve(cfg, model.cfg, model.device.type, weights, gpu_free_bytes=free,
                                  cuda_capability=torch.cuda.get_device_capability(model.device) if free else None)
        return cls(cfg, model, tokenizer, plan, copy_stream)

    # ---- requests (called from the event loop or offline code) ----
    def fit_max_tokens(self, prompt_len: int, max_tokens: int | None, clamp: bool = False) -> int:
        """The max_tokens a request with this prompt gets: None means up to the end of the context (vLLM's
        default), but never past what the KV pool holds, which on a small card or the CPU can be less. With clamp,
        a larger max_tokens is cut to what fits instead of refused (Anthropic's clients send one large
        max_tokens whatever the server's context)."""
        context, pool = self.context_length, self.plan.kv_tokens
        if prompt_len >= context:
            raise RequestError(f"the prompt is {prompt_len} tokens long, but the context is {context} tokens "
                               "(there must be room for at least one generated token)", "prompt")
        if prompt_len >= pool:
            raise RequestError(f"the prompt is {prompt_len} tokens long, but the KV cache holds {pool} tokens; "
                               "raise engine.kv_cache_tokens", "prompt")
        if max_tokens is None or (clamp and prompt_len + max_tokens > min(context, pool)):
            return min(context, pool) - prompt_len if max_tokens is None else \
                min(max_tokens, min(context, pool) - prompt_len)
        room = context - prompt_len
        if max_tokens > room:
            raise RequestError(f"max_tokens ({max_tokens}) plus the prompt ({prompt_len} tokens) is longer than the "
                               f"context ({context} tokens); at most {room} tokens fit", "max_tokens")
        if prompt_len + max_tokens > pool:
            raise RequestError(f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}, which is more "
                               f"than the KV cache holds ({pool} tokens); raise engine.kv_cache_tokens",
                               "max_tokens")
        return max_tokens

    def validate(self, params: SamplingParams) -> None:
        """The one validation of sampling parameters; raises RequestError naming the field."""
        try:
            params.validate()
        except ValueError as e:                          # its messages start with the field name
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids: {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                               "stop_token_ids")

    # ---- images ----
    @property
    def vision(self) -> bool:
        """Whether requests may carry images (a vision tower is loaded)."""
        return self.image_processor is not None

    def check_images(self, params: list[str]) -> None:
        """May a request carry images from these request fields? RequestError naming the first one that may not
        (the API asks before it fetches any)."""
        if params and not self.vision:
            raise RequestError(f"{params[0]}: this model takes no image input (the checkpoint has no vision tower, "
                               "or model.vision = false)", params[0])
        limit = self.cfg.model.max_images
        if len(params) > limit:
            raise RequestError(f"{len(params)} images in one request; at most {limit} (model.max_images)",
                               params[limit])

    def prepare_images(self, prompt_ids: list[int], sources: list[ImageSource]) -> tuple[list[int], list[ProcessedImage]]:
        """Decode and preprocess a request's images (in prompt order) and widen the template's one pad per image
        to its token count. Runs on a worker thread (PIL and numpy, no torch compute). RequestError names the
        image's request field, or "prompt" when the pads do not match the images."""
        mc = self.model.cfg
        self.check_images([src.param for src in sources])
        images = []
        for src in sources:
            try:
                image = decode_image(src.data, src.media_type, self.cfg.model.max_image_pixels)
                images.append(preprocess(image, self.image_processor))
            except ImageError as e:
                hint = " (model.max_image_pixels)" if "too large" in str(e) else ""
                raise RequestError(f"{src.param}: {e}{hint}", src.param) from None
        try:
            ids = expand_image_pads(prompt_ids, images, mc.image_token_id, self.image_processor.merge_size)
        except ValueError as e:
            raise RequestError(str(e), "prompt") from None
        for image in images:                     # hashed here, on this worker thread, not on the event loop
            image_keys(image.digest + self.vision_fingerprint, image.num_tokens, self.vocab_size)
        return ids, images

    def _make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None,
                      images: list[ProcessedImage] = ()) -> Request:
        self.validate(params)
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                               "prompt")
        self.fit_max_tokens(len(prompt_ids), params.max_tokens)
        located = None
        if images:
            self.check_images(["prompt"] * len(images))
            try:
                located = request_images(prompt_ids, list(images), self.model.cfg.image_token_id,
                                         self.image_processor.merge_size, self.vocab_size, self.vision_fingerprint)
            except ValueError as e:
                raise RequestError(str(e), "prompt") from None
            self.images_received += len(images)
        grammar = self._grammar_state(params) if params.constraint is not None else None
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return Request(request_id or uuid.uuid4().hex, list(prompt_ids), params, seed, grammar=grammar,
                       images=located)

    def _grammar_state(self, params: SamplingParams):
        """The request's matcher (grammar.py); RequestError(field="response_format", or "tool_choice" / "tools" for a
        forced tool call) on a constraint it cannot take. Compiling a schema runs here, on the caller's thread
        (milliseconds for API-sized schemas; cached)."""
        tool_call = params.constraint.kind == "tool_call"
        what = "a forced tool call (tool_choice)" if tool_call else "a constrained response_format"
        if params.ignore_eos or params.min_tokens:
            raise RequestError(f"{what} cannot be combined with ignore_eos or min_tokens "
                               "(the grammar decides where the output ends)",
                               "tool_choice" if tool_call else "response_format")
        field = "tools" if tool_call else "response_format"
        if self._grammar is None:
            raise RequestError(f"{field}: constrained decoding is not available: {self._grammar_error}", field)
        try:
            return self._grammar.state(params.constraint)
        except ValueError as e:
            raise RequestError(f"{field}: {e}", field) from None

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               images: list[ProcessedImage] = ()) -> RequestStream:
        """images: what prepare_images returned for these (expanded) prompt ids."""
        req = self._make_request(prompt_ids, params, request_id, images)
        stream = RequestStream(self, req, RequestResult(req.request_id, len(prompt_ids)))
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
        fut: Future = Future()
        self._calls.append((fut, fn, args))
        self._work.set()
        return await asyncio.wrap_future(fut)

    # ---- the step (engine thread) ----
    def _step(self) -> list[StepEvent]:
        sched = self.scheduler
        events: list[StepEvent] = []
        while self._calls:
            fut, fn, args = self._calls.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except Exception as e:                   # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
        if self._new and self.kv_pool.released and not self._restore_device():   # the first after an idle release
            while self._new:                             # no room on the device now: these fail, the next tries again
                req = self._new.popleft()
                req.status, req.finish_reason = Status.FINISHED, "error"
                events.append(self._event(req, []))
        while self._new:                                 # before the aborts: a request may be cancelled at once
            sched.add(self._new.popleft())
        while self._aborts:
            req = self._aborts.popleft()
            if req.status != Status.FINISHED:
                sched.abort(req)
                events.append(self._event(req, []))
        seqs = sched.schedule()
        if any(s.req.images is not None for s in seqs):
            for req, error in self.runner.encode_images(seqs).items():    # only that request fails
                log.error("request %s: the vision tower failed on its image: %s", req.request_id, error)
                sched.abort(req)
                req.finish_reason = "error"
                events.append(self._event(req, []))
            seqs = [s for s in seqs if s.req.status == Status.RUNNING]
        if not seqs:
            return events
        self._last_busy = time.monotonic()
        out = self.runner.step(seqs, len(sched.running))
        # commit each sequence's tokens one by one: nothing after a stop is kept (a verify may commit several)
        kept: dict[int, int] = {}
        reasons: dict[int, str | None] = {}
        for o in out.outputs:
            req, reason = o.seq.req, None
            for n, tok in enumerate(o.tokens, 1):
                req.output_ids.append(tok)
                reason = self._finish_reason(req, tok)
                if req.grammar is not None and not req.grammar.advance(tok) and not reason:
                    # cannot happen with the mask applied; end the request rather than sample from an empty mask
                    log.error("request %s: the grammar rejected token %d (%s)", req.request_id, tok,
                              req.grammar.error)
                    reason = "stop"
                if reason:
                    kept[id(o.seq)] = n
                    break
            else:
                kept[id(o.seq)] = len(o.tokens)
            reasons[id(o.seq)] = reason
        sched.advance(seqs, [kept.get(id(s), 0) for s in seqs])
        for o in out.outputs:
            req, p, n = o.seq.req, o.seq.req.params, kept[id(o.seq)]
            tokens = []
            for k in range(n):
                ev = TokenEvent(o.tokens[k])
                if p.logprobs is not None:
                    ev.logprob = o.logprobs[k]
                    if p.logprobs > 0 and o.top is not None:
                        ev.top_logprobs = o.top[k]
                tokens.append(ev)
            drafted = len(o.seq.draft)
            if drafted:
                self.spec_stats.observe(drafted, o.accepted)
                if req.depth is not None:
                    req.depth.observe(drafted, o.accepted)
            if reasons[id(o.seq)]:
                sched.finish(req, reasons[id(o.seq)])
            events.append(dataclasses.replace(self._event(req, tokens), drafted=drafted, accepted=o.accepted))
        return events

    @staticmethod
    def _event(req: Request, tokens: list[TokenEvent]) -> StepEvent:
        done = req.status == Status.FINISHED
        return StepEvent(req.request_id, tokens, req.finish_reason if done else None, req.cached_tokens,
                         dict(req.cached_by_tier))

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p, n = req.params, len(req.output_ids)
        if n >= p.min_tokens and ((not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids):
            return "stop"
        if n >= p.max_tokens or req.num_tokens >= self.context_length:
            return "length"
        return None

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
                continue
            if not self._has_work():
                release_in = self._idle_release_in()
                if self.cfg.engine.sleep_on_idle or release_in is not None:
                    # /health answers on the event loop; /metrics and flushes are `call` jobs: none of them is a
                    # request, so none restarts the idle clock or re-allocates released pools
                    if not self._work.wait(release_in) and not self._has_work() and release_in is not None:
                        self._release_device()
                else:                                    # poll: a new request starts without a wake-up hop
                    time.sleep(0.0005)
            elif not self.scheduler.running:             # requests wait on file-tier reads: their landing wakes us
                self._work.wait(IDLE_WAIT_S)
        self.cache.close()

    # ---- idle release (engine.idle_release_s) ----
    def _idle_release_in(self) -> float | None:
        """Seconds until the device pools are due for release; None when off or already released."""
        after = self.cfg.engine.idle_release_s
        if not after or self.kv_pool.released:
            return None
        return max(0.0, self._last_busy + after - time.monotonic())

    def _release_device(self) -> None:
        """Demote the device's prefix cache to the host / file tiers (what they can take; the rest is dropped) and
        free the device KV and state pools, so an idle server holds no device memory for its cache."""
        if self.scheduler.has_work():
            return
        # every device page (none is locked while idle) is demoted or dropped, and with it its node's snapshot
        self.cache.make_room(self.allocator.num_pages)
        self.copies.synchronize()                  # the demotions' copies read the pools about to be freed
        self.kv_pool.release()
        self.state_pool.release()
        self.runner.release_graphs()               # they point into the pools just freed
        if self.kv_pool.buffer.is_cuda:
            torch.cuda.empty_cache()
        self.idle_releases += 1
        log.info("idle for %.0f s: device cache demoted to the tiers, device pools freed",
                 self.cfg.engine.idle_release_s)

    def _restore_device(self) -> bool:
        """Allocate the device pools again for the first request after an idle release. False when the device has
        no room for them now (another process took the memory meanwhile): the pools stay released, whole."""
        try:
            self.kv_pool.restore()
            self.state_pool.restore()
        except RuntimeError as e:                  # torch.OutOfMemoryError is one; so is a failed CPU allocation
            self.kv_pool.release()                 # what did get allocated
            self.state_pool.release()
            if self.kv_pool.buffer.is_cuda:
                torch.cuda.empty_cache()
            log.error("a request after an idle release: no room for the device pools now (%s); the waiting "
                      "requests fail and the next one tries again", str(e).splitlines()[0])
            return False
        self.runner.capture_graphs()               # on the new pools, before the request's first step
        log.info("a request after an idle release: device pools allocated again")
        return True

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
        self._watcher = asyncio.ensure_future(self._watch_host_memory())

    async def stop(self) -> None:
        """Stop the step loop and flush pending file-tier writes (bounded)."""
        if self._serving is None:
            return
        self._watcher.cancel()
        self._stopping = True
        self._work.set()
        await self._serving
        self._serving = None

    async def _watch_host_memory(self) -> None:
        """While serving: every HOST_MEMORY_CHECK_S, ask the cache whether the host's available memory is below
        cache.host.min_free_gb (a read of /proc/meminfo; no host tier or no floor: never), and if so have the host
        tier give memory back on the engine thread, between two steps. Runs until stop()."""
        while True:
            await asyncio.sleep(HOST_MEMORY_CHECK_S)
            try:
                if self.cache.relief_due():
                    await self.call(self.cache.relieve_host_memory)
            except Exception:                             # noqa: BLE001 - serving goes on; the next check retries
                log.exception("host tier: giving memory back failed")

    def _dispatch(self, events: list[StepEvent]) -> None:
        now = time.monotonic()
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            res = stream.result
            res.cached_tokens = ev.cached_tokens
            res.draft_tokens += ev.drafted
            res.accepted_draft_tokens += ev.accepted
            res.cached_tokens_by_tier.update(ev.cached_by_tier)
            if ev.tokens:
                res.completion_tokens += len(ev.tokens)
                if res.first_token_time is None:
                    res.first_token_time = now
                stream._queue.put_nowait(ev.tokens)
            if ev.finish_reason is not None:
                res.finish_reason = ev.finish_reason
                res.finish_time = now
                stream._queue.put_nowait(None)
                del self._streams[ev.request_id]

    # ---- offline API (the calling thread does the compute; not while serving) ----
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Synchronous batch generation (tests, benchmarks)."""
        return [r.output_ids for r in self.run_requests(prompts, params)]

    def run_requests(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                     images: list[list[ProcessedImage]] | None = None) -> list[Request]:
        """Like generate(), returning the finished Requests (outputs, cached_tokens, finish_reason). images: per
        prompt, what prepare_images returned for it."""
        assert self._serving is None, "run_requests() is offline only; use submit() while serving"
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ilist = images if images is not None else [[]] * len(prompts)
        reqs = [self._make_request(p, sp, None, im) for p, sp, im in zip(prompts, plist, ilist)]
        for r in reqs:
            self.scheduler.add(r)
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
                           cache=self.cache.stats(), spec=self.spec_stats if self.nextn else None,
                           pools_released=self.kv_pool.released, idle_releases=self.idle_releases,
                           images_received=self.images_received, images_encoded=self.runner.images_encoded,
                           image_encode_seconds=self.runner.image_encode_seconds)

    def flush_cache(self, include_file: bool = False) -> bool:
        """Empty the prefix cache (device and host tiers; the file tier too when asked); False when a running
        request holds part of it (nothing is freed then). On the engine thread while serving."""
        return self.cache.flush(include_file)

    def close(self, timeout: float = 10.0) -> None:
        """Offline: flush pending file-tier writes (bounded) so a restart finds them."""
        self.copies.synchronize()
        self.cache.close(timeout)
