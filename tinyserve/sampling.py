"""Batched sampling: logit bias, penalties, min_tokens, temperature, top-k / top-p / min-p, seeded draws, logprobs.

The runner calls `SamplingBatch.build(...)` and `sample(logits, batch)` once per step for all running requests
(unless every one is plainly greedy, SamplingParams.plain_greedy: then the token is the logits' argmax). All
math is batched over [B, V] tensors in float32; Python only loops over the (few) requests to gather their
parameters. Top-k / top-p / min-p and the draw from what they keep are in top_k_top_p.py, the coins in draws.py: a
request's draw at position p depends only on its own seed and p, not on the batch it shares, its row, or preemption.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tinyserve.draws import as_int64
from tinyserve.top_k_top_p import candidates, draw_filtered, top_n

# Temperatures below this are treated as greedy (same cut-off vLLM uses); dividing by them would overflow.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0            # OpenAI's range for logit_bias values: [-100, 100]

# Each numeric field: what it must be, its range as an error names it (None passes where that starts with "None"), and
# the range as an interval: its ends and which it includes ("[" / "]": included, "(" / ")": not; None: max_tokens), in
# the order they are checked
INF = math.inf
_RANGES = {
    "temperature": ("a number", ">= 0 (0 = greedy)", "[)", 0.0, INF),
    "top_p": ("a number", "in (0, 1]", "(]", 0.0, 1.0),
    "top_k": ("an integer", "-1, 0 (both disable it) or a positive integer", "[)", -1, INF),
    "min_p": ("a number", "in [0, 1]", "[]", 0.0, 1.0),
    "presence_penalty": ("a number", "in [-2, 2]", "[]", -2.0, 2.0),
    "frequency_penalty": ("a number", "in [-2, 2]", "[]", -2.0, 2.0),
    "repetition_penalty": ("a number", "> 0 (1 = off)", "()", 0.0, INF),
    "max_tokens": ("an integer", ">= 1", "[)", 1, INF),
    "min_tokens": ("an integer", "in [0, max_tokens={p.max_tokens}]", "[]", 0, None),
    "logprobs": ("an integer", f"None or an integer in [0, {MAX_LOGPROBS}]", "[]", 0, MAX_LOGPROBS),
    "seed": ("an integer", "None or an integer", "()", -INF, INF),
    "prompt_logprobs": ("an integer", f"None or an integer in [0, {MAX_LOGPROBS}]", "[]", 0, MAX_LOGPROBS),
}


@dataclass(frozen=True)
class Constraint:
    """What the output must match: kind "json_object" (any JSON object), "json_schema" (schema: its JSON text,
    so the dataclass stays hashable and frozen) or "tool_call" (schema: the JSON text of the callable tools,
    [{"name", "parameters"}]). start_after: a token id (the reasoning end, `</think>`) before which the output is
    free; None: constrained from the first token. Enforced by grammar.py, which turns it into a logit mask."""

    kind: str
    schema: str | None = None
    start_after: int | None = None

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> "Constraint":
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    @classmethod
    def tool_call(cls, tools: list[dict[str, Any]], name: str | None = None,
                  formats: dict[str, dict[str, Any]] | None = None) -> "Constraint":
        """One call of any of these OpenAI function tools ({"type": "function", "function": {...}} or the bare
        function), or of the one named. formats: the freeform tools (by name) and the format of their `input`
        ({"type": "text"} or {"type": "grammar", "syntax", "definition"})."""
        callable_ = []
        for tool in tools:
            fn = tool.get("function") if isinstance(tool, dict) and isinstance(tool.get("function"), dict) else tool
            fn = fn if isinstance(fn, dict) else {}
            if name is None or fn.get("name") == name:
                if fn.get("name") in (formats or {}):
                    callable_.append({"name": fn.get("name"), "format": formats[fn["name"]]})
                else:
                    callable_.append({"name": fn.get("name"), "parameters": fn.get("parameters")})
        return cls("tool_call", json.dumps(callable_))


def _check_logit_bias(bias: object) -> None:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias must map token ids (non-negative integers); got the key {token!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must map each token id to a number in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}]; got {value!r} for token {token}")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16       # None: up to the end of the context (request.Intake fits it)
    min_tokens: int = 0
    temperature: float = 1.0          # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1 -> off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # None: off; 0: the chosen token's logprob; n: plus top-n
    constraint: Constraint | None = None   # grammar the output must match (grammar.py); None: free text
    speculative: bool = True          # False: this request never speculates (NEXTN), whatever the engine does
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before every filter
    prompt_logprobs: int | None = None  # None: off; n >= 0: each prompt token's logprob (+ its top-n), from the prefill

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and its allowed range (the ranges: _RANGES)."""
        for name, (kind, allowed, ends, lo, hi) in _RANGES.items():
            value = getattr(self, name)
            if value is None and allowed.startswith("None"):
                continue
            if isinstance(value, bool) or not isinstance(value, int if kind == "an integer" else (int, float)) \
                    or value != value:                                      # NaN
                raise ValueError(f"{name} must be {kind}, got {value!r}")
            hi = self.max_tokens if hi is None else hi
            above = lo <= value if ends[0] == "[" else lo < value
            if not above or not (value <= hi if ends[1] == "]" else value < hi):
                raise ValueError(f"{name} must be {allowed.format(p=self)}, got {value!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint or None, got {self.constraint!r}")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing to apply to the logits first and no logprobs: the token is the raw logits' argmax."""
        return self.is_greedy and self.logprobs is None and not self.logit_bias and not self.min_tokens and \
            self.presence_penalty == self.frequency_penalty == 0.0 and self.repetition_penalty == 1.0


