"""Images in a request as the engine sees them (placeholders, grid sizes and M-RoPE positions).

- Where each image sits: the chat template emits one `<|image_pad|>` per image; `expand_image_pads` widens each to
  the image's token count (gh x gw merged tokens) and records its span.
- What the prefix cache sees: every pad has the same id, so a cache keyed on token ids would serve one picture's
  KV for another. `RequestImages.cache_ids` replaces the pads by per-position values derived from the image's
  digest (sha256 of its processed pixels, grid and processor settings), all in [vocab_size, 2^31): never a real
  token id, and int32 for the file tier's chain hashes. Two different images diverge at their first pad; the same
  image in the same place matches through it. The model is always fed the real ids.
- Rotary positions: 3-row M-RoPE for any range of the sequence (`positions`), i + delta past the last image.
- Vision features: the tower sees a whole image at once (its attention is bidirectional), so a prefill chunk that
  covers part of an image takes a slice of features encoded once; `FeatureCache` keeps them by digest (LRU,
  bounded in bytes) so a repeated image after different text skips the tower.
"""
from __future__ import annotations

import functools
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch

from tinyserve.images import ProcessedImage
from tinyserve.models.qwen_vision import ImageSpan, mrope_delta, mrope_positions_range

if TYPE_CHECKING:
    from tinyserve.request import Request
    from tinyserve.scheduler import ScheduledSeq

KEY_LIMIT = 1 << 31                  # cache key values stay below this (int32 in the file tier's hashes)
FEATURE_CACHE_BYTES = 256 << 20      # vision features kept by digest (a 1024x1024 image on a 27B: 10 MiB)


@functools.lru_cache(maxsize=64)
def image_keys(digest: bytes, n: int, vocab_size: int) -> tuple[int, ...]:
    """The cache key values of an image's n tokens: sha256(digest || block) in counter mode, eight 32-bit words
    per block, each folded into [vocab_size, 2^31). Kept for the last images (prepare_images computes them on a
    worker thread; each choice's request then finds them)."""
    span = KEY_LIMIT - vocab_size
    out: list[int] = []
    block = 0
    while len(out) < n:
        words = hashlib.sha256(digest + block.to_bytes(8, "little")).digest()
        out += [vocab_size + int.from_bytes(words[i:i + 4], "little") % span for i in range(0, 32, 4)]
        block += 1
    return tuple(out[:n])


@dataclass(eq=False)
class PromptImage:
    """One image of a request. Once the tower has encoded it, the request keeps its features on the host instead
    of its pixels (fewer bytes, and what a recompute after preemption needs): image.pixel_values is None then."""
    image: ProcessedImage
    span: ImageSpan                              # its tokens: [span.start, span.end) of the prompt
    features: torch.Tensor | None = None         # on the device, held while its span is being prefilled
    encoded: torch.Tensor | None = None          # on the host, from the first encoding (or feature-cache hit) on


@dataclass(eq=False)
class RequestImages:
    """The images of one request, in prompt order."""
    items: list[PromptImage]
    cache_ids: list[int]                         # the prompt with each pad replaced by its image's key value
    delta: int = field(init=False)               # rotary position - sequence index after the last image

    def __post_init__(self) -> None:
        self.delta = mrope_delta([it.span for it in self.items])

    def positions(self, start: int, end: int) -> torch.Tensor:
        """(t, h, w) rotary rows [3, end - start] of sequence indices [start, end) (decode included)."""
        if start >= self.items[-1].span.end:     # past the last image: every row is i + delta
            return torch.arange(start + self.delta, end + self.delta).expand(3, -1)
        return mrope_positions_range(start, end, [it.span for it in self.items])

    def overlapping(self, start: int, end: int) -> list[PromptImage]:
        return [it for it in self.items if it.span.start < end and start < it.span.end]

    def boundaries(self) -> list[tuple[int, int]]:
        """(first pad, one past the last pad) of each image: where cached states help a later request resume."""
        return [(it.span.start, it.span.end) for it in self.items]


def rope_rows(images: RequestImages | None, start: int, end: int) -> torch.Tensor:
    """The (t, h, w) rotary rows [3, end - start] of a request's sequence indices [start, end), for a batch that
    has images: a text-only request's three rows are its plain positions."""
    return images.positions(start, end) if images is not None else torch.arange(start, end).expand(3, -1)


def expand_image_pads(prompt_ids: list[int], images: list[ProcessedImage], image_token_id: int,
                      merge_size: int) -> list[int]:
    """Widen the template's single pad per image to the image's token count. Raises ValueError when the number
    of pads is not the number of images (e.g. a literal <|image_pad|> typed in the text)."""
    pads = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if len(pads) != len(images):
        raise ValueError(f"the prompt has {len(pads)} image placeholder token(s) for {len(images)} image(s)")
    out: list[int] = []
    prev = 0
    for at, image in zip(pads, images):
        gh, gw = image.token_grid(merge_size)
        out += prompt_ids[prev:at] + [image_token_id] * (gh * gw)
        prev = at + 1
    return out + prompt_ids[prev:]


