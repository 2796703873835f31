"""Qwen3.5 vision: the ViT tower that turns image patches into LM embeddings, and the 3-row (M-RoPE) positions the
language model uses for prompts that contain images.

Tower (as transformers computes it): patch embedding (a Conv3d with stride = kernel, i.e. a linear map over
each flattened patch), a learned square position table resampled bilinearly (align_corners) to each image's patch
grid, 2-D rotary, pre-norm blocks with full non-causal attention inside each image (images never see each other),
then a merger that concatenates each 2x2 block of patches into one LM token. Patch rows arrive in the processor's
order: 2x2 merge blocks in raster order, each block's 4 patches in raster order (tinyserve/images.py).

Positions (§3.3, §3.4): text advances one position per token; an image of gh x gw merged tokens puts token (r, c)
at (t, h, w) = (cur, cur + r, cur + c) and then advances cur by max(gh, gw). Everything after the last image sits at
sequence index + delta (delta <= 0), so decode needs only delta.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tinyserve.models.weights import WeightLoaders, empty_param


# ---------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass
class VisionConfig:
    """The vision tower's hyper-parameters (a checkpoint's `vision_config`). Defaults are transformers'
    Qwen3_5VisionConfig defaults, which is what a field missing from config.json means there too."""

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    eps: float = 1e-6                   # every LayerNorm in the tower (fixed in transformers, not in the config)

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        rope = d.get("rope_parameters") or {}
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
        base = cls()

        def pick(key: str, alias: str | None = None):
            if key in d:
                return d[key]
            if alias is not None and alias in d:
                return d[alias]
            return getattr(base, key)

        cfg = cls(depth=int(pick("depth", "num_hidden_layers")), hidden_size=int(pick("hidden_size")),
                  num_heads=int(pick("num_heads", "num_attention_heads")),
                  intermediate_size=int(pick("intermediate_size")), patch_size=int(pick("patch_size")),
                  temporal_patch_size=int(pick("temporal_patch_size")),
                  spatial_merge_size=int(pick("spatial_merge_size")), out_hidden_size=int(pick("out_hidden_size")),
                  num_position_embeddings=int(pick("num_position_embeddings")),
                  in_channels=int(pick("in_channels")), hidden_act=str(pick("hidden_act")),
                  rope_theta=float(theta))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config: hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"vision_config: head_dim {self.head_dim} must be a multiple of 4 (2-D rotary uses "
                             f"head_dim/4 frequencies per axis)")
        if self.table_side ** 2 != self.num_position_embeddings:
            raise ValueError(f"vision_config: num_position_embeddings {self.num_position_embeddings} is not a "
                             f"square")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config: unsupported hidden_act {self.hidden_act!r} "
                             f"(supported: {', '.join(sorted(_ACTIVATIONS))})")

    # ---- derived sizes ----
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one pixel_values row: [C][T][P][P]."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def table_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def num_parameters(self) -> int:
        """Parameter count from the shapes alone (for the memory plan; allocates nothing)."""
        D, I, O, M = self.hidden_size, self.intermediate_size, self.out_hidden_size, self.merge_unit * self.hidden_size
        block = 2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D) + (I * D + I) + (D * I + D)
        return ((D * self.patch_dim + D) + self.num_position_embeddings * D + self.depth * block
                + 2 * D + (M * M + M) + (O * M + O))


# ---------------------------------------------------------------------------------------------------------------
# tower
# ---------------------------------------------------------------------------------------------------------------

def _block_order(grid: torch.Tensor, merge: int) -> torch.Tensor:
    """[h, w, ...] patch grid -> [h*w, ...] rows in the processor's order (2x2 blocks, each block in raster order)."""
    h, w = grid.shape[:2]
    rest = grid.shape[2:]
    g = grid.reshape(h // merge, merge, w // merge, merge, *rest).transpose(1, 2)
    return g.reshape(h * w, *rest)


def _axis_taps(n: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) resampling of a `side`-long axis to `n` points: low tap, high tap (edge-clamped)
    and the high tap's weight. Point i samples the table at i * (side - 1) / (n - 1), in float32 as transformers."""
    src = torch.arange(n, dtype=torch.float32, device=device) * (side - 1) / max(n - 1, 1)
    low = src.floor()
    frac = src - low
    lo = low.long().clamp(0, side - 1)
    hi = (low.long() + 1).clamp(0, side - 1)
    return lo, hi, frac


class VisionBlock(nn.Module):
    """Pre-norm ViT block: x + proj(attn(LN1 x)), then x + fc2(act(fc1(LN2 x))). qkv rows: [q | k | v], all heads."""

    def __init__(self, cfg: VisionConfig, dtype, device) -> None:
        super().__init__()
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.cfg = cfg
        self.norm1_weight, self.norm1_bias = empty_param((D,), dtype, device), empty_param((D,), dtype, device)
        self.norm2_weight, self.norm2_bias = empty_param((D,), dtype, device), empty_param((D,), dtype, device)
        self.qkv_weight, self.qkv_bias = empty_param((3 * D, D), dtype, device), empty_param((3 * D,), dtype, device)
        self.proj_weight, self.proj_bias = empty_param((D, D), dtype, device), empty_param((D,), dtype, device)
        self.fc1_weight, self.fc1_bias = empty_param((I, D), dtype, device), empty_param((I,), dtype, device)
        self.fc2_weight, self.fc2_bias = empty_param((D, I), dtype, device), empty_param((D,), dtype, device)

    def weight_loaders(self) -> WeightLoaders:
        w, D, I = WeightLoaders(), self.cfg.hidden_size, self.cfg.intermediate_size
        for name, shape, target in [
                ("norm1.weight", (D,), self.norm1_weight), ("norm1.bias", (D,), self.norm1_bias),
                ("norm2.weight", (D,), self.norm2_weight), ("norm2.bias", (D,), self.norm2_bias),
                ("attn.qkv.weight", (3 * D, D), self.qkv_weight), ("attn.qkv.bias", (3 * D,), self.qkv_bias),
                ("attn.proj.weight", (D, D), self.proj_weight), ("attn.proj.bias", (D,), self.proj_bias),
                ("mlp.linear_fc1.weight", (I, D), self.fc1_weight), ("mlp.linear_fc1.bias", (I,), self.fc1_bias),
                ("mlp.linear_fc2.weight", (D, I), self.fc2_weight), ("mlp.linear_fc2.bias", (D,), self.fc2_bias)]:
            w.add(name, shape, target)
        return w

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]) -> torch.Tensor:
        cfg = self.cfg
        N, nh, hd = x.shape[0], cfg.num_heads, cfg.head_dim
        h = F.layer_norm(x, (cfg.hidden_size,), self.norm1_weight, self.norm1_bias, cfg.eps)
        q, k, v = F.linear(h, self.qkv_weight, self.qkv_bias).view(N, 3, nh, hd).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # full attention inside each image (or video frame pair); SDPA per segment never builds cross-image scores
        outs, start = [], 0
        for n in segments:
            qs, ks, vs = (t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=hd ** -0.5)[0].transpose(0, 1))
            start += n
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        x = x + F.linear(o.reshape(N, cfg.hidden_size), self.proj_weight, self.proj_bias)
        h = F.layer_norm(x, (cfg.hidden_size,), self.norm2_weight, self.norm2_bias, cfg.eps)
        h = _ACTIVATIONS[cfg.hidden_act](F.linear(h, self.fc1_weight, self.fc1_bias))
        return x + F.linear(h, self.fc2_weight, self.fc2_bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Full-head NeoX rotary in float32 (cos/sin [N, head_dim]), cast back to x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos.unsqueeze(1) + torch.cat([-x2, x1], dim=-1) * sin.unsqueeze(1)).to(x.dtype)


