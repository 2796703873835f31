"""Images inside the memory plan (intake.ImageBudget): pixels waiting for the vision tower count against a per-server
budget; a request whose pixels do not fit waits in line (first come, first served; one larger than the whole budget
runs alone), is refused with 503 when the queue is full, and never runs the server out of memory. The room comes back
when the last reference to the pixels goes.

The end-to-end test sends a burst of image requests to a real server on the tiny multimodal checkpoint and reads the
server process's peak resident memory (VmHWM) before and after: the pixels of the whole burst would take several
times what the budget lets them.
"""
from __future__ import annotations

import asyncio
import base64
import gc
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from checkpoints import make_qwen3_5_vl
from server_util import ServerProcess, free_port, http, server_config
from tinyserve.images import ImageProcessorConfig, decode_image, pixel_bytes, preprocess
from tinyserve.multimodal import IMAGE_BUDGET_REQUESTS, ImageBudget, image_budget_bytes
from tinyserve.config import from_dict

SIDE = 256                           # the tiny checkpoint's processor keeps 256x256 (65,536 pixels) as it is


def png(w: int, h: int, seed: int = 0) -> bytes:
    """A smooth picture (a small file) whose pixels still take 24 bytes each once preprocessed."""
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([(x * 255 // max(1, w - 1)), (y * 255 // max(1, h - 1)), np.full_like(x, seed % 256)], -1)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, "PNG")
    return out.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# The budget

def test_waiting_in_line_and_a_request_larger_than_the_budget_runs_alone():
    async def scenario():
        budget = ImageBudget(100)
        await budget.acquire(60)
        order = []

        async def take(name: str, n: int) -> None:
            await budget.acquire(n)
            order.append(name)

        big = asyncio.create_task(take("big", 500))      # larger than the whole budget: waits until nothing is held
        await asyncio.sleep(0)
        small = asyncio.create_task(take("small", 10))   # fits now, but waits behind big (first come, first served)
        await asyncio.sleep(0)
        assert budget.waiting == 2 and order == []
        budget.release(60)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert order == ["big"] and budget.held == 500 and budget.waiting == 1
        budget.release(500)
        await asyncio.wait_for(small, 5)
        await big
        assert order == ["big", "small"] and budget.held == 10
        budget.release(10)
        # a cancelled wait takes nothing, and lets those behind it go
        await budget.acquire(90)
        blocked = asyncio.create_task(take("blocked", 50))
        await asyncio.sleep(0)
        behind = asyncio.create_task(take("behind", 5))
        await asyncio.sleep(0)
        blocked.cancel()
        await asyncio.wait_for(behind, 5)
        assert budget.held == 95 and budget.waiting == 0
    asyncio.run(scenario())


@pytest.mark.parametrize("size", [(256, 256), (640, 480), (17, 3000), (5, 5)])
@pytest.mark.parametrize("processor", [ImageProcessorConfig(), ImageProcessorConfig(patch_size=4, merge_size=2,
                                                                                    min_pixels=1024, max_pixels=65536)])
def test_measured_bytes_are_the_pixels_preprocessing_makes(size, processor):
    w, h = size
    image = preprocess(decode_image(png(w, h)), processor)
    assert pixel_bytes(h, w, processor) == image.pixel_values.numel() * image.pixel_values.element_size()


def test_the_budget_holds_two_requests_at_the_limits_within_an_eighth_of_the_memory():
    processor = ImageProcessorConfig()
    cfg = from_dict({"model": {"max_images": 2}})
    largest = processor.max_pixels * 24
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert image_budget_bytes(cfg, processor) == min(IMAGE_BUDGET_REQUESTS * 2 * largest, machine // 8)
    assert image_budget_bytes(cfg, None) == 0


# ---------------------------------------------------------------------------------------------------------------
# A burst against a real server

@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    folder, _ = make_qwen3_5_vl(tmp_path_factory.mktemp("vl-budget"))
    return folder


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def metric(base_url: str, name: str) -> float:
    _, _, body = http("GET", base_url + "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.slow
def test_a_burst_of_large_images_stays_within_the_budget_and_is_answered(vl_folder, tmp_path):
    n, queued = 48, 44
    cfg = server_config(free_port(), {
        "model": {"path": str(vl_folder), "context_length": 2048, "max_images": 1},
        "engine": {"kv_cache_tokens": 8192, "max_running_requests": 2, "chunked_prefill_size": 1024},
        "server": {"max_queued_requests": queued}})
    url = "data:image/png;base64," + base64.b64encode(png(SIDE, SIDE)).decode()
    body = {"model": "tinyserve", "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]}]}
    per_request = SIDE * SIDE * 24
    with ServerProcess(tmp_path, cfg) as server:
        budget = metric(server.base_url, "tinyserve:image_budget_bytes")
        assert budget == IMAGE_BUDGET_REQUESTS * per_request          # two requests' pixels at the limits
        assert http("POST", server.base_url + "/v1/chat/completions", body, timeout=300)[0] == 200   # warm up
        gc.collect()
        before = peak_rss(server.proc.pid)
        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(lambda _: http("POST", server.base_url + "/v1/chat/completions", body,
                                                   timeout=600), range(n)))
        grew = peak_rss(server.proc.pid) - before
        statuses = sorted(status for status, _, _ in answers)
        # the queue holds max_running_requests + max_queued_requests; the rest get 503 (waiting for image memory
        # counts as queued), never an out-of-memory
        assert statuses.count(200) >= cfg["engine"]["max_running_requests"] + queued - 2, statuses
        assert set(statuses) <= {200, 503}, [raw for status, _, raw in answers if status not in (200, 503)]
        for status, headers, raw in answers:
            if status == 503:
                assert headers.get("Retry-After") and b"full" in raw
            else:
                assert json.loads(raw)["usage"]["prompt_tokens"] > SIDE * SIDE // 64
        assert metric(server.base_url, "tinyserve:image_bytes_held") == 0      # every pixel given back
        assert metric(server.base_url, "tinyserve:image_requests_waiting") == 0
        # without the budget the burst's pixels alone would be n * per_request (72 MiB) on top (measured here with
        # the budget lifted: 63 MiB more at the peak; with it: 12 MiB)
        assert grew < n * per_request / 2, (grew, n * per_request)
