"""The memory plan: every size the engine derives from the config, decided in one place before anything is allocated.

`MemoryPlan.resolve(cfg, model_config, device, weight_values)` turns the TOML's "0 / auto means derive" keys into
numbers: device and dtypes, context length, KV pages, GDN state slots, prefix-cache snapshot slots, the host tier's
split between KV pages and snapshots, and the file tier's budget. It needs only config.json and the safetensors
headers (`plan_for(cfg)` reads them), so `tinyserve --check` prints it without loading a single weight, and the
engine allocates exactly what it says. A host tier larger than the host's available memory fails here, naming the
key, before anything is allocated.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyserve.config import DTYPES, KV_CACHE_DTYPES, Config, ConfigError
from tinyserve.models.config import ModelConfig, WeightCount

# The one table of dtypes: the config's name -> (torch's name, bytes per value). Plans carry the config's names, so
# planning (and `tinyserve --check` on a CPU) never imports torch; the engine turns them into torch dtypes.
DTYPE_TABLE: dict[str, tuple[str, int]] = {"bfloat16": ("bfloat16", 2), "float16": ("float16", 2),
                                           "float32": ("float32", 4), "fp8_e4m3": ("float8_e4m3fn", 1)}
assert set(DTYPES + KV_CACHE_DTYPES) - {"auto"} == set(DTYPE_TABLE), "config.py's dtype names and this table"
# engine.kv_cache_tokens = 0 on the CPU: room for this many full-length requests (an agent's session at the full
# context, and its side requests and other sessions beside it), within this share of the host's available memory
CPU_KV_CONTEXTS = 2
CPU_KV_MEMORY_SHARE = 0.25
SNAPSHOTS_PER_RUNNING_REQUEST = 4   # cache.state_slots = 0: device snapshots per engine.max_running_requests
# Share of the host tier kept for recurrent-state snapshots (hybrid models): a budget of their own, because too few
# host state slots strand host KV (a page without a state above it is no hit). bench/simulate.py chose 0.25 on agent
# traces (docs/cache-sizing.md).
HOST_STATE_SHARE = 0.25
CUDA_CONTEXT_BYTES = 600 << 20     # --gpu-memory-gb: what the CUDA context and torch take before anything is ours
GIB = 1 << 30


def torch_dtype(name: str) -> Any:
    import torch
    return getattr(torch, DTYPE_TABLE[name][0])


def dtype_name(dtype: Any) -> str:
    """The config's name of a torch dtype."""
    return next(name for name, (torch_name, _) in DTYPE_TABLE.items() if str(dtype) == f"torch.{torch_name}")


def element_size(dtype: str) -> int:
    return DTYPE_TABLE[dtype][1]


def kv_bytes_per_token(mc: ModelConfig, kv_dtype: str, nextn_layers: int = 0) -> int:
    """K and V of every full-attention layer for one token (the NEXTN head's layers are attention layers too)."""
    return (len(mc.attn_layer_ids) + nextn_layers) * 2 * mc.num_key_value_heads * mc.head_dim * element_size(kv_dtype)


def state_bytes_per_slot(mc: ModelConfig, dtype: str) -> int:
    """Conv state (model dtype) and SSM state (fp32) of every GDN layer: one request's recurrent state."""
    layers = len(mc.gdn_layer_ids)
    conv = mc.conv_dim * (mc.linear_conv_kernel_dim - 1) * element_size(dtype)
    ssm = mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4
    return layers * (conv + ssm)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping); total RAM elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def activation_bytes(cfg: Config, mc: ModelConfig, dtype: str) -> int:
    """An estimate of the peak transient memory of one step: the largest layer's intermediates for a full prefill
    chunk (engine.chunked_prefill_size tokens) plus the running requests' decode / verify rows, and the fp32
    logits of every row that samples. The GDN chunk kernel's fp32 intermediates (heads expanded to the value heads,
    the WY factors, the 64-wide triangular blocks, the state before each chunk) dominate the hybrid layers."""
    e = cfg.engine
    rows_per_request = 1 + cfg.speculative.num_steps
    tokens = e.chunked_prefill_size + e.max_running_requests * rows_per_request
    logits = e.max_running_requests * rows_per_request * mc.vocab_size * 4 * 2
    return tokens * layer_bytes_per_token(mc, dtype) + logits


