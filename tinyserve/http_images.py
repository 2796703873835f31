"""Images on the HTTP side: fetching http(s) image URLs (server.fetch_image_urls) and handing a request's images to
the engine's images part (multimodal.Images) in worker threads, within the image budget. `prepare_images` is api.py's one call."""
from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import aiohttp

from .engine import Engine, RequestError
from .images import SUPPORTED_MEDIA_TYPES, ImageSource
from .protocol import APIError, Fields, ImageInput, RemoteImage, ServerState, bad_request

FETCH_TIMEOUT_S = 10.0           # per fetched image URL (server.fetch_image_urls), connect to last byte
# Decoding and preprocessing images on their own two threads: a 16-megapixel image takes ~1.4 GB while it is
# processed, so a burst of image requests queues here instead of all at once, and text requests' templates and
# tokenization (the default executor) never wait behind them.
IMAGE_WORKERS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tinyserve-images")


async def _fetch_image(session: aiohttp.ClientSession, image: RemoteImage, max_bytes: int) -> ImageSource:
    """One http(s) image URL -> its bytes; any failure is a 400 naming the part. The media type is the response's
    Content-Type when it is one we decode, else the bytes decide."""
    def fail(why: str) -> APIError:
        return bad_request(f"{image.param}: cannot fetch the image URL: {why}", image.param)

    data = bytearray()
    try:
        async with session.get(image.url) as r:
            if r.status != 200:
                raise fail(f"HTTP {r.status}")
            if r.content_length is not None and r.content_length > max_bytes:
                raise fail(f"the image is larger than server.max_request_body_mb ({max_bytes} bytes)")
            async for chunk in r.content.iter_chunked(1 << 16):    # a missing or lying length is caught here
                data += chunk
                if len(data) > max_bytes:
                    raise fail(f"the image is larger than server.max_request_body_mb ({max_bytes} bytes)")
            media_type = r.content_type.lower()
    except asyncio.TimeoutError:
        raise fail(f"no complete answer within {FETCH_TIMEOUT_S:g} s") from None
    except (aiohttp.ClientError, ValueError) as e:                 # refused, bad address, redirect to another scheme
        raise fail(f"{type(e).__name__}: {e}") from None
    return ImageSource(image.param, bytes(data), media_type if media_type in SUPPORTED_MEDIA_TYPES else None)


async def fetch_images(images: list[ImageInput], max_bytes: int) -> list[ImageSource]:
    """The request's images with every RemoteImage fetched (all at once), in the same order."""
    remote = [im for im in images if isinstance(im, RemoteImage)]
    if not remote:
        return list(images)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as session:
        results = await asyncio.gather(*(_fetch_image(session, im, max_bytes) for im in remote),
                                       return_exceptions=True)
    fetched: dict[str, ImageSource] = {}
    for im, result in zip(remote, results):
        if isinstance(result, BaseException):      # the first failing part, in prompt order
            raise result
        fetched[im.param] = result
    return [fetched[im.param] if isinstance(im, RemoteImage) else im for im in images]


async def prepare_images(state: ServerState, engine: Engine, images: list[ImageInput], prompt_ids: list[int],
                         fields: Fields) -> tuple[list[int], list[Any]]:
    """A request's images: (the prompt ids with each image's pad widened to its tokens, the processed images for
    the generation). 400 naming the part when the model takes no images or an image cannot be used. The request
    waits here, in line, until its pixels fit the image budget (multimodal.py); they are made only then."""
    part, loop = engine.images, asyncio.get_running_loop()
    if part is None:
        raise bad_request(f"{images[0].param}: this model takes no image input (the checkpoint has no vision tower, "
                          "or model.vision = false)", fields.of(images[0].param))
    try:
        part.check([im.param for im in images])                     # before fetching what cannot be used
        sources = await fetch_images(images, int(state.cfg.server.max_request_body_mb * 1024 * 1024))
        sizes = await loop.run_in_executor(IMAGE_WORKERS, part.measure, sources)
        await part.budget.acquire(sum(sizes))
        # shielded: once the room is taken the job runs (a cancelled caller drops its images, which gives it back)
        job = loop.run_in_executor(IMAGE_WORKERS, part.prepare, prompt_ids, sources, sizes)
        job.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(job)
    except RequestError as e:
        raise bad_request(str(e), fields.of(e.field)) from None
