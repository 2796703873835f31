"""The text model's hyper-parameters and the count of its weights (no torch here: the memory plan and `tinyserve
--check` read them without importing torch)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """The text model's hyper-parameters, read from a checkpoint's config.json by tinyserve.model_config."""

    model_type: str                      # qwen3_next | qwen3_5_text | qwen3_5_moe_text
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]               # "linear_attention" | "full_attention" per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int               # dense MLP width (dense layers only)
    num_experts: int = 0                 # 0: dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    tie_word_embeddings: bool = False
    interleaved_gdn_proj: bool = False   # Qwen3-Next checkpoints: in_proj_qkvz / in_proj_ba interleaved per group
    num_mtp_layers: int = 0              # NEXTN layers present in the checkpoint (mtp.*)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str = "float32"         # dtype the checkpoint was saved in
    # M-RoPE (Qwen3.5): which of the (t, h, w) position rows drives each rotary frequency; text-only positions are
    # equal rows, i.e. plain 1-D RoPE. Empty: 1-D RoPE only (Qwen3-Next).
    mrope_section: list[int] = field(default_factory=list)
    mrope_interleaved: bool = False
    # Image input: the checkpoint's vision_config (None: no vision tower loaded) and the special token ids
    vision_config: dict | None = None
    image_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    folder: str = ""                     # where the checkpoint was read from (its processor config lives there)
    vision_parameters: int = 0           # weight values of the vision tower (in the plan's weights)
    # linear weights an FP8 checkpoint keeps FP8 (parameter name -> scale block), when read for a device that
    # keeps them (loader.read_checkpoint(keep_fp8=True))
    fp8_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)

    # ---- derived sizes ----
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class WeightCount:
    """The weight values a model will hold and how they are stored (loader.read_checkpoint counts them from the
    safetensors headers alone)."""

    values: int              # every weight value (the vision tower's too, unless model.vision = false)
    fp8_values: int = 0      # of those, the values kept as FP8 (1 byte each) ...
    fp8_scales: int = 0      # ... and their block scales (fp32, not in `values`)
    w4_values: int = 0       # of `values`, those held 4-bit (kernels/w4_weight.W4Weight) ...
    w4_bytes: int = 0        # ... in this many bytes: codes, group scales, zero points, act-order permutations
    w4_format: str = ""      # how they are stored, for the plan's line: "gptq g128", "nvfp4 g16", ...

    def bytes(self, element_size: int) -> int:
        """Bytes on the device when the other weights are held in a dtype of `element_size` bytes."""
        return ((self.values - self.fp8_values - self.w4_values) * element_size + self.fp8_values
                + 4 * self.fp8_scales + self.w4_bytes)
