"""CUDA graphs for decode and NEXTN verify (static.StaticStep): decode and verify steps run padded to a captured
shape (batch size, tokens per sequence) from static buffers, the padding rows and tokens on a scratch KV page and a
scratch GDN state slot that no request ever holds.

On the CPU the static path is forced on without a capture (conftest.static_steps, unbuilt) and must
give exactly the eager path's greedy tokens on every page size, with the prefix cache on, while the batch shrinks
and grows, and with NEXTN the unspeculated tokens; the scratch page and slot are never handed out and never written
by a real sequence. The capture and replay themselves need a GPU (the `gpu` test at the end).
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from checkpoints import make_agreeing_head, make_qwen3_5_text, make_qwen3_next
from conftest import (PinnedCost, TEST_DEVICE, assert_no_leaks, drive, engine_for, merge, nextn, static_steps,
                      tokens)
from tinyserve.config import from_dict
from tinyserve.engine import Engine
from tinyserve.idle import IdleRelease
from tinyserve.loader import load_model
from tinyserve.models.config import WeightCount
from tinyserve.plan import MemoryPlan
from tinyserve.static import StaticStep, graph_batch_sizes

CTX = 512
MAX_RUNNING = 7                 # sizes 1, 2, 4, 7: steps of 3, 5 and 6 sequences are padded


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder, _ = make_qwen3_5_text(tmp_path_factory.mktemp("q35"), max_position_embeddings=CTX)
    return load_model(folder, torch.float32, TEST_DEVICE)


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    folder, _ = make_qwen3_5_text(tmp_path_factory.mktemp("mtp"), with_mtp=True, max_position_embeddings=CTX)
    return load_model(folder, torch.float32, TEST_DEVICE)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder, _ = make_qwen3_next(tmp_path_factory.mktemp("qnext"), max_position_embeddings=CTX)
    return load_model(folder, torch.float32, TEST_DEVICE)


def make_engine(model, page_size: int, **tables) -> Engine:
    """The engines here run eagerly unless a test switches the static path on (engine.compile_steps on only where asked)."""
    defaults = {"engine": {"page_size": page_size, "kv_cache_tokens": 4096, "max_running_requests": MAX_RUNNING,
                           "chunked_prefill_size": 96, "compile_steps": False},
                "cache": {"state_track_interval": 64}}
    return engine_for(model, **merge(defaults, tables))


class Recorder:
    """Wraps StaticStep.run: records (sequences, padded size, tokens per sequence) of each static target step and
    (spans, padded size, tokens per span, KV only) of each NEXTN head pass, and checks the buffers they ran on: no
    real token points at the scratch page or slot, every padding token does."""

    def __init__(self, static: StaticStep) -> None:
        self.static, self.steps, self.short, self.drafts = static, [], 0, []
        self._run = static.run
        static.run = self.run

    def run(self, batch, kind="step", hidden=None):
        out = self._run(batch, kind, hidden)
        st, n, cu = self.static, batch.num_seqs, batch.cu_seqlens
        lens = [cu[i + 1] - cu[i] for i in range(n)]
        T = max(lens)
        B, ps, page, slot = next(b for b in st.sizes if b >= n), st.kv_pool.page_size, st.kv_pool.scratch_page, \
            st.padding_slot
        real = torch.tensor([i * T + t for i, k in enumerate(lens) for t in range(k)])
        padding = torch.tensor([r for r in range(B * T) if r not in set(real.tolist())], dtype=torch.long)
        assert not (st.slot_mapping[real] // ps == page).any()
        assert (st.slot_mapping[padding] == page * ps).all()
        if kind != "step":                 # the NEXTN head's passes: the real tokens' KV in their pages
            assert len(real) == batch.input_ids.shape[0] == hidden.shape[0]
            assert out is None if kind == "head_kv" else out.shape[0] == len(real)
            self.drafts.append((n, B, T, kind == "head_kv"))
            return out
        assert not (batch.page_table == page).any()
        assert all(s not in (slot, st.state_pool.scratch_slot) for s in batch.state_slots)
        assert not (st.state_slots[:n] == slot).any()
        assert (st.state_slots[n:B] == slot).all()
        assert (st.page_table[n:B, 0] == page).all() and (st.seq_lens[n:B] == 1).all()
        if T > 1:                          # extra tokens: the state after each real token in its own slot
            assert not (st.out_slots[real] == slot).any() and (st.out_slots[padding] == slot).all()
            assert batch.cu_seqlens[n] == out.shape[0] == len(real)
        else:
            assert out.shape[0] == n
        self.steps.append((n, B, T))
        self.short += any(k < T for k in lens)      # a sequence with padding tokens after its own
        return out


def workload(seed: int) -> list[tuple[int, list[int], int]]:
    """Eight requests of different lengths: three start together, one finishes, five more arrive one by one while
    the others decode (the eighth waits for a free running slot), some sharing a prefix with one that finished (a
    prefix-cache hit), then all finish at different steps: the static batch shrinks, grows to 7 and shrinks to 1."""
    shared = tokens(150, seed)
    return [(0, tokens(40, seed + 1), 60), (0, shared, 10), (0, tokens(7, seed + 2), 75),
            (16, shared + tokens(20, seed + 3), 40), (17, tokens(90, seed + 4), 34),
            (18, shared[:130] + tokens(5, seed + 5), 30), (19, tokens(3, seed + 6), 45), (20, tokens(12, seed + 7), 25)]


def check_scratch(eng: Engine) -> None:
    """The scratch page and slot lie past everything the allocators and the prefix cache can hold, and padding
    rows left only finite values in them."""
    kv, st = eng.kv_pool, eng.state_pool
    assert kv.scratch_page == eng.allocator.num_pages == len(eng.allocator.refcount)
    assert kv.buffer.shape[0] == kv.scratch_page + 1
    assert st.scratch_slot == st.num_slots + st.num_snapshot_slots == st.conv.shape[0] == st.ssm.shape[0]
    assert st.scratch_slot not in st._free and st.scratch_slot not in st._free_snapshots
    assert st.conv_all.shape[0] == st.scratch_slot + 1 and st.conv.data_ptr() == st.conv_all.data_ptr()
    assert torch.isfinite(kv.buffer[kv.scratch_page]).all()
    assert torch.isfinite(st.conv_all[st.scratch_slot]).all() and torch.isfinite(st.ssm_all[st.scratch_slot]).all()


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(7) == [1, 2, 4, 7]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_static_decode_gives_the_eager_tokens(dense, page_size):
    schedule = workload(page_size)
    eager = make_engine(dense, page_size)
    want = drive(eager, schedule)
    assert eager.runner.steps is None
    assert_no_leaks(eager)

    eng = make_engine(dense, page_size)
    rec = Recorder(static_steps(eng))          # the CPU test switch: no capture
    got = drive(eng, schedule)
    assert got == want
    assert {n for n, _, _ in rec.steps} >= set(range(1, MAX_RUNNING + 1))     # shrinking ...
    assert any(n < B for n, B, _ in rec.steps), "some steps were padded"
    grew = [i for i in range(1, len(rec.steps)) if rec.steps[i][0] > rec.steps[i - 1][0]]
    assert grew, "... and growing between static steps"
    assert eng.cache.stats().hit_tokens > 0, "later requests hit the prefix cache"
    check_scratch(eng)
    assert_no_leaks(eng)
    check_scratch(eng)


@pytest.mark.parametrize("page_size", [1, 16])
def test_cpu_layout_decode_reads_the_packed_rows(dense, page_size):
    """The CPU's static decode (for_graphs off) reads the runner's batch as it is, no buffer filled: the eager
    tokens while the batch shrinks and grows, every decode step taken, page tables as wide as the step's longest
    sequence (at least 2)."""
    schedule = workload(page_size)
    want = drive(make_engine(dense, page_size), schedule)
    eng = make_engine(dense, page_size)
    static = static_steps(eng, for_graphs=False)
    static.run = lambda *a, **k: pytest.fail("a CPU decode step went through the buffers")
    made, pages, forward_on, pack = [], [], static._forward_on, eng.runner.pack

    def packed(spans, *args, **kwargs):
        pages.append(max(len(req.pages) for req, _, _ in spans))     # the step's longest sequence's
        return pack(spans, *args, **kwargs)

    def recorded(kind, T, t):
        ids, table = t[0], t[4]
        made.append((ids.shape[0], tuple(table.shape) == (ids.shape[0], max(pages[-1], 2)),
                     table.is_contiguous() and T == 1))
        return forward_on(kind, T, t)
    eng.runner.pack, static._forward_on = packed, recorded
    assert drive(eng, schedule) == want
    assert {n for n, _, _ in made} >= set(range(1, MAX_RUNNING + 1))
    assert all(width_ok and layout_ok for _, width_ok, layout_ok in made)
    assert_no_leaks(eng)


@pytest.mark.slow
def test_static_decode_moe(moe):
    """Qwen3-Next (MoE): padding rows are routed to experts like any row and change nothing."""
    schedule = workload(3)[:5]
    want = drive(make_engine(moe, 16), schedule)
    eng = make_engine(moe, 16)
    rec = Recorder(static_steps(eng))
    assert drive(eng, schedule) == want and any(n < B for n, B, _ in rec.steps)
    assert_no_leaks(eng)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_static_verify_gives_the_unspeculated_tokens(tmp_path, page_size):
    """NEXTN speculating while at most 3 requests run: above that, plain decodes take the static path with one
    token each; at 3 and below verifies take it with 1 + drafts tokens, requests of other depths (and plain
    decodes, probing at depth 0) padded to the longest. The drafts come from the static rows (runner._draft). The
    greedy tokens are the unspeculated, uncached ones, and every real token's state went to its own slot. The head's
    own layer and its hidden input matter (head_layer, head_noise), so its drafts, and with them the acceptance
    counts, are those of the eager head only if the static head pass computes what the eager one does."""
    folder, _ = make_qwen3_5_text(tmp_path / "mtp", with_mtp=True, max_position_embeddings=CTX)
    make_agreeing_head(folder, mix=0.3, head_noise=0.05, head_layer=0.5)
    model = load_model(folder, torch.float32, TEST_DEVICE)
    schedule = workload(5)
    want = drive(make_engine(model, page_size, cache={"enabled": False}), schedule)
    spec = {"num_steps": 3, "max_running": 3}
    eager = make_engine(model, page_size, speculative=spec)
    nextn(eager).step_cost = PinnedCost()           # depths by acceptance alone, not by timing
    assert drive(eager, schedule) == want
    eng = make_engine(model, page_size, speculative=spec)
    nextn(eng).step_cost = PinnedCost()
    rec = Recorder(static_steps(eng))
    assert drive(eng, schedule) == want
    # the same drafts as the eager head's (a wrong draft costs acceptance, not tokens: so compare the counts)
    assert dataclasses.asdict(nextn(eng).totals) == dataclasses.asdict(nextn(eager).totals)
    assert eng.runner.steps.max_tokens == 1 + nextn(eng).num_steps
    shapes = {(B, T) for _, B, T in rec.steps}
    assert any(T == 1 for _, T in shapes) and any(T > 1 for _, T in shapes), shapes
    assert any(n < B and T > 1 for n, B, T in rec.steps), "a verify batch with padding sequences"
    assert rec.short > 0, "a verify batch with sequences of different lengths"
    assert nextn(eng).totals.num_accepted_tokens > 0
    # the NEXTN head ran static too: over the tokens each step committed (1 .. 1 + drafts), then chain steps; and
    # its KV alone over the tokens of steps that drafted nothing
    heads = [(n, B, T) for n, B, T, kv_only in rec.drafts if not kv_only]
    assert any(T > 1 for _, _, T in heads) and any(T == 1 for _, _, T in heads)
    assert any(n < B for n, B, _ in heads)
    assert any(kv_only for *_, kv_only in rec.drafts)
    assert_no_leaks(eng)
    check_scratch(eng)


@pytest.mark.slow
@pytest.mark.parametrize("nextn", [False, True], ids=["decode", "nextn"])
def test_static_steps_through_the_triton_kernels(tmp_path, monkeypatch, nextn):
    """The Triton kernels (the interpreter on the CPU) on padded static batches: the conv and GDN decode kernels
    with several padding rows on slot -1 (a zero state, nothing stored), the attention decode with its split count from the whole
    context (the split length lowered so there are many, most of them empty for these short sequences); with
    NEXTN the verify kernels (padding tokens' states to slot -1) and the attention's verify rows
    (table_rows). The prefill kernels, which the static path does not run, take their torch references here (the
    interpreter is slow)."""
    pytest.importorskip("triton")
    from triton_setup import DEV, backend
    from tinyserve.kernels import attention, attention_triton, conv, conv_triton, gdn, gdn_triton
    monkeypatch.setattr(attention_triton, "SPLIT_MIN_TOKENS", 64)

    def reference(fn):
        def run(*args):
            with backend("torch"):
                return fn(*args)
        return run
    for ref, tri, name in [(gdn, gdn_triton, "chunk_gated_delta_rule"), (conv, conv_triton, "causal_conv1d_prefill"),
                           (attention, attention_triton, "paged_attention_prefill")]:
        monkeypatch.setattr(tri, name, reference(getattr(ref, name)))
    # one layer of each kind: every kernel runs, at half the interpreter's time of the default four layers
    folder, _ = make_qwen3_5_text(tmp_path / "q35", with_mtp=nextn, max_position_embeddings=CTX, num_hidden_layers=2,
                                  layer_types=["linear_attention", "full_attention"])
    if nextn:
        make_agreeing_head(folder, mix=0.3)
    model = load_model(folder, torch.float32, DEV)
    schedule = [(0, tokens(4, 1), 4), (0, tokens(6, 2), 5), (0, tokens(3, 3), 3)]
    spec = {"speculative": {"max_running": 3, "num_steps": 2}} \
        if nextn else {}
    out = {}
    with backend("auto"):                         # restored after: each engine sets it from engine.kernels
        for name in ("triton", "static"):
            eng = make_engine(model, 16, engine={"kernels": "triton"}, **spec)
            if name == "static":
                rec = Recorder(static_steps(eng))
            out[name] = drive(eng, schedule)
    assert out["static"] == out["triton"] == drive(make_engine(model, 16), schedule)       # and the references'
    assert eng.runner.steps.padding_slot == -1
    if nextn:
        assert any(T > 1 for _, _, T in rec.steps) and eng.nextn.totals.num_accepted_tokens > 0
    else:
        assert (3, 4, 1) in rec.steps and attention_triton.num_splits(CTX, 4, 2, torch.device(DEV)) == 8


@pytest.mark.slow
def test_the_static_forward_reads_no_tensor_on_the_host(dense, moe, mtp, monkeypatch):
    """What a capture forbids, checked on the CPU as far as the CPU can: the forwards of a static batch (decode,
    verify and the NEXTN head's, as captured: every row padding) read no tensor value on the host (.item(),
    .tolist(), bool(), int(): aten's _local_scalar_dense; nonzero; torch.tensor(list) inside the forward). With the
    torch references, whose only reads are CPU-only (slot_run reads slot ids of CPU pools alone, row_groups the
    verify rows' sequences on the CPU) or not on the CUDA path (the MoE reference counts
    its experts on the host; CUDA runs the Triton MoE): those are switched off here. The Triton wrappers of the
    decode kernels are pure launches (read in review); a capture on a GPU is the real test (the gpu test below)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from tinyserve.kernels import attention, conv, gdn
    from tinyserve.models import qwen3_next
    monkeypatch.setattr(gdn, "slot_run", lambda ids, pool: None)
    monkeypatch.setattr(attention, "row_groups", lambda rows, q: None)
    monkeypatch.setattr(conv, "slot_run", lambda ids, pool: None)
    # CUDA runs the Triton MoE: its device-side part (sorting the pairs into per-expert blocks) runs here for real;
    # its two GEMM launches cannot run on CPU tensors outside the interpreter (which reads values itself), so the
    # layer's routed output is zeros for this check (the reference loops over experts it counted on the host)
    from tinyserve.kernels import moe_triton

    def device_side_moe(x, w_gate_up, w_down, topk_weights, topk_ids):
        moe_triton.align_pairs(topk_ids, w_gate_up.shape[0], moe_triton.tile_shape(topk_ids.numel(),
                                                                                   w_gate_up.shape[0])[0])
        return torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32)
    monkeypatch.setattr(qwen3_next, "fused_experts", device_side_moe)
    forbidden = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
                 torch.ops.aten.lift_fresh.default}

    class NoHostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert func not in forbidden, f"the decode forward calls {func}"
            return func(*args, **(kwargs or {}))

    def read(self, *args, **kwargs):                 # CPU tensors' tolist / numpy bypass the dispatcher
        raise AssertionError("the decode forward reads a tensor on the host")
    for model in (dense, moe, mtp):
        spec = {"speculative": {"num_steps": 3}} if model is mtp else {}
        eng = make_engine(model, 16, **spec)
        static = StaticStep(model, eng.kv_pool, eng.state_pool, MAX_RUNNING, CTX, max_tokens=3,   # and verifies
                            nextn_kv_layer=nextn(eng).kv_layer if spec else None)                 # and the head
        for B, T in static.shapes:
            t = static.tensors(B, T, static.width)
            with monkeypatch.context() as m, torch.inference_mode(), NoHostReads():
                for name in ("tolist", "numpy", "cpu"):
                    m.setattr(torch.Tensor, name, read)
                static.eager("step", T, static.max_len, t)
                if spec:
                    static.eager("draft", T, static.max_len, t)


