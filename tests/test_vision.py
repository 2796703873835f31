"""Image input against transformers 5.24: the image processor (bit for bit), the vision tower (fp32 features), the
M-RoPE positions (exact integers) and the rotary cos/sin they produce, on the tiny multimodal checkpoint."""
from __future__ import annotations

import base64
import io
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer as HFTokenizer
from transformers import PreTrainedTokenizerFast, Qwen3_5TextConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

from checkpoints import TINY_VL_PREPROCESSOR, make_qwen3_5_vl, read_tensors
from tinyserve.images import (DEFAULT_MAX_DECODE_PIXELS, ImageError, ImageProcessorConfig, decode_image,
                              image_from_data_url, image_token_count, parse_data_url, preprocess, smart_resize)
from tinyserve.models.qwen3_next import Rotary
from tinyserve.models.qwen_vision import (ImageSpan, VisionConfig, VisionTower, mrope_cos_sin, mrope_delta,
                                          mrope_positions, mrope_positions_range)

SIZES = [(40, 24), (20, 12), (400, 300), (24, 192), (192, 24), (33, 17), (120, 80)]   # (width, height)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder, oracle = make_qwen3_5_vl(tmp_path_factory.mktemp("vl"))
    return folder, oracle, json.loads((folder / "config.json").read_text())


@pytest.fixture(scope="module")
def tower(vl):
    folder, _, raw = vl
    t = VisionTower(VisionConfig.from_dict(raw["vision_config"]))
    for name, tensor in read_tensors(folder).items():
        if name.startswith("model.visual."):
            t.load_tensor(name[len("model.visual."):], tensor)
    return t


def _random_image(w: int, h: int, mode: str, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    alpha = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8))
    if mode == "RGBA":
        img = rgb.copy()
        img.putalpha(alpha)
        return img
    if mode == "LA":
        img = rgb.convert("L").convert("LA")
        img.putalpha(alpha)
        return img
    if mode == "P+transparency":       # palette image whose colour index 3 is transparent (as GIF / PNG tRNS)
        img = rgb.quantize(colors=16)
        img.info["transparency"] = 3
        return img
    return rgb.convert(mode)


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# (a) the image processor
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_preprocess_matches_transformers_bit_for_bit(vl, size):
    folder = vl[0]
    cfg = ImageProcessorConfig.from_folder(folder)
    hf = Qwen2VLImageProcessorPil.from_pretrained(str(folder))      # the same preprocessor_config.json
    assert (hf.patch_size, hf.merge_size, hf.size["shortest_edge"], hf.size["longest_edge"]) == \
        (cfg.patch_size, cfg.merge_size, cfg.min_pixels, cfg.max_pixels)
    w, h = size
    digests = set()
    for mode in ["RGB", "RGBA", "L", "LA", "P", "P+transparency"]:
        img = _random_image(w, h, mode)
        ours = preprocess(img, cfg)
        ref = hf(img, return_tensors="pt")
        assert ours.pixel_values.dtype == torch.float32
        assert torch.equal(ours.pixel_values, ref["pixel_values"]), mode
        assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist(), mode
        assert ours.num_tokens == ref["pixel_values"].shape[0] // 4 == image_token_count(h, w, cfg)
        digests.add(ours.digest)
    assert len(digests) == 6        # different pixels, different digests


def test_transparency_is_composited_onto_white(vl):
    cfg = ImageProcessorConfig.from_folder(vl[0])
    clear = Image.new("RGBA", (40, 24), (0, 0, 0, 0))
    out = preprocess(clear, cfg)                       # 40x24 is under min_pixels: upscaled to 48x32, 8x12 patches
    assert out.grid_thw == (1, 8, 12)
    assert torch.equal(out.pixel_values, torch.ones(96, 96))     # white: (1 - .5) / .5


