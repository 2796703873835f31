"""The CPU's decode steps compiled by torch.compile: a decode step as a few fused C++ loops around the GEMMs instead
of some two thousand eager ops, each paying Python's and the dispatcher's overhead.

What is compiled: the model's static_forward (a decode step, T = 1, and a NEXTN verify, T = 1 + drafts) and, with
NEXTN, static.draft_forward (the head's passes) and static.head_kv_forward (its KV alone), per tokens per sequence
T, with the batch size and the page table's width dynamic: one graph for a lone sequence (what one request decodes
through, fully specialised) and one for 2 .. max_running_requests sequences (two where a GEMM route splits the
range), at any context length. A plain decode is the runner's batch as it is (`decode`, the runner's `compiled`:
the batch's tensors, nothing to pad); NEXTN's verifies and head passes go through the static step's buffers
(static.py, the runner's `steps`). And the LM head over one row (`lone_logits`: a step that samples one row, a
lone decode's). The plain decode's graphs and the LM head's are made at start, before the server answers /health; with
NEXTN the verify and head graphs not saved yet are compiled on a thread of their own while the server already
serves (a cold start would otherwise wait minutes for some twenty graphs), each forward's steps running eagerly until
its graphs are published. Nothing is compiled after that: a step whose shapes no graph covers runs eagerly, with
one warning, instead of compiling for seconds in the middle of serving.

Each graph is compiled ahead of time (torch.compile's `aot_compile`) and saved whole, dynamo's bytecode and shape
guards with inductor's library, as one file in the cache folder, named by a hash of everything it was traced from
(the source it runs through, torch, the model's tensors, the pools' shapes, the GEMM routes, the CPU, whether our
kernels' ops are C++ or Python, the example shapes): a restart loads the file instead of tracing the model again,
and a change to any of these compiles anew.

A graph runs under inductor's C++ wrapper: its fused loops, GEMMs and our kernels' ops are called one after the
other from C++, where inductor's default is a Python function of some thousand lines per graph (~0.8 ms of a ~6 ms
decode step of the 4-bit bench model; served, 4-5% more tokens/s: docs/benchmarks.md). Its cost is a longer cold
compile (the 4-bit bench model's three graphs: 130 s against 118), once per machine and model.

The weights are not frozen into the graphs (freezing copies them, once per graph): the GEMMs stay kernels.linear's
calls on the route chosen at start, and inductor fuses everything between them: norms, activations, rotary, the
GDN recurrence and conv, the attention's gathers, the KV and state writes (in place in the pools). The graphs read
the weights from the model they are called with.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch._dynamo

import tinyserve.static
from tinyserve.kernels import attention_cpu, gdn_cpu, linear, use_triton, w4_cpu
from tinyserve.kernels.w4_weight import W4Weight
from tinyserve.models.qwen3_next import ForwardBatch
from tinyserve.static import FORWARDS, StaticStep

log = logging.getLogger("tinyserve.compiled")

NAMES = {"step": "decode / verify", "draft": "NEXTN head", "head_kv": "NEXTN head's KV",   # by kind, for the log
         "logits": "LM head"}


def lone_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """One sampled row's logits [1, V] in float32 (a lone decode's, or a prefill's last row): the LM head multiplied
    in the graph's own code (kernels.linear's multiply-and-sum, both threads), where the eager call of one row
    reads the LM head at about half the memory's speed (bench model, bfloat16: 0.84 ms eagerly, 0.45 compiled)."""
    return model.compute_logits(hidden).float()


COMPILED = {**FORWARDS, "logits": lone_logits}     # by kind: what is compiled


