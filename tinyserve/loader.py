"""Read a Qwen3-Next / Qwen3.5 checkpoint folder: config.json -> ModelConfig, safetensors -> model weights.

Weights are streamed one tensor at a time (safe_open + model.load_tensor), so peak memory stays near the model
size. FP8 checkpoints (Qwen block FP8 and compressed-tensors float-quantized) are dequantized tensor by tensor.
Every problem with the folder is raised as LoaderError with a message naming the file, key or tensor at fault.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from tinyserve.models.config import ModelConfig

log = logging.getLogger("tinyserve.loader")

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# model_type of the text model that ModelConfig.model_type records
_TEXT_MODEL_TYPE = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5_text", "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5_moe_text": "qwen3_5_moe_text",
}
_FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}   # safetensors dtype tags
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")
_LARGE_CHECKPOINT_BYTES = 2 << 30      # progress bar even without a tty above this size
_MAX_LISTED = 10                       # names listed in one error message


class LoaderError(ValueError):
    """The checkpoint folder cannot be loaded; the message names the file, config key or tensor at fault."""


# ---------------------------------------------------------------------------------------------------------------
# config.json


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LoaderError(f"{what} {path} is not valid JSON: {e}") from e
    except OSError as e:
        raise LoaderError(f"cannot read {what} {path}: {e}") from e
    if not isinstance(data, dict):
        raise LoaderError(f"{what} {path} must hold a JSON object, found {type(data).__name__}")
    return data


_MAX_HEADER_BYTES = 100 << 20     # safetensors itself refuses larger headers


def _check_folder(folder: str | Path) -> Path:
    path = Path(folder).expanduser()
    if not path.exists():
        raise LoaderError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise LoaderError(f"model path {path} is not a folder")
    return path


def _raw_config(folder: Path) -> dict[str, Any]:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise LoaderError(f"model folder {folder} has no config.json")
    raw = _read_json(cfg_path, "config")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise LoaderError(f"{cfg_path}: unsupported model_type {model_type!r}; "
                          f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return raw


def _text_section(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's settings: `text_config` for the multimodal Qwen3.5 configs, the whole file otherwise."""
    text = raw.get("text_config")
    if text is None:
        return raw
    if not isinstance(text, dict):
        raise LoaderError(f"config.json: text_config must be an object, found {type(text).__name__}")
    return text


