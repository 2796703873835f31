"""Shared helpers of the benchmark scripts: the cached ~30M-parameter hybrid checkpoint, prompts, timers, RSS.

The checkpoint is a transformers Qwen3_5ForCausalLM (fp32, random weights, perturbed 1-D weights) in the 3:1
linear/full layer pattern, saved sharded so the loader's multi-file path is what gets measured. It is built once
and reused from the cache folder (a marker file records the build parameters, so a change rebuilds it).
"""
from __future__ import annotations

import json
import os
import resource
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DEFAULT_DIR = Path(os.environ.get("TINYSERVE_BENCH_DIR", Path.home() / ".cache" / "tinyserve" / "bench"))


@dataclass(frozen=True)
class BenchModelSpec:
    """Shape of the benchmark checkpoint (about 30M parameters)."""

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
    max_position_embeddings: int = 8192
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


def _perturb_1d(model: torch.nn.Module, seed: int) -> None:
    """Random values for every 1-D weight (norms initialise to 0/1, A_log and dt_bias to constants)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def bench_checkpoint(folder: str | Path | None = None, spec: BenchModelSpec = BenchModelSpec()) -> Path:
    """Folder of the benchmark checkpoint, building it with transformers (CPU, fp32) on first use."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    folder = Path(folder or DEFAULT_DIR) / "qwen3_5_30m"
    marker = folder / "bench_spec.json"
    want = json.dumps(spec.hf_config_kwargs() | {"max_shard_size": spec.max_shard_size, "seed": spec.seed},
                      sort_keys=True)
    if marker.exists() and marker.read_text() == want:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    torch.manual_seed(spec.seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**spec.hf_config_kwargs())).eval()
    _perturb_1d(model, spec.seed)
    model.save_pretrained(str(folder), safe_serialization=True, max_shard_size=spec.max_shard_size)
    marker.write_text(want)
    return folder


def load_hf(folder: Path):
    """The transformers oracle of a benchmark checkpoint (fp32, eval mode)."""
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


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
    """n random prompts with lengths spread over [lo, hi] (ids avoid the special ids 0..2)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


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
