"""Independent packers and dequantizers for the 4-bit formats (the oracles of tests/test_four_bit.py), and tiny 4-bit
checkpoints written with them beside their dequantized fp32 twin.

None of this imports tinyserve's loader. compressed-tensors (its own compressors, pack_to_int32 / unpack_from_int32,
the FP4 pack and unpack, and its AutoAWQ converter) is the oracle for compressed-tensors, NVFP4 and AWQ; GPTQ and AWQ
are packed here with numpy from the published layouts (reference/four-bit.md), and tests/test_four_bit.py checks a
few of their words by hand.

Codes are quantized from real weights: per group of `group` input columns (under act-order the columns g_idx puts
in one group), symmetric (zero 8, scale amax / 7) or asymmetric (scale (max - min) / 15, zero round(-min / scale)).
The oracle's dequantized weight is W[n, k] = (q[n, k] - z[n, g_idx[k]]) * s[n, g_idx[k]] in float32, exact.
"""
from __future__ import annotations

import json
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

from checkpoints import read_tensors, update_config, write_tensors

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]      # nibble j of an AWQ word holds column 8w + AWQ_ORDER[j]


# ---------------------------------------------------------------------------------------------------------------
# int4 codes from a weight


def act_order_g_idx(K: int, group: int, seed: int) -> torch.Tensor:
    """A GPTQ desc_act group index: the columns in a random order, cut into groups of `group` (g_idx[perm[j]] =
    j // group), as GPTQ's Hessian order leaves them."""
    perm = torch.randperm(K, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[perm] = (torch.arange(K) // group).to(torch.int32)
    return g_idx


def int4_codes(w: torch.Tensor, group: int, symmetric: bool, scale_dtype: torch.dtype = torch.float16,
               g_idx: torch.Tensor | None = None):
    """(q uint8 [N, K], z uint8 [N, G], s [N, G] in scale_dtype, g_idx int32 [K]) for a float weight [N, K]."""
    w = w.float()
    N, K = w.shape
    G = K // group
    g_idx = (torch.arange(K) // group).to(torch.int32) if g_idx is None else g_idx
    cols = [torch.nonzero(g_idx == g).flatten() for g in range(G)]
    s = torch.empty(N, G)
    z = torch.empty(N, G)
    for g, c in enumerate(cols):
        part = w[:, c]
        if symmetric:
            s[:, g] = (part.abs().amax(1) / 7).clamp(min=1e-6)
            z[:, g] = 8
        else:
            lo, hi = part.amin(1).clamp(max=0), part.amax(1).clamp(min=0)
            s[:, g] = ((hi - lo) / 15).clamp(min=1e-6)
            z[:, g] = torch.round(-lo / s[:, g]).clamp(1, 15)       # >= 1: GPTQ v1 cannot store z = 0
    s = s.to(scale_dtype)
    sf, zf = s.float()[:, g_idx.long()], z[:, g_idx.long()]
    q = torch.clamp(torch.round(w / sf) + zf, 0, 15)
    return q.to(torch.uint8), z.to(torch.uint8), s, g_idx


def dequantize_int4(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The published formula, float32: W[n, k] = (q[n, k] - z[n, g_idx[k]]) * s[n, g_idx[k]]."""
    g = g_idx.long()
    return (q.float() - z.float()[:, g]) * s.float()[:, g]


# ---------------------------------------------------------------------------------------------------------------
# GPTQ and AWQ, packed with numpy from the layouts


def _pack_words(codes: np.ndarray, order: list[int] | None = None) -> np.ndarray:
    """uint8 [R, 8W] -> int32 [R, W]: nibble j of word w holds column 8w + order[j] (order: 0..7)."""
    order = order or list(range(8))
    R, C = codes.shape
    words = np.zeros((R, C // 8), dtype=np.uint32)
    for j, col in enumerate(order):
        words |= codes[:, col::8].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


def pack_gptq(q, z, s, g_idx, v1: bool) -> dict[str, torch.Tensor]:
    """GPTQ: qweight int32 [K/8, N] packed along K; qzeros int32 [K/g, N/8] packed along N, z - 1 in v1 (gptq) and z
    in v2 (gptq_v2); scales [K/g, N]; g_idx int32 [K]."""
    zeros = (z.numpy().astype(np.int64) - (1 if v1 else 0)) & 0xF
    return {"qweight": pack_gptq_qweight(q),
            "qzeros": torch.from_numpy(_pack_words(zeros.T.astype(np.uint8))),  # [G, N] packed along N
            "scales": s.T.contiguous(), "g_idx": g_idx.clone()}


def _pack_words_rows(codes: np.ndarray) -> np.ndarray:
    """uint8 [8R, C] -> int32 [R, C] packed along rows (GPTQ's qweight: element k at bits 4 * (k % 8))."""
    R = codes.shape[0] // 8
    words = np.zeros((R, codes.shape[1]), dtype=np.uint32)
    for j in range(8):
        words |= codes[j::8].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


def pack_gptq_qweight(q: torch.Tensor) -> torch.Tensor:
    """qweight of codes q [N, K]: [K/8, N], row r holding columns 8r .. 8r + 7 of each output."""
    return torch.from_numpy(_pack_words_rows(q.numpy().T.copy()))


def pack_awq(q, z, s) -> dict[str, torch.Tensor]:
    """AWQ GEMM: qweight int32 [K, N/8] and qzeros int32 [K/g, N/8], both packed along N in AWQ_ORDER; scales
    [K/g, N]."""
    return {"qweight": torch.from_numpy(_pack_words(q.numpy().T.copy(), AWQ_ORDER)),
            "qzeros": torch.from_numpy(_pack_words(z.numpy().T.copy(), AWQ_ORDER)),
            "scales": s.T.contiguous()}


def awq_oracle(t: dict[str, torch.Tensor], group: int, symmetric: bool = False) -> torch.Tensor:
    """compressed-tensors' AutoAWQ converter (its own unpack and order reversal), dequantized by compressed-tensors,
    in the scales' dtype."""
    conv = AutoAWQConverter(group_size=group, zero_point=not symmetric)
    weight, scale, zp = conv._convert_gemm_module(t["qweight"], t["scales"], None if symmetric else t["qzeros"])
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group)
    return ct_dequantize(weight, scale, zp, args)


# ---------------------------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized and NVFP4, by compressed-tensors itself


def ct_args(group: int, symmetric: bool) -> QuantizationScheme:
    strategy = "channel" if group == -1 else "group"
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=symmetric, strategy=strategy, group_size=None if group == -1 else group))


def pack_ct(q, z, s, g_idx, group: int, symmetric: bool, act_order: bool) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized tensors. Without act-order by its compressor (which quantizes the exactly
    dequantized weight back to q); with it (the old actorder "group", which compressed-tensors 0.20 no longer
    writes) by its pack_to_int32, beside weight_g_idx."""
    zp = (z.to(torch.int16) - 8).to(torch.int8)
    if act_order:
        out = {"weight_packed": pack_to_int32((q.to(torch.int16) - 8).to(torch.int8), 4),
               "weight_scale": s, "weight_shape": torch.tensor(list(q.shape)), "weight_g_idx": g_idx.clone()}
        if not symmetric:
            out["weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0)
        return out
    state = {"weight": dequantize_int4(q, z, s, g_idx), "weight_scale": s}
    if not symmetric:
        state["weight_zero_point"] = zp
    return dict(PackedQuantizationCompressor.compress(state, ct_args(group, symmetric)))


def ct_oracle(t: dict[str, torch.Tensor], group: int, symmetric: bool, scale_dtype=None) -> torch.Tensor:
    """compressed-tensors' own dequantization (its decompressor; under act-order its unpack_from_int32 and the
    g_idx formula), in the scales' dtype (or scale_dtype)."""
    scale = t["weight_scale"] if scale_dtype is None else t["weight_scale"].to(scale_dtype)
    if "weight_g_idx" in t:
        N, K = t["weight_shape"].tolist()
        q = unpack_from_int32(t["weight_packed"], 4, torch.Size([N, K])).float()
        g = t["weight_g_idx"].long()
        zp = 0.0 if symmetric else unpack_from_int32(t["weight_zero_point"], 4, torch.Size([N, scale.shape[1]]),
                                                     packed_dim=0).float()[:, g]
        return ((q - zp) * scale.float()[:, g]).to(scale.dtype)
    return PackedQuantizationCompressor.decompress({**t, "weight_scale": scale}, ct_args(group, symmetric))["weight"]


NVFP4_SCHEME = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
    num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16))


