"""Tiny Qwen3-Next / Qwen3.5 checkpoints built with transformers 5.24 on CPU (fp32), saved as safetensors.

Every helper returns ``(folder, hf_model)``: ``hf_model`` is an eval-mode transformers model whose logits are the
oracle for the text model stored in ``folder``. All 1-D parameters are perturbed (norm weights initialise to zero in
transformers), so an engine that confuses the ``(1 + w)`` and ``w`` RMSNorm conventions fails the logit checks.

When a checkpoint is written with MTP tensors, they are also available as ``hf_model.mtp_state_dict``
(checkpoint names, ``mtp.*``) because transformers itself has no Qwen MTP module to hold them.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from header_only import QWEN3_5_27B, make_header_only  # noqa: F401 - re-exported (the tests import them from here)

# Shapes from qwen-hybrid.md §5: rotary_dim = 8, GDN r = nv/nk = 2 (exercises the GQA head mapping), GQA 4:2.
TINY_COMMON: dict = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2,
)
TINY_MOE: dict = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
)
ROPE_NEXT: dict = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
ROPE_35: dict = {**ROPE_NEXT, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
TINY_VISION: dict = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
    num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2,
)


def _config_kwargs(base: dict, overrides: dict) -> dict:
    """Merge overrides; a changed layer count without explicit layer_types gets the [lin, lin, lin, full] pattern."""
    kw = {**base, **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = kw["num_hidden_layers"]
        kw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return kw


def perturb_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every 1-D parameter random values (norms are zero-init, A_log/dt_bias are constant-init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _randn(shape: tuple[int, ...], g: torch.Generator, std: float) -> torch.Tensor:
    return torch.randn(shape, generator=g) * std


def _mtp_tensors(cfg: dict, *, moe: bool, seed: int) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors in the release layout (qwen-hybrid.md §2.5): one full-attention layer."""
    g = torch.Generator().manual_seed(1000 + seed)
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w, n = 0.05, 0.3  # Linear std, 1-D (norm) std
    t: dict[str, torch.Tensor] = {
        "mtp.fc.weight": _randn((H, 2 * H), g, w),
        "mtp.pre_fc_norm_embedding.weight": _randn((H,), g, n),
        "mtp.pre_fc_norm_hidden.weight": _randn((H,), g, n),
        "mtp.norm.weight": _randn((H,), g, n),
    }
    p = "mtp.layers.0."
    t[p + "input_layernorm.weight"] = _randn((H,), g, n)
    t[p + "post_attention_layernorm.weight"] = _randn((H,), g, n)
    t[p + "self_attn.q_proj.weight"] = _randn((2 * nh * hd, H), g, w)
    t[p + "self_attn.k_proj.weight"] = _randn((kv * hd, H), g, w)
    t[p + "self_attn.v_proj.weight"] = _randn((kv * hd, H), g, w)
    t[p + "self_attn.o_proj.weight"] = _randn((H, nh * hd), g, w)
    t[p + "self_attn.q_norm.weight"] = _randn((hd,), g, n)
    t[p + "self_attn.k_norm.weight"] = _randn((hd,), g, n)
    if moe:
        E, I, S = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        t[p + "mlp.gate.weight"] = _randn((E, H), g, w)
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = _randn((I, H), g, w)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = _randn((I, H), g, w)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = _randn((H, I), g, w)
        t[p + "mlp.shared_expert.gate_proj.weight"] = _randn((S, H), g, w)
        t[p + "mlp.shared_expert.up_proj.weight"] = _randn((S, H), g, w)
        t[p + "mlp.shared_expert.down_proj.weight"] = _randn((H, S), g, w)
        t[p + "mlp.shared_expert_gate.weight"] = _randn((1, H), g, w)
    else:
        I = cfg["intermediate_size"]
        t[p + "mlp.gate_proj.weight"] = _randn((I, H), g, w)
        t[p + "mlp.up_proj.weight"] = _randn((I, H), g, w)
        t[p + "mlp.down_proj.weight"] = _randn((H, I), g, w)
    return t


