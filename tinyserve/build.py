"""Building an engine: plan the memory, load the model, allocate the pools, wire the prefix cache and its tiers, the
scheduler, the runner and the request intake, then make the optional parts the configuration and the checkpoint
turn on and hand each to the core objects that call it, by name (None: off), and start them (the static steps
compile or capture, NEXTN prices its drafts). Everything here runs once, at start, on the thread that will run the steps (a server's compute
thread)."""
from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import torch

from tinyserve.blob import model_fingerprint, weights_digest
from tinyserve.cache import Cache, DevicePrefixCache, PrefixCache
from tinyserve.config import Config, ConfigError
from tinyserve.copies import CopyStream, copy_stream_for
from tinyserve.demo import default_cache_dir
from tinyserve.divergences import describe_divergence
from tinyserve.engine import Engine
from tinyserve.file_tier import FileTier
from tinyserve.grammar import Grammar
from tinyserve.host_tier import HostTier
from tinyserve.idle import IdleRelease
from tinyserve.request import Intake
from tinyserve.kernels import ONEDNN_DTYPES, set_backend as set_kernel_backend, triton_problem, use_triton
from tinyserve.kernels.fp8_weight import Fp8Weight
from tinyserve.kernels.w4_weight import W4Weight
from tinyserve.kernels.gdn import snapshot_alignment
from tinyserve.kernels.linear import calibrate as calibrate_linear, pack as pack_weights
from tinyserve.pools import KVPool, PageAllocator, StatePool
from tinyserve.loader import load_model
from tinyserve.model_config import LoaderError
from tinyserve.models.config import WeightCount
from tinyserve.models.weights import place_on_huge_pages
from tinyserve.multimodal import Images
from tinyserve.plan import GIB, MemoryPlan, dtype_name, host_available_bytes, plan_for, torch_dtype
from tinyserve.prompt_logprobs import PromptLogprobs
from tinyserve.runner import ModelRunner
from tinyserve.scheduler import Scheduler
from tinyserve.spec import NextN
from tinyserve.static import StaticStep, static_step
from tinyserve.tokenizer import Tokenizer

log = logging.getLogger("tinyserve.build")


def build_engine(cfg: Config) -> Engine:
    """Plan from the checkpoint's headers, then load the weights and build the pools, on the calling thread (a
    server calls this on the compute thread)."""
    folder, _, plan = plan_for(cfg)
    try:                                       # before the weights: a folder without a usable tokenizer fails fast
        tokenizer = Tokenizer.from_folder(folder)
    except ValueError as e:                    # no tokenizer.json, one `tokenizers` cannot read, a broken template
        raise LoaderError(str(e)) from None
    try:
        model = load_model(folder, torch_dtype(plan.dtype), plan.device, vision=cfg.model.vision,
                           fp8_weights=plan.fp8_weights)
        if cfg.model.int8_activations:
            round_activations_to_int8(model)
        engine = assemble(cfg, model, tokenizer, plan)
        if engine.nextn is not None:
            engine.nextn.price(engine)         # NEXTN: the first forwards, before serving
        compile_while_serving(engine)
    except RuntimeError as e:                  # torch.OutOfMemoryError (CUDA) or the CPU allocator's failure
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        key = "engine.mem_fraction_static" if plan.device == "cuda" else "engine.kv_cache_tokens"
        raise ConfigError(f"out of memory while loading the model, allocating the pools the plan sized "
                          f"({plan}) or running the first steps; lower {key}", key) from None
    return engine


def round_activations_to_int8(model) -> None:
    """model.int8_activations: every 4-bit weight's GEMMs round their activations to int8 (kernels/w4_cpu.c's integer
    path; W4Weight.int8_activations); refused, by name, where it cannot apply."""
    key = "model.int8_activations"
    weights = [m for m in model.modules() if isinstance(m, W4Weight)]
    if not weights:
        raise ConfigError(f"{key} = true needs a checkpoint with int4 weights (GPTQ, AWQ, compressed-tensors "
                          f"W4A16); this one has no 4-bit weights", key)
    if weights[0].codes.device.type != "cpu":
        raise ConfigError(f"{key} = true runs on the CPU only (the model is on {weights[0].codes.device.type}, "
                          f"whose 4-bit kernels keep the activations' dtype)", key)
    if any(w.kind != "int4" for w in weights):
        raise ConfigError(f"{key} = true takes int4 weights (GPTQ, AWQ, compressed-tensors W4A16); this "
                          f"checkpoint's are NVFP4, whose activations stay in model.dtype", key)
    for w in weights:
        w.int8_activations = True
    log.info("%s: %d int4 weights multiply int8 activations", key, len(weights))