@dataclass
class SampleResult:
    tokens: torch.Tensor                      # [B] int64
    logprobs: torch.Tensor | None             # [B] float32, log_softmax(raw logits)[token]; None: no row asks
    top_ids: torch.Tensor | None = None       # [B, n] int64, sorted by logprob, descending
    top_logprobs: torch.Tensor | None = None  # [B, n] float32


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one step. Tensors that no row needs are None (checked via flags)."""

    batch_size: int
    vocab_size: int
    device: torch.device
    # Rows split by decoding mode; index tensors are None when the split is trivial.
    all_greedy: bool
    any_greedy: bool
    sample_rows: torch.Tensor | None = None   # [S] int64 rows that draw randomly (None: all rows or none)
    greedy_rows: torch.Tensor | None = None   # [G] int64 greedy rows in a mixed batch
    # Per sampled row ([S]); None when unused by every sampled row.
    temperature: torch.Tensor | None = None   # float32
    top_k: torch.Tensor | None = None         # int64, vocab_size where off
    top_p: torch.Tensor | None = None         # float32, 1.0 where off
    min_p: torch.Tensor | None = None         # float32, 0.0 where off
    seeds: torch.Tensor | None = None         # int64 (the seed's 64 bits)
    positions: torch.Tensor | None = None     # int64, output tokens generated so far = index of this draw
    # Penalties: per row ([B]), and the tokens they touch as flat indices row * V + id (each once), so a step
    # costs what the requests' tokens hold, not B x V (248,320 columns for Qwen3.5).
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    output_flat: torch.Tensor | None = None       # [M] int64, the output tokens
    output_counts: torch.Tensor | None = None     # [M] float32, how often each occurs in its row's output
    repetition_penalty: torch.Tensor | None = None
    seen_flat: torch.Tensor | None = None         # [N] int64, the tokens of each row's prompt and output
    # logit_bias: logits[bias_rows, bias_cols] += bias_values, one sparse add over the (row, id) pairs set
    bias_rows: torch.Tensor | None = None
    bias_cols: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # min_tokens: logits[suppress_rows, suppress_cols] = -inf (eos + stop ids of rows still short of min_tokens).
    suppress_rows: torch.Tensor | None = None
    suppress_cols: torch.Tensor | None = None
    max_logprobs: int | None = None               # largest `logprobs` any row asks for; None if none asks
    top_n: list[int] | None = None                # per row its top-n count (0: none); set when max_logprobs
    # Grammar constraints: rows mask_rows ([C] int64) may only pick the tokens set in mask_bits
    # (int32 [C, ceil(V / 32)], bit j of word w = token 32 w + j, filled by llguidance on the host).
    mask_rows: torch.Tensor | None = None
    mask_bits: torch.Tensor | None = None

    @property
    def has_penalties(self) -> bool:
        return self.output_flat is not None or self.seen_flat is not None

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_ids: list[list[int]], output_ids: list[list[int]],
              seeds: list[int], eos_token_ids: list[int], vocab_size: int,
              device: torch.device | str = "cpu",
              masks: tuple[list[int], torch.Tensor] | None = None) -> "SamplingBatch":
        """masks: (rows, int32 bitmask [len(rows), ceil(V / 32)]) of the grammar-constrained rows, or None."""
        B = len(params)
        if not (len(prompt_ids) == len(output_ids) == len(seeds) == B):
            raise ValueError(
                f"SamplingBatch.build: params ({B}), prompt_ids ({len(prompt_ids)}), output_ids "
                f"({len(output_ids)}) and seeds ({len(seeds)}) must have one entry per request")
        device = torch.device(device)
        sampled = [r for r, p in enumerate(params) if not p.is_greedy]
        batch = cls(batch_size=B, vocab_size=vocab_size, device=device, all_greedy=not sampled,
                    any_greedy=len(sampled) < B)
        if sampled:
            batch._sampled_rows(params, sampled, output_ids, seeds)
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
               for p in params):
            batch._penalties_and_bias(params, prompt_ids, output_ids)
        if any(len(out) < p.min_tokens for p, out in zip(params, output_ids)):
            batch._min_tokens(params, output_ids, eos_token_ids)
        if masks is not None and masks[0]:
            batch.mask_rows = torch.tensor(masks[0], dtype=torch.int64, device=device)
            batch.mask_bits = masks[1].to(device)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            batch.max_logprobs = max(wanted)
            batch.top_n = [p.logprobs or 0 for p in params] if batch.max_logprobs else None
        return batch

    def _sampled_rows(self, params: list[SamplingParams], sampled: list[int], output_ids: list[list[int]],
                      seeds: list[int]) -> None:
        """The columns of the rows that draw: temperature, the filters that some row sets, seeds and positions."""
        B, V, device = self.batch_size, self.vocab_size, self.device
        if len(sampled) < B:
            self.sample_rows = torch.tensor(sampled, dtype=torch.int64, device=device)
            self.greedy_rows = torch.tensor([r for r in range(B) if params[r].is_greedy], dtype=torch.int64,
                                            device=device)
        sp = [params[r] for r in sampled]
        # One host->device transfer per dtype: pack the float and int columns, then split.
        floats = torch.tensor([[p.temperature for p in sp], [p.top_p for p in sp], [p.min_p for p in sp]],
                              dtype=torch.float32).to(device)
        ints = torch.tensor(
            [[p.top_k if 0 < p.top_k < V else V for p in sp],
             [as_int64(seeds[r]) for r in sampled],
             [len(output_ids[r]) for r in sampled]], dtype=torch.int64).to(device)
        self.temperature = floats[0]
        self.seeds, self.positions = ints[1], ints[2]
        if any(0 < p.top_k < V for p in sp):
            self.top_k = ints[0]
        if any(p.top_p < 1.0 for p in sp):
            self.top_p = floats[1]
        if any(p.min_p > 0.0 for p in sp):
            self.min_p = floats[2]

    def _penalties_and_bias(self, params: list[SamplingParams], prompt_ids: list[list[int]],
                            output_ids: list[list[int]]) -> None:
        V, device = self.vocab_size, self.device
        if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
            self.presence_penalty = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32,
                                                 device=device)
            self.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32,
                                                  device=device)
            flat, counts = torch.unique(_flat_ids(output_ids, V, device, "output_ids"), return_counts=True)
            self.output_flat, self.output_counts = flat, counts.to(torch.float32)
        if any(p.repetition_penalty != 1.0 for p in params):
            self.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32,
                                                   device=device)
            seen = [pr + out for pr, out in zip(prompt_ids, output_ids)]
            self.seen_flat = torch.unique(_flat_ids(seen, V, device, "prompt_ids/output_ids"))
        # logit_bias: only the (row, id) pairs requests set, so a batch costs what its biases hold, not B x V each
        bias = [(r, t, b) for r, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
        if bias:
            rows, cols, values = zip(*bias)
            if max(cols) >= V:
                raise ValueError(f"logit_bias holds a token id outside [0, vocab_size={V})")
            self.bias_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            self.bias_cols = torch.tensor(cols, dtype=torch.int64, device=device)
            self.bias_values = torch.tensor(values, dtype=torch.float32, device=device)

    def _min_tokens(self, params: list[SamplingParams], output_ids: list[list[int]], eos_token_ids: list[int]) -> None:
        """The engine never stops a row early, and the row must not even *pick* eos / stop ids."""
        suppress: list[tuple[int, int]] = []
        for r, p in enumerate(params):
            if len(output_ids[r]) < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(eos_token_ids)
                suppress += [(r, t) for t in sorted(banned) if 0 <= t < self.vocab_size]  # outside: never drawn
        if suppress:
            rows, cols = zip(*suppress)
            self.suppress_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
            self.suppress_cols = torch.tensor(cols, dtype=torch.int64, device=self.device)


def _flat_ids(rows: list[list[int]], V: int, device: torch.device, what: str) -> torch.Tensor:
    """Row-major flat indices row * V + token for all tokens of all rows (for bincount / scatter)."""
    lengths = [len(r) for r in rows]
    ids = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
        raise ValueError(f"{what} contain a token id outside [0, vocab_size={V})")
    row_of = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int64),
                                     torch.tensor(lengths, dtype=torch.int64))
    return (row_of * V + ids).to(device)


# ---------------------------------------------------------------------------------------------------------------
# Logit processing


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """vLLM's penalties, out of place, float32 [B, V].

    Repetition (prompt + output tokens): positive logits divided by the penalty, negative ones multiplied.
    Frequency / presence (output tokens): logit -= frequency * count + presence * (count > 0).
    """
    V = logits.shape[1]
    x = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).copy_(logits)
    flat = x.view(-1)                                  # only the touched entries change
    if batch.seen_flat is not None:
        rp = batch.repetition_penalty[batch.seen_flat // V]
        v = flat[batch.seen_flat]
        flat[batch.seen_flat] = torch.where(v > 0, v / rp, v * rp)
    if batch.output_flat is not None:
        rows, counts = batch.output_flat // V, batch.output_counts
        v = flat[batch.output_flat]
        flat[batch.output_flat] = v - batch.frequency_penalty[rows] * counts - batch.presence_penalty[rows]
    return x


def apply_logit_bias(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias added to the (row, id) pairs that set one (out of place)."""
    if batch.bias_rows is None:
        return logits
    return logits.index_put((batch.bias_rows, batch.bias_cols), batch.bias_values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """-inf on eos + stop ids for rows that have generated fewer than min_tokens (out of place)."""
    if batch.suppress_rows is None:
        return logits
    x = logits.clone()
    x[batch.suppress_rows, batch.suppress_cols] = float("-inf")
    return x


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The sampled rows' processed logits as a full [S, V] tensor (-inf where excluded); for tests / debugging.

    softmax of the result is the distribution `sample` draws from. logits: [S, V] after penalties.
    """
    vals, ids = candidates(logits.to(torch.float32), batch)
    if ids is None:
        return vals
    return torch.full_like(logits, float("-inf"), dtype=torch.float32).scatter_(1, ids, vals)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """Pick one token per row. logits: [B, V], any float dtype; not modified."""
    check_logits(logits, batch, "sample")
    raw = logits.to(torch.float32)
    x = process_logits(raw, batch)
    tokens = torch.argmax(x, dim=-1) if batch.all_greedy else _draw_rows(x, batch)
    if batch.max_logprobs is None:
        return SampleResult(tokens=tokens, logprobs=None)
    chosen, top_ids, top_lp = token_logprobs(raw, tokens, batch)
    return SampleResult(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)


def _draw_rows(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The tokens of a batch with rows that draw: those drawn, the greedy ones' argmax."""
    xs = x if batch.sample_rows is None else x.index_select(0, batch.sample_rows)
    drawn = draw_filtered(xs, batch)
    if batch.sample_rows is None:
        return drawn
    tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    tokens[batch.sample_rows] = drawn
    tokens[batch.greedy_rows] = torch.argmax(x.index_select(0, batch.greedy_rows), dim=-1)
    return tokens


def check_logits(logits: torch.Tensor, batch: SamplingBatch, who: str) -> tuple[int, int]:
    """(rows, vocab) of logits after checking them against the batch."""
    B, V = logits.shape
    if B != batch.batch_size:
        raise ValueError(f"{who}: logits have {B} rows but the SamplingBatch has {batch.batch_size}")
    if V != batch.vocab_size:
        raise ValueError(f"{who}: logits have vocab {V} but the SamplingBatch was built for {batch.vocab_size}")
    return B, V


_bit_shifts: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, ceil(V / 32)] bitmask (bit j of word w = token 32 w + j) -> bool [R, V] allowed."""
    shifts = _bit_shifts.get(bits.device)
    if shifts is None:
        shifts = _bit_shifts[bits.device] = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab_size]
    return allowed.bool()


def apply_mask(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Out of place: logits [B, V] with -inf where rows[i]'s token is not allowed[i] (one batched masked_fill)."""
    x = logits.clone()
    x[rows] = x[rows].masked_fill(~allowed, float("-inf"))
    return x


