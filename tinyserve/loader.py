"""Stream a checkpoint's weights into the model (model_config.py reads the folder, fp8_scheme.py its FP8 scales).

The checkpoint's tensors are first matched to the model's own list (names, shapes, FP8 scales), then copied in one
at a time (safe_open + models.weights.TextWeights.load), so peak memory stays near the model size. An FP8
checkpoint's tensors are dequantized one by one, or kept FP8 where fp8_scheme.fp8_placement allows. read_checkpoint counts what load_model
will hold from the headers alone: what the memory plan needs. Every problem is raised as LoaderError with a message
naming the file, key or tensor at fault.
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinyserve.fp8_scheme import (FP8_WEIGHTS, SCALE_SUFFIXES, Fp8Scheme, dequantize, fp8_placement, pair_scales,
                                  scale_of, scales_in_blocks)
from tinyserve.model_config import (LoaderError, TensorInfo, TensorToLoad, canonical_name, is_vision_tensor,
                                    read_folder)
from tinyserve.models.config import ModelConfig, WeightCount

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tinyserve.loader")

_LARGE_CHECKPOINT_BYTES = 2 << 30      # progress bar even without a tty above this size
_MAX_LISTED = 10                       # names listed in one error message


def read_checkpoint(folder: str | Path, vision: bool = True, keep_fp8: bool = False) -> tuple[ModelConfig,
                                                                                                WeightCount]:
    """The ModelConfig and the weights the model will hold (the vision tower's too, unless vision=False), from
    config.json and the safetensors headers alone (no tensor data is read): what the memory plan needs before any
    weight is loaded. keep_fp8: count FP8 weights as load_model(fp8_weights=...) keeps them (this imports torch to
    lay the model out on "meta"; a plan that dequantizes needs no torch)."""
    checkpoint = read_folder(folder, vision)
    cfg = checkpoint.config
    items = _loadable(cfg, checkpoint.tensors)
    cfg.vision_parameters = sum(math.prod(it.info.shape) for it in items if it.canonical.startswith("visual."))
    values = sum(math.prod(it.info.shape) for it in items)
    scheme = Fp8Scheme.from_config(checkpoint.raw)
    if not keep_fp8 or not scheme.method:        # the same condition as load_model's
        return cfg, WeightCount(values)
    for item in items:
        item.scale = scale_of(item, checkpoint.tensors)
    blocks, kept = fp8_placement(cfg, items, scheme)
    cfg.fp8_blocks = blocks
    fp8 = [(it.info.shape, blocks[kept[it.canonical]]) for it in items if it.canonical in kept]
    return cfg, WeightCount(values, fp8_values=sum(out * inp for (out, inp), _ in fp8),
                            fp8_scales=sum(math.ceil(out / b0) * math.ceil(inp / b1) for (out, inp), (b0, b1) in fp8))


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu", vision: bool = True,
               fp8_weights: str = "dequantize"):
    """Build the model described by `folder`/config.json and stream the checkpoint's weights into it (with its
    vision tower when it has one, unless vision=False). An FP8 checkpoint's linear weights are dequantized to
    `dtype`, or with fp8_weights "w8a8" / "w8a16" kept FP8 where fp8_placement allows (kernels/fp8.py)."""
    # torch and the model are imported on use: reading configs and headers (the plan, --check) needs neither
    import torch
    from safetensors import safe_open

    from tinyserve.models.qwen3_next import Qwen3NextForCausalLM
    from tinyserve.models.weights import Fp8Weights, TextWeights

    checkpoint = read_folder(folder, vision)
    path, cfg, tensors = checkpoint.path, checkpoint.config, checkpoint.tensors
    scheme = Fp8Scheme.from_config(checkpoint.raw)
    device = torch.device(device)

    assert fp8_weights in FP8_WEIGHTS, fp8_weights
    blocks: dict[str, tuple[int, int]] = {}
    kept: dict[str, str] = {}                      # canonical tensor -> the FP8 parameter it fills
    if fp8_weights != "dequantize" and scheme.method:
        check = Qwen3NextForCausalLM(cfg, dtype, "meta")       # names and shapes checked before any allocation
        matched = _match_tensors(path, cfg, tensors, scheme, TextWeights(check).expected())
        blocks, kept = fp8_placement(cfg, matched, scheme)
    cfg.fp8_blocks = blocks
    fp8 = Fp8Weights(blocks, act_quant=fp8_weights == "w8a8") if blocks else None
    model = Qwen3NextForCausalLM(cfg, dtype, device, fp8)
    if model.visual is not None:
        cfg.vision_parameters = sum(p.numel() for p in model.visual.parameters())
    weights = TextWeights(model)
    items = _match_tensors(path, cfg, tensors, scheme, weights.expected())

    # Read file by file (sequential access into each mmap); scales may sit in another shard.
    items.sort(key=lambda it: (str(it.info.file), it.info.name))
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(f: Path):
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            return handles[f]

        size = sum(f.stat().st_size for f in checkpoint.files)
        with _progress(len(items), size) as bar:
            for item in items:
                tensor = handle(item.info.file).get_tensor(item.info.name)
                scale = None
                if item.scale is not None:
                    scale = handle(item.scale.file).get_tensor(item.scale.name)
                    if item.canonical in kept:         # stays FP8: the scales in the weight's block layout
                        scale = scales_in_blocks(scale, item.info.shape, blocks[kept[item.canonical]])
                    else:                              # dequantized where the model lives
                        tensor = dequantize(tensor.to(device), scale, scheme.block, item.scale.name)
                        scale = None
                weights.load(item.canonical, tensor, scale)
                del tensor  # one checkpoint tensor alive at a time
                bar.update(1)
    log.info("loaded %s: %d tensors, %s, dtype %s, device %s%s", path, len(items), cfg.model_type, dtype, device,
             f", {len(blocks)} linear weights kept FP8 ({fp8_weights})" if blocks else "")
    return model


def _loadable(cfg: ModelConfig, tensors: dict[str, TensorInfo]) -> list[TensorToLoad]:
    """The checkpoint tensors the text model loads (without their FP8 scales)."""
    items = []
    for name, info in tensors.items():
        if name.endswith(SCALE_SUFFIXES) or name.endswith(".input_scale"):
            continue  # scales travel with their weight; activation scales are unused (dequantized GEMMs)
        canon = canonical_name(name)
        if canon.startswith("visual.") and cfg.vision_config is None:
            continue  # vision tensors without a tower to load them into (model.vision = false, or no config)
        if canon == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the head is the embedding
        if canon.startswith("mtp.") and _mtp_layer_dropped(canon, cfg.num_mtp_layers):
            continue
        if canon.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some older exports include
        items.append(TensorToLoad(canon, info))
    return items


def _match_tensors(folder: Path, cfg: ModelConfig, tensors: dict[str, TensorInfo], scheme: Fp8Scheme,
                   expected: dict[str, tuple[int, ...]]) -> list[TensorToLoad]:
    """The checkpoint's tensors the model loads, each matched to one the model expects (name, shape) and an FP8
    weight to its scale; raise on anything missing, left over or inconsistent."""
    skipped_vision = sum(1 for n in tensors if is_vision_tensor(n)) if cfg.vision_config is None else 0
    items = _loadable(cfg, tensors)
    if skipped_vision:
        log.info("skipping %d vision tensors (model.visual.*): no image input (model.vision = false or the "
                 "config has no vision_config)", skipped_vision)
    pair_scales(items, tensors, scheme)

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
        if tuple(item.info.shape) != tuple(want):
            mismatched.append(f"{item.info.name}: expected {list(want)}, found {list(item.info.shape)}")
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

