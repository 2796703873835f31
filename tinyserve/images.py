"""Image input: data URLs, decoding, and the Qwen2-VL / Qwen3.5 image processor.

`preprocess` reproduces transformers' `Qwen2VLImageProcessorPil` bit for bit: transparency composited onto white,
`smart_resize` to a multiple of patch * merge pixels within [min_pixels, max_pixels], a PIL bicubic resize of the
uint8 image, x * rescale_factor in float64 rounded to float32, (x - mean) / std in float32, then the patch rows in
the order the vision tower expects (2x2 merge blocks in raster order, each block's patches in raster order, every
row [C][T][P][P] with the frame repeated T times).

Everything that can go wrong with a client's image raises ImageError (a ValueError) whose message names the problem,
for the API to return as a 400.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

# Formats we decode, by media type; Pillow's format names for Image.open(formats=...).
SUPPORTED_MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
                         "image/gif": "GIF"}
_FORMATS = sorted(set(SUPPORTED_MEDIA_TYPES.values()))
# Largest image decode_image accepts (width * height of the encoded file), checked from the header before any pixel
# is decoded: a small compressed file can expand to gigabytes. 64 MP is above any camera image we expect.
DEFAULT_MAX_DECODE_PIXELS = 64 * 1024 * 1024
MAX_ASPECT_RATIO = 200          # smart_resize's limit (transformers raises above it)


class ImageError(ValueError):
    """A client image that cannot be used; the message says why."""


# ---------------------------------------------------------------------------------------------------------------
# processor settings
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageSource:
    """An image as a client sent it, before decoding: the request field it came from (errors name it) and its
    bytes (a data URL or base64 block, or a fetched URL) with the media type the client declared."""
    param: str                        # e.g. "messages[1].content[0]"
    data: bytes
    media_type: str | None = None


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The image processor's settings. Defaults are the released Qwen3.5 / 3.6 preprocessor_config.json values
    (not transformers' class defaults, which are Qwen2-VL's: patch 14, CLIP mean/std)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536             # size.shortest_edge: a pixel COUNT, not an edge
    max_pixels: int = 16777216          # size.longest_edge: a pixel count
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3                   # PIL resampling filter number: 3 = bicubic

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (one merged LM token per factor x factor pixels)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict) -> "ImageProcessorConfig":
        """From a preprocessor_config.json object (or processor_config.json's `image_processor` object); a missing
        field keeps the Qwen3.5 default. Top-level min_pixels / max_pixels override size (as transformers does)."""
        base = cls()
        size = d.get("size") or {}
        if not isinstance(size, dict):
            raise ValueError(f"image processor config: size must be an object, got {size!r}")
        min_pixels = size.get("shortest_edge", size.get("min_pixels", base.min_pixels))
        max_pixels = size.get("longest_edge", size.get("max_pixels", base.max_pixels))
        if d.get("min_pixels") is not None:
            min_pixels = d["min_pixels"]
        if d.get("max_pixels") is not None:
            max_pixels = d["max_pixels"]

        def triple(key: str, default: tuple[float, ...]) -> tuple[float, ...]:
            v = d.get(key)
            if v is None:
                return default
            v = [v] * 3 if isinstance(v, (int, float)) else list(v)
            if len(v) != 3:
                raise ValueError(f"image processor config: {key} must have 3 values (RGB), got {v}")
            return tuple(float(x) for x in v)

        cfg = cls(patch_size=int(d.get("patch_size", base.patch_size)),
                  temporal_patch_size=int(d.get("temporal_patch_size", base.temporal_patch_size)),
                  merge_size=int(d.get("merge_size", base.merge_size)),
                  min_pixels=int(min_pixels), max_pixels=int(max_pixels),
                  image_mean=triple("image_mean", base.image_mean), image_std=triple("image_std", base.image_std),
                  rescale_factor=float(d.get("rescale_factor", base.rescale_factor)),
                  resample=int(d.get("resample", base.resample)))
        cfg.validate()
        return cfg

    @classmethod
    def from_folder(cls, path: str | Path) -> "ImageProcessorConfig":
        """preprocessor_config.json, else processor_config.json (fields under `image_processor`), else defaults."""
        folder = Path(path)
        pre, combined = folder / "preprocessor_config.json", folder / "processor_config.json"
        if pre.is_file():
            return cls.from_dict(_read_json(pre))
        if combined.is_file():
            data = _read_json(combined)
            section = data.get("image_processor", data)
            if not isinstance(section, dict):
                raise ValueError(f"{combined}: image_processor must be an object")
            return cls.from_dict(section)
        return cls()

    def validate(self) -> None:
        if min(self.patch_size, self.temporal_patch_size, self.merge_size) < 1:
            raise ValueError(f"image processor config: bad patch/merge sizes in {self}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"image processor config: need 0 < min_pixels <= max_pixels, got {self.min_pixels}, "
                             f"{self.max_pixels}")
        if any(s == 0 for s in self.image_std):
            raise ValueError("image processor config: image_std has a zero")
        try:
            Image.Resampling(self.resample)
        except ValueError:
            raise ValueError(f"image processor config: unknown resample filter {self.resample}") from None

    def fingerprint(self) -> bytes:
        """Every setting that changes pixel_values, canonically encoded (part of each image's digest)."""
        return json.dumps([self.patch_size, self.temporal_patch_size, self.merge_size, self.min_pixels,
                           self.max_pixels, list(self.image_mean), list(self.image_std), repr(self.rescale_factor),
                           self.resample]).encode()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


# ---------------------------------------------------------------------------------------------------------------
# data URLs and decoding
# ---------------------------------------------------------------------------------------------------------------

_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL | re.IGNORECASE)


def decode_base64(text: str, what: str = "image data") -> bytes:
    """Standard base64 (whitespace allowed, padding required); ImageError naming `what` otherwise."""
    compact = re.sub(r"\s+", "", text)
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what} is not valid base64 ({e})") from None
    if not data:
        raise ImageError(f"{what} is empty")
    return data


