"""4-bit checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized, NVFP4 from compressed-tensors and ModelOpt) held
4-bit (kernels/w4_weight.W4Weight) or dequantized where a weight's parts differ (tinyserve/four_bit.py).

The oracles are independent of the loader (tests/four_bit_packers.py): compressed-tensors' own packers, unpackers
and dequantization for compressed-tensors, NVFP4 and AWQ (its AutoAWQ converter), and GPTQ / AWQ packed with numpy
from the published layouts, a few of their words checked by hand here. Model-level: the engine on a tiny 4-bit
checkpoint against transformers on its dequantized twin (fp32 logits within 1e-4, greedy tokens identical), then
the peers' bugs on exactly these checkpoints, the engine's invariants on a 4-bit model, and every refusal."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from checkpoints import (QWEN3_5_27B, make_agreeing_head, make_header_only, make_qwen3_5_moe, make_qwen3_5_text,
                         make_qwen3_next, read_tensors, update_config, write_tensors)
from conftest import PinnedCost, assert_no_leaks, engine_for, nextn, prefill_logits, tokens
from four_bit_packers import (act_order_g_idx, awq_oracle, ct_oracle, dequantize_int4, int4_codes, nvfp4_ct_oracle,
                              nvfp4_modelopt_oracle, nvfp4_quantize, pack_awq, pack_ct, pack_gptq,
                              pack_gptq_qweight, quant_config, quantize_checkpoint, to_modelopt)
from server_util import write_config
from tinyserve.build import round_activations_to_int8
from tinyserve.config import ConfigError, from_dict
from tinyserve.four_bit import FourBitScheme, repack
from tinyserve.kernels.w4_weight import W4Weight
from tinyserve.loader import load_model, read_checkpoint
from tinyserve.model_config import LoaderError, TensorInfo
from tinyserve.plan import plan_for
from tinyserve.request import Request
from tinyserve.sampling import SamplingParams

TAGS = {torch.int32: "I32", torch.uint8: "U8", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
        torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64"}
N, K = 48, 256                          # one weight of the tensor-level tests: groups of 32, 64, 128 divide K


def load_module(tensors: dict[str, torch.Tensor], qc: dict, module: str = "model.layers.0.mlp.down_proj"
                ) -> W4Weight:
    """What the loader does with one module's tensors: found from their headers by the config's scheme, checked,
    repacked."""
    full = {f"{module}.{role}": t for role, t in tensors.items()}
    infos = {name: TensorInfo(name, Path("x"), TAGS[t.dtype], tuple(t.shape)) for name, t in full.items()}
    m = FourBitScheme.from_config(qc).find_modules(infos)[module]
    return repack(m, {role: full[info.name] for role, info in m.tensors.items()})


def weight(seed: int = 0, n: int = N, k: int = K) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


# ---------------------------------------------------------------------------------------------------------------
# (a) Each format's repacked weight dequantizes to exactly its oracle's


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v1", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_gptq_dequantizes_to_the_published_formula(group, symmetric, v1, act_order):
    """GPTQ's v1 / v2 zero points, symmetric or not, act-order's permuted g_idx (the columns sorted by group at
    load, W4Weight.perm): (q - z[g_idx]) * s[g_idx], exactly, in float32 and in the scales' float16."""
    g_idx = act_order_g_idx(K, group, seed=group) if act_order else None
    q, z, s, g_idx = int4_codes(weight(group), group, symmetric, torch.float16, g_idx)
    w4 = load_module(pack_gptq(q, z, s, g_idx, v1), quant_config("gptq", group, symmetric, act_order, v1))
    oracle = dequantize_int4(q, z, s, g_idx)
    assert torch.equal(w4.dequantize(torch.float32), oracle)
    assert torch.equal(w4.dequantize(torch.float16), oracle.half())
    assert (w4.perm is not None) == act_order and (w4.zeros is None) == symmetric


