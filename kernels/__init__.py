"""The compute kernels: one module per op. Each op has a torch reference (the CPU path and the test oracle) and,
in a `*_triton.py` module beside it, a Triton kernel with the same signature (the CUDA path).

Which one runs is decided per call by `use_triton(tensor)` from the backend set at start:
  "auto"   Triton for CUDA tensors when triton imports, the torch reference otherwise (the default); on the CPU an op
           with a C kernel beside it (`*_cpu.py`, `use_cpu_kernel`) runs that;
  "torch"  always the torch reference (debugging: rule the kernels out);
  "triton" always Triton (debugging; without CUDA only under TRITON_INTERPRET=1, as the tests run it).
The engine calls `set_backend(cfg.engine.kernels)` once before the first forward. Triton modules are imported only
when a Triton kernel first runs, so the CPU path never imports triton.

Every kernel takes a pool as `PoolLayer`: one layer of a pool laid out [rows, layers, ...]. The KV pool (rows are
pages) and the GDN state pools (rows are state slots) hold every layer of a row together, so a row moves to and from
the cache tiers in one piece. A kernel reads the layer through `rows` (a view) and writes it through `put`, which
indexes the whole pool with the layer as one more index (rows[index] = values: advanced indexing, ints select;
`PoolLayer.of` takes a plain tensor [rows, ...] as a pool of one layer). Written so, a compiled step (torch.compile / inductor)
updates the rows in place; a write into the layer's view makes inductor copy the whole layer (the whole KV or state
pool, every step) around it.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, NamedTuple

import torch

BACKENDS = ("auto", "torch", "triton")
MIN_TRITON = (3, 5)                # the GDN prefill kernels' bf16x3 dots (tl.dot input_precision) came in 3.5
_backend = "auto"
_triton: str | None = None         # "" when usable, else why not (checked once, on first need)


def triton_problem() -> str:
    """"" when the triton package imports and is MIN_TRITON or newer; else what is wrong, in a sentence."""
    global _triton
    if _triton is None:
        try:
            import triton
            found = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])
            _triton = "" if found >= MIN_TRITON else \
                f"the Triton kernels need triton >= {'.'.join(map(str, MIN_TRITON))}, found {triton.__version__}"
        except Exception as e:     # not installed, or no usable build for this machine
            _triton = f"the Triton kernels need the triton package ({type(e).__name__}: {e})"
    return _triton


def triton_available() -> bool:
    return not triton_problem()


def set_backend(name: str) -> None:
    """Choose the kernels for every later call: "auto" | "torch" | "triton" (engine.kernels)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(BACKENDS)}, found {name!r}")
    if name == "triton" and not triton_available():
        raise RuntimeError(f"engine.kernels = \"triton\": {triton_problem()}")
    if name == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("engine.kernels = \"triton\" without CUDA runs only under TRITON_INTERPRET=1")
    _backend = name


def backend() -> str:
    return _backend


@contextlib.contextmanager
def backend_set_to(name: str) -> Iterator[None]:
    """set_backend(name) for a with-block, then the backend before it (tests and benchmarks compare the two)."""
    old = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


# oneDNN's GEMM y = x W^T (torch's private op, what torch's own CPU compiler emits; None where torch has no oneDNN), and
# the dtypes it runs on this CPU: its bfloat16 GEMM needs AVX512 BW/VL/DQ or AVX-NE-CONVERT (on an AVX2-only CPU it
# cannot even be set up, a RuntimeError at the first call), so there bfloat16 goes to F.linear (MKL)
ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() \
    else None
ONEDNN_DTYPES = (torch.float32,) + ((torch.bfloat16,) if ONEDNN_LINEAR is not None
                                    and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ())


def use_cpu_kernel(x) -> bool:
    """Whether the op called with tensor x runs its C kernel (where it has one): the "auto" backend on the CPU."""
    return _backend == "auto" and x.device.type == "cpu"


def use_triton(x) -> bool:
    """Whether the op called with tensor x (its first tensor argument) runs the Triton kernel."""
    return _backend == "triton" or _backend == "auto" and x.is_cuda and triton_available()


class PoolLayer(NamedTuple):
    pool: torch.Tensor          # [rows, layers, ...]
    layer: int

    @staticmethod
    def of(x: "torch.Tensor | PoolLayer") -> "PoolLayer":
        return x if isinstance(x, PoolLayer) else PoolLayer(x.unsqueeze(1), 0)

    @property
    def rows(self) -> torch.Tensor:
        return self.pool.select(1, self.layer)

    def put(self, index: tuple[torch.Tensor | int, ...], values: torch.Tensor) -> None:
        first = index[0]
        full = [first, torch.full_like(first, self.layer)]
        for i in index[1:]:
            full.append(torch.full_like(first, i) if isinstance(i, int) else i)
        self.pool.index_put_(tuple(full), values.to(self.pool.dtype))
