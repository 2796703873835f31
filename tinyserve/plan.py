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
from tinyserve.models.config import ModelConfig

# The one table of dtypes: the config's name -> (torch's name, bytes per value). Plans carry the config's names, so
# planning (and `tinyserve --check` on a CPU) never imports torch; the engine turns them into torch dtypes.
DTYPE_TABLE: dict[str, tuple[str, int]] = {"bfloat16": ("bfloat16", 2), "float16": ("float16", 2),
                                           "float32": ("float32", 4), "fp8_e4m3": ("float8_e4m3fn", 1)}
assert set(DTYPES + KV_CACHE_DTYPES) - {"auto"} == set(DTYPE_TABLE), "config.py's dtype names and this table"
CPU_DEFAULT_KV_TOKENS = 32768       # engine.kv_cache_tokens = 0 on the CPU: a modest pool
SNAPSHOTS_PER_RUNNING_REQUEST = 4   # cache.state_slots = 0: device snapshots per engine.max_running_requests
CUDA_ACTIVATION_RESERVE = 1 << 30   # bytes kept free on the GPU for activations and the CUDA context
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

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size

    @property
    def hybrid(self) -> bool:
        return self.state_bytes_per_slot > 0

    @classmethod
    def resolve(cls, cfg: Config, mc: ModelConfig, device: str, weight_values: int) -> "MemoryPlan":
        """Decide every derived size. `weight_values` is the number of weight values the model holds (from the
        safetensors headers); `device` is "cpu" or "cuda" (see resolve_device)."""
        dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        kv_dtype = cfg.model.kv_cache_dtype if cfg.model.kv_cache_dtype != "auto" else dtype
        e, c = cfg.engine, cfg.cache
        hybrid = bool(mc.gdn_layer_ids)
        nextn_layers = verify_slots = 0
        if cfg.speculative.algorithm == "nextn":
            if mc.num_mtp_layers == 0:
                raise ConfigError('speculative.algorithm = "nextn" needs the checkpoint\'s NEXTN head, but model.path '
                                  'has no mtp.* tensors (some quantized releases drop them); set '
                                  'speculative.algorithm = "" or use a checkpoint with mtp.* weights',
                                  "speculative.algorithm")
            nextn_layers = mc.num_mtp_layers
            verify_slots = e.max_running_requests * cfg.speculative.num_steps if hybrid else 0
        per_token = kv_bytes_per_token(mc, kv_dtype, nextn_layers)
        per_slot = state_bytes_per_slot(mc, dtype)
        weights = weight_values * element_size(dtype)
        snapshots = 0
        if c.enabled and hybrid:
            snapshots = c.state_slots or SNAPSHOTS_PER_RUNNING_REQUEST * e.max_running_requests
        state_bytes = (e.max_running_requests + verify_slots + snapshots) * per_slot
        if e.kv_cache_tokens:
            kv_tokens = e.kv_cache_tokens
        elif device == "cuda":
            import torch
            free, _ = torch.cuda.mem_get_info()
            budget = free * e.mem_fraction_static - weights - state_bytes - CUDA_ACTIVATION_RESERVE
            if budget < per_token * e.page_size:
                raise ConfigError(
                    f"the GPU has {free / GIB:.1f} GiB free; with engine.mem_fraction_static = "
                    f"{e.mem_fraction_static} there is no room for a KV cache after {weights / GIB:.1f} GiB of "
                    f"weights and {state_bytes / GIB:.2f} GiB of GDN state (lower engine.max_running_requests or "
                    f"cache.state_slots, or use a smaller model)", "engine.mem_fraction_static")
            kv_tokens = int(budget // per_token)
        else:
            kv_tokens = CPU_DEFAULT_KV_TOKENS
        kv_pages = max(1, kv_tokens // e.page_size)
        context = cfg.model.context_length or mc.max_position_embeddings

        host_pages = host_snapshots = 0
        host_bytes = int(c.host.size_gb * GIB) if c.enabled else 0
        if host_bytes:
            available = host_available_bytes()
            if host_bytes > available:
                raise ConfigError(f"cache.host.size_gb = {c.host.size_gb:g} GB does not fit: this host has "
                                  f"{available / GIB:.1f} GiB available; lower cache.host.size_gb",
                                  "cache.host.size_gb")
            page_bytes = per_token * e.page_size
            share = 0.0
            if hybrid:   # cache.host.state_share, or the device's own ratio of snapshot to KV + snapshot memory
                dev_snap = snapshots * per_slot
                share = c.host.state_share or dev_snap / max(1, dev_snap + kv_pages * page_bytes)
                host_snapshots = int(host_bytes * share // per_slot)
            host_pages = int((host_bytes - host_snapshots * per_slot) // page_bytes)
        file_on = c.enabled and bool(c.file.dir)
        return cls(device=device, dtype=dtype, kv_dtype=kv_dtype, weights_bytes=weights,
                   vision_bytes=mc.vision_parameters * element_size(dtype), context_length=context,
                   page_size=e.page_size, kv_pages=kv_pages, kv_bytes_per_token=per_token,
                   state_slots=e.max_running_requests, state_bytes_per_slot=per_slot if hybrid else 0,
                   snapshot_slots=snapshots, verify_slots=verify_slots, nextn_layers=nextn_layers,
                   kv_layers=len(mc.attn_layer_ids) + nextn_layers,
                   host_pages=host_pages, host_snapshots=host_snapshots,
                   file_dir=c.file.dir if file_on else "", file_bytes=int(c.file.size_gb * GIB) if file_on else 0)

    def __str__(self) -> str:
        return (f"device {self.device} ({self.dtype}); weights {self.weights_bytes / GIB:.2f} GiB"
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
                   f"(~{self.file_bytes // max(1, self.kv_bytes_per_token)} tokens)" if self.file_dir else ""))


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


def plan_for(cfg: Config) -> tuple[Path, ModelConfig, MemoryPlan]:
    """The checkpoint folder, its ModelConfig and the plan, from config.json and the safetensors headers only."""
    from tinyserve.loader import read_checkpoint
    folder = checkpoint_folder(cfg)
    mc, values = read_checkpoint(folder, vision=cfg.model.vision)     # the vision tower's weights count too
    return folder, mc, MemoryPlan.resolve(cfg, mc, resolve_device(cfg), values)
