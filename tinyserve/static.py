"""The static-shape steps that CUDA graphs replay: decode, NEXTN verify, and the NEXTN head's passes after them.

A step of N sequences of at most T tokens runs as shape (B, T) over buffers sized for the largest step, B the
smallest graph batch size >= N: nothing inside a forward changes from step to step but the buffers' contents, so on
CUDA one graph per shape (and per forward: the target's, the NEXTN head's) is captured at start and replayed. On the
CPU (tests) the padded batch runs eagerly: the same math.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from types import SimpleNamespace

import torch

from tinyserve.kernels import use_triton
from tinyserve.kernels.verify_layout import VerifyLayout
from tinyserve.kv import KVPool
from tinyserve.models.qwen3_next import ForwardBatch, Qwen3NextForCausalLM
from tinyserve.request import Request
from tinyserve.scheduler import ScheduledSeq
from tinyserve.state import StatePool

log = logging.getLogger("tinyserve.static")


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
        scratch_page, pad_slot = self.kv_pool.scratch_page, self.padding_slot
        ids, positions, slots, out_slots, token_lens = [], [], [], [], []         # per token row
        lens, state_slots, real_rows, cu = [], [], [], [0]                       # per sequence
        for i, (req, start, toks, after) in enumerate(spans):
            n = len(toks)
            for t in range(T):
                p = start + min(t, n - 1)                    # a padding token repeats the last real position
                ids.append(toks[t] if t < n else 0)
                positions.append(p)
                slots.append(req.pages[p // ps] * ps + p % ps if t < n else scratch_page * ps)
                out_slots.append(after[t] if t < n else pad_slot)
                token_lens.append(p + 1)
            lens.append(start + n)
            state_slots.append(req.state_slot)
            real_rows += range(i * T, i * T + n)
            cu.append(cu[-1] + n)
        pad_rows = (B - N) * T
        w = min(self.width, max(len(req.pages) for req, _, _, _ in spans))  # columns to write; later: never read
        table = [p for req, _, _, _ in spans for p in req.pages[:w] + [scratch_page] * (w - len(req.pages[:w]))]
        R = B * T
        # every buffer with its values, padding sequences last: packed into one host tensor, copied once
        layout = [(self.input_ids[:R], ids + [0] * pad_rows),
                  (self.positions[:R], positions + [0] * pad_rows),
                  (self.slot_mapping[:R], slots + [scratch_page * ps] * pad_rows),
                  (self.out_slots[:R], out_slots + [pad_slot] * pad_rows),
                  (self.token_lens[:R], token_lens + [1] * pad_rows),
                  (self.seq_lens[:B], lens + [1] * (B - N)),
                  (self.state_slots[:B], state_slots + [pad_slot] * (B - N)),
                  (self.page_table[:B, :w], table + [scratch_page] * ((B - N) * w))]
        host = torch.tensor([v for _, values in layout for v in values] + real_rows, dtype=torch.long)
        vals = host.to(self.input_ids.device, non_blocking=True)
        at = 0
        for buf, values in layout:
            buf.copy_(vals[at:at + len(values)].view(buf.shape))
            at += len(values)
        return B, T, lens + [1] * (B - N), state_slots + [pad_slot] * (B - N), cu + [cu[-1]] * (B - N), vals[at:]

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
