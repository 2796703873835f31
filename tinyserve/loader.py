"""Stream a checkpoint's weights into the model (model_config.py reads the folder, fp8_scheme.py its FP8 scales,
four_bit.py its 4-bit modules).

The checkpoint's tensors are first matched to the model's own list (names, shapes, FP8 scales; a 4-bit module's
tensors count as its one weight), then copied in one at a time (safe_open + models.weights.TextWeights.load), so
peak memory stays near the model size. An FP8 checkpoint's tensors are dequantized one by one, or kept FP8 where
fp8_scheme.fp8_placement allows; a 4-bit module is repacked into the W4Weight layout and held 4-bit where
four_bit.w4_placement allows, else dequantized. read_checkpoint counts what load_model will hold from the headers
(and, for act-order checkpoints, their g_idx): what the memory plan needs. Every problem is raised as LoaderError
with a message naming the file, key or tensor at fault.
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinyserve.four_bit import (FourBitScheme, QuantizedModule, W4Placement, fit_to, read_facts, read_module, repack,
                                w4_placement)
from tinyserve.fp8_scheme import (FP8_WEIGHTS, SCALE_SUFFIXES, Fp8Scheme, dequantize, fp8_placement, pair_scales,
                                  scale_of, scales_in_blocks)
from tinyserve.model_config import (CheckpointFolder, LoaderError, TensorInfo, TensorToLoad, canonical_name,
                                    is_vision_tensor, read_folder)
from tinyserve.models.config import ModelConfig, WeightCount

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tinyserve.loader")

_LARGE_CHECKPOINT_BYTES = 2 << 30      # progress bar even without a tty above this size
_MAX_LISTED = 10                       # names listed in one error message


def read_checkpoint(folder: str | Path, vision: bool = True, keep_fp8: bool = False) -> tuple[ModelConfig,
                                                                                                WeightCount]:
    """The ModelConfig and the weights the model will hold (the vision tower's too, unless vision=False), from
    config.json and the safetensors headers (no weight data is read): what the memory plan needs before any weight
    is loaded. 4-bit weights are counted as load_model holds them (an act-order checkpoint's g_idx are read, where
    the files hold data, to tell which fused weights share a permutation). keep_fp8: count FP8 weights as
    load_model(fp8_weights=...) keeps them. Both lay the model out on "meta" (importing torch); a plan of a bf16
    or dequantized FP8 checkpoint needs no torch."""
    checkpoint = read_folder(folder, vision)
    cfg = checkpoint.config
    w4_scheme = FourBitScheme.from_config(checkpoint.quantization)
    modules = w4_scheme.find_modules(checkpoint.tensors) if w4_scheme else {}
    items = _loadable(cfg, checkpoint.tensors, modules)
    cfg.vision_parameters = sum(math.prod(it.shape) for it in items if it.canonical.startswith("visual."))
    values = sum(math.prod(it.shape) for it in items)
    w4 = W4Placement({}, {})
    if modules:
        w4 = w4_placement(cfg, items, _facts_if_stored(checkpoint, items))
    scheme = Fp8Scheme.from_config(checkpoint.quantization)
    if not keep_fp8 or not scheme.method:        # the same condition as load_model's
        return cfg, WeightCount(values, w4_values=w4.values, w4_bytes=w4.bytes, w4_format=w4.label)
    for item in items:
        if item.w4 is None:
            item.scale = scale_of(item, checkpoint.tensors)
    blocks, kept = fp8_placement(cfg, items, scheme)
    cfg.fp8_blocks = blocks
    fp8 = [(it.info.shape, blocks[kept[it.canonical]]) for it in items if it.canonical in kept]
    return cfg, WeightCount(values, fp8_values=sum(out * inp for (out, inp), _ in fp8),
                            fp8_scales=sum(math.ceil(out / b0) * math.ceil(inp / b1) for (out, inp), (b0, b1) in fp8),
                            w4_values=w4.values, w4_bytes=w4.bytes, w4_format=w4.label)


def _facts_if_stored(checkpoint: CheckpointFolder, items: list[TensorToLoad]):
    """four_bit.read_facts of the act-order modules (what the plan's count depends on: which fused weights share a
    permutation), or None for a folder of headers alone (no tensor data)."""
    from safetensors import SafetensorError
    modules = [it.w4 for it in items if it.w4 is not None and it.w4.fmt.act_order]
    if not modules:
        return {}
    try:
        with contextlib.ExitStack() as stack:
            return read_facts(modules, _tensor_reader(stack))
    except SafetensorError:
        return None                              # headers alone (tinyserve --check of a header-only folder)


def _tensor_reader(stack: contextlib.ExitStack):
    """read(info) -> that tensor, on the CPU: each file opened once (safe_open: an mmap), closed with `stack`."""
    from safetensors import safe_open
    handles: dict[Path, Any] = {}

    def read(info: TensorInfo):
        if info.file not in handles:
            handles[info.file] = stack.enter_context(safe_open(str(info.file), framework="pt", device="cpu"))
        return handles[info.file].get_tensor(info.name)
    return read


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu", vision: bool = True,
               fp8_weights: str = "dequantize"):
    """Build the model described by `folder`/config.json and stream the checkpoint's weights into it (with its
    vision tower when it has one, unless vision=False). An FP8 checkpoint's linear weights are dequantized to
    `dtype`, or with fp8_weights "w8a8" / "w8a16" kept FP8 where fp8_placement allows (kernels/fp8.py). A 4-bit
    checkpoint's (GPTQ, AWQ, compressed-tensors, NVFP4) are held 4-bit where w4_placement allows (kernels/w4.py),
    on every device, and dequantized to `dtype` elsewhere."""
    # torch and the model are imported on use: reading configs and headers (the plan, --check) needs neither
    import torch

    from tinyserve.models.qwen3_next import Qwen3NextForCausalLM
    from tinyserve.models.weights import QuantizedWeights, TextWeights

    checkpoint = read_folder(folder, vision)
    path, cfg, tensors = checkpoint.path, checkpoint.config, checkpoint.tensors
    w4_scheme = FourBitScheme.from_config(checkpoint.quantization)
    scheme = Fp8Scheme.from_config(checkpoint.quantization)
    modules = w4_scheme.find_modules(tensors) if w4_scheme else {}
    device = torch.device(device)

    with contextlib.ExitStack() as stack:
        read = _tensor_reader(stack)
        assert fp8_weights in FP8_WEIGHTS, fp8_weights
        blocks: dict[str, tuple[int, int]] = {}
        kept: dict[str, str] = {}                      # canonical tensor -> the FP8 parameter it fills
        w4 = W4Placement({}, {})
        if modules or (fp8_weights != "dequantize" and scheme.method):
            check = Qwen3NextForCausalLM(cfg, dtype, "meta")       # names and shapes checked before any allocation
            matched = _match_tensors(path, cfg, tensors, scheme, TextWeights(check).expected(), modules)
            if fp8_weights != "dequantize" and scheme.method:
                blocks, kept = fp8_placement(cfg, matched, scheme)
            if modules:
                w4 = w4_placement(cfg, matched, read_facts([it.w4 for it in matched if it.w4 is not None], read))
        cfg.fp8_blocks = blocks
        quantized = QuantizedWeights(blocks, fp8_weights == "w8a8", w4.layouts) if blocks or w4.layouts else None
        model = Qwen3NextForCausalLM(cfg, dtype, device, quantized)
        if model.visual is not None:
            cfg.vision_parameters = sum(p.numel() for p in model.visual.parameters())
        weights = TextWeights(model)
        items = _match_tensors(path, cfg, tensors, scheme, weights.expected(), modules)

        # Read file by file (sequential access into each mmap); scales may sit in another shard.
        items.sort(key=lambda it: (str(it.info.file), it.info.name))
        size = sum(f.stat().st_size for f in checkpoint.files)
        with _progress(len(items), size) as bar:
            for item in items:
                if item.w4 is not None:                # repacked where the model lives
                    _load_four_bit(weights, item, w4, read, device, dtype)
                    bar.update(1)
                    continue
                tensor = read(item.info)
                scale = None
                if item.scale is not None:
                    scale = read(item.scale)
                    if item.canonical in kept:         # stays FP8: the scales in the weight's block layout
                        scale = scales_in_blocks(scale, item.info.shape, blocks[kept[item.canonical]])
                    else:                              # dequantized where the model lives
                        tensor = dequantize(tensor.to(device), scale, scheme.block, item.scale.name)
                        scale = None
                weights.load(item.canonical, tensor, scale)
                del tensor  # one checkpoint tensor alive at a time
                bar.update(1)
        if w4.layouts and device.type == "cpu":        # the CPU kernel's layout, once every part is in
            from tinyserve.kernels import w4_cpu
            w4_cpu.block_weights(model)
    log.info("loaded %s: %d tensors, %s, dtype %s, device %s%s%s", path, len(items), cfg.model_type, dtype, device,
             f", {len(blocks)} linear weights kept FP8 ({fp8_weights})" if blocks else "",
             f", {len(w4.layouts)} linear weights held 4-bit ({w4.label})" if w4.layouts else "")
    return model


def _load_four_bit(weights, item: TensorToLoad, w4: W4Placement, read, device, dtype) -> None:
    """One 4-bit module: repacked, then copied into the weight it fills (held 4-bit) or dequantized into it."""
    part = repack(item.w4, {role: t.to(device) for role, t in read_module(item.w4, read).items()})
    param = w4.kept.get(item.canonical)
    weights.load(item.canonical, fit_to(part, w4.layouts[param]) if param else part.dequantize(dtype))


def _loadable(cfg: ModelConfig, tensors: dict[str, TensorInfo],
              modules: dict[str, QuantizedModule] | None = None) -> list[TensorToLoad]:
    """The checkpoint tensors the text model loads (without their FP8 scales); each 4-bit module as one item (w4)
    in place of its tensors."""
    modules = modules or {}
    consumed = {info.name for m in modules.values() for info in m.tensors.values()}
    found = [TensorToLoad(canonical_name(name), info) for name, info in tensors.items()
             if name not in consumed and not name.endswith(SCALE_SUFFIXES + _UNUSED_SUFFIXES)]
    found += [TensorToLoad(canonical_name(m.name + ".weight"), m.packed, w4=m) for m in modules.values()]
    return [it for it in found if not _skipped(cfg, it.canonical)]


# Scales travel with their weight; activation scales and the KV cache's static scales (ModelOpt,
# compressed-tensors) are unused: the GEMMs are weight-only or quantize activations dynamically.
_UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


def _skipped(cfg: ModelConfig, canon: str) -> bool:
    """A tensor the model does not load: vision ones without a tower to load them into (model.vision = false, or
    no config), a tied head (the embedding), mtp.* beyond the MTP layers the config asks for, a buffer some older
    exports include."""
    return ((canon.startswith("visual.") and cfg.vision_config is None)
            or (canon == "lm_head.weight" and cfg.tie_word_embeddings)
            or (canon.startswith("mtp.") and _mtp_layer_dropped(canon, cfg.num_mtp_layers))
            or canon.endswith("rotary_emb.inv_freq"))


def _match_tensors(folder: Path, cfg: ModelConfig, tensors: dict[str, TensorInfo], scheme: Fp8Scheme,
                   expected: dict[str, tuple[int, ...]],
                   modules: dict[str, QuantizedModule] | None = None) -> list[TensorToLoad]:
    """The checkpoint's tensors the model loads, each matched to one the model expects (name, shape) and an FP8
    weight to its scale; raise on anything missing, left over or inconsistent (a 4-bit module's weight shape is
    the one its packed tensors hold)."""
    skipped_vision = sum(1 for n in tensors if is_vision_tensor(n)) if cfg.vision_config is None else 0
    items = _loadable(cfg, tensors, modules)
    if skipped_vision:
        log.info("skipping %d vision tensors (model.visual.*): no image input (model.vision = false or the "
                 "config has no vision_config)", skipped_vision)
    consumed = {info.name for m in (modules or {}).values() for info in m.tensors.values()}
    pair_scales([it for it in items if it.w4 is None], {n: i for n, i in tensors.items() if n not in consumed},
                scheme)

    # Completeness and shapes, against the model's own list.
    provided: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    for item in items:
        want = expected.get(item.canonical)
        if want is None:
            fused = _fused_expert_cover(item.canonical, expected)
            if fused is None:
                unexpected.append(item.info.name)
                continue
            covered, want = fused
            provided.update(covered)
        else:
            provided.add(item.canonical)
        if item.shape != tuple(want):
            mismatched.append(f"{item.info.name}: expected {list(want)}, found {list(item.info.shape)}"
                              if item.w4 is None else
                              f"{item.info.name} (a 4-bit {list(item.shape)} weight, packed {list(item.info.shape)}): "
                              f"config.json's {config_keys_of(item.canonical)} make it {list(want)}")
    missing = [n for n in expected if n not in provided]
    if missing:
        raise LoaderError(f"checkpoint {folder} is missing {len(missing)} tensor(s) the model needs "
                          f"(canonical names): {_listing(missing)}")
    if unexpected:
        raise LoaderError(f"checkpoint {folder} has {len(unexpected)} tensor(s) the model does not use: "
                          f"{_listing(unexpected)}")
    if mismatched:
        raise LoaderError(f"checkpoint {folder} has {len(mismatched)} tensor(s) with the wrong shape: "
                          f"{_listing(mismatched)}")
    return items


# The config.json keys that size each linear weight [N, K] (named when a 4-bit tensor disagrees with them)
_SIZED_BY = [
    (r"self_attn\.q_proj", "num_attention_heads x head_dim x 2, hidden_size"),
    (r"self_attn\.[kv]_proj", "num_key_value_heads x head_dim, hidden_size"),
    (r"self_attn\.o_proj", "hidden_size, num_attention_heads x head_dim"),
    (r"linear_attn\.in_proj_(qkvz|qkv)", "linear_num_key_heads x linear_key_head_dim, linear_num_value_heads x "
                                         "linear_value_head_dim, hidden_size"),
    (r"linear_attn\.in_proj_z", "linear_num_value_heads x linear_value_head_dim, hidden_size"),
    (r"linear_attn\.in_proj_(ba|a|b)", "linear_num_value_heads, hidden_size"),
    (r"linear_attn\.out_proj", "hidden_size, linear_num_value_heads x linear_value_head_dim"),
    (r"shared_expert\.(gate|up)_proj", "shared_expert_intermediate_size, hidden_size"),
    (r"shared_expert\.down_proj", "hidden_size, shared_expert_intermediate_size"),
    (r"experts\.\d+\.(gate|up)_proj", "moe_intermediate_size, hidden_size"),
    (r"experts\.\d+\.down_proj", "hidden_size, moe_intermediate_size"),
    (r"mlp\.(gate|up)_proj", "intermediate_size, hidden_size"),
    (r"mlp\.down_proj", "hidden_size, intermediate_size"),
    (r"mtp\.fc", "hidden_size, 2 x hidden_size"),
]


def config_keys_of(canonical: str) -> str:
    """The config.json keys that size a weight, for messages."""
    return next((keys for pattern, keys in _SIZED_BY if re.search(pattern, canonical)), "sizes")


_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _fused_expert_cover(name: str, expected: dict[str, tuple[int, ...]]
                        ) -> tuple[list[str], tuple[int, ...]] | None:
    """For a fused 3-D expert tensor, the per-expert names it provides and the shape it must have."""
    m = _FUSED_EXPERTS.match(name)
    if not m:
        return None
    base, kind = m.groups()
    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    covered: list[str] = []
    e = 0
    while f"{base}.{e}.{parts[0]}.weight" in expected:
        covered += [f"{base}.{e}.{p}.weight" for p in parts]
        e += 1
    if e == 0:
        return None
    out, inp = expected[f"{base}.0.{parts[0]}.weight"]
    shape = (e, out * len(parts), inp)  # gate_up: [E, 2I, H]; down: [E, H, I]
    return covered, shape


def _mtp_layer_dropped(canon: str, num_mtp: int) -> bool:
    """mtp.* tensors beyond the MTP layers the config asks for are not loaded."""
    if num_mtp == 0:
        return True
    m = re.match(r"mtp\.layers\.(\d+)\.", canon)
    return m is not None and int(m.group(1)) >= num_mtp


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")



def _progress(total: int, size_bytes: int):
    from tqdm import tqdm

    show = sys.stderr.isatty() or size_bytes >= _LARGE_CHECKPOINT_BYTES
    return tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show, leave=False)

