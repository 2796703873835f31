"""The static-shape steps (engine.compile_steps): decode steps, verifies (a decode with NEXTN's drafts), and the
NEXTN head's passes after them.

An optional part (`StaticStep`, the runner's `steps`): the runner asks whether it `takes` a target step's packed
batch (runner.Packed: all decodes and verifies, fitting the buffers) and then has it run the step (`forward`): a
CPU decode step reads tensors made from it (decode_tensors), any other is padded into the buffers; then the forward
of that shape runs. NEXTN's head passes call `run` themselves (spec.py), and idle release drops the graphs with the
pools they point into and captures them again (idle.py). Off, or a batch it does not take: the runner's eager
forward, the same math.

A step of N sequences of at most T tokens runs as shape (B, T) over buffers sized for the largest step: nothing
inside a forward changes from step to step but the buffers' contents and, on the CPU, the batch size and the page
table's width. Two ways to make that fast:
  - CUDA: B is the smallest graph batch size >= N, the page table spans the whole context, and one graph per shape
    (and per forward: the target's, the NEXTN head's) is captured at start and replayed;
  - CPU: B = N, the page table spans the step's pages, and the forwards are compiled once by torch.compile
    (compiled.py) for every batch size and context length; a decode step (one token per sequence, nothing to pad)
    reads tensors made from the packed rows, without the buffers (decode_tensors).
Without either (the CPU tests) the same batches run eagerly: the same math.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

import numpy as np
import torch

from tinyserve.kernels import use_triton
from tinyserve.kernels.pool_layer import PoolLayer
from tinyserve.kernels.verify_layout import VerifyLayout
from tinyserve.pools import KVPool, StatePool
from tinyserve.models.qwen3_next import ForwardBatch, Qwen3NextForCausalLM
from tinyserve.request import Request
from tinyserve.runner import ModelRunner, Packed

log = logging.getLogger("tinyserve.static")


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then every 16 (nano-vllm's and mini-sglang's choice), and
    max_batch itself; a step of N sequences runs as the smallest of them >= N."""
    return [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]


