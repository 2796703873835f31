"""A checkpoint folder read without its tensor data: config.json -> ModelConfig, and the tensors its safetensors
headers list (names, dtypes, shapes, files).

The memory plan and `tinyserve --check` read no more than this; loader.py streams the tensor data. Every problem
with the folder is raised as LoaderError with a message naming the file, key or tensor at fault.
"""
from __future__ import annotations

import json
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinyserve.models.config import ModelConfig

log = logging.getLogger("tinyserve.loader")     # one logger for reading and loading a checkpoint

SUPPORTED_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# model_type of the text model that ModelConfig.model_type records
_TEXT_MODEL_TYPE = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5_text", "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5_moe_text": "qwen3_5_moe_text",
}
_MAX_HEADER_BYTES = 100 << 20     # safetensors itself refuses larger headers


class LoaderError(ValueError):
    """The checkpoint folder cannot be loaded; the message names the file, config key or tensor at fault."""


@dataclass
class CheckpointFolder:
    """What a checkpoint folder holds, read from config.json and the safetensors headers (no tensor data)."""

    path: Path
    raw: dict[str, Any]                 # config.json as written
    files: list[Path]                   # the safetensors files
    tensors: dict[str, TensorInfo]      # every tensor in their headers, by checkpoint name
    config: ModelConfig
    quantization: dict[str, Any] | None = None   # the quantization config (read_quantization), None: not quantized


def read_folder(folder: str | Path, vision: bool = True) -> CheckpointFolder:
    """config.json and the safetensors headers of a checkpoint folder. vision=False leaves the vision tower out of
    the ModelConfig (model.vision = false) even when the checkpoint has one."""
    path = _check_folder(folder)
    raw = _raw_config(path)
    files = _weight_files(path)
    tensors = _scan_tensors(files)
    return CheckpointFolder(path, raw, files, tensors, parse_config(path, raw, list(tensors), vision),
                            read_quantization(path, raw))


def read_quantization(folder: Path, raw: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's quantization config: config.json's quantization_config (top level or text_config), else
    ModelOpt's hf_quant_config.json, whose "quantization" object is returned with quant_method "modelopt" (as newer
    ModelOpt exports write it into config.json). None: the weights are not quantized."""
    qc = raw.get("quantization_config") or text_section(raw).get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise LoaderError(f"config.json: quantization_config must be an object, found {qc!r}")
        return qc
    modelopt = folder / "hf_quant_config.json"
    if not modelopt.is_file():
        return None
    quantization = _read_json(modelopt, "ModelOpt config").get("quantization")
    if not isinstance(quantization, dict):
        raise LoaderError(f"{modelopt}: \"quantization\" must be an object, found {quantization!r}")
    return {"quant_method": "modelopt", **quantization}


def read_model_config(folder: str | Path) -> ModelConfig:
    """The text model's ModelConfig for a checkpoint folder (num_mtp_layers counts only MTP layers that the
    checkpoint actually stores)."""
    path = _check_folder(folder)
    raw = _raw_config(path)
    try:
        names = list(_scan_tensors(_weight_files(path)))
    except LoaderError:
        names = []  # a config-only folder still has a config; load_model reports the missing weights
    return parse_config(path, raw, names)


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


def text_section(raw: dict[str, Any]) -> dict[str, Any]:
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
    if vision is None or not any(is_vision_tensor(n) for n in tensor_names):
        return None, ids
    if not isinstance(vision, dict):
        raise LoaderError(f"config.json: vision_config must be an object, found {type(vision).__name__}")
    for k, v in ids.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise LoaderError(f"config.json: {k} must be an int for image input, found {v!r}")
    return vision, ids


def parse_config(folder: Path, raw: dict[str, Any], tensor_names: list[str], vision: bool = True) -> ModelConfig:
    """vision=False leaves the vision tower out (model.vision = false) even when the checkpoint has one."""
    text = text_section(raw)
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
# safetensors headers


@dataclass
class TensorInfo:
    """One tensor as a safetensors header lists it."""

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
        gguf = sorted(f.name for f in folder.glob("*.gguf"))
        if gguf:
            raise LoaderError(f"model folder {folder} holds GGUF files ({', '.join(gguf[:3])}): GGUF is not "
                              f"supported; use a safetensors checkpoint (bf16, FP8, GPTQ, AWQ, compressed-tensors "
                              f"or NVFP4)")
        raise LoaderError(f"model folder {folder} has no .safetensors weight files")
    return files


def _scan_tensors(files: list[Path]) -> dict[str, TensorInfo]:
    """Names, dtypes and shapes from the safetensors headers: an 8-byte little-endian length, then that much JSON.
    Parsed here rather than with safe_open so that a folder of headers alone (no tensor data) can be planned."""
    infos: dict[str, TensorInfo] = {}
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
                infos[name] = TensorInfo(name, f, meta["dtype"], tuple(meta["shape"]))
        except LoaderError:
            raise
        except Exception as e:  # short file, bad JSON, missing keys: all one thing to the user
            raise LoaderError(f"cannot read safetensors file {f}: {e}") from e
    return infos


# ---------------------------------------------------------------------------------------------------------------
# names


_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")


def is_vision_tensor(name: str) -> bool:
    return name.startswith(_VISION_PREFIXES)


def canonical_name(name: str) -> str:
    """Checkpoint name -> the model's canonical name (`visual.*` for the vision tower; the loader skips those
    when the tower is off)."""
    for prefix in _VISION_PREFIXES:
        if name.startswith(prefix):
            return "visual." + name[len(prefix):]
    for prefix in ("model.language_model.", "language_model.model.", "language_model."):
        if name.startswith(prefix):
            return name[len(prefix):]
    if name.startswith("model."):
        return name[len("model."):]
    return name  # lm_head.weight, mtp.*, or something unexpected (reported by the completeness check)


@dataclass
class TensorToLoad:
    """A checkpoint tensor the model loads: its canonical name, where it is stored, and its FP8 scale if any; or a
    4-bit weight (w4: a four_bit.QuantizedModule, its tensors; info is then its packed codes)."""

    canonical: str
    info: TensorInfo
    scale: TensorInfo | None = None
    w4: Any = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape in the model (a 4-bit weight's [N, K], not its packed tensor's)."""
        return tuple(self.w4.shape) if self.w4 is not None else tuple(self.info.shape)
