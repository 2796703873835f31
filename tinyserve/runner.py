"""Turns a scheduled step into one forward pass and the tokens it samples: pack -> forward -> sample.

A step has two names: the scheduler's sequences (scheduler.ScheduledSeq) and the model's batch
(qwen3_next.ForwardBatch). `pack` lays the sequences out as that batch (plain decodes, then verifies, then prefill
chunks: token ids, positions, KV slots, the page table, state slots), the one packer: the eager forward reads it, the
compiled CPU decode reads its tensors as they are, the static steps pad them into their buffers. `forward` runs the
model, `step` then takes the logits of the rows that sample and samples them.

A request's page-table row is kept as an array between steps (`_page_row`): a request's page list only grows by
appends, or is replaced whole (PrefixCache.admit, Scheduler._free: a new list), so a step copies each row instead of
walking every page of a long context in Python. The page table is at least 2 wide: torch.compile keeps a width of 1
apart, as a constant.

The optional parts it calls, each None when off and called at one place here (build.py sets them):
    images           multimodal.Images       the model's inputs of a batch with an image (M-RoPE rows, features),
                                             and the features of images computed let go after the step
    compiled         compiled.CompiledSteps  a plain decode step through the graphs torch.compile made (the CPU)
    steps            static.StaticStep       a step it takes (decodes, verifies) through CUDA graphs (and, on the
                                             CPU, NEXTN's verifies through the compiled graphs)
    grammar          grammar.Grammar         the masks of the constrained rows, before sampling
    nextn            spec.NextN              the verify of the drafts, then the next drafts after the step
    prompt_logprobs  prompt_logprobs.PromptLogprobs   the prompt rows' logprobs of a request that asks, after the step
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from tinyserve.kernels.verify_layout import verify_layout
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


Spans = list[tuple[Request, int, int]]     # (request, first position, tokens) of each sequence, in batch order


class ImageInputs(Protocol):                # multimodal.Images
    def model_inputs(self, spans: Spans, batch: ForwardBatch, shift: int) -> dict[str, Any]: ...
    def after_step(self, seqs: list[ScheduledSeq]) -> None: ...


class CompiledDecode(Protocol):             # compiled.CompiledSteps
    def decode(self, batch: ForwardBatch) -> torch.Tensor: ...
    def logits(self, row: torch.Tensor) -> torch.Tensor: ...


class StaticSteps(Protocol):                # static.StaticStep
    def takes(self, batch: ForwardBatch) -> bool: ...
    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


class LogitMasks(Protocol):                 # grammar.Grammar
    def masks(self, reqs: list[Request], rows: list[int]) -> tuple[list[int], torch.Tensor] | None: ...


class Drafting(Protocol):                   # spec.NextN
    def verify(self, seqs: list[ScheduledSeq], logits: torch.Tensor, first_rows: list[int]) -> list[SeqOutput]: ...
    def draft(self, seqs: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor, outputs: list[SeqOutput],
              started: float) -> None: ...


class PromptRows(Protocol):                 # prompt_logprobs.PromptLogprobs
    def read(self, seqs: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor) -> None: ...


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
        self.compiled: CompiledDecode | None = None
        self.steps: StaticSteps | None = None
        self.grammar: LogitMasks | None = None
        self.nextn: Drafting | None = None
        self.prompt_logprobs: PromptRows | None = None
        self._page_rows: dict[int, tuple[list[int], np.ndarray]] = {}   # id(request) -> (its pages, as an array)

    # ---- pack ----
    def pack(self, spans: Spans, input_ids: list[int], state_slots: list[int], num_decode: int,
             state_after: tuple[list[int], ...] = (), snapshots: tuple[tuple[int, int, int], ...] = ()
             ) -> ForwardBatch:
        # num_decode decodes, len(state_after) verifies (state_after[k]: each token's state slot), prefill chunks
        ps, dev, nd, nv = self.page_size, self.device, num_decode, len(state_after)
        positions: list[int] = []
        slots: list[int] = []
        cu, seq_lens, rows = [0], [], []
        for req, start, n in spans:
            positions += range(start, start + n)
            slots += [req.pages[p // ps] * ps + p % ps for p in range(start, start + n)]
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            rows.append(self._page_row(req))
        table = np.zeros((len(rows), max(2, max(map(len, rows)))), dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, :len(row)] = row
        # where the verifies read and write their state, token by token (the kernels' layout)
        verify = verify_layout([c - cu[nd] for c in cu[nd:nd + nv + 1]], seq_lens[nd:nd + nv], state_slots[nd:nd + nv],
                               list(state_after), dev) if nv else None
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev), cu_seqlens=cu, seq_lens=seq_lens,
            positions=torch.tensor(positions, dtype=torch.long, device=dev), page_table=torch.from_numpy(table).to(dev),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=dev), state_slots=state_slots,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_slots_t=torch.tensor(state_slots, dtype=torch.long, device=dev), num_decode=nd, num_verify=nv,
            verify=verify, prefill_snapshots=snapshots)

    def _page_row(self, req: Request) -> np.ndarray:
        pages, (held, row) = req.pages, self._page_rows.get(id(req), (None, None))
        if held is not pages or len(row) > len(pages):
            row = np.asarray(pages, dtype=np.int32)
        elif len(row) < len(pages):
            row = np.concatenate((row, np.asarray(pages[len(row):], dtype=np.int32)))
        else:
            return row
        if len(self._page_rows) > 64:              # finished requests' rows go (an id a new request reuses comes
            self._page_rows.clear()                 # with another list, which the held one tells apart)
        self._page_rows[id(req)] = (pages, row)
        return row

    def model_inputs(self, spans: Spans, batch: ForwardBatch, shift: int = 0) -> dict:
        """The model's keyword inputs beyond the batch: an image's (M-RoPE rows, features). shift: 0 for the
        target, 1 for the NEXTN head, whose row p embeds the token at p + 1."""
        if self.images is None or all(req.images is None for req, _, _ in spans):
            return {}
        return self.images.model_inputs(spans, batch, shift)

    # ---- forward ----
    @torch.inference_mode()
    def forward(self, seqs: list[ScheduledSeq]) -> tuple[ForwardBatch, torch.Tensor]:
        # the step packed and its final hidden rows (the compiled decode, the static steps, else eagerly)
        spans: Spans = [(s.req, s.start, s.num_tokens) for s in seqs]
        state_slots = [s.req.state_slot for s in seqs]
        ids: list[int] = []
        state_after: list[list[int]] = []
        snapshots: list[tuple[int, int, int]] = []
        num_decode = 0
        for i, s in enumerate(seqs):
            ids += s.req.token_ids(s.start, s.start + s.num_tokens - len(s.drafts)) + s.drafts
            num_decode += s.is_decode and not s.drafts
            if s.drafts:
                state_after.append(s.state_after)
            for pos, slot in s.snapshots:       # a prefill's, counted from the first prefill
                snapshots.append((i - num_decode - len(state_after), pos - s.start, slot))
        batch = self.pack(spans, ids, state_slots, num_decode, tuple(state_after), tuple(snapshots))
        inputs = self.model_inputs(spans, batch) if self.images is not None else {}
        if not inputs and self.compiled is not None and num_decode == len(seqs):
            return batch, self.compiled.decode(batch)
        if not inputs and self.steps is not None and self.steps.takes(batch):
            return batch, self.steps.forward(batch)
        return batch, self.model(batch, self.kv_pool, self.state_pool, **inputs)

    # ---- the step ----
    @torch.inference_mode()
    def step(self, seqs: list[ScheduledSeq]) -> list[SeqOutput]:
        """pack -> forward -> sample: the tokens of the sequences that sample, in batch order (seqs: not empty)."""
        started = time.perf_counter()
        batch, hidden = self.forward(seqs)
        outputs = self._sample(seqs, batch, hidden)
        if self.nextn is not None:                     # the next drafts (and the NEXTN head's KV)
            self.nextn.draft(seqs, batch, hidden, outputs, started)
        if self.images is not None and any(s.req.images is not None for s in seqs):
            self.images.after_step(seqs)
        if self.prompt_logprobs is not None and any(s.req.prompt_logprobs is not None for s in seqs):
            self.prompt_logprobs.read(seqs, batch, hidden)
        return outputs

    def _sample(self, seqs: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor) -> list[SeqOutput]:
        # one logits pass over the sampling rows (a sequence's last token; a verify's own last token and each
        # draft), in batch order
        sampled: list[ScheduledSeq] = []
        rows: list[int] = []
        for i, s in enumerate(seqs):
            if s.samples:
                sampled.append(s)
                rows += range(batch.cu_seqlens[i + 1] - 1 - len(s.drafts), batch.cu_seqlens[i + 1])
        if not sampled:
            return []
        if len(rows) == 1 and self.compiled is not None:      # one row: the LM head compiled (a lone decode's)
            logits = self.compiled.logits(hidden[rows[0]:rows[0] + 1])
        else:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
        if len(rows) == len(sampled):                  # no drafts: one row each
            return self._sample_rows(sampled, logits)
        return self._sample_with_drafts(sampled, logits)

    def _sample_rows(self, seqs: list[ScheduledSeq], logits: torch.Tensor) -> list[SeqOutput]:
        # one token for each sequence from its row: the argmax when every row is plainly greedy, else the sampler's
        reqs = [s.req for s in seqs]
        constrained = self.grammar is not None and any(r.grammar is not None for r in reqs)
        masks = self.grammar.masks(reqs, list(range(len(reqs)))) if constrained else None
        if masks is None and all(r.params.plain_greedy for r in reqs):
            return [SeqOutput(s, [token], [None]) for s, token in zip(seqs, logits.argmax(-1).tolist())]
        return self._draw(seqs, reqs, logits, masks)

    def _draw(self, seqs: list[ScheduledSeq], reqs: list[Request], logits: torch.Tensor,
              masks: tuple[list[int], torch.Tensor] | None) -> list[SeqOutput]:
        """One token for each sequence through the sampler (penalties, temperature, filters, seeded draws,
        logprobs), its constrained rows masked first."""
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
