"""What the text model and the vision tower share: parameters laid out empty, and the weight loaders that map a
checkpoint's tensor names to them."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from tinyserve.kernels.fp8_weight import Fp8Weight


def empty_param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class WeightLoaders:
    """Maps canonical checkpoint tensor names to (expected shape, copy function) for one module tree.

    `parts` records the tensors copied as they are into rows of a parameter (name -> (parameter, first row); for
    stacked experts [E, N, K] the first row within its expert): the loader keeps a checkpoint's FP8 tensors FP8 only
    where whole parameters are filled that way. A loader of an Fp8Weight's rows takes the FP8 values and their
    scales, already in the weight's block layout."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.loaders: dict[str, Callable[..., None]] = {}
        self.parts: dict[str, tuple[nn.Parameter | Fp8Weight, int]] = {}

    def add(self, name: str, shape: tuple[int, ...], target: torch.Tensor | Fp8Weight,
            transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        if isinstance(target, Fp8Weight):
            assert transform is None, name        # rows reordered at load never stay FP8 (the loader's rule)
            return self.add_rows(name, shape, target, 0)
        self.shapes[name] = tuple(shape)
        if transform is None and isinstance(target, nn.Parameter):
            self.parts[name] = (target, 0)

        def load(t: torch.Tensor) -> None:
            with torch.no_grad():
                target.copy_((transform(t) if transform else t).reshape(target.shape))
        self.loaders[name] = load

    def add_norm(self, name: str, shape: tuple[int, ...], scale: nn.Parameter, dtype: torch.dtype) -> None:
        """A zero-centred RMSNorm weight w into its fp32 scale 1 + w, from w rounded to the model's dtype (as the
        checkpoint's own implementation holds it before adding 1 in fp32)."""
        self.add(name, shape, scale, lambda t: 1.0 + t.to(dtype).float())

    def add_rows(self, name: str, shape: tuple[int, ...], param: nn.Parameter | Fp8Weight, start: int,
                 expert: int | None = None) -> None:
        """A checkpoint tensor that fills rows start:start+shape[0] of a fused parameter (of expert `expert` of
        stacked experts [E, N, K])."""
        rows = shape[0]
        if isinstance(param, Fp8Weight):
            self.shapes[name] = tuple(shape)
            weight, scale_rows = (param.weight, param.scale) if expert is None else \
                (param.weight[expert], param.scale[expert])

            def load(t: torch.Tensor, scale: torch.Tensor) -> None:
                b0 = param.block[0]
                weight[start:start + rows].copy_(t)
                scale_rows[start // b0:start // b0 + scale.shape[0]].copy_(scale)
            self.loaders[name] = load
        else:
            self.add(name, shape, (param if expert is None else param[expert])[start:start + rows])
        self.parts[name] = (param, start)

    def merge(self, prefix: str, other: "WeightLoaders") -> None:
        for n, s in other.shapes.items():
            self.shapes[prefix + n] = s
            self.loaders[prefix + n] = other.loaders[n]
            if n in other.parts:
                self.parts[prefix + n] = other.parts[n]


def place_on_huge_pages(module: nn.Module) -> tuple[int, object | None]:
    """Move a CPU module's parameters into one anonymous mapping advised MADV_HUGEPAGE (Linux; the default "madvise"
    THP setting otherwise leaves them on 4 KB pages). A decode step reads every weight once, and 2 MB pages spare it
    most TLB misses: ~10% more tokens/s for a lone decode on the bench model (2-core AMD EPYC). Only the weights,
    which live as long as the process: torch's own THP switch (THP_MEM_ALLOC_ENABLE) advises every large block, and
    the freed ones stay resident (a server's RSS grew ~190 MB in 30 s of tests/test_soak.py). Returns the bytes
    moved and the mapping, which the caller keeps alive with the module; (0, None) where madvise is missing."""
    import mmap
    params = [p for p in module.parameters() if p.device.type == "cpu" and p.numel()]     # tied ones once
    if not params or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0, None
    align = 64                                           # every weight on a cache line, as torch's allocator does
    sizes = [-(-p.numel() * p.element_size() // align) * align for p in params]
    mapping = mmap.mmap(-1, sum(sizes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = 0
    for p, size in zip(params, sizes):
        view = buffer[offset:offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
        offset += size
    return offset, mapping
