"""Image input: the vision tower's time per image and the TTFT of an image request, cold and cached, through a
`tinyserve` process over HTTP on the CPU with the tiny VL checkpoint of the tests; then the tower's FLOPs and
memory for one 1024x1024 image on the Qwen3.5-27B vision config (computed from the config, not measured).

    python bench/vision.py            # ~1 min

TTFT is the latency of a chat completion with max_tokens = 1 (the prompt's prefill, the image's encoding when it
is not in the feature cache, one sampled token), the median of --repeats requests per case:
- cold: a new image (new pixels each time) after new text: the tower runs and nothing is cached;
- same image, same text: the prefix cache holds the whole prompt (a hit through the image);
- same image, other text first: the KV misses (the text before it differs) but the tower is skipped (feature cache);
- text only, same token count: the prefill alone, for scale.
The tower's time per image comes from the server's /metrics (vision_encoder_seconds / images_encoded).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from common import DEFAULT_DIR, ServerProcess, fmt_table, free_port  # noqa: E402

# The released Qwen3.5 / 3.6 27B-class vision_config, as its config.json gives it.
VISION_27B = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=5120, num_position_embeddings=2304,
                  in_channels=3, hidden_act="gelu_pytorch_tanh")


def vl_checkpoint(folder: Path) -> Path:
    from checkpoints import make_qwen3_5_vl
    if not (folder / "config.json").is_file():
        make_qwen3_5_vl(folder, seed=0)
    return folder


def image_url(w: int, h: int, seed: int) -> str:
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat(url: str, text_before: str, image: str | None, text_after: str) -> tuple[float, dict]:
    content = [{"type": "text", "text": text_before}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": image}})
    content.append({"type": "text", "text": text_after})
    body = {"model": "tinyserve", "messages": [{"role": "user", "content": content}], "max_tokens": 1,
            "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t0, out


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(tinyserve:[a-z_]+) ([0-9.e+-]+)$", text, re.M)}


def tower_costs(cfg: dict, width: int, height: int) -> dict[str, float]:
    """FLOPs (2 x multiply-adds) and memory of one image through the tower, from its config."""
    from tinyserve.images import ImageProcessorConfig, smart_resize
    from tinyserve.models.qwen_vision import VisionConfig
    vc = VisionConfig.from_dict(cfg)
    proc = ImageProcessorConfig(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                temporal_patch_size=vc.temporal_patch_size)
    h, w = smart_resize(height, width, proc.factor, proc.min_pixels, proc.max_pixels)
    n = (h // vc.patch_size) * (w // vc.patch_size)                 # patches
    tokens = n // vc.merge_unit                                     # LM tokens after the 2x2 merger
    d, i, m = vc.hidden_size, vc.intermediate_size, vc.merge_unit * vc.hidden_size
    linear = n * vc.patch_dim * d + vc.depth * n * (d * 3 * d + d * d + 2 * d * i) + \
        tokens * (m * m + m * vc.out_hidden_size)
    attention = vc.depth * 2 * n * n * d                            # QK^T and AV, full attention in the image
    return dict(patches=n, tokens=tokens, linear_tflop=2 * linear / 1e12, attention_tflop=2 * attention / 1e12,
                weights_gb=vc.num_parameters * 2 / 1e9,            # bf16
                activations_mb=n * (d + 3 * d + i + d) * 2 / 1e6,   # one block's live tensors in bf16
                scores_gb=vc.num_heads * n * n * 2 / 1e9,           # attention scores if materialized (no flash)
                features_mb=tokens * vc.out_hidden_size * 2 / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR / "qwen3_5_vl_tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--size", type=int, default=256, help="test image side in pixels (256: 1024 image tokens)")
    args = ap.parse_args()
    import tomli_w
    folder = vl_checkpoint(args.dir)
    work = Path(tempfile.mkdtemp(prefix="tinyserve-vision-bench-"))
    port = free_port()
    cfg = {"model": {"path": str(folder), "device": "cpu", "context_length": 4096},
           "server": {"host": "127.0.0.1", "port": port},
           "engine": {"max_running_requests": 1, "kv_cache_tokens": 16384, "page_size": 16},
           "log": {"level": "warning"}}
    (work / "vision.toml").write_text(tomli_w.dumps(cfg))
    server = ServerProcess("tinyserve", [sys.executable, "-m", "tinyserve.cli", str(work / "vision.toml")],
                           f"http://127.0.0.1:{port}", work / "server.log", env={**os.environ, "OMP_NUM_THREADS": "1"})
    server.wait_ready()
    url, s = server.url, args.size
    try:
        chat(url, "warm up", image_url(s, s, 999), "?")
        cases: dict[str, list[float]] = {k: [] for k in ("cold", "same", "feature", "text")}
        cached: dict[str, list[int]] = {k: [] for k in cases}
        sizes: dict[str, int] = {}
        prompt_tokens = 0
        for r in range(args.repeats):
            img = image_url(s, s, r)
            t, out = chat(url, f"Picture number {r}: ", img, " What is in it?")
            cases["cold"].append(t)
            prompt_tokens = out["usage"]["prompt_tokens"]
            cached["cold"].append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            sizes["cold"] = out["usage"]["prompt_tokens"]
            t, out = chat(url, f"Picture number {r}: ", img, " What is in it?")
            cases["same"].append(t)
            cached["same"].append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            sizes["same"] = out["usage"]["prompt_tokens"]
            t, out = chat(url, f"Another question {r} about ", img, " What is in it?")
            cases["feature"].append(t)
            cached["feature"].append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            sizes["feature"] = out["usage"]["prompt_tokens"]
            words = " ".join(f"w{r}x{k}" for k in range(prompt_tokens))
            t, out = chat(url, words[:int(prompt_tokens * 1.18)], None, "?")    # about as many tokens
            cases["text"].append(t)
            cached["text"].append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            sizes["text"] = out["usage"]["prompt_tokens"]
        m = metrics(url)
    finally:
        server.stop()
    per_image = m["tinyserve:vision_encoder_seconds_total"] / max(1.0, m["tinyserve:images_encoded_total"])
    cold = statistics.median(cases["cold"])
    names = {"cold": "cold (new image)", "same": "same image, same text (prefix hit)",
             "feature": "same image, other text first (feature cache)", "text": "text only (no image)"}
    rows = [(names[k], str(sizes[k]), f"{statistics.median(v) * 1e3:.1f}", f"{statistics.median(cached[k]):.0f}",
             f"{cold / statistics.median(v):.2f}x") for k, v in cases.items()]
    print(f"tiny VL checkpoint {folder}, {s}x{s} PNG ({prompt_tokens} prompt tokens with the image), "
          f"{args.repeats} requests per case, OMP_NUM_THREADS=1, max_tokens=1\n")
    print(fmt_table(rows, ("case", "prompt tokens", "TTFT median ms", "cached tokens", "speed-up vs cold")))
    print(f"\nvision tower: {per_image * 1e3:.1f} ms per image ({m['tinyserve:images_encoded_total']:.0f} encoded "
          f"of {m['tinyserve:images_total']:.0f} images in requests; the rest came from the feature cache)\n")
    c = tower_costs(VISION_27B, 1024, 1024)
    print("Qwen3.5-27B vision tower, one 1024x1024 image (computed from the released vision_config):")
    print(fmt_table([(f"{c['patches']}", f"{c['tokens']}", f"{c['linear_tflop']:.2f} + {c['attention_tflop']:.2f}",
                      f"{c['weights_gb']:.2f}", f"{c['activations_mb']:.0f}", f"{c['scores_gb']:.2f}",
                      f"{c['features_mb']:.0f}")],
                    ("patches", "LM tokens", "TFLOP linear + attention", "weights GB (bf16)",
                     "activations per block MB", "scores if materialized GB", "features MiB")))


if __name__ == "__main__":
    main()
