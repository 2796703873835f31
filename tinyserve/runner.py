"""Owns the model and the pools; turns a scheduled step into one packed forward pass and sampled tokens."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.grammar import MaskBuffer
from tinyserve.kv import KVPool
from tinyserve.models.qwen3_next import ForwardBatch, Qwen3NextForCausalLM
from tinyserve.sampling import SampleResult, SamplingBatch, sample
from tinyserve.scheduler import ScheduledSeq
from tinyserve.state import StatePool


@dataclass
class StepResult:
    sampled: list[ScheduledSeq]        # sequences that produced a token this step, in row order of `result`
    result: SampleResult | None


class ModelRunner:
    def __init__(self, model: Qwen3NextForCausalLM, kv_pool: KVPool, state_pool: StatePool,
                 eos_token_ids: list[int]) -> None:
        self.model, self.kv_pool, self.state_pool = model, kv_pool, state_pool
        self.device = model.device
        self.page_size = kv_pool.page_size
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.cfg.vocab_size
        self._masks: MaskBuffer | None = None      # grammar bitmasks of the constrained rows (made on first use)

    def build_batch(self, seqs: list[ScheduledSeq]) -> ForwardBatch:
        """Pack the step's sequences (decodes first, as the scheduler orders them)."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        num_decode = sum(s.is_decode for s in seqs)
        assert all(s.is_decode for s in seqs[:num_decode]), "the scheduler puts decodes first"
        for s in seqs:
            req, end = s.req, s.start + s.num_tokens
            ids += req.all_ids[s.start:end]
            positions += range(s.start, end)
            slots += [req.pages[p // ps] * ps + p % ps for p in range(s.start, end)]
            cu.append(cu[-1] + s.num_tokens)
            seq_lens.append(end)
        max_pages = max(len(s.req.pages) for s in seqs)
        table = [s.req.pages + [0] * (max_pages - len(s.req.pages)) for s in seqs]
        state_slots = [s.req.state_slot for s in seqs]
        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            cu_seqlens=cu, seq_lens=seq_lens,
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_slots=state_slots,
            state_slots_t=torch.tensor(state_slots, dtype=torch.long, device=dev),
            num_decode=num_decode)

    def grammar_masks(self, sampled: list[ScheduledSeq]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask) of the rows whose grammar is active this step, filled by llguidance; None if none."""
        rows = [r for r, s in enumerate(sampled) if s.req.grammar is not None and s.req.grammar.active]
        if not rows:
            return None
        if self._masks is None:
            self._masks = MaskBuffer(sampled[rows[0]].req.grammar.vocab_size)
        return rows, self._masks.fill([sampled[r].req.grammar for r in rows])

    @torch.inference_mode()
    def step(self, seqs: list[ScheduledSeq]) -> StepResult:
        if not seqs:
            return StepResult([], None)
        batch = self.build_batch(seqs)
        hidden = self.model(batch, self.kv_pool, self.state_pool)
        rows = [i for i, s in enumerate(seqs) if s.samples]
        if not rows:
            return StepResult([], None)
        last = torch.tensor([batch.cu_seqlens[i + 1] - 1 for i in rows], device=self.device)
        logits = self.model.compute_logits(hidden[last]).float()
        sampled = [seqs[i] for i in rows]
        sb = SamplingBatch.build([s.req.params for s in sampled], [s.req.prompt_ids for s in sampled],
                                 [s.req.output_ids for s in sampled], [s.req.seed for s in sampled],
                                 self.eos_token_ids, self.vocab_size, self.device, self.grammar_masks(sampled))
        return StepResult(sampled, sample(logits, sb))