def _id_list(value: Any, key: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        raise LoaderError(f"config.json: {key} must be an int or a list of ints, found {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise LoaderError(f"config.json: {key} must be an int or a list of ints, found {value!r}")


class _Keys:
    """Typed look-ups in the text config, falling back to the top level; errors name the key."""

    def __init__(self, text: dict[str, Any], top: dict[str, Any]) -> None:
        self.text, self.top = text, top

    def get(self, key: str, default: Any = None) -> Any:
        if self.text.get(key) is not None:
            return self.text[key]
        if self.top.get(key) is not None:
            return self.top[key]
        return default

    def require_int(self, key: str) -> int:
        v = self.get(key)
        if v is None:
            raise LoaderError(f"config.json: required key {key!r} is missing")
        return self._int(key, v)

    def int(self, key: str, default: int) -> int:
        return self._int(key, self.get(key, default))

    def float(self, key: str, default: float) -> float:
        v = self.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise LoaderError(f"config.json: {key} must be a number, found {v!r}")
        return float(v)

    @staticmethod
    def _int(key: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise LoaderError(f"config.json: {key} must be an integer, found {v!r}")
        return v


def _layer_types(keys: _Keys, n_layers: int) -> list[str]:
    types = keys.get("layer_types")
    if types is None:
        # Legacy key of the released Qwen3-Next config: every interval-th layer is full attention.
        interval = keys.int("full_attention_interval", 4)
        if interval <= 0:
            raise LoaderError(f"config.json: full_attention_interval must be positive, found {interval}")
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers:
        raise LoaderError(f"config.json: layer_types must be a list of num_hidden_layers={n_layers} entries, "
                          f"found {types!r}")
    bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if bad:
        raise LoaderError(f"config.json: layer_types has unsupported entries {bad}; "
                          f"expected 'linear_attention' or 'full_attention'")
    return list(types)


def _rope(keys: _Keys) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from rope_parameters / rope_scaling / top-level keys."""
    theta: float | None = None
    factor: float | None = None
    for key in ("rope_parameters", "rope_scaling"):
        params = keys.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise LoaderError(f"config.json: {key} must be an object or null, found {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        # M-RoPE for text tokens is plain 1-D RoPE (qwen-hybrid.md §1.2); anything that rescales frequencies is not.
        if rope_type not in ("default", "mrope", None):
            raise LoaderError(f"config.json: {key}.rope_type {rope_type!r} is not supported (only default RoPE)")
        if theta is None and params.get("rope_theta") is not None:
            theta = float(params["rope_theta"])
        if factor is None and params.get("partial_rotary_factor") is not None:
            factor = float(params["partial_rotary_factor"])
    if theta is None:
        theta = keys.float("rope_theta", 10000.0)  # transformers' default when the key is absent
    if factor is None:
        factor = keys.float("partial_rotary_factor", 0.25)
    return theta, factor


def _declared_mtp_layers(keys: _Keys) -> int | None:
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if keys.get(key) is not None:
            return keys.int(key, 0)
    return None


def _count_mtp_layers(names: list[str]) -> int:
    ids = {int(m.group(1)) for n in names if (m := re.match(r"mtp\.layers\.(\d+)\.", n))}
    return max(ids) + 1 if ids else 0


def _mrope(keys: _Keys) -> tuple[list[int], bool]:
    """(mrope_section, mrope_interleaved) from rope_parameters / rope_scaling; ([], False) when absent."""
    for key in ("rope_parameters", "rope_scaling"):
        params = keys.get(key)
        if isinstance(params, dict) and params.get("mrope_section") is not None:
            section = params["mrope_section"]
            if not isinstance(section, list) or len(section) != 3 or \
                    not all(isinstance(v, int) and v >= 0 for v in section):
                raise LoaderError(f"config.json: {key}.mrope_section must be three ints (t, h, w), found {section!r}")
            return list(section), bool(params.get("mrope_interleaved", False))
    return [], False


def _vision(raw: dict[str, Any], tensor_names: list[str]) -> tuple[dict | None, dict[str, int | None]]:
    """The vision_config and the image token ids, when the checkpoint has a vision tower to load."""
    ids = {k: raw.get(k) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")}
    vision = raw.get("vision_config")
    if vision is None or not any(_is_vision(n) for n in tensor_names):
        return None, ids
    if not isinstance(vision, dict):
        raise LoaderError(f"config.json: vision_config must be an object, found {type(vision).__name__}")
    for k, v in ids.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise LoaderError(f"config.json: {k} must be an int for image input, found {v!r}")
    return vision, ids


def _build_config(folder: Path, raw: dict[str, Any], tensor_names: list[str], vision: bool = True) -> ModelConfig:
    """vision=False leaves the vision tower out (model.vision = false) even when the checkpoint has one."""
    text = _text_section(raw)
    keys = _Keys(text, raw)
    model_type = _TEXT_MODEL_TYPE[raw["model_type"]]
    n_layers = keys.require_int("num_hidden_layers")
    hidden = keys.require_int("hidden_size")
    heads = keys.require_int("num_attention_heads")
    head_dim = keys.int("head_dim", hidden // heads)
    theta, factor = _rope(keys)
    mrope_section, mrope_interleaved = _mrope(keys)
    if model_type.startswith("qwen3_5"):   # transformers' Qwen3.5 rotary always interleaves, [11, 11, 10] if unset
        mrope_section, mrope_interleaved = mrope_section or [11, 11, 10], True
    vision_config, vision_ids = _vision(raw, tensor_names) if vision else (None, {})

    act = keys.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise LoaderError(f"config.json: hidden_act {act!r} is not supported (only silu)")
    if keys.get("attention_bias", False):
        raise LoaderError("config.json: attention_bias=true is not supported (these models have no biases)")

    mtp_names = [n for n in tensor_names if n.startswith("mtp.")]
    declared = _declared_mtp_layers(keys)
    if mtp_names:
        num_mtp = declared if declared is not None else _count_mtp_layers(mtp_names)
        if num_mtp == 0:
            log.info("%s: config.json sets 0 MTP layers; ignoring the checkpoint's %d mtp.* tensors",
                     folder, len(mtp_names))
    else:
        num_mtp = 0
        if declared:
            log.info("%s: config.json declares %d MTP layer(s) but the checkpoint has no mtp.* tensors; "
                     "MTP speculative decoding is unavailable", folder, declared)

    mlp_only = keys.get("mlp_only_layers", []) or []
    if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
        raise LoaderError(f"config.json: mlp_only_layers must be a list of layer indices, found {mlp_only!r}")

    eos = _id_list(text.get("eos_token_id"), "text_config.eos_token_id" if text is not raw else "eos_token_id")
    if not eos:
        eos = _id_list(raw.get("eos_token_id"), "eos_token_id")
    bos = keys.get("bos_token_id")
    dtype = keys.get("dtype") or keys.get("torch_dtype") or "float32"

    return ModelConfig(
        model_type=model_type,
        vocab_size=keys.require_int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=_layer_types(keys, n_layers),
        num_attention_heads=heads,
        num_key_value_heads=keys.int("num_key_value_heads", heads),
        head_dim=head_dim,
        partial_rotary_factor=factor,
        rope_theta=theta,
        rms_norm_eps=keys.float("rms_norm_eps", 1e-6),
        max_position_embeddings=keys.int("max_position_embeddings", 32768),
        # transformers' defaults for the GDN sizes (all released configs set them)
        linear_num_key_heads=keys.int("linear_num_key_heads", 16),
        linear_num_value_heads=keys.int("linear_num_value_heads", 32),
        linear_key_head_dim=keys.int("linear_key_head_dim", 128),
        linear_value_head_dim=keys.int("linear_value_head_dim", 128),
        linear_conv_kernel_dim=keys.int("linear_conv_kernel_dim", 4),
        intermediate_size=keys.int("intermediate_size", 0),
        num_experts=keys.int("num_experts", 0),
        num_experts_per_tok=keys.int("num_experts_per_tok", 0),
        moe_intermediate_size=keys.int("moe_intermediate_size", 0),
        shared_expert_intermediate_size=keys.int("shared_expert_intermediate_size", 0),
        norm_topk_prob=bool(keys.get("norm_topk_prob", True)),
        decoder_sparse_step=keys.int("decoder_sparse_step", 1),
        mlp_only_layers=list(mlp_only),
        tie_word_embeddings=bool(keys.get("tie_word_embeddings", False)),
        interleaved_gdn_proj=(raw["model_type"] == "qwen3_next"),
        num_mtp_layers=num_mtp,
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
        torch_dtype=str(dtype),
        folder=str(folder),
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        vision_config=vision_config,
        image_token_id=vision_ids.get("image_token_id") if vision_config else None,
        vision_start_token_id=vision_ids.get("vision_start_token_id") if vision_config else None,
        vision_end_token_id=vision_ids.get("vision_end_token_id") if vision_config else None,
    )


# ---------------------------------------------------------------------------------------------------------------
# safetensors files


@dataclass
class _TensorInfo:
    name: str          # checkpoint name
    file: Path
    dtype: str         # safetensors dtype tag, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoaderError(f"{index} has no weight_map")
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise LoaderError(f"{index} lists shard files that are not in the folder: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoaderError(f"model folder {folder} has no .safetensors weight files")
    return files


def _scan_tensors(files: list[Path]) -> dict[str, _TensorInfo]:
    """Names, dtypes and shapes from the safetensors headers: an 8-byte little-endian length, then that much JSON.
    Parsed here rather than with safe_open so that a folder of headers alone (no tensor data) can be planned."""
    infos: dict[str, _TensorInfo] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                (length,) = struct.unpack("<Q", fh.read(8))
                if length > _MAX_HEADER_BYTES:
                    raise ValueError(f"header length {length} is implausible")
                header = json.loads(fh.read(length))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if name in infos:
                    raise LoaderError(f"tensor {name!r} is stored twice: in {infos[name].file.name} "
                                      f"and {f.name}")
                infos[name] = _TensorInfo(name, f, meta["dtype"], tuple(meta["shape"]))
        except LoaderError:
            raise
        except Exception as e:  # short file, bad JSON, missing keys: all one thing to the user
            raise LoaderError(f"cannot read safetensors file {f}: {e}") from e
    return infos


def read_model_config(folder: str | Path) -> ModelConfig:
    """The text model's ModelConfig for a checkpoint folder (num_mtp_layers counts only MTP layers that the
    checkpoint actually stores)."""
    path = _check_folder(folder)
    raw = _raw_config(path)
    try:
        names = list(_scan_tensors(_weight_files(path)))
    except LoaderError:
        names = []  # a config-only folder still has a config; load_model reports the missing weights
    return _build_config(path, raw, names)


# ---------------------------------------------------------------------------------------------------------------
# names


_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")


def _is_vision(name: str) -> bool:
    return name.startswith(_VISION_PREFIXES)


def _canonical(name: str) -> str:
    """Checkpoint name -> the model's canonical name (`visual.*` for the vision tower; _loadable skips those when
    the tower is off)."""
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return "visual." + name[len(prefix):]
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name.startswith("model."):
        return name[len("model."):]
    return name  # lm_head.weight, mtp.*, or something unexpected (reported by the completeness check)


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


# ---------------------------------------------------------------------------------------------------------------
# FP8


@dataclass
class _QuantScheme:
    """What the checkpoint's quantization_config says about FP8 weights."""

    method: str | None = None                       # "fp8" | "compressed-tensors" | None
    block: tuple[int, int] = (128, 128)             # block size for block scales
    ignore_exact: set[str] = field(default_factory=set)
    ignore_regex: list[re.Pattern[str]] = field(default_factory=list)

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> "_QuantScheme":
        qc = raw.get("quantization_config") or _text_section(raw).get("quantization_config")
        if not qc:
            return cls()
        if not isinstance(qc, dict):
            raise LoaderError(f"config.json: quantization_config must be an object, found {qc!r}")
        method = qc.get("quant_method")
        scheme = cls(method=method)
        if method == "fp8":
            if qc.get("weight_block_size") is not None:
                scheme.block = cls._block(qc["weight_block_size"], "quantization_config.weight_block_size")
            ignore = qc.get("modules_to_not_convert") or []
        elif method == "compressed-tensors":
            fmt = qc.get("format")
            if fmt not in ("float-quantized", "naive-quantized", None):
                raise LoaderError(f"config.json: compressed-tensors format {fmt!r} is not supported "
                                  f"(only float-quantized FP8)")
            for gname, group in (qc.get("config_groups") or {}).items():
                w = (group or {}).get("weights") or {}
                if w.get("type", "float") != "float" or w.get("num_bits", 8) != 8:
                    raise LoaderError(f"config.json: quantization_config.config_groups.{gname}.weights is not "
                                      f"8-bit float ({w.get('num_bits')} bits, type {w.get('type')!r}); "
                                      f"only FP8 is supported")
                if w.get("strategy") == "block" and w.get("block_structure") is not None:
                    scheme.block = cls._block(w["block_structure"],
                                              f"quantization_config.config_groups.{gname}.weights.block_structure")
            ignore = qc.get("ignore") or []
        else:
            raise LoaderError(f"config.json: quantization_config.quant_method {method!r} is not supported "
                              f"(supported: 'fp8', 'compressed-tensors')")
        for item in ignore:
            if not isinstance(item, str):
                raise LoaderError(f"config.json: quantization ignore list entry {item!r} is not a string")
            if item.startswith("re:"):
                try:
                    scheme.ignore_regex.append(re.compile(item[3:]))
                except re.error as e:
                    raise LoaderError(f"config.json: bad regex in quantization ignore list {item!r}: {e}") from e
            else:
                scheme.ignore_exact.add(item)
        return scheme

    @staticmethod
    def _block(value: Any, key: str) -> tuple[int, int]:
        if (not isinstance(value, list) or len(value) != 2
                or not all(isinstance(v, int) and v > 0 for v in value)):
            raise LoaderError(f"config.json: {key} must be two positive ints, found {value!r}")
        return value[0], value[1]

    def is_ignored(self, module: str) -> bool:
        """Module listed as not quantized; matched against its checkpoint and canonical names."""
        canon = _canonical(module + ".weight")[: -len(".weight")]
        variants = {module, canon, "model." + canon, "model.language_model." + canon}
        if variants & self.ignore_exact:
            return True
        return any(rx.match(v) for rx in self.ignore_regex for v in variants)


def _dequantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], scale_name: str) -> torch.Tensor:
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