def use_cache_dir(folder: Path) -> Path:
    """Inductor's on-disk cache (generated C++, compiled libraries, FX graphs) and our saved graphs in `folder`,
    unless the user chose one with TORCHINDUCTOR_CACHE_DIR. Returns the folder in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")    # importing torch._dynamo sets it to torch's default
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def _shape_guards_only(entries: list[Any]) -> list[bool]:
    """The guards a saved graph keeps: the sizes' ranges that tell its graphs apart. The rest (the model object,
    every tensor's dtype and static sizes, globals) is what the file's name hashes, and cannot all be saved."""
    return [e.guard_type == "SHAPE_ENV" for e in entries]


def _source_hash() -> str:
    """A hash of the source the graphs are traced through: the model and the kernels, static.py's forwards and
    this module (how they are traced). The rest of tinyserve (the API, the engine) runs outside the graphs, so
    editing it compiles nothing anew."""
    h = hashlib.sha256()
    files = [("static.py", Path(tinyserve.static.__file__)), ("compiled.py", Path(__file__))]
    for module in ("tinyserve.models", "tinyserve.kernels"):
        folder = Path(sys.modules[module].__file__).parent
        files += [(f"{module}/{p.relative_to(folder)}", p) for p in sorted(folder.rglob("*.py"))]
    for name, path in files:
        h.update(name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.stride()}{value.dtype}{value.device.type}"
    if isinstance(value, tuple):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    return repr(value) if isinstance(value, (int, str, type(None))) else type(value).__name__


def graphs_fingerprint(model: Any, triton: bool) -> str:
    """What the saved graphs' file names hash: torch, Python, the traced source, the CPU, the model's config, dtype,
    tensors and modules' settings (a 4-bit weight's group, layout and int8 activations are constants in the graph),
    the GEMM routes and which ops are C++."""
    fingerprint = [torch.__version__, sys.version, _source_hash(), torch.backends.cpu.get_cpu_capability(),
                   repr(model.cfg), str(model.dtype), repr(sorted(linear.traced_routes().items())), str(triton),
                   f"ops in C++: {CompiledSteps._ops_in_cpp(model)}"]
    fingerprint += [f"{n}{_describe(p)}" for n, p in model.state_dict(keep_vars=True).items()]
    fingerprint += [f"{n}: {m.extra_repr()}" for n, m in model.named_modules() if m.extra_repr()]
    return hashlib.sha256("\n".join(fingerprint).encode()).hexdigest()


class CompiledSteps:
    """The compiled forwards of a StaticStep (for_graphs False), called as StaticStep._forward_on calls them."""

    def __init__(self, static: StaticStep) -> None:
        assert not static.for_graphs and static.model.device.type == "cpu"
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        self.static = static
        self.folder = Path(cache_dir()) / "tinyserve-steps"
        # (kind, T, lone sequence) -> the graphs for it; more than one where a size guard split the batch range
        self.graphs: dict[tuple[str, int, bool], list[Any]] = {}
        self.pending: list[tuple[tuple[str, int, bool], list[tuple[int, int]]]] = []   # _shapes() not made yet
        self._thread: threading.Thread | None = None
        self._warned = False
        self.eager_steps = 0          # steps no graph covered
        self._fingerprint = graphs_fingerprint(static.model, use_triton(static.kv_pool.buffer))
        self.loaded = self.compiled = 0
        self.lm_head: Any = None       # the graph of lone_logits, made with the plain decode's

    @staticmethod
    def _ops_in_cpp(model: Any) -> dict[str, bool]:
        """Which of our C kernels' ops the graphs call are C++ and which the Python fallbacks (the GDN decode's:
        the torch reference): a graph calls the op it was traced with, which must exist in the process that loads
        it (asking loads the library, which registers the op)."""
        ops = {"attention": attention_cpu.op_in_cpp(), "GDN decode": gdn_cpu.built()}
        if any(isinstance(m, W4Weight) for m in model.modules()):
            ops["4-bit"] = w4_cpu.op_in_cpp()
        return ops

    def build(self, in_background: bool = False) -> float:
        """Make every graph a step can need, for each forward and T: one sequence, then 2 and the most sequences
        with page tables 2, 3 and the whole context wide; a shape the graphs so far do not cover (their size
        guards) gets its own, loaded from the cache folder or compiled and saved. With in_background only the plain
        decode's graphs (step, T = 1) are compiled now, the others saved are loaded, and the rest (NEXTN's verify
        and head passes) wait in `pending` for compile_pending. Logs a line per graph and the total; returns the
        seconds taken. Raises what the compiler raised."""
        st, start = self.static, time.perf_counter()
        st._pad()
        with torch.inference_mode():
            for key, shapes in self._shapes():
                graphs = self._make(st, key, shapes, compile=not in_background or key[:2] == ("step", 1))
                if graphs is None:
                    self.pending.append((key, shapes))
                else:
                    self.graphs[key] = graphs
            row = (st.model, torch.zeros(1, st.model.cfg.hidden_size, dtype=st.model.dtype))
            self.lm_head = self._load("logits", 1, 1, row) or self._compile("logits", 1, 1, 0, row, (), True)
            self.lm_head.disable_guard_check()     # one graph, one shape: the caller passes one row
        total = time.perf_counter() - start
        log.info("CPU step graphs ready in %.1f s: %d compiled, %d loaded from %s (%s; tokens per sequence 1..%d; "
                 "any batch size up to %d, any context)%s", total, self.compiled, self.loaded, self.folder,
                 " and ".join(st.kinds()), st.max_tokens, st.sizes[-1],
                 f"; {len(self.pending)} more to compile while serving" if self.pending else "")
        return total

    def compile_pending(self, on_ready: Callable[[], Any] | None = None) -> None:
        """Compile the pending graphs on a thread of their own (tinyserve-compile) while the engine serves: each
        forward's graphs are published together once made, and until then its steps run eagerly (the same math).
        The thread traces through a twin of the static step (buffers of its own) and runs no torch compute of its
        own: its graphs run first on the engine thread. on_ready: called on that thread when it is done."""
        twin = self.static.twin()

        def run() -> None:
            start, made = time.perf_counter(), 0
            if sys.platform == "linux":      # the serving thread first (a thread's own niceness on Linux)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            with torch.inference_mode():
                while self.pending:
                    key, shapes = self.pending[0]
                    try:
                        self.graphs[key] = self._make(twin, key, shapes, compile=True, warm_up=False)
                    except Exception as e:    # noqa: BLE001 - an op inductor cannot lower: these steps stay eager
                        log.warning("compiling the %s graphs for %d token(s) failed, those steps run eagerly: %s: %s",
                                    key[0], key[1], type(e).__name__, str(e).strip().splitlines()[0] if str(e) else "")
                    self.pending.pop(0)
                    made += 1
            log.info("the %d remaining CPU step graphs made while serving in %.1f s", made,
                     time.perf_counter() - start)
            if on_ready is not None:
                on_ready()

        self._thread = threading.Thread(target=run, name="tinyserve-compile", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for compile_pending's thread; True when no graph is pending."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.pending

    def _shapes(self) -> list[tuple[tuple[str, int, bool], list[tuple[int, int]]]]:
        """Each graph list's key (kind, T, lone sequence) and the (sequences, page-table width) shapes it covers,
        the plain decode's first."""
        st = self.static
        widths = sorted({min(st.width, w) for w in (2, 3, st.width)})
        many = sorted({min(2, st.sizes[-1]), st.sizes[-1]} - {1})
        return [((kind, T, lone), [(B, W) for B in ([1] if lone else many) for W in widths])
                for T in range(1, st.max_tokens + 1) for kind in st.kinds() for lone in (True, False)
                if lone or many]

    def _make(self, st: StaticStep, key: tuple[str, int, bool], shapes: list[tuple[int, int]], compile: bool,
              warm_up: bool = True) -> list[Any] | None:
        """The graphs of one key covering its shapes, each loaded from its file or (compile) compiled and saved;
        None when one is not saved and compile is False."""
        kind, T, _ = key
        graphs: list[Any] = []
        for B, W in shapes:
            t = st.tensors(B, T, W)
            args = st.args(kind, T, None, t)
            if any(g.guard_check(*args) for g in graphs):
                continue
            graph = self._load(kind, T, B, args)
            if graph is None and not compile:
                return None
            graphs.append(graph if graph is not None else self._compile(kind, T, B, W, args, t, warm_up))
        if len(graphs) == 1:          # the only graph of its kind covers every shape routed to it: checked above
            graphs[0].disable_guard_check()
        return graphs

    def _path(self, kind: str, T: int, B: int, args: tuple) -> Path:
        key = hashlib.sha256(f"{self._fingerprint}\n{kind}\n{_describe(args[1:])}".encode()).hexdigest()[:32]
        return self.folder / f"{kind}-{B}x{T}-{key}.bin"

    def _load(self, kind: str, T: int, B: int, args: tuple) -> Any | None:
        """The graph saved for this shape; None when there is none, or it cannot be used (logged)."""
        path, t0 = self._path(kind, T, B, args), time.perf_counter()
        if not path.exists():
            return None
        try:
            with path.open("rb") as f:
                module = sys.modules[COMPILED[kind].__module__]          # the traced function's globals
                graph = torch.compiler.load_compiled_function(f, f_globals=vars(module))
            if not graph.guard_check(*args):
                raise ValueError("its shape guards refuse the shape it was saved for")
        except Exception as e:        # noqa: BLE001 - a damaged file, another torch: compile it again
            log.warning("could not load the saved graph %s, compiling it again: %s: %s", path, type(e).__name__,
                        str(e).strip().splitlines()[0] if str(e).strip() else "")
            return None
        self.loaded += 1
        log.info("loaded the %s forward for %d sequence(s) x %d token(s) in %.1f s", NAMES[kind], B, T,
                 time.perf_counter() - t0)
        return graph

    def _compile(self, kind: str, T: int, B: int, W: int, args: tuple, t: tuple[torch.Tensor, ...],
                 warm_up: bool) -> Any:
        t0 = time.perf_counter()
        if B > 1:                     # the batch size and the page table's width dynamic (1 stays a constant)
            for x in t + ((args[5],) if kind != "step" else ()):
                torch._dynamo.maybe_mark_dynamic(x, 0)
        if t:
            torch._dynamo.maybe_mark_dynamic(t[4], 1)
        # no size, stride and alignment asserts on the outputs of the ops called out of the graph (the GEMMs): they
        # cost ~0.15 ms a step of 8 sequences, and every input is a contiguous tensor static.py made, laid out as
        # traced (its buffers, or a plain decode's batch: runner.pack); cpp_wrapper: see the module's docstring
        compile_fn: Callable = torch.compile(COMPILED[kind], fullgraph=True,
                                             options={"guard_filter_fn": _shape_guards_only, "size_asserts": False,
                                                      "alignment_asserts": False, "scalar_asserts": False,
                                                      "cpp_wrapper": True})
        with linear.fused_rows(fixed_rows=B == 1):
            graph = compile_fn.aot_compile((args, {}))
        if warm_up:
            graph(*args)              # runs once, as it will serve (on padding rows)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(kind, T, B, args)
        partial = path.with_suffix(f".{os.getpid()}.part")       # a crash mid-write leaves no damaged graph
        graph.save_compiled_function(str(partial))
        os.replace(partial, path)
        self.compiled += 1
        log.info("compiled the %s forward for %d sequence(s) x %d token(s) (page table %d wide) in %.1f s",
                 NAMES[kind], B, T, W, time.perf_counter() - t0)
        return graph

    def decode(self, batch: ForwardBatch) -> torch.Tensor:
        """A plain decode step's hidden rows: the runner's batch as it is (nothing to pad) through its graph."""
        st, state = self.static, self.static.state_pool
        return self._run("step", 1, len(batch.seq_lens) == 1, (
            st.model, 1, None, st.kv_pool.buffer, state.conv_all, state.ssm_all, batch.input_ids, batch.positions,
            batch.slot_mapping, batch.seq_lens_t, batch.page_table, batch.state_slots_t))

    def logits(self, row: torch.Tensor) -> torch.Tensor:
        """lone_logits of one hidden row [1, H] (contiguous, the model's dtype)."""
        return self.lm_head(self.static.model, row)

    def __call__(self, kind: str, T: int, max_len: int | None, t: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """A forward over the static step's tensors t (StaticStep._forward_on)."""
        return self._run(kind, T, t[4].shape[0] == 1, self.static.args(kind, T, max_len, t))

    def _run(self, kind: str, T: int, lone: bool, args: tuple) -> torch.Tensor:
        # through the graph covering this shape (a lone sequence's, or the one whose size guards take it); eagerly
        # where none does, with one warning unless its graphs are still being compiled
        graphs = self.graphs.get((kind, T, lone), [])
        for graph in graphs:
            if len(graphs) == 1 or graph.guard_check(*args):
                return graph(*args)
        self.eager_steps += 1
        if not self._warned and not any(key[:2] == (kind, T) for key, _ in self.pending):
            self._warned = True
            log.warning("a %s step of %d token(s) per sequence needs a graph not compiled at start: such steps run "
                        "eagerly", kind, T)
        return FORWARDS[kind](*args)