def test_token_counts_match_transformers():
    released = ImageProcessorConfig()          # no preprocessor file: the released Qwen3.5 settings
    hf = Qwen2VLImageProcessorPil(size={"shortest_edge": 65536, "longest_edge": 16777216}, patch_size=16,
                                  temporal_patch_size=2, merge_size=2, image_mean=[.5] * 3, image_std=[.5] * 3)
    table = {(300, 200): 70, (64, 500): 69, (256, 256): 64, (512, 512): 256, (1024, 1024): 1024,
             (1920, 1080): 2040, (5000, 4000): 16302, (10, 1000): 80}    # qwen-vision.md §2.2, (w, h)
    for (w, h), tokens in table.items():
        assert image_token_count(h, w, released) == tokens == hf.get_number_of_image_patches(h, w) // 4


def test_smart_resize_matches_transformers():
    rnd = random.Random(0)
    sizes = [(rnd.randint(1, 3000), rnd.randint(1, 3000)) for _ in range(300)]
    sizes += [(1, 1), (8, 1600), (12, 20), (28, 36), (1, 200), (200, 1), (4, 4)]   # ties, extremes
    for limits in [(1024, 65536, 8), (65536, 16777216, 32), (3136, 1003520, 28)]:
        lo, hi, f = limits
        for h, w in sizes:
            if max(h, w) / min(h, w) > 200:
                continue
            assert smart_resize(h, w, f, lo, hi) == hf_smart_resize(h, w, f, lo, hi), (h, w, limits)
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(1, 201, 32, 65536, 16777216)
    with pytest.raises(ImageError, match="aspect ratio"):
        image_token_count(2000, 9, ImageProcessorConfig())
    with pytest.raises(ImageError, match="no pixels"):
        smart_resize(0, 10, 32, 65536, 16777216)


def test_processor_config_sources(tmp_path):
    assert ImageProcessorConfig.from_folder(tmp_path) == ImageProcessorConfig(
        patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=65536, max_pixels=16777216)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": TINY_VL_PREPROCESSOR}))
    nested = ImageProcessorConfig.from_folder(tmp_path)
    assert (nested.patch_size, nested.min_pixels, nested.max_pixels) == (4, 1024, 65536)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 14, "min_pixels": 3136, "max_pixels": 12845056, "image_mean": [0.1, 0.2, 0.3]}))
    flat = ImageProcessorConfig.from_folder(tmp_path)        # preferred over processor_config.json
    assert (flat.patch_size, flat.factor, flat.min_pixels, flat.max_pixels) == (14, 28, 3136, 12845056)
    assert flat.image_mean == (0.1, 0.2, 0.3) and flat.image_std == (0.5, 0.5, 0.5)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 10, "longest_edge": 5}}))
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        ImageProcessorConfig.from_folder(tmp_path)


def test_digest_names_pixels_and_settings(vl):
    cfg = ImageProcessorConfig.from_folder(vl[0])
    img = _random_image(40, 24, "RGB")
    same = _random_image(40, 24, "RGB")
    one_pixel = img.copy()
    one_pixel.putpixel((5, 5), (0, 0, 0) if img.getpixel((5, 5)) != (0, 0, 0) else (1, 1, 1))
    assert preprocess(img, cfg).digest == preprocess(same, cfg).digest
    assert preprocess(img, cfg).digest != preprocess(one_pixel, cfg).digest
    other = ImageProcessorConfig(**{**cfg.__dict__, "max_pixels": cfg.max_pixels + 1})   # same pixels, new setting
    assert torch.equal(preprocess(img, other).pixel_values, preprocess(img, cfg).pixel_values)
    assert preprocess(img, other).digest != preprocess(img, cfg).digest


# ---------------------------------------------------------------------------------------------------------------
# (b) data URLs and decoding
# ---------------------------------------------------------------------------------------------------------------

