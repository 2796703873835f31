"""A 4-bit checkpoint's quantization (weight-only): the format its config declares, which checkpoint tensors hold each
quantized module's weight, and their repacking into the one layout the GEMMs read (kernels/w4_weight.W4Weight), kept
4-bit where every part of a model's weight is 4-bit alike (w4_placement), dequantized to the model's dtype elsewhere.

W is [N out, K in], q its 4-bit codes, z the zero points, g the group size (input columns per scale). A packed int32
holds 8 codes, code j at bits 4j..4j+3 (little-endian, as the files store it).
  GPTQ (quant_method "gptq": GPTQModel, AutoGPTQ): qweight int32 [K/8, N] packed along K (W[n, 8r + j] is code j of
    qweight[r, n]); qzeros int32 [K/g, N/8] packed along N; scales [K/g, N]; g_idx int32 [K], the group of each
    input column (permuted under desc_act). checkpoint_format "gptq" (v1) stores z - 1 in qzeros (a symmetric
    checkpoint 0x77777777), "gptq_v2" z. W[n, k] = (q[n, k] - z[g_idx[k], n]) * scales[g_idx[k], n]. GPTQModel's
    `dynamic` overrides bits / group_size / desc_act / sym per module regex, or skips a module ("-:").
  AWQ (quant_method "awq", version "gemm"): qweight int32 [K, N/8] packed along N, code j of word w being column
    8w + [0, 2, 4, 6, 1, 3, 5, 7][j]; qzeros int32 [K/g, N/8] the same way (z itself); scales [K/g, N].
  compressed-tensors pack-quantized (weights int, 4 bits): weight_packed int32 [N, K/8] packed along K, each signed
    value v stored as v + 8; weight_scale [N, K/g]; weight_zero_point int32 [N/8, K/g] packed along N (asymmetric,
    signed + 8); weight_shape int [2]; weight_g_idx [K] (the old actorder "group", as GPTQ's g_idx).
  NVFP4: ModelOpt (hf_quant_config.json, or quant_method "modelopt"; quant_algo NVFP4, W4A16_NVFP4 or MIXED_PRECISION
    beside FP8 layers) and compressed-tensors nvfp4-pack-quantized: weight (ModelOpt) / weight_packed uint8
    [N, K/2], column 2j in the low nibble, E2M1 codes (bit 3 the sign); weight_scale float8_e4m3fn [N, K/16];
    ModelOpt's weight_scale_2 float32 scalar, or compressed-tensors' weight_global_scale, its inverse.
    W = e2m1 * weight_scale * weight_scale_2. Activation scales (input_scale, input_global_scale) are unused.
A module is 4-bit when its tensors say so (qweight, weight_packed, weight_scale_2); the config says how they are
packed. Every problem is a LoaderError naming the tensor and the config key at fault.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from tinyserve.model_config import LoaderError, TensorInfo, TensorToLoad, canonical_name
from tinyserve.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from tinyserve.kernels.w4_weight import W4Weight
    from tinyserve.models.weights import W4Layout

log = logging.getLogger("tinyserve.loader")

FOUR_BIT_METHODS = ("gptq", "awq", "modelopt")   # and compressed-tensors when one of its config groups is 4-bit
CT_FOUR_BIT_FORMATS = ("pack-quantized", "nvfp4-pack-quantized")
CT_FORMATS = CT_FOUR_BIT_FORMATS + ("float-quantized", "naive-quantized", "mixed-precision")
MODELOPT_NVFP4 = ("NVFP4", "W4A16_NVFP4")
MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO")
NVFP4_GROUP = 16
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # code j of an AWQ word is column 8w + AWQ_ORDER[j]
_SCALE_TAGS = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
_SCALE_BYTES = {"F16": 2, "BF16": 2, "F32": 4}

# Each packing's tensors (by the suffix after the module's name): the one whose presence marks a 4-bit module,
# those it needs, and those it may have. Activation scales are taken along and not read (weight-only).
_MARKER = {"gptq": "qweight", "awq": "qweight", "ct-int4": "weight_packed", "ct-nvfp4": "weight_packed",
           "modelopt-nvfp4": "weight_scale_2"}
_REQUIRED = {"gptq": ("qweight", "qzeros", "scales"), "awq": ("qweight", "scales"),
             "ct-int4": ("weight_packed", "weight_scale"),
             "ct-nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
             "modelopt-nvfp4": ("weight", "weight_scale", "weight_scale_2")}
_OPTIONAL = {"gptq": ("g_idx",), "awq": (), "ct-int4": ("weight_shape", "weight_g_idx"),
             "ct-nvfp4": ("input_global_scale",), "modelopt-nvfp4": ("input_scale",)}


@dataclass(frozen=True)
class ModuleFormat:
    """How the config says one module's weight is stored 4-bit."""

    packing: str              # "gptq" | "awq" | "ct-int4" | "ct-nvfp4" | "modelopt-nvfp4"
    group: int                # input columns per scale; -1: all of K (one group, "channel")
    symmetric: bool = True    # every zero point is 8 (GPTQ stores them anyway; the others do not)
    act_order: bool = False   # GPTQ desc_act / compressed-tensors actorder "group": a permuted g_idx is expected
    zeros_minus_one: bool = False   # GPTQ v1: qzeros hold z - 1
    key: str = "quantization_config"  # the config key that says so (named in errors)

    @property
    def kind(self) -> str:
        return "fp4" if self.packing.endswith("nvfp4") else "int4"

    @property
    def zero_point_role(self) -> str | None:
        """The tensor of zero points, when the module has one."""
        if self.symmetric:
            return None
        return "weight_zero_point" if self.packing == "ct-int4" else "qzeros"

    @property
    def g_idx_role(self) -> str | None:
        return {"gptq": "g_idx", "ct-int4": "weight_g_idx"}.get(self.packing)


