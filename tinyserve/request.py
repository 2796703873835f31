"""One generation request as the engine, the scheduler and the prefix cache see it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tinyserve.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

    from tinyserve.grammar import GrammarState
    from tinyserve.multimodal import RequestImages
    from tinyserve.spec import DepthControl


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


TIERS = ("device", "host", "file")

# One prompt token's logprob under the model, and the top-n (id, logprob) at its position (params.prompt_logprobs)
PromptLogprob = tuple[float, list[tuple[int, float]]]


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
    cached_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # split of the above
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    admit_order: int = 0                               # larger = admitted later (preempted first)
    grammar: GrammarState | None = None                # params.constraint's matcher: has consumed output_ids
    # NEXTN: the drafts to verify after the last output token, the distribution each sampled draft was drawn from
    # ([len(draft), V], None for greedy requests), and how deep this request drafts (None: never speculates)
    draft: list[int] = field(default_factory=list)
    draft_q: torch.Tensor | None = None
    depth: DepthControl | None = None
    images: RequestImages | None = None                # image spans, cache keys, positions (multimodal.py)
    # params.prompt_logprobs: prompt tokens 1.. in order, filled by the runner as the prefill computes them
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def cache_ids(self) -> list[int]:
        """What the prefix cache keys this request on: all_ids with image pads replaced by their images' keys."""
        if self.images is None:
            return self.all_ids
        return self.images.cache_ids + self.output_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for its prompt's logprobs and not all computed yet: its prefill starts from no cached prefix."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
