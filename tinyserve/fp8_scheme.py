"""An FP8 checkpoint's quantization: what its quantization_config says (block size, modules left unquantized),
which tensor is whose scale, dequantizing a weight by its scale, and which linear weights stay FP8 where the device
keeps them (the GEMM that reads them is kernels/fp8.py).

Three formats: Qwen's block FP8 (`quant_method: fp8`, `weight_scale_inv` per 128x128 block), compressed-tensors
float-quantized (`weight_scale` per tensor, per output channel or per block) and ModelOpt's FP8 (`weight_scale` per
tensor or channel), the last two also as the FP8 layers of a checkpoint whose others are 4-bit (four_bit.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tinyserve.four_bit import CT_FORMATS, FOUR_BIT_METHODS, IgnoreList
from tinyserve.model_config import LoaderError, TensorInfo, TensorToLoad, is_vision_tensor
from tinyserve.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

FP8_WEIGHTS = ("dequantize", "w8a8", "w8a16")     # how load_model holds FP8 weights (fp8_weights=...)
_FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}             # safetensors dtype tags
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


@dataclass
class Fp8Scheme:
    """What the checkpoint's quantization_config says about FP8 weights."""

    method: str | None = None                       # "fp8" | "compressed-tensors" | "modelopt" | None
    block: tuple[int, int] = (128, 128)             # block size for block scales
    ignore: IgnoreList = field(default_factory=IgnoreList)

    @classmethod
    def from_config(cls, qc: dict[str, Any] | None) -> "Fp8Scheme":
        """qc: the checkpoint's quantization config (model_config.read_quantization)."""
        if not qc:
            return cls()
        method = qc.get("quant_method")
        if method in ("gptq", "awq"):
            return cls()                                # 4-bit alone (four_bit.py)
        if isinstance(method, str) and method.lower().startswith("modelopt"):
            return cls(method="modelopt")               # FP8 layers beside NVFP4 ones: scales per tensor / channel
        scheme = cls(method=method)
        if method == "fp8":
            if qc.get("weight_block_size") is not None:
                scheme.block = cls._block(qc["weight_block_size"], "quantization_config.weight_block_size")
            ignore = qc.get("modules_to_not_convert"), "quantization_config.modules_to_not_convert"
        elif method == "compressed-tensors":
            fmt = qc.get("format")
            if fmt not in CT_FORMATS + (None,):
                raise LoaderError(f"config.json: compressed-tensors format {fmt!r} is not supported "
                                  f"(supported: {', '.join(CT_FORMATS)})")
            for gname, group in (qc.get("config_groups") or {}).items():
                w = (group or {}).get("weights") or {}
                if w.get("num_bits") == 4:
                    continue                            # four_bit.py's
                if w.get("type", "float") != "float" or w.get("num_bits", 8) != 8:
                    raise LoaderError(f"config.json: quantization_config.config_groups.{gname}.weights is not "
                                      f"8-bit float ({w.get('num_bits')} bits, type {w.get('type')!r}); "
                                      f"FP8 and 4-bit (int or NVFP4) weights are supported")
                if w.get("strategy") == "block" and w.get("block_structure") is not None:
                    scheme.block = cls._block(w["block_structure"],
                                              f"quantization_config.config_groups.{gname}.weights.block_structure")
            ignore = qc.get("ignore"), "quantization_config.ignore"
        else:
            raise LoaderError(f"config.json: quantization_config.quant_method {method!r} is not supported "
                              f"(supported: 'fp8', 'compressed-tensors', {', '.join(map(repr, FOUR_BIT_METHODS))}; "
                              f"bitsandbytes, GGUF, AQLM, HQQ, EXL2 and other formats are not)")
        scheme.ignore = IgnoreList.parse(*ignore)
        return scheme

    @staticmethod
    def _block(value: Any, key: str) -> tuple[int, int]:
        if (not isinstance(value, list) or len(value) != 2
                or not all(isinstance(v, int) and v > 0 for v in value)):
            raise LoaderError(f"config.json: {key} must be two positive ints, found {value!r}")
        return value[0], value[1]


def pair_scales(items: list[TensorToLoad], tensors: dict[str, TensorInfo], scheme: Fp8Scheme) -> None:
    """Give every FP8 weight its scale tensor (item.scale): every FP8 weight needs its scale, every scale its FP8
    weight, and no FP8 weight may be of a module the scheme lists as not quantized."""
    scales = {n: i for n, i in tensors.items() if n.endswith(SCALE_SUFFIXES)}
    by_name = {it.info.name: it for it in items}
    for sname, sinfo in scales.items():
        wname = sname[: sname.rindex(".weight_scale")] + ".weight"
        item = by_name.get(wname)
        if item is None:
            if is_vision_tensor(sname) or wname in tensors:
                continue  # scale of a skipped tensor (vision, tied head, dropped mtp)
            raise LoaderError(f"scale tensor {sname!r} has no weight {wname!r} in the checkpoint")
        if item.info.dtype not in _FP8_DTYPES:
            raise LoaderError(f"scale tensor {sname!r} belongs to weight {wname!r}, which is not FP8 "
                              f"(dtype {item.info.dtype})")
        if item.scale is not None:
            raise LoaderError(f"weight {wname!r} has two scales: {item.scale.name!r} and {sname!r}")
        item.scale = sinfo
    for item in items:
        if item.info.dtype in _FP8_DTYPES:
            module = item.info.name[: -len(".weight")] if item.info.name.endswith(".weight") else item.info.name
            if module in scheme.ignore:
                raise LoaderError(f"tensor {item.info.name!r} is stored as FP8 but its module is listed as not "
                                  f"quantized (modules_to_not_convert / ignore)")
            if item.scale is None:
                raise LoaderError(f"FP8 tensor {item.info.name!r} has no scale tensor "
                                  f"({item.info.name}_scale_inv or {item.info.name}_scale)")


