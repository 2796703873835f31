"""Turns a scheduled step into one packed forward pass and the tokens it commits.

A step packs the scheduled sequences (plain decodes, NEXTN verifies, then prefill chunks) into one ForwardBatch,
runs the model, takes the logits of the rows that sample and samples them; a verify's rows go through
spec.verify_drafts, the same maths with drafts. The optional parts are one call each: image features
(multimodal.VisionFeatures), grammar masks (grammar.MaskBuffer), NEXTN drafting after the step (spec.NextN), and the
static-shape path whose CUDA graphs replay decode and verify steps (static.StaticStep).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tinyserve.grammar import MaskBuffer
from tinyserve.kernels.pool_layer import PoolLayer
from tinyserve.kernels.verify_layout import verify_layout
from tinyserve.kv import KVPool
from tinyserve.models.qwen3_next import ForwardBatch, Qwen3NextForCausalLM
from tinyserve.multimodal import VisionFeatures, rope_rows
from tinyserve.request import Request
from tinyserve.sampling import SamplingBatch, sample, top_n
from tinyserve.scheduler import ScheduledSeq
from tinyserve.spec import NextN, verify_drafts
from tinyserve.state import StatePool
from tinyserve.static import StaticStep

log = logging.getLogger("tinyserve.runner")

PROMPT_LOGPROB_ROWS = 128      # prompt rows per LM-head pass for prompt logprobs ([rows, vocab] float32 at a time)


@dataclass
class SeqOutput:
    """What one sequence of the step produced, before the engine applies stops."""
    seq: ScheduledSeq
    tokens: list[int]                                  # a verify: accepted drafts + bonus; otherwise one token
    logprobs: list[float | None]                       # None where no row of the step asks for logprobs
    top: list[list[tuple[int, float]]] | None = None   # per token, when the request asks for top logprobs
    accepted: int = 0                                  # drafts accepted (a verify)


@dataclass
class StepResult:
    outputs: list[SeqOutput]           # the sequences that produced tokens this step, in batch order


class ModelRunner:
    def __init__(self, model: Qwen3NextForCausalLM, kv_pool: KVPool, state_pool: StatePool,
                 eos_token_ids: list[int], nextn: NextN | None = None, context_length: int = 0) -> None:
        self.model, self.kv_pool, self.state_pool = model, kv_pool, state_pool
        self.device = model.device
        self.page_size = kv_pool.page_size
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.cfg.vocab_size
        self.nextn, self.context_length = nextn, context_length
        self.images = VisionFeatures(model.encode_images, model.device) if model.visual is not None else None
        self._masks: MaskBuffer | None = None      # grammar bitmasks of the constrained rows (made on first use)
        self.static: StaticStep | None = None      # the static decode / verify path (graphs, compiled); None: eager

    # ---- the static path (CUDA graphs, the CPU's compiled steps) ----
    def enable_static_steps(self, max_batch: int, for_graphs: bool, build: bool = True) -> None:
        """Run decode and NEXTN verify steps of up to max_batch sequences through StaticStep from now on: with
        for_graphs in the CUDA graphs' layout, captured when `build` (at engine start); otherwise in the CPU's, its
        forwards compiled by torch.compile when `build`. Without `build` (the CPU tests' switch) the static batches
        run eagerly. A capture or a compile that fails leaves every step eager, with the error in the log."""
        pool_tokens = self.kv_pool.num_pages * self.page_size
        max_len = min(self.context_length, pool_tokens) if self.context_length else pool_tokens
        nextn = self.nextn
        self.static = StaticStep(self.model, self.kv_pool, self.state_pool, max_batch, max_len,
                                 1 + nextn.num_steps if nextn else 1, nextn.kv_layer if nextn else None,
                                 for_graphs=for_graphs)
        if build and for_graphs:
            self.capture_graphs()
        elif build:
            self._compile()

    def _compile(self) -> None:
        from tinyserve.compiled import CompiledSteps     # torch.compile's machinery: imported only when used
        try:
            compiled = CompiledSteps(self.static)
            compiled.build()
        except Exception as e:           # noqa: BLE001 - no compiler, an op inductor cannot lower: eager, as before
            log.warning("compiling the CPU steps failed, every step runs eagerly (engine.compile_steps = false skips "
                        "the attempt): %s: %s", type(e).__name__, str(e).strip().splitlines()[0] if str(e) else "")
            self.static = None
            return
        self.static.compiled = compiled

    def capture_graphs(self) -> None:
        """(Re)capture the static path's CUDA graphs (at start; after an idle release of the pools)."""
        if self.static is None or not self.static.for_graphs:
            return
        try:
            self.static.capture()
        except RuntimeError:             # torch reports a failed capture (a host sync, a forbidden call) as one
            log.exception("capturing the CUDA graphs failed: every step runs eagerly "
                          "(engine.compile_steps = false skips the capture)")
            self.static = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def release_graphs(self) -> None:
        """Drop the graphs and their memory pool (idle release: the pools they point into are freed)."""
        if self.static is not None:
            self.static.graphs.clear()

    # ---- the packed batch ----
    def _batch(self, spans: list[tuple[Request, int, int]], input_ids: list[int], state_slots: list[int],
               num_decode: int, image_shift: int = 0) -> tuple[ForwardBatch, dict]:
        """The packed batch of spans (request, first position, tokens) over each request's own pages. A row at
        position p embeds the image feature of the token at p + image_shift where that is an image token (0 for the
        target; 1 for the NEXTN head, which embeds the token after each position)."""
        ps, dev = self.page_size, self.device
        positions: list[int] = []
        slots: list[int] = []
        cu, seq_lens = [0], []
        with_images = self.images is not None and any(req.images is not None for req, _, _ in spans)
        rope: list[torch.Tensor] = []                  # (t, h, w) rows per sequence when images are in the batch
        image_rows: list[int] = []
        image_embeds: list[torch.Tensor] = []
        for req, start, n in spans:
            end = start + n
            if with_images:
                rope.append(rope_rows(req.images, start, end))
                if req.images is not None:             # a chunk takes its slice of each image it covers
                    rows, embeds = self.images.slices(req.images, start + image_shift, end + image_shift, cu[-1])
                    image_rows += rows
                    image_embeds += embeds
            positions += range(start, end)
            slots += [req.pages[p // ps] * ps + p % ps for p in range(start, end)]
            cu.append(cu[-1] + n)
            seq_lens.append(end)
        max_pages = max(len(req.pages) for req, _, _ in spans)
        table = [req.pages + [0] * (max_pages - len(req.pages)) for req, _, _ in spans]
        inputs = {}
        if rope:
            inputs["rope_positions"] = torch.cat(rope, dim=1).to(dev)
        if image_rows:
            inputs["embeds"] = (torch.tensor(image_rows, dtype=torch.long, device=dev), torch.cat(image_embeds).to(dev))
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            cu_seqlens=cu, seq_lens=seq_lens,
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_slots=state_slots,
            state_slots_t=torch.tensor(state_slots, dtype=torch.long, device=dev),
            num_decode=num_decode), inputs

    def build_batch(self, seqs: list[ScheduledSeq]) -> tuple[ForwardBatch, dict]:
        """Pack the step's sequences (plain decodes, then verifies, then prefill chunks, as scheduled)."""
        num_decode = sum(s.is_decode and not s.is_verify for s in seqs)
        num_verify = sum(s.is_verify for s in seqs)
        assert all(s.is_decode and not s.is_verify for s in seqs[:num_decode]) and \
            all(s.is_verify for s in seqs[num_decode:num_decode + num_verify]), "decodes, verifies, then prefills"
        ids: list[int] = []
        for s in seqs:
            req = s.req
            ids += req.all_ids[s.start:s.start + 1] + s.draft if s.is_verify else req.all_ids[s.start:s.start + s.num_tokens]
        batch, inputs = self._batch([(s.req, s.start, s.num_tokens) for s in seqs], ids,
                                    [s.req.state_slot for s in seqs], num_decode)
        first_prefill = num_decode + num_verify
        batch.prefill_snapshots = tuple((i - first_prefill, pos - s.start, slot)
                                        for i, s in enumerate(seqs) for pos, slot in s.snapshots)
        if num_verify:
            vs, cu = seqs[num_decode:num_decode + num_verify], batch.cu_seqlens
            batch.num_extended = num_verify
            batch.extended = verify_layout([c - cu[num_decode] for c in cu[num_decode:num_decode + num_verify + 1]],
                                         batch.seq_lens[num_decode:num_decode + num_verify],
                                         [s.req.state_slot for s in vs], [s.verify_slots for s in vs], self.device)
        return batch, inputs

    def nextn_head(self, spans: list[tuple[Request, int, int]], next_ids: list[int],
                   hidden: torch.Tensor) -> torch.Tensor:
        """The NEXTN head's output rows [sum n, H] over spans (request, first position p, tokens n), embedding the
        tokens at p+1 .. (next_ids, packed in span order; at an image token that image's feature row, as vLLM) with
        the hidden rows at p .. (packed the same way): through the static path (its CUDA graphs) when it fits,
        else eagerly. Leading one-token spans use the decode attention."""
        if self.static is not None and self.static.fits_draft(spans):
            return self.static.run_draft(spans, next_ids, hidden)
        num_decode = next((k for k, (_, _, n) in enumerate(spans) if n != 1), len(spans))
        batch, inputs = self._batch(spans, next_ids, [0] * len(spans), num_decode, image_shift=1)
        return self.model.mtp(*self._head_args(batch, inputs, hidden))

    def _head_args(self, batch: ForwardBatch, inputs: dict, hidden: torch.Tensor) -> tuple:
        m = self.model
        return (m.embed(batch.input_ids, inputs.get("embeds")), hidden, batch,
                PoolLayer(self.kv_pool.buffer, self.nextn.kv_layer), m.cos_sin(batch.positions, inputs.get("rope_positions")))

    def nextn_kv(self, spans: list[tuple[Request, int, int]], next_ids: list[int], hidden: torch.Tensor) -> None:
        """Only the NEXTN head's KV over spans (as nextn_head writes it), where nothing is drafted."""
        if self.static is not None and self.static.fits_draft(spans):
            self.static.run_draft(spans, next_ids, hidden, kv_only=True)
            return
        batch, inputs = self._batch(spans, next_ids, [0] * len(spans), 0, image_shift=1)
        self.model.mtp.write_kv(*self._head_args(batch, inputs, hidden))

    def grammar_masks(self, reqs: list[Request], rows: list[int]) -> tuple[list[int], torch.Tensor] | None:
        """(sampling rows, bitmask) of the requests whose grammar is active this step, filled by llguidance; None
        if none. reqs[i] samples at row rows[i] (a constrained request never verifies drafts: one row)."""
        active = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.active]
        if not active:
            return None
        if self._masks is None:
            self._masks = MaskBuffer(reqs[active[0]].grammar.vocab_size)
        return [rows[i] for i in active], self._masks.fill([reqs[i].grammar for i in active])

    # ---- the step ----
    @torch.inference_mode()
    def forward(self, seqs: list[ScheduledSeq]) -> tuple[ForwardBatch, torch.Tensor, dict]:
        """The step's forward: its batch, the hidden rows and the model inputs of images."""
        if self.static is not None and self.static.fits(seqs):     # decodes and verifies: padded, graphs on CUDA
            batch, hidden = self.static.run(seqs)
            return batch, hidden, {}
        batch, inputs = self.build_batch(seqs)
        return batch, self.model(batch, self.kv_pool, self.state_pool, **inputs), inputs

    @torch.inference_mode()
    def step(self, seqs: list[ScheduledSeq], num_running: int = 1) -> StepResult:
        if not seqs:
            return StepResult([])
        start = time.perf_counter()
        batch, hidden, inputs = self.forward(seqs)
        if any(s.req.needs_prompt_logprobs and not s.is_decode for s in seqs):
            self._prompt_logprobs(seqs, batch, hidden)
        sampled = [i for i, s in enumerate(seqs) if s.samples]
        outputs = self._sample(seqs, sampled, batch, hidden) if sampled else []
        if self.nextn is not None:
            self.nextn.draft(self, seqs, batch.cu_seqlens, hidden, {id(o.seq): o for o in outputs}, num_running)
            if len(seqs) == 1 and seqs[0].is_decode:    # one request decoding: its time prices a draft
                self.nextn.step_cost.observe(len(seqs[0].draft), time.perf_counter() - start)
        if inputs:                                     # a request with images ran
            self.images.let_go(seqs)
        return StepResult(outputs)

    def _prompt_logprobs(self, seqs: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """The prompt tokens' logprobs (params.prompt_logprobs) from the prefill chunks' own rows: row q predicts
        prompt token q + 1, under the raw model distribution (as sampled tokens' logprobs), with its top-n. The rows
        go through the LM head PROMPT_LOGPROB_ROWS at a time, so a long chunk never holds [chunk, V] logits."""
        for i, s in enumerate(seqs):
            req = s.req
            if s.is_decode or not req.needs_prompt_logprobs:
                continue
            done = len(req.prompt_logprobs)                # rows 0 .. done-1 ran in an earlier chunk
            assert done >= s.start, "a request computing its prompt's logprobs resumes from no cached prefix"
            end = min(s.start + s.num_tokens, len(req.prompt_ids) - 1)
            n_top = req.params.prompt_logprobs
            for q in range(done, end, PROMPT_LOGPROB_ROWS):
                q_end = min(q + PROMPT_LOGPROB_ROWS, end)
                row = batch.cu_seqlens[i] + q - s.start
                logp = torch.log_softmax(self.model.compute_logits(hidden[row:row + q_end - q]).float(), dim=-1)
                targets = torch.tensor(req.prompt_ids[q + 1:q_end + 1], device=self.device)
                chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
                if n_top:
                    top_lp, top_ids = top_n(logp, min(n_top, logp.shape[1]))
                    tops = [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lp.tolist())]
                else:
                    tops = [[] for _ in chosen]
                req.prompt_logprobs += zip(chosen, tops)

    def _sample(self, seqs: list[ScheduledSeq], sampled: list[int], batch: ForwardBatch,
                hidden: torch.Tensor) -> list[SeqOutput]:
        """Sample the plain rows and verify the drafts, in one batched pass over all their logits rows."""
        rows: list[int] = []          # hidden rows to take logits of: every verify token, a chunk's last token
        first_row: list[int] = []     # each sampled sequence's first sampling row
        for i in sampled:
            first_row.append(len(rows))
            s = seqs[i]
            rows += range(batch.cu_seqlens[i], batch.cu_seqlens[i + 1]) if s.is_verify else [batch.cu_seqlens[i + 1] - 1]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]).float()
        reqs = [seqs[i].req for i in sampled]
        masks = self.grammar_masks(reqs, first_row)
        if not any(seqs[i].is_verify for i in sampled):
            sb = SamplingBatch.build([r.params for r in reqs], [r.prompt_ids for r in reqs],
                                     [r.output_ids for r in reqs], [r.seed for r in reqs], self.eos_token_ids,
                                     self.vocab_size, self.device, masks)
            r = sample(logits, sb)
            tokens = r.tokens.tolist()
            lps = r.logprobs.tolist() if r.logprobs is not None else [None] * len(tokens)
            top = None
            if r.top_ids is not None:
                top = [list(zip(i, lp)) for i, lp in zip(r.top_ids.tolist(), r.top_logprobs.tolist())]
            return [SeqOutput(seqs[i], [tokens[j]], [lps[j]],
                              [top[j][:seqs[i].req.params.logprobs]] if top and seqs[i].req.params.logprobs else None)
                    for j, i in enumerate(sampled)]
        # one row per verified position: row j of a request sees its outputs plus the drafts before it
        params, prompts, outs, seeds, drafts, qs = [], [], [], [], [], []
        for i in sampled:
            s, req = seqs[i], seqs[i].req
            for j in range(len(s.draft) + 1):
                params.append(req.params)
                prompts.append(req.prompt_ids)
                outs.append(req.output_ids + s.draft[:j])
                seeds.append(req.seed)
            drafts.append(s.draft)
            if s.draft:
                qs.append(req.draft_q if req.draft_q is not None else
                          torch.zeros(len(s.draft), self.vocab_size, device=self.device))
        sb = SamplingBatch.build(params, prompts, outs, seeds, self.eos_token_ids, self.vocab_size, self.device,
                                 masks)
        any_q = any(seqs[i].req.draft_q is not None for i in sampled if seqs[i].is_verify)
        v = verify_drafts(logits, sb, drafts, torch.cat(qs) if any_q else None)
        return [SeqOutput(seqs[i], v.tokens[j], v.logprobs[j], v.top[j] if v.top is not None else None,
                          v.accepted[j]) for j, i in enumerate(sampled)]