def test_data_urls():
    png = _encode(_random_image(6, 4, "RGB"), "PNG")
    b64 = base64.b64encode(png).decode()
    assert parse_data_url(f"data:image/png;base64,{b64}") == ("image/png", png)
    wrapped = "\n".join(b64[i:i + 20] for i in range(0, len(b64), 20))       # MIME line breaks are fine
    assert parse_data_url(f"DATA:Image/PNG;base64,{wrapped}") == ("image/png", png)
    assert image_from_data_url(f"data:image/png;base64,{b64}").size == (6, 4)
    with pytest.raises(ImageError, match="remote image URLs are not fetched"):
        parse_data_url("https://example.com/cat.png")
    with pytest.raises(ImageError, match="is not an image"):
        parse_data_url(f"data:text/plain;base64,{b64}")
    with pytest.raises(ImageError, match="not valid base64"):
        parse_data_url("data:image/png;base64,iVBOR*w0KGgo=")
    with pytest.raises(ImageError, match="not valid base64"):
        parse_data_url("data:image/png;base64,iVBORw0KGgo")              # missing padding
    with pytest.raises(ImageError, match="base64-encoded"):
        parse_data_url("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="expected a data URL"):
        parse_data_url("file:///etc/passwd")
    with pytest.raises(ImageError, match="empty"):
        parse_data_url("data:image/png;base64,")


@pytest.mark.parametrize("fmt,media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                            ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_decode_formats(fmt, media_type):
    img = _random_image(24, 16, "RGB")
    kw = {"lossless": True} if fmt == "WEBP" else {}
    out = decode_image(_encode(img, fmt, **kw), media_type)
    assert out.size == (24, 16) and out.format == fmt
    if fmt in ("PNG", "WEBP"):
        assert np.array_equal(np.asarray(out.convert("RGB")), np.asarray(img))
    assert decode_image(_encode(img, fmt, **kw), "image/png").size == (24, 16)   # the bytes decide the format


def test_decode_gif_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 0, 255)]]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    out = decode_image(buf.getvalue(), "image/gif")
    assert getattr(out, "n_frames", 1) == 2
    assert out.convert("RGB").getpixel((3, 3)) == (255, 0, 0)


def test_decode_errors():
    img = _random_image(24, 16, "RGB")
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF"):
        decode_image(_encode(img, "BMP"))
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF"):
        decode_image(b"definitely not an image")
    with pytest.raises(ImageError, match="unsupported image type 'image/bmp'"):
        decode_image(_encode(img, "PNG"), "image/bmp")
    with pytest.raises(ImageError, match="cannot decode"):
        decode_image(_encode(img, "PNG")[:60])                          # truncated
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"")
    with pytest.raises(ImageError, match="too large"):
        decode_image(_encode(img, "PNG"), max_pixels=24 * 16 - 1)
    # a decompression bomb: ~20 KB of PNG for 81 megapixels, refused from the header without decoding
    bomb = _encode(Image.new("1", (9000, 9000)), "PNG", optimize=True)
    assert len(bomb) < 100_000 and 9000 * 9000 > DEFAULT_MAX_DECODE_PIXELS
    with pytest.raises(ImageError, match="too large"):
        decode_image(bomb, "image/png")


# ---------------------------------------------------------------------------------------------------------------
# (c) the vision tower
# ---------------------------------------------------------------------------------------------------------------

def test_tower_weights_cover_the_checkpoint(vl, tower):
    folder, oracle, raw = vl
    visual = {n[len("model.visual."):]: tuple(t.shape) for n, t in read_tensors(folder).items()
              if n.startswith("model.visual.")}
    assert tower.expected_tensors() == visual
    n_hf = sum(p.numel() for p in oracle.model.visual.parameters())
    assert VisionConfig.from_dict(raw["vision_config"]).num_parameters == n_hf
    assert tower.param_bytes() == 4 * n_hf
    with pytest.raises(ValueError, match="shape"):
        tower.load_tensor("merger.norm.bias", torch.zeros(3))
    with pytest.raises(KeyError):
        tower.load_tensor("merger.nonexistent", torch.zeros(3))


