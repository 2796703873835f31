"""Checkpoint tensors into the models' parameters: parameters laid out empty, the weight loaders that map a
checkpoint's tensor names to them (WeightLoaders; the vision tower's own in qwen_vision.py), the text model's map
(TextWeights: Qwen3NextForCausalLM and its NEXTN head), and the memory of a model laid out on "meta" (allocate: the
weights kept FP8 as Fp8Weight, those kept 4-bit as W4Weight). The model files hold the forward only."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from tinyserve.kernels.fp8_weight import Fp8Weight
from tinyserve.kernels.w4_weight import W4Weight


def empty_param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class WeightLoaders:
    """Maps canonical checkpoint tensor names to (expected shape, copy function) for one module tree.

    `parts` records the tensors copied as they are into rows of a parameter (name -> (parameter, first row); for
    stacked experts [E, N, K] the first row within its expert): the loader keeps a checkpoint's FP8 tensors FP8 only
    where whole parameters are filled that way (and 4-bit ones 4-bit). A loader of an Fp8Weight's rows takes the FP8
    values and their scales, already in the weight's block layout; a loader of a W4Weight's rows takes a W4Weight of
    the same layout (tinyserve/four_bit.py repacks the checkpoint's tensors into one)."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.loaders: dict[str, Callable[..., None]] = {}
        self.parts: dict[str, tuple[nn.Parameter | Fp8Weight | W4Weight, int]] = {}

    def add(self, name: str, shape: tuple[int, ...], target: torch.Tensor | Fp8Weight | W4Weight,
            transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if isinstance(target, (Fp8Weight, W4Weight)):
            assert transform is None, name        # rows reordered at load never stay FP8 / 4-bit (the loader's rule)
            return self.add_rows(name, shape, target, 0)
        self.shapes[name] = tuple(shape)
        if transform is None and isinstance(target, nn.Parameter):
            self.parts[name] = (target, 0)

        def load(t: torch.Tensor) -> None:
            with torch.no_grad():
                target.copy_((transform(t) if transform else t).reshape(target.shape))
        self.loaders[name] = load

    def add_norm(self, name: str, shape: tuple[int, ...], scale: nn.Parameter, dtype: torch.dtype) -> None:
        """A zero-centred RMSNorm weight w into its fp32 scale 1 + w, from w rounded to the model's dtype (as the
        checkpoint's own implementation holds it before adding 1 in fp32)."""
        self.add(name, shape, scale, lambda t: 1.0 + t.to(dtype).float())

    def add_rows(self, name: str, shape: tuple[int, ...], param: nn.Parameter | Fp8Weight | W4Weight, start: int,
                 expert: int | None = None) -> None:
        """A checkpoint tensor that fills rows start:start+shape[0] of a fused parameter (of expert `expert` of
        stacked experts [E, N, K])."""
        rows = shape[0]
        if isinstance(param, W4Weight):
            self.shapes[name] = tuple(shape)

            def load_w4(part: W4Weight) -> None:
                (param if expert is None else param.expert(expert)).copy_rows(start, part)   # expert e's view
            self.loaders[name] = load_w4
        elif isinstance(param, Fp8Weight):
            self.shapes[name] = tuple(shape)
            weight, scale_rows = (param.weight, param.scale) if expert is None else \
                (param.weight[expert], param.scale[expert])

            def load(t: torch.Tensor, scale: torch.Tensor) -> None:
                b0 = param.block[0]
                weight[start:start + rows].copy_(t)
                scale_rows[start // b0:start // b0 + scale.shape[0]].copy_(scale)
            self.loaders[name] = load
        else:
            self.add(name, shape, (param if expert is None else param[expert])[start:start + rows])
        self.parts[name] = (param, start)

    def merge(self, prefix: str, other: "WeightLoaders") -> None:
        for n, s in other.shapes.items():
            self.shapes[prefix + n] = s
            self.loaders[prefix + n] = other.loaders[n]
            if n in other.parts:
                self.parts[prefix + n] = other.parts[n]


def place_on_huge_pages(module: nn.Module) -> tuple[int, object | None]:
    """Move a CPU module's parameters into one anonymous mapping advised MADV_HUGEPAGE (Linux; the default "madvise"
    THP setting otherwise leaves them on 4 KB pages). A decode step reads every weight once, and 2 MB pages spare it
    most TLB misses: ~10% more tokens/s for a lone decode on the bench model (2-core AMD EPYC). Only the weights,
    which live as long as the process: torch's own THP switch (THP_MEM_ALLOC_ENABLE) advises every large block, and
    the freed ones stay resident (a server's RSS grew ~190 MB in 30 s of tests/test_soak.py). Returns the bytes
    moved and the mapping, which the caller keeps alive with the module; (0, None) where madvise is missing."""
    import mmap
    params = [p for p in module.parameters() if p.device.type == "cpu" and p.numel()]     # tied ones once
    if not params or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0, None
    align = 64                                           # every weight on a cache line, as torch's allocator does
    sizes = [-(-p.numel() * p.element_size() // align) * align for p in params]
    mapping = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = 0
    for p, size in zip(params, sizes):
        view = buffer[offset:offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
        offset += size
    return offset, mapping


# ---------------------------------------------------------------------------------------------------------------
# The text model's map: Qwen3NextForCausalLM's parameters by checkpoint name (read through the modules' attributes)

@dataclass(frozen=True)
class W4Layout:
    """How a linear weight is held 4-bit: kernels/w4_weight.W4Weight's arguments besides its shape."""

    kind: str                        # "int4" | "fp4"
    group: int                       # input columns per scale
    scale_dtype: torch.dtype
    asymmetric: bool = False         # a zero point per group (else every zero is `zero_point`)
    zero_point: int = 8
    act_order: bool = False          # columns sorted by group at load (W4Weight.perm)
    global_scale: float = 1.0        # fp4

    def weight(self, shape: torch.Size, device) -> W4Weight:
        """An empty W4Weight of `shape` ([N, K], or stacked experts [E, N, K])."""
        return W4Weight(shape[-2], shape[-1], self.group, self.kind, self.scale_dtype, self.asymmetric,
                        self.zero_point, self.act_order, self.global_scale, device,
                        shape[0] if len(shape) == 3 else None)


@dataclass(frozen=True)
class QuantizedWeights:
    """Which linear weights the model holds quantized, and how: as FP8 (parameter name -> scale block; act_quant:
    how they multiply) and as 4-bit (parameter name -> W4Layout)."""

    blocks: dict[str, tuple[int, int]]
    act_quant: bool                  # w8a8 (activations quantized per 128-group) or w8a16 (see kernels/fp8.py)
    w4: dict[str, W4Layout] = field(default_factory=dict)


def allocate(model: nn.Module, quantized: QuantizedWeights) -> None:
    """Give every parameter of a model laid out on "meta" its memory (on model.device): an Fp8Weight where
    QuantizedWeights.blocks names it, a W4Weight where QuantizedWeights.w4 does (each with an experts dimension for stacked
    experts [E, N, K]), else a tensor of its dtype."""
    unknown = (set(quantized.blocks) | set(quantized.w4)) - {n for n, p in model.named_parameters()
                                                 if getattr(p, "is_linear_weight", False)}
    assert not unknown, f"not linear weights of this model: {sorted(unknown)}"
    assert not set(quantized.blocks) & set(quantized.w4), "a weight is either FP8 or 4-bit"
    for name, p in list(model.named_parameters()):
        if not p.is_meta:
            continue
        owner, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        del owner._parameters[attr]
        if name in quantized.blocks:
            experts = p.shape[0] if p.dim() == 3 else None
            setattr(owner, attr, Fp8Weight(p.shape[-2], p.shape[-1], quantized.blocks[name], model.device,
                                           quantized.act_quant, experts))
        elif name in quantized.w4:
            setattr(owner, attr, quantized.w4[name].weight(p.shape, model.device))
        else:
            setattr(owner, attr, empty_param(p.shape, p.dtype, model.device))
    if model.cfg.tie_word_embeddings:
        model.lm_head = model.embed_tokens


class TextWeights:
    """Which checkpoint tensor (canonical name) fills which parameter of a text model, and how: rows of a fused
    projection ([q | gate] and k, v into qkv_proj; gate and up into gate_up), Qwen3-Next's interleaved GDN
    projections reordered into [q | k | v | z] and [b | a], a zero-centred norm's w into its scale 1 + w."""

    def __init__(self, model: Any) -> None:
        self.model = model
        cfg, H, V, dtype = model.cfg, model.cfg.hidden_size, model.cfg.vocab_size, model.dtype
        w = self.loaders = WeightLoaders()
        w.add("embed_tokens.weight", (V, H), model.embed_tokens)
        for i, layer in enumerate(model.layers):
            w.merge(f"layers.{i}.", _layer(layer, cfg))
        w.add_norm("norm.weight", (H,), model.norm, dtype)
        if not cfg.tie_word_embeddings:
            w.add("lm_head.weight", (V, H), model.lm_head)
        if model.mtp is not None:
            w.merge("mtp.", _nextn_head(model.mtp, cfg))
        if model.visual is not None:
            w.merge("visual.", model.visual.weight_loaders())
        # the stacked experts a checkpoint may ship instead of per-expert tensors: not part of expected()
        self.fused = WeightLoaders()
        heads = list(model.mtp.layers) if model.mtp is not None else []
        for prefix, layer in [(f"layers.{i}.", x) for i, x in enumerate(model.layers)] + \
                             [(f"mtp.layers.{i}.", x) for i, x in enumerate(heads)]:
            if hasattr(layer.mlp, "experts_gate_up"):
                f = WeightLoaders()
                f.add("experts.gate_up_proj", tuple(layer.mlp.experts_gate_up.shape), layer.mlp.experts_gate_up)
                f.add("experts.down_proj", tuple(layer.mlp.experts_down.shape), layer.mlp.experts_down)
                self.fused.merge(prefix + "mlp.", f)

    def expected(self) -> dict[str, tuple[int, ...]]:
        return dict(self.loaders.shapes)

    def load(self, name: str, tensor: torch.Tensor | W4Weight, scale: torch.Tensor | None = None) -> None:
        """Copy one checkpoint tensor in; `scale` (block scales in the target's layout) when it stays FP8; a
        W4Weight (one checkpoint module's 4-bit weight, repacked) into a weight held 4-bit."""
        loader = self.loaders.loaders.get(name) or self.fused.loaders.get(name)
        if loader is None:
            raise KeyError(f"unexpected tensor {name!r}")
        device = self.model.device
        if scale is None:
            loader(tensor.to(device))
        else:
            loader(tensor.to(device), scale.to(device, torch.float32))

    def linear_parts(self) -> dict[str, list[tuple[str, int, int]]]:
        """Each linear weight filled by checkpoint tensors copied as they are: parameter name -> [(canonical name,
        first row, rows)], for stacked experts [E, N, K] every expert's parts with their first row within the
        expert. Weights loaded through a reordering (Qwen3-Next's interleaved GDN projections) are not listed, and
        the stacked names a checkpoint may ship instead (self.fused) are no parts. What the loader decides FP8 and
        4-bit placement on."""
        model = self.model
        names = {id(p): n for n, p in model.named_parameters() if getattr(p, "is_linear_weight", False)}
        out: dict[str, list[tuple[str, int, int]]] = {}
        for canonical, (param, start) in self.loaders.parts.items():
            if id(param) in names:
                out.setdefault(names[id(param)], []).append((canonical, start, self.loaders.shapes[canonical][0]))
        # a weight is listed only if its parts cover it (a reordered part leaves it out); stacked experts by rows
        # of all experts
        return {n: parts for n, parts in out.items()
                if sum(rows for _, _, rows in parts) == math.prod(model.get_parameter(n).shape[:-1])}


def _layer(layer: Any, cfg: Any) -> WeightLoaders:
    w, H = WeightLoaders(), cfg.hidden_size
    w.add_norm("input_layernorm.weight", (H,), layer.input_layernorm, layer.dtype)
    w.add_norm("post_attention_layernorm.weight", (H,), layer.post_attention_layernorm, layer.dtype)
    if layer.kind == "linear_attention":
        w.merge("linear_attn.", _gated_delta_net(layer.mixer, cfg))
    else:
        w.merge("self_attn.", _gated_attention(layer.mixer, cfg, layer.dtype))
    w.merge("mlp.", _moe(layer.mlp, cfg) if hasattr(layer.mlp, "experts_gate_up") else _mlp(layer.mlp))
    return w


def _gated_delta_net(m: Any, cfg: Any) -> WeightLoaders:
    w = WeightLoaders()
    H, kd, vd, nk, nv, dk, dv = cfg.hidden_size, m.kd, m.vd, m.nk, m.nv, m.dk, m.dv
    r = nv // nk
    if cfg.interleaved_gdn_proj:
        # Qwen3-Next: rows grouped per key head g: [q_g | k_g | v_{g*r..} | z_{g*r..}] -> reorder to [q|k|v|z]
        def qkvz(t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(nk, 2 * dk + 2 * r * dv, H)
            q, k, v, z = t.split([dk, dk, r * dv, r * dv], dim=1)
            return torch.cat([x.reshape(-1, H) for x in (q, k, v, z)])

        def ba(t: torch.Tensor) -> torch.Tensor:
            b, a = t.reshape(nk, 2 * r, H).split([r, r], dim=1)
            return torch.cat([b.reshape(nv, H), a.reshape(nv, H)])
        w.add("in_proj_qkvz.weight", (2 * kd + 2 * vd, H), m.in_proj_qkvz, qkvz)
        w.add("in_proj_ba.weight", (2 * nv, H), m.in_proj_ba, ba)
    else:
        w.add_rows("in_proj_qkv.weight", (2 * kd + vd, H), m.in_proj_qkvz, 0)
        w.add_rows("in_proj_z.weight", (vd, H), m.in_proj_qkvz, 2 * kd + vd)
        w.add_rows("in_proj_b.weight", (nv, H), m.in_proj_ba, 0)
        w.add_rows("in_proj_a.weight", (nv, H), m.in_proj_ba, nv)
    w.add("conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), m.conv_weight)
    w.add("A_log", (nv,), m.A_log)
    w.add("dt_bias", (nv,), m.dt_bias)
    w.add("norm.weight", (dv,), m.norm_weight)
    w.add("out_proj.weight", (H, vd), m.out_proj)
    return w


def _gated_attention(m: Any, cfg: Any, dtype: torch.dtype) -> WeightLoaders:
    """qkv_proj rows: [q_proj rows (per head: query hd | gate hd) | k_proj rows | v_proj rows]."""
    w, H = WeightLoaders(), cfg.hidden_size
    w.add_rows("q_proj.weight", (m.q_rows, H), m.qkv_proj, 0)
    w.add_rows("k_proj.weight", (m.kv_rows, H), m.qkv_proj, m.q_rows)
    w.add_rows("v_proj.weight", (m.kv_rows, H), m.qkv_proj, m.q_rows + m.kv_rows)
    w.add("o_proj.weight", (H, m.nh * m.hd), m.o_proj)
    w.add_norm("q_norm.weight", (m.hd,), m.q_norm, dtype)
    w.add_norm("k_norm.weight", (m.hd,), m.k_norm, dtype)
    return w


def _mlp(m: Any) -> WeightLoaders:
    w, H, I = WeightLoaders(), m.down.shape[0], m.inter
    w.add_rows("gate_proj.weight", (I, H), m.gate_up, 0)
    w.add_rows("up_proj.weight", (I, H), m.gate_up, I)
    w.add("down_proj.weight", (H, I), m.down)
    return w


def _moe(m: Any, cfg: Any) -> WeightLoaders:
    w, E, H, I = WeightLoaders(), m.E, cfg.hidden_size, m.I
    w.add("gate.weight", (E, H), m.router)
    for e in range(E):
        w.add_rows(f"experts.{e}.gate_proj.weight", (I, H), m.experts_gate_up, 0, expert=e)
        w.add_rows(f"experts.{e}.up_proj.weight", (I, H), m.experts_gate_up, I, expert=e)
        w.add_rows(f"experts.{e}.down_proj.weight", (H, I), m.experts_down, 0, expert=e)
    w.merge("shared_expert.", _mlp(m.shared_expert))
    w.add("shared_expert_gate.weight", (1, H), m.shared_expert_gate)
    return w


def _nextn_head(head: Any, cfg: Any) -> WeightLoaders:
    w, H = WeightLoaders(), cfg.hidden_size
    w.add("fc.weight", (H, 2 * H), head.fc)
    w.add_norm("pre_fc_norm_embedding.weight", (H,), head.pre_fc_norm_embedding, head.dtype)
    w.add_norm("pre_fc_norm_hidden.weight", (H,), head.pre_fc_norm_hidden, head.dtype)
    for i, layer in enumerate(head.layers):
        w.merge(f"layers.{i}.", _layer(layer, cfg))
    w.add_norm("norm.weight", (H,), head.norm, head.dtype)
    return w
