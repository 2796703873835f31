"""tinyserve.model_config, fp8_scheme and loader: config parsing, streaming load (single file / sharded / fused
experts), FP8, errors."""
from __future__ import annotations

import json
import logging
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from checkpoints import (
    fp8_checkpoint,
    make_qwen3_5_conditional,
    make_qwen3_5_text,
    make_qwen3_next,
    read_tensors,
    update_config,
    write_tensors,
)
from tinyserve.loader import load_model
from tinyserve.model_config import LoaderError, read_model_config


# ---------------------------------------------------------------------------------------------------------------
# fixtures: one checkpoint of each kind per module; broken variants are copies


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "next": make_qwen3_next(root / "next"),
        "next_mtp": make_qwen3_next(root / "next_mtp", with_mtp=True),
        "text": make_qwen3_5_text(root / "text"),
        "cond": make_qwen3_5_conditional(root / "cond"),
    }


def copy_of(ckpts, kind: str, tmp_path: Path) -> Path:
    dst = tmp_path / kind
    shutil.copytree(ckpts[kind][0], dst)
    return dst


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_params(a, b) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


def write_config(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


def edit_config(folder: Path, fn) -> None:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


TEXT_KEYS = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                 max_position_embeddings=256)
MOE_KEYS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


# ---------------------------------------------------------------------------------------------------------------
# config parsing


def test_config_qwen3_next_from_transformers(ckpts):
    folder, hf = ckpts["next"]
    cfg = read_model_config(folder)
    hc = hf.config
    assert cfg.model_type == "qwen3_next"
    assert cfg.interleaved_gdn_proj is True
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (256, 64, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    assert cfg.rope_theta == 1e7 and cfg.partial_rotary_factor == 0.25 and cfg.rotary_dim == 8
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size) == (8, 2, 32, 32)
    assert cfg.norm_topk_prob is True and cfg.mlp_only_layers == [] and cfg.decoder_sparse_step == 1
    assert cfg.rms_norm_eps == hc.rms_norm_eps and cfg.max_position_embeddings == 256
    assert cfg.eos_token_ids == [2] and cfg.bos_token_id == 1
    assert cfg.tie_word_embeddings is False and cfg.num_mtp_layers == 0


def test_config_qwen3_next_release_style_keys(tmp_path):
    """The released Qwen3-Next config: full_attention_interval, top-level rope_theta / partial_rotary_factor,
    rope_scaling null, eos as a list."""
    folder = write_config(tmp_path / "m", dict(
        TEXT_KEYS, **MOE_KEYS, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], num_hidden_layers=8,
        full_attention_interval=4, rope_theta=5e6, partial_rotary_factor=0.5, rope_scaling=None,
        eos_token_id=[7, 8], bos_token_id=3, torch_dtype="bfloat16", norm_topk_prob=False, mlp_only_layers=[2],
        decoder_sparse_step=1))
    cfg = read_model_config(folder)
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert cfg.rope_theta == 5e6 and cfg.partial_rotary_factor == 0.5
    assert cfg.eos_token_ids == [7, 8] and cfg.bos_token_id == 3
    assert cfg.torch_dtype == "bfloat16" and cfg.norm_topk_prob is False and cfg.mlp_only_layers == [2]
    assert not cfg.is_moe_layer(2) and cfg.is_moe_layer(3)
    assert cfg.num_mtp_layers == 0  # no weights at all


def test_config_rope_theta_defaults_like_transformers(tmp_path):
    folder = write_config(tmp_path / "m", dict(TEXT_KEYS, model_type="qwen3_5_text"))
    cfg = read_model_config(folder)
    assert cfg.rope_theta == 10000.0 and cfg.partial_rotary_factor == 0.25
    assert cfg.model_type == "qwen3_5_text" and cfg.interleaved_gdn_proj is False
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]


def test_config_rope_scaling_dict(tmp_path):
    folder = write_config(tmp_path / "m", dict(
        TEXT_KEYS, model_type="qwen3_5_text",
        rope_scaling={"rope_type": "default", "rope_theta": 123.0, "partial_rotary_factor": 0.5}))
    cfg = read_model_config(folder)
    assert cfg.rope_theta == 123.0 and cfg.partial_rotary_factor == 0.5