@dataclass
class QuantizedModule:
    """One checkpoint module's 4-bit weight, from the headers: its tensors by role, the weight's shape [N, K], its
    group and how its scales are held (a safetensors dtype tag: F16, BF16 or F32; NVFP4's FP8 scales as F32)."""

    name: str                          # the checkpoint's module name: "model.layers.0.mlp.down_proj"
    fmt: ModuleFormat
    tensors: dict[str, TensorInfo]     # role ("qweight", "scales", ...) -> tensor
    shape: tuple[int, int]
    group: int
    scale_tag: str

    @property
    def packed(self) -> TensorInfo:
        """The tensor of codes."""
        return self.tensors["weight" if self.fmt.packing == "modelopt-nvfp4" else _MARKER[self.fmt.packing]]

    @property
    def kind(self) -> str:
        return self.fmt.kind

    @property
    def label(self) -> str:
        """The plan's name of how it is stored: "gptq g128", "awq g64", "compressed-tensors g32", "nvfp4"."""
        name = {"gptq": "gptq", "awq": "awq", "ct-int4": "compressed-tensors"}.get(self.fmt.packing, "nvfp4")
        return name if self.kind == "fp4" else f"{name} {'channel' if self.fmt.group == -1 else f'g{self.group}'}"


# ---------------------------------------------------------------------------------------------------------------
# The config


def name_variants(module: str) -> set[str]:
    """A module's name as the checkpoint stores it and as configs write it (with or without the multimodal
    `model.language_model.` prefix): what ignore lists and per-module rules are matched against."""
    canon = canonical_name(module + ".weight")[: -len(".weight")]
    return {module, canon, "model." + canon, "model.language_model." + canon}


@dataclass
class IgnoreList:
    """A quantization config's modules left unquantized (FP8's `modules_to_not_convert`, compressed-tensors'
    `ignore`): exact names and `re:` regexes, matched against every name a module goes by (name_variants)."""
    exact: set[str] = dataclasses.field(default_factory=set)
    regex: list[re.Pattern[str]] = dataclasses.field(default_factory=list)

    @classmethod
    def parse(cls, items: Any, key: str) -> IgnoreList:
        out = cls()
        for item in items or []:
            if not isinstance(item, str):
                raise LoaderError(f"config.json: {key} entry {item!r} is not a string")
            if not item.startswith("re:"):
                out.exact.add(item)
                continue
            try:
                out.regex.append(re.compile(item[3:]))
            except re.error as e:
                raise LoaderError(f"config.json: bad regex in {key} {item!r}: {e}") from e
        return out

    def __contains__(self, module: str) -> bool:
        names = name_variants(module)
        return bool(names & self.exact) or any(rx.match(n) for rx in self.regex for n in names)


class FourBitScheme:
    """What a checkpoint's quantization config says about its 4-bit modules: `format_of(module)` is how one is
    packed, or None where the config leaves it unquantized. `from_config` is None for a config without 4-bit
    weights (none, FP8 alone)."""

    label = ""                          # the config's method, as messages name it

    @staticmethod
    def from_config(qc: dict[str, Any] | None) -> "FourBitScheme | None":
        if not qc:
            return None
        method = qc.get("quant_method")
        if method == "gptq":
            return GptqScheme(qc)
        if method == "awq":
            return AwqScheme(qc)
        if method == "compressed-tensors":
            scheme = CompressedTensorsScheme(qc)
            return scheme if scheme.has_four_bit else None
        if isinstance(method, str) and method.lower().startswith("modelopt"):
            scheme = ModelOptScheme(qc)
            return scheme if scheme.has_four_bit else None
        return None                     # fp8, or a method fp8_scheme refuses by name

    def markers(self) -> tuple[str, ...]:
        """The tensor suffixes whose presence makes a module 4-bit under this method."""
        raise NotImplementedError

    def format_of(self, module: str, marker: TensorInfo) -> ModuleFormat | None:
        raise NotImplementedError

    def find_modules(self, tensors: dict[str, TensorInfo]) -> dict[str, QuantizedModule]:
        """Every 4-bit module of the checkpoint (by module name), its tensors checked against each other and the
        config from the headers alone."""
        modules: dict[str, QuantizedModule] = {}
        suffixes = tuple("." + m for m in self.markers())
        for name, info in tensors.items():
            if not name.endswith(suffixes):
                continue
            module = name.rpartition(".")[0]
            fmt = self.format_of(module, info)
            if fmt is None:
                raise LoaderError(f"tensor {name!r} is stored 4-bit, but the checkpoint's {self.label} "
                                  f"quantization config leaves its module {module!r} unquantized (ignore list / "
                                  f"modules_to_not_convert / dynamic '-:' rule)")
            modules[module] = describe_module(module, fmt, tensors)
        return modules