def test_gptq_words_by_hand():
    """The packer's words, by hand: codes 1..8 of output 0 fill qweight[0, 0] as 0x87654321 (element k at bits
    4 * (k % 8)); a symmetric v1 checkpoint's qzeros are 0x77777777 (z - 1 = 7), a v2 one's 0x88888888. Then the
    loader on hand-written words: W[0, k] = (k + 1 - 8) * 1, the other rows' codes 0: -8."""
    q = torch.zeros(8, 8, dtype=torch.uint8)
    q[0] = torch.arange(1, 9)
    z, s = torch.full((8, 1), 8, dtype=torch.uint8), torch.ones(8, 1, dtype=torch.float16)
    g = torch.zeros(8, dtype=torch.int32)
    assert pack_gptq(q, z, s, g, v1=False)["qweight"][0, 0].item() == 0x87654321 - (1 << 32)
    assert pack_gptq(q, z, s, g, v1=True)["qzeros"][0, 0].item() == 0x77777777
    assert pack_gptq(q, z, s, g, v1=False)["qzeros"][0, 0].item() == 0x88888888 - (1 << 32)
    hand = {"qweight": torch.tensor([[0x87654321 - (1 << 32)] + [0] * 7], dtype=torch.int32),
            "qzeros": torch.tensor([[0x88888888 - (1 << 32)]], dtype=torch.int32), "scales": s.T.contiguous()}
    w = load_module(hand, quant_config("gptq", 8, True)).dequantize(torch.float32)
    assert w[0].tolist() == [-7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0] and bool((w[1:] == -8).all())
    assert torch.equal(pack_gptq_qweight(q), hand["qweight"])


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_dequantizes_as_compressed_tensors_converter_does(group, symmetric):
    """AWQ GEMM's interleaved columns ([0, 2, 4, 6, 1, 3, 5, 7] in each word) and zero points: compressed-tensors'
    AutoAWQ converter unpacks and dequantizes the same weight (in the scales' float16); and the published formula
    agrees in float32."""
    q, z, s, g_idx = int4_codes(weight(group + 1), group, symmetric, torch.float16)
    t = pack_awq(q, z, s)
    if symmetric:
        del t["qzeros"]
    w4 = load_module(t, quant_config("awq", group, symmetric))
    assert torch.equal(w4.dequantize(torch.float16), awq_oracle(t, group, symmetric))
    assert torch.equal(w4.dequantize(torch.float32), dequantize_int4(q, z, s, g_idx))


def test_awq_words_by_hand():
    """Columns 0..7 holding codes 0..7 pack into 0x75316420: nibble j holds column AWQ_ORDER[j]."""
    q = torch.arange(8, dtype=torch.uint8).repeat(8, 1).T.contiguous()          # [N=8, K=8]: W[n, k] = n
    t = pack_awq(q, torch.full((8, 1), 8, dtype=torch.uint8), torch.ones(8, 1, dtype=torch.float16))
    assert t["qweight"][0, 0].item() == 0x75316420


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group, act_order", [(32, False), (64, False), (128, False), (-1, False), (32, True),
                                              (128, True)])
def test_compressed_tensors_dequantizes_as_its_decompressor(group, symmetric, act_order):
    """pack-quantized (signed codes + 8, zero points packed along N, groups or one per row (-1: strategy channel),
    the old actorder "group" with weight_g_idx): compressed-tensors' own decompression, in the scales' bfloat16 and
    in float32."""
    g = K if group == -1 else group
    g_idx = act_order_g_idx(K, g, seed=g) if act_order else None
    q, z, s, g_idx = int4_codes(weight(g + 2), g, symmetric, torch.bfloat16, g_idx)
    t = pack_ct(q, z, s, g_idx, group, symmetric, act_order)
    qc = quant_config("ct", group, symmetric, act_order)
    if group == -1:
        qc["config_groups"]["group_0"]["weights"].update(strategy="channel", group_size=None)
    w4 = load_module(t, qc)
    assert torch.equal(w4.dequantize(torch.bfloat16), ct_oracle(t, group, symmetric))
    assert torch.equal(w4.dequantize(torch.float32), ct_oracle(t, group, symmetric, torch.float32))


def test_nvfp4_dequantizes_as_compressed_tensors_and_modelopt_do():
    """NVFP4: compressed-tensors' decompressor (weight_global_scale is 1 / ModelOpt's weight_scale_2; a power of two
    here, so both orders of the float32 products are exact), and ModelOpt's formula e2m1 * scale * scale_2 with
    any scale_2, exactly."""
    t = nvfp4_quantize(weight(5))
    ct = load_module(t, quant_config("ct-nvfp4"))
    assert ct.kind == "fp4" and ct.group == 16
    assert torch.equal(ct.dequantize(torch.bfloat16), nvfp4_ct_oracle(t, torch.bfloat16))
    assert torch.equal(ct.dequantize(torch.float32), nvfp4_ct_oracle(t, torch.float32))
    for power_of_two in (True, False):
        mo = to_modelopt(nvfp4_quantize(weight(6), power_of_two))
        w4 = load_module(mo, {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16})
        assert torch.equal(w4.dequantize(torch.float32), nvfp4_modelopt_oracle(mo))