def test_released_vision_config_size():
    cfg = VisionConfig.from_dict({"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152, "num_heads": 16,
                                  "intermediate_size": 4304, "out_hidden_size": 5120, "patch_size": 16,
                                  "num_position_embeddings": 2304, "deepstack_visual_indexes": []})
    assert cfg.num_parameters == 460_730_096 and cfg.rope_theta == 10000.0 and cfg.head_dim == 72   # §1.2


def test_tower_matches_transformers(vl, tower):
    oracle = vl[1]
    cfg = ImageProcessorConfig.from_folder(vl[0])
    images = [preprocess(_random_image(40, 24, "RGB", seed=1), cfg),
              preprocess(_random_image(56, 72, "RGB", seed=2), cfg)]
    assert images[0].grid_thw != images[1].grid_thw
    pv = torch.cat([im.pixel_values for im in images])
    grids = [im.grid_thw for im in images]
    with torch.no_grad():
        ref = oracle.model.get_image_features(pv, torch.tensor(grids)).pooler_output
        ours = tower(pv, grids)
        singles = [tower(im.pixel_values, [im.grid_thw]) for im in images]
    assert ours.shape == (sum(im.num_tokens for im in images), 64)
    assert (ours - torch.cat(ref)).abs().max().item() <= 1e-5
    assert (ours - torch.cat(singles)).abs().max().item() <= 1e-6     # images never see each other
    for single, r in zip(singles, ref):
        assert (single - r).abs().max().item() <= 1e-5


def test_tower_video_grid_matches_transformers(vl, tower):
    oracle = vl[1]                   # t = 2: two attention segments, the position table repeated per frame pair
    g = torch.Generator().manual_seed(3)
    grid = (2, 4, 6)
    pv = torch.randn(2 * 4 * 6, tower.cfg.patch_dim, generator=g)
    with torch.no_grad():
        ref = torch.cat(oracle.model.get_video_features(pv, torch.tensor([grid])).pooler_output)
        ours = tower(pv, [grid])
    assert (ours - ref).abs().max().item() <= 1e-5


def test_tower_bf16_close_to_fp32(vl, tower):
    folder, _, raw = vl
    t16 = VisionTower(VisionConfig.from_dict(raw["vision_config"]), torch.bfloat16)
    for name, tensor in read_tensors(folder).items():
        if name.startswith("model.visual."):
            t16.load_tensor(name[len("model.visual."):], tensor)
    im = preprocess(_random_image(40, 24, "RGB", seed=1), ImageProcessorConfig.from_folder(folder))
    with torch.no_grad():
        a, b = tower(im.pixel_values, [im.grid_thw]), t16(im.pixel_values, [im.grid_thw])
    assert b.dtype == torch.bfloat16
    assert ((b.float() - a).norm() / a.norm()).item() < 2e-2


def test_tower_rejects_bad_grids(tower):
    pv = torch.zeros(24, tower.cfg.patch_dim)
    with pytest.raises(ValueError, match="need 32"):
        tower(pv, [(1, 4, 8)])
    with pytest.raises(ValueError, match="multiples of the merge size"):
        tower(torch.zeros(15, tower.cfg.patch_dim), [(1, 3, 5)])
    with pytest.raises(ValueError, match=r"\[N, 96\]"):
        tower(torch.zeros(24, 95), [(1, 4, 6)])


# ---------------------------------------------------------------------------------------------------------------
# (d) M-RoPE positions
# ---------------------------------------------------------------------------------------------------------------

def _prompt(folder, messages, grids: list[tuple[int, int]]) -> tuple[list[int], list[ImageSpan], dict]:
    """Render with transformers' chat template, tokenize, expand each <|image_pad|> to gh * gw pads."""
    raw = json.loads((folder / "config.json").read_text())
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = HFTokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    pad = raw["image_token_id"]
    assert ids.count(pad) == len(grids)
    out, spans, it = [], [], iter(grids)
    for t in ids:
        if t == pad:
            gh, gw = next(it)
            spans.append(ImageSpan(len(out), gh, gw))
            out += [pad] * (gh * gw)
        else:
            out.append(t)
    return out, spans, raw