def add_tensors(folder: Path, tensors: dict[str, torch.Tensor], shard_name: str = "model-extra.safetensors") -> None:
    """Add tensors to a saved checkpoint: into model.safetensors (single file) or as a new shard in the index."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if index.exists():
        data = json.loads(index.read_text())
        save_file(tensors, str(folder / shard_name), metadata={"format": "pt"})
        data["weight_map"].update({k: shard_name for k in tensors})
        index.write_text(json.dumps(data, indent=2))
    else:
        single = folder / "model.safetensors"
        merged = load_file(str(single))
        merged.update(tensors)
        save_file(merged, str(single), metadata={"format": "pt"})


def _update_config(folder: Path, fn) -> None:
    path = Path(folder) / "config.json"
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=2))


def _save(model: torch.nn.Module, folder: Path, max_shard_size: str | int | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    kw = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(str(folder), safe_serialization=True, **kw)


def _add_mtp(folder: Path, kw: dict, model, *, moe: bool, seed: int, count_in_config: bool) -> None:
    """A random NEXTN head (mtp.* tensors) in a shard of its own, kept on `model` for the tests' oracle;
    count_in_config: config.json says mtp_num_hidden_layers = 1 (where the folder's config does not already)."""
    mtp = _mtp_tensors(kw, moe=moe, seed=seed)
    add_tensors(folder, mtp, "model-mtp.safetensors")
    if count_in_config:
        _update_config(folder, lambda d: d.update(mtp_num_hidden_layers=1))
    model.mtp_state_dict = mtp


def make_qwen3_next(path: str | Path, *, max_shard_size: str | int | None = None, with_mtp: bool = False,
                    seed: int = 0, **overrides) -> tuple[Path, Qwen3NextForCausalLM]:
    """Tiny Qwen3-Next (MoE, interleaved GDN projections, per-expert tensors as in the release)."""
    folder = Path(path)
    kw = _config_kwargs({**TINY_COMMON, **TINY_MOE, "rope_parameters": dict(ROPE_NEXT)}, overrides)
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**kw)).eval()
    perturb_(model, seed)
    _save(model, folder, max_shard_size)
    if with_mtp:
        # The Qwen3-Next release has no MTP count in config.json; vLLM defaults num_nextn_predict_layers to 1.
        _add_mtp(folder, kw, model, moe=True, seed=seed, count_in_config=False)
    return folder, model


def make_qwen3_5_text(path: str | Path, *, max_shard_size: str | int | None = None, with_mtp: bool = False,
                      seed: int = 0, **overrides) -> tuple[Path, Qwen3_5ForCausalLM]:
    """Tiny dense Qwen3.5 text-only checkpoint (model_type qwen3_5_text, weights under `model.`)."""
    folder = Path(path)
    kw = _config_kwargs({**TINY_COMMON, "rope_parameters": dict(ROPE_35)}, overrides)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw)).eval()
    perturb_(model, seed)
    _save(model, folder, max_shard_size)
    if with_mtp:
        _add_mtp(folder, kw, model, moe=False, seed=seed, count_in_config=True)
    return folder, model


def make_qwen3_5_moe(path: str | Path, *, max_shard_size: str | int | None = None, with_mtp: bool = False,
                     seed: int = 0, **overrides) -> tuple[Path, Qwen3_5MoeForCausalLM]:
    """Tiny Qwen3.5-MoE text-only checkpoint (model_type qwen3_5_moe_text; transformers saves the experts per
    expert, as the releases ship them)."""
    folder = Path(path)
    kw = _config_kwargs({**TINY_COMMON, **TINY_MOE, "rope_parameters": dict(ROPE_35)}, overrides)
    kw.pop("intermediate_size")                     # MoE text configs carry no dense width
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kw)).eval()
    perturb_(model, seed)
    _save(model, folder, max_shard_size)
    if with_mtp:
        _add_mtp(folder, kw, model, moe=True, seed=seed, count_in_config=True)
    return folder, model