def test_per_module_rules_pick_each_modules_format():
    """compressed-tensors: of several config groups the one whose targets name the module (exact, then "re:", then
    "Linear") decides its group size and symmetry, and an `ignore` entry ("re:") that covers a packed module is
    refused; GPTQModel's `dynamic`: the first matching regex overrides group_size ("+:") or skips ("-:")."""
    q, z, s, g_idx = int4_codes(weight(10), 32, False, torch.bfloat16)
    t = pack_ct(q, z, s, g_idx, 32, False, False)
    qc = quant_config("ct", 64, True)
    qc["config_groups"]["mlp"] = {"targets": ["re:.*mlp\\.down_proj$"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}}
    w4 = load_module(t, qc)
    assert w4.group == 32 and w4.zeros is not None
    assert torch.equal(w4.dequantize(torch.bfloat16), ct_oracle(t, 32, False))
    with pytest.raises(LoaderError, match="weight_scale' has shape \\[48, 8\\].* needs \\[48, 4\\]"):
        load_module(t, qc, module="model.layers.0.self_attn.o_proj")     # group_0 ("Linear"): group 64
    with pytest.raises(LoaderError, match="leaves its module 'model.layers.0.mlp.down_proj' unquantized"):
        load_module(t, {**qc, "ignore": ["re:.*down_proj$"]})
    q, z, s, g_idx = int4_codes(weight(11), 64, True, torch.float16)
    t = pack_gptq(q, z, s, g_idx, v1=True)
    qc = {**quant_config("gptq", 128, True, v1=True), "dynamic": {"-:.*self_attn.*": {},
                                                                  "+:.*mlp\\..*": {"group_size": 64}}}
    assert torch.equal(load_module(t, qc).dequantize(torch.float32), dequantize_int4(q, z, s, g_idx))
    with pytest.raises(LoaderError, match="leaves its module 'model.layers.3.self_attn.o_proj' unquantized"):
        load_module(t, qc, module="model.layers.3.self_attn.o_proj")


def test_gptq_v2_zero_points_are_not_read_as_v1():
    """vLLM #26343 ("!!!" output): a gptq_v2 checkpoint's qzeros read as v1 are off by one step of every group. The
    same tensors under checkpoint_format "gptq" (v1) give another weight; a symmetric v2 checkpoint declared v1 is
    refused, naming sym and checkpoint_format."""
    q, z, s, g_idx = int4_codes(weight(7), 32, False, torch.float16)
    t = pack_gptq(q, z, s, g_idx, v1=False)
    v2 = load_module(t, quant_config("gptq", 32, False, v1=False)).dequantize(torch.float32)
    v1 = load_module(t, quant_config("gptq", 32, False, v1=True)).dequantize(torch.float32)
    assert torch.equal(v2, dequantize_int4(q, z, s, g_idx)) and not torch.equal(v1, v2)
    q, z, s, g_idx = int4_codes(weight(8), 32, True, torch.float16)
    with pytest.raises(LoaderError, match=r"qzeros' holds zero points other than the symmetric 7 .*"
                                          r"quantization_config\.sym = true: is checkpoint_format right"):
        load_module(pack_gptq(q, z, s, g_idx, v1=False), quant_config("gptq", 32, True, v1=True))