def _hf_positions(oracle, ids: list[int], spans: list[ImageSpan], pad: int):
    input_ids = torch.tensor([ids])
    mm = (input_ids == pad).int()               # 0 text, 1 image, 2 video
    grid = torch.tensor([[1, 2 * s.grid_h, 2 * s.grid_w] for s in spans]) if spans else None
    pos, delta = oracle.model.get_rope_index(input_ids, mm, image_grid_thw=grid)
    return pos[:, 0], int(delta.item())


def _img(text_before: str | None = None, text_after: str | None = None) -> list[dict]:
    parts = [{"type": "text", "text": text_before}] if text_before else []
    parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
    if text_after:
        parts.append({"type": "text", "text": text_after})
    return parts


CASES = {
    "image_first": ([{"role": "user", "content": _img(None, "What is this?")}], [(3, 5)]),
    "image_last": ([{"role": "user", "content": _img("Describe:")}], [(6, 2)]),
    "two_images": ([{"role": "user", "content": _img("A", "and") + _img(None, "B?")},
                    {"role": "assistant", "content": "Two pictures."},
                    {"role": "user", "content": [{"type": "image", "source": {"type": "base64"}},
                                                 {"type": "text", "text": "and this?"}]}],
                   [(4, 7), (5, 1), (2, 2)]),
    "text_only": ([{"role": "user", "content": "Hello there"}], []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mrope_positions_match_get_rope_index(vl, case):
    folder, oracle, _ = vl
    messages, grids = CASES[case]
    ids, spans, raw = _prompt(folder, messages, grids)
    ref, ref_delta = _hf_positions(oracle, ids, spans, raw["image_token_id"])
    pos, delta = mrope_positions(len(ids), spans)
    assert pos.dtype == torch.int64 and torch.equal(pos, ref)
    assert delta == ref_delta == mrope_delta(spans) == pos.max().item() + 1 - len(ids)
    if spans:
        assert delta < 0


@pytest.mark.parametrize("layout", ["bare", "ends_in_image", "adjacent_text_between"])
def test_mrope_positions_raw_sequences(vl, layout):
    _, oracle, raw = vl
    pad, start, end = raw["image_token_id"], raw["vision_start_token_id"], raw["vision_end_token_id"]
    if layout == "bare":                                      # nothing but one image's pads
        spans = [ImageSpan(0, 3, 4)]
        ids = [pad] * 12
    elif layout == "ends_in_image":                           # a prompt cut inside an image (the last pads)
        spans = [ImageSpan(3, 2, 9)]
        ids = [10, 11, start] + [pad] * 18
    else:                                                     # two images with one text token between them
        spans = [ImageSpan(1, 2, 2), ImageSpan(6, 1, 3)]
        ids = [start] + [pad] * 4 + [end] + [pad] * 3 + [end, 40]
    ref, ref_delta = _hf_positions(oracle, ids, spans, pad)
    pos, delta = mrope_positions(len(ids), spans)
    assert torch.equal(pos, ref) and delta == ref_delta


def test_mrope_range_is_exact_slice(vl):
    folder = vl[0]
    messages, grids = CASES["two_images"]
    ids, spans, _ = _prompt(folder, messages, grids)
    full, delta = mrope_positions(len(ids), spans)
    L = len(ids)
    for width in (1, 5, 17, 64):
        for start in range(0, L, 1 if width < 17 else 3):
            end = min(L, start + width)
            assert torch.equal(mrope_positions_range(start, end, spans), full[:, start:end]), (start, end)
    tail = mrope_positions_range(L, L + 6, spans)             # decode tokens past the prompt: i + delta
    assert torch.equal(tail, (torch.arange(L, L + 6) + delta).expand(3, -1))
    assert mrope_positions_range(5, 5, spans).shape == (3, 0)
    assert torch.equal(mrope_positions_range(0, 9, []), torch.arange(9).expand(3, -1))
    shuffled = list(reversed(spans))                          # order of the list does not matter
    assert torch.equal(mrope_positions(L, shuffled)[0], full)


def test_mrope_span_errors():
    with pytest.raises(ValueError, match="overlap"):
        mrope_positions(40, [ImageSpan(2, 2, 2), ImageSpan(5, 1, 1)])
    with pytest.raises(ValueError, match="past the prompt"):
        mrope_positions(10, [ImageSpan(8, 2, 2)])
    with pytest.raises(ValueError, match="bad image span"):
        mrope_positions(10, [ImageSpan(0, 0, 2)])


# ---------------------------------------------------------------------------------------------------------------
# (e) rotary cos / sin from 3-row positions
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [True, False])
def test_mrope_cos_sin_with_identical_rows_is_plain_rotary(interleaved):
    rotary = Rotary(8, 1e7, "cpu")
    positions = torch.arange(0, 5000, 7)
    cos, sin = rotary.cos_sin(positions)
    mcos, msin = mrope_cos_sin(positions.expand(3, -1), rotary.inv_freq, [2, 1, 1], interleaved)
    assert mcos.shape == cos.shape == (len(positions), 1, 8)
    assert torch.equal(mcos, cos) and torch.equal(msin, sin)
    big = Rotary(64, 1e7, "cpu")
    cos, sin = big.cos_sin(positions)
    mcos, msin = mrope_cos_sin(positions, big.inv_freq, [11, 11, 10], interleaved)
    assert torch.equal(mcos, cos) and torch.equal(msin, sin)


def test_mrope_cos_sin_matches_transformers_tiny(vl):
    folder, oracle, _ = vl
    messages, grids = CASES["two_images"]
    ids, spans, _ = _prompt(folder, messages, grids)
    pos, _ = mrope_positions(len(ids), spans)
    hf_cos, hf_sin = oracle.model.language_model.rotary_emb(torch.zeros(1), pos[:, None, :])
    rotary = Rotary(8, 1e7, "cpu")                              # text config: head_dim 32 x 0.25, theta 1e7
    cos, sin = mrope_cos_sin(pos, rotary.inv_freq, [2, 1, 1], True)
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])
    # and it is not the 1-D rotary: the image tokens' h / w rows matter
    assert not torch.equal(cos, rotary.cos_sin(pos[0])[0])