def _bits(value: Any, key: str) -> None:
    if value != 4:
        raise LoaderError(f"config.json: {key} = {value!r}: only 4-bit weights are supported among the quantized "
                          f"formats besides FP8 (2-, 3- and 8-bit GPTQ / AWQ / compressed-tensors are not)")


def _group(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or value > 0):
        raise LoaderError(f"config.json: {key} must be a positive int or -1 (one group over all input columns), "
                          f"found {value!r}")
    return value


class GptqScheme(FourBitScheme):
    label = "gptq"

    def __init__(self, qc: dict[str, Any]) -> None:
        k = "quantization_config"
        _bits(qc.get("bits", 4), f"{k}.bits")
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise LoaderError(f"config.json: {k}.checkpoint_format {fmt!r} is not supported (only 'gptq' and "
                              f"'gptq_v2'; Marlin, BitBLAS and other repacked GPTQ layouts are not)")
        if qc.get("is_marlin_format"):
            raise LoaderError(f"config.json: {k}.is_marlin_format = true: AutoGPTQ's Marlin layout is not supported")
        if qc.get("pack_dtype", "int32") != "int32":
            raise LoaderError(f"config.json: {k}.pack_dtype {qc['pack_dtype']!r} is not supported (only int32)")
        self.base = ModuleFormat("gptq", _group(qc.get("group_size", 128), f"{k}.group_size"),
                                 symmetric=bool(qc.get("sym", True)), act_order=bool(qc.get("desc_act", False)),
                                 zeros_minus_one=fmt == "gptq", key=k)
        dynamic = qc.get("dynamic") or {}
        if not isinstance(dynamic, dict):
            raise LoaderError(f"config.json: {k}.dynamic must be an object of regex -> overrides, found {dynamic!r}")
        self.dynamic: list[tuple[str, bool, re.Pattern[str], dict[str, Any]]] = []
        for pattern, overrides in dynamic.items():
            skip = pattern.startswith("-:")
            try:
                rx = re.compile(pattern[2:] if pattern.startswith(("-:", "+:")) else pattern)
            except re.error as e:
                raise LoaderError(f"config.json: bad regex in {k}.dynamic {pattern!r}: {e}") from e
            if not isinstance(overrides, dict):
                raise LoaderError(f"config.json: {k}.dynamic[{pattern!r}] must be an object, found {overrides!r}")
            self.dynamic.append((pattern, skip, rx, overrides))

    def markers(self) -> tuple[str, ...]:
        return ("qweight",)

    def format_of(self, module: str, marker: TensorInfo) -> ModuleFormat | None:
        """GPTQModel's rule (as vLLM applies it): the first `dynamic` regex that matches the module decides; "-:"
        leaves it unquantized, others override bits / group_size / desc_act / sym."""
        names = name_variants(module)
        for pattern, skip, rx, overrides in self.dynamic:
            if not any(rx.match(n) for n in names):
                continue
            if skip:
                return None
            key = f"quantization_config.dynamic[{pattern!r}]"
            _bits(overrides.get("bits", 4), f"{key}.bits")
            return dataclasses.replace(
                self.base, group=_group(overrides.get("group_size", self.base.group), f"{key}.group_size"),
                symmetric=bool(overrides.get("sym", self.base.symmetric)),
                act_order=bool(overrides.get("desc_act", self.base.act_order)), key=key)
        return self.base


class AwqScheme(FourBitScheme):
    label = "awq"

    def __init__(self, qc: dict[str, Any]) -> None:
        k = "quantization_config"
        _bits(qc.get("bits", qc.get("w_bit", 4)), f"{k}.bits")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise LoaderError(f"config.json: {k}.version {qc.get('version')!r} is not supported: only AutoAWQ's "
                              f"GEMM layout is (GEMV, Marlin, ExLlama and IPEX repack the weights otherwise)")
        self.base = ModuleFormat("awq", _group(qc.get("group_size", qc.get("q_group_size", 128)), f"{k}.group_size"),
                                 symmetric=not qc.get("zero_point", True), key=k)
        self.skip = [m for m in (qc.get("modules_to_not_convert") or []) if isinstance(m, str)]

    def markers(self) -> tuple[str, ...]:
        return ("qweight",)

    def format_of(self, module: str, marker: TensorInfo) -> ModuleFormat | None:
        # AutoAWQ's rule: a module is left unquantized when any entry is a substring of its name
        return None if any(s in n for s in self.skip for n in name_variants(module)) else self.base


