"""One generation request as the engine, the scheduler and the prefix cache see it (Request), and the intake that
makes it: every check a request passes before it reaches the scheduler. The API calls the intake on the event loop or
a worker thread (no torch compute); a request that fails a check gets a RequestError naming its field, never a
traceback. The optional parts a request may ask for take it up there, each None when off (build.py sets them):
`grammar` (grammar.Grammar: the matcher of a constrained request), `images` (multimodal.Images: where its images
sit) and `prompt_logprobs` (prompt_logprobs.PromptLogprobs).

The max_tokens a request gets (`fit_max_tokens`): None means up to the end of the context (vLLM's default; a min_tokens
past it is cut to it, where one past a max_tokens the client chose is refused), but never past what the KV pool holds,
which on a small card or the CPU can be less; with clamp a larger one is cut to what fits instead of refused
(Anthropic's clients send one large max_tokens whatever the server's context). A prompt or max_tokens past them is a
ContextError.

Where the prompt's last two messages start (the last two turn markers; after a generation prompt the second last opens
the last message) are its resume hints (Request.resume_hints): agents resend a conversation with its last message
changed (a reminder dropped, a tool result cut short), so a state cached there resumes their next prompt, where the
interval snapshots below it may have been evicted.
"""
from __future__ import annotations

import enum
import random
import uuid
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, Protocol

from tinyserve.config import Config
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
    # what the optional parts keep of this request (None: it asks nothing of them, or they are off)
    drafts: Any = None                                 # spec.Drafts: NEXTN's drafts to verify, its draft depth
    images: Any = None                                 # multimodal.RequestImages: where its images sit
    grammar: Any = None                                # grammar.GrammarState: the matcher of its constraint
    prompt_logprobs: list | None = None                # prompt_logprobs.py: its prompt's logprobs so far
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


class RequestError(ValueError):
    """A request the engine cannot take. `field` names what is wrong: a SamplingParams field, "prompt" or
    "max_tokens" (the API maps it to the request's own field name). A prompt too long for the context or the KV pool
    carries its length and that limit (`tokens`), which some clients read back from the message."""

    def __init__(self, message: str, field: str, tokens: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.tokens = tokens


class ContextError(RequestError):
    """A prompt or max_tokens past the context or the KV pool (the APIs answer it in their own words);
    prompt_len: the prompt's length."""

    def __init__(self, message: str, field: str, prompt_len: int, tokens: tuple[int, int] | None = None) -> None:
        super().__init__(message, field, tokens)
        self.prompt_len = prompt_len


class Matchers(Protocol):                    # grammar.Grammar
    def attach(self, params: SamplingParams) -> Any: ...


class PromptImages(Protocol):                # multimodal.Images
    def attach(self, req: Request, images: list[Any]) -> None: ...


class PromptRows(Protocol):                  # prompt_logprobs.PromptLogprobs
    def attach(self, req: Request) -> None: ...


class Intake:
    """Fits max_tokens to the context and the KV pool, validates sampling parameters and prompts, and makes the
    Request, which the optional parts it asks for take up."""

    def __init__(self, cfg: Config, context_length: int, kv_tokens: int, vocab_size: int,
                 turn_start_id: int | None = None) -> None:
        self.cfg, self.context_length, self.kv_tokens = cfg, context_length, kv_tokens
        self.turn_start_id = turn_start_id
        self.vocab_size = vocab_size
        self.grammar: Matchers | None = None
        self.images: PromptImages | None = None
        self.prompt_logprobs: PromptRows | None = None

    # ---- lengths and parameters ----
    def fit_max_tokens(self, prompt_len: int, max_tokens: int | None, clamp: bool = False) -> int:
        """The max_tokens a request with this prompt gets (see the module docstring)."""
        fits = min(self.context_length, self.kv_tokens) - prompt_len
        if fits <= 0:
            raise self._prompt_too_long(prompt_len)
        if max_tokens is None:
            return fits
        if max_tokens > fits and not clamp:
            raise self._max_tokens_too_large(prompt_len, max_tokens)
        return min(max_tokens, fits)

    def _prompt_too_long(self, prompt_len: int) -> ContextError:
        context, pool = self.context_length, self.kv_tokens
        if prompt_len >= context:
            return ContextError(f"the prompt is {prompt_len} tokens long, but the context is {context} tokens "
                                "(there must be room for at least one generated token)", "prompt", prompt_len,
                                (prompt_len, context - 1))
        return ContextError(f"the prompt is {prompt_len} tokens long, but the KV cache holds {pool} tokens; "
                            "raise engine.kv_cache_tokens", "prompt", prompt_len, (prompt_len, pool - 1))

    def _max_tokens_too_large(self, prompt_len: int, max_tokens: int) -> ContextError:
        context, pool = self.context_length, self.kv_tokens
        if max_tokens > context - prompt_len:
            return ContextError(f"max_tokens ({max_tokens}) plus the prompt ({prompt_len} tokens) is longer than the "
                                f"context ({context} tokens); at most {context - prompt_len} tokens fit", "max_tokens",
                                prompt_len)
        return ContextError(f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}, which is more than "
                            f"the KV cache holds ({pool} tokens); raise engine.kv_cache_tokens", "max_tokens",
                            prompt_len)

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

    # ---- the request ----
    def make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     images: list[Any] = ()) -> Request:
        """images: what multimodal.Images.prepare returned for these (expanded) prompt ids."""
        if params.max_tokens is None:                    # up to the end of the context; a min_tokens past it is cut
            fits = self.fit_max_tokens(len(prompt_ids), None)
            params = replace(params, max_tokens=fits, min_tokens=min(params.min_tokens, fits))
        try:                                             # the one validation of sampling parameters
            params.validate()
        except ValueError as e:                          # its messages start with the field name
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None
        if params.stop_token_ids or params.logit_bias:
            self._check_vocabulary(params)
        if not prompt_ids or min(prompt_ids) < 0 or max(prompt_ids) >= self.vocab_size:
            raise self._bad_prompt(prompt_ids)
        self.fit_max_tokens(len(prompt_ids), params.max_tokens)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        # where the last two messages start (resume_hints), read from the end: the scan stops at the second
        turns = (i for i in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[i] == self.turn_start_id)
        starts = tuple(islice(turns, 2)) if self.turn_start_id in prompt_ids else ()
        req = Request(request_id or uuid.uuid4().hex, list(prompt_ids), params, seed, resume_hints=starts)
        if params.constraint is not None and self.grammar is not None:
            req.grammar = self.grammar.attach(params)          # its matcher; a RequestError names the field
        if params.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.attach(req)
        if images:                                       # engine.images made them: the part is there
            self.images.attach(req, list(images))
        return req

    def _bad_prompt(self, prompt_ids: list[int]) -> RequestError:
        if not prompt_ids:
            return RequestError("the prompt is empty", "prompt")
        bad = next(t for t in prompt_ids if not 0 <= t < self.vocab_size)
        return RequestError(f"prompt token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