def scale_of(item: TensorToLoad, tensors: dict[str, TensorInfo]) -> TensorInfo | None:
    """The scale tensor stored beside an FP8 weight (name + "_scale_inv" or "_scale"), if any."""
    return next((tensors[item.info.name + suffix[len(".weight"):]] for suffix in SCALE_SUFFIXES
                 if item.info.name.endswith(".weight") and item.info.name + suffix[len(".weight"):] in tensors), None)


def dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], scale_name: str) -> torch.Tensor:
    """FP8 [..., out, in] times its scale: scalar, per output channel [..., out, 1], or per block
    [..., ceil(out/b0), ceil(in/b1)] (the last blocks may be partial)."""
    import torch
    out, inp = w.shape[-2], w.shape[-1]
    lead = tuple(w.shape[:-2])
    wf = w.to(torch.float32)
    s = scale.to(device=wf.device, dtype=torch.float32)
    if s.numel() == 1:
        return wf * s.reshape(())
    if tuple(s.shape) in (lead + (out, 1), lead + (out,)):
        return wf * s.reshape(lead + (out, 1))
    b0, b1 = block
    blocks = lead + (math.ceil(out / b0), math.ceil(inp / b1))
    if tuple(s.shape) == blocks:
        full = s.repeat_interleave(b0, dim=-2)[..., :out, :].repeat_interleave(b1, dim=-1)[..., :inp]
        return wf * full
    raise LoaderError(f"scale tensor {scale_name!r} has shape {list(s.shape)}, which fits neither a per-tensor, "
                      f"per-channel {list(lead + (out, 1))} nor a {b0}x{b1} block {list(blocks)} scale for "
                      f"its weight of shape {list(w.shape)}")


def _scale_block(item: TensorToLoad, block: tuple[int, int]) -> tuple[int, int] | None:
    """The scale block of an FP8 tensor in Fp8Weight's terms (per-tensor and per-channel scales are blocks of one
    row by all columns), or None when the GEMM cannot read it (then the tensor is dequantized)."""
    from tinyserve.kernels.fp8_weight import scale_block_ok
    if item.scale is None or item.info.dtype != "F8_E4M3" or len(item.info.shape) != 2:
        return None
    out, inp = item.info.shape
    shape = tuple(item.scale.shape)
    if math.prod(shape) == 1 or shape in ((out, 1), (out,)):
        found = (1, inp)
    elif shape == (math.ceil(out / block[0]), math.ceil(inp / block[1])):
        found = block
    else:
        return None
    return found if scale_block_ok(found, inp) else None


def scales_in_blocks(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """A checkpoint scale as Fp8Weight.scale rows for a weight of `shape`: [ceil(out/b0), ceil(in/b1)]."""
    out = shape[0]
    if block[0] == 1:                                   # per-tensor or per-channel: one scale per row
        return scale.reshape(-1, 1).expand(out, 1) if scale.numel() == 1 else scale.reshape(out, 1)
    return scale


def fp8_placement(cfg: ModelConfig, items: list[TensorToLoad], scheme: Fp8Scheme
                  ) -> tuple[dict[str, tuple[int, int]], dict[str, str]]:
    """Which linear weights stay FP8: (parameter name -> scale block, canonical tensor name -> its parameter).

    A parameter stays FP8 when every checkpoint tensor that fills it is float8_e4m3fn with the same readable scale
    block and starts on a block row (fused q|k|v, gate|up, qkv|z parts of 128 rows each do; Qwen3.5's 48-row
    in_proj_b | in_proj_a do not, and are small). A MoE layer's stacked experts [E, 2I, H] / [E, H, I] are one
    parameter filled by every expert's gate_proj / up_proj (rows 0 and I of its expert: I a multiple of the block
    rows) or down_proj. Reordered weights (Qwen3-Next's interleaved GDN projections) are dequantized; experts a
    checkpoint ships stacked (experts.gate_up_proj / down_proj, bf16 in the releases) are not FP8. The model is
    laid out on "meta" to learn its parameters' parts, so the placement follows from the headers alone
    (read_checkpoint counts what load_model holds)."""
    import dataclasses

    import torch

    from tinyserve.models.qwen3_next import Qwen3NextForCausalLM
    from tinyserve.models.weights import TextWeights
    by_name = {it.canonical: it for it in items}
    probe = Qwen3NextForCausalLM(dataclasses.replace(cfg, vision_config=None), torch.bfloat16, "meta")
    blocks: dict[str, tuple[int, int]] = {}
    kept: dict[str, str] = {}
    for param, parts in TextWeights(probe).linear_parts().items():
        found = {_scale_block(by_name[c], scheme.block) if c in by_name else None for c, _, _ in parts}
        if len(found) != 1 or None in found:
            continue
        block = found.pop()
        if all(start % block[0] == 0 for _, start, _ in parts):
            blocks[param] = block
            kept.update((c, param) for c, _, _ in parts)
    return blocks, kept