class CompressedTensorsScheme(FourBitScheme):
    """compressed-tensors: config groups, each with `targets` (module names, "re:" regexes, or the class "Linear")
    and weight quantization args; the `ignore` list leaves modules unquantized."""

    label = "compressed-tensors"

    def __init__(self, qc: dict[str, Any]) -> None:
        top = qc.get("format")
        if top is not None and top not in CT_FORMATS:
            raise LoaderError(f"config.json: compressed-tensors format {top!r} is not supported (supported: "
                              f"{', '.join(CT_FORMATS)})")
        self.groups: list[tuple[str, list[str], ModuleFormat | None]] = []    # None: an FP8 group
        for gname, group in (qc.get("config_groups") or {}).items():
            key = f"quantization_config.config_groups.{gname}"
            group = group or {}
            targets = group.get("targets") or []
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                raise LoaderError(f"config.json: {key}.targets must be a list of strings, found {targets!r}")
            w = group.get("weights")
            if not w:
                continue
            fmt = self._group_format(w, group.get("format") or top, key)
            self.groups.append((gname, targets, fmt))
        self.has_four_bit = any(fmt is not None for _, _, fmt in self.groups)
        self.ignore = IgnoreList.parse(qc.get("ignore"), "quantization_config.ignore")

    @staticmethod
    def _group_format(w: dict[str, Any], fmt: str | None, key: str) -> ModuleFormat | None:
        """A group's weights: a 4-bit ModuleFormat, None for FP8 (fp8_scheme's), or refused by name."""
        bits, kind = w.get("num_bits"), str(w.get("type", "int")).lower()
        if kind == "float" and bits == 8:
            return None
        if fmt is not None and fmt not in CT_FORMATS:
            raise LoaderError(f"config.json: {key}.format {fmt!r} is not supported (supported: "
                              f"{', '.join(CT_FORMATS)})")
        if kind == "float" and bits == 4:
            group = w.get("group_size")
            if group != NVFP4_GROUP or fmt not in (None, "nvfp4-pack-quantized", "mixed-precision"):
                raise LoaderError(f"config.json: {key}.weights: 4-bit float weights with group_size {group!r} and "
                                  f"format {fmt!r} are not supported (only NVFP4: group_size 16, "
                                  f"nvfp4-pack-quantized)")
            return ModuleFormat("ct-nvfp4", NVFP4_GROUP, key=f"{key}.weights")
        if kind != "int" or bits != 4:
            raise LoaderError(f"config.json: {key}.weights: {bits}-bit {kind} weights are not supported (4-bit int "
                              f"pack-quantized, NVFP4 and FP8 are)")
        if fmt not in (None, "pack-quantized", "mixed-precision"):
            raise LoaderError(f"config.json: {key}: 4-bit int weights in format {fmt!r} are not supported (only "
                              f"pack-quantized)")
        strategy = w.get("strategy") or ("group" if w.get("group_size") not in (None, -1) else "channel")
        if strategy == "group":
            group = _group(w.get("group_size"), f"{key}.weights.group_size")
        elif strategy == "channel":
            group = -1
        else:
            raise LoaderError(f"config.json: {key}.weights.strategy {strategy!r} is not supported for 4-bit weights "
                              f"(group and channel are)")
        if w.get("dynamic"):
            raise LoaderError(f"config.json: {key}.weights.dynamic = {w['dynamic']!r}: weights quantized on the fly "
                              f"are not a stored checkpoint")
        act_order = w.get("actorder") in (True, "group", "dynamic")
        return ModuleFormat("ct-int4", group, symmetric=bool(w.get("symmetric", True)), act_order=act_order,
                            key=f"{key}.weights")

    def markers(self) -> tuple[str, ...]:
        return ("weight_packed",)

    def format_of(self, module: str, marker: TensorInfo) -> ModuleFormat | None:
        """compressed-tensors' precedence: a target naming the module, then a regex, then the class "Linear"."""
        if module in self.ignore:
            return None
        names = name_variants(module)

        def rank(target: str) -> int | None:
            if target in names:
                return 0
            if target.startswith("re:") and any(re.match(target[3:], n) for n in names):
                return 1
            return 2 if target == "Linear" else None
        ranked = [(r, gname, fmt) for gname, targets, fmt in self.groups for t in targets
                  if (r := rank(t)) is not None]
        if not ranked:
            return None
        _, gname, fmt = min(ranked, key=lambda x: x[0])
        if fmt is None:
            raise LoaderError(f"tensor {marker.name!r} is stored 4-bit, but its module matches "
                              f"quantization_config.config_groups.{gname}, which is FP8")
        if fmt.kind == "fp4" and marker.dtype != "U8" or fmt.kind == "int4" and marker.dtype != "I32":
            raise LoaderError(f"tensor {marker.name!r} is {marker.dtype}, but {fmt.key} makes it "
                              f"{'NVFP4 (U8)' if fmt.kind == 'fp4' else '4-bit int packed in I32'}")
        return fmt


