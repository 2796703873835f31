"""The static-shape steps (engine.compile_steps): CUDA graphs of the decode steps, the verifies (a decode with
NEXTN's drafts) and the NEXTN head's passes after them, and their CPU twin where it is the same code: NEXTN's verifies
and head passes through the graphs torch.compile made (compiled.py). A plain CPU decode does not come here: the
runner hands its batch as it is to the compiled graphs (compiled.CompiledSteps.decode).

An optional part (`StaticStep`, the runner's `steps`): the runner asks whether it `takes` a target step's batch
(qwen3_next.ForwardBatch: all decodes and verifies, fitting the buffers) and then has it run the step (`forward`):
the batch's tensors are copied into the buffers, padded to a shape, and the forward of that shape runs. NEXTN's head
passes call `run` themselves (spec.py), and idle release drops the graphs with the pools they point into and captures
them again (idle.py). Off, or a batch it does not take: the runner's eager forward, the same math.

A step of N sequences of at most T tokens runs as shape (B, T) over buffers sized for the largest step
(ForwardBatch.of_shape reads them): nothing inside a forward changes from step to step but the buffers' contents and,
on the CPU, the batch size and the page table's width. CUDA: B is the smallest graph batch size >= N, the page table
spans the whole context, and one graph per shape (and per forward: the target's, the NEXTN head's) is captured at
start and replayed. CPU: B = N, the page table spans the step's pages, and the forwards are compiled once by
torch.compile for every batch size and context length. Without either (the CPU tests) the same batches run eagerly:
the same math.
"""
from __future__ import annotations

import logging
import time

import torch

from tinyserve.kernels import PoolLayer, use_triton
from tinyserve.pools import KVPool, StatePool
from tinyserve.models.qwen3_next import ForwardBatch, Qwen3NextForCausalLM
from tinyserve.runner import ModelRunner

log = logging.getLogger("tinyserve.static")


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then every 16 (nano-vllm's and mini-sglang's choice), and
    max_batch itself; a step of N sequences runs as the smallest of them >= N."""
    return [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]


def draft_forward(model: Qwen3NextForCausalLM, T: int, max_len: int | None, kv_layer: int, kv: torch.Tensor,
                  hidden: torch.Tensor, *t: torch.Tensor) -> torch.Tensor:
    """A static NEXTN head pass: token row r embeds input_ids[r] with the hidden row hidden[r] ([B * T, H]).
    t: ForwardBatch.of_shape's tensors; max_len None: the page table's width in tokens."""
    batch = ForwardBatch.of_shape(T, max_len or t[4].shape[1] * kv.shape[3], *t)
    return model.mtp(model.embed(t[0]), hidden, batch, PoolLayer(kv, kv_layer), model.cos_sin(t[1]))


def head_kv_forward(model: Qwen3NextForCausalLM, T: int, max_len: int | None, kv_layer: int, kv: torch.Tensor,
                    hidden: torch.Tensor, *t: torch.Tensor) -> None:
    """A static pass of the NEXTN head's KV alone (positions nothing is drafted from), fed as draft_forward."""
    batch = ForwardBatch.of_shape(T, max_len or t[4].shape[1] * kv.shape[3], *t)
    model.mtp.write_kv(model.embed(t[0]), hidden, batch, PoolLayer(kv, kv_layer), model.cos_sin(t[1]))


# by kind: the target's forward (the model's own static_forward), the NEXTN head's, its KV alone
FORWARDS = {"step": Qwen3NextForCausalLM.static_forward, "draft": draft_forward, "head_kv": head_kv_forward}