def nvfp4_quantize(w: torch.Tensor, power_of_two: bool = True) -> dict[str, torch.Tensor]:
    """compressed-tensors nvfp4-pack-quantized tensors of w (its compressor): weight_packed uint8 [N, K/2],
    weight_scale e4m3 [N, K/16], weight_global_scale [1] (448 * 6 / amax, rounded down to a power of two unless told
    otherwise, so that 1 / it is exact and W's float32 products are too)."""
    w = w.float()
    gs = 448 * 6 / w.abs().max().clamp(min=1e-6)
    if power_of_two:
        gs = 2.0 ** torch.floor(torch.log2(gs))
    gs = gs.reshape(1).to(torch.float32)
    N, K = w.shape
    scale = (w.abs().reshape(N, K // 16, 16).amax(-1) / 6 * gs).clamp(min=2 ** -9).to(torch.float8_e4m3fn)
    state = {"weight": w, "weight_scale": scale.float(), "weight_global_scale": gs}
    return dict(NVFP4PackedCompressor.compress(state, NVFP4_SCHEME), weight_global_scale=gs)


def nvfp4_ct_oracle(t: dict[str, torch.Tensor], dtype=torch.bfloat16) -> torch.Tensor:
    """compressed-tensors' NVFP4 decompressor: e2m1 * weight_scale / weight_global_scale."""
    N, half = t["weight_packed"].shape
    out = dict(NVFP4PackedCompressor.decompress(dict(t), NVFP4_SCHEME))["weight"]
    assert out.shape == (N, 2 * half)
    return out.to(dtype)


def to_modelopt(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weight as ModelOpt writes it: weight uint8 [N, K/2] (the same nibble order as compressed-tensors'
    pack_fp4_to_uint8, the low nibble the even column), weight_scale e4m3, weight_scale_2 = 1 / weight_global_scale,
    and a static input_scale (W4A4's; unused weight-only)."""
    return {"weight": t["weight_packed"], "weight_scale": t["weight_scale"],
            "weight_scale_2": (1.0 / t["weight_global_scale"]).reshape(()), "input_scale": torch.tensor(0.5)}


def nvfp4_modelopt_oracle(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """ModelOpt's formula in float32: e2m1 (compressed-tensors' unpack) * weight_scale * weight_scale_2."""
    N, half = t["weight"].shape
    e2m1 = unpack_fp4_from_uint8(t["weight"], N, 2 * half, dtype=torch.float32)
    return e2m1 * t["weight_scale"].float().repeat_interleave(16, dim=1) * t["weight_scale_2"].float()


# ---------------------------------------------------------------------------------------------------------------
# Tiny 4-bit checkpoints


# modules the releases leave bf16: the GDN in_proj_a / in_proj_b, the routers and shared_expert_gate
LEFT_BF16 = re.compile(r".*(linear_attn\.in_proj_[ab]|mlp\.gate|shared_expert_gate)$")


def _quantizable(name: str, t: torch.Tensor, leave: re.Pattern[str]) -> bool:
    return (t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name and "visual" not in name
            and name != "lm_head.weight" and not leave.match(name[: -len(".weight")]))


def _input_key(name: str) -> str:
    """Modules that read one input (q, k, v; gate, up; in_proj_qkv, in_proj_z) get one act-order g_idx, as GPTQ
    gives them: their Hessians are the same."""
    return re.sub(r"(self_attn\.[qkv]_proj|(gate|up)_proj|linear_attn\.in_proj_(qkv|z))", "input", name)


def quantize_checkpoint(src: Path, dst: Path, fmt: str, *, group: int = 32, symmetric: bool = True,
                        act_order: bool = False, v1: bool = False, shared_order: bool = True,
                        scale_dtype: torch.dtype = torch.float16, fp8=None, leave: re.Pattern[str] = LEFT_BF16
                        ) -> Path:
    """Quantize src's linear weights (all but embed_tokens, lm_head, the GDN in_proj_a / in_proj_b, the routers and
    shared_expert_gate, as the releases leave them) into dst in format fmt ("gptq", "awq", "ct", "ct-nvfp4",
    "modelopt-nvfp4") with its quantization config, and write the exactly dequantized reference checkpoint (fp32) to
    dst.parent / (dst.name + "_ref"). fp8(name): ModelOpt's FP8 layers (per-tensor e4m3) instead; leave: the
    weights left as stored. shared_order=False gives each module its own act-order g_idx."""
    shutil.copytree(src, dst)
    ref = dst.parent / (dst.name + "_ref")
    shutil.copytree(src, ref)
    tensors = read_tensors(src)
    quant, deq, layers = {}, {}, {}
    for name, t in tensors.items():
        if not _quantizable(name, t, leave):
            quant[name] = deq[name] = t
            continue
        module = name[: -len(".weight")]
        if fp8 and fp8(name):
            scale = (t.abs().max() / 448).reshape(())
            q8 = (t / scale).to(torch.float8_e4m3fn)
            quant.update({name: q8, module + ".weight_scale": scale, module + ".input_scale": torch.tensor(0.5)})
            deq[name] = q8.float() * scale
            layers[module] = {"quant_algo": "FP8"}
            continue
        if fmt in ("ct-nvfp4", "modelopt-nvfp4"):
            packed = nvfp4_quantize(t)
            if fmt == "ct-nvfp4":
                quant.update({f"{module}.{k}": v for k, v in packed.items()})
                deq[name] = nvfp4_ct_oracle(packed, torch.float32)
            else:
                mo = to_modelopt(packed)
                quant.update({f"{module}.{k}": v for k, v in mo.items()})
                deq[name] = nvfp4_modelopt_oracle(mo)
                layers[module] = {"quant_algo": "NVFP4", "group_size": 16}
            continue
        K = t.shape[1]
        seed = zlib.crc32((_input_key(name) if shared_order else name).encode())
        g_idx = act_order_g_idx(K, group, seed) if act_order else None
        q, z, s, g_idx = int4_codes(t, group, symmetric, scale_dtype, g_idx)
        deq[name] = dequantize_int4(q, z, s, g_idx)
        if fmt == "gptq":
            packed = pack_gptq(q, z, s, g_idx, v1)
        elif fmt == "awq":
            packed = pack_awq(q, z, s)
            packed.pop("qzeros") if symmetric else None
        else:
            packed = pack_ct(q, z, s, g_idx, group, symmetric, act_order)
        quant.update({f"{module}.{k}": v for k, v in packed.items()})
    write_tensors(dst, quant)
    write_tensors(ref, deq)
    update_config(dst, quantization_config=quant_config(fmt, group, symmetric, act_order, v1, layers,
                                                        ["lm_head", "re:" + leave.pattern]))
    if fmt == "modelopt-nvfp4":        # ModelOpt's own file instead of a config.json entry
        cfg = json.loads((dst / "config.json").read_text())
        qc = cfg.pop("quantization_config")
        (dst / "config.json").write_text(json.dumps(cfg))
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": qc}))
    return ref


def quant_config(fmt: str, group: int = 32, symmetric: bool = True, act_order: bool = False,
                 v1: bool = False, layers: dict | None = None, ignore: list[str] | None = None) -> dict:
    """The quantization config each producer writes (layers: ModelOpt's algorithm of each quantized module;
    ignore: compressed-tensors' list of modules left unquantized)."""
    ignore = ignore or ["lm_head", "re:" + LEFT_BF16.pattern]
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
                "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": False, "true_sequential": True}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": not symmetric,
                "version": "gemm", "modules_to_not_convert": ["visual"]}
    if fmt == "ct":
        weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group,
                   "dynamic": False}
        if act_order:
            weights["actorder"] = "group"
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}, "ignore": ignore}
    if fmt == "ct-nvfp4":
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                    "group_size": 16, "dynamic": False}}},
                "ignore": ignore}
    assert fmt == "modelopt-nvfp4", fmt
    if all(v["quant_algo"] == "NVFP4" for v in (layers or {}).values()):
        return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": ["lm_head"]}
    return {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "quantized_layers": layers}