def test_config_rejects_rescaled_rope(tmp_path):
    folder = write_config(tmp_path / "m", dict(
        TEXT_KEYS, model_type="qwen3_next", rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(LoaderError, match="rope_scaling.rope_type 'yarn'"):
        read_model_config(folder)


def test_config_qwen3_5_conditional(ckpts):
    folder, hf = ckpts["cond"]
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and raw["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    cfg = read_model_config(folder)
    assert cfg.model_type == "qwen3_5_text" and cfg.interleaved_gdn_proj is False
    assert cfg.hidden_size == 64 and cfg.intermediate_size == 128 and cfg.num_experts == 0
    assert cfg.rope_theta == 1e7 and cfg.partial_rotary_factor == 0.25
    assert cfg.num_mtp_layers == 1
    assert cfg.eos_token_ids == [2]


def test_config_eos_from_text_config_then_top_level(tmp_path):
    nested = {"model_type": "qwen3_5", "text_config": dict(TEXT_KEYS, model_type="qwen3_5_text", eos_token_id=5),
              "eos_token_id": 6, "tie_word_embeddings": True}
    cfg = read_model_config(write_config(tmp_path / "a", nested))
    assert cfg.eos_token_ids == [5]
    assert cfg.tie_word_embeddings is True  # only at the top level: falls back to it
    del nested["text_config"]["eos_token_id"]
    cfg = read_model_config(write_config(tmp_path / "b", nested))
    assert cfg.eos_token_ids == [6]


@pytest.mark.parametrize("model_type, nested, expect", [
    ("qwen3_5_text", False, "qwen3_5_text"),
    ("qwen3_5_moe", True, "qwen3_5_moe_text"),
    ("qwen3_5_moe_text", False, "qwen3_5_moe_text"),
])
def test_config_other_model_types(tmp_path, model_type, nested, expect):
    text = dict(TEXT_KEYS, layer_types=["linear_attention", "full_attention"] * 2,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    if "moe" in model_type:
        text.update(MOE_KEYS)
        del text["intermediate_size"]  # MoE text configs need not carry the dense width
    if nested:
        data = {"model_type": model_type, "text_config": dict(text, model_type=model_type + "_text"),
                "vision_config": {"depth": 1}, "mtp_num_hidden_layers": 1}
    else:
        data = dict(text, model_type=model_type)
    cfg = read_model_config(write_config(tmp_path / "m", data))
    assert cfg.model_type == expect
    assert cfg.layer_types == ["linear_attention", "full_attention"] * 2
    assert cfg.rope_theta == 1e7
    if "moe" in model_type:
        assert cfg.num_experts == 8 and cfg.intermediate_size == 0
        assert all(cfg.is_moe_layer(i) for i in range(4))
    assert cfg.num_mtp_layers == 0


@pytest.mark.parametrize("data, match", [
    ({"model_type": "llama"}, r"unsupported model_type 'llama'; supported: qwen3_next, qwen3_5"),
    ({"hidden_size": 8}, r"unsupported model_type None"),
    (dict(TEXT_KEYS, model_type="qwen3_next", layer_types=["full_attention"]), r"layer_types must be a list of"),
    (dict(TEXT_KEYS, model_type="qwen3_next", layer_types=["linear_attention", "sliding"] * 2), r"'sliding'"),
    ({k: v for k, v in dict(TEXT_KEYS, model_type="qwen3_next").items() if k != "vocab_size"}, r"'vocab_size'"),
    (dict(TEXT_KEYS, model_type="qwen3_next", hidden_size="64"), r"hidden_size must be an integer"),
    (dict(TEXT_KEYS, model_type="qwen3_next", eos_token_id="x"), r"eos_token_id must be an int"),
])
def test_config_errors(tmp_path, data, match):
    with pytest.raises(LoaderError, match=match):
        read_model_config(write_config(tmp_path / "m", data))


def test_config_folder_errors(tmp_path):
    with pytest.raises(LoaderError, match="does not exist"):
        read_model_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoaderError, match="has no config.json"):
        read_model_config(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(LoaderError, match="not valid JSON"):
        read_model_config(bad)
    with pytest.raises(LoaderError, match="does not exist"):
        load_model(tmp_path / "nope", torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# MTP counting


def test_mtp_counted_from_tensor_names(ckpts):
    # The released Qwen3-Next config has no MTP key: the mtp.layers.{i}. names decide.
    folder, hf = ckpts["next_mtp"]
    raw = json.loads((folder / "config.json").read_text())
    assert "num_nextn_predict_layers" not in raw and "mtp_num_hidden_layers" not in raw
    assert read_model_config(folder).num_mtp_layers == 1


def test_mtp_declared_but_absent_logs_once(tmp_path, caplog):
    folder, _ = make_qwen3_5_conditional(tmp_path / "m", with_mtp=False)
    with caplog.at_level(logging.INFO, logger="tinyserve.loader"):
        cfg = read_model_config(folder)
    assert cfg.num_mtp_layers == 0
    msgs = [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()]
    assert len(msgs) == 1 and "no mtp.* tensors" in msgs[0]


def test_mtp_config_zero_ignores_tensors(ckpts, tmp_path):
    folder = copy_of(ckpts, "next_mtp", tmp_path)
    update_config(folder, num_nextn_predict_layers=0)
    assert read_model_config(folder).num_mtp_layers == 0
    model = load_model(folder, torch.float32)
    assert model.mtp is None


# ---------------------------------------------------------------------------------------------------------------
# loading


def test_load_weights_match_transformers(ckpts):
    for kind in ("next", "text", "cond"):
        folder, hf = ckpts[kind]
        model = load_model(folder, torch.float32)
        assert torch.equal(model.embed_tokens, hf.model.embed_tokens.weight)
        assert torch.equal(model.lm_head, hf.lm_head.weight)
        assert torch.equal(model.norm, 1.0 + hf.model.norm.weight)      # a zero-centred norm: held as 1 + w


def test_load_dtype(ckpts):
    model = load_model(ckpts["text"][0], torch.bfloat16)
    assert model.embed_tokens.dtype == torch.bfloat16
    assert torch.equal(model.embed_tokens, ckpts["text"][1].model.embed_tokens.weight.to(torch.bfloat16))


def test_sharded_equals_single_file(tmp_path):
    single, _ = make_qwen3_next(tmp_path / "single", with_mtp=True)
    sharded, _ = make_qwen3_next(tmp_path / "sharded", with_mtp=True, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (sharded / "model.safetensors").exists()
    a, b = load_model(single, torch.float32), load_model(sharded, torch.float32)
    assert a.mtp is not None
    assert_same_params(a, b)


def test_conditional_loads_the_vision_tower_unless_told_not_to(ckpts, caplog):
    folder, hf = ckpts["cond"]
    names = read_tensors(folder)
    assert any(n.startswith("model.visual.") for n in names)
    assert any(n.startswith("model.language_model.layers.") for n in names)
    with_tower = load_model(folder, torch.float32)
    assert with_tower.visual is not None
    assert torch.equal(with_tower.visual.pos_table, names["model.visual.pos_embed.weight"])
    with caplog.at_level(logging.INFO, logger="tinyserve.loader"):
        model = load_model(folder, torch.float32, vision=False)           # model.vision = false
    assert model.visual is None
    vision_lines = [r for r in caplog.records if "vision" in r.getMessage()]
    assert len(vision_lines) == 1
    assert model.mtp is not None and model.cfg.num_mtp_layers == 1
    assert torch.equal(model.mtp.fc, hf.mtp_state_dict["mtp.fc.weight"])
    assert torch.equal(model.mtp.norm, 1.0 + hf.mtp_state_dict["mtp.norm.weight"])        # held as 1 + w


def test_text_and_conditional_load_the_same_text_model(tmp_path):
    text, _ = make_qwen3_5_text(tmp_path / "t", seed=3)
    cond, _ = make_qwen3_5_conditional(tmp_path / "c", with_mtp=False, seed=3)
    assert_same_params(load_model(text, torch.float32), load_model(cond, torch.float32, vision=False))


def test_fused_expert_tensors_equal_per_expert(ckpts, tmp_path):
    folder = copy_of(ckpts, "next", tmp_path)
    tensors = read_tensors(folder)
    cfg = read_model_config(folder)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts"
        gate = [tensors.pop(f"{p}.{e}.gate_proj.weight") for e in range(cfg.num_experts)]
        up = [tensors.pop(f"{p}.{e}.up_proj.weight") for e in range(cfg.num_experts)]
        down = [tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(cfg.num_experts)]
        tensors[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        tensors[f"{p}.down_proj"] = torch.stack(down)
    write_tensors(folder, tensors)
    assert_same_params(load_model(ckpts["next"][0], torch.float32), load_model(folder, torch.float32))


def test_fused_expert_wrong_shape(ckpts, tmp_path):
    folder = copy_of(ckpts, "next", tmp_path)
    tensors = read_tensors(folder)
    p = "model.layers.0.mlp.experts"
    down = [tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(8)]
    tensors[f"{p}.down_proj"] = torch.stack(down).transpose(1, 2).contiguous()  # [E, I, H] instead of [E, H, I]
    write_tensors(folder, tensors)
    with pytest.raises(LoaderError, match=r"model.layers.0.mlp.experts.down_proj: expected \[8, 64, 32\], "
                                          r"found \[8, 32, 64\]"):
        load_model(folder, torch.float32)


def test_tied_embeddings_ignore_stored_lm_head(tmp_path):
    folder, hf = make_qwen3_5_text(tmp_path / "m", tie_word_embeddings=True)
    tensors = read_tensors(folder)
    tensors["lm_head.weight"] = torch.zeros(256, 64)  # a stale head some exports keep: must not be used
    write_tensors(folder, tensors)
    model = load_model(folder, torch.float32)
    assert model.cfg.tie_word_embeddings
    assert torch.equal(model.lm_head, hf.model.embed_tokens.weight)


# ---------------------------------------------------------------------------------------------------------------
# load errors


def test_error_no_safetensors(ckpts, tmp_path):
    folder = copy_of(ckpts, "text", tmp_path)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(LoaderError, match="has no .safetensors weight files"):
        load_model(folder, torch.float32)
    assert read_model_config(folder).hidden_size == 64  # config alone is still readable


def test_error_index_names_missing_shard(tmp_path):
    folder, _ = make_qwen3_5_text(tmp_path / "m", max_shard_size="100KB")
    shard = sorted(folder.glob("model-0000*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(LoaderError, match=re.escape(shard.name)):
        load_model(folder, torch.float32)


def test_error_missing_tensor(ckpts, tmp_path):
    folder = copy_of(ckpts, "cond", tmp_path)
    tensors = read_tensors(folder)
    del tensors["model.language_model.layers.1.linear_attn.A_log"]
    write_tensors(folder, tensors)
    with pytest.raises(LoaderError, match=r"missing 1 tensor\(s\).*layers\.1\.linear_attn\.A_log"):
        load_model(folder, torch.float32)


def test_error_many_missing_tensors_are_counted(ckpts, tmp_path):
    folder = copy_of(ckpts, "next", tmp_path)
    tensors = {k: v for k, v in read_tensors(folder).items() if ".mlp.experts." not in k}
    write_tensors(folder, tensors)
    with pytest.raises(LoaderError) as e:
        load_model(folder, torch.float32)
    msg = str(e.value)
    assert "missing 96 tensor(s)" in msg and "(86 more)" in msg
    assert "layers.0.mlp.experts.0.gate_proj.weight" in msg


def test_error_unexpected_tensor(ckpts, tmp_path):
    folder = copy_of(ckpts, "text", tmp_path)
    tensors = read_tensors(folder)
    tensors["model.layers.0.mlp.bias_that_should_not_be_here"] = torch.zeros(3)
    write_tensors(folder, tensors)
    with pytest.raises(LoaderError, match=r"1 tensor\(s\) the model does not use: "
                                          r"model\.layers\.0\.mlp\.bias_that_should_not_be_here"):
        load_model(folder, torch.float32)


def test_error_shape_mismatch(ckpts, tmp_path):
    folder = copy_of(ckpts, "next", tmp_path)
    tensors = read_tensors(folder)
    tensors["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    write_tensors(folder, tensors)
    with pytest.raises(LoaderError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight: expected \[64, 64\], "
                                          r"found \[32, 64\]"):
        load_model(folder, torch.float32)


def test_error_config_mismatch_with_weights(ckpts, tmp_path):
    """A config that disagrees with the weights (more layers) reports the missing layer's tensors."""
    folder = copy_of(ckpts, "text", tmp_path)
    update_config(folder, num_hidden_layers=5, layer_types=["linear_attention"] * 4 + ["full_attention"])
    with pytest.raises(LoaderError, match=r"missing \d+ tensor\(s\).*layers\.4\."):
        load_model(folder, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# FP8


def _next_fp8_ignore(n_layers: int) -> tuple[list[str], object]:
    """Qwen3-Next-FP8 style exact-name modules_to_not_convert (qwen-hybrid.md §4.1)."""
    names = ["lm_head", "mtp.fc"]
    for i in range(n_layers):
        names += [f"model.layers.{i}.mlp.gate", f"model.layers.{i}.mlp.shared_expert_gate",
                  f"model.layers.{i}.linear_attn.in_proj_ba"]
    names += ["mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.shared_expert_gate"]
    return names, lambda m: m in names


CT_IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn\\.in_proj_[ab]$",
             "re:.*linear_attn\\.in_proj_ba$", "re:^mtp\\.fc$"]


def _ct_ignored(module: str) -> bool:
    return module == "lm_head" or any(re.match(p[3:], module) for p in CT_IGNORE if p.startswith("re:"))


@pytest.mark.parametrize("block", [(128, 128), (32, 48)])
def test_fp8_block_qwen_format(ckpts, tmp_path, block):
    ignore, ignored = _next_fp8_ignore(4)
    dst = tmp_path / "fp8"
    ref = fp8_checkpoint(ckpts["next_mtp"][0], dst, method="fp8", strategy="block", block=block,
                         ignore=ignore, ignored=ignored)
    t = read_tensors(dst)
    assert t["model.layers.0.linear_attn.in_proj_qkvz.weight"].dtype == torch.float8_e4m3fn
    # 192 x 64 rows/cols: partial blocks on both dims for 128x128 and for 32x48
    assert t["model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv"].shape == (
        math.ceil(192 / block[0]), math.ceil(64 / block[1]))
    assert t["model.layers.0.linear_attn.in_proj_ba.weight"].dtype == torch.float32
    assert t["mtp.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    a, b = load_model(dst, torch.float32), load_model(ref, torch.float32)
    assert_same_params(a, b)
    # the reference really is the dequantized weight: close to, not equal to, the original
    orig = read_tensors(ckpts["next_mtp"][0])["model.layers.0.linear_attn.out_proj.weight"]
    deq = read_tensors(ref)["model.layers.0.linear_attn.out_proj.weight"]
    assert not torch.equal(orig, deq) and torch.allclose(orig, deq, atol=0.1 * orig.abs().max().item())


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_fp8_compressed_tensors(ckpts, tmp_path, strategy):
    dst = tmp_path / "ct"
    ref = fp8_checkpoint(ckpts["cond"][0], dst, method="compressed-tensors", strategy=strategy,
                         ignore=CT_IGNORE, ignored=_ct_ignored)
    t = read_tensors(dst)
    name = "model.language_model.layers.3.self_attn.q_proj"
    assert t[name + ".weight"].dtype == torch.float8_e4m3fn
    assert t[name + ".weight_scale"].shape == {"channel": (256, 1), "tensor": (), "block": (2, 1)}[strategy]
    assert t["model.language_model.layers.0.linear_attn.in_proj_b.weight"].dtype == torch.float32
    assert_same_params(load_model(dst, torch.float32), load_model(ref, torch.float32))


def test_fp8_per_tensor_scale_of_shape_1(ckpts, tmp_path):
    dst = tmp_path / "ct"
    ref = fp8_checkpoint(ckpts["text"][0], dst, method="compressed-tensors", strategy="tensor",
                         ignore=CT_IGNORE, ignored=_ct_ignored)
    tensors = read_tensors(dst)
    for k in [k for k in tensors if k.endswith(".weight_scale")]:
        tensors[k] = tensors[k].reshape(1)
    write_tensors(dst, tensors)
    assert_same_params(load_model(dst, torch.float32), load_model(ref, torch.float32))


def test_fp8_weight_without_scale(ckpts, tmp_path):
    ignore, ignored = _next_fp8_ignore(4)
    dst = tmp_path / "fp8"
    fp8_checkpoint(ckpts["next"][0], dst, method="fp8", strategy="block", ignore=ignore, ignored=ignored)
    tensors = read_tensors(dst)
    del tensors["model.layers.2.linear_attn.out_proj.weight_scale_inv"]
    write_tensors(dst, tensors)
    with pytest.raises(LoaderError, match=r"FP8 tensor 'model\.layers\.2\.linear_attn\.out_proj\.weight' "
                                          r"has no scale"):
        load_model(dst, torch.float32)


def test_fp8_scale_without_weight(ckpts, tmp_path):
    dst = tmp_path / "ct"
    fp8_checkpoint(ckpts["text"][0], dst, method="compressed-tensors", strategy="channel",
                   ignore=CT_IGNORE, ignored=_ct_ignored)
    tensors = read_tensors(dst)
    tensors["model.layers.0.mlp.nothing.weight_scale"] = torch.ones(4, 1)
    write_tensors(dst, tensors)
    with pytest.raises(LoaderError, match=r"scale tensor 'model\.layers\.0\.mlp\.nothing\.weight_scale' has no "
                                          r"weight"):
        load_model(dst, torch.float32)


def test_fp8_scale_for_plain_weight(ckpts, tmp_path):
    dst = tmp_path / "ct"
    fp8_checkpoint(ckpts["text"][0], dst, method="compressed-tensors", strategy="channel",
                   ignore=CT_IGNORE, ignored=_ct_ignored)
    tensors = read_tensors(dst)
    tensors["lm_head.weight_scale"] = torch.ones(256, 1)
    write_tensors(dst, tensors)
    with pytest.raises(LoaderError, match=r"'lm_head\.weight_scale' belongs to weight 'lm_head\.weight', "
                                          r"which is not FP8"):
        load_model(dst, torch.float32)


def test_fp8_ignored_module_stored_as_fp8(ckpts, tmp_path):
    """Honour the ignore list: a module listed there must be a plain tensor."""
    dst = tmp_path / "ct"
    fp8_checkpoint(ckpts["text"][0], dst, method="compressed-tensors", strategy="channel",
                   ignore=CT_IGNORE + ["model.layers.1.mlp.down_proj"], ignored=_ct_ignored)
    with pytest.raises(LoaderError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' is stored as FP8 but "
                                          r"its module is listed as not quantized"):
        load_model(dst, torch.float32)


def test_fp8_bad_scale_shape(ckpts, tmp_path):
    dst = tmp_path / "ct"
    fp8_checkpoint(ckpts["text"][0], dst, method="compressed-tensors", strategy="channel",
                   ignore=CT_IGNORE, ignored=_ct_ignored)
    tensors = read_tensors(dst)
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(3, 5)
    write_tensors(dst, tensors)
    with pytest.raises(LoaderError, match=r"scale tensor 'model\.layers\.0\.mlp\.up_proj\.weight_scale' has "
                                          r"shape \[3, 5\]"):
        load_model(dst, torch.float32)


def test_unsupported_quant_method(ckpts, tmp_path):
    folder = copy_of(ckpts, "text", tmp_path)
    update_config(folder, quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(LoaderError, match=r"quant_method 'bitsandbytes' is not supported"):
        load_model(folder, torch.float32)


@pytest.mark.parametrize("prefix", ["model.language_model.", "model."])
def test_fp8_block_qwen3_5_exact_ignore_names(ckpts, tmp_path, prefix):
    """Qwen3.5 FP8 releases list unquantized modules by name; accept checkpoint or text-model spelling."""
    plain = [f"layers.{i}.linear_attn.in_proj_{x}" for i in range(3) for x in "ab"]
    ignore = ["lm_head", "mtp.fc"] + [prefix + n for n in plain]
    dst = tmp_path / "fp8"
    ref = fp8_checkpoint(ckpts["cond"][0], dst, method="fp8", strategy="block",
                         ignore=ignore, ignored=lambda m: m in ("lm_head", "mtp.fc")
                         or m.removeprefix("model.language_model.") in plain)
    t = read_tensors(dst)
    assert t["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.float8_e4m3fn
    assert t["mtp.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert_same_params(load_model(dst, torch.float32), load_model(ref, torch.float32))


def test_weights_moved_onto_huge_pages_keep_their_values_and_ties():
    """models.weights.place_on_huge_pages: every parameter lands in the one advised mapping, 64-byte aligned, with
    its values; a tied parameter stays one tensor."""
    import mmap
    from tinyserve.models.weights import place_on_huge_pages
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(50, 24), torch.nn.Linear(24, 50, bias=False), torch.nn.LayerNorm(24))
    net[1].weight = net[0].weight                            # tied, as a tied LM head
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    moved, mapping = place_on_huge_pages(net)
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        assert (moved, mapping) == (0, None)
        return
    start = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    assert moved == len(mapping) and net[1].weight is net[0].weight
    for n, p in net.named_parameters():
        assert torch.equal(p, before[n]) and p.data_ptr() % 64 == 0
        assert start <= p.data_ptr() < start + moved