def request_images(prompt_ids: list[int], images: list[ProcessedImage], image_token_id: int, merge_size: int,
                   vocab_size: int, tower: bytes = b"") -> RequestImages:
    """Locate already expanded images in prompt_ids (runs of pads, in order) and make their cache keys (from the
    image's digest and `tower`, a digest of the vision tower's weights)."""
    items: list[PromptImage] = []
    cache_ids = list(prompt_ids)
    i = 0
    for image in images:
        gh, gw = image.token_grid(merge_size)
        while i < len(prompt_ids) and prompt_ids[i] != image_token_id:
            i += 1
        n = gh * gw
        if prompt_ids[i:i + n] != [image_token_id] * n or (i + n < len(prompt_ids)
                                                           and prompt_ids[i + n] == image_token_id):
            raise ValueError(f"the prompt's image placeholder tokens do not match the images' sizes "
                             f"(an image of {gh}x{gw} tokens at index {i})")
        items.append(PromptImage(image, ImageSpan(i, gh, gw)))
        cache_ids[i:i + n] = image_keys(image.digest + tower, n, vocab_size)
        i += n
    if image_token_id in prompt_ids[i:]:
        raise ValueError("the prompt has more image placeholder tokens than images")
    return RequestImages(items, cache_ids)


class FeatureCache:
    """Vision features by image digest, least recently used out first, at most max_bytes (on the host: a
    chunk's slice goes to the device when it is prefilled)."""

    def __init__(self, max_bytes: int = FEATURE_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0

    def get(self, digest: bytes) -> torch.Tensor | None:
        features = self._items.get(digest)
        if features is not None:
            self._items.move_to_end(digest)
        return features

    def put(self, digest: bytes, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes or digest in self._items:
            return
        self._items[digest] = features
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._items)


class VisionFeatures:
    """The vision features a step's image tokens take: held by the request while its image is being prefilled, else
    from the feature cache (kept on the host), else encoded by the tower (which attends over the whole image, so a
    chunk never encodes only its part)."""

    def __init__(self, encode: Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor],
                 device: torch.device) -> None:
        self.encode, self.device = encode, device
        self.cache = FeatureCache()
        self.images_encoded = 0
        self.encode_seconds = 0.0

    def of(self, item: PromptImage) -> torch.Tensor:
        """The features of a whole image on the model's device."""
        if item.features is not None:
            return item.features
        host = item.encoded if item.encoded is not None else self.cache.get(item.image.digest)
        if host is None:
            start = time.perf_counter()
            item.features = self.encode(item.image.pixel_values, [item.image.grid_thw])
            self.encode_seconds += time.perf_counter() - start
            self.images_encoded += 1
            host = item.features.cpu()
            self.cache.put(item.image.digest, host)
        else:
            item.features = host.to(self.device)
        if item.encoded is None:                       # the request needs its pixels no more
            item.encoded = host
            item.image = replace(item.image, pixel_values=None)
        return item.features

    def encode_for(self, seqs: list[ScheduledSeq]) -> dict[Request, Exception]:
        """Before a step: the features of every image its prefill chunks (and the NEXTN head, one token further)
        will read, so that an image the tower cannot encode (out of memory, a malformed input) fails its own
        request and not the step. Returns the failed requests with their errors."""
        failed: dict[Request, Exception] = {}
        for s in seqs:
            req = s.req
            if req.images is None or s.is_decode:
                continue
            for item in req.images.overlapping(s.start, s.start + s.num_tokens + 1):
                try:
                    self.of(item)
                except (RuntimeError, ValueError) as e:   # torch.OutOfMemoryError is a RuntimeError
                    failed[req] = e
                    item.features = None
                    break
        if failed and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return failed

    def slices(self, images: RequestImages, start: int, end: int, offset: int) -> tuple[list[int], list[torch.Tensor]]:
        """The image tokens among sequence indices [start, end) of a request packed from row `offset`: their rows
        and feature slices."""
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        for item in images.overlapping(start, end):
            lo, hi = max(item.span.start, start), min(item.span.end, end)
            rows += range(offset + lo - start, offset + hi - start)
            embeds.append(self.of(item)[lo - item.span.start:hi - item.span.start])
        return rows, embeds

    @staticmethod
    def let_go(seqs: list[ScheduledSeq]) -> None:
        """After a step (the target's rows and the NEXTN head's, which embeds the token after each row): the
        features of images whose last token is computed are not needed again (a recompute after preemption takes
        them from the feature cache or encodes again)."""
        for s in seqs:
            if s.req.images is not None:
                for item in s.req.images.items:
                    if item.span.end <= s.start + s.num_tokens:
                        item.features = None
