"""The 4-bit bench checkpoint of bench/serve.py --weights w4 (bench/common.w4_checkpoint), on a small bench-shaped
model: compressed-tensors' own decompressor reads what it wrote as the published W4A16 layout says (symmetric int4,
group 128, float16 scales amax / 7, codes round(w / scale)), tinyserve loads it with the decoder layers' linear
weights held 4-bit and dequantizing to exactly that, each within half a scale of the float32 weight, the rest (the
GDN's in_proj_a / in_proj_b, embeddings, lm_head, norms) as stored, and its engine generates from it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import BenchModelSpec, bench_checkpoint, w4_checkpoint  # noqa: E402
from conftest import engine_for  # noqa: E402
from tinyserve.kernels.w4_weight import W4Weight  # noqa: E402
from tinyserve.loader import load_model  # noqa: E402
from tinyserve.sampling import SamplingParams  # noqa: E402

pytest.importorskip("compressed_tensors")

# every K a multiple of 128: hidden 256, intermediate 384, 4 x 64 attention and GDN value heads
SPEC = BenchModelSpec(vocab_size=512, hidden_size=256, num_hidden_layers=4, intermediate_size=384,
                      num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                      max_position_embeddings=4096, max_shard_size="2MB")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    src = bench_checkpoint(tmp_path_factory.mktemp("bench"), SPEC, "tiny")
    return src, w4_checkpoint(src)


def oracle(w: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized weight, per-element scale) of the published recipe, in float32."""
    N, K = w.shape
    g = w.reshape(N, K // group, group)
    s = (g.abs().amax(-1, keepdim=True) / 7).clamp(min=1e-6).half().float()
    q = torch.clamp(torch.round(g / s), -8, 7)
    return (q * s).reshape(N, K), s.expand_as(g).reshape(N, K)


def test_compressed_tensors_reads_the_published_layout(folders):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    src, w4 = folders
    qc = json.loads((w4 / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}.items() <= \
        qc["config_groups"]["group_0"]["weights"].items()
    assert (w4 / "tokenizer.json").is_file() and (w4 / "tokenizer_config.json").is_file()
    ref = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    got = {k: v for f in w4.glob("*.safetensors") for k, v in load_file(f).items()}
    index = json.loads((w4 / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(got)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=128))
    quantized = {k[: -len(".weight_packed")] for k in got if k.endswith(".weight_packed")}
    suffixes = {m.split(".", 3)[3] for m in quantized}
    assert suffixes == {"linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
                        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert len(quantized) == 3 * 3 + 4 + 4 * 3      # 3 GDN mixers, 1 attention mixer, 4 MLPs
    for m in quantized:
        t = {role: got[f"{m}.{role}"] for role in ("weight_packed", "weight_scale", "weight_shape")}
        assert t["weight_packed"].dtype == torch.int32 and t["weight_scale"].dtype == torch.float16
        deq = PackedQuantizationCompressor.decompress(t, scheme)["weight"]     # in the scales' float16
        want, _ = oracle(ref[m + ".weight"])
        assert torch.equal(deq, want.half()), m
    for name, t in ref.items():                 # everything else as stored
        if not name.endswith(".weight") or name[: -len(".weight")] not in quantized:
            assert torch.equal(got[name], t), name
    assert "model.layers.0.linear_attn.in_proj_a.weight" in got and "lm_head.weight" in got


def test_tinyserve_holds_it_4bit_within_half_a_scale(folders):
    src, w4 = folders
    model, ref = load_model(w4, torch.float32), load_model(src, torch.float32)
    held = {n: m for n, m in model.named_modules() if isinstance(m, W4Weight)}
    gdn, attn = model.cfg.gdn_layer_ids[0], model.cfg.attn_layer_ids[0]
    assert {f"layers.{gdn}.mixer.in_proj_qkvz", f"layers.{gdn}.mixer.out_proj", f"layers.{attn}.mixer.qkv_proj",
            f"layers.{attn}.mixer.o_proj", "layers.0.mlp.gate_up", "layers.0.mlp.down"} <= set(held)
    assert len(held) == 4 * 4
    params = dict(ref.named_parameters())
    for name, w in held.items():
        f32 = params[name].detach()
        want, scale = oracle(f32)
        deq = w.dequantize(torch.float32)
        assert torch.equal(deq, want), name
        assert bool(((deq - f32).abs() <= scale * (0.5 + 1e-3)).all()), name
    for name, p in model.named_parameters():      # in_proj_ba, embeddings, lm_head, norms, A_log, conv: as stored
        assert torch.equal(p, params[name]), name
    eng = engine_for(model, engine={"page_size": 16})
    out = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0]) == 4