def test_folding_global_scales_stays_within_an_ulp():
    """NVFP4 parts with different global scales share one weight with the scales folded in (W4Weight.folded):
    float32 rounding of each scale apart, the same weight."""
    t = nvfp4_quantize(weight(9), power_of_two=False)
    w4 = load_module(t, quant_config("ct-nvfp4"))
    folded = w4.folded()
    assert folded.global_scale == 1.0 and w4.global_scale != 1.0
    assert torch.allclose(folded.dequantize(torch.float32), w4.dequantize(torch.float32), rtol=2 ** -22, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# (b) The engine on tiny 4-bit checkpoints against transformers on their dequantized twins

from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM  # noqa: E402

LEAVE_A = re.compile(r".*(linear_attn\.in_proj_a|mlp\.gate|shared_expert_gate)$")   # in_proj_b 4-bit, a bf16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@dataclass
class Tiny:
    folder: Path          # the 4-bit checkpoint
    ref: Path             # its dequantized twin (fp32)
    model: object         # loaded from folder, fp32
    hf: object            # transformers on ref


def tiny(root: Path, make, hf_cls, fmt: str, **quant) -> Tiny:
    src, _ = make(root / "src")
    ref = quantize_checkpoint(src, root / fmt, fmt, **quant)
    return Tiny(root / fmt, ref, load_model(root / fmt, torch.float32),
                hf_cls.from_pretrained(ref, dtype=torch.float32).eval())


def dense_src(path: Path, **kw):
    """Qwen3.5 dense with a NEXTN head that agrees with the model (drafts accepted about 2 in 3: mix 0.3)."""
    folder, hf = make_qwen3_5_text(path, with_mtp=True, max_position_embeddings=2048, **kw)
    make_agreeing_head(folder, mix=0.3)
    return folder, hf


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """GPTQ v2, asymmetric, act-order, group 32, the MTP head quantized too."""
    return tiny(tmp_path_factory.mktemp("dense"), dense_src, Qwen3_5ForCausalLM, "gptq", symmetric=False,
                act_order=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """Qwen3.5-MoE (per-expert tensors, 35B-A3B-shaped) in compressed-tensors, asymmetric bf16 scales, act-order
    (the old actorder "group": each expert its own permutation), in_proj_b 4-bit beside a bf16 in_proj_a, the MTP
    head (an MoE layer) quantized."""
    return tiny(tmp_path_factory.mktemp("moe"), lambda p: make_qwen3_5_moe(p, with_mtp=True), Qwen3_5MoeForCausalLM,
                "ct", symmetric=False, act_order=True, scale_dtype=torch.bfloat16, leave=LEAVE_A)


def engine_logits(model, ids: list[int]) -> torch.Tensor:
    eng = engine_for(model, engine={"page_size": 16, "kv_cache_tokens": 4096, "max_running_requests": 2,
                                    "chunked_prefill_size": 256})
    return prefill_logits(eng, Request("r", ids, SamplingParams(max_tokens=1), seed=0))


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def assert_matches_transformers(t: Tiny, length: int = 70) -> None:
    ids = tokens(length, length)
    with torch.no_grad():
        ref = t.hf(torch.tensor([ids])).logits[0]
    assert (engine_logits(t.model, ids) - ref).abs().max().item() < 1e-4
    eng = engine_for(t.model, engine={"page_size": 16})
    assert eng.generate([ids], GREEDY)[0] == hf_greedy(t.hf, ids, GREEDY.max_tokens)


def w4_names(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, W4Weight)}


def test_dense_gptq_matches_transformers(dense):
    gdn, attn = dense.model.cfg.gdn_layer_ids[0], dense.model.cfg.attn_layer_ids[0]
    assert {f"layers.{gdn}.mixer.in_proj_qkvz", f"layers.{gdn}.mixer.out_proj", f"layers.{attn}.mixer.qkv_proj",
            "layers.0.mlp.gate_up", "layers.0.mlp.down", "mtp.fc", "mtp.layers.0.mixer.qkv_proj",
            "mtp.layers.0.mlp.down"} <= w4_names(dense.model)
    assert dense.model.layers[0].mlp.gate_up.perm is not None                       # act-order kept 4-bit
    assert_matches_transformers(dense)


def test_moe_compressed_tensors_matches_transformers(moe):
    cfg = moe.model.cfg
    experts = moe.model.layers[0].mlp.experts_gate_up
    assert isinstance(experts, W4Weight) and experts.codes.shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size,
                                                                     cfg.hidden_size // 2)
    assert experts.perm.shape == (cfg.num_experts, cfg.hidden_size) and not torch.equal(experts.perm[0],
                                                                                        experts.perm[1])
    assert {"layers.0.mlp.experts_down", "layers.0.mlp.shared_expert.gate_up", "mtp.layers.0.mlp.experts_gate_up",
            "mtp.fc"} <= w4_names(moe.model)
    assert_matches_transformers(moe)


@pytest.mark.parametrize("fmt", ["modelopt-nvfp4", "ct-nvfp4", "awq"])
def test_other_formats_match_transformers(tmp_path, fmt):
    """ModelOpt NVFP4 beside its FP8 attention layers (a mixed checkpoint: hf_quant_config.json MIXED_PRECISION),
    compressed-tensors NVFP4, AWQ; no MTP head."""
    fp8 = (lambda name: "self_attn" in name) if fmt == "modelopt-nvfp4" else None
    t = tiny(tmp_path, lambda p: make_qwen3_5_text(p), Qwen3_5ForCausalLM, fmt, fp8=fp8)
    attn = t.model.cfg.attn_layer_ids[0]
    assert "layers.0.mlp.gate_up" in w4_names(t.model)
    assert (f"layers.{attn}.mixer.qkv_proj" in w4_names(t.model)) == (fp8 is None)
    assert_matches_transformers(t, 40)


def test_qwen3_next_interleaved_projections_are_dequantized(tmp_path):
    """Qwen3-Next's in_proj_qkvz / in_proj_ba are reordered at load: dequantized, the rest held 4-bit (GPTQ v1,
    symmetric)."""
    t = tiny(tmp_path, lambda p: make_qwen3_next(p), Qwen3NextForCausalLM, "gptq", v1=True,
             leave=re.compile(r".*(mlp\.gate|shared_expert_gate)$"))
    gdn, attn = t.model.cfg.gdn_layer_ids[0], t.model.cfg.attn_layer_ids[0]
    assert isinstance(t.model.layers[gdn].mixer.in_proj_qkvz, torch.nn.Parameter)
    assert {f"layers.{gdn}.mixer.out_proj", f"layers.{attn}.mixer.qkv_proj", "layers.0.mlp.experts_gate_up"} <= \
        w4_names(t.model)
    assert_matches_transformers(t, 40)


# ---------------------------------------------------------------------------------------------------------------
# (c) The peers' bugs on exactly these checkpoints


def test_bf16_in_proj_a_b_beside_4bit_in_proj_qkvz(dense, moe):
    """SGLang #38854 (a crash repacking a fused 4-bit layer of N = 96), #19406, vLLM PR #36329: in_proj_b | in_proj_a
    are bf16 beside a 4-bit in_proj_qkv | in_proj_z. Each loads as stored: in_proj_ba is the bf16 rows (or, where
    in_proj_b alone is 4-bit, its dequantized rows beside in_proj_a's), in_proj_qkvz is held 4-bit."""
    for t in (dense, moe):
        ref = read_tensors(t.ref)
        prefix = "model.layers.{}.linear_attn."
        for i in t.model.cfg.gdn_layer_ids:
            mixer = t.model.layers[i].mixer
            assert isinstance(mixer.in_proj_qkvz, W4Weight) and isinstance(mixer.in_proj_ba, torch.nn.Parameter)
            p = prefix.format(i)
            assert torch.equal(mixer.in_proj_ba, torch.cat([ref[p + "in_proj_b.weight"], ref[p + "in_proj_a.weight"]]))
    stored = read_tensors(moe.folder)
    assert "model.layers.0.linear_attn.in_proj_b.weight_packed" in stored
    assert "model.layers.0.linear_attn.in_proj_a.weight" in stored


def test_every_4bit_gdn_projection_is_used(dense):
    """SGLang PR #22618 (every linear_attn weight of RedHat's NVFP4 dropped silently: garbage out): each GDN layer's
    4-bit in_proj_qkv | in_proj_z and out_proj dequantize to the oracle's weights."""
    ref = read_tensors(dense.ref)
    for i in dense.model.cfg.gdn_layer_ids:
        mixer, p = dense.model.layers[i].mixer, f"model.layers.{i}.linear_attn."
        assert torch.equal(mixer.in_proj_qkvz.dequantize(torch.float32),
                           torch.cat([ref[p + "in_proj_qkv.weight"], ref[p + "in_proj_z.weight"]]))
        assert torch.equal(mixer.out_proj.dequantize(torch.float32), ref[p + "out_proj.weight"])


def test_the_cpu_holds_4bit_weights_in_blocks_of_rows(dense, moe):
    """On the CPU the loader interleaves each 4-bit weight's blocks of rows for the kernel (W4Weight.block_rows) where
    its rows are whole 32-byte pieces: the dequantized weights above and the logits against transformers are these."""
    from tinyserve.kernels import w4_cpu
    if not w4_cpu.built():
        pytest.skip("no C compiler: the reference reads rows")
    for t in (dense, moe):
        held = [w for w in t.model.modules() if isinstance(w, W4Weight)]
        assert any(w.blocked for w in held)
        assert all(w.blocked == (w.in_features % 64 == 0) for w in held)


def test_a_checkpoint_missing_a_gdn_projection_is_refused(dense, tmp_path):
    """... and a checkpoint without one of them is refused, naming it."""
    folder = shutil.copytree(dense.folder, tmp_path / "gptq")
    write_tensors(folder, {k: v for k, v in read_tensors(folder).items()
                           if not k.startswith("model.layers.1.linear_attn.in_proj_z.")})
    with pytest.raises(LoaderError, match=r"missing 1 tensor.*layers\.1\.linear_attn\.in_proj_z\.weight"):
        load_model(folder, torch.float32)


def spec_engine(model, **engine):
    eng = engine_for(model, engine={"page_size": 16, **engine}, speculative={"num_steps": 3, "max_running": 0})
    nextn(eng).step_cost = PinnedCost()
    return eng


PROMPTS = [tokens(37, 0), tokens(5, 1), tokens(80, 2)]
LONG = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_a_4bit_mtp_head_drafts_and_is_lossless(dense, moe):
    """SGLang #35797, vLLM #53387 (fc.weight looked for beside fc.weight_packed: acceptance stuck at 1.0): the 4-bit
    MTP head's tensors are found and used. Its drafts are accepted (the head agrees with the model, dense), and
    greedy tokens with NEXTN are the plain ones (invariant 7), dense and MoE."""
    assert isinstance(dense.model.mtp.fc, W4Weight) and isinstance(moe.model.mtp.fc, W4Weight)
    for t in (dense, moe):
        plain = engine_for(t.model, engine={"page_size": 16}).generate(PROMPTS, LONG)
        eng = spec_engine(t.model)
        assert eng.generate(PROMPTS, LONG) == plain
        assert_no_leaks(eng)
    assert nextn(eng).totals.num_draft_tokens > 0
    dense_eng = spec_engine(dense.model)
    dense_eng.generate(PROMPTS, LONG)
    st = nextn(dense_eng).totals
    assert st.num_accepted_tokens > st.num_draft_tokens / 3, (st.num_accepted_tokens, st.num_draft_tokens)


def test_the_gdn_recurrence_over_a_long_prompt(dense):
    """onnxruntime-genai moved the GDN projections to INT8 as the recurrence accumulated 4-bit error: over 1,200
    tokens the engine's logits stay within 1e-4 of transformers' on the dequantized weights (the 4-bit GEMM adds
    no error of its own)."""
    ids = tokens(1200, 7)
    with torch.no_grad():
        ref = dense.hf(torch.tensor([ids])).logits[0]
    assert (engine_logits(dense.model, ids) - ref).abs().max().item() < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# (d) The engine's invariants on a 4-bit model


def run_one(eng, prompt: list[int]) -> tuple[list[int], int]:
    req = eng.intake.make_request(prompt, GREEDY, None)
    eng.scheduler.add(req)
    while req.finish_reason is None:
        eng._step()
    return req.output_ids, req.cached_tokens


def test_prefix_cache_hits_give_the_cold_tokens(dense):
    """Invariant 1: a prompt that extends a cached one hits the cache and gives the cold run's tokens."""
    first, second = tokens(64, 3), tokens(64, 3) + tokens(20, 4)
    warm = engine_for(dense.model, engine={"page_size": 16}, cache={"state_track_interval": 16})
    run_one(warm, first)
    hit, cached = run_one(warm, second)
    cold, _ = run_one(engine_for(dense.model, engine={"page_size": 16}, cache={"enabled": False}), second)
    assert cached >= 48 and hit == cold
    assert_no_leaks(warm)


def test_batch_invariance(moe):
    """Invariant 3: a request's greedy tokens alone and inside a batch (the MoE's 4-bit experts)."""
    alone = [engine_for(moe.model, engine={"page_size": 16}).generate([p], GREEDY)[0] for p in PROMPTS]
    assert engine_for(moe.model, engine={"page_size": 16}).generate(PROMPTS, GREEDY) == alone


def test_parts_with_different_act_orders_are_dequantized(tmp_path):
    """A fused weight's parts must share one column permutation to be held 4-bit: q, k, v with a g_idx each are
    dequantized into qkv_proj (the logits still match), o_proj (one part) stays 4-bit with its permutation."""
    t = tiny(tmp_path, lambda p: make_qwen3_5_text(p), Qwen3_5ForCausalLM, "gptq", act_order=True,
             shared_order=False)
    attn = t.model.cfg.attn_layer_ids[0]
    assert isinstance(t.model.layers[attn].mixer.qkv_proj, torch.nn.Parameter)
    assert t.model.layers[attn].mixer.o_proj.perm is not None
    assert_matches_transformers(t, 40)


# ---------------------------------------------------------------------------------------------------------------
# model.int8_activations: the int4 weights' GEMMs round their activations to int8 (kernels/w4_cpu.c's integer path)


def int8_model(t: Tiny):
    """t's checkpoint loaded afresh (the fixtures' models stay float) with model.int8_activations on."""
    model = load_model(t.folder, torch.float32)
    round_activations_to_int8(model)
    return model


def test_int8_activations_reach_every_int4_weight_and_the_logits(dense, moe, monkeypatch):
    """Every 4-bit weight takes the flag (the MTP head's, every expert's view). The engine's logits are those of the
    same engine with the torch reference GEMM (w4_linear_reference: x rounded by int8_rounded, then F.linear) within
    1e-3: the two sum in different orders, so a value whose x * 127 / amax lies within a rounding of a half may round
    to the next step in one of them only (5e-5 to 2.6e-4 seen, over 70 and 300 tokens: the kernel and the rounded
    prefill); the float activations' logits are further (1.3e-3 dense with groups of 32, 2.4e-2 to 3.1e-2 MoE)."""
    from tinyserve.kernels import w4_cpu
    for t, away in ((dense, 1e-3), (moe, 1e-2)):
        model = int8_model(t)
        w4 = [m for m in model.modules() if isinstance(m, W4Weight)]
        assert w4 and all(m.int8_activations for m in w4) and model.mtp.fc.int8_activations
        experts = [m for m in w4 if m.codes.dim() == 3]
        assert all(m.expert(1).int8_activations for m in experts) and bool(experts) == (t is moe)
        for length in (70, 300):           # 70: the kernel; 300: a chunk of 256 rows, past INT8_GEMM_ROWS: x rounded
            ids = tokens(length, length)
            kernel = engine_logits(model, ids)
            with monkeypatch.context() as m:
                m.setattr(w4_cpu, "usable", lambda x, w: False)
                reference = engine_logits(model, ids)
            assert (kernel - reference).abs().max().item() < 1e-3
            assert (kernel - engine_logits(t.model, ids)).abs().max().item() > away


def test_int8_activations_keep_the_engines_invariants(dense, moe):
    """With int8 activations (each row of x rounded by itself, so a request's rows round alike in any batch): a
    request's greedy tokens alone and in a batch (MoE), NEXTN lossless (dense, drafts accepted), a prefix cache hit
    gives the cold tokens (dense)."""
    model = int8_model(moe)
    alone = [engine_for(model, engine={"page_size": 16}).generate([p], GREEDY)[0] for p in PROMPTS]
    assert engine_for(model, engine={"page_size": 16}).generate(PROMPTS, GREEDY) == alone
    model = int8_model(dense)
    plain = engine_for(model, engine={"page_size": 16}).generate(PROMPTS, LONG)
    eng = spec_engine(model)
    assert eng.generate(PROMPTS, LONG) == plain
    assert nextn(eng).totals.num_accepted_tokens > 0
    first, second = tokens(64, 3), tokens(64, 3) + tokens(20, 4)
    warm = engine_for(model, engine={"page_size": 16}, cache={"state_track_interval": 16})
    run_one(warm, first)
    hit, cached = run_one(warm, second)
    cold, _ = run_one(engine_for(model, engine={"page_size": 16}, cache={"enabled": False}), second)
    assert cached >= 48 and hit == cold
    assert_no_leaks(warm)


def test_int8_activations_have_their_own_cached_pages_and_compiled_steps(dense):
    """The file tier's pages and the saved compiled steps are keyed by the setting: KV computed with int8 activations
    never hits for the float model, and a graph traced with float activations (the GEMM's int8_x is a constant in
    it) is never loaded for the int8 one (a server started after one of the other setting did load it)."""
    from tinyserve.blob import model_fingerprint
    from tinyserve.compiled import graphs_fingerprint
    int8, plain = int8_model(dense), load_model(dense.folder, torch.float32)
    assert model_fingerprint(int8, torch.float32, 16) != model_fingerprint(plain, torch.float32, 16)
    assert graphs_fingerprint(int8, False) != graphs_fingerprint(plain, False)
    assert graphs_fingerprint(plain, False) == graphs_fingerprint(load_model(dense.folder, torch.float32), False)


def test_int8_activations_are_refused_where_they_cannot_apply(dense):
    """A checkpoint without 4-bit weights, or with NVFP4 ones: a ConfigError naming model.int8_activations."""
    float_model = load_model(dense.ref, torch.float32)
    with pytest.raises(ConfigError, match="model.int8_activations = true needs a checkpoint with int4 weights"):
        round_activations_to_int8(float_model)
    fp4 = torch.nn.Sequential(W4Weight(16, 64, 16, kind="fp4"))
    with pytest.raises(ConfigError, match="model.int8_activations.*NVFP4"):
        round_activations_to_int8(fp4)
    assert not fp4[0].int8_activations


# ---------------------------------------------------------------------------------------------------------------
# The memory plan counts 4-bit weights at their size


def held_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())


