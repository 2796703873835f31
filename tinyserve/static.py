"""The static-shape steps: decode, NEXTN verify, and the NEXTN head's passes after them.

A step of N sequences of at most T tokens runs as shape (B, T) over buffers sized for the largest step: nothing
inside a forward changes from step to step but the buffers' contents and, on the CPU, the batch size and the page
table's width. Two ways to make that fast:
  - CUDA (engine.compile_steps): B is the smallest graph batch size >= N, the page table spans the whole context, and
    one graph per shape (and per forward: the target's, the NEXTN head's) is captured at start and replayed;
  - CPU (engine.compile_steps): B = N, the page table spans the step's pages, and the forwards are compiled once by
    torch.compile (compiled.py) for every batch size and context length.
Without either (the CPU tests) the same batches run eagerly: the same math.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import torch

from tinyserve.kernels import use_triton
from tinyserve.kernels.pool_layer import PoolLayer
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


class ShapeBatch(ForwardBatch):
    """A static step's batch as its forward sees it: B sequences of T tokens each, every one a decode (T = 1) or a
    verify (T > 1), described by tensors alone. No host list: the number of sequences and where the prefill rows
    would begin come from the shapes, so torch.compile traces one graph for every batch size."""

    @property
    def num_seqs(self) -> int:
        return self.page_table.shape[0]

    @property
    def prefill_start(self) -> int:
        return self.input_ids.shape[0]

    @property
    def has_prefill(self) -> bool:
        return False


class StepTensors(NamedTuple):
    """What a static forward reads, per token row (B * T) or per sequence (B), views of StaticStep's buffers."""
    input_ids: torch.Tensor        # [B*T] int64
    positions: torch.Tensor        # [B*T] int64
    slot_mapping: torch.Tensor     # [B*T] int64
    seq_lens: torch.Tensor         # [B] int32: context length after the step
    page_table: torch.Tensor       # [B, W] int32
    state_slots: torch.Tensor      # [B] int64: the state each sequence starts from
    out_slots: torch.Tensor        # [B*T] int64: where the state after each token goes (a verify)
    token_lens: torch.Tensor       # [B*T] int32: the keys each token sees (a verify)