def test_static_decode_with_a_short_pool(dense):
    """A KV pool shorter than the context: the page table and the attention bound are the pool's length."""
    eng = make_engine(dense, 16, engine={"kv_cache_tokens": 256})
    static = static_steps(eng)
    assert static.max_len == 256 and static.width == 16
    schedule = [(0, tokens(30, 1), 20), (0, tokens(50, 2), 20), (3, tokens(20, 3), 10)]
    want = drive(make_engine(dense, 16, engine={"kv_cache_tokens": 256}), schedule)
    assert drive(eng, schedule) == want
    assert_no_leaks(eng)


def test_a_page_row_follows_its_requests_pages(dense):
    """The runner keeps each request's pages as an array between steps (ModelRunner._page_row): pages appended
    extend it, a list replaced whole (the prefix cache's match, a release) is read again, even at the same length."""
    from tinyserve.sampling import SamplingParams
    eng = make_engine(dense, 16)
    runner = eng.runner
    req = eng.intake.make_request(tokens(5, 1), SamplingParams(max_tokens=1), None)
    req.pages = [3, 4]
    assert runner._page_row(req).tolist() == [3, 4]
    req.pages += [9]
    assert runner._page_row(req).tolist() == [3, 4, 9]
    req.pages = [7, 8, 1]
    assert runner._page_row(req).tolist() == [7, 8, 1]
    req.pages = []
    assert runner._page_row(req).tolist() == []


