"""Idle release (engine.idle_release_s > 0): after that long without a request, the device's prefix cache is demoted
to the host / file tiers and the device KV and state pools are freed, so an idle home box holds no device memory for
its cache; the first request after it allocates them again. Engine thread only."""
from __future__ import annotations

import logging
import time

import torch

from tinyserve.cache import NullCache, PrefixCache
from tinyserve.copies import CopyStream
from tinyserve.kv import KVPool, PageAllocator
from tinyserve.runner import ModelRunner
from tinyserve.state import StatePool

log = logging.getLogger("tinyserve.idle")


class IdleRelease:
    def __init__(self, after_s: float, kv_pool: KVPool, state_pool: StatePool, allocator: PageAllocator,
                 cache: NullCache | PrefixCache, runner: ModelRunner, copies: CopyStream) -> None:
        self.after_s = after_s                        # 0: off
        self.kv_pool, self.state_pool, self.allocator = kv_pool, state_pool, allocator
        self.cache, self.runner, self.copies = cache, runner, copies
        self.last_busy = time.monotonic()             # the last step that ran a request
        self.releases = 0

    @property
    def released(self) -> bool:
        return self.kv_pool.released

    def busy(self) -> None:
        self.last_busy = time.monotonic()

    def due_in(self) -> float | None:
        """Seconds until the device pools are due for release; None when off or already released."""
        if not self.after_s or self.released:
            return None
        return max(0.0, self.last_busy + self.after_s - time.monotonic())

    def release(self) -> None:
        """Demote the device's prefix cache to the tiers (what they can take; the rest is dropped) and free the
        device pools. The caller makes sure no request runs or waits."""
        # every device page (none is locked while idle) is demoted or dropped, and with it its node's snapshot
        self.cache.make_room(self.allocator.num_pages)
        self.copies.synchronize()                  # the demotions' copies read the pools about to be freed
        self.kv_pool.release()
        self.state_pool.release()
        self.runner.release_graphs()               # they point into the pools just freed
        if self.kv_pool.buffer.is_cuda:
            torch.cuda.empty_cache()
        self.releases += 1
        log.info("idle for %.0f s: device cache demoted to the tiers, device pools freed", self.after_s)

    def restore(self) -> bool:
        """Allocate the device pools again for the first request after a release. False when the device has no room
        for them now (another process took the memory meanwhile): the pools stay released, whole."""
        try:
            self.kv_pool.restore()
            self.state_pool.restore()
        except RuntimeError as e:                  # torch.OutOfMemoryError is one; so is a failed CPU allocation
            self.kv_pool.release()                 # what did get allocated
            self.state_pool.release()
            if self.kv_pool.buffer.is_cuda:
                torch.cuda.empty_cache()
            log.error("a request after an idle release: no room for the device pools now (%s); the waiting "
                      "requests fail and the next one tries again", str(e).splitlines()[0])
            return False
        self.runner.capture_graphs()               # on the new pools, before the request's first step
        log.info("a request after an idle release: device pools allocated again")
        return True
