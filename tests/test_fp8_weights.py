"""FP8 checkpoints with their linear weights kept FP8 (loader fp8_weights "w8a16" / "w8a8", what a CUDA plan picks).

The oracle is the same checkpoint dequantized at load (its `_ref` twin, written by fp8_checkpoint): w8a16 multiplies
by exactly the dequantized weight, so greedy tokens are identical and logits equal to fp32 rounding; w8a8 quantizes
activations too, so its logits are only close. The plan's byte count from the headers is checked against the
model it loads, and which weights stay FP8 against the placement rule (whole parameters, parts on block rows)."""
from __future__ import annotations

import re

import pytest
import torch

from checkpoints import fp8_checkpoint, make_qwen3_5_conditional, make_qwen3_5_moe, make_qwen3_5_text, make_qwen3_next
from conftest import engine_for, tokens
from tinyserve.blob import weights_digest
from tinyserve.kernels.fp8_weight import Fp8Weight
from tinyserve.kernels.linear import linear
from tinyserve.loader import load_model, read_checkpoint
from tinyserve.sampling import SamplingParams

QWEN_IGNORE = ["lm_head", "re:.*linear_attn\\.in_proj_[ab]$"]       # what Qwen3.5 FP8 releases leave in bf16


def _qwen_ignored(module: str) -> bool:
    return module == "lm_head" or re.match(r".*linear_attn\.in_proj_[ab]$", module) is not None


@pytest.fixture(scope="module")
def text_fp8(tmp_path_factory):
    """Qwen3.5 dense with a NEXTN head, quant_method fp8 with 16 x 128 blocks (the tiny model's rows are
    multiples of 16, as the 27B's are of 128)."""
    root = tmp_path_factory.mktemp("fp8")
    src, _ = make_qwen3_5_text(root / "text", with_mtp=True)
    ref = fp8_checkpoint(src, root / "text_fp8", method="fp8", strategy="block", block=(16, 128),
                         ignore=QWEN_IGNORE, ignored=_qwen_ignored)
    return root / "text_fp8", ref


def fp8_modules(model) -> dict[str, Fp8Weight]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Weight)}


def greedy(model, prompts, **tables) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    return engine_for(model, **{"engine": {"page_size": 16}, **tables}).generate(prompts, params)


PROMPTS = [tokens(37, 0), tokens(5, 1), tokens(80, 2)]


def test_linear_weights_stay_fp8_where_whole_parameters_are(text_fp8):
    folder, _ = text_fp8
    model = load_model(folder, torch.float32, fp8_weights="w8a16")
    kept = fp8_modules(model)
    attn, gdn = model.cfg.attn_layer_ids[0], model.cfg.gdn_layer_ids[0]
    assert {f"layers.{gdn}.mixer.in_proj_qkvz", f"layers.{gdn}.mixer.out_proj", f"layers.{attn}.mixer.qkv_proj",
            f"layers.{attn}.mixer.o_proj", "layers.0.mlp.gate_up", "layers.0.mlp.down", "mtp.fc",
            "mtp.layers.0.mixer.qkv_proj"} <= set(kept)
    names = {n for n, _ in model.named_parameters()}
    assert f"layers.{gdn}.mixer.in_proj_ba" in names and "lm_head" in names and "embed_tokens" in names
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.block == (16, 128) and not m.act_quant
               for m in kept.values())
    assert not any(p.is_meta for p in model.parameters())          # everything laid out on meta got memory


def test_w8a16_decodes_as_the_dequantized_checkpoint(text_fp8):
    folder, ref = text_fp8
    kept, deq = load_model(folder, torch.float32, fp8_weights="w8a16"), load_model(ref, torch.float32)
    assert greedy(kept, PROMPTS) == greedy(deq, PROMPTS)
    # and through NEXTN drafting (the head's fc and layer are FP8 too) and the prefix cache
    spec = {"speculative": {"algorithm": "nextn", "max_running": 8}}
    assert greedy(kept, PROMPTS, **spec) == greedy(deq, PROMPTS)


def test_w8a8_logits_are_close_to_the_dequantized_checkpoints(text_fp8):
    """Activations quantized to e4m3 per 128-group: a few percent per GEMM, not a wrong scale row (which would be
    off by orders of magnitude)."""
    folder, ref = text_fp8
    kept, deq = load_model(folder, torch.float32, fp8_weights="w8a8"), load_model(ref, torch.float32)
    assert all(m.act_quant for m in fp8_modules(kept).values())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, kept.cfg.hidden_size, generator=g)
    assert torch.equal(kept.compute_logits(x), deq.compute_logits(x))      # lm_head is listed as bf16: equal
    for name, m in fp8_modules(kept).items():
        w = deq.get_parameter(name)
        x = torch.randn(6, w.shape[1], generator=g)
        exact = torch.nn.functional.linear(x, w)
        assert (linear(x, m) - exact).norm() / exact.norm() < 0.08, name


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_the_plan_counts_the_bytes_the_model_holds(text_fp8, mode):
    assert_plan_counts_what_loads(text_fp8[0], mode)
    assert read_checkpoint(text_fp8[0])[1].fp8_values == 0                  # a CPU plan dequantizes