class ModelOptScheme(FourBitScheme):
    """ModelOpt: quant_algo NVFP4 / W4A16_NVFP4 for every quantized module, or MIXED_PRECISION with each layer's
    algorithm in quantized_layers (NVFP4 beside FP8: the FP8 ones are fp8_scheme's). Its NVFP4 modules are found by
    their weight_scale_2."""

    label = "modelopt"

    def __init__(self, qc: dict[str, Any]) -> None:
        algo = str(qc.get("quant_algo") or "").upper()
        algos = {algo}
        if algo == "MIXED_PRECISION":
            layers = qc.get("quantized_layers") or {}
            if not isinstance(layers, dict):
                raise LoaderError(f"ModelOpt config: quantized_layers must be an object, found {layers!r}")
            for name, layer in layers.items():
                la = str((layer or {}).get("quant_algo") or "").upper()
                self._check(la, (layer or {}).get("group_size", qc.get("group_size", NVFP4_GROUP)),
                            f"quantized_layers[{name!r}].quant_algo")
                algos.add(la)
        else:
            self._check(algo, qc.get("group_size", NVFP4_GROUP), "quant_algo")
        self.has_four_bit = algo == "MIXED_PRECISION" or algo in MODELOPT_NVFP4     # the tensors tell which
        self.fmt = ModuleFormat("modelopt-nvfp4", NVFP4_GROUP, key="ModelOpt quant_algo")

    @staticmethod
    def _check(algo: str, group: Any, key: str) -> None:
        if algo in MODELOPT_NVFP4:
            if group != NVFP4_GROUP:
                raise LoaderError(f"ModelOpt config: NVFP4 with group_size {group!r} ({key}) is not supported "
                                  f"(NVFP4's group is 16)")
        elif algo not in MODELOPT_FP8:
            raise LoaderError(f"ModelOpt config: {key} {algo!r} is not supported (supported: "
                              f"{', '.join(MODELOPT_NVFP4 + MODELOPT_FP8)}, MIXED_PRECISION of those)")

    def markers(self) -> tuple[str, ...]:
        return ("weight_scale_2",)

    def format_of(self, module: str, marker: TensorInfo) -> ModuleFormat | None:
        return self.fmt


# ---------------------------------------------------------------------------------------------------------------
# One module's tensors, from the headers