def make_qwen3_5_conditional(path: str | Path, with_mtp: bool = True, *, max_shard_size: str | int | None = None,
                             seed: int = 0, **overrides) -> tuple[Path, Qwen3_5ForCausalLM]:
    """A folder shaped like a real Qwen3.5 release (Qwen3_5ForConditionalGeneration, nested text_config,
    `model.language_model.*`, `model.visual.*`, `lm_head.weight`, `mtp.*`). The returned oracle is a
    Qwen3_5ForCausalLM holding the same text weights."""
    folder = Path(path)
    kw = _config_kwargs({**TINY_COMMON, "rope_parameters": dict(ROPE_35)}, overrides)
    torch.manual_seed(seed)
    text = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw)).eval()
    perturb_(text, seed)
    full_cfg = Qwen3_5Config(text_config=dict(kw), vision_config=dict(TINY_VISION),
                             tie_word_embeddings=kw["tie_word_embeddings"])
    full = Qwen3_5ForConditionalGeneration(full_cfg).eval()
    # Copy the text weights into the multimodal model: `model.X` -> `model.language_model.X`.
    sd = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
          for k, v in text.state_dict().items()}
    missing, unexpected = full.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith("model.visual.") for k in missing), missing
    _save(full, folder, max_shard_size)

    def fix(d: dict) -> None:
        d["architectures"] = ["Qwen3_5ForConditionalGeneration"]
        d["model_type"] = "qwen3_5"
        d["text_config"]["mtp_num_hidden_layers"] = 1
        d["text_config"]["mtp_use_dedicated_embeddings"] = False
        d["eos_token_id"] = kw["eos_token_id"]

    _update_config(folder, fix)
    if with_mtp:
        _add_mtp(folder, kw, text, moe=False, seed=seed, count_in_config=False)
    return folder, text


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a saved checkpoint (single-file or sharded), by checkpoint name."""
    folder = Path(folder)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def write_tensors(folder: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace a checkpoint's weights with `tensors` as one model.safetensors (drops any index and shards)."""
    folder = Path(folder)
    for f in list(folder.glob("*.safetensors")) + list(folder.glob("model.safetensors.index.json")):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


def update_config(folder: str | Path, **changes) -> None:
    """Set top-level config.json keys."""
    _update_config(Path(folder), lambda d: d.update(changes))