def engine_for_model(cfg: Config, model, tokenizer=None, copy_stream: CopyStream | None = None) -> Engine:
    """An engine around a model already loaded (tests, notebooks): the plan from cfg and the model's sizes, in the
    model's own dtype."""
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype_name(model.dtype)))
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Weight)]
    fp8_values = sum(m.weight.numel() for m in fp8)
    w4 = [m for m in model.modules() if isinstance(m, W4Weight)]
    w4_values = sum(2 * m.codes.numel() for m in w4)            # two 4-bit values a byte
    weights = WeightCount(sum(p.numel() for p in model.parameters()) + fp8_values + w4_values, fp8_values,
                          sum(m.scale.numel() for m in fp8), w4_values, sum(m.nbytes() for m in w4))
    free = None
    if model.device.type == "cuda":            # free memory as if the weights, loaded already, were not
        free = torch.cuda.mem_get_info(model.device)[0] + weights.bytes(torch.empty((), dtype=model.dtype)
                                                                       .element_size())
    plan = MemoryPlan.resolve(cfg, model.cfg, model.device.type, weights, gpu_free_bytes=free,
                              cuda_capability=torch.cuda.get_device_capability(model.device) if free else None)
    return assemble(cfg, model, tokenizer, plan, copy_stream)


def assemble(cfg: Config, model, tokenizer, plan: MemoryPlan, copy_stream: CopyStream | None = None) -> Engine:
    """The engine's parts, sized by the plan. copy_stream: where tier copies run (copies.py); by default the
    device's own (CUDA: a stream of its own, the CPU: at once)."""
    mc, device = model.cfg, model.device
    try:                                       # engine.kernels: the Triton kernels or the torch references
        set_kernel_backend(cfg.engine.kernels)
    except RuntimeError as e:
        raise ConfigError(str(e), "engine.kernels") from None
    eos_token_ids = sorted(set(mc.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else []))
    kv_pool = KVPool(plan.kv_pages, plan.page_size, plan.kv_layers, mc.num_key_value_heads, mc.head_dim,
                     torch_dtype(plan.kv_dtype), device)
    allocator = PageAllocator(plan.kv_pages)
    state_pool = StatePool(plan.state_slots + plan.verify_slots, len(mc.gdn_layer_ids), mc.conv_dim,
                           mc.linear_conv_kernel_dim, mc.linear_num_value_heads, mc.linear_key_head_dim,
                           mc.linear_value_head_dim, model.dtype, device, num_snapshot_slots=plan.snapshot_slots)
    # tier copies on a stream of their own (CUDA); pages and slots handed out again wait for their saves
    copies = copy_stream or copy_stream_for(device)
    if copies.asynchronous:                    # (the CPU's copies are done when issued: nothing to wait for)
        allocator.fence, state_pool.fence = copies.fence_pages, copies.fence_slots
    work = threading.Event()                   # set when the engine thread has something to do
    cache = prefix_cache(cfg, plan, model, tokenizer, kv_pool, allocator, state_pool, copies, work.set) \
        if cfg.cache.enabled else Cache(state_pool)
    scheduler = Scheduler(allocator, state_pool, plan.page_size, cfg.engine.max_running_requests,
                          cfg.engine.chunked_prefill_size, cache,
                          snapshot_align=snapshot_alignment(device) if plan.hybrid else None)
    runner = ModelRunner(model, kv_pool, state_pool, eos_token_ids, plan.context_length)
    intake = Intake(cfg, plan.context_length, plan.kv_tokens, mc.vocab_size,
                    tokenizer.turn_start_id if tokenizer else None)
    engine = Engine(cfg, plan, model, tokenizer, kv_pool=kv_pool, allocator=allocator, state_pool=state_pool,
                    copies=copies, cache=cache, scheduler=scheduler, runner=runner, intake=intake, work=work)
    # the optional parts, each handed to the objects that call it (None: off); the static steps last, below
    nextn = images = idle = None
    if plan.nextn_layers:
        nextn = NextN(cfg.speculative.num_steps, cfg.speculative.max_running, len(mc.attn_layer_ids), runner,
                      running=lambda: len(scheduler.running))
    if model.visual is not None:
        images = Images(cfg, model, mc.vocab_size, weights_digest(model.visual))
    grammar = Grammar(tokenizer, mc.vocab_size, eos_token_ids)
    prompt_logprobs = PromptLogprobs(model)
    if cfg.engine.idle_release_s:
        idle = IdleRelease(cfg.engine.idle_release_s, kv_pool, state_pool, allocator, cache, copies, runner)
    scheduler.nextn, scheduler.images = nextn, images
    runner.nextn, runner.images, runner.grammar, runner.prompt_logprobs = nextn, images, grammar, prompt_logprobs
    intake.images, intake.grammar, intake.prompt_logprobs = images, grammar, prompt_logprobs
    engine.nextn, engine.images, engine.grammar, engine.idle = nextn, images, grammar, idle
    if plan.device == "cpu":                   # pick this CPU's fastest GEMM route on the model's own shapes
        if not hasattr(model, "huge_pages"):   # once per model, before pack: its copies follow the weights' addresses
            _, model.huge_pages = place_on_huge_pages(model)
        dense = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]
        shapes = {tuple(p.shape): p for p in dense}
        # packed copies of the weights where they pay, if they take at most a quarter of the memory left
        may_pack = 4 * sum(p.numel() * p.element_size() for p in dense) <= host_available_bytes()
        routes = calibrate_linear(list(shapes.values()), may_pack=may_pack)
        added = pack_weights(dense)
        log.info("CPU GEMM route: %s%s", routes, f" (packed weight copies: {added / GIB:.2f} GiB)" if added else "")
        if model.dtype == torch.bfloat16 and torch.bfloat16 not in ONEDNN_DTYPES:
            log.warning("model.dtype = \"bfloat16\" on a CPU without AVX-512 (AVX2 only): bfloat16 has no fast GEMM "
                        "here, and \"float32\" runs faster (the 4-bit bench model decoded 2.2-2.7x faster on an AMD EPYC "
                        "7001: docs/benchmarks.md)")
        # the C kernels of the decode attention and the GDN decode, built for this CPU (once) and loaded now:
        # registering their torch ops is the engine thread's work
        from tinyserve.kernels import attention_cpu, gdn_cpu
        attention_cpu.library()
        gdn_cpu.library()
    static = compiled_steps(cfg, plan, runner)
    if static is not None:                     # the CPU: plain decodes through the compiled graphs, the static step
        runner.compiled = static.compiled      # for NEXTN's verifies and head passes only
        runner.steps = static if static.for_graphs or nextn is not None else None
    return engine