def process_logits(raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Logit bias, penalties, min_tokens and the grammar mask on float32 [B, V] logits: what greedy takes the argmax
    of, and what every filter (temperature, top-k, top-p, min-p) starts from. The bias comes first, as OpenAI
    applies it to the model's logits; logprobs stay those of the raw logits."""
    x = raw if batch.bias_rows is None else apply_logit_bias(raw, batch)
    x = apply_penalties(x, batch) if batch.has_penalties else x
    x = x if batch.suppress_rows is None else apply_min_tokens(x, batch)
    if batch.mask_rows is not None:
        x = apply_mask(x, batch.mask_rows, unpack_bitmask(batch.mask_bits, raw.shape[1]))
    return x


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(logprob of each row's token, top-n ids, top-n logprobs) under the raw model distribution (vLLM's default
    "raw_logprobs"); the top-n pair is None when no row asks for it, all three when no row asks for logprobs at
    all (a logsumexp over the whole vocabulary per token, 248K rows with Qwen3.5's, that nobody reads)."""
    if batch.max_logprobs is None:
        return None, None, None
    if batch.max_logprobs:
        logp = torch.log_softmax(raw, dim=-1)
        chosen = logp.gather(1, tokens[:, None]).squeeze(1)
        top_lp, top_ids = top_n(logp, min(batch.max_logprobs, raw.shape[1]))            # sorted, descending
        return chosen, top_ids, top_lp
    # Cheaper than a full log_softmax when no top-n list is needed.
    return raw.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1), None, None


# ---------------------------------------------------------------------------------------------------------------
# Speculative decoding (NEXTN / MTP): draft draws and the accept walk (Leviathan et al. 2023, Chen et al. 2023)


def to_probs(probs: torch.Tensor, ids: torch.Tensor | None, V: int) -> torch.Tensor:
    """Probabilities over `candidates`' ids as full-vocab float32 [S, V], zero outside the kept set."""
    if ids is None:
        return probs
    return torch.zeros(probs.shape[0], V, dtype=torch.float32, device=probs.device).scatter_(1, ids, probs)