class ShapeBatch(ForwardBatch):
    """A static step's batch as its forward sees it: B sequences of T tokens each, every one a decode (T = 1) or a
    verify (T > 1), described by tensors alone. No host list: the number of sequences and where
    the prefill rows would begin come from the shapes, so torch.compile traces one graph for every batch size."""

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
    """What a static forward reads, per token row (B * T) or per sequence (B): views of StaticStep's buffers, or a
    CPU decode's own contiguous tensors (decode_tensors), laid out the same."""
    input_ids: torch.Tensor        # [B*T] int64
    positions: torch.Tensor        # [B*T] int64
    slot_mapping: torch.Tensor     # [B*T] int64
    seq_lens: torch.Tensor         # [B] int32: context length after the step
    page_table: torch.Tensor       # [B, W] int32
    state_slots: torch.Tensor      # [B] int64: the state each sequence starts from
    out_slots: torch.Tensor        # [B*T] int64: where the state after each token goes (T > 1)
    token_lens: torch.Tensor       # [B*T] int32: the keys each token sees (T > 1)


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
                      state_slots_t=t.state_slots, num_decode=B if T == 1 else 0, num_verify=0 if T == 1 else B,
                      verify=verify, decode_max_len=max_len)


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
    """The static-shape steps: a decode step (every sequence one new token), a verify step (the last accepted token
    plus NEXTN's drafts, plain decodes among them), and the NEXTN head's passes after
    them (over the tokens a step committed, then one token per draft; its KV alone where nothing is drafted). No
    prefill chunk, no image.

    Every tensor a forward reads lives in a buffer sized for the largest step (StepTensors): token ids, positions,
    KV slots, the state slot after each token, lengths and (for the NEXTN head) input hidden rows per token; context
    lengths, state slots and the page table (whole-context rows) per sequence. N sequences of at most T tokens run
    as shape (B, T): B the smallest of `sizes` >= N, T in 1 .. max_tokens (1 + the NEXTN draft steps).
      - T = 1: a decode batch of B rows.
      - T > 1: B sequences of T tokens each. A shorter sequence's tokens past its end are padding (token 0 at its
        last real position, KV to the scratch page, the state after it to `padding_slot`); a plain decode among
        them is a sequence of one real token, whose state goes to its own slot as a verify's first token's.
    Sequences N..B-1 (CUDA graphs' padding) are padding: token 0 at position 0 of a one-token context on the KV
    pool's scratch page, state from `padding_slot` (the page is never handed out), so every kernel computes them
    as any row and nothing reads what they produce. `padding_slot` is -1 with the Triton kernels, which read a zero
    state for it and store none (a padding token would otherwise write a whole fp32 state per GDN layer), and the
    state pool's scratch slot (never handed out) with the torch references, which index it.

    for_graphs (CUDA graphs): B from graph_batch_sizes, and the page table and the attention's split count span
    the whole context (`max_len`, at most the pool), not this step's, so nothing inside a forward changes from step
    to step but the buffers' contents: one graph per shape (and per forward) is captured at start (`capture`) and
    replayed. Otherwise (the CPU): B = N, and the page table spans the step's pages (at least 2, so torch.compile
    sees a width it keeps dynamic), a decode step reads tensors made from its packed rows (no buffer: nothing to
    pad, no address to keep), and the forwards run as compiled at start (`compiled`, compiled.CompiledSteps), or
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
        self.held_pools: tuple[torch.Tensor, ...] | None = None   # a twin's: the pools as they were when made
        self._page_rows: dict[int, tuple[list[int], np.ndarray]] = {}   # id(request) -> (its pages, as an array)
        self._pad()

    def twin(self) -> "StaticStep":
        """A step of the same shapes with buffers of its own, over the same model and the pools as they are now
        (held: an idle release meanwhile frees them once the twin is gone): what compiles graphs on another thread
        while this one serves (compiled.py). Its warm-ups write padding rows only, as this one's do."""
        twin = StaticStep(self.model, self.kv_pool, self.state_pool, self.sizes[-1], self.max_len, self.max_tokens,
                          self.nextn_kv_layer, for_graphs=self.for_graphs)
        twin.held_pools = self.pools()
        return twin

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

    # ---- the runner's ----
    def takes(self, packed: Packed) -> bool:
        """A target step that is all decodes and verifies, and fits."""
        return packed.num_decode + packed.num_verify == packed.num_seqs and self.fits(packed)

    def forward(self, packed: Packed) -> torch.Tensor:
        """The hidden rows of a target step it takes."""
        if not self.for_graphs and not packed.num_verify:     # a CPU decode: no buffers to pad into
            return self._forward_on("step", 1, self.decode_tensors(packed))
        return self.run(packed)

    def fits(self, packed: Packed) -> bool:
        """Whether a packed batch fits the buffers: sequences, tokens per sequence, context."""
        return packed.num_seqs <= self.sizes[-1] and all(
            n <= self.max_tokens and pos + n <= self.max_len for _, pos, n in packed.spans)

    def run(self, packed: Packed, kind: str = "step", hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """A forward of `kind` over a packed batch (fits): the buffers filled from it, padded to a shape. Returns
        the real rows laid out as packed (for one token per sequence a view of the output buffer: read before the
        next forward); the head's KV pass (head_kv) returns None. kind "draft" / "head_kv": the NEXTN head, whose
        row r embeds the packed token r with the hidden row hidden[r]."""
        B, T, W, real_rows = self._fill(packed, kind == "step")
        if hidden is not None:
            self.draft_in.index_copy_(0, real_rows, hidden)   # padding rows keep earlier rows: finite, never read
        out = self._forward(kind, B, T, W)
        if out is None:
            return None
        return out[:packed.num_seqs] if T == 1 else out[real_rows]   # a gather copies: safe from the next replay

    def _fill(self, packed: Packed, target: bool) -> tuple[int, int, int, torch.Tensor]:
        """Fill the buffers from the packed batch, each sequence's rows padded to T and the sequences to B. Returns
        (B, T, the page-table width to read, the real tokens' rows on the device)."""
        spans, ps = packed.spans, self.kv_pool.page_size
        N, T = len(spans), max(n for _, _, n in spans)
        B = next(b for b in self.sizes if b >= N)
        scratch_page, pad_slot = self.kv_pool.scratch_page, self.padding_slot
        if T == 1:                                       # one token per sequence: the packed rows as they are
            ids, positions, slots = packed.input_ids, packed.positions, packed.slot_mapping
            out_slots, token_lens, real_rows = [pad_slot] * N, [1] * N, list(range(N))
        else:
            ids, positions, slots, out_slots, token_lens, real_rows = self._rows(packed, T, target)
        pad_rows = (B - N) * T
        pages = max(len(req.pages) for req, _, _ in spans)
        W = self.table_width(pages)                            # columns the forward reads
        w = min(self.width, pages) if self.for_graphs else W   # columns written (a graph's later ones: never read)
        R = B * T
        # every buffer with its values, padding sequences last: packed into one host tensor, copied once
        layout = [(self.input_ids[:R], ids + [0] * pad_rows),
                  (self.positions[:R], positions + [0] * pad_rows),
                  (self.slot_mapping[:R], slots + [scratch_page * ps] * pad_rows),
                  (self.out_slots[:R], out_slots + [pad_slot] * pad_rows),
                  (self.token_lens[:R], token_lens + [1] * pad_rows),
                  (self.seq_lens[:B], packed.seq_lens + [1] * (B - N)),
                  (self.state_slots[:B], packed.state_slots + [pad_slot] * (B - N))]
        small = [v for _, values in layout for v in values] + real_rows
        host = np.full(len(small) + B * w, scratch_page, dtype=np.int64)
        host[:len(small)] = small
        table = host[len(small):].reshape(B, w)         # the page table last, without a Python loop over its pages
        for i, (req, _, _) in enumerate(spans):
            row = self._page_row(req)[:w]
            table[i, :len(row)] = row
        vals = torch.from_numpy(host).to(self.input_ids.device, non_blocking=True)
        at = 0
        for buf, values in layout:
            buf.copy_(vals[at:at + len(values)].view(buf.shape))
            at += len(values)
        self.table(B, W)[:, :w].copy_(vals[len(small):].view(B, w))
        return B, T, W, vals[at:len(small)]

    def decode_tensors(self, packed: Packed) -> StepTensors:
        """A CPU decode's tensors, the packed rows as they are (one token per sequence, nothing to pad): only a CUDA
        graph needs the buffers' fixed addresses. out_slots and token_lens are not read at T = 1."""
        N, dev = packed.num_seqs, self.input_ids.device
        W = self.table_width(max(len(req.pages) for req, _, _ in packed.spans))
        table = np.full((N, W), self.kv_pool.scratch_page, dtype=np.int32)
        for i, (req, _, _) in enumerate(packed.spans):
            row = self._page_row(req)[:W]
            table[i, :len(row)] = row
        ids, positions, slots, state_slots = (torch.tensor(v, dtype=torch.long, device=dev) for v in (
            packed.input_ids, packed.positions, packed.slot_mapping, packed.state_slots))
        return StepTensors(ids, positions, slots, torch.tensor(packed.seq_lens, dtype=torch.int32, device=dev),
                           torch.from_numpy(table).to(dev), state_slots, self.out_slots[:N], self.token_lens[:N])

    def _page_row(self, req: Request) -> np.ndarray:
        """req.pages as an array, extended by the pages added since the last step. A request's page list only
        grows by appends, or is replaced whole (PrefixCache.admit, Scheduler._free: a new list), so a step copies
        each row instead of walking every page of a long context in Python."""
        pages, held = req.pages, self._page_rows.get(id(req))
        if held is None or held[0] is not pages or len(held[1]) > len(pages):
            row = np.asarray(pages, dtype=np.int32)
        elif len(held[1]) < len(pages):
            row = np.concatenate((held[1], np.asarray(pages[len(held[1]):], dtype=np.int32)))
        else:
            return held[1]
        if len(self._page_rows) > 4 * self.sizes[-1]:  # finished requests' (their lists are held: an id reused
            self._page_rows.clear()                     # by a new request comes with another list)
        self._page_rows[id(req)] = (pages, row)
        return row

    def _rows(self, packed: Packed, T: int, target: bool) -> tuple[list[int], ...]:
        """The token rows of sequences of up to T tokens, each padded to T: token ids, positions, KV slots, the
        slot the state after each token goes to (a target step's: a verify's state_after, a plain
        decode's own state slot; the head's: padding_slot), the keys each sees; and the real tokens' rows. A padding
        token repeats its sequence's last real position, writes the scratch page and its state to padding_slot."""
        scratch, pad_slot, cu = self.kv_pool.scratch_page * self.kv_pool.page_size, self.padding_slot, packed.cu_seqlens
        ids, positions, slots, out_slots, token_lens, real_rows = [], [], [], [], [], []
        for i, (_, _, n) in enumerate(packed.spans):
            after = [pad_slot] * n
            if target:
                k = i - packed.num_decode
                after = packed.state_after[k] if k >= 0 else [packed.state_slots[i]]
            for t in range(T):
                r = cu[i] + min(t, n - 1)
                ids.append(packed.input_ids[r] if t < n else 0)
                positions.append(packed.positions[r])
                slots.append(packed.slot_mapping[r] if t < n else scratch)
                out_slots.append(after[t] if t < n else pad_slot)
                token_lens.append(packed.positions[r] + 1)
            real_rows += range(i * T, i * T + n)
        return ids, positions, slots, out_slots, token_lens, real_rows

    # ---- the buffers and the forwards ----
    def pools(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The KV pool and the state pools with their scratch slot (StatePool.conv_all), as the forwards take them."""
        if self.held_pools is not None:
            return self.held_pools
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

    def _forward(self, kind: str, B: int, T: int, W: int) -> torch.Tensor | None:
        """A forward of shape (B, T) over the filled buffers: its graph when captured, its compiled code when
        compiled, else eagerly. Returns the [B * T, H] rows (a view of `output(kind)` for a graph: read before the
        next replay); the head's KV pass returns None."""
        if (kind, B, T) in self.graphs and self._pool_addresses() == self._captured_on:
            return self._replay(kind, B, T)
        if self.graphs and self._pool_addresses() != self._captured_on:
            log.warning("the KV / state pools moved since the CUDA graphs were captured: dropping the graphs")
            self.graphs.clear()
        return self._forward_on(kind, T, self.tensors(B, T, W))

    def _forward_on(self, kind: str, T: int, t: StepTensors) -> torch.Tensor | None:
        """The forward over these tensors: compiled when it is (the CPU), else eagerly."""
        max_len = self.max_len if self.for_graphs else None
        if self.compiled is not None:
            return self.compiled(kind, T, max_len, t)
        return self.eager(kind, T, max_len, t)

    def _replay(self, kind: str, B: int, T: int) -> torch.Tensor | None:
        self.graphs[kind, B, T].replay()
        out = self.output(kind)
        return None if out is None else out[:B * T]

    def args(self, kind: str, T: int, max_len: int | None, t: StepTensors) -> tuple:
        """What FORWARDS[kind] is called with, eagerly or compiled."""
        kv, conv, ssm = self.pools()
        if kind == "step":
            return (self.model, T, max_len, kv, conv, ssm, t)
        return (self.model, T, max_len, self.nextn_kv_layer, kv, self.draft_in[:t.input_ids.shape[0]], t)

    def eager(self, kind: str, T: int, max_len: int | None, t: StepTensors) -> torch.Tensor | None:
        return FORWARDS[kind](*self.args(kind, T, max_len, t))

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

    def drop_graphs(self) -> None:
        """Drop the graphs and their memory pool (the pools they point into are about to be freed: idle release)."""
        self.graphs.clear()


def static_step(runner: ModelRunner, max_batch: int, for_graphs: bool) -> StaticStep:
    """The static path for a runner's steps of up to max_batch sequences (and, with NEXTN registered, its verify
    and head passes), not built yet: with for_graphs in the CUDA graphs' layout (capture makes the graphs),
    otherwise in the CPU's (compiled.CompiledSteps compiles its forwards). As the runner's `steps`, it takes the
    steps it fits; unbuilt (the CPU tests' switch), they run eagerly through its buffers."""
    pool_tokens = runner.kv_pool.num_pages * runner.page_size
    max_len = min(runner.context_length, pool_tokens) if runner.context_length else pool_tokens
    nextn = runner.nextn
    return StaticStep(runner.model, runner.kv_pool, runner.state_pool, max_batch, max_len,
                      1 + nextn.num_steps if nextn is not None else 1, nextn.kv_layer if nextn is not None else None,
                      for_graphs=for_graphs)
