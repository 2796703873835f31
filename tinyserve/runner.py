"""Owns the model and the pools; turns a scheduled step into one packed forward pass and the tokens it commits.

With NEXTN on (spec.py), a step also verifies the drafts of the speculating requests (their rows go through
sampling.verify_drafts, the other rows through the same math with no drafts) and then drafts the next round: the
NEXTN head runs over the positions this step committed, with the target's hidden states (writing its own KV, so
prefill chunks fill it too and a later cache hit can draft at once), and chains num_steps single-token steps.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from tinyserve.grammar import MaskBuffer
from tinyserve.kv import KVPool
from tinyserve.kernels import use_triton
from tinyserve.kernels.verify_layout import VerifyLayout, verify_layout
from tinyserve.models.qwen3_next import ForwardBatch, Qwen3NextForCausalLM
from tinyserve.multimodal import FeatureCache, PromptImage, rope_rows
from tinyserve.request import Request
from tinyserve.sampling import SamplingBatch, sample
from tinyserve import sampling
from tinyserve.scheduler import ScheduledSeq
from tinyserve.spec import DepthControl, NextNSetup, StepCost
from tinyserve.state import StatePool

log = logging.getLogger("tinyserve.runner")


@dataclass
class SeqOutput:
    """What one sequence of the step produced, before the engine applies stops."""
    seq: ScheduledSeq
    tokens: list[int]                                  # a verify: accepted drafts + bonus; otherwise one token
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None = None   # per token, when the request asks for top logprobs
    accepted: int = 0                                  # drafts accepted (a verify)


@dataclass
class StepResult:
    outputs: list[SeqOutput]           # the sequences that produced tokens this step, in batch order


@dataclass
class _Segment:
    """NEXTN positions pos .. pos+len(next_ids)-1 of one request, fed the target's hidden rows `rows`."""
    req: Request
    rows: list[int]
    pos: int
    next_ids: list[int]
    depth: int = 0                     # drafts to make from its last position (0: only its KV is written)
    outputs: list[int] | None = None   # the request's outputs once this step's tokens are committed