class VisionTower(nn.Module):
    """pixel_values [N, C*T*P*P] (rows in the processor's order) + per-item grids (t, h, w) in patches ->
    features [N / merge^2, out_hidden_size], items concatenated in the order given."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        super().__init__()
        cfg.validate()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        D, M = cfg.hidden_size, cfg.merge_unit * cfg.hidden_size
        self.patch_weight = empty_param((D, cfg.patch_dim), dtype, device)   # the Conv3d kernel, flattened
        self.patch_bias = empty_param((D,), dtype, device)
        self.pos_table = empty_param((cfg.num_position_embeddings, D), dtype, device)
        self.blocks = nn.ModuleList([VisionBlock(cfg, dtype, device) for _ in range(cfg.depth)])
        self.merger_norm_weight = empty_param((D,), dtype, device)
        self.merger_norm_bias = empty_param((D,), dtype, device)
        self.merger_fc1_weight = empty_param((M, M), dtype, device)
        self.merger_fc1_bias = empty_param((M,), dtype, device)
        self.merger_fc2_weight = empty_param((cfg.out_hidden_size, M), dtype, device)
        self.merger_fc2_bias = empty_param((cfg.out_hidden_size,), dtype, device)
        # per axis: head_dim/4 frequencies; rows and columns share them
        half = cfg.head_dim // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                                               device=self.device) / half))
        self._weights = self.weight_loaders()

    # ---- weights ----
    def weight_loaders(self) -> WeightLoaders:
        """Checkpoint names without the `model.visual.` prefix."""
        cfg, w = self.cfg, WeightLoaders()
        D, M, O = cfg.hidden_size, cfg.merge_unit * cfg.hidden_size, cfg.out_hidden_size
        P, T, C = cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels
        w.add("patch_embed.proj.weight", (D, C, T, P, P), self.patch_weight)
        w.add("patch_embed.proj.bias", (D,), self.patch_bias)
        w.add("pos_embed.weight", (cfg.num_position_embeddings, D), self.pos_table)
        for i, block in enumerate(self.blocks):
            w.merge(f"blocks.{i}.", block.weight_loaders())
        w.add("merger.norm.weight", (D,), self.merger_norm_weight)
        w.add("merger.norm.bias", (D,), self.merger_norm_bias)
        w.add("merger.linear_fc1.weight", (M, M), self.merger_fc1_weight)
        w.add("merger.linear_fc1.bias", (M,), self.merger_fc1_bias)
        w.add("merger.linear_fc2.weight", (O, M), self.merger_fc2_weight)
        w.add("merger.linear_fc2.bias", (O,), self.merger_fc2_bias)
        return w

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        return dict(self._weights.shapes)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """name without the `model.visual.` prefix; the tensor is cast to the tower's dtype by the copy."""
        loader = self._weights.loaders.get(name)
        if loader is None:
            raise KeyError(f"unexpected vision tensor {name!r}")
        shape = self._weights.shapes[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"vision tensor {name!r}: shape {tuple(tensor.shape)}, expected {shape}")
        loader(tensor.to(self.device))

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # ---- sizes ----
    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        """LM tokens (feature rows) one item of grid (t, h, w) patches produces."""
        t, h, w = grid
        return t * h * w // self.cfg.merge_unit

    def check_grids(self, grids: list[tuple[int, int, int]], rows: int) -> None:
        m = self.cfg.spatial_merge_size
        for g in grids:
            t, h, w = g
            if t < 1 or h < m or w < m or h % m or w % m:
                raise ValueError(f"vision grid {tuple(g)}: h and w must be positive multiples of the merge size {m}")
        total = sum(t * h * w for t, h, w in grids)
        if total != rows:
            raise ValueError(f"pixel_values has {rows} patch rows but the grids {list(grids)} need {total}")

    # ---- forward ----
    def _positions(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per patch row: the resampled position embedding (float32) and the rotary cos/sin [N, head_dim]."""
        dev, side, m = self.device, self.cfg.table_side, self.cfg.spatial_merge_size
        table = self.pos_table.float().view(side, side, -1)
        pos, ang = [], []
        for t, h, w in grids:
            rlo, rhi, rf = _axis_taps(h, side, dev)
            clo, chi, cf = _axis_taps(w, side, dev)
            wr = torch.stack([1 - rf, rf], dim=1)                    # [h, 2]
            wc = torch.stack([1 - cf, cf], dim=1)                    # [w, 2]
            row_taps, col_taps = (rlo, rhi), (clo, chi)
            grid = None
            for i in range(2):                                       # taps summed as transformers does: r0c0, r0c1,
                for j in range(2):                                   # r1c0, r1c1
                    tap = table[row_taps[i]][:, col_taps[j]] * (wr[:, i, None] * wc[None, :, j]).unsqueeze(-1)
                    grid = tap if grid is None else grid + tap
            pos.append(_block_order(grid, m).repeat(t, 1))
            # rotary angles: [row * inv_freq | col * inv_freq], in patch units
            r = torch.arange(h, device=dev, dtype=torch.float32)[:, None, None] * self.inv_freq
            c = torch.arange(w, device=dev, dtype=torch.float32)[None, :, None] * self.inv_freq
            rc = torch.cat([r.expand(h, w, -1), c.expand(h, w, -1)], dim=-1)
            ang.append(_block_order(rc, m).repeat(t, 1))
        angles = torch.cat(ang)
        emb = torch.cat([angles, angles], dim=-1)
        return torch.cat(pos), emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        cfg = self.cfg
        grids = [tuple(int(v) for v in g) for g in grids]
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values must be [N, {cfg.patch_dim}], got {list(pixel_values.shape)}")
        self.check_grids(grids, pixel_values.shape[0])
        x = F.linear(pixel_values.to(self.device, self.dtype), self.patch_weight, self.patch_bias)
        pos, cos, sin = self._positions(grids)
        x = x + pos.to(x.dtype)
        segments = [h * w for t, h, w in grids for _ in range(t)]   # each frame pair of a video is its own segment
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        D = cfg.hidden_size
        y = F.layer_norm(x, (D,), self.merger_norm_weight, self.merger_norm_bias, cfg.eps)
        y = F.gelu(F.linear(y.view(-1, cfg.merge_unit * D), self.merger_fc1_weight, self.merger_fc1_bias))
        return F.linear(y, self.merger_fc2_weight, self.merger_fc2_bias)


# ---------------------------------------------------------------------------------------------------------------
# M-RoPE positions
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageSpan:
    """One image in a token sequence: `start` is the sequence index of its first <|image_pad|>; grid_h x grid_w is
    its size in merged tokens (LM tokens), so it covers [start, start + grid_h * grid_w)."""

    start: int
    grid_h: int
    grid_w: int

    @property
    def length(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def advance(self) -> int:
        """Positions the image occupies (text after it continues from cur + advance)."""
        return max(self.grid_h, self.grid_w)


def _sorted_spans(images: list[ImageSpan]) -> list[ImageSpan]:
    spans = sorted(images, key=lambda s: s.start)
    prev_end = 0
    for s in spans:
        if s.grid_h < 1 or s.grid_w < 1 or s.start < 0:
            raise ValueError(f"bad image span {s}")
        if s.start < prev_end:
            raise ValueError(f"image spans overlap: {s} starts before index {prev_end}")
        prev_end = s.end
    return spans


def mrope_delta(images: list[ImageSpan]) -> int:
    """Rotary position minus sequence index for every token after the last image (<= 0): each image shifts what
    follows by max(gh, gw) - gh * gw."""
    return sum(s.advance - s.length for s in images)


def mrope_positions_range(start: int, end: int, images: list[ImageSpan]) -> torch.Tensor:
    """Rows (t, h, w) [3, end - start] int64 of the sequence indices [start, end): exactly the slice of
    mrope_positions over the whole prompt, in O(end - start + number of images). Indices past the last image (e.g.
    decode tokens beyond the prompt) are i + delta."""
    if not 0 <= start <= end:
        raise ValueError(f"bad range [{start}, {end})")
    idx = torch.arange(start, end, dtype=torch.int64)
    out = idx.unsqueeze(0).repeat(3, 1)          # text: sequence index + the shift of the images before it
    shift, text_from = 0, start                  # shift: sum of (advance - length) of the images passed
    for s in _sorted_spans(images):
        if s.end <= start:
            shift += s.advance - s.length
            continue
        if s.start >= end:
            break
        if text_from < s.start:
            out[:, text_from - start:s.start - start] += shift
        lo, hi = max(s.start, start) - start, min(s.end, end) - start
        j = idx[lo:hi] - s.start                 # raster index inside the image
        cur = s.start + shift
        out[0, lo:hi] = cur
        out[1, lo:hi] = cur + j // s.grid_w
        out[2, lo:hi] = cur + j % s.grid_w
        shift += s.advance - s.length
        text_from = s.end
    if text_from < end:
        out[:, text_from - start:] += shift
    return out


def mrope_positions(length: int, images: list[ImageSpan]) -> tuple[torch.Tensor, int]:
    """Rows (t, h, w) [3, length] int64 for a whole prompt, and delta = max(position) + 1 - length."""
    spans = _sorted_spans(images)
    if spans and spans[-1].end > length:
        raise ValueError(f"image span {spans[-1]} runs past the prompt length {length}")
    return mrope_positions_range(0, length, spans), mrope_delta(spans)


def mrope_rows(num_freqs: int, mrope_section: list[int], interleaved: bool) -> torch.Tensor:
    """Which position row (0 = t, 1 = h, 2 = w) drives each rotary frequency [num_freqs] int64 (CPU; cached, do not
    modify).

    Interleaved (Qwen3-VL / Qwen3.5): frequency j uses h if j % 3 == 1 and j < 3 * s_h, w if j % 3 == 2 and
    j < 3 * s_w, else t. Contiguous (Qwen2-VL / Qwen2.5-VL): the first s_t frequencies use t, the next s_h h, the
    rest w."""
    if len(mrope_section) != 3:
        raise ValueError(f"mrope_section must have 3 entries (t, h, w), got {mrope_section}")
    return _mrope_rows(num_freqs, tuple(int(v) for v in mrope_section), bool(interleaved))


@functools.lru_cache(maxsize=32)
def _mrope_rows(num_freqs: int, mrope_section: tuple[int, int, int], interleaved: bool) -> torch.Tensor:
    s_t, s_h, s_w = mrope_section
    rows = torch.zeros(num_freqs, dtype=torch.int64)
    j = torch.arange(num_freqs)
    if interleaved:
        rows[(j % 3 == 1) & (j < 3 * s_h)] = 1
        rows[(j % 3 == 2) & (j < 3 * s_w)] = 2
    else:
        if s_t + s_h + s_w != num_freqs:
            raise ValueError(f"mrope_section {mrope_section} must sum to the {num_freqs} rotary frequencies")
        rows[s_t:s_t + s_h] = 1
        rows[s_t + s_h:] = 2
    return rows


def mrope_cos_sin(positions3: torch.Tensor, inv_freq: torch.Tensor, mrope_section: list[int],
                  interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, rotary_dim] for positions [3, T] (or [T]: the same row three times), in the layout of
    Rotary.cos_sin, so kernels.pointwise.apply_rotary uses them unchanged; with identical rows they equal
    Rotary.cos_sin exactly."""
    if positions3.dim() == 1:
        positions3 = positions3.unsqueeze(0).expand(3, -1)
    if positions3.dim() != 2 or positions3.shape[0] != 3:
        raise ValueError(f"positions must be [3, T], got {list(positions3.shape)}")
    inv_freq = inv_freq.to(positions3.device)
    rows = mrope_rows(inv_freq.shape[0], mrope_section, interleaved).to(positions3.device)
    freqs = positions3.float().t()[:, rows] * inv_freq              # [T, rd/2]: each frequency's own row
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
