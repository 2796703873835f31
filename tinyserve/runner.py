"""Turns a scheduled step into one packed forward pass and the tokens it samples: pack -> forward -> sample.

`pack` lays the step's sequences out on the host (plain decodes, then verifies, then prefill chunks): token ids,
positions, KV slots, the page table, state slots. It is the one packer: the eager forward makes its ForwardBatch
from it (Packed.batch), and the static steps pad it into their buffers. `forward` runs the model, `step` then takes
the logits of the rows that sample and samples them.

The optional parts it calls, each None when off and called at one place here (build.py sets them):
    images           multimodal.Images       the model's inputs of a batch with an image (M-RoPE rows, features),
                                             and the features of images computed let go after the step
    steps            static.StaticStep       a step it takes (decodes, verifies) through CUDA graphs / compiled code
    grammar          grammar.Grammar         the masks of the constrained rows, before sampling
    nextn            spec.NextN              the verify of the drafts, then the next drafts after the step
    prompt_logprobs  prompt_logprobs.PromptLogprobs   the prompt rows' logprobs of a request that asks, after the step
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tinyserve.kernels.verify_layout import VerifyLayout, verify_layout
from tinyserve.pools import KVPool, StatePool
from tinyserve.models.qwen3_next import ForwardBatch, Qwen3NextForCausalLM
from tinyserve.request import Request
from tinyserve.sampling import SamplingBatch, sample
from tinyserve.scheduler import ScheduledSeq


@dataclass
class SeqOutput:
    """What one sequence of the step produced, before the engine applies stops."""
    seq: ScheduledSeq
    tokens: list[int]                                  # one token; a verify's: the drafts it kept and one more
    logprobs: list[float | None]                       # None where no row of the step asks for logprobs
    top: list[list[tuple[int, float]]] | None = None   # per token, when the request asks for top logprobs


@dataclass
class Packed:
    """Sequences packed on the host: spans[i] = (request, first position, tokens) owns token rows
    cu_seqlens[i]:cu_seqlens[i+1]. The first num_decode sequences decode one token, the next num_verify are
    verifies (state_after[k]: where the state after each of verify k's tokens goes), the rest are prefill chunks."""
    spans: list[tuple[Request, int, int]]
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]                            # flat KV slot (page * page_size + offset) of each token
    cu_seqlens: list[int]
    seq_lens: list[int]                                # context length after the step
    state_slots: list[int]
    num_decode: int
    num_verify: int = 0
    state_after: tuple[list[int], ...] = ()
    prefill_snapshots: tuple[tuple[int, int, int], ...] = ()   # ForwardBatch.prefill_snapshots

    @property
    def num_seqs(self) -> int:
        return len(self.spans)

    def batch(self, device: torch.device) -> ForwardBatch:
        """The packed sequences as the model's tensors on `device` (the eager forward's)."""
        max_pages = max(len(req.pages) for req, _, _ in self.spans)
        table = [req.pages + [0] * (max_pages - len(req.pages)) for req, _, _ in self.spans]
        return ForwardBatch(
            input_ids=torch.tensor(self.input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(self.positions, dtype=torch.long, device=device),
            cu_seqlens=self.cu_seqlens, seq_lens=self.seq_lens,
            seq_lens_t=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            page_table=torch.tensor(table, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(self.slot_mapping, dtype=torch.long, device=device),
            state_slots=self.state_slots,
            state_slots_t=torch.tensor(self.state_slots, dtype=torch.long, device=device),
            num_decode=self.num_decode, num_verify=self.num_verify,
            verify=self.verify_layout_of(device) if self.num_verify else None,
            prefill_snapshots=self.prefill_snapshots)

    def verify_layout_of(self, device: torch.device) -> VerifyLayout:
        """Where the verifies read and write their state, token by token (the kernels' layout)."""
        first, last, cu = self.num_decode, self.num_decode + self.num_verify, self.cu_seqlens
        return verify_layout([c - cu[first] for c in cu[first:last + 1]], self.seq_lens[first:last],
                             self.state_slots[first:last], list(self.state_after), device)


class ImageInputs(Protocol):                # multimodal.Images
    def model_inputs(self, packed: Packed, shift: int) -> dict[str, Any]: ...
    def after_step(self, seqs: list[ScheduledSeq]) -> None: ...


class StaticSteps(Protocol):                # static.StaticStep
    def takes(self, packed: Packed) -> bool: ...
    def forward(self, packed: Packed) -> torch.Tensor: ...


class LogitMasks(Protocol):                 # grammar.Grammar
    def masks(self, reqs: list[Request], rows: list[int]) -> tuple[list[int], torch.Tensor] | None: ...


class Drafting(Protocol):                   # spec.NextN
    def verify(self, seqs: list[ScheduledSeq], logits: torch.Tensor, first_rows: list[int]) -> list[SeqOutput]: ...
    def draft(self, seqs: list[ScheduledSeq], packed: Packed, hidden: torch.Tensor, outputs: list[SeqOutput],
              started: float) -> None: ...


class PromptRows(Protocol):                 # prompt_logprobs.PromptLogprobs
    def read(self, seqs: list[ScheduledSeq], packed: Packed, hidden: torch.Tensor) -> None: ...


class ModelRunner:
    def __init__(self, model: Qwen3NextForCausalLM, kv_pool: KVPool, state_pool: StatePool,
                 eos_token_ids: list[int], context_length: int = 0) -> None:
        self.model, self.kv_pool, self.state_pool = model, kv_pool, state_pool
        self.device = model.device
        self.page_size = kv_pool.page_size
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.cfg.vocab_size
        self.context_length = context_length
        # the optional parts (see the module docstring), set by build.py
        self.images: ImageInputs | None = None
        self.steps: StaticSteps | None = None
        self.grammar: LogitMasks | None = None
        self.nextn: Drafting | None = None
        self.prompt_logprobs: PromptRows | None = None

    # ---- pack ----
    def pack(self, spans: list[tuple[Request, int, int]], input_ids: list[int], state_slots: list[int],
             num_decode: int, state_after: tuple[list[int], ...] = (),
             snapshots: tuple[tuple[int, int, int], ...] = ()) -> Packed:
        """Spans (request, first position, tokens) over each request's own pages, with their token ids packed in
        span order; the first num_decode are one-token decodes, the next len(state_after) verifies."""
        ps = self.page_size
        positions: list[int] = []
        slots: list[int] = []
        cu, seq_lens = [0], []
        for req, start, n in spans:
            end = start + n
            positions += range(start, end)
            slots += [req.pages[p // ps] * ps + p % ps for p in range(start, end)]
            cu.append(cu[-1] + n)
            seq_lens.append(end)
        return Packed(spans, input_ids, positions, slots, cu, seq_lens, state_slots, num_decode, len(state_after),
                      state_after, snapshots)

    def pack_step(self, seqs: list[ScheduledSeq]) -> Packed:
        """A scheduled step packed (plain decodes, verifies, then prefill chunks, as scheduled)."""
        num_decode = sum(s.is_decode and not s.drafts for s in seqs)
        num_verify = sum(bool(s.drafts) for s in seqs)
        ids: list[int] = []
        for s in seqs:
            own = s.num_tokens - len(s.drafts)
            ids += s.req.token_ids(s.start, s.start + own) + s.drafts
        first_prefill = num_decode + num_verify
        snapshots = tuple((i - first_prefill, pos - s.start, slot)
                          for i, s in enumerate(seqs) for pos, slot in s.snapshots)
        return self.pack([(s.req, s.start, s.num_tokens) for s in seqs], ids, [s.req.state_slot for s in seqs],
                         num_decode, tuple(s.state_after for s in seqs[num_decode:first_prefill]), snapshots)

    def model_inputs(self, packed: Packed, shift: int = 0) -> dict:
        """The model's keyword inputs beyond the batch: an image's (M-RoPE rows, features). shift: 0 for the
        target, 1 for the NEXTN head, whose row p embeds the token at p + 1."""
        if self.images is None or all(req.images is None for req, _, _ in packed.spans):
            return {}
        return self.images.model_inputs(packed, shift)

    # ---- forward ----
    @torch.inference_mode()
    def forward(self, seqs: list[ScheduledSeq]) -> tuple[Packed, torch.Tensor]:
        """The step's packed batch and the final hidden rows, laid out as packed: through the static steps when
        they take the batch (all decodes and verifies, no image), else eagerly."""
        packed = self.pack_step(seqs)
        inputs = self.model_inputs(packed)
        if self.steps is not None and not inputs and self.steps.takes(packed):
            return packed, self.steps.forward(packed)
        return packed, self.model(packed.batch(self.device), self.kv_pool, self.state_pool, **inputs)

    # ---- the step ----
    @torch.inference_mode()
    def step(self, seqs: list[ScheduledSeq]) -> list[SeqOutput]:
        """pack -> forward -> sample: the tokens of the sequences that sample, in batch order."""
        if not seqs:
            return []
        started = time.perf_counter()
        packed, hidden = self.forward(seqs)
        outputs = self._sample(seqs, packed, hidden)
        if self.nextn is not None:                     # the next drafts (and the NEXTN head's KV)
            self.nextn.draft(seqs, packed, hidden, outputs, started)
        if self.images is not None and any(s.req.images is not None for s in seqs):
            self.images.after_step(seqs)
        if self.prompt_logprobs is not None and any(s.req.prompt_logprobs is not None for s in seqs):
            self.prompt_logprobs.read(seqs, packed, hidden)
        return outputs

    def _sample(self, seqs: list[ScheduledSeq], packed: Packed, hidden: torch.Tensor) -> list[SeqOutput]:
        """One logits pass over the sampling rows (a sequence's last token; a verify's own last token and each
        draft), in batch order."""
        sampled = [s for s in seqs if s.samples]
        if not sampled:
            return []
        ends = [packed.cu_seqlens[i + 1] for i, s in enumerate(seqs) if s.samples]
        rows = [r for s, end in zip(sampled, ends) for r in range(end - 1 - len(s.drafts), end)]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
        if len(rows) == len(sampled):                  # no drafts: one row each
            return self._sample_rows(sampled, logits)
        return self._sample_with_drafts(sampled, logits)

    def _sample_rows(self, seqs: list[ScheduledSeq], logits: torch.Tensor) -> list[SeqOutput]:
        """One token for each sequence from its row of logits: the argmax when every row is plainly greedy, else
        through the sampler."""
        reqs = [s.req for s in seqs]
        masks = None
        if self.grammar is not None and any(r.grammar is not None for r in reqs):
            masks = self.grammar.masks(reqs, list(range(len(reqs))))
        if masks is None and all(r.params.plain_greedy for r in reqs):
            return [SeqOutput(s, [token], [None]) for s, token in zip(seqs, logits.argmax(-1).tolist())]
        sb = SamplingBatch.build([r.params for r in reqs], [r.prompt_ids for r in reqs], [r.output_ids for r in reqs],
                                 [r.seed for r in reqs], self.eos_token_ids, self.vocab_size, self.device, masks)
        r = sample(logits, sb)
        tokens = r.tokens.tolist()
        lps = r.logprobs.tolist() if r.logprobs is not None else [None] * len(tokens)
        top = None
        if r.top_ids is not None:
            top = [list(zip(i, lp)) for i, lp in zip(r.top_ids.tolist(), r.top_logprobs.tolist())]
        out = []
        for k, s in enumerate(seqs):
            n = s.req.params.logprobs
            out.append(SeqOutput(s, [tokens[k]], [lps[k]], [top[k][:n]] if top and n else None))
        return out

    def _sample_with_drafts(self, seqs: list[ScheduledSeq], logits: torch.Tensor) -> list[SeqOutput]:
        """The plain sequences sampled here, the verifies by NEXTN (each one's rows start at its first row)."""
        first = [0]
        for s in seqs:
            first.append(first[-1] + 1 + len(s.drafts))
        plain = [k for k, s in enumerate(seqs) if not s.drafts]
        verifies = [k for k, s in enumerate(seqs) if s.drafts]
        out: dict[int, SeqOutput] = {}
        if plain:
            picked = logits[torch.tensor([first[k] for k in plain], device=self.device)]
            out.update(zip(plain, self._sample_rows([seqs[k] for k in plain], picked)))
        out.update(zip(verifies, self.nextn.verify([seqs[k] for k in verifies], logits, [first[k] for k in verifies])))
        return [out[k] for k in range(len(seqs))]
