"""One generation request as the engine, the scheduler and the prefix cache see it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tinyserve.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)    # pages holding KV of tokens [0, num_computed)
    state_slot: int | None = None
    num_computed: int = 0                              # tokens whose KV and GDN state are in the pools
    cached_tokens: int = 0                             # prompt tokens taken from the prefix cache
    finish_reason: str | None = None
    admit_order: int = 0                               # larger = admitted later (preempted first)
    # what the prefix cache keys the prompt on where that is not prompt_ids (an image's tokens: its key values), and
    # prompt positions where a cached state helps later requests resume (where the last messages start; before and
    # after the images)
    prompt_keys: list[int] | None = None
    resume_hints: tuple[int, ...] = ()
    reuse_cache: bool = True                           # False: compute the whole prompt, whatever is cached
    features: dict[str, Any] = field(default_factory=dict)   # the optional features' records, by feature name
    report: dict[str, Any] = field(default_factory=dict)     # for the result, with the next event (engine.py)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the rest (a long prompt is read every step)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

    @property
    def cache_ids(self) -> list[int]:
        """What the prefix cache keys this request on: prompt_keys (else prompt_ids), then the output."""
        return (self.prompt_keys if self.prompt_keys is not None else self.prompt_ids) + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