def assert_plan_counts_what_loads(folder, mode: str) -> None:
    """The headers' count (read_checkpoint, what the plan uses) is what the loaded model holds, FP8 and not."""
    _, counted = read_checkpoint(folder, keep_fp8=True)
    model = load_model(folder, torch.float32, fp8_weights=mode)
    fp8 = fp8_modules(model).values()
    assert counted.fp8_values == sum(m.weight.numel() for m in fp8)
    assert counted.fp8_scales == sum(m.scale.numel() for m in fp8)
    assert counted.bytes(4) == _held_bytes(model)


def _held_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())


def test_parts_off_the_block_rows_are_dequantized(tmp_path):
    """48-row blocks: the attention q rows (a multiple of 48) fit, but k starts mid-block, so the fused q|k|v is
    dequantized; o_proj and the MLP stay FP8. The plan agrees with what is loaded."""
    src, _ = make_qwen3_5_text(tmp_path / "text")
    ref = fp8_checkpoint(src, tmp_path / "fp8", method="fp8", strategy="block", block=(48, 128),
                         ignore=QWEN_IGNORE, ignored=_qwen_ignored)
    model = load_model(tmp_path / "fp8", torch.float32, fp8_weights="w8a16")
    kept = fp8_modules(model)
    attn = model.cfg.attn_layer_ids[0]
    q_rows = model.layers[attn].mixer.q_rows
    assert q_rows % 48 != 0 or model.layers[attn].mixer.kv_rows % 48 != 0
    assert f"layers.{attn}.mixer.qkv_proj" not in kept and f"layers.{attn}.mixer.o_proj" in kept
    _, counted = read_checkpoint(tmp_path / "fp8", keep_fp8=True)
    assert counted.fp8_values == sum(m.weight.numel() for m in kept.values())
    assert greedy(model, PROMPTS[:2]) == greedy(load_model(ref, torch.float32), PROMPTS[:2])


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_compressed_tensors_scales(tmp_path, strategy):
    """compressed-tensors: per-channel scales are blocks of (1, K); per-tensor ones become per-channel."""
    src, _ = make_qwen3_5_conditional(tmp_path / "cond")
    ref = fp8_checkpoint(src, tmp_path / "ct", method="compressed-tensors", strategy=strategy, block=(16, 128),
                         ignore=QWEN_IGNORE, ignored=_qwen_ignored)
    model = load_model(tmp_path / "ct", torch.float32, fp8_weights="w8a16")
    kept = fp8_modules(model)
    assert kept and all(m.block == ((16, 128) if strategy == "block" else (1, m.weight.shape[1]))
                        for m in kept.values())
    assert greedy(model, PROMPTS[:2]) == greedy(load_model(ref, torch.float32), PROMPTS[:2])


def test_qwen3_next_keeps_what_is_not_reordered(tmp_path):
    """Qwen3-Next: the interleaved in_proj_qkvz is reordered at load, so it is dequantized; attention, the shared
    expert and the routed experts (stacked from per-expert tensors on block rows) stay FP8."""
    src, _ = make_qwen3_next(tmp_path / "next")
    ignore = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn\\.in_proj_ba$"]
    ref = fp8_checkpoint(src, tmp_path / "fp8b", method="fp8", strategy="block", block=(16, 128), ignore=ignore,
                         ignored=lambda m: m == "lm_head" or any(re.match(p[3:], m) for p in ignore[1:]))
    model = load_model(tmp_path / "fp8b", torch.float32, fp8_weights="w8a16")
    kept = set(fp8_modules(model))
    attn, gdn = model.cfg.attn_layer_ids[0], model.cfg.gdn_layer_ids[0]
    assert f"layers.{attn}.mixer.qkv_proj" in kept and f"layers.{gdn}.mixer.out_proj" in kept
    assert {"layers.0.mlp.shared_expert.gate_up", "layers.0.mlp.experts_gate_up", "layers.0.mlp.experts_down"} <= kept
    assert f"layers.{gdn}.mixer.in_proj_qkvz" not in kept
    assert greedy(model, PROMPTS[:2]) == greedy(load_model(ref, torch.float32), PROMPTS[:2])


def test_the_file_tiers_fingerprint_tells_fp8_from_dequantized(text_fp8):
    """Keys of the persistent tier: KV computed with FP8 weights is not the dequantized model's KV."""
    folder, ref = text_fp8
    assert weights_digest(load_model(folder, torch.float32, fp8_weights="w8a16")) != \
        weights_digest(load_model(ref, torch.float32))



# ---------------------------------------------------------------------------------------------------------------
# MoE experts kept FP8 (Qwen3-Next, Qwen3.5-MoE): stacked Fp8Weights [E, N, K] filled from per-expert tensors

MOE_IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn\\.in_proj_(ba|a|b)$"]


def _moe_ignored(module: str) -> bool:
    return module == "lm_head" or any(re.match(p[3:], module) for p in MOE_IGNORE[1:])