def make_agreeing_head(folder: str | Path, *, mix: float = 0.0, head_noise: float = 0.0, head_layer: float = 0.0,
                       seed: int = 0) -> None:
    """Rewrite a checkpoint with `mtp.*` so its NEXTN head agrees with the model by construction (for speculative
    decoding tests and benchmarks; random heads accept almost nothing).

    Every layer's output projections (attention o_proj, GDN out_proj, MLP / expert down projections) are scaled by
    `mix`: at 0 each layer passes its input through, so the final hidden state at p is norm(embed(x_p)) and the next
    token depends on x_p alone. The head's fc passes the (normed) token embedding through ([I | 0]), its own layer
    adds nothing, and mtp.norm is the model's final norm: its logits at p are the model's logits at p+1, so it drafts
    exactly the model's next token. mix > 0 gives the model real dependence on its context (the GDN states, the KV)
    that the head cannot see, and head_noise perturbs fc: both lower acceptance. head_layer > 0 keeps the head's own
    layer, its output projections scaled by it, so its drafts also depend on its attention over its own KV.
    """
    t = read_tensors(folder)
    g = torch.Generator().manual_seed(seed)
    outputs = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "down_proj.weight", "experts.down_proj")
    for name in list(t):
        if name.startswith("mtp."):
            continue
        if name.endswith(outputs):
            t[name] = t[name] * mix
    H = t["mtp.fc.weight"].shape[0]
    fc = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
    t["mtp.fc.weight"] = fc + head_noise * torch.randn(fc.shape, generator=g)
    t["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(H)
    final_norm = "model.norm.weight" if "model.norm.weight" in t else "model.language_model.norm.weight"
    t["mtp.norm.weight"] = t[final_norm].clone()
    for name in list(t):
        if name.startswith("mtp.layers.") and name.endswith(outputs):
            t[name] = t[name] * head_layer
    write_tensors(folder, t)


# ---- a tiny multimodal (image input) Qwen3.5 checkpoint ----

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# depth 2, head_dim 16 (divisible by 4 for the 2-D rotary), a 4x4 position table (every image interpolates it),
# patch 4 (one LM token per 8x8 pixels, so test images are tens to hundreds of tokens)
TINY_VL_VISION: dict = {**TINY_VISION, "depth": 2, "hidden_act": "gelu_pytorch_tanh"}
# preprocessor_config.json of the tiny VL checkpoint: the release's fields, with sizes scaled to patch 4
TINY_VL_PREPROCESSOR: dict = {
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "size": {"shortest_edge": 1024, "longest_edge": 65536}, "patch_size": 4, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
    "rescale_factor": 1 / 255, "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
}


def _vl_chat_template() -> str:
    """demo.CHAT_TEMPLATE with the released Qwen3.5 template's image/video parts (qwen-vision.md §4): an item with an
    `image` / `image_url` key or type 'image' renders as <|vision_start|><|image_pad|><|vision_end|> in place (one
    pad; the server expands it), videos likewise, and a system message may contain neither."""
    from tinyserve.demo import CHAT_TEMPLATE

    old_macro = CHAT_TEMPLATE[:CHAT_TEMPLATE.index("{%- endmacro -%}")]
    new_macro = r"""{%- macro render_content(content, is_system=false) -%}
{%- if content is none -%}{{- '' -}}{%- elif content is string -%}{{- content -}}
{%- else -%}{%- for part in content -%}
{%- if part is mapping and ('image' in part or 'image_url' in part or part.type == 'image') -%}
{%- if is_system -%}{{- raise_exception('System message cannot contain images.') -}}{%- endif -%}
{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
{%- elif part is mapping and ('video' in part or part.type == 'video') -%}
{%- if is_system -%}{{- raise_exception('System message cannot contain videos.') -}}{%- endif -%}
{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
{%- elif part is mapping and part.text is defined -%}{{- part.text -}}
{%- else -%}{{- raise_exception('Unexpected item type in content.') -}}
{%- endif -%}{%- endfor -%}
{%- endif -%}
"""
    out = CHAT_TEMPLATE.replace(old_macro, new_macro)
    for old, new in [("render_content(messages[0].content)", "render_content(messages[0].content, true)"),
                     ("render_content(message.content)", "render_content(message.content, message.role == 'system')")]:
        assert out.count(old) == 1, f"demo.CHAT_TEMPLATE changed: {old!r} not found once"
        out = out.replace(old, new)
    assert out != CHAT_TEMPLATE
    return out


VL_CHAT_TEMPLATE = _vl_chat_template()


def _write_vl_tokenizer_files(folder: Path) -> dict[str, int]:
    """tokenizer.json (the demo byte-level BPE + the vision specials), tokenizer_config.json, chat_template.jinja,
    generation_config.json and preprocessor_config.json, as demo.write_demo_tokenizer_files writes them. Returns the
    ids of the special tokens the config needs."""
    from tokenizers import AddedToken

    from tinyserve.demo import EOS_TOKEN, build_demo_tokenizer

    tok = build_demo_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(str(folder / "tokenizer.json"), pretty=False)
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS + [EOS_TOKEN, "<|endoftext|>"]}
    assert all(v is not None for v in ids.values()), ids
    eos_ids = [ids[EOS_TOKEN], ids["<|endoftext|>"]]

    def write(name: str, data: dict) -> None:
        (folder / name).write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    write("tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "bos_token": None,
        "eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "chat_template": VL_CHAT_TEMPLATE,
    })
    (folder / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE, encoding="utf-8")
    write("generation_config.json", {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": eos_ids,
                                     "pad_token_id": ids["<|endoftext|>"], "do_sample": False})
    write("preprocessor_config.json", TINY_VL_PREPROCESSOR)
    return {"vocab": tok.get_vocab_size(with_added_tokens=True), "eos": ids[EOS_TOKEN],
            "bos": ids["<|endoftext|>"], "vision_start": ids["<|vision_start|>"],
            "vision_end": ids["<|vision_end|>"], "image": ids["<|image_pad|>"], "video": ids["<|video_pad|>"]}


def _sharpen_vision_(visual: torch.nn.Module, seed: int) -> None:
    """Unit-scale vision matrices (std 1/sqrt(fan_in)) and a unit-scale position table. At transformers' init (std
    0.02) attention scores are ~0, so the softmax is uniform and neither the 2-D rotary nor the patch order inside an
    image changes the features measurably; here q.k / sqrt(d) has a std of about 4 and they all matter."""
    g = torch.Generator().manual_seed(2000 + seed)
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if name == "pos_embed.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                fan_in = p[0].numel()
                scale = 2.0 if name.endswith("attn.qkv.weight") else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * scale / fan_in ** 0.5)