def prefix_cache(cfg: Config, plan: MemoryPlan, model, tokenizer, kv_pool: KVPool, allocator: PageAllocator,
                 state_pool: StatePool, copies: CopyStream, wake) -> PrefixCache:
    """The radix tree with the host and file tiers the plan sized. wake: called when a file-tier read lands. The
    tokenizer shows the tokens either side of where a prompt leaves a cached path, in the log."""
    host = file = None
    if plan.host_pages or plan.host_snapshots:
        host = HostTier(kv_pool, state_pool, plan.host_pages, plan.host_snapshots,
                        min_free_bytes=int(cfg.cache.host.min_free_gb * GIB), copies=copies)
    if plan.file_dir:
        file = FileTier.for_pools(Path(plan.file_dir), plan.file_bytes,
                                  model_fingerprint(model, kv_pool.dtype, plan.page_size), kv_pool, state_pool,
                                  copies, host, needs_state=plan.hybrid,
                                  probe_every=cfg.cache.state_track_interval // plan.page_size)
        log.info("file tier %s: %d blobs found", plan.file_dir, file.num_blobs)
    decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=False)) if tokenizer is not None else None
    cls = PrefixCache if host is not None or file is not None else DevicePrefixCache
    return cls(cfg, allocator, state_pool, plan.page_size, plan.hybrid, host, file, wake=wake,
               describe=lambda d: describe_divergence(d, decode, model.cfg.vocab_size))


