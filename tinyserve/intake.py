"""Requests on their way in: every check a request passes before it reaches the scheduler, and the Request it
becomes. The API calls these on the event loop or a worker thread (none runs torch compute); a request that fails
one gets a RequestError naming its field, never a traceback.

Images are inside the memory plan: their pixels (float32, the frame twice: 24 bytes a pixel after resizing, ~384 MB
for a 16-megapixel image) are held from preprocessing until the vision tower has encoded them, so a request takes
room in the ImageBudget for them before they are made (measured from the files' headers), and waits in line while
there is none; the room comes back when the last reference to the pixels goes (encoded, finished or failed).
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import random
import threading
import uuid
import weakref
from collections import deque
from pathlib import Path

from tinyserve.config import Config, ConfigError
from tinyserve.features import Features
from tinyserve.images import (ImageError, ImageProcessorConfig, ImageSource, ProcessedImage, decode_image, open_image,
                              pixel_bytes, preprocess)
from tinyserve.request import Request
from tinyserve.sampling import SamplingParams

log = logging.getLogger("tinyserve.intake")

KEY_LIMIT = 1 << 31                  # image cache key values stay below this (int32 in the file tier's hashes)


@functools.lru_cache(maxsize=64)
def image_keys(digest: bytes, n: int, vocab_size: int) -> tuple[int, ...]:
    """The cache key values of an image's n tokens: sha256(digest || block) in counter mode, eight 32-bit words
    per block, each folded into [vocab_size, 2^31). Kept for the last images (prepare_images computes them on a
    worker thread; each choice's request then finds them: multimodal.request_images)."""
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


class RequestError(ValueError):
    """A request the engine cannot take. `field` names what is wrong: a SamplingParams field, "prompt" or
    "max_tokens" (the API maps it to the request's own field name). A prompt too long for the context or the KV pool
    carries its length and that limit (`tokens`), which some clients read back from the message."""

    def __init__(self, message: str, field: str, tokens: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.tokens = tokens


class Intake:
    """Fits max_tokens to the context and the KV pool, validates sampling parameters and prompts, prepares images,
    and makes the Request, which the registered features then take up (features.Feature.on_request: a constrained
    request's matcher, its images' places)."""

    def __init__(self, cfg: Config, context_length: int, kv_tokens: int, vocab_size: int, features: Features,
                 image_token_id: int | None = None, image_processor: ImageProcessorConfig | None = None,
                 vision_fingerprint: bytes = b"", turn_start_id: int | None = None) -> None:
        self.cfg, self.context_length, self.kv_tokens = cfg, context_length, kv_tokens
        self.turn_start_id = turn_start_id
        self.vocab_size, self.features = vocab_size, features
        self.image_token_id, self.image_processor = image_token_id, image_processor
        # image tokens' cache keys depend on the tower that makes their features (the file tier's fingerprint
        # leaves the tower out, so text pages are shared whether model.vision is on or off)
        self.vision_fingerprint = vision_fingerprint
        self.image_budget = ImageBudget(image_budget_bytes(cfg, image_processor))
        if image_processor is not None:
            log.info("image budget: %.2f GiB of pixels waiting for the vision tower (%d requests of model.max_images"
                     " = %d at most, 1/%d of this machine's memory at most)", self.image_budget.limit / (1 << 30),
                     IMAGE_BUDGET_REQUESTS, cfg.model.max_images, IMAGE_BUDGET_SHARE)

    # ---- lengths and parameters ----
    def fit_max_tokens(self, prompt_len: int, max_tokens: int | None, clamp: bool = False) -> int:
        """The max_tokens a request with this prompt gets: None means up to the end of the context (vLLM's
        default), but never past what the KV pool holds, which on a small card or the CPU can be less. With clamp,
        a larger max_tokens is cut to what fits instead of refused (Anthropic's clients send one large
        max_tokens whatever the server's context)."""
        fits = min(self.context_length, self.kv_tokens) - prompt_len
        if fits <= 0:
            raise self._prompt_too_long(prompt_len)
        if max_tokens is None:
            return fits
        if max_tokens > fits and not clamp:
            raise self._max_tokens_too_large(prompt_len, max_tokens)
        return min(max_tokens, fits)

    def _prompt_too_long(self, prompt_len: int) -> RequestError:
        context, pool = self.context_length, self.kv_tokens
        if prompt_len >= context:
            return RequestError(f"the prompt is {prompt_len} tokens long, but the context is {context} tokens "
                                "(there must be room for at least one generated token)", "prompt",
                                (prompt_len, context - 1))
        return RequestError(f"the prompt is {prompt_len} tokens long, but the KV cache holds {pool} tokens; "
                            "raise engine.kv_cache_tokens", "prompt", (prompt_len, pool - 1))

    def _max_tokens_too_large(self, prompt_len: int, max_tokens: int) -> RequestError:
        context, pool = self.context_length, self.kv_tokens
        if max_tokens > context - prompt_len:
            return RequestError(f"max_tokens ({max_tokens}) plus the prompt ({prompt_len} tokens) is longer than the "
                                f"context ({context} tokens); at most {context - prompt_len} tokens fit", "max_tokens")
        return RequestError(f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}, which is more than "
                            f"the KV cache holds ({pool} tokens); raise engine.kv_cache_tokens", "max_tokens")

    def validate(self, params: SamplingParams) -> None:
        """The one validation of sampling parameters; raises RequestError naming the field."""
        try:
            params.validate()
        except ValueError as e:                          # its messages start with the field name
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None
        if params.stop_token_ids or params.logit_bias:
            self._check_vocabulary(params)

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """The token ids of stop_token_ids and logit_bias are inside the vocabulary."""
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise RequestError(f"stop_token_ids: {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                               "stop_token_ids")
        bad = sorted(t for t in params.logit_bias or {} if t >= self.vocab_size)
        if bad:
            shown = ", ".join(map(str, bad[:8])) + (", ..." if len(bad) > 8 else "")
            raise RequestError(f"logit_bias: token id {shown} is outside the vocabulary (ids 0..{self.vocab_size - 1}; "
                               f"vocabulary size {self.vocab_size})", "logit_bias")

    # ---- images ----
    @property
    def vision(self) -> bool:
        """Whether requests may carry images (a vision tower is loaded)."""
        return self.image_processor is not None

    def check_images(self, params: list[str]) -> None:
        """May a request carry images from these request fields? RequestError naming the first one that may not
        (the API asks before it fetches any)."""
        if params and not self.vision:
            raise RequestError(f"{params[0]}: this model takes no image input (the checkpoint has no vision tower, "
                               "or model.vision = false)", params[0])
        limit = self.cfg.model.max_images
        if len(params) > limit:
            raise RequestError(f"{len(params)} images in one request; at most {limit} (model.max_images)",
                               params[limit])

    def measure_images(self, sources: list[ImageSource]) -> list[int]:
        """The pixel bytes each image will take once preprocessed, from its header alone (no pixel decoded), for the
        image budget. Runs on a worker thread; RequestError names the image's request field."""
        self.check_images([src.param for src in sources])
        out = []
        for src in sources:
            try:
                w, h = open_image(src.data, src.media_type, self.cfg.model.max_image_pixels).size
                out.append(pixel_bytes(h, w, self.image_processor))
            except ImageError as e:
                raise self._image_error(src, e) from None
        return out

    @staticmethod
    def _image_error(src: ImageSource, e: ImageError) -> RequestError:
        hint = " (model.max_image_pixels)" if "too large" in str(e) else ""
        return RequestError(f"{src.param}: {e}{hint}", src.param)

    def prepare_images(self, prompt_ids: list[int], sources: list[ImageSource], taken: list[int] | None = None
                       ) -> tuple[list[int], list[ProcessedImage]]:
        """Decode and preprocess a request's images (in prompt order) and widen the template's one pad per image
        to its token count. Runs on a worker thread (PIL and numpy, no torch compute). RequestError names the
        image's request field, or "prompt" when the pads do not match the images. taken: each image's bytes taken
        from the image budget (measure_images); they go back when its pixels are freed, or here if it fails."""
        self.check_images([src.param for src in sources])
        images: list[ProcessedImage] = []
        try:
            for src in sources:
                try:
                    image = preprocess(decode_image(src.data, src.media_type, self.cfg.model.max_image_pixels),
                                       self.image_processor)
                except ImageError as e:
                    raise self._image_error(src, e) from None
                if taken is not None:
                    weakref.finalize(image.pixel_values, self.image_budget.release, taken[len(images)])
                images.append(image)
        except BaseException:
            if taken is not None:
                self.image_budget.release(sum(taken[len(images):]))
            raise
        try:
            ids = expand_image_pads(prompt_ids, images, self.image_token_id, self.image_processor.merge_size)
        except ValueError as e:
            raise RequestError(str(e), "prompt") from None
        for image in images:                     # hashed here, on this worker thread, not on the event loop
            image_keys(image.digest + self.vision_fingerprint, image.num_tokens, self.vocab_size)
        return ids, images

    # ---- the request ----
    def make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     images: list[ProcessedImage] = ()) -> Request:
        """images: what prepare_images returned for these (expanded) prompt ids."""
        self.validate(params)
        if not prompt_ids or min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise self._bad_prompt(prompt_ids)
        self.fit_max_tokens(len(prompt_ids), params.max_tokens)
        if images:
            self.check_images(["prompt"] * len(images))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        req = Request(request_id or uuid.uuid4().hex, list(prompt_ids), params, seed,
                      resume_hints=self.last_message_starts(prompt_ids))
        self.features.on_request(req, list(images))
        return req

    def last_message_starts(self, ids: list[int]) -> tuple[int, ...]:
        """Where the prompt's last two messages start (the last two turn markers; after a generation prompt the
        second last opens the last message). Agents resend a conversation with its last message changed (a
        reminder dropped, a tool result cut short), so a state cached there resumes their next prompt, where the
        interval snapshots below it may have been evicted (Request.resume_hints)."""
        if self.turn_start_id is None:
            return ()
        starts: list[int] = []
        backwards, end = ids[::-1], len(ids)
        for _ in range(2):
            try:
                end = len(ids) - 1 - backwards.index(self.turn_start_id, len(ids) - end)
            except ValueError:
                break
            starts.append(end)
        return tuple(starts)

    def _bad_prompt(self, prompt_ids: list[int]) -> RequestError:
        if not prompt_ids:
            return RequestError("the prompt is empty", "prompt")
        bad = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
        return RequestError(f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")


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