def test_the_plan_counts_the_bytes_the_model_holds(dense, moe, tmp_path):
    """read_checkpoint (the plan's count, from the headers and an act-order checkpoint's g_idx) is what load_model
    holds: GPTQ with act-order, compressed-tensors MoE, and ModelOpt's NVFP4 beside FP8 layers kept FP8."""
    for t in (dense, moe):
        _, counted = read_checkpoint(t.folder)
        w4 = [m for m in t.model.modules() if isinstance(m, W4Weight)]
        assert counted.w4_bytes == sum(m.nbytes() for m in w4) > 0
        assert counted.bytes(4) == held_bytes(t.model)
    src, _ = make_qwen3_5_text(tmp_path / "src")
    quantize_checkpoint(src, tmp_path / "mixed", "modelopt-nvfp4", fp8=lambda name: "self_attn" in name)
    _, counted = read_checkpoint(tmp_path / "mixed", keep_fp8=True)
    model = load_model(tmp_path / "mixed", torch.float32, fp8_weights="w8a16")
    assert counted.fp8_values > 0 and counted.w4_bytes > 0 and counted.w4_format == "nvfp4"
    assert counted.bytes(4) == held_bytes(model)


def test_check_plans_a_27b_gptq_folder_for_a_32gb_card(tmp_path):
    """tinyserve --check on a header-only Qwen3.5-27B W4A16 g128 (GPTQ) folder: ~12.5 GB of 4-bit linears, and with
    a 64K context it fits a 32 GB card."""
    folder = make_header_only(tmp_path / "q35-27b-gptq", QWEN3_5_27B, gptq_group=128)
    _, weights = read_checkpoint(folder)
    assert weights.w4_format == "gptq g128" and 11.5 < weights.w4_bytes / 2 ** 30 < 12
    config = write_config(tmp_path, {"model": {"path": str(folder), "context_length": 65536}})
    out = subprocess.run([sys.executable, "-m", "tinyserve.cli", "--check", str(config), "--gpu-memory-gb", "32"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan, verdict = out.stdout.strip().splitlines()[-2:]
    assert re.search(r"weights 17\.\d\d GiB \(11\.\d\d GiB of them 4-bit, gptq g128\)", plan), plan
    assert verdict.startswith("fits a 32 GiB card"), verdict


# ---------------------------------------------------------------------------------------------------------------
# (e) Refusals: a LoaderError naming the tensor and the config key


def copy_with(folder: Path, tmp_path: Path, config: dict | None = None, drop: str | None = None) -> Path:
    out = shutil.copytree(folder, tmp_path / "copy")
    if config is not None:
        raw = json.loads((out / "config.json").read_text())
        raw["quantization_config"] = {**raw["quantization_config"], **config}
        (out / "config.json").write_text(json.dumps(raw))
    if drop:
        write_tensors(out, {k: v for k, v in read_tensors(out).items() if not k.startswith(drop)})
    return out


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "gguf"}, "quant_method 'gguf' is not supported"),
    ({"quant_method": "aqlm"}, "quant_method 'aqlm' is not supported"),
    ({"quant_method": "hqq"}, "quant_method 'hqq' is not supported"),
    ({"quant_method": "exl2"}, "quant_method 'exl2' is not supported"),
    ({"bits": 3}, r"quantization_config\.bits = 3"),
    ({"bits": 8}, r"quantization_config\.bits = 8"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "awq", "version": "gemv"}, "version 'gemv' is not supported"),
    ({"quant_method": "awq", "version": "marlin"}, "version 'marlin' is not supported"),
    ({"quant_method": "awq", "version": "exllama"}, "version 'exllama' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24"}, "format 'marlin-24' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     r"config_groups\.group_0\.weights: 8-bit int weights are not supported"),
    ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, "quant_algo 'MXFP8' is not supported"),
    ({"group_size": 48}, r"quantization_config\.group_size = 48 does not divide the 64 input columns of "
                         r"'model\.layers\.0\.linear_attn\.in_proj_qkv\.qweight'"),
    ({"dynamic": {r"-:.*mlp\.down_proj": {}}}, r"'model\.layers\.0\.mlp\.down_proj\.qweight' is stored 4-bit.*"
                                               r"leaves its module .* unquantized"),
    ({"desc_act": False}, r"g_idx' permutes the input columns, but quantization_config\.desc_act is off"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": [3]},
     r"quantization_config\.ignore entry 3 is not a string"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["re:lm_head(", "lm_head"]},
     r"bad regex in quantization_config\.ignore 're:lm_head\('"),
    ({"quant_method": "fp8", "modules_to_not_convert": ["lm_head", None]},
     r"quantization_config\.modules_to_not_convert entry None is not a string"),
])
def test_refusals_name_the_format_tensor_and_key(dense, tmp_path, config, message):
    with pytest.raises(LoaderError, match=message):
        load_model(copy_with(dense.folder, tmp_path, config), torch.float32)