def parse_data_url(url: str) -> tuple[str, bytes]:
    """`data:image/<type>;base64,<data>` -> (media type, decoded bytes)."""
    if not isinstance(url, str):
        raise ImageError(f"image url must be a string, got {type(url).__name__}")
    head = url[:16].lower()
    if head.startswith(("http://", "https://")):
        raise ImageError("remote image URLs are not fetched by this server; send the image inline as a data URL "
                         "(data:image/png;base64,...)")
    m = _DATA_URL.fullmatch(url.strip()) if head.startswith("data:") else None
    if m is None:
        raise ImageError(f"unsupported image URL {url[:40]!r}: expected a data URL (data:image/png;base64,...)")
    media_type = m.group("type").strip().lower()
    params = [p.strip().lower() for p in m.group("params").split(";") if p.strip()]
    if not media_type.startswith("image/"):
        raise ImageError(f"data URL media type {media_type or '(none)'!r} is not an image")
    if "base64" not in params:
        raise ImageError("image data URLs must be base64-encoded (data:image/png;base64,...)")
    return media_type, decode_base64(m.group("data"), "data URL payload")


def open_image(data: bytes, media_type: str | None = None,
               max_pixels: int = DEFAULT_MAX_DECODE_PIXELS) -> Image.Image:
    """PNG, JPEG, WebP or GIF bytes -> a PIL image whose header is read and checked, its pixels not decoded yet.

    The declared media type must be one of the supported ones, but the bytes decide the format (clients often label
    a JPEG as PNG). The size is checked from the header before decoding pixels."""
    if media_type is not None and media_type.lower() not in SUPPORTED_MEDIA_TYPES:
        raise ImageError(f"unsupported image type {media_type!r}; supported: image/png, image/jpeg, image/webp, "
                         f"image/gif")
    if not data:
        raise ImageError("image data is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)   # our own limit decides
            img = Image.open(io.BytesIO(data), formats=_FORMATS)
    except Image.DecompressionBombError:
        raise ImageError(f"image is too large to decode (more than {max_pixels} pixels)") from None
    except Image.UnidentifiedImageError:
        raise ImageError("cannot decode image: not a PNG, JPEG, WebP or GIF file") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"cannot decode image: {e}") from None
    w, h = img.size
    if w * h > max_pixels:
        raise ImageError(f"image is too large: {w}x{h} pixels is more than the {max_pixels} allowed")
    if w < 1 or h < 1:
        raise ImageError(f"image has no pixels ({w}x{h})")
    return img