def _scale_block(item: "_Item", block: tuple[int, int]) -> tuple[int, int] | None:
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


def _scale_in_blocks(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """A checkpoint scale as Fp8Weight.scale rows for a weight of `shape`: [ceil(out/b0), ceil(in/b1)]."""
    out = shape[0]
    if block[0] == 1:                                   # per-tensor or per-channel: one scale per row
        return scale.reshape(-1, 1).expand(out, 1) if scale.numel() == 1 else scale.reshape(out, 1)
    return scale


def _fp8_placement(cfg: ModelConfig, items: list["_Item"], scheme: _QuantScheme
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
    by_name = {it.canonical: it for it in items}
    probe = Qwen3NextForCausalLM(dataclasses.replace(cfg, vision_config=None), torch.bfloat16, "meta")
    blocks: dict[str, tuple[int, int]] = {}
    kept: dict[str, str] = {}
    for param, parts in probe.linear_parts().items():
        found = {_scale_block(by_name[c], scheme.block) if c in by_name else None for c, _, _ in parts}
        if len(found) != 1 or None in found:
            continue
        block = found.pop()
        if all(start % block[0] == 0 for _, start, _ in parts):
            blocks[param] = block
            kept.update((c, param) for c, _, _ in parts)
    return blocks, kept


# ---------------------------------------------------------------------------------------------------------------
# load


@dataclass
class _Item:
    """One tensor to load: canonical name, its checkpoint tensor, and the FP8 scale if any."""

    canonical: str
    info: _TensorInfo
    scale: _TensorInfo | None = None


def _scale_info(item: _Item, infos: dict[str, _TensorInfo]) -> _TensorInfo | None:
    """The scale tensor stored beside an FP8 weight (name + "_scale_inv" or "_scale"), if any."""
    return next((infos[item.info.name + suffix[len(".weight"):]] for suffix in _SCALE_SUFFIXES
                 if item.info.name.endswith(".weight") and item.info.name + suffix[len(".weight"):] in infos), None)


def _loadable(cfg: ModelConfig, infos: dict[str, _TensorInfo]) -> list[_Item]:
    """The checkpoint tensors the text model loads (without their FP8 scales)."""
    items = []
    for name, info in infos.items():
        if name.endswith(_SCALE_SUFFIXES) or name.endswith(".input_scale"):
            continue  # scales travel with their weight; activation scales are unused (dequantized GEMMs)
        canon = _canonical(name)
        if canon.startswith("visual.") and cfg.vision_config is None:
            continue  # vision tensors without a tower to load them into (model.vision = false, or no config)
        if canon == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the head is the embedding
        if canon.startswith("mtp.") and _mtp_layer_dropped(canon, cfg.num_mtp_layers):
            continue
        if canon.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some older exports include
        items.append(_Item(canon, info))
    return items


@dataclass(frozen=True)
class WeightCount:
    """The weight values a model will hold and how they are stored, from the safetensors headers alone."""

    values: int              # every weight value (the vision tower's too, unless model.vision = false)
    fp8_values: int = 0      # of those, the values kept as FP8 (1 byte each) ...
    fp8_scales: int = 0      # ... and their block scales (fp32, not in `values`)

    def bytes(self, element_size: int) -> int:
        """Bytes on the device when the other weights are held in a dtype of `element_size` bytes."""
        return (self.values - self.fp8_values) * element_size + self.fp8_values + 4 * self.fp8_scales


def read_checkpoint(folder: str | Path, vision: bool = True, keep_fp8: bool = False) -> tuple[ModelConfig,
                                                                                                WeightCount]:
    """The ModelConfig and the weights the model will hold (the vision tower's too, unless vision=False), from
    config.json and the safetensors headers alone (no tensor data is read): what the memory plan needs before any
    weight is loaded. keep_fp8: count FP8 weights as load_model(fp8_weights=...) keeps them (this imports torch to
    lay the model out on "meta"; a plan that dequantizes needs no torch)."""
    path = _check_folder(folder)
    raw = _raw_config(path)
    infos = _scan_tensors(_weight_files(path))
    cfg = _build_config(path, raw, list(infos), vision)
    items = _loadable(cfg, infos)
    cfg.vision_parameters = sum(math.prod(it.info.shape) for it in items if it.canonical.startswith("visual."))
    values = sum(math.prod(it.info.shape) for it in items)
    scheme = _QuantScheme.from_config(raw)
    if not keep_fp8 or not scheme.method:        # the same condition as load_model's
        return cfg, WeightCount(values)
    for item in items:
        item.scale = _scale_info(item, infos)
    blocks, kept = _fp8_placement(cfg, items, scheme)
    cfg.fp8_blocks = blocks
    fp8_values = sum(math.prod(it.info.shape) for it in items if it.canonical in kept)
    scales = sum(math.ceil(it.info.shape[0] / blocks[kept[it.canonical]][0])
                 * math.ceil(it.info.shape[1] / blocks[kept[it.canonical]][1]) for it in items if it.canonical in kept)
    return cfg, WeightCount(values, fp8_values, scales)


def _plan(folder: Path, cfg: ModelConfig, infos: dict[str, _TensorInfo], scheme: _QuantScheme,
          expected: dict[str, tuple[int, ...]]) -> list[_Item]:
    """Match the checkpoint's tensors to the model's expected tensors; raise on anything inconsistent."""
    scales = {n: i for n, i in infos.items() if n.endswith(_SCALE_SUFFIXES)}
    skipped_vision = sum(1 for n in infos if _is_vision(n)) if cfg.vision_config is None else 0
    items = _loadable(cfg, infos)
    unexpected: list[str] = []
    if skipped_vision:
        log.info("skipping %d vision tensors (model.visual.*): no image input (model.vision = false or the "
                 "config has no vision_config)", skipped_vision)

    # FP8 pairing: every FP8 weight needs its scale, every scale its FP8 weight.
    by_name = {it.info.name: it for it in items}
    for sname, sinfo in scales.items():
        wname = sname[: sname.rindex(".weight_scale")] + ".weight"
        item = by_name.get(wname)
        if item is None:
            if _is_vision(sname) or wname in infos:
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
            if scheme.is_ignored(module):
                raise LoaderError(f"tensor {item.info.name!r} is stored as FP8 but its module is listed as not "
                                  f"quantized (modules_to_not_convert / ignore)")
            if item.scale is None:
                raise LoaderError(f"FP8 tensor {item.info.name!r} has no scale tensor "
                                  f"({item.info.name}_scale_inv or {item.info.name}_scale)")

    # Completeness and shapes, against the model's own list.
    provided: set[str] = set()
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


def _progress(total: int, size_bytes: int):
    from tqdm import tqdm

    show = sys.stderr.isatty() or size_bytes >= _LARGE_CHECKPOINT_BYTES
    return tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show, leave=False)


FP8_WEIGHTS = ("dequantize", "w8a8", "w8a16")     # load_model(fp8_weights=...): see kernels/fp8.py


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu", vision: bool = True,
               fp8_weights: str = "dequantize"):
    """Build the model described by `folder`/config.json and stream the checkpoint's weights into it (with its
    vision tower when it has one, unless vision=False). An FP8 checkpoint's linear weights are dequantized to
    `dtype`, or with fp8_weights "w8a8" / "w8a16" kept FP8 where _fp8_placement allows (kernels/fp8.py)."""
    # torch and the model are imported on use: reading configs and headers (the plan, --check) needs neither
    import torch
    from safetensors import safe_open

    from tinyserve.models.qwen3_next import Fp8Weights, Qwen3NextForCausalLM

    path = _check_folder(folder)
    raw = _raw_config(path)
    files = _weight_files(path)
    infos = _scan_tensors(files)
    cfg = _build_config(path, raw, list(infos), vision)
    scheme = _QuantScheme.from_config(raw)
    device = torch.device(device)

    assert fp8_weights in FP8_WEIGHTS, fp8_weights
    blocks: dict[str, tuple[int, int]] = {}
    kept: dict[str, str] = {}                      # canonical tensor -> the FP8 parameter it fills
    if fp8_weights != "dequantize" and scheme.method:
        check = Qwen3NextForCausalLM(cfg, dtype, "meta")       # names and shapes checked before any allocation
        planned = _plan(path, cfg, infos, scheme, check.expected_tensors())
        blocks, kept = _fp8_placement(cfg, planned, scheme)
    cfg.fp8_blocks = blocks
    fp8 = Fp8Weights(blocks, act_quant=fp8_weights == "w8a8") if blocks else None
    model = Qwen3NextForCausalLM(cfg, dtype, device, fp8)
    if model.visual is not None:
        cfg.vision_parameters = sum(p.numel() for p in model.visual.parameters())
    items = _plan(path, cfg, infos, scheme, model.expected_tensors())

    # Read file by file (sequential access into each mmap); scales may sit in another shard.
    items.sort(key=lambda it: (str(it.info.file), it.info.name))
    work_device = device if device.type != "cpu" else torch.device("cpu")  # dequantize where the model lives
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def handle(f: Path):
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            return handles[f]

        size = sum(f.stat().st_size for f in files)
        with _progress(len(items), size) as bar:
            for item in items:
                tensor = handle(item.info.file).get_tensor(item.info.name)
                scale = None
                if item.scale is not None:
                    scale = handle(item.scale.file).get_tensor(item.scale.name)
                    if item.canonical in kept:         # stays FP8: the scales in the weight's block layout
                        scale = _scale_in_blocks(scale, item.info.shape, blocks[kept[item.canonical]])
                    else:
                        tensor = _dequantize(tensor.to(work_device), scale, scheme.block, item.scale.name)
                        scale = None
                model.load_tensor(item.canonical, tensor, scale)
                del tensor  # one checkpoint tensor alive at a time
                bar.update(1)
    log.info("loaded %s: %d tensors, %s, dtype %s, device %s%s", path, len(items), cfg.model_type, dtype, device,
             f", {len(blocks)} linear weights kept FP8 ({fp8_weights})" if blocks else "")
    return model