def shape_batch(T: int, max_len: int, t: StepTensors) -> ShapeBatch:
    """The batch of B = page_table.shape[0] sequences of T tokens (token rows i*T .. i*T+T-1 are sequence i's);
    max_len bounds the decode attention's context."""
    B = t.page_table.shape[0]
    verify = None
    if T > 1:
        rows = torch.arange(B * T, device=t.input_ids.device)
        verify = VerifyLayout(rows=rows.view(B, T), valid=None, in_slots=t.state_slots, out_slots=t.out_slots,
                              token_seq=rows // T, token_lens=t.token_lens)
    return ShapeBatch(input_ids=t.input_ids, positions=t.positions, cu_seqlens=[], seq_lens=[],
                      seq_lens_t=t.seq_lens, page_table=t.page_table, slot_mapping=t.slot_mapping, state_slots=[],
                      state_slots_t=t.state_slots, num_decode=B if T == 1 else 0, num_extended=0 if T == 1 else B,
                      extended=verify, decode_max_len=max_len)


class StepPools(NamedTuple):
    """The KV and state pools as the forward takes them (kv_pool.buffer, state_pool.conv / .ssm), the state pool
    with its scratch slot (StatePool.conv_all)."""
    buffer: torch.Tensor
    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


def target_forward(model: Qwen3NextForCausalLM, T: int, max_len: int | None, kv: torch.Tensor, conv: torch.Tensor,
                   ssm: torch.Tensor, t: StepTensors) -> torch.Tensor:
    """A static target step: the final hidden rows [B * T, H]. kv: the whole KV pool [pages, layers, 2, page_size,
    ...]; max_len None: the page table's width in tokens."""
    pools = StepPools(kv, conv, ssm)
    return model(shape_batch(T, max_len or t.page_table.shape[1] * kv.shape[3], t), pools, pools)


def draft_forward(model: Qwen3NextForCausalLM, T: int, max_len: int | None, kv_layer: int, kv: torch.Tensor,
                  hidden: torch.Tensor, t: StepTensors) -> torch.Tensor:
    """A static NEXTN head pass: token row r embeds input_ids[r] with the hidden row hidden[r] ([B * T, H])."""
    batch = shape_batch(T, max_len or t.page_table.shape[1] * kv.shape[3], t)
    return model.mtp(model.embed(t.input_ids), hidden, batch, PoolLayer(kv, kv_layer), model.cos_sin(t.positions))


def head_kv_forward(model: Qwen3NextForCausalLM, T: int, max_len: int | None, kv_layer: int, kv: torch.Tensor,
                    hidden: torch.Tensor, t: StepTensors) -> None:
    """A static pass of the NEXTN head's KV alone (positions nothing is drafted from), fed as draft_forward."""
    batch = shape_batch(T, max_len or t.page_table.shape[1] * kv.shape[3], t)
    model.mtp.write_kv(model.embed(t.input_ids), hidden, batch, PoolLayer(kv, kv_layer), model.cos_sin(t.positions))


FORWARDS = {"step": target_forward, "draft": draft_forward, "head_kv": head_kv_forward}   # by kind


class StaticStep:
    """The static-shape steps: a decode step (every sequence one new token), a NEXTN verify step (the last accepted
    token plus the drafts, plain decodes among them), and the NEXTN head's passes after them (over the tokens a
    step committed, then one token per draft; its KV alone where nothing is drafted). No prefill chunk, no image.

    Every tensor a forward reads lives in a buffer sized for the largest step (StepTensors): token ids, positions,
    KV slots, verify state slots, lengths and (for the NEXTN head) input hidden rows per token; context lengths,
    state slots and the page table (whole-context rows) per sequence. N sequences of at most T tokens run as shape
    (B, T): B the smallest of `sizes` >= N, T in 1 .. max_tokens (1 + the NEXTN draft steps).
      - T = 1: a decode batch of B rows.
      - T > 1: B verifies of T tokens each. A shorter sequence's tokens past its end are padding (token 0 at its
        last real position, KV to the scratch page, the state after it to `padding_slot`); a plain decode among
        them is a verify of one real token, whose state goes to its own slot as a verify's first token's does.
    Sequences N..B-1 (CUDA graphs' padding) are padding: token 0 at position 0 of a one-token context on the KV
    pool's scratch page, state from `padding_slot` (the page is never handed out), so every kernel computes them
    as any row and nothing reads what they produce. `padding_slot` is -1 with the Triton kernels, which read a zero
    state for it and store none (a padding token would otherwise write a whole fp32 state per GDN layer), and the
    state pool's scratch slot (never handed out) with the torch references, which index it.

    for_graphs (CUDA graphs): B from graph_batch_sizes, and the page table and the attention's split count span
    the whole context (`max_len`, at most the pool), not this step's, so nothing inside a forward changes from step
    to step but the buffers' contents: one graph per shape (and per forward) is captured at start (`capture`) and
    replayed. Otherwise (the CPU): B = N, and the page table spans the step's pages (at least 2, so torch.compile
    sees a width it keeps dynamic): the forwards run as compiled at start (`compiled`, compiled.CompiledSteps), or
    eagerly. The logits and the sampling run outside, as for an eager step, on the real rows."""

    def __init__(self, model: Qwen3NextForCausalLM, kv_pool: KVPool, state_pool: StatePool, max_batch: int,
                 max_len: int, max_tokens: int = 1, nextn_kv_layer: int | None = None,
                 for_graphs: bool = True) -> None:
        self.model, self.kv_pool, self.state_pool = model, kv_pool, state_pool
        self.padding_slot = -1 if use_triton(state_pool.ssm_all) else state_pool.scratch_slot
        self.for_graphs = for_graphs
        self.sizes = graph_batch_sizes(max_batch) if for_graphs else list(range(1, max_batch + 1))
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
        self.graphs: dict[tuple[str, int, int], torch.cuda.CUDAGraph] = {}    # (kind, B, T): kinds()
        self._captured_on: tuple[int, ...] | None = None      # the pools' addresses the graphs were captured on
        self.compiled = None                                  # compiled.CompiledSteps (the CPU), once built
        self._pad()

    def _pad(self) -> None:
        """Every row padding (before a capture or a compile, whose warm-ups run for real: on the scratch page and
        padding_slot only)."""
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

    def pools(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The KV pool and the state pools with their scratch slot (StatePool.conv_all), as the forwards take them."""
        return self.kv_pool.buffer, self.state_pool.conv_all, self.state_pool.ssm_all

    def _pool_addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.pools())

    def tensors(self, B: int, T: int, W: int) -> StepTensors:
        """The buffers as the forward of shape (B, T) with a page table W pages wide reads them."""
        R = B * T
        return StepTensors(self.input_ids[:R], self.positions[:R], self.slot_mapping[:R], self.seq_lens[:B],
                           self.table(B, W), self.state_slots[:B], self.out_slots[:R], self.token_lens[:R])

    def table(self, B: int, W: int) -> torch.Tensor:
        """The page table of B sequences, W columns: rows of the whole-context table for a graph; on the CPU a
        contiguous [B, W] block (a compiled graph keeps its strides: one layout for every width)."""
        return self.page_table[:B, :W] if self.for_graphs else self.page_table.view(-1)[:B * W].view(B, W)

    def table_width(self, pages: int) -> int:
        """The page-table columns a step whose longest sequence holds `pages` pages reads: the whole context for
        a graph; on the CPU its own, but at least 2 (torch.compile keeps a width of 1 apart, as a constant)."""
        return self.width if self.for_graphs else min(self.width, max(pages, 2))

    def kinds(self) -> list[str]:
        """The forwards this step has: the target's ("step"); with NEXTN the head's ("draft") and its KV alone
        ("head_kv")."""
        return list(FORWARDS) if self.nextn_kv_layer is not None else ["step"]

    def output(self, kind: str) -> torch.Tensor | None:
        """The buffer a captured forward of this kind writes its rows to (the head's KV pass: none)."""
        return {"step": self.hidden, "draft": self.draft_out}.get(kind)

    def forward(self, kind: str, B: int, T: int, W: int) -> torch.Tensor | None:
        """A forward of shape (B, T) over the filled buffers: its graph when captured, its compiled code when
        compiled, else eagerly. Returns the [B * T, H] rows (a view of `output(kind)` for a graph: read before the
        next replay); the head's KV pass returns None."""
        graph = self.graphs.get((kind, B, T))
        if graph is not None:
            if self._pool_addresses() == self._captured_on:
                graph.replay()
                out = self.output(kind)
                return None if out is None else out[:B * T]
            log.warning("the KV / state pools moved since the CUDA graphs were captured: dropping the graphs")
            self.graphs.clear()
        max_len = self.max_len if self.for_graphs else None
        t = self.tensors(B, T, W)
        if self.compiled is not None:
            return self.compiled(kind, T, max_len, t)
        return self.eager(kind, T, max_len, t)

    def args(self, kind: str, T: int, max_len: int | None, t: StepTensors) -> tuple:
        """What FORWARDS[kind] is called with, eagerly or compiled."""
        kv, conv, ssm = self.pools()
        if kind == "step":
            return (self.model, T, max_len, kv, conv, ssm, t)
        return (self.model, T, max_len, self.nextn_kv_layer, kv, self.draft_in[:t.input_ids.shape[0]], t)

    def eager(self, kind: str, T: int, max_len: int | None, t: StepTensors) -> torch.Tensor | None:
        return FORWARDS[kind](*self.args(kind, T, max_len, t))

    def _batch(self, B: int, T: int, seq_lens: list[int], state_slots: list[int]) -> ForwardBatch:
        """What the runner reads of a static step's batch (the packing, on the host), shaped as an eager one's."""
        W = self.width
        return ForwardBatch(
            input_ids=self.input_ids[:B * T], positions=self.positions[:B * T],
            cu_seqlens=list(range(0, B * T + 1, T)), seq_lens=seq_lens, seq_lens_t=self.seq_lens[:B],
            page_table=self.page_table[:B, :W], slot_mapping=self.slot_mapping[:B * T], state_slots=state_slots,
            state_slots_t=self.state_slots[:B], num_decode=B if T == 1 else 0, num_extended=0 if T == 1 else B,
            decode_max_len=self.max_len)

    def _fill(self, spans: list[tuple[Request, int, list[int], list[int]]]
              ) -> tuple[int, int, int, list[int], list[int], list[int], torch.Tensor]:
        """Fill the buffers from (request, first position, token ids, state slot after each token) per sequence,
        padded to a shape. Returns (B, T, the page-table width to read, context lengths, state slots, cu_seqlens of
        the real tokens, the real tokens' rows on the device)."""
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
        pages = max(len(req.pages) for req, _, _, _ in spans)
        W = self.table_width(pages)                            # columns the forward reads
        w = min(self.width, pages) if self.for_graphs else W   # columns written (a graph's later ones: never read)
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
                  (self.table(B, W)[:, :w], table + [scratch_page] * ((B - N) * w))]
        host = torch.tensor([v for _, values in layout for v in values] + real_rows, dtype=torch.long)
        vals = host.to(self.input_ids.device, non_blocking=True)
        at = 0
        for buf, values in layout:
            buf.copy_(vals[at:at + len(values)].view(buf.shape))
            at += len(values)
        return (B, T, W, lens + [1] * (B - N), state_slots + [pad_slot] * (B - N), cu + [cu[-1]] * (B - N),
                vals[at:])

    def run(self, seqs: list[ScheduledSeq]) -> tuple[ForwardBatch, torch.Tensor]:
        """A target step: fill the buffers from the step's sequences and run the forward. Returns the batch and the
        hidden states of the real tokens, packed as an eager step's (sequence i's at cu_seqlens[i]:cu_seqlens[i+1];
        with T = 1 the padding rows follow, possibly in a view of `hidden`: read before the next step)."""
        spans = []
        for s in seqs:
            req, n_prompt = s.req, len(s.req.prompt_ids)
            first = req.prompt_ids[s.start] if s.start < n_prompt else req.output_ids[s.start - n_prompt]
            spans.append((req, s.start, [first] + s.draft, s.verify_slots if s.is_verify else [req.state_slot]))
        B, T, W, lens, state_slots, cu, real_rows = self._fill(spans)
        batch = self._batch(B, T, lens, state_slots)
        hidden = self.forward("step", B, T, W)
        if T == 1:
            return batch, hidden
        return dataclasses.replace(batch, cu_seqlens=cu), hidden[real_rows]   # a copy: safe from the next replay

    def run_draft(self, spans: list[tuple[Request, int, int]], next_ids: list[int], hidden: torch.Tensor,
                  kv_only: bool = False) -> torch.Tensor | None:
        """A NEXTN head pass (fits_draft): request r computes positions pos .. pos+n-1, embedding next_ids (packed
        in span order) with the hidden rows `hidden` [sum n, H] (the target's, or the head's own for a chain
        step). Returns the head's output rows packed the same way (possibly a view of `draft_out` for one token
        per sequence: read before the next pass); with kv_only, writes only the head's KV and returns None."""
        pad_slot, k = self.padding_slot, 0
        filled = []
        for req, pos, n in spans:
            filled.append((req, pos, next_ids[k:k + n], [pad_slot] * n))
            k += n
        B, T, W, _, _, _, real_rows = self._fill(filled)
        self.draft_in.index_copy_(0, real_rows, hidden)   # padding rows keep earlier rows: finite, never read
        out = self.forward("head_kv" if kv_only else "draft", B, T, W)
        if out is None:
            return None
        return out[:len(spans)] if T == 1 else out[real_rows]

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
        kinds = self.kinds()
        pool, stream = None, torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for B, T in sorted(self.shapes, key=lambda bt: (-bt[0] * bt[1], -bt[1])):
                t, R = self.tensors(B, T, self.width), B * T
                for kind in kinds:
                    out = self.output(kind)

                    def forward():
                        rows = self.eager(kind, T, self.max_len, t)
                        if out is not None:
                            out[:R].copy_(rows)
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