def layer_bytes_per_token(mc: ModelConfig, dtype: str) -> int:
    """The peak intermediates of one token through the largest layer (activation_bytes' per-token share)."""
    b = element_size(dtype)
    H = mc.hidden_size
    residual = 3 * H * b                                       # the residual stream, its norm and a layer's output
    if mc.num_experts:               # the experts' gate | up and activation, their [top_k, H] outputs, the shared one
        mlp = ((mc.num_experts_per_tok * mc.moe_intermediate_size + mc.shared_expert_intermediate_size) * 3 * b
               + mc.num_experts_per_tok * H * (b + 4))
    else:
        mlp = 3 * mc.intermediate_size * b                     # gate | up, then the activation
    gdn = 0
    if mc.gdn_layer_ids:
        hv, dk, dv = mc.linear_num_value_heads, mc.linear_key_head_dim, mc.linear_value_head_dim
        gdn = ((2 * mc.key_dim + 2 * mc.value_dim + 2 * hv) * b + mc.conv_dim * b
               + hv * (2 * dk + dv) * 4 + hv * (dk + 2 * dv) * 4 + hv * 64 * 4
               + hv * dk * dv * 4 // 64)                     # the state before each 64-token chunk
    q_rows = mc.num_attention_heads * mc.head_dim * 2                      # queries and their output gate
    attn = (q_rows + 2 * mc.num_key_value_heads * mc.head_dim + mc.num_attention_heads * mc.head_dim) * b
    return residual + max(mlp, gdn, attn)


CUDA_GRAPH_MARGIN = 64 << 20      # the graphs' pool beyond the estimate: the allocator's block rounding, workspaces
ATTENTION_MAX_SPLITS = 64         # kernels/attention_triton.py MAX_SPLITS (not imported: planning needs no triton)


def cuda_graph_bytes(cfg: Config, mc: ModelConfig, dtype: str) -> int:
    """An estimate of what the CUDA graphs (engine.compile_steps) hold for good: they share one memory pool, captured
    largest first, so it is about the intermediates of the largest step, engine.max_running_requests sequences of
    1 + speculative.num_steps tokens with NEXTN (else 1) (the layer intermediates, the split-K attention's partial
    outputs), the static output rows, and a margin."""
    tokens = 1 + cfg.speculative.num_steps
    rows, b = cfg.engine.max_running_requests * tokens, element_size(dtype)
    splits = rows * mc.num_attention_heads * ATTENTION_MAX_SPLITS * (mc.head_dim + 1) * 4
    return rows * (layer_bytes_per_token(mc, dtype) + mc.hidden_size * b) + splits + CUDA_GRAPH_MARGIN


def fp8_weights_for(device: str, cuda_capability: tuple[int, int] | None, kernels: str = "auto") -> str:
    """How an FP8 checkpoint's weights are held (fp8_scheme.FP8_WEIGHTS): kept FP8 on GPUs with FP8 tensor cores
    (sm_89 and later; None: a card planned with --gpu-memory-gb, taken to be one), activations quantized on the
    fly (w8a8). Dequantized at load on older GPUs, where Triton has no e4m3 type, and on the CPU, which has no FP8
    arithmetic and room for bf16 or fp32 weights."""
    if device != "cuda" or (cuda_capability is not None and cuda_capability < (8, 9)) or kernels == "torch":
        return "dequantize"          # (engine.kernels = "torch": the reference's w8a8 GEMM is for tests, not a 27B)
    return "w8a8"


@dataclass(frozen=True)
class MemoryPlan:
    device: str                  # "cpu" | "cuda"
    dtype: str                   # weights and activations (a name of DTYPE_TABLE)
    kv_dtype: str
    weights_bytes: int
    context_length: int
    page_size: int
    kv_pages: int
    kv_bytes_per_token: int
    state_slots: int             # working GDN state slots: one per running request
    state_bytes_per_slot: int
    snapshot_slots: int          # device slots for prefix-cache state snapshots
    verify_slots: int = 0        # NEXTN: extra slots for the state after each verified draft (num_steps per request)
    nextn_layers: int = 0        # NEXTN: its attention layers, stored after the target's in the KV pages
    kv_layers: int = 0           # attention layers in the KV pages (the target's, then NEXTN's)
    host_pages: int = 0          # host tier (L2): KV pages ...
    host_snapshots: int = 0      # ... and state snapshots
    file_dir: str = ""           # file tier (L3): "" = off
    file_bytes: int = 0
    vision_bytes: int = 0        # the vision tower's share of weights_bytes (image input)
    fp8_weights: str = "dequantize"  # how FP8 checkpoint weights are held (fp8_scheme.FP8_WEIGHTS)
    fp8_bytes: int = 0           # the weights kept FP8 (values and scales), a share of weights_bytes
    w4_bytes: int = 0            # the weights held 4-bit (codes, scales, zero points, permutations), a share of it
    w4_format: str = ""          # how the checkpoint stores them ("gptq g128", "nvfp4", ...)
    activation_bytes: int = 0    # estimated peak of one step's intermediates (CUDA plans)
    graph_bytes: int = 0         # estimated memory the CUDA graphs hold (CUDA plans, engine.compile_steps)
    gpu_bytes: int = 0           # CUDA: the device memory the plan was made for (free memory at start)

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size

    @property
    def static_bytes(self) -> int:
        """What engine.mem_fraction_static holds: the weights, every state slot (working, verify, snapshot and the
        scratch slot of padded decode rows), the KV pool and its scratch page."""
        slots = self.state_slots + self.verify_slots + self.snapshot_slots + 1
        return (self.weights_bytes + slots * self.state_bytes_per_slot
                + (self.kv_pages + 1) * self.page_size * self.kv_bytes_per_token)

    @property
    def hybrid(self) -> bool:
        return self.state_bytes_per_slot > 0

    @classmethod
    def resolve(cls, cfg: Config, mc: ModelConfig, device: str, weights_count: WeightCount,
                gpu_free_bytes: int | None = None, cuda_capability: tuple[int, int] | None = None,
                check_host: bool = True) -> "MemoryPlan":
        """Decide every derived size. `weights_count` counts the weights the model holds (from the safetensors
        headers, FP8 ones as kept on this device, 4-bit ones as held); `device` is "cpu" or "cuda" (see
        resolve_device). On CUDA the budget is `gpu_free_bytes` (a card that is not here: --gpu-memory-gb) or the
        device's free memory now. check_host: compare the host tier with this machine's available memory (not when
        planning for another machine)."""
        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        kv_dtype = cfg.model.kv_cache_dtype if cfg.model.kv_cache_dtype != "auto" else dtype
        e, c = cfg.engine, cfg.cache
        hybrid = bool(mc.gdn_layer_ids)
        nextn_layers = verify_slots = 0
        if cfg.speculative.num_steps:
            if mc.num_mtp_layers == 0:
                raise ConfigError("speculative.num_steps > 0 needs the checkpoint's NEXTN head, but model.path has no "
                                  "mtp.* tensors (some quantized releases drop them); set speculative.num_steps = 0 "
                                  "or use a checkpoint with mtp.* weights", "speculative.num_steps")
            nextn_layers = mc.num_mtp_layers
            verify_slots = e.max_running_requests * cfg.speculative.num_steps if hybrid else 0
        if kv_dtype == "fp8_e4m3" and device == "cuda" and cuda_capability is not None and \
                cuda_capability < (8, 9) and e.kernels != "torch":
            raise ConfigError(f'model.kv_cache_dtype = "fp8_e4m3" needs FP8 support in the GPU (sm_89 or later: '
                              f'RTX 40xx / 50xx, L40, H100 and later) for the Triton kernels; this GPU is '
                              f'sm_{cuda_capability[0]}{cuda_capability[1]}: use "bfloat16"', "model.kv_cache_dtype")
        per_token = kv_bytes_per_token(mc, kv_dtype, nextn_layers)
        per_slot = state_bytes_per_slot(mc, dtype)
        weights = weights_count.bytes(element_size(dtype))
        snapshots = 0
        if c.enabled and hybrid:
            snapshots = c.state_slots or SNAPSHOTS_PER_RUNNING_REQUEST * e.max_running_requests
        state_bytes = (e.max_running_requests + verify_slots + snapshots + 1) * per_slot     # + the scratch slot
        context = cfg.model.context_length or mc.max_position_embeddings
        free = activations = graphs = 0
        if device == "cuda":
            if gpu_free_bytes is None:
                import torch
                gpu_free_bytes = torch.cuda.mem_get_info()[0]
            free = gpu_free_bytes
            activations = activation_bytes(cfg, mc, dtype)
            graphs = cuda_graph_bytes(cfg, mc, dtype) if e.compile_steps else 0
            kv_tokens = cls._cuda_kv_tokens(cfg, free, weights, state_bytes, per_token, activations, context, graphs)
        else:
            kv_tokens = e.kv_cache_tokens or cls._cpu_kv_tokens(context, per_token,
                                                                 host_available_bytes() if check_host else None)
        kv_pages = max(1, kv_tokens // e.page_size)

        host_pages = host_snapshots = 0
        host_bytes = int(c.host.size_gb * GIB) if c.enabled else 0
        if host_bytes:
            available = host_available_bytes() if check_host else host_bytes
            if host_bytes > available:
                raise ConfigError(f"cache.host.size_gb = {c.host.size_gb:g} GB does not fit: this host has "
                                  f"{available / GIB:.1f} GiB available; lower cache.host.size_gb",
                                  "cache.host.size_gb")
            page_bytes = per_token * e.page_size
            if hybrid:
                host_snapshots = int(host_bytes * HOST_STATE_SHARE // per_slot)
            host_pages = int((host_bytes - host_snapshots * per_slot) // page_bytes)
        file_on = c.enabled and bool(c.file.dir)
        return cls(device=device, dtype=dtype, kv_dtype=kv_dtype, weights_bytes=weights,
                   vision_bytes=mc.vision_parameters * element_size(dtype), context_length=context,
                   fp8_weights=fp8_weights_for(device, cuda_capability, e.kernels) if weights_count.fp8_values
                   else "dequantize",
                   fp8_bytes=weights_count.fp8_values + 4 * weights_count.fp8_scales,
                   w4_bytes=weights_count.w4_bytes, w4_format=weights_count.w4_format,
                   activation_bytes=activations, graph_bytes=graphs, gpu_bytes=free,
                   page_size=e.page_size, kv_pages=kv_pages, kv_bytes_per_token=per_token,
                   state_slots=e.max_running_requests, state_bytes_per_slot=per_slot if hybrid else 0,
                   snapshot_slots=snapshots, verify_slots=verify_slots, nextn_layers=nextn_layers,
                   kv_layers=len(mc.attn_layer_ids) + nextn_layers,
                   host_pages=host_pages, host_snapshots=host_snapshots,
                   file_dir=c.file.dir if file_on else "", file_bytes=int(c.file.size_gb * GIB) if file_on else 0)

    @staticmethod
    def _cpu_kv_tokens(context: int, per_token: int, available: int | None) -> int:
        """The CPU's derived KV pool: CPU_KV_CONTEXTS requests of `context` tokens, or as many tokens as
        CPU_KV_MEMORY_SHARE of the `available` host memory holds (None: not this machine, no cap), but never less
        than one full-length request: a pool that cannot hold one fails, naming the key to change."""
        wanted = CPU_KV_CONTEXTS * context
        if available is None:
            return wanted
        fits = int(available * CPU_KV_MEMORY_SHARE) // per_token
        if fits < context:
            raise ConfigError(f"a KV pool for one request of model.context_length = {context} tokens needs "
                              f"{context * per_token / GIB:.2f} GiB, more than {CPU_KV_MEMORY_SHARE:.0%} of the "
                              f"{available / GIB:.1f} GiB this host has available; lower model.context_length or "
                              f"set engine.kv_cache_tokens", "model.context_length")
        return min(wanted, fits)

    @staticmethod
    def _cuda_kv_tokens(cfg: Config, free: int, weights: int, state_bytes: int, per_token: int, activations: int,
                        context: int, graphs: int = 0) -> int:
        """The KV pool on a GPU with `free` bytes: engine.mem_fraction_static of them hold the weights, the GDN
        state slots and the KV pool (engine.kv_cache_tokens, or all that is left); the rest is for one step's
        activations and the CUDA context's own allocations. A derived pool that cannot hold one request of
        `context` tokens, an explicit one that does not fit, or activations that do not fit the rest, fail naming the
        key to change."""
        e = cfg.engine
        static = free * e.mem_fraction_static
        have = (f"the GPU has {free / GIB:.1f} GiB free; engine.mem_fraction_static = {e.mem_fraction_static} "
                f"gives {static / GIB:.1f} GiB to {weights / GIB:.1f} GiB of weights, {state_bytes / GIB:.2f} GiB "
                f"of GDN state and the KV pool")
        left = static - weights - state_bytes - per_token * e.page_size          # (the scratch page)
        if left < per_token * e.page_size:
            raise ConfigError(f"{have}: the weights and the GDN state alone take it all, leaving no room for a KV "
                              f"pool; this model needs a larger card, a smaller checkpoint, fewer "
                              f"engine.max_running_requests / cache.state_slots, or a higher "
                              f"engine.mem_fraction_static", "engine.mem_fraction_static")
        if e.kv_cache_tokens:
            if e.kv_cache_tokens * per_token > left:
                raise ConfigError(f"{have}: engine.kv_cache_tokens = {e.kv_cache_tokens} needs "
                                  f"{e.kv_cache_tokens * per_token / GIB:.2f} GiB but {max(0, left) / GIB:.2f} GiB "
                                  f"are left; lower engine.kv_cache_tokens (0 derives it) or model.context_length",
                                  "engine.kv_cache_tokens")
            kv_tokens = e.kv_cache_tokens
        else:
            kv_tokens = int(max(0, left) // per_token)
        pool = kv_tokens // e.page_size * e.page_size           # what whole pages hold
        if not e.kv_cache_tokens and pool < context:
            # a derived pool must hold one full-length request (as vLLM refuses to start otherwise); an explicit
            # engine.kv_cache_tokens is the user's choice, and requests longer than it are refused (as on the CPU)
            raise ConfigError(f"{have}: the KV pool holds {pool} tokens, fewer than one request of "
                              f"model.context_length = {context} tokens needs; lower model.context_length, raise "
                              f"engine.mem_fraction_static, use fp8_e4m3 for model.kv_cache_dtype, or fewer "
                              f"engine.max_running_requests / cache.state_slots", "model.context_length")
        rest = free - static
        if activations + graphs > rest:
            raise ConfigError(f"the GPU has {free / GIB:.1f} GiB free; one step's activations need about "
                              f"{activations / GIB:.2f} GiB"
                              + (f" and the CUDA graphs about {graphs / GIB:.2f} GiB (engine.compile_steps)"
                                 if graphs else "") + " but engine.mem_fraction_static = "
                              f"{e.mem_fraction_static} leaves {rest / GIB:.2f} GiB; lower "
                              f"engine.chunked_prefill_size or engine.mem_fraction_static",
                              "engine.chunked_prefill_size")
        return kv_tokens

    def __str__(self) -> str:
        return (f"device {self.device} ({self.dtype}); weights {self.weights_bytes / GIB:.2f} GiB"
                + (f" ({self.fp8_bytes / GIB:.2f} GiB of them kept FP8, {self.fp8_weights})" if self.fp8_bytes
                   else "")
                + (f" ({self.w4_bytes / GIB:.2f} GiB of them 4-bit, {self.w4_format})" if self.w4_bytes else "")
                + (f" (vision tower {self.vision_bytes / GIB:.2f} GiB)" if self.vision_bytes else "") + "; "
                f"KV pool {self.kv_tokens} tokens ({self.kv_pages} pages of {self.page_size}, "
                f"{self.kv_dtype}, {self.kv_tokens * self.kv_bytes_per_token / GIB:.2f} GiB); "
                f"GDN state {self.state_slots} slots ({self.state_slots * self.state_bytes_per_slot / GIB:.2f} GiB); "
                + (f"NEXTN: {self.nextn_layers} attention layer in the KV pages "
                   f"({self.kv_tokens * self.kv_bytes_per_token * self.nextn_layers / max(1, self.kv_layers) / GIB:.2f}"
                   f" GiB of the KV pool), {self.verify_slots} verify state slots "
                   f"({self.verify_slots * self.state_bytes_per_slot / GIB:.2f} GiB); " if self.nextn_layers else "") +
                f"prefix-cache state snapshots {self.snapshot_slots} "
                f"({self.snapshot_slots * self.state_bytes_per_slot / GIB:.2f} GiB); "
                f"context {self.context_length} tokens"
                + (f"; host tier {self.host_pages * self.page_size} tokens ({self.host_pages} pages) + "
                   f"{self.host_snapshots} snapshots" if self.host_pages or self.host_snapshots else "")
                + (f"; file tier {self.file_dir} up to {self.file_bytes / GIB:.2f} GiB "
                   f"(~{self.file_bytes // max(1, self.kv_bytes_per_token)} tokens)" if self.file_dir else "")
                + (f"; one step's activations ~{self.activation_bytes / GIB:.2f} GiB" if self.activation_bytes
                   else "")
                + (f"; CUDA graphs ~{self.graph_bytes / GIB:.2f} GiB (their padding rows' scratch state "
                   f"slot and KV page are in the static share)" if self.graph_bytes else ""))


def resolve_device(cfg: Config) -> str:
    device = cfg.model.device
    if device == "cpu":
        return device
    import torch                       # only here: a CPU plan needs no torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ConfigError('model.device = "cuda" but no CUDA device is available', "model.device")
    return device


def checkpoint_folder(cfg: Config) -> Path:
    """model.path, with "demo" written (once) and resolved to the built-in demo checkpoint."""
    if cfg.model.path == "demo":
        from tinyserve.demo import ensure_demo_checkpoint
        return Path(ensure_demo_checkpoint())
    return Path(cfg.model.path)


def plan_for(cfg: Config, gpu_memory_gb: float | None = None) -> tuple[Path, ModelConfig, MemoryPlan]:
    """The checkpoint folder, its ModelConfig and the plan, from config.json and the safetensors headers only.
    gpu_memory_gb: plan for a CUDA card of that size instead of this machine's device (--gpu-memory-gb)."""
    from tinyserve.loader import read_checkpoint
    folder = checkpoint_folder(cfg)
    device = "cuda" if gpu_memory_gb else resolve_device(cfg)
    capability = free = None
    if gpu_memory_gb:
        free = int(gpu_memory_gb * GIB) - CUDA_CONTEXT_BYTES
    elif device == "cuda":
        import torch
        capability = torch.cuda.get_device_capability()
    # the vision tower's weights count too; FP8 weights as this device holds them
    keep_fp8 = fp8_weights_for(device, capability, cfg.engine.kernels) != "dequantize"
    mc, weights = read_checkpoint(folder, vision=cfg.model.vision, keep_fp8=keep_fp8)
    return folder, mc, MemoryPlan.resolve(cfg, mc, device, weights, gpu_free_bytes=free, cuda_capability=capability,
                                          check_host=not gpu_memory_gb)