def test_missing_scales_are_refused(dense, tmp_path):
    folder = copy_with(dense.folder, tmp_path, drop="model.layers.0.mlp.down_proj.scales")
    with pytest.raises(LoaderError, match=r"has no model\.layers\.0\.mlp\.down_proj\.scales"):
        read_checkpoint(folder)


def test_a_packed_shape_that_disagrees_with_the_config_is_refused(dense, tmp_path):
    folder = copy_with(dense.folder, tmp_path)
    update_config(folder, intermediate_size=96)
    with pytest.raises(LoaderError, match=r"mlp\.down_proj\.qweight \(a 4-bit \[64, 128\] weight, packed \[16, 64\]\): "
                                          r"config\.json's hidden_size, intermediate_size make it \[64, 96\]"):
        load_model(folder, torch.float32)


def test_gguf_is_refused_by_name(tmp_path):
    folder, _ = make_qwen3_5_text(tmp_path / "m")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    (folder / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(LoaderError, match="GGUF is not supported"):
        read_checkpoint(folder)


def test_nextn_without_an_mtp_head_refuses_to_start(dense, tmp_path):
    """A 4-bit release without mtp.* (some drop it): NEXTN refuses at start, naming the missing tensors."""
    folder = copy_with(dense.folder, tmp_path, drop="mtp.")
    assert load_model(folder, torch.float32).mtp is None
    with pytest.raises(ConfigError, match=r"no mtp\.\* tensors") as e:
        plan_for(from_dict({"model": {"path": str(folder)}, "speculative": {"num_steps": 3}}))
    assert e.value.key == "speculative.num_steps"