def _image_positions(seed: int) -> torch.Tensor:
    rnd = random.Random(seed)
    spans, at = [], 3
    for _ in range(3):
        gh, gw = rnd.randint(1, 40), rnd.randint(1, 40)
        spans.append(ImageSpan(at, gh, gw))
        at += gh * gw + rnd.randint(1, 9)
    return mrope_positions(at + 5, spans)[0]


def test_mrope_cos_sin_matches_transformers_27b_section():
    cfg = Qwen3_5TextConfig(hidden_size=5120, num_attention_heads=24, head_dim=256, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True})
    pos = _image_positions(0)
    hf_cos, hf_sin = Qwen3_5TextRotaryEmbedding(cfg)(torch.zeros(1), pos[:, None, :])
    cos, sin = mrope_cos_sin(pos, Rotary(64, 1e7, "cpu").inv_freq, [11, 11, 10], True)
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])


def test_mrope_cos_sin_contiguous_sections_match_qwen2_vl():
    cfg = Qwen2VLTextConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
    pos = _image_positions(1)
    hf_cos, hf_sin = Qwen2VLRotaryEmbedding(cfg)(torch.zeros(1), pos[:, None, :])
    cos, sin = mrope_cos_sin(pos, Rotary(16, 1e6, "cpu").inv_freq, [2, 3, 3], False)
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])
    with pytest.raises(ValueError, match="sum to"):
        mrope_cos_sin(pos, Rotary(16, 1e6, "cpu").inv_freq, [2, 2, 2], False)