def make_qwen3_5_vl(path: str | Path, *, seed: int = 0, with_mtp: bool = False, vision: dict | None = None,
                    **overrides) -> tuple[Path, Qwen3_5ForConditionalGeneration]:
    """A servable tiny multimodal Qwen3.5 folder: weights (`model.language_model.*`, `model.visual.*`,
    `lm_head.weight`, optionally `mtp.*`), config.json with the vision token ids, the demo tokenizer plus the vision
    specials, a chat template that renders images, and a preprocessor_config.json for patch 4.

    The oracle is the full Qwen3_5ForConditionalGeneration (eval, fp32) with every 1-D parameter perturbed, vision
    included, and the vision matrices at unit scale (_sharpen_vision_). `overrides` change the text config, `vision`
    the vision config. MTP tensors, when asked for, are in `oracle.mtp_state_dict` (transformers has no module for
    them)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    ids = _write_vl_tokenizer_files(folder)
    vocab = -(-ids["vocab"] // 16) * 16          # padded past the tokenizer, as released vocabularies are
    base = {**TINY_COMMON, "vocab_size": vocab, "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
            "max_position_embeddings": 4096, "rope_parameters": dict(ROPE_35)}
    kw = _config_kwargs(base, overrides)
    assert kw["vocab_size"] >= ids["vocab"], "vocab_size must cover the tokenizer"
    torch.manual_seed(seed)
    cfg = Qwen3_5Config(text_config=dict(kw), vision_config={**TINY_VL_VISION, **(vision or {})},
                        image_token_id=ids["image"], video_token_id=ids["video"],
                        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
                        tie_word_embeddings=kw["tie_word_embeddings"])
    full = Qwen3_5ForConditionalGeneration(cfg).eval()
    perturb_(full, seed)
    _sharpen_vision_(full.model.visual, seed)
    _save(full, folder, None)

    def fix(d: dict) -> None:
        d["architectures"] = ["Qwen3_5ForConditionalGeneration"]
        d["model_type"] = "qwen3_5"
        d["text_config"]["mtp_num_hidden_layers"] = 1     # as released; without mtp.* tensors the loader turns MTP off
        d["text_config"]["mtp_use_dedicated_embeddings"] = False
        d["eos_token_id"] = kw["eos_token_id"]

    _update_config(folder, fix)
    # save_pretrained rewrote generation_config.json from the model config: keep the chat-aware one
    _write_vl_tokenizer_files(folder)
    if with_mtp:
        _add_mtp(folder, kw, full, moe=False, seed=seed, count_in_config=False)
    return folder, full


# ---------------------------------------------------------------------------------------------------------------
# FP8 checkpoints

FP8_MAX = 448.0


def _is_quantizable(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name and "visual" not in name


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    out, inp = shape
    return scale.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]


def quantize(w: torch.Tensor, strategy: str, block: tuple[int, int] = (128, 128)):
    """FP8 e4m3 weight and its dequant multiplier (scale), plus the exactly dequantized reference weight."""
    w = w.float()
    out, inp = w.shape
    if strategy == "tensor":
        scale = (w.abs().max() / FP8_MAX).clamp(min=1e-12).reshape(())
        full = scale
    elif strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        full = scale
    else:
        nb0, nb1 = math.ceil(out / block[0]), math.ceil(inp / block[1])
        pad = torch.zeros(nb0 * block[0], nb1 * block[1])
        pad[:out, :inp] = w.abs()
        amax = pad.reshape(nb0, block[0], nb1, block[1]).amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full = _expand(scale, (out, inp), block)
    q = (w / full).to(torch.float8_e4m3fn)
    return q, scale, q.float() * full


def fp8_checkpoint(src: Path, dst: Path, *, method: str, strategy: str, block=(128, 128),
                   ignore: list[str], ignored) -> Path:
    """Quantize src's Linear weights into dst (FP8 + scales + quantization_config) and write the dequantized
    reference checkpoint to dst.parent / (dst.name + "_ref")."""
    shutil.copytree(src, dst)
    ref = dst.parent / (dst.name + "_ref")
    shutil.copytree(src, ref)
    tensors = read_tensors(src)
    quant: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    n_quantized = 0
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if _is_quantizable(name, t) and not ignored(module):
            q, scale, d = quantize(t, strategy, block)
            quant[name] = q
            quant[module + (".weight_scale_inv" if method == "fp8" else ".weight_scale")] = scale
            if method == "compressed-tensors":
                quant[module + ".input_scale"] = torch.tensor(0.5)  # static activation scale: unused
            deq[name] = d
            n_quantized += 1
        else:
            quant[name] = t
            deq[name] = t
    assert n_quantized > 10
    write_tensors(dst, quant)
    write_tensors(ref, deq)
    if method == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(block) if strategy == "block" else None, "modules_to_not_convert": ignore}
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy}
        if strategy == "block":
            weights["block_structure"] = list(block)
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                            "input_activations": {"num_bits": 8, "type": "float",
                                                                  "strategy": "tensor", "dynamic": False}}},
              "ignore": ignore}
    update_config(dst, quantization_config=qc)
    return ref