@pytest.mark.skipif(TEST_DEVICE == "cpu", reason="on the CPU engine.compile_steps compiles (tests/test_compiled.py)")
def test_the_engine_captures_on_cuda(dense):
    static = make_engine(dense, 16, engine={"compile_steps": True}).runner.steps
    assert static is not None and static.for_graphs
    assert sorted(static.graphs) == [(B, 1) for B in graph_batch_sizes(MAX_RUNNING)]
    assert make_engine(dense, 16).runner.steps is None


def test_the_plan_counts_the_graphs(dense):
    mc = dense.cfg
    weights = WeightCount(sum(p.numel() for p in dense.parameters()), 0, 0)
    base = {"model": {"dtype": "float32"}, "engine": {"max_running_requests": 8}}
    on = MemoryPlan.resolve(from_dict(base), mc, "cuda", weights, gpu_free_bytes=8 << 30)
    off = MemoryPlan.resolve(from_dict(merge(base, {"engine": {"compile_steps": False}})), mc, "cuda", weights,
                             gpu_free_bytes=8 << 30)
    assert on.graph_bytes > 0 and off.graph_bytes == 0
    assert "CUDA graphs" in str(on) and "CUDA graphs" not in str(off)
    more = MemoryPlan.resolve(from_dict(merge(base, {"engine": {"max_running_requests": 64}})), mc, "cuda", weights,
                              gpu_free_bytes=8 << 30)
    assert more.graph_bytes > on.graph_bytes
    assert MemoryPlan.resolve(from_dict(base), mc, "cpu", weights).graph_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("nextn", [False, True], ids=["decode", "nextn"])
