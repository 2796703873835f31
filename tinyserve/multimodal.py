"""Images in a request as the engine sees them (placeholders, grid sizes and M-RoPE positions).

A feature (features.py) registered when the checkpoint has a vision tower, on these hooks: `on_request` (the record
below), `prepare` (the vision
features of every image a step's prefill chunks read, so an image the tower cannot encode fails its own request),
`model_inputs` (the M-RoPE rows of a batch with an image, and the packed rows that take image features, for the
target and, one token further, the NEXTN head), `after_forward` (features of fully computed images let go), `free`
(a preempted request's device features go) and `stats`. Its per-request record is `RequestImages`
(req.features["images"], made by `on_request` with the request, which also sets the request's prompt_keys and
resume_hints for the prefix cache).

- Where each image sits: the chat template emits one `<|image_pad|>` per image; the intake widens each to the
  image's token count (gh x gw merged tokens: intake.expand_image_pads) and `request_images` records its span.
- What the prefix cache sees: every pad has the same id, so a cache keyed on token ids would serve one picture's
  KV for another. `RequestImages.cache_ids` replaces the pads by per-position values derived from the image's
  digest (intake.image_keys: sha256 of its processed pixels, grid and processor settings), all in [vocab_size, 2^31): never a real
  token id, and int32 for the file tier's chain hashes. Two different images diverge at their first pad; the same
  image in the same place matches through it. The model is always fed the real ids.
- Rotary positions: 3-row M-RoPE for any range of the sequence (`positions`), i + delta past the last image.
- Vision features: the tower sees a whole image at once (its attention is bidirectional), so a prefill chunk that
  covers part of an image takes a slice of features encoded once; `FeatureCache` keeps them by digest (LRU,
  bounded in bytes) so a repeated image after different text skips the tower.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from tinyserve.features import Feature
from tinyserve.images import ProcessedImage
from tinyserve.models.qwen_vision import ImageSpan, mrope_delta, mrope_positions_range

from tinyserve.intake import Intake, RequestError, image_keys

if TYPE_CHECKING:
    from tinyserve.request import Request
    from tinyserve.runner import Packed, SeqOutput
    from tinyserve.scheduler import ScheduledSeq

FEATURE_CACHE_BYTES = 256 << 20      # vision features kept by digest (a 1024x1024 image on a 27B: 10 MiB)


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
    budget_bytes: int = 0                # pixels waiting for the vision tower may hold this much (intake.ImageBudget)
    bytes_held: int = 0                  # ... and hold this much now
    requests_waiting: int = 0            # requests waiting for room in it


class Images(Feature):
    """The vision features a step's image tokens take: held by the request while its image is being prefilled, else
    from the feature cache (kept on the host), else encoded by the tower (which attends over the whole image, so a
    chunk never encodes only its part)."""
    name = "images"

    def __init__(self, encode: Callable[[torch.Tensor, list[tuple[int, int, int]]], torch.Tensor],
                 device: torch.device, intake: Intake) -> None:
        self.encode, self.device, self.intake = encode, device, intake
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

    # ---- hooks ----
    def on_request(self, req: Request, images: list[ProcessedImage]) -> None:
        """A request with images: where each sits and the prefix cache's keys for its tokens (req.prompt_keys), with
        the positions where a cached state helps (req.resume_hints)."""
        if not images:
            return
        intake = self.intake
        try:
            located = request_images(req.prompt_ids, images, intake.image_token_id,
                                     intake.image_processor.merge_size, intake.vocab_size, intake.vision_fingerprint)
        except ValueError as e:
            raise RequestError(str(e), "prompt") from None
        req.features[self.name] = located
        req.prompt_keys = located.cache_ids
        req.resume_hints += located.resume_hints()
        self.images_received += len(images)

    def prepare(self, seqs: list[ScheduledSeq]) -> dict[Request, Exception]:
        """Before a step: the features of every image its prefill chunks (and the NEXTN head, one token further)
        will read, so that an image the tower cannot encode (out of memory, a malformed input) fails its own
        request and not the step. Returns the failed requests with their errors."""
        failed: dict[Request, Exception] = {}
        for s in seqs:
            images = s.req.features.get(self.name)
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

    def model_inputs(self, packed: Packed, shift: int) -> dict[str, Any]:
        """For a batch with an image: every sequence's (t, h, w) rotary rows (a text-only request's three rows are
        its plain positions), and the image tokens' rows with their feature slices (the tokens at p + shift)."""
        records = [req.features.get(self.name) for req, _, _ in packed.spans]
        if not any(records):
            return {}
        rope: list[torch.Tensor] = []
        rows: list[int] = []
        embeds: list[torch.Tensor] = []
        for (_, start, n), images, offset in zip(packed.spans, records, packed.cu_seqlens):
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

    def after_forward(self, seqs: list[ScheduledSeq], packed: Packed, hidden: torch.Tensor,
                      outputs: list[SeqOutput], started: float) -> None:
        """After a step (the target's rows and the NEXTN head's, which embeds the token after each row): the
        features of images whose last token is computed are not needed again (a recompute after preemption takes
        them from the feature cache or encodes again)."""
        for s in seqs:
            images = s.req.features.get(self.name)
            if images is not None:
                for item in images.items:
                    if item.span.end <= s.start + s.num_tokens:
                        item.features = None

    def free(self, req: Request) -> None:
        """Vision features held for a prefill that stops here go."""
        images = req.features.get(self.name)
        if images is not None:
            for item in images.items:
                item.features = None

    def stats(self) -> ImageStats:
        budget = self.intake.image_budget
        return ImageStats(self.images_received, self.images_encoded, self.encode_seconds, budget.limit, budget.held,
                          budget.waiting)