def decode_image(data: bytes, media_type: str | None = None,
                 max_pixels: int = DEFAULT_MAX_DECODE_PIXELS) -> Image.Image:
    """open_image, then the pixels decoded: a loaded PIL image (any mode; preprocess converts to RGB); an animated
    GIF or WebP gives its first frame."""
    img = open_image(data, media_type, max_pixels)
    try:
        img.seek(0)
        img.load()
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"cannot decode {img.format} image: {e}") from None
    return img


def pixel_bytes(height: int, width: int, cfg: ImageProcessorConfig) -> int:
    """Bytes of the pixel_values `preprocess` makes of an image of this size (float32 rows, the frame T times)."""
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return h * w * 3 * cfg.temporal_patch_size * 4


# ---------------------------------------------------------------------------------------------------------------
# resize and token count
# ---------------------------------------------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) resized: both multiples of factor, the area within [min_pixels, max_pixels] (small images are
    upscaled), the aspect ratio kept as closely as that allows. Python round (ties to even), as transformers."""
    if height < 1 or width < 1:
        raise ImageError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.1f} is too extreme "
                         f"({width}x{height}); the limit is {MAX_ASPECT_RATIO}:1")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def image_token_count(height: int, width: int, cfg: ImageProcessorConfig) -> int:
    """<|image_pad|> tokens for an image of this size (from the size alone; no pixels needed)."""
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return (h // cfg.factor) * (w // cfg.factor)


# ---------------------------------------------------------------------------------------------------------------
# preprocessing
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class ProcessedImage:
    """What the vision tower takes for one image, and its identity for the caches."""

    pixel_values: torch.Tensor          # [grid_h * grid_w, C * T * P * P] float32, rows in the tower's order
    grid_thw: tuple[int, int, int]      # (1, grid_h, grid_w) in patches
    num_tokens: int                     # LM tokens = grid_h * grid_w / merge^2
    digest: bytes                       # sha256 of pixel_values + grid + processor settings

    def token_grid(self, merge_size: int) -> tuple[int, int]:
        """(rows, cols) of the image in merged LM tokens (what positions use)."""
        return self.grid_thw[1] // merge_size, self.grid_thw[2] // merge_size


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency (alpha band or palette/colour-key transparency) composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Image.Image, cfg: ImageProcessorConfig) -> ProcessedImage:
    """PIL image -> pixel_values, grid and digest (equal to Qwen2VLImageProcessorPil's output bit for bit)."""
    try:
        rgb = to_rgb(image)
    except (OSError, ValueError) as e:
        raise ImageError(f"cannot convert {image.mode} image to RGB: {e}") from None
    width, height = rgb.size
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    resized = rgb.resize((w, h), resample=Image.Resampling(cfg.resample))
    x = (np.asarray(resized, dtype=np.uint8).astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = (x - np.array(cfg.image_mean, dtype=np.float32)) / np.array(cfg.image_std, dtype=np.float32)
    P, M, T = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h // P, w // P
    # [H, W, C] -> [gh/M, M, P, gw/M, M, P, C] -> [gh/M, gw/M, M(row), M(col), C, P, P], then the T copies
    blocks = x.reshape(gh // M, M, P, gw // M, M, P, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], T, P, P))
    pixel_values = torch.from_numpy(np.ascontiguousarray(frames).reshape(gh * gw, 3 * T * P * P))
    grid = (1, gh, gw)
    digest = hashlib.sha256()
    digest.update(b"tinyserve-image-v1\0")
    digest.update(cfg.fingerprint())
    digest.update(json.dumps(grid).encode())
    digest.update(pixel_values.numpy().tobytes())
    return ProcessedImage(pixel_values=pixel_values, grid_thw=grid, num_tokens=gh * gw // (M * M),
                          digest=digest.digest())


def image_from_data_url(url: str, max_pixels: int = DEFAULT_MAX_DECODE_PIXELS) -> Image.Image:
    """parse_data_url + decode_image."""
    media_type, data = parse_data_url(url)
    return decode_image(data, media_type, max_pixels)