def describe_module(module: str, fmt: ModuleFormat, tensors: dict[str, TensorInfo]) -> QuantizedModule:
    """A 4-bit module's tensors, checked: each one there with the dtype and shape the packing gives the weight's
    [N, K] (read from the codes) in groups of the config's size."""
    packing = fmt.packing
    required = _REQUIRED[packing] + ((fmt.zero_point_role,) if fmt.zero_point_role else ())
    found = {r: tensors[f"{module}.{r}"] for r in required + _OPTIONAL[packing] if f"{module}.{r}" in tensors}
    missing = [f"{module}.{r}" for r in required if r not in found]
    if missing:
        raise LoaderError(f"4-bit module {module!r} ({fmt.key}: {packing}) has no {', '.join(missing)}")
    if fmt.act_order and fmt.g_idx_role and fmt.g_idx_role not in found:
        raise LoaderError(f"4-bit module {module!r} has no {module}.{fmt.g_idx_role}, which {fmt.key} "
                          f"(desc_act / actorder) needs")
    codes = found["weight" if packing == "modelopt-nvfp4" else _MARKER[packing]]
    want_tag = "U8" if fmt.kind == "fp4" else "I32"
    if codes.dtype != want_tag or len(codes.shape) != 2:
        raise LoaderError(f"4-bit tensor {codes.name!r} is {codes.dtype} {list(codes.shape)}; {packing} stores "
                          f"codes as a 2-D {want_tag} tensor")
    a, b = codes.shape
    N, K = {"gptq": (b, 8 * a), "awq": (8 * b, a), "ct-int4": (a, 8 * b)}.get(packing, (a, 2 * b))
    group = K if fmt.group == -1 else fmt.group
    if K % group:
        raise LoaderError(f"{fmt.key}.group_size = {group} does not divide the {K} input columns of {codes.name!r} "
                          f"(shape {list(codes.shape)}): a checkpoint this loader cannot serve")
    if group % 2:
        raise LoaderError(f"{fmt.key}.group_size = {group} is odd: 4-bit groups of an odd size are not supported")
    G, words = K // group, -(-N // 8)                      # groups; int32 words of N zero points
    scale_role = "scales" if packing in ("gptq", "awq") else "weight_scale"
    expected = {scale_role: ((G, N) if packing in ("gptq", "awq") else (N, G), ("F16", "BF16", "F32", "F8_E4M3"))}
    zero_role = "qzeros" if packing == "gptq" else fmt.zero_point_role    # GPTQ stores them symmetric too
    if zero_role:
        expected[zero_role] = ({"gptq": (G, words), "awq": (G, N // 8)}.get(packing, (words, G)), ("I32",))
    if fmt.g_idx_role:
        expected[fmt.g_idx_role] = ((K,), ("I32", "I64"))
    if packing == "ct-int4":
        expected["weight_shape"] = ((2,), ("I32", "I64"))
    for role, (shape, tags) in expected.items():
        info = found.get(role)
        if info is not None and tuple(info.shape) != shape:
            raise LoaderError(f"tensor {info.name!r} has shape {list(info.shape)}, but a [{N}, {K}] weight "
                              f"({codes.name} {list(codes.shape)}) in groups of {group} ({fmt.key}.group_size) "
                              f"needs {list(shape)}")
        if info is not None and info.dtype not in tags:
            raise LoaderError(f"tensor {info.name!r} is {info.dtype}; {packing} stores it as {' or '.join(tags)}")
    scale = found[scale_role]
    for role in ("weight_scale_2", "weight_global_scale"):
        if role in found and math.prod(found[role].shape) != 1:
            raise LoaderError(f"tensor {found[role].name!r} has shape {list(found[role].shape)}; NVFP4's global "
                              f"scale is one value per module")
    if fmt.kind == "fp4":
        if scale.dtype != "F8_E4M3":
            raise LoaderError(f"NVFP4 scale {scale.name!r} is {scale.dtype}, not F8_E4M3")
        tag = "F32"                                          # FP8 group scales held as the float32 they equal
    else:
        tag = scale.dtype
        if tag not in _SCALE_TAGS:
            raise LoaderError(f"scale tensor {scale.name!r} is {tag}; 4-bit scales are F16, BF16 or F32")
    return QuantizedModule(module, fmt, found, (N, K), group, tag)


# ---------------------------------------------------------------------------------------------------------------
# Repacking into W4Weight (torch from here on)


def _word_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] packed along the last dim -> uint8 [..., 4W]: the same bytes, which hold two codes each, the
    low nibble first: W4Weight's layout already (a little-endian host's view of the words, no copy of the codes)."""
    import torch
    assert sys.byteorder == "little", "the 4-bit loader reads packed int32 words as little-endian bytes"
    return words.contiguous().reshape(-1).view(torch.uint8).reshape(*words.shape[:-1], 4 * words.shape[-1])


def _unpack_words(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., 8W]: the 8 codes of each word, the low nibble first."""
    import torch
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).flatten(-2)


def _awq_columns(packed: torch.Tensor, n: int) -> torch.Tensor:
    """AWQ int32 [R, N/8] packed along N in AWQ_ORDER -> uint8 [R, N] in column order."""
    import torch
    codes = _unpack_words(packed).view(packed.shape[0], -1, 8)
    out = torch.empty_like(codes)
    out[..., list(AWQ_ORDER)] = codes             # column 8w + AWQ_ORDER[j] <- code j of word w
    return out.reshape(packed.shape[0], -1)[:, :n]


