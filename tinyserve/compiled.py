"""The CPU's static steps (static.py) compiled by torch.compile: a decode step as a few fused C++ loops around the
GEMMs instead of some two thousand eager ops, each paying Python's and the dispatcher's overhead.

What is compiled: static.target_forward (a decode step, T = 1, and a NEXTN verify, T = 1 + drafts) and, with NEXTN,
static.draft_forward (the head's passes), per tokens per sequence T, with the batch size and the page table's width
dynamic: one graph for a lone sequence (what one request decodes through, fully specialised) and one for 2 ..
max_running_requests sequences, at any context length. All of them are compiled at start, before the server
answers /health, by running each once on padding rows (the scratch page and slot), and never again: a step whose
shapes no graph covers (a guard that fails) runs eagerly, with one warning, instead of compiling for seconds in
the middle of serving. Inductor keeps what it built in `cache_dir`, so a restart only traces.

The weights are not frozen into the graphs (freezing copies them, once per graph): the GEMMs stay kernels.linear's
calls on the route chosen at start, and inductor fuses everything between them: norms, activations, rotary, the
GDN recurrence and conv, the attention's gathers, the KV and state writes (in place in the pools).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
import torch._dynamo

from tinyserve.static import StaticStep, StepTensors, draft_forward, target_forward

log = logging.getLogger("tinyserve.compiled")

RECOMPILE_LIMIT = 64      # graphs per compiled function: 2 batch-size classes x T x (widths 2+, and any split)


def use_cache_dir(folder: Path) -> Path:
    """Inductor's on-disk cache (generated C++, compiled libraries, FX graphs) in `folder`, unless the user chose
    one with TORCHINDUCTOR_CACHE_DIR. Returns the folder in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")    # importing torch._dynamo sets it to torch's default
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


class CompiledSteps:
    """The compiled forwards of a StaticStep (for_graphs False), called as static.forward calls them."""

    def __init__(self, static: StaticStep) -> None:
        assert not static.for_graphs and static.model.device.type == "cpu"
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        self.static = static
        self._target = torch.compile(target_forward, fullgraph=True)
        self._draft = torch.compile(draft_forward, fullgraph=True) if static.nextn_kv_layer is not None else None
        self._warned = False

    def build(self) -> float:
        """Compile every graph a step can need by running each shape once on padding rows: per forward and T, one
        sequence and then 2 and the most (the dynamic graph, and whatever guard its range splits on). Logs a line
        per graph and the total; returns the seconds taken. Raises what the compiler raised."""
        st, start = self.static, time.perf_counter()
        st._pad()
        kinds = ["step"] + (["draft"] if self._draft is not None else [])
        widths = sorted({min(st.width, w) for w in (2, 3, st.width)})
        count = 0
        with torch.inference_mode():
            for kind in kinds:
                name = "decode / verify" if kind == "step" else "NEXTN head"
                for T in range(1, st.max_tokens + 1):
                    for B in sorted({1, min(2, st.sizes[-1]), st.sizes[-1]}):
                        for W in widths:
                            t0 = time.perf_counter()
                            self._call(kind, T, st.tensors(B, T, W), mark=True)
                            took = time.perf_counter() - t0
                            if took > 0.5:    # a new graph (a cached one is a call of a few milliseconds)
                                count += 1
                                log.info("compiled the %s forward for %d sequence(s) x %d token(s) (page table %d "
                                         "wide) in %.1f s", name, B, T, W, took)
        total = time.perf_counter() - start
        log.info("compiled %d CPU step graphs (%s; tokens per sequence 1..%d; any batch size up to %d, any "
                 "context) in %.1f s", count, " and ".join(kinds), st.max_tokens, st.sizes[-1], total)
        return total

    def _call(self, kind: str, T: int, t: StepTensors, mark: bool = False) -> torch.Tensor:
        st = self.static
        kv, conv, ssm = st.pools()
        hidden = st.draft_in[:t.input_ids.shape[0]] if kind == "draft" else None
        if mark:                # the batch size and the page table's width dynamic (a size of 1 stays a constant)
            for x in (*t, hidden) if hidden is not None else t:
                torch._dynamo.maybe_mark_dynamic(x, 0)
            torch._dynamo.maybe_mark_dynamic(t.page_table, 1)
        if kind == "step":
            return self._target(st.model, T, None, kv, conv, ssm, t)
        return self._draft(st.model, T, None, st.nextn_kv_layer, kv, hidden, t)

    def __call__(self, kind: str, T: int, max_len: int | None, t: StepTensors) -> torch.Tensor:
        """The forward through the graphs compiled at start; eagerly (with one warning) where none fits."""
        # Only the guards that tell the graphs apart are checked (5-10% of a lone decode step's time on the bench
        # model): build() ran every shape static.py routes here (B, T, and the page table's width from 2 up), and
        # nothing else a guard reads (the weights, the pools' shapes, the kernel backend) changes while serving.
        try:
            with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
                return self._call(kind, T, t)
        except RuntimeError as e:
            if "recompil" not in str(e).lower():
                raise
            if not self._warned:
                self._warned = True
                log.warning("a %s step of %d sequence(s) x %d token(s) needs a graph not compiled at start: such "
                            "steps run eagerly (%s)", kind, t.page_table.shape[0], T, str(e).splitlines()[0])
            return self.static.eager(kind, T, max_len, t)

