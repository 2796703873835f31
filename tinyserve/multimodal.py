"""Images in a request, from its bytes to the model's inputs: the image budget, preprocessing, placeholders, grid
sizes, M-RoPE positions, the vision features. One optional part (`Images`, built when the checkpoint has a vision
tower and model.vision is on; None otherwise), called by name: the API has it check, measure and preprocess a
request's images (`check`, `measure`, `prepare`, on worker threads, within `budget`); the intake has it `attach`
them to the Request (`RequestImages`, req.images: where each sits, the prefix cache's keys for its tokens:
req.prompt_keys, req.resume_hints); the engine has it `encode` the images a step's prefill chunks read before the
step, so an image the tower cannot encode fails its own request and not the step; the runner takes the M-RoPE rows
and feature rows of a batch with an image (`model_inputs`, for the target and, one token further, the NEXTN head)
and lets go of the features of images computed (`after_step`); the scheduler drops what a preempted request held
(`drop`).

- The budget: pixels (float32, the frame twice: 24 bytes a pixel after resizing, ~384 MB for a 16-megapixel image)
  are held from preprocessing until the vision tower has encoded them, so a request takes room in the ImageBudget
  for them before they are made (measured from the files' headers), and waits in line while there is none; the
  room comes back when the last reference to the pixels goes (encoded, finished or failed).
- Where each image sits: the chat template emits one `<|image_pad|>` per image; `prepare` widens each to the
  image's token count (gh x gw merged tokens: expand_image_pads) and `request_images` records its span.
- What the prefix cache sees: every pad has the same id, so a cache keyed on token ids would serve one picture's
  KV for another. `RequestImages.cache_ids` replaces the pads by per-position values derived from the image's
  digest (image_keys: sha256 of its processed pixels, grid and processor settings), all in [vocab_size, 2^31): never
  a real token id, and int32 for the file tier's chain hashes. Two different images diverge at their first pad; the
  same image in the same place matches through it. The model is always fed the real ids.
- Rotary positions: 3-row M-RoPE for any range of the sequence (`positions`), i + delta past the last image.
- Vision features: the tower sees a whole image at once (its attention is bidirectional), so a prefill chunk that
  covers part of an image takes a slice of features encoded once; `FeatureCache` keeps them by digest (LRU,
  bounded in bytes) so a repeated image after different text skips the tower.
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tinyserve.config import Config, ConfigError
from tinyserve.images import (ImageError, ImageProcessorConfig, ImageSource, ProcessedImage, decode_image, open_image,
                              pixel_bytes, preprocess)
from tinyserve.models.qwen_vision import ImageSpan, mrope_delta, mrope_positions_range
from tinyserve.request import Request, RequestError
from tinyserve.models.qwen3_next import ForwardBatch
from tinyserve.runner import Spans
from tinyserve.scheduler import ScheduledSeq

log = logging.getLogger("tinyserve.multimodal")

FEATURE_CACHE_BYTES = 256 << 20      # vision features kept by digest (a 1024x1024 image on a 27B: 10 MiB)
KEY_LIMIT = 1 << 31                  # image cache key values stay below this (int32 in the file tier's hashes)


@functools.lru_cache(maxsize=64)
def image_keys(digest: bytes, n: int, vocab_size: int) -> tuple[int, ...]:
    """The cache key values of an image's n tokens: sha256(digest || block) in counter mode, eight 32-bit words
    per block, each folded into [vocab_size, 2^31). Kept for the last images (Images.prepare computes them on a
    worker thread; each choice's request then finds them: request_images)."""
    span = KEY_LIMIT - vocab_size
    out: list[int] = []
    block = 0
    while len(out) < n:
        words = hashlib.sha256(digest + block.to_bytes(8, "little")).digest()
        out += [vocab_size + int.from_bytes(words[i:i + 4], "little") % span for i in range(0, 32, 4)]
        block += 1
    return tuple(out[:n])


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


IMAGE_BUDGET_REQUESTS = 2    # the budget holds this many requests at the per-request limits (one being encoded,
IMAGE_BUDGET_SHARE = 8       # one ready behind it), but at most this share (1/8) of the machine's memory


def image_budget_bytes(cfg: Config, processor: ImageProcessorConfig | None) -> int:
    """The per-server budget of pixel bytes: IMAGE_BUDGET_REQUESTS requests of model.max_images images of the
    largest size the processor makes, at most 1/IMAGE_BUDGET_SHARE of the machine's memory (0 without images)."""
    if processor is None or not cfg.model.max_images:
        return 0
    largest = processor.max_pixels * 3 * processor.temporal_patch_size * 4
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(IMAGE_BUDGET_REQUESTS * cfg.model.max_images * largest, machine // IMAGE_BUDGET_SHARE)


class _Waiter:
    def __init__(self, nbytes: int, loop: asyncio.AbstractEventLoop) -> None:
        self.nbytes, self.loop, self.future = nbytes, loop, loop.create_future()


class ImageBudget:
    """Bytes of image pixels held, at most `limit`. `acquire` waits in line (first come, first served) until a
    request's pixels fit; a request larger than the whole budget goes when nothing else is held, so it runs alone.
    `release` may be called from any thread (the pixels' finalizer runs where their last reference goes)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        """Requests waiting for room."""
        return len(self._waiters)

    def _fits(self, nbytes: int) -> bool:
        return self.held + nbytes <= self.limit or self.held == 0

    async def acquire(self, nbytes: int) -> None:
        """Take nbytes, waiting until they fit; a cancelled wait takes nothing."""
        with self._lock:
            if not self._waiters and self._fits(nbytes):
                self.held += nbytes
                return
            waiter = _Waiter(nbytes, asyncio.get_running_loop())
            self._waiters.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            with self._lock:
                granted = waiter not in self._waiters
                if not granted:
                    self._waiters.remove(waiter)
            if granted:                      # room was given as the wait was cancelled: give it back
                self.release(nbytes)
            else:
                self._wake()                 # the head of the line went: those behind may fit
            raise

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            while self._waiters and self._fits(self._waiters[0].nbytes):
                waiter = self._waiters.popleft()
                self.held += waiter.nbytes
                waiter.loop.call_soon_threadsafe(_grant, waiter.future)


def _grant(future: asyncio.Future) -> None:
    if not future.done():                    # a cancelled waiter gives its room back itself
        future.set_result(None)




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

    def resume_hints(self) -> tuple[int, int]:
        """Where cached states help a later request resume: before the first image (the same text with another
        picture resumes there) and after the last one (other text after the same pictures): Request.resume_hints."""
        return self.items[0].span.start, self.items[-1].span.end


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


@dataclass
class ImageStats:
    received: int = 0                    # images in requests made (intake)
    encoded: int = 0                     # images through the vision tower (a feature-cache hit skips it)
    encode_seconds: float = 0.0
    budget_bytes: int = 0                # pixels waiting for the vision tower may hold this much (ImageBudget)
    bytes_held: int = 0                  # ... and hold this much now
    requests_waiting: int = 0            # requests waiting for room in it


class Images:
    """A request's images on their way in (the budget, preprocessing) and the vision features a step's image tokens
    take: held by the request while its image is being prefilled, else from the feature cache (kept on the host),
    else encoded by the tower (which attends over the whole image, so a chunk never encodes only its part)."""

    def __init__(self, cfg: Config, model, vocab_size: int, tower: bytes) -> None:
        """tower: a digest of the vision tower's weights (blob.weights_digest)."""
        self.tower_forward, self.device = model.encode_images, model.device
        self.image_token_id, self.vocab_size = model.cfg.image_token_id, vocab_size
        self.processor = image_processor_for(model)
        # image tokens' cache keys depend on the tower that makes their features (the file tier's fingerprint
        # leaves the tower out, so text pages are shared whether model.vision is on or off)
        self.tower = tower
        self.max_images, self.max_image_pixels = cfg.model.max_images, cfg.model.max_image_pixels
        self.budget = ImageBudget(image_budget_bytes(cfg, self.processor))
        log.info("image budget: %.2f GiB of pixels waiting for the vision tower (%d requests of model.max_images = %d "
                 "at most, 1/%d of this machine's memory at most)", self.budget.limit / (1 << 30),
                 IMAGE_BUDGET_REQUESTS, cfg.model.max_images, IMAGE_BUDGET_SHARE)
        self.cache = FeatureCache()
        self.images_received = 0
        self.images_encoded = 0
        self.encode_seconds = 0.0

    def of(self, item: PromptImage) -> torch.Tensor:
        """The features of a whole image on the model's device."""
        if item.features is not None:
            return item.features
        host = item.encoded if item.encoded is not None else self.cache.get(item.image.digest)
        if host is None:
            start = time.perf_counter()
            item.features = self.tower_forward(item.image.pixel_values, [item.image.grid_thw])
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

    # ---- on the way in (the API's, on worker threads) ----
    def check(self, params: list[str]) -> None:
        """May a request carry images from these request fields? RequestError naming the first one past
        model.max_images (the API asks before it fetches any)."""
        limit = self.max_images
        if len(params) > limit:
            raise RequestError(f"{len(params)} images in one request; at most {limit} (model.max_images)",
                               params[limit])

    def measure(self, sources: list[ImageSource]) -> list[int]:
        """The pixel bytes each image will take once preprocessed, from its header alone (no pixel decoded), for the
        image budget. Runs on a worker thread; RequestError names the image's request field."""
        self.check([src.param for src in sources])
        out = []
        for src in sources:
            try:
                w, h = open_image(src.data, src.media_type, self.max_image_pixels).size
                out.append(pixel_bytes(h, w, self.processor))
            except ImageError as e:
                raise self._image_error(src, e) from None
        return out

    @staticmethod
    def _image_error(src: ImageSource, e: ImageError) -> RequestError:
        hint = " (model.max_image_pixels)" if "too large" in str(e) else ""
        return RequestError(f"{src.param}: {e}{hint}", src.param)

    def prepare(self, prompt_ids: list[int], sources: list[ImageSource], taken: list[int] | None = None
                ) -> tuple[list[int], list[ProcessedImage]]:
        """Decode and preprocess a request's images (in prompt order) and widen the template's one pad per image
        to its token count. Runs on a worker thread (PIL and numpy, no torch compute). RequestError names the
        image's request field, or "prompt" when the pads do not match the images. taken: each image's bytes taken
        from the image budget (measure); they go back when its pixels are freed, or here if it fails."""
        self.check([src.param for src in sources])
        images: list[ProcessedImage] = []
        try:
            for src in sources:
                try:
                    image = preprocess(decode_image(src.data, src.media_type, self.max_image_pixels), self.processor)
                except ImageError as e:
                    raise self._image_error(src, e) from None
                if taken is not None:
                    weakref.finalize(image.pixel_values, self.budget.release, taken[len(images)])
                images.append(image)
        except BaseException:
            if taken is not None:
                self.budget.release(sum(taken[len(images):]))
            raise
        try:
            ids = expand_image_pads(prompt_ids, images, self.image_token_id, self.processor.merge_size)
        except ValueError as e:
            raise RequestError(str(e), "prompt") from None
        for image in images:                     # hashed here, on this worker thread, not on the event loop
            image_keys(image.digest + self.tower, image.num_tokens, self.vocab_size)
        return ids, images

    # ---- the request (the intake's) ----
    def attach(self, req: Request, images: list[ProcessedImage]) -> None:
        """A request with images: where each sits and the prefix cache's keys for its tokens (req.prompt_keys), with
        the positions where a cached state helps (req.resume_hints)."""
        self.check(["prompt"] * len(images))
        try:
            located = request_images(req.prompt_ids, images, self.image_token_id, self.processor.merge_size,
                                     self.vocab_size, self.tower)
        except ValueError as e:
            raise RequestError(str(e), "prompt") from None
        req.images = located
        req.prompt_keys = located.cache_ids
        req.resume_hints += located.resume_hints()
        self.images_received += len(images)

    # ---- the step (the engine's, the runner's, the scheduler's) ----
    def encode(self, seqs: list[ScheduledSeq]) -> dict[Request, Exception]:
        """Before a step: the features of every image its prefill chunks (and the NEXTN head, one token further)
        will read, so that an image the tower cannot encode (out of memory, a malformed input) fails its own
        request and not the step. Returns the failed requests with their errors."""
        failed: dict[Request, Exception] = {}
        for s in seqs:
            images = s.req.images
            if images is None or s.is_decode:
                continue
            for item in images.overlapping(s.start, s.start + s.num_tokens + 1):
                try:
                    self.of(item)
                except (RuntimeError, ValueError) as e:   # torch.OutOfMemoryError is a RuntimeError
                    failed[s.req] = e
                    item.features = None
                    break
        if failed and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return failed

    def model_inputs(self, spans: Spans, batch: ForwardBatch, shift: int) -> dict[str, Any]:
        """For a batch with an image (spans: its (request, first position, tokens)): every sequence's (t, h, w)
        rotary rows (a text-only request's three rows are its plain positions), and the image tokens' rows with
        their feature slices (the tokens at p + shift)."""
        records = [req.images for req, _, _ in spans]
        rope: list[torch.Tensor] = []
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        for (_, start, n), images, offset in zip(spans, records, batch.cu_seqlens):
            end = start + n
            rope.append(images.positions(start, end) if images is not None else torch.arange(start, end).expand(3, -1))
            if images is not None:                     # a chunk takes its slice of each image it covers
                for item in images.overlapping(start + shift, end + shift):
                    lo, hi = max(item.span.start, start + shift), min(item.span.end, end + shift)
                    rows += range(offset + lo - start - shift, offset + hi - start - shift)
                    embeds.append(self.of(item)[lo - item.span.start:hi - item.span.start])
        inputs: dict[str, Any] = {"rope_positions": torch.cat(rope, dim=1).to(self.device)}
        if rows:
            inputs["embeds"] = (torch.tensor(rows, dtype=torch.long, device=self.device),
                                torch.cat(embeds).to(self.device))
        return inputs

    def after_step(self, seqs: list[ScheduledSeq]) -> None:
        """After a step (the target's rows and the NEXTN head's, which embeds the token after each row): the
        features of images whose last token is computed are not needed again (a recompute after preemption takes
        them from the feature cache or encodes again)."""
        for s in seqs:
            images = s.req.images
            if images is not None:
                for item in images.items:
                    if item.span.end <= s.start + s.num_tokens:
                        item.features = None

    def drop(self, req: Request) -> None:
        """Vision features held for a prefill that stops here (preempted, aborted, finished) go."""
        for item in req.images.items:
            item.features = None

    def stats(self) -> ImageStats:
        budget = self.budget
        return ImageStats(self.images_received, self.images_encoded, self.encode_seconds, budget.limit, budget.held,
                          budget.waiting)


def image_processor_for(model) -> ImageProcessorConfig:
    """The checkpoint's image processor settings, which must cut patches the way its vision tower takes them."""
    folder, vc = Path(model.cfg.folder), model.visual.cfg
    want = (vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size)
    if not any((folder / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
        log.info("%s has no preprocessor_config.json: the image processor takes Qwen3.5's released settings "
                 "with the vision tower's patch sizes", folder)
        return ImageProcessorConfig(patch_size=vc.patch_size, merge_size=vc.spatial_merge_size,
                                    temporal_patch_size=vc.temporal_patch_size)
    try:
        proc = ImageProcessorConfig.from_folder(folder)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder}: cannot read the image processor config: {e}", "model.path") from None
    if (proc.patch_size, proc.merge_size, proc.temporal_patch_size) != want:
        raise ConfigError(f"{folder}: the image processor cuts patch_size / merge_size / temporal_patch_size "
                          f"{(proc.patch_size, proc.merge_size, proc.temporal_patch_size)}, the vision tower "
                          f"(config.json vision_config) takes {want}", "model.path")
    return proc
