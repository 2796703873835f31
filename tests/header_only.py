"""A Qwen3.5-27B-shaped checkpoint folder of safetensors headers alone (no tensor data), bf16 or block FP8: what the
memory plan, `tinyserve --check` and the GPU benchmark read at real scale at no disk cost. Apart from
checkpoints.py (which re-exports it) because it needs no transformers: bench/gpu.py imports it on a GPU machine
whose transformers may be another version."""
from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import torch

from tinyserve.model_config import parse_config
from tinyserve.models.qwen3_next import Qwen3NextForCausalLM
from tinyserve.models.weights import TextWeights

QWEN3_5_27B = {   # text_config of Qwen3.5-27B (its config.json)
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "num_hidden_layers": 64,
    "full_attention_interval": 4, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "intermediate_size": 17408, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1, "tie_word_embeddings": False,
    "eos_token_id": 248044, "dtype": "bfloat16"}


def make_header_only(path: str | Path, config: dict, dtype_tag: str = "BF16",
                     fp8_block: tuple[int, int] | None = None, gptq_group: int | None = None) -> Path:
    """A checkpoint folder whose safetensors file holds the header alone (names, dtypes, shapes, offsets) and no
    tensor data: the shape of a real release for planning (`tinyserve --check`) at no disk cost. fp8_block: a
    block-FP8 release (`quant_method: fp8`) quantized as Qwen's are: every linear weight but lm_head, the GDN
    in_proj_a / in_proj_b and mtp.fc is F8_E4M3 with float32 `weight_scale_inv` blocks. gptq_group: a GPTQ W4A16
    release in groups of that size (symmetric, no act-order, as Qwen's GPTQ-Int4 are): every linear weight but
    lm_head, the GDN in_proj_a / in_proj_b and the MTP head (bf16) is qweight / qzeros / scales / g_idx."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    if gptq_group:
        config = {**config, "quantization_config": {
            "quant_method": "gptq", "bits": 4, "group_size": gptq_group, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq"}}
    if fp8_block:
        config = {**config, "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block),
            "modules_to_not_convert": ["lm_head", "re:.*linear_attn\\.in_proj_[ab]$", "mtp.fc"]}}
    (folder / "config.json").write_text(json.dumps(config))
    mtp = ["mtp.layers.0.x"] if config.get("mtp_num_hidden_layers") else []
    cfg = parse_config(folder, config, mtp)
    expected = TextWeights(Qwen3NextForCausalLM(cfg, torch.bfloat16, torch.device("meta"))).expected()
    size = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4, "F16": 2}
    header, offset = {}, 0

    def put(name: str, tag: str, shape) -> None:
        nonlocal offset
        n = size[tag] * int(torch.Size(shape).numel())
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    for name, shape in expected.items():
        stored = name if name.startswith(("mtp.", "lm_head.")) else "model." + name
        if gptq_group and len(shape) == 2 and name.endswith(".weight") and "embed_tokens" not in name and \
                not name.startswith("mtp.") and not re.match(r"(lm_head|.*in_proj_[ab])\.weight$", name):
            (n, k), module = shape, stored[: -len(".weight")]
            put(module + ".qweight", "I32", (k // 8, n))
            put(module + ".qzeros", "I32", (k // gptq_group, n // 8))
            put(module + ".scales", "F16", (k // gptq_group, n))
            put(module + ".g_idx", "I32", (k,))
        elif fp8_block and len(shape) == 2 and name.endswith(".weight") and "embed_tokens" not in name and \
                not re.match(r"(lm_head|mtp\.fc|.*in_proj_[ab])\.weight$", name):
            put(stored, "F8_E4M3", shape)
            put(stored + "_scale_inv", "F32", (math.ceil(shape[0] / fp8_block[0]), math.ceil(shape[1] / fp8_block[1])))
        else:
            put(stored, dtype_tag, shape)
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return folder