def _group_order(g_idx: torch.Tensor | None, m: QuantizedModule) -> torch.Tensor | None:
    """The act-order permutation of a module's g_idx (columns sorted by group: perm[j] is the checkpoint column at
    sorted position j), or None when it is absent or already sorted (g_idx[k] = k // group)."""
    import torch
    if g_idx is None:
        return None
    K = m.shape[1]
    g_idx = g_idx.to(torch.int64)
    info = m.tensors[m.fmt.g_idx_role]
    if torch.equal(g_idx, torch.arange(K, device=g_idx.device) // m.group):
        return None
    if not m.fmt.act_order:
        setting = "desc_act" if m.fmt.packing == "gptq" else "actorder"
        raise LoaderError(f"tensor {info.name!r} permutes the input columns, but {m.fmt.key}.{setting} is off")
    G = K // m.group
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= G or \
            not bool((torch.bincount(g_idx, minlength=G) == m.group).all()):
        raise LoaderError(f"tensor {info.name!r} is no act-order group index: each of its {G} groups must hold "
                          f"exactly {m.group} columns ({m.fmt.key}.group_size)")
    return torch.argsort(g_idx, stable=True)


def group_order_key(g_idx: torch.Tensor | None, m: QuantizedModule) -> bytes | None:
    """What decides whether fused parts can share one permutation: the g_idx's bytes, None when sorted."""
    perm = _group_order(g_idx, m)
    return None if perm is None else perm.cpu().numpy().tobytes()


def global_scale_of(m: QuantizedModule, t: dict[str, torch.Tensor]) -> float:
    """NVFP4's scale_2 (compressed-tensors stores 1 / scale_2: W = q * weight_scale / weight_global_scale)."""
    role = "weight_scale_2" if m.fmt.packing == "modelopt-nvfp4" else "weight_global_scale"
    value = float(t[role].float().reshape(-1)[0])
    if not math.isfinite(value) or value <= 0:
        raise LoaderError(f"NVFP4 global scale {m.tensors[role].name!r} is {value}; it must be positive")
    return value if role == "weight_scale_2" else 1.0 / value


def repack(m: QuantizedModule, t: dict[str, torch.Tensor]) -> W4Weight:
    """A module's 4-bit tensors (by role, on the device the weight goes to) as a W4Weight [N, K] that dequantizes
    to exactly what the format's own dequantization gives."""
    from tinyserve.kernels.w4_weight import W4Weight, pack_codes
    N, K = m.shape
    packing, perm, zeros = m.fmt.packing, None, None
    if packing == "gptq":
        codes = _word_bytes(t["qweight"].T)[:, :K // 2]                          # packed along K: our bytes
        z = _unpack_words(t["qzeros"])[:, :N].T.contiguous()                     # [N, K/g]
        zeros = z + 1 if m.fmt.zeros_minus_one else z                           # v1: z - 1 stored (1..16 back)
        scales = t["scales"].T.contiguous()
        perm = _group_order(t.get("g_idx"), m)
    elif packing == "awq":                                                      # packed along N, interleaved
        codes = pack_codes(_awq_columns(t["qweight"], N).T)
        zeros = None if m.fmt.symmetric else _awq_columns(t["qzeros"], N).T.contiguous()
        scales = t["scales"].T.contiguous()
    elif packing == "ct-int4":
        if "weight_shape" in t and t["weight_shape"].reshape(-1).tolist() != [N, K]:
            raise LoaderError(f"tensor {m.tensors['weight_shape'].name!r} says {t['weight_shape'].tolist()}, but "
                              f"{m.packed.name} holds a [{N}, {K}] weight")
        codes = _word_bytes(t["weight_packed"])[:, :K // 2]                      # signed + 8: the codes themselves
        if not m.fmt.symmetric:
            zeros = _unpack_words(t["weight_zero_point"].T.contiguous())[:, :N].T.contiguous()
        scales = t["weight_scale"]
        perm = _group_order(t.get("weight_g_idx"), m)
    else:                                                                       # NVFP4: already our layout
        packed = t["weight" if packing == "modelopt-nvfp4" else "weight_packed"]
        return W4Weight.of(packed.contiguous(), t["weight_scale"].float(), m.group, "fp4",
                           global_scale=global_scale_of(m, t))
    if m.fmt.symmetric and zeros is not None:                                   # GPTQ stores them symmetric too
        if not bool((zeros == 8).all()):
            stored = "7 (z - 1, checkpoint_format gptq)" if m.fmt.zeros_minus_one else "8 (checkpoint_format gptq_v2)"
            raise LoaderError(f"tensor {m.tensors['qzeros'].name!r} holds zero points other than the symmetric "
                              f"{stored}, but {m.fmt.key}.sym = true: is checkpoint_format right?")
        zeros = None
    if perm is not None:                                                        # columns sorted by group
        codes = pack_codes(W4Weight.of(codes, scales, m.group).unpacked()[:, perm])
    return W4Weight.of(codes.contiguous(), scales.contiguous(), m.group, "int4", zeros=zeros, perm=perm)


def read_module(m: QuantizedModule, read: Callable[[TensorInfo], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's tensors by role, read with `read` (activation scales left unread)."""
    return {role: read(info) for role, info in m.tensors.items() if role not in ("input_scale", "input_global_scale")}


def fit_to(part: W4Weight, layout: W4Layout) -> W4Weight:
    """A repacked part in the layout of the weight it fills: its global scale folded into its scales where the
    weight's parts carry different ones, an identity permutation where the weight is act-order but this part's
    g_idx is sorted."""
    import torch
    if part.kind == "fp4" and part.global_scale != layout.global_scale:
        part = part.folded()
    if layout.act_order and part.perm is None:
        K = part.in_features
        part = type(part).of(part.codes, part.scales, part.group, part.kind, part.zeros, part.zero_point,
                             torch.arange(K, device=part.codes.device), part.global_scale)
    return part


# ---------------------------------------------------------------------------------------------------------------
# Placement: which of the model's weights are held 4-bit


@dataclass
class ModuleFacts:
    """What a module's data (not its headers) says that decides its weight's placement."""

    order: bytes | None = None            # act-order: its permutation, None when its g_idx is sorted
    global_scale: float | None = None     # NVFP4


def read_facts(modules: list[QuantizedModule], read: Callable[[TensorInfo], torch.Tensor]) -> dict[str, ModuleFacts]:
    """The g_idx of act-order modules and the global scales of NVFP4 ones (small tensors), by module name."""
    facts: dict[str, ModuleFacts] = {}
    for m in modules:
        if m.kind == "fp4":
            role = "weight_scale_2" if m.fmt.packing == "modelopt-nvfp4" else "weight_global_scale"
            facts[m.name] = ModuleFacts(global_scale=global_scale_of(m, {role: read(m.tensors[role])}))
        elif m.fmt.act_order:
            facts[m.name] = ModuleFacts(order=group_order_key(read(m.tensors[m.fmt.g_idx_role]), m))
    return facts


@dataclass
class W4Placement:
    """The model's weights held 4-bit: parameter name -> its W4Layout, canonical tensor name -> the parameter it
    fills, and what that holds (values and bytes, for the memory plan)."""

    layouts: dict[str, W4Layout]
    kept: dict[str, str]
    values: int = 0
    bytes: int = 0
    label: str = ""


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def w4_placement(cfg: ModelConfig, items: list[TensorToLoad], facts: dict[str, ModuleFacts] | None) -> W4Placement:
    """Which linear weights are held 4-bit. A weight is when every checkpoint tensor that fills it is 4-bit alike
    (the same kind, group size, scale dtype, and zero points stored or not), filled as it is (fused q | k | v,
    gate | up, Qwen3.5's in_proj_qkv | in_proj_z and in_proj_b | in_proj_a, a MoE layer's per-expert tensors into
    stacked [E, N, K]) and the parts that read one input share their act-order permutation (GPTQ's q, k, v do: one
    input, one Hessian). Otherwise each part loads as stored, a 4-bit one dequantized to the model's dtype (a bf16
    in_proj_a / in_proj_b beside a 4-bit in_proj_qkv | in_proj_z; Qwen3-Next's interleaved GDN projections, which
    are reordered at load). NVFP4 parts with different global scales share one with their scales folded
    (W4Weight.folded). facts: read_facts' of the modules whose data matter here (None: headers alone, as --check of
    a folder without tensor data; the parts are then taken to share their permutation). The plan reads no global
    scale: they change no byte count."""
    import torch

    from tinyserve.kernels.w4_weight import W4Weight
    from tinyserve.models.qwen3_next import Qwen3NextForCausalLM
    from tinyserve.models.weights import TextWeights, W4Layout
    by_name = {it.canonical: it.w4 for it in items if it.w4 is not None}
    if not by_name:
        return W4Placement({}, {})
    probe = Qwen3NextForCausalLM(dataclasses.replace(cfg, vision_config=None), torch.bfloat16, "meta")
    placement = W4Placement({}, {})
    labels: set[str] = set()
    for param, parts in TextWeights(probe).linear_parts().items():
        modules = [by_name.get(c) for c, _, _ in parts]
        if any(m is None for m in modules):
            continue
        alike = {(m.kind, m.group, m.scale_tag, m.fmt.symmetric) for m in modules}
        if len(alike) != 1:
            log.info("%s: its parts are stored 4-bit differently (%s): dequantized", param, sorted(alike))
            continue
        kind, group, tag, symmetric = alike.pop()
        orders: dict[str | None, set[bytes | None]] = {}
        for (canonical, _, _), m in zip(parts, modules):
            found = _EXPERT.search(canonical)
            order = facts[m.name].order if facts is not None and m.name in facts else \
                (b"declared" if facts is None and m.fmt.act_order else None)
            orders.setdefault(found.group(1) if found else None, set()).add(order)
        if any(len(o) > 1 for o in orders.values()):
            log.warning("%s: its parts' act-order permutations differ: dequantized", param)
            continue
        act_order = any(o != {None} for o in orders.values())
        # NVFP4: the parts' common global scale, or 1 with theirs folded in (unread, as by the plan: 1, no matter)
        scales = {facts[m.name].global_scale if facts and m.name in facts else None for m in modules}
        layout = W4Layout(kind, group, getattr(torch, _SCALE_TAGS[tag]), not symmetric, 8, act_order,
                          scales.pop() if len(scales) == 1 and None not in scales else 1.0)
        shape = probe.get_parameter(param).shape
        placement.layouts[param] = layout
        placement.kept.update((c, param) for c, _, _ in parts)
        placement.values += math.prod(shape)
        placement.bytes += W4Weight.bytes_for(shape[-2], shape[-1], group, _SCALE_BYTES[tag], not symmetric,
                                              act_order, shape[0] if len(shape) == 3 else None)
        labels.update(m.label for m in modules)
        if act_order:
            labels.add("act-order")
    placement.label = ", ".join(sorted(labels))
    return placement