class ModelRunner:
    def __init__(self, model: Qwen3NextForCausalLM, kv_pool: KVPool, state_pool: StatePool,
                 eos_token_ids: list[int], nextn: NextNSetup | None = None, context_length: int = 0) -> None:
        self.model, self.kv_pool, self.state_pool = model, kv_pool, state_pool
        self.device = model.device
        self.page_size = kv_pool.page_size
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.cfg.vocab_size
        self.nextn, self.context_length = nextn, context_length
        self.step_cost = StepCost()                # what a draft costs here, for the draft depth
        self._masks: MaskBuffer | None = None      # grammar bitmasks of the constrained rows (made on first use)
        self.features = FeatureCache()             # vision features by image digest
        self.images_encoded = 0
        self.image_encode_seconds = 0.0
        self.static: StaticStep | None = None      # the static-shape decode / verify path (CUDA graphs); None: eager

    def enable_static_steps(self, max_batch: int, capture: bool) -> None:
        """Run decode and NEXTN verify steps of up to max_batch sequences through StaticStep from now on; with
        capture (CUDA, at engine start) replaying its graphs. Without capture (the CPU tests' switch) the padded
        static batch runs eagerly. A capture that fails leaves every step eager, with the error in the log."""
        max_len = min(self.context_length, self.kv_pool.num_pages * self.page_size) if self.context_length else \
            self.kv_pool.num_pages * self.page_size
        nextn = self.nextn
        self.static = StaticStep(self.model, self.kv_pool, self.state_pool, max_batch, max_len,
                                 1 + nextn.num_steps if nextn else 1, nextn.kv_layer if nextn else None)
        if capture:
            self.capture_graphs()

    def capture_graphs(self) -> None:
        """(Re)capture the static path's CUDA graphs (at start; after an idle release of the pools)."""
        if self.static is None:
            return
        try:
            self.static.capture()
        except RuntimeError:             # torch reports a failed capture (a host sync, a forbidden call) as one
            log.exception("capturing the CUDA graphs failed: every step runs eagerly "
                          "(engine.cuda_graphs = false skips the capture)")
            self.static = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def release_graphs(self) -> None:
        """Drop the graphs and their memory pool (idle release: the pools they point into are freed)."""
        if self.static is not None:
            self.static.graphs.clear()

    # ---- the packed batch ----
    def build_batch(self, seqs: list[ScheduledSeq]) -> ForwardBatch:
        """Pack the step's sequences (plain decodes, then verifies, then prefill chunks, as scheduled)."""
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        num_decode = sum(s.is_decode and not s.is_verify for s in seqs)
        num_verify = sum(s.is_verify for s in seqs)
        assert all(s.is_decode and not s.is_verify for s in seqs[:num_decode]) and \
            all(s.is_verify for s in seqs[num_decode:num_decode + num_verify]), "decodes, verifies, then prefills"
        with_images = any(s.req.images is not None for s in seqs)
        rope: list[torch.Tensor] = []                  # (t, h, w) rows per sequence when images are in the batch
        image_rows: list[int] = []
        image_embeds: list[torch.Tensor] = []
        for s in seqs:
            req, end = s.req, s.start + s.num_tokens
            if with_images:
                rope.append(rope_rows(req.images, s.start, end))
            if req.images is not None:                 # a chunk takes its slice of each image it covers
                self._image_slices(req, s.start, end, len(ids), image_rows, image_embeds)
            ids += req.all_ids[s.start:s.start + 1] + s.draft if s.is_verify else req.all_ids[s.start:end]
            positions += range(s.start, end)
            slots += [req.pages[p // ps] * ps + p % ps for p in range(s.start, end)]
            cu.append(cu[-1] + s.num_tokens)
            seq_lens.append(end)
        max_pages = max(len(s.req.pages) for s in seqs)
        table = [s.req.pages + [0] * (max_pages - len(s.req.pages)) for s in seqs]
        state_slots = [s.req.state_slot for s in seqs]
        dev = self.device
        layout = None
        if num_verify:
            vs = seqs[num_decode:num_decode + num_verify]
            layout = verify_layout([c - cu[num_decode] for c in cu[num_decode:num_decode + num_verify + 1]],
                                   seq_lens[num_decode:num_decode + num_verify], [s.req.state_slot for s in vs],
                                   [s.verify_slots for s in vs], dev)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            cu_seqlens=cu, seq_lens=seq_lens,
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_slots=state_slots,
            state_slots_t=torch.tensor(state_slots, dtype=torch.long, device=dev),
            num_decode=num_decode, num_verify=num_verify, verify=layout,
            mrope_positions=torch.cat(rope, dim=1).to(dev) if with_images else None,
            image_rows=torch.tensor(image_rows, dtype=torch.long, device=dev) if image_rows else None,
            image_embeds=torch.cat(image_embeds).to(dev) if image_embeds else None)

    def _image_slices(self, req: Request, start: int, end: int, offset: int, rows: list[int],
                      embeds: list[torch.Tensor]) -> None:
        """The image tokens among sequence indices [start, end) of req, packed from row `offset`: their rows and
        feature slices (the request holds an image's features until the step that computes its last token)."""
        for item in req.images.overlapping(start, end):
            lo, hi = max(item.span.start, start), min(item.span.end, end)
            rows += range(offset + lo - start, offset + hi - start)
            embeds.append(self._features(item)[lo - item.span.start:hi - item.span.start])

    def encode_images(self, seqs: list[ScheduledSeq]) -> dict[Request, Exception]:
        """Before a step: the features of every image its prefill chunks (and the NEXTN head, one token further)
        will read, so that an image the tower cannot encode (out of memory, a malformed input) fails its own
        request and not the step. Returns the failed requests with their errors."""
        failed: dict[Request, Exception] = {}
        for s in seqs:
            req = s.req
            if req.images is None or s.is_decode:
                continue
            for item in req.images.overlapping(s.start, s.start + s.num_tokens + 1):
                try:
                    self._features(item)
                except (RuntimeError, ValueError) as e:   # torch.OutOfMemoryError is a RuntimeError
                    failed[req] = e
                    item.features = None
                    break
        if failed and self.device.type == "cuda":
            torch.cuda.empty_cache()
        return failed

    @staticmethod
    def _let_go_of_features(seqs: list[ScheduledSeq]) -> None:
        """After a step (the target's rows and the NEXTN head's, which embeds the token after each row): the
        features of images whose last token is computed are not needed again (a recompute after preemption takes
        them from the feature cache or encodes again)."""
        for s in seqs:
            if s.req.images is not None:
                for item in s.req.images.items:
                    if item.span.end <= s.start + s.num_tokens:
                        item.features = None

    def _features(self, item: PromptImage) -> torch.Tensor:
        """The vision features of a whole image on the model's device: held by the request, else from the feature
        cache (kept on the host), else encoded (the tower attends over the whole image, so a chunk never encodes
        only its part)."""
        if item.features is not None:
            return item.features
        host = item.encoded if item.encoded is not None else self.features.get(item.image.digest)
        if host is None:
            start = time.perf_counter()
            item.features = self.model.encode_images(item.image.pixel_values, [item.image.grid_thw])
            self.image_encode_seconds += time.perf_counter() - start
            self.images_encoded += 1
            host = item.features.cpu()
            self.features.put(item.image.digest, host)
        else:
            item.features = host.to(self.device)
        if item.encoded is None:                       # the request needs its pixels no more
            item.encoded = host
            item.image = dataclasses.replace(item.image, pixel_values=None)
        return item.features

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
    def step(self, seqs: list[ScheduledSeq], num_running: int = 1) -> StepResult:
        if not seqs:
            return StepResult([])
        start = time.perf_counter()
        if self.static is not None and self.static.fits(seqs):     # decodes and verifies: padded, graphs on CUDA
            batch, hidden = self.static.run(seqs)
        else:
            batch = self.build_batch(seqs)
            hidden = self.model(batch, self.kv_pool, self.state_pool)
        sampled = [i for i, s in enumerate(seqs) if s.samples]
        outputs = self._sample(seqs, sampled, batch, hidden) if sampled else []
        if self.nextn is not None:
            self._draft(seqs, batch, hidden, {id(o.seq): o for o in outputs}, num_running)
            if len(seqs) == 1 and seqs[0].is_decode:    # one request decoding: its time prices a draft
                self.step_cost.observe(len(seqs[0].draft), time.perf_counter() - start)
        if batch.mrope_positions is not None:          # a request with images ran
            self._let_go_of_features(seqs)
        return StepResult(outputs)

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
            tokens, lps = r.tokens.tolist(), r.logprobs.tolist()
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
        v = sampling.verify_drafts(logits, sb, drafts, torch.cat(qs) if any_q else None)
        return [SeqOutput(seqs[i], v.tokens[j], v.logprobs[j], v.top[j] if v.top is not None else None,
                          v.accepted[j]) for j, i in enumerate(sampled)]

    # ---- NEXTN drafting ----
    def _speculates(self, req: Request) -> bool:
        return req.params.speculative and req.params.constraint is None

    def _depth(self, req: Request, outputs: list[int], next_pos: int) -> int:
        """How many drafts req makes for its next round: its DepthControl's choice, cut to what max_tokens, the
        context and its pages leave room for. next_pos: its first position not computed yet."""
        if outputs[-1] in self.eos_token_ids or outputs[-1] in req.params.stop_token_ids:
            return 0                                   # it is about to finish
        if req.depth is None:
            req.depth = DepthControl(self.nextn.num_steps)
        depth = req.depth.next_depth(self.step_cost)
        room_pages = len(req.pages) * self.page_size - next_pos + 1     # draft step j writes KV at next_pos + j-2
        return max(0, min(depth, req.params.max_tokens - len(outputs) - 1,
                          self.context_length - next_pos - 1, room_pages))

    def _draft(self, seqs: list[ScheduledSeq], batch: ForwardBatch, hidden: torch.Tensor,
               outputs: dict[int, SeqOutput], num_running: int) -> None:
        allowed = self.nextn.allows(num_running)
        segments: list[_Segment] = []
        for i, s in enumerate(seqs):
            req = s.req
            req.draft, req.draft_q = [], None
            if not self._speculates(req):
                continue
            start = batch.cu_seqlens[i]
            if not s.samples:                          # a prefill chunk that is not the last: KV only
                end = s.start + s.num_tokens
                segments.append(_Segment(req, list(range(start, batch.cu_seqlens[i + 1])), s.start,
                                         req.all_ids[s.start + 1:end + 1]))
                continue
            toks = outputs[id(s)].tokens
            after = req.output_ids + toks
            if s.is_decode:                            # the last accepted token, then the accepted drafts
                n_in = len(toks)
                seg = _Segment(req, list(range(start, start + n_in)), s.start, toks, outputs=after)
            else:                                      # the prompt's (or a recompute's) last chunk
                end = s.start + s.num_tokens
                seg = _Segment(req, list(range(start, batch.cu_seqlens[i + 1])), s.start,
                               req.all_ids[s.start + 1:end] + toks, outputs=after)
            next_pos = seg.pos + len(seg.rows)
            seg.depth = self._depth(req, after, next_pos) if allowed else 0
            if s.is_decode and seg.depth == 0:
                continue                               # decoding plainly: no NEXTN work (its KV there stays stale)
            segments.append(seg)
        if not segments:
            return
        segments.sort(key=lambda g: len(g.rows) != 1)   # one-row segments first: they use the decode attention
        g = self._head([(seg.req, seg.pos, len(seg.rows)) for seg in segments],
                       [t for seg in segments for t in seg.next_ids],
                       hidden[torch.tensor([r for seg in segments for r in seg.rows], device=self.device)])
        ends = torch.tensor(list(_cumsum(len(seg.rows) for seg in segments)), device=self.device) - 1
        drafting = [k for k, seg in enumerate(segments) if seg.depth > 0]
        if not drafting:
            return
        live = [segments[k] for k in drafting]
        h = g[ends[torch.tensor(drafting, device=self.device)]]
        qs: dict[int, list[torch.Tensor]] = {id(seg.req): [] for seg in live}
        for step in range(max(seg.depth for seg in live)):
            if step:                                   # a chain step: the last draft and the head's own hidden
                h = self._head([(seg.req, seg.pos + len(seg.rows) + step - 1, 1) for seg in live],
                               [seg.req.draft[-1] for seg in live], h)
            reqs = [seg.req for seg in live]
            sb = SamplingBatch.build([r.params for r in reqs], [r.prompt_ids for r in reqs],
                                     [seg.outputs + seg.req.draft for seg in live], [r.seed for r in reqs],
                                     self.eos_token_ids, self.vocab_size, self.device)
            tokens, q = sampling.draw_drafts(self.model.compute_logits(h).float(), sb)
            for j, (seg, t) in enumerate(zip(live, tokens.tolist())):
                seg.req.draft.append(t)
                if q is not None and not seg.req.params.is_greedy:
                    qs[id(seg.req)].append(q[j])
            keep = [j for j, seg in enumerate(live) if seg.depth > step + 1]
            live = [live[j] for j in keep]
            if not live:
                break
            h = h[torch.tensor(keep, device=self.device)]
        for seg in segments:
            rows = qs.get(id(seg.req))
            if rows:
                seg.req.draft_q = torch.stack(rows)

    def _head(self, spans: list[tuple[Request, int, int]], next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """The NEXTN head's output rows [sum n, H] over spans (request, first position p, tokens n), embedding the
        tokens at p+1 .. (next_ids, packed in span order) with the hidden rows at p .. (packed the same way):
        through the static path (its CUDA graphs) when it fits, else eagerly."""
        if self.static is not None and self.static.fits_draft(spans):
            return self.static.run_draft(spans, next_ids, hidden)
        batch = self._mtp_batch(spans)
        image_rows: list[int] = []                     # the head takes the embedding of the token at p + 1:
        image_embeds: list[torch.Tensor] = []          # at an image token, that image's feature row (as vLLM)
        offset = 0
        for req, pos, n in spans:
            if req.images is not None:
                self._image_slices(req, pos + 1, pos + 1 + n, offset, image_rows, image_embeds)
            offset += n
        if image_rows:
            batch.image_rows = torch.tensor(image_rows, dtype=torch.long, device=self.device)
            batch.image_embeds = torch.cat(image_embeds).to(self.device)
        return self.model.mtp_hidden(torch.tensor(next_ids, device=self.device), hidden, batch, self.kv_pool,
                                     self.nextn.kv_layer)

    def _mtp_batch(self, spans: list[tuple[Request, int, int]]) -> ForwardBatch:
        """A ForwardBatch for the NEXTN layer: request r computes positions pos .. pos+n-1 over its own pages
        (leading one-token spans use the decode attention)."""
        ps, dev = self.page_size, self.device
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]
        rope = [rope_rows(req.images, pos, pos + n) for req, pos, n in spans] \
            if any(req.images is not None for req, _, _ in spans) else None   # the same M-RoPE as the target's
        for req, pos, n in spans:
            positions += range(pos, pos + n)
            slots += [req.pages[p // ps] * ps + p % ps for p in range(pos, pos + n)]
            cu.append(cu[-1] + n)
        seq_lens = [pos + n for _, pos, n in spans]
        num_decode = next((k for k, (_, _, n) in enumerate(spans) if n != 1), len(spans))
        max_pages = max(len(req.pages) for req, _, _ in spans)
        table = [req.pages + [0] * (max_pages - len(req.pages)) for req, _, _ in spans]
        none = torch.zeros(len(spans), dtype=torch.long, device=dev)
        return ForwardBatch(
            input_ids=torch.zeros(len(positions), dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            cu_seqlens=cu, seq_lens=seq_lens,
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            state_slots=[0] * len(spans), state_slots_t=none, num_decode=num_decode,
            mrope_positions=torch.cat(rope, dim=1).to(dev) if rope is not None else None)


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


# ---------------------------------------------------------------------------------------------------------------
# The static-shape decode and verify steps and their CUDA graphs

def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then every 16 (nano-vllm's and mini-sglang's choice), and
    max_batch itself; a step of N sequences runs as the smallest of them >= N."""
    return [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]


class StaticStep:
    """The steps that CUDA graphs replay, run with static shapes: a decode step (every sequence one new token), a
    NEXTN verify step (the last accepted token plus the drafts, plain decodes among them), and the NEXTN head's
    passes after them (over the tokens a step committed, then one token per draft). No prefill chunk, no image.

    Every tensor a forward reads lives in a buffer sized for the largest step: token ids, positions, KV slots,
    verify state slots, lengths and (for the NEXTN head) input hidden rows per token; context lengths, state slots
    and the page table (whole-context rows) per sequence. N sequences of at most T tokens run as shape (B, T): B the
    smallest of `sizes` >= N, T in 1 .. max_tokens (1 + the NEXTN draft steps).
      - T = 1: a decode batch of B rows.
      - T > 1: B verifies of T tokens each. A shorter sequence's tokens past its end are padding (token 0 at its
        last real position, KV to the scratch page, the state after it to `padding_slot`); a plain decode among
        them is a verify of one real token, whose state goes to its own slot as a verify's first token's does.
    Sequences N..B-1 are padding: token 0 at position 0 of a one-token context on the KV pool's scratch page, state
    from `padding_slot` (the page is never handed out), so every kernel computes them as any row and nothing reads
    what they produce. `padding_slot` is -1 with the Triton kernels, which read a zero state for it and store none
    (a padding token would otherwise write a whole fp32 state per GDN layer), and the state pool's scratch slot
    (never handed out) with the torch references, which index it. The attention's split count comes from
    `max_len` (the context, at most the pool), not from this step's lengths. So nothing inside a forward changes
    from step to step but the buffers' contents: on CUDA one graph per shape (and per forward: the target's, the
    NEXTN head's) is captured at start (`capture`) and replayed; on the CPU (tests) the padded batch runs eagerly,
    the same math. The logits and the sampling run outside, as for an eager step, on the real rows."""

    def __init__(self, model: Qwen3NextForCausalLM, kv_pool: KVPool, state_pool: StatePool, max_batch: int,
                 max_len: int, max_tokens: int = 1, nextn_kv_layer: int | None = None) -> None:
        self.model, self.kv_pool, self.state_pool = model, kv_pool, state_pool
        self.padding_slot = -1 if use_triton(state_pool.ssm_all) else state_pool.scratch_slot
        self.sizes = graph_batch_sizes(max_batch)
        self.max_len, self.max_tokens, self.nextn_kv_layer = max_len, max_tokens, nextn_kv_layer
        self.shapes = [(B, T) for T in range(1, max_tokens + 1) for B in self.sizes]
        self.width = -(-max_len // kv_pool.page_size)          # page-table columns: a whole context
        B, R, dev = self.sizes[-1], self.sizes[-1] * max_tokens, model.device
        self.input_ids = torch.zeros(R, dtype=torch.long, device=dev)           # per token row
        self.positions = torch.zeros(R, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(R, dtype=torch.long, device=dev)
        self.out_slots = torch.zeros(R, dtype=torch.long, device=dev)
        self.token_lens = torch.ones(R, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)            # per sequence
        self.state_slots = torch.zeros(B, dtype=torch.long, device=dev)
        self.page_table = torch.zeros((B, self.width), dtype=torch.int32, device=dev)
        H = model.cfg.hidden_size
        self.hidden = torch.zeros((R, H), dtype=model.dtype, device=dev)       # the target's output rows
        if nextn_kv_layer is not None:                                          # the NEXTN head's input and output
            self.draft_in = torch.zeros((R, H), dtype=model.dtype, device=dev)
            self.draft_out = torch.zeros((R, H), dtype=model.dtype, device=dev)
        self.layouts = {(b, t): VerifyLayout(                                   # constant per verify shape
            rows=torch.arange(b * t, device=dev).view(b, t), valid=None, in_slots=self.state_slots[:b],
            out_slots=self.out_slots[:b * t], token_seq=torch.arange(b, device=dev).repeat_interleave(t),
            token_lens=self.token_lens[:b * t]) for b, t in self.shapes if t > 1}
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}    # ("step" | "draft", B, T)
        self._captured_on: tuple[int, ...] | None = None      # the pools' addresses the graphs were captured on
        self._pad()

    def _pad(self) -> None:
        """Every row padding (before a capture, whose warm-up runs for real: on the scratch page and padding_slot
        only)."""
        scratch_page, pad_slot = self.kv_pool.scratch_page, self.padding_slot
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(scratch_page * self.kv_pool.page_size)
        self.out_slots.fill_(pad_slot)
        self.token_lens.fill_(1)
        self.seq_lens.fill_(1)
        self.state_slots.fill_(pad_slot)
        self.page_table.fill_(scratch_page)
        if self.nextn_kv_layer is not None:
            self.draft_in.zero_()

    def fits(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether a target step runs here: decodes and verifies only."""
        return len(seqs) <= self.sizes[-1] and all(
            s.is_decode and s.num_tokens <= self.max_tokens and s.req.images is None
            and s.start + s.num_tokens <= self.max_len for s in seqs)

    def fits_draft(self, spans: list[tuple[Request, int, int]]) -> bool:
        """Whether a NEXTN head pass over (request, first position, tokens) spans runs here."""
        return self.nextn_kv_layer is not None and len(spans) <= self.sizes[-1] and all(
            n <= self.max_tokens and req.images is None and pos + n <= self.max_len for req, pos, n in spans)

    def _pools(self) -> tuple[KVPool, SimpleNamespace]:
        """The pools as the forward takes them, the state pool with its scratch slot (StatePool.conv_all)."""
        return self.kv_pool, SimpleNamespace(conv=self.state_pool.conv_all, ssm=self.state_pool.ssm_all)

    def _pool_addresses(self) -> tuple[int, ...]:
        return (self.kv_pool.buffer.data_ptr(), self.state_pool.conv_all.data_ptr(),
                self.state_pool.ssm_all.data_ptr())

    def _batch(self, B: int, T: int, seq_lens: list[int], state_slots: list[int]) -> ForwardBatch:
        """The forward's batch of shape (B, T) over the buffers (host lists: what the forward reads as shapes)."""
        return ForwardBatch(
            input_ids=self.input_ids[:B * T], positions=self.positions[:B * T],
            cu_seqlens=list(range(0, B * T + 1, T)), seq_lens=seq_lens, seq_lens_t=self.seq_lens[:B],
            page_table=self.page_table[:B], slot_mapping=self.slot_mapping[:B * T], state_slots=state_slots,
            state_slots_t=self.state_slots[:B], num_decode=B if T == 1 else 0, num_verify=0 if T == 1 else B,
            verify=self.layouts.get((B, T)), decode_max_len=self.max_len)

    def _fill(self, spans: list[tuple[Request, int, list[int], list[int]]]
              ) -> tuple[int, int, list[int], list[int], list[int], torch.Tensor]:
        """Fill the buffers from (request, first position, token ids, state slot after each token) per sequence,
        padded to a shape. Returns (B, T, context lengths, state slots, cu_seqlens of the real tokens, the real
        tokens' rows on the device)."""
        N, ps = len(spans), self.kv_pool.page_size
        T = max(len(ids) for _, _, ids, _ in spans)
        B = next(b for b in self.sizes if b >= N)
        scratch_kv, pad_slot = self.kv_pool.scratch_page * ps, self.padding_slot
        ids, positions, slots, out_slots, token_lens = [], [], [], [], []         # per token row
        lens, state_slots, real_rows, cu = [], [], [], [0]                       # per sequence
        for i, (req, start, toks, after) in enumerate(spans):
            n = len(toks)
            for t in range(T):
                p = start + min(t, n - 1)                    # a padding token repeats the last real position
                ids.append(toks[t] if t < n else 0)
                positions.append(p)
                slots.append(req.pages[p // ps] * ps + p % ps if t < n else scratch_kv)
                out_slots.append(after[t] if t < n else pad_slot)
                token_lens.append(p + 1)
            lens.append(start + n)
            state_slots.append(req.state_slot)
            real_rows += range(i * T, i * T + n)
            cu.append(cu[-1] + n)
        pad = B - N
        lens += [1] * pad
        state_slots += [pad_slot] * pad
        w = min(self.width, max(len(req.pages) for req, _, _, _ in spans))  # columns to write; later: never read
        table: list[int] = []
        for req, _, _, _ in spans:
            row = req.pages[:w]
            table += row
            table += [self.kv_pool.scratch_page] * (w - len(row))
        R, padded = B * T, pad * T
        host = torch.tensor(ids + [0] * padded + positions + [0] * padded + slots + [scratch_kv] * padded
                            + out_slots + [pad_slot] * padded + token_lens + [1] * padded
                            + lens + state_slots + table + [self.kv_pool.scratch_page] * (pad * w)
                            + real_rows, dtype=torch.long)
        vals = host.to(self.input_ids.device, non_blocking=True)   # one host -> device copy
        for k, buf in enumerate((self.input_ids, self.positions, self.slot_mapping, self.out_slots, self.token_lens)):
            buf[:R].copy_(vals[k * R:(k + 1) * R])
        at = 5 * R
        self.seq_lens[:B].copy_(vals[at:at + B])
        self.state_slots[:B].copy_(vals[at + B:at + 2 * B])
        at += 2 * B
        self.page_table[:B, :w].copy_(vals[at:at + B * w].view(B, w))
        return B, T, lens, state_slots, cu + [cu[-1]] * pad, vals[at + B * w:]

    def run(self, seqs: list[ScheduledSeq]) -> tuple[ForwardBatch, torch.Tensor]:
        """A target step: fill the buffers from the step's sequences and run the forward, the graph of its shape
        when captured, else eagerly. Returns the batch and the hidden states of the real tokens, packed as an
        eager step's (sequence i's at cu_seqlens[i]:cu_seqlens[i+1]; with T = 1 the padding rows follow, in a view
        of `hidden`: read before the next step)."""
        spans = []
        for s in seqs:
            req, n_prompt = s.req, len(s.req.prompt_ids)
            first = req.prompt_ids[s.start] if s.start < n_prompt else req.output_ids[s.start - n_prompt]
            spans.append((req, s.start, [first] + s.draft, s.verify_slots if s.is_verify else [req.state_slot]))
        B, T, lens, state_slots, cu, real_rows = self._fill(spans)
        batch = self._batch(B, T, lens, state_slots)
        hidden = self._replay(("step", B, T), lambda: self.model(batch, *self._pools()), self.hidden)
        if T == 1:
            return batch, hidden
        return dataclasses.replace(batch, cu_seqlens=cu), hidden[real_rows]   # a copy: safe from the next replay

    def run_draft(self, spans: list[tuple[Request, int, int]], next_ids: list[int],
                  hidden: torch.Tensor) -> torch.Tensor:
        """A NEXTN head pass (fits_draft): request r computes positions pos .. pos+n-1, embedding next_ids (packed
        in span order) with the hidden rows `hidden` [sum n, H] (the target's, or the head's own for a chain
        step). Returns the head's output rows packed the same way (a view of `draft_out` for one token per
        sequence: read before the next pass)."""
        pad_slot, k = self.padding_slot, 0
        filled = []
        for req, pos, n in spans:
            filled.append((req, pos, next_ids[k:k + n], [pad_slot] * n))
            k += n
        B, T, lens, state_slots, _, real_rows = self._fill(filled)
        R = B * T
        self.draft_in.index_copy_(0, real_rows, hidden)   # padding rows keep earlier rows: finite, never read
        batch = self._batch(B, T, lens, state_slots)
        out = self._replay(("draft", B, T), lambda: self.model.mtp_hidden(
            self.input_ids[:R], self.draft_in[:R], batch, self.kv_pool, self.nextn_kv_layer), self.draft_out)
        return out[:len(spans)] if T == 1 else out[real_rows]

    def _replay(self, key: tuple[str, int, int], forward, out: torch.Tensor) -> torch.Tensor:
        """The graph of `key` when captured on the pools as they are (its output in `out`), else `forward()`."""
        graph = self.graphs.get(key)
        if graph is not None:
            if self._pool_addresses() == self._captured_on:
                graph.replay()
                return out[:key[1] * key[2]]
            log.warning("the KV / state pools moved since the CUDA graphs were captured: dropping the graphs")
            self.graphs.clear()
        return forward()

    @torch.inference_mode()
    def capture(self) -> None:
        """One CUDA graph per shape and forward, the most rows first, all in one memory pool (a smaller graph
        reuses the largest's memory: only one replays at a time). Each runs once eagerly first, outside the capture
        but on its stream, so the Triton kernels are compiled and anything made lazily per stream (cuBLAS
        workspaces) is made before it. Every row is padding meanwhile, so the warm-ups touch only the scratch page
        and padding_slot."""
        start, before = time.perf_counter(), torch.cuda.memory_reserved()
        self.graphs.clear()
        self._pad()
        torch.cuda.synchronize()
        kinds = ["step"] + (["draft"] if self.nextn_kv_layer is not None else [])
        pool, stream = None, torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for B, T in sorted(self.shapes, key=lambda bt: (-bt[0] * bt[1], -bt[1])):
                batch = self._batch(B, T, [1] * B, [self.padding_slot] * B)
                R = B * T
                for kind in kinds:
                    if kind == "step":
                        def forward():
                            self.hidden[:R].copy_(self.model(batch, *self._pools()))
                    else:
                        def forward():
                            self.draft_out[:R].copy_(self.model.mtp_hidden(
                                self.input_ids[:R], self.draft_in[:R], batch, self.kv_pool, self.nextn_kv_layer))
                    forward()                                                     # warm-up
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                        forward()
                    if pool is None:
                        pool = graph.pool()
                    self.graphs[kind, B, T] = graph
        torch.cuda.synchronize()
        self._captured_on = self._pool_addresses()
        log.info("captured %d CUDA graphs (%s; batch sizes %s; tokens per sequence 1..%d) in %.1f s (%.0f MiB more "
                 "reserved)", len(self.graphs), " and ".join(kinds), ", ".join(map(str, self.sizes)),
                 self.max_tokens, time.perf_counter() - start, (torch.cuda.memory_reserved() - before) / 2 ** 20)