def compiled_steps(cfg: Config, plan: MemoryPlan, runner: ModelRunner) -> StaticStep | None:
    """The static decode / NEXTN verify path (engine.compile_steps, static.py), made at start (a server is not ready
    before), for the runner's `steps`: on CUDA its graphs, one per batch size up to engine.max_running_requests and tokens per
    sequence (1 + the draft steps), which need the Triton kernels (the torch references read values on the host); on
    the CPU its forwards compiled by torch.compile, inductor's cache in compile_cache_dir. A capture or a compile
    that fails leaves every step eager, with the error in the log."""
    if not cfg.engine.compile_steps:
        return None
    if plan.device != "cpu" and not use_triton(runner.kv_pool.buffer):
        why = triton_problem() if cfg.engine.kernels == "auto" else ""
        log.log(logging.WARNING if why else logging.INFO, "CUDA graphs are off: engine.kernels = %r runs the "
                "torch references on CUDA%s", cfg.engine.kernels, f" ({why})" if why else "")
        return None
    if plan.device == "cpu":
        from tinyserve.compiled import use_cache_dir
        log.info("compiling the CPU steps (inductor's cache: %s)", use_cache_dir(compile_cache_dir(cfg)))
    return built_static_step(runner, cfg.engine.max_running_requests, for_graphs=plan.device != "cpu",
                             in_background=True)


def compile_while_serving(engine: Engine):
    """Start compiling the CPU step graphs left for after start (NEXTN's verify and head passes not saved yet:
    compiled.py) on a thread of their own; once they are made the draft depths are priced again. Returns the
    CompiledSteps (its `wait` joins the thread), None when no graph is left."""
    compiled, nextn = engine.runner.compiled, engine.nextn
    if compiled is None or not compiled.pending:
        return None
    compiled.compile_pending(lambda: nextn is not None and engine.call_soon(nextn.forget_draft_prices))
    return compiled


def built_static_step(runner: ModelRunner, max_batch: int, for_graphs: bool,
                      in_background: bool = False) -> StaticStep | None:
    """static.static_step, captured (for_graphs) or compiled (the CPU; in_background: CompiledSteps.build's); None
    where that fails (logged)."""
    static = static_step(runner, max_batch, for_graphs)
    if for_graphs:
        try:
            static.capture()
        except RuntimeError:                   # torch reports a failed capture (a host sync, a forbidden call) as one
            log.exception("capturing the CUDA graphs failed: every step runs eagerly "
                          "(engine.compile_steps = false skips the capture)")
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return None
        return static
    from tinyserve.compiled import CompiledSteps    # torch.compile's machinery: imported only when used
    try:
        compiled = CompiledSteps(static)
        compiled.build(in_background)
    except Exception as e:                     # noqa: BLE001 - no compiler, an op inductor cannot lower: eager
        log.warning("compiling the CPU steps failed, every step runs eagerly (engine.compile_steps = false skips "
                    "the attempt): %s: %s", type(e).__name__, str(e).strip().splitlines()[0] if str(e) else "")
        return None
    static.compiled = compiled
    return static


def compile_cache_dir(cfg: Config) -> Path:
    """Where the compiled CPU steps are kept between runs: beside the file tier's blobs (cache.file.dir) when it is
    on, else the per-user cache folder ($XDG_CACHE_HOME/tinyserve, ~/.cache/tinyserve)."""
    base = Path(cfg.cache.file.dir).expanduser() if cfg.cache.enabled and cfg.cache.file.dir else default_cache_dir()
    return base / "compiled"