def test_captured_graphs_replay_the_eager_tokens(tmp_path, nextn):
    """On a GPU: the graphs are captured at engine start (one per shape: batch size x tokens per sequence, 1 + the
    draft steps with NEXTN), decode and verify steps replay them, and the greedy tokens equal an engine with
    engine.compile_steps = false and no speculation; after an idle release they are captured again."""
    folder, _ = make_qwen3_5_text(tmp_path / "q35", with_mtp=nextn, max_position_embeddings=CTX)
    if nextn:
        make_agreeing_head(folder, mix=0.3)
    model = load_model(folder, torch.float32, "cuda")
    schedule = workload(16)
    eager = make_engine(model, 16)
    assert eager.runner.steps is None
    want = drive(eager, schedule)

    spec = {"speculative": {"num_steps": 3, "max_running": 3}} if nextn else {}
    eng = make_engine(model, 16, engine={"compile_steps": True}, **spec)
    static = eng.runner.steps
    shapes = sorted((kind, B, T) for kind in static.kinds() for B in graph_batch_sizes(MAX_RUNNING)
                    for T in range(1, static.max_tokens + 1))
    assert static is not None and sorted(static.graphs) == shapes
    assert static.max_tokens == (1 + eng.nextn.num_steps if nextn else 1)
    replays = []

    class Counted:
        def __init__(self, graph, shape):
            self.graph, self.shape = graph, shape

        def replay(self):
            replays.append(self.shape)
            self.graph.replay()
    static.graphs = {bt: Counted(g, bt) for bt, g in static.graphs.items()}
    rec = Recorder(static)
    assert drive(eng, schedule) == want
    assert [bt for kind, *bt in replays if kind == "step"] == [[B, T] for _, B, T in rec.steps]
    assert any(n < B for n, B, _ in rec.steps)
    assert any(T > 1 for _, _, T in rec.steps) == nextn
    check_scratch(eng)
    assert_no_leaks(eng)

    idle = IdleRelease(1.0, eng.kv_pool, eng.state_pool, eng.allocator, eng.cache, eng.copies, eng.runner)
    eng.idle = idle
    idle.idle_since = time.monotonic() - 2                   # idle for longer than its second
    idle.release()
    assert idle.pools_freed and not static.graphs
    assert idle.wake() and sorted(static.graphs) == shapes
    assert drive(eng, schedule) == want
    assert_no_leaks(eng)