MOE_MAKERS = {"next": make_qwen3_next, "moe": make_qwen3_5_moe}


@pytest.fixture(scope="module", params=list(MOE_MAKERS))
def moe_fp8(request, tmp_path_factory):
    """Qwen3-Next / Qwen3.5-MoE with a NEXTN head (an MoE layer too), quant_method fp8 with 16 x 128 blocks: the
    tiny experts' gate, up and down rows (32, 32, 64) start on block rows, as the releases' (512 / 128) do."""
    root = tmp_path_factory.mktemp(f"moe_fp8_{request.param}")
    src, _ = MOE_MAKERS[request.param](root / "src", with_mtp=True)
    ref = fp8_checkpoint(src, root / "fp8", method="fp8", strategy="block", block=(16, 128), ignore=MOE_IGNORE,
                         ignored=_moe_ignored)
    return root / "fp8", ref


def expert_modules(model) -> list[str]:
    return [f"{prefix}.mlp.{part}" for prefix in [f"layers.{i}" for i in range(len(model.layers))] + ["mtp.layers.0"]
            for part in ("experts_gate_up", "experts_down")]


def test_moe_experts_stay_fp8(moe_fp8):
    folder, _ = moe_fp8
    model = load_model(folder, torch.float32, fp8_weights="w8a16")
    kept = fp8_modules(model)
    cfg = model.cfg
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert set(expert_modules(model)) <= set(kept)
    for name in expert_modules(model):
        m = kept[name]
        N, K = (2 * I, H) if name.endswith("gate_up") else (H, I)
        assert m.weight.shape == (E, N, K) and m.weight.dtype == torch.float8_e4m3fn
        assert m.scale.shape == (E, N // 16, 1) and m.block == (16, 128) and not m.act_quant
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.mlp.router" in names and "layers.0.mlp.shared_expert_gate" in names      # listed as bf16
    gdn = cfg.gdn_layer_ids[0]
    assert (f"layers.{gdn}.mixer.in_proj_qkvz" in kept) != cfg.interleaved_gdn_proj   # Qwen3-Next's is reordered
    assert not any(p.is_meta for p in model.parameters())


def test_moe_w8a16_decodes_as_the_dequantized_checkpoint(moe_fp8):
    folder, ref = moe_fp8
    kept, deq = load_model(folder, torch.float32, fp8_weights="w8a16"), load_model(ref, torch.float32)
    expect = greedy(deq, PROMPTS)
    assert greedy(kept, PROMPTS) == expect
    spec = {"speculative": {"algorithm": "nextn", "max_running": 8}}     # the head's MoE layer is FP8 too
    assert greedy(kept, PROMPTS, **spec) == expect


def test_moe_w8a8_expert_gemms_are_close(moe_fp8):
    """Every expert's GEMM with activations quantized per row and 128-group: a few percent, not a wrong scale row
    or expert."""
    folder, ref = moe_fp8
    kept, deq = load_model(folder, torch.float32, fp8_weights="w8a8"), load_model(ref, torch.float32)
    g = torch.Generator().manual_seed(0)
    for name in expert_modules(kept):
        m, w = kept.get_submodule(name), deq.get_parameter(name)
        assert m.act_quant
        for e in range(m.shape[0]):
            x = torch.randn(6, w.shape[2], generator=g)
            exact = torch.nn.functional.linear(x, w[e])
            assert (linear(x, m.expert(e)) - exact).norm() / exact.norm() < 0.08, (name, e)


@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_moe_plan_counts_the_bytes_the_model_holds(moe_fp8, mode):
    assert_plan_counts_what_loads(moe_fp8[0], mode)


def test_experts_off_the_block_rows(tmp_path):
    """24-row blocks: an expert's up rows start at row 32, mid-block, so the stacked gate | up is dequantized,
    while down (one part per expert, its last block partial) stays FP8; the plan agrees, and the layer runs one
    GEMM of each kind."""
    src, _ = make_qwen3_5_moe(tmp_path / "moe")
    ref = fp8_checkpoint(src, tmp_path / "fp8", method="fp8", strategy="block", block=(24, 128), ignore=MOE_IGNORE,
                         ignored=_moe_ignored)
    model = load_model(tmp_path / "fp8", torch.float32, fp8_weights="w8a16")
    kept = fp8_modules(model)
    assert "layers.0.mlp.experts_down" in kept and "layers.0.mlp.experts_gate_up" not in kept
    assert kept["layers.0.mlp.experts_down"].scale.shape == (8, 3, 1)
    assert isinstance(model.layers[0].mlp.experts_gate_up, torch.nn.Parameter)
    _, counted = read_checkpoint(tmp_path / "fp8", keep_fp8=True)
    assert counted.fp8_values == sum(m.weight.numel() for m in kept.values())
    assert counted.bytes(4) == _held_bytes(model)
    assert greedy(model, PROMPTS[:2]) == greedy(load_model(ref, torch.float32), PROMPTS[:2])
