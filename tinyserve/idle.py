"""Idle release (engine.idle_release_s > 0): after that long without a request, the device's prefix cache is demoted
to the host / file tiers and the device KV and state pools are freed, so an idle home box holds no device memory for
its cache; the first request after it allocates them again. Engine thread only.

An optional part (`IdleRelease`, the engine's `idle`), called by the engine's loop: `timeout` (how long the engine
may sit with nothing to do: the clock starts when it last had work), `release` (the pools go), `wake` (new requests:
the pools come back, or the requests fail when the device has no room for them now) and `stats`. The static steps'
CUDA graphs point into the pools: they are dropped with them and captured again after (the runner's `steps`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tinyserve.cache import Cache
from tinyserve.copies import CopyStream
from tinyserve.pools import KVPool, PageAllocator, StatePool
from tinyserve.runner import ModelRunner

log = logging.getLogger("tinyserve.idle")


@dataclass
class IdleStats:
    pools_freed: bool = False        # the device pools are freed now
    times: int = 0                   # times they were freed


class IdleRelease:
    def __init__(self, after_s: float, kv_pool: KVPool, state_pool: StatePool, allocator: PageAllocator,
                 cache: Cache, copies: CopyStream, runner: ModelRunner) -> None:
        self.after_s = after_s
        self.kv_pool, self.state_pool, self.allocator = kv_pool, state_pool, allocator
        self.cache, self.copies, self.runner = cache, copies, runner
        self.idle_since: float | None = None          # when the engine last ran out of work; None: it has work
        self.times = 0

    @property
    def pools_freed(self) -> bool:
        return not self.kv_pool.allocated

    def timeout(self) -> float | None:
        """Seconds until the device pools are due to be freed; None when they are freed already."""
        if self.pools_freed:
            return None
        now = time.monotonic()
        if self.idle_since is None:
            self.idle_since = now
        return max(0.0, self.idle_since + self.after_s - now)

    def release(self) -> None:
        """Demote the device's prefix cache to the tiers (what they can take; the rest is dropped) and free the
        device pools. The engine calls it with no request running or waiting."""
        if self.pools_freed or self.idle_since is None or time.monotonic() < self.idle_since + self.after_s:
            return
        # every device page (none is locked while idle) is demoted or dropped, and with it its node's snapshot
        self.cache.make_room(self.allocator.num_pages)
        self.copies.synchronize()                  # the demotions' copies read the pools about to be freed
        if self.runner.steps is not None:
            self.runner.steps.drop_graphs()        # they point into the pools about to be freed
        self.kv_pool.deallocate()
        self.state_pool.deallocate()
        if self.kv_pool.buffer.is_cuda:
            torch.cuda.empty_cache()
        self.times += 1
        log.info("idle for %.0f s: device cache demoted to the tiers, device pools freed", self.after_s)

    def wake(self) -> bool:
        """New requests: the engine has work again, and after a release the device pools are allocated again.
        False when the device has no room for them now (another process took the memory meanwhile): the pools stay
        freed, whole."""
        self.idle_since = None
        if not self.pools_freed:
            return True
        try:
            self.kv_pool.allocate()
            self.state_pool.allocate()
        except RuntimeError as e:                  # torch.OutOfMemoryError is one; so is a failed CPU allocation
            self.kv_pool.deallocate()              # what did get allocated
            self.state_pool.deallocate()
            if self.kv_pool.buffer.is_cuda:
                torch.cuda.empty_cache()
            log.error("a request after an idle release: no room for the device pools now (%s); the waiting "
                      "requests fail and the next one tries again", str(e).splitlines()[0])
            return False
        static = self.runner.steps
        if static is not None and static.for_graphs:
            try:
                static.capture()                   # on the new pools, before the request's first step
            except RuntimeError:                   # torch reports a failed capture as one: the steps run eagerly
                log.exception("capturing the CUDA graphs again failed: every step runs eagerly")
                static.drop_graphs()
        log.info("a request after an idle release: device pools allocated again")
        return True

    def stats(self) -> IdleStats:
        return IdleStats(self.pools_freed, self.times)