def test_tower_features_and_positions_reproduce_the_hf_forward(vl, tower):
    """The integration contract: features of all images concatenated in prompt order replace the <|image_pad|> rows
    of the embeddings, the rotary takes mrope_positions, and the LM is otherwise unchanged."""
    folder, oracle, raw = vl
    pad = raw["image_token_id"]
    cfg = ImageProcessorConfig.from_folder(folder)
    images = [preprocess(_random_image(40, 24, "RGB", seed=4), cfg), preprocess(_random_image(24, 64, "L"), cfg)]
    messages = [{"role": "user", "content": _img("Compare", "with") + _img(None, "please.")}]
    ids, spans, _ = _prompt(folder, messages, [im.token_grid(cfg.merge_size) for im in images])
    input_ids = torch.tensor([ids])
    pv = torch.cat([im.pixel_values for im in images])
    grids = [im.grid_thw for im in images]
    with torch.no_grad():
        ref = oracle(input_ids=input_ids, pixel_values=pv, image_grid_thw=torch.tensor(grids),
                     mm_token_type_ids=(input_ids == pad).int()).logits[0]
        emb = oracle.model.get_input_embeddings()(input_ids)[0].clone()
        emb[input_ids[0] == pad] = tower(pv, grids)
        pos, _ = mrope_positions(len(ids), spans)
        lm = oracle.model.language_model
        logits = oracle.lm_head(lm(inputs_embeds=emb[None], position_ids=pos[:, None, :]).last_hidden_state)[0]
        plain = oracle.lm_head(lm(inputs_embeds=emb[None]).last_hidden_state)[0]   # 1-D positions: wrong
    assert (logits - ref).abs().max().item() <= 1e-4
    assert (plain - ref).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------------------------------------------
# the checkpoint folder: tokenizer, template, ids
# ---------------------------------------------------------------------------------------------------------------

def test_vl_checkpoint_tokens_and_template(vl):
    folder, oracle, raw = vl
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    for key, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]:
        assert hf_tok.convert_tokens_to_ids(token) == raw[key] == getattr(oracle.config, key)
        assert hf_tok.encode(token, add_special_tokens=False) == [raw[key]]
    assert raw["text_config"]["vocab_size"] >= len(hf_tok)
    openai = [{"role": "user", "content": _img(None, "What is this?")}]
    anthropic = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "AAAA"}},
                                              {"type": "text", "text": "What is this?"}]}]
    expected = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
                "<|im_start|>assistant\n")
    for messages in (openai, anthropic):
        assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == expected
    with pytest.raises(Exception, match="System message cannot contain images"):
        hf_tok.apply_chat_template([{"role": "system", "content": _img(None, "x")},
                                    {"role": "user", "content": "hi"}], tokenize=False)
    with pytest.raises(Exception, match="Unexpected item type"):
        hf_tok.apply_chat_template([{"role": "user", "content": [{"type": "audio"}]}], tokenize=False)
    # text-only prompts render exactly as the demo template does
    from tinyserve.demo import CHAT_TEMPLATE
    text = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert hf_tok.apply_chat_template(text, tokenize=False, add_generation_prompt=True) == \
        hf_tok.apply_chat_template(text, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)


def test_vl_checkpoint_loads_in_tinyserve(vl):
    from tinyserve.model_config import read_model_config
    from tinyserve.tokenizer import Tokenizer

    folder, oracle, raw = vl
    cfg = read_model_config(folder)
    assert cfg.vocab_size == raw["text_config"]["vocab_size"] and cfg.rotary_dim == 8
    assert cfg.eos_token_ids[0] == Tokenizer.from_folder(folder).encode("<|im_end|>")[0]