class StaticStep:
    """The static-shape steps: a decode step (every sequence one new token), a verify step (the last accepted token
    plus NEXTN's drafts, plain decodes among them), and the NEXTN head's passes after
    them (over the tokens a step committed, then one token per draft; its KV alone where nothing is drafted). No
    prefill chunk, no image.

    Every tensor a forward reads lives in a buffer sized for the largest step (`tensors`): token ids, positions,
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
    sees a width it keeps dynamic), a decode step reads the batch's own tensors (no buffer: nothing to pad, no
    address to keep; CompiledSteps.decode, called by the runner, does the same), and the forwards run as compiled
    at start (`compiled`, compiled.CompiledSteps), or eagerly. The logits and the sampling run outside, as for an
    eager step, on the real rows."""

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
    def takes(self, batch: ForwardBatch) -> bool:
        """A target step that is all decodes and verifies, and fits."""
        return batch.num_decode + batch.num_verify == len(batch.seq_lens) and self.fits(batch)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The hidden rows of a target step it takes."""
        if not self.for_graphs and not batch.num_verify:     # a CPU decode: its tensors as they are, nothing to pad
            return self._forward_on("step", 1, (batch.input_ids, batch.positions, batch.slot_mapping,
                                                batch.seq_lens_t, batch.page_table, batch.state_slots_t))
        return self.run(batch)

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether a batch fits the buffers: sequences, tokens per sequence, context."""
        cu = batch.cu_seqlens
        return len(batch.seq_lens) <= self.sizes[-1] and max(batch.seq_lens) <= self.max_len and \
            max(cu[i + 1] - cu[i] for i in range(len(batch.seq_lens))) <= self.max_tokens

    def run(self, batch: ForwardBatch, kind: str = "step", hidden: torch.Tensor | None = None
            ) -> torch.Tensor | None:
        """A forward of `kind` over a batch (fits): the buffers filled from it, padded to a shape. Returns the real
        rows laid out as the batch's (for one token per sequence a view of the output buffer: read before the next
        forward); the head's KV pass (head_kv) returns None. kind "draft" / "head_kv": the NEXTN head, whose row r
        embeds the batch's token r with the hidden row hidden[r]."""
        B, T, W, real = self._fill(batch, kind == "step")
        if hidden is not None and real is None:
            self.draft_in[:hidden.shape[0]].copy_(hidden)
        elif hidden is not None:     # padding rows keep earlier rows: finite, never read
            self.draft_in.index_copy_(0, real, hidden)
        out = self._forward(kind, B, T, W)
        if out is None:
            return None
        return out[:len(batch.seq_lens)] if real is None else out[real]   # a gather copies: safe from the next replay

    def _fill(self, batch: ForwardBatch, target: bool) -> tuple[int, int, int, torch.Tensor | None]:
        """Copy the batch into the buffers, each sequence's tokens padded to T and the sequences to B (padding as
        the class docstring says). Returns (B, T, the page-table width to read, the real tokens' rows on the
        device: None for one token per sequence, the first N rows)."""
        N, cu, dev = len(batch.seq_lens), batch.cu_seqlens, self.input_ids.device
        T = max(cu[i + 1] - cu[i] for i in range(N))
        B = next(b for b in self.sizes if b >= N)
        scratch, pad_slot, n = self.kv_pool.scratch_page, self.padding_slot, N * T
        slot_pad = scratch * self.kv_pool.page_size
        real = None
        if T == 1:                          # one token per sequence: the batch's rows as they are
            self.input_ids[:N].copy_(batch.input_ids)
            self.positions[:N].copy_(batch.positions)
            self.slot_mapping[:N].copy_(batch.slot_mapping)
        else:
            # row i * T + t holds token t of sequence i; past its end a padding token at its last real position, its
            # KV to the scratch page, its state to padding_slot
            src = [cu[i] + min(t, cu[i + 1] - cu[i] - 1) for i in range(N) for t in range(T)]
            rows = [i * T + t for i in range(N) for t in range(cu[i + 1] - cu[i])]
            src_t, real = torch.tensor(src, device=dev), torch.tensor(rows, device=dev)
            self.input_ids[:n].zero_()
            self.input_ids.index_copy_(0, real, batch.input_ids)
            self.positions[:n].copy_(batch.positions[src_t])
            self.token_lens[:n].copy_(self.positions[:n] + 1)
            self.slot_mapping[:n].fill_(slot_pad)
            self.slot_mapping.index_copy_(0, real, batch.slot_mapping)
            self.out_slots[:n].fill_(pad_slot)
            if target:                      # the state after each token: a plain decode's own slot, a verify's
                after = batch.state_slots_t[:batch.num_decode]          # state_after
                if batch.verify is not None:
                    after = torch.cat([after, batch.verify.out_slots])
                self.out_slots.index_copy_(0, real, after)
        if B > N:                           # the padding sequences
            self.input_ids[n:B * T].zero_()
            self.positions[n:B * T].zero_()
            self.slot_mapping[n:B * T].fill_(slot_pad)
            self.out_slots[n:B * T].fill_(pad_slot)
            self.token_lens[n:B * T].fill_(1)
            self.seq_lens[N:B].fill_(1)
            self.state_slots[N:B].fill_(pad_slot)
        self.seq_lens[:N].copy_(batch.seq_lens_t)
        self.state_slots[:N].copy_(batch.state_slots_t)
        W = self.table_width(batch.page_table.shape[1])        # columns the forward reads
        w = min(W, batch.page_table.shape[1])                   # columns written (a graph's later ones: never read)
        table = self.table(B, W)
        table[:N, :w].copy_(batch.page_table[:, :w])
        table[N:].fill_(scratch)
        return B, T, W, real

    # ---- the buffers and the forwards ----
    def pools(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The KV pool and the state pools with their scratch slot (StatePool.conv_all), as the forwards take them."""
        if self.held_pools is not None:
            return self.held_pools
        return self.kv_pool.buffer, self.state_pool.conv_all, self.state_pool.ssm_all

    def _pool_addresses(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.pools())

    def tensors(self, B: int, T: int, W: int) -> tuple[torch.Tensor, ...]:
        """The buffers as the forward of shape (B, T) with a page table W pages wide reads them (ForwardBatch.of_shape's
        tensors: token ids, positions, KV slots, context lengths, the page table, state slots; with T > 1 where
        the state after each token goes and the keys each sees)."""
        R = B * T
        t = (self.input_ids[:R], self.positions[:R], self.slot_mapping[:R], self.seq_lens[:B], self.table(B, W),
             self.state_slots[:B])
        return t if T == 1 else t + (self.out_slots[:R], self.token_lens[:R])

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

    def _forward_on(self, kind: str, T: int, t: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """The forward over these tensors: compiled when it is (the CPU), else eagerly."""
        max_len = self.max_len if self.for_graphs else None
        if self.compiled is not None:
            return self.compiled(kind, T, max_len, t)
        return self.eager(kind, T, max_len, t)

    def _replay(self, kind: str, B: int, T: int) -> torch.Tensor | None:
        self.graphs[kind, B, T].replay()
        out = self.output(kind)
        return None if out is None else out[:B * T]

    def args(self, kind: str, T: int, max_len: int | None, t: tuple[torch.Tensor, ...]) -> tuple:
        """What FORWARDS[kind] is called with, eagerly or compiled."""
        kv, conv, ssm = self.pools()
        if kind == "step":
            return (self.model, T, max_len, kv, conv, ssm, *t)
        return (self.model, T, max_len, self.nextn_kv_layer, kv, self.draft_in[:t[0].shape[0]], *t)

    def eager(self, kind: str, T: int, max_len: int | None, t: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
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
