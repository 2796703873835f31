"""4-bit linear weights kept packed in memory (weight-only: activations stay in the model's dtype). The GEMMs that
read them are kernels/w4.py (torch reference and the CPU kernel) and kernels/w4_triton.py (CUDA).

A weight W [N, K] is held as a 4-bit code per element and a scale per group of `group` consecutive input columns:
  int4 (GPTQ, AWQ, compressed-tensors pack-quantized):  W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]
  fp4  (NVFP4: ModelOpt, compressed-tensors nvfp4):      W[n, k] = (E2M1[q[n, k]] * scale[n, g]) * global_scale
with g = k // group, each product computed in fp32 and rounded once to the model's dtype (what `dequantize` does and
what every format's own dequantization gives: tests/test_four_bit.py checks each against its package's unpacking).
Codes are unsigned 0..15 whatever the format stores (a signed int4 v is stored as v + 8 with zero 8); E2M1 codes
have the sign in bit 3 and magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. An FP8 e4m3 group scale of NVFP4 is held as the
float32 it equals (exactly).

The layout, one for every format (each loader repacks into it: tinyserve/four_bit.py):
  codes   uint8 [N, K // 2]   column 2j in the low nibble of byte j, column 2j + 1 in the high nibble: each output
                              row reads its K columns contiguously (what a decode's GEMV streams)
  scales  [N, K // group]     float32, float16 or bfloat16 (as the checkpoint stores them)
  zeros   uint8 [N, K // group] int4 with a zero point per group (asymmetric); None: every zero is `zero_point`
  perm    int64 [K] or None   act-order (GPTQ desc_act, compressed-tensors actorder "group"): the columns were sorted
                              by their group at load so that groups are contiguous runs of `group` columns, and
                              y = x[..., perm] @ W_sorted^T
With `experts`, every buffer has a leading E dimension (a MoE layer's stacked experts); `expert(e)` is one of them.

On the CPU the loader then interleaves the codes of each block of BLOCK_ROWS output rows (`block_rows`, where
K % 64 == 0): the block's bytes are its rows' first PIECE bytes, one row after the other, then their next PIECE
bytes, and so on; the last N % BLOCK_ROWS rows stay rows. The CPU GEMM computes a block of rows at a time
(kernels/w4_cpu.c), so it then reads each block as one stream rather than four: 7-11% less time for one decode row
of the bench model's projections and ~6% for eight (docs/benchmarks.md). `row_codes` gives the codes as rows again.
"""
from __future__ import annotations

import torch
from torch import nn

KINDS = ("int4", "fp4")
BLOCK_ROWS, PIECE = 4, 32                        # the CPU layout's blocks of rows and its pieces of a row (bytes)
FP4_GROUP = 16                                   # NVFP4's group size
# E2M1 values of codes 0..15 (bit 3 the sign)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class W4Weight(nn.Module):
    """A linear weight [N, K] held as 4-bit codes with group scales (the module docstring's layout)."""

    # model.int8_activations (int4 weights on the CPU): x is rounded to int8 per group before the product
    # (`int8_rounded`); build.round_activations_to_int8 sets it on every 4-bit weight of the model
    int8_activations = False

    def __init__(self, out_features: int, in_features: int, group: int, kind: str = "int4",
                 scale_dtype: torch.dtype = torch.float16, asymmetric: bool = False, zero_point: int = 8,
                 act_order: bool = False, global_scale: float = 1.0, device="cpu", experts: int | None = None):
        super().__init__()
        assert kind in KINDS, kind
        assert in_features % group == 0 and group % 2 == 0, (in_features, group)
        assert kind == "int4" or (group == FP4_GROUP and not asymmetric and not act_order)
        self.kind, self.group, self.zero_point, self.global_scale = kind, group, zero_point, float(global_scale)
        self.blocked = False                     # the codes' blocks of rows interleaved (block_rows)
        lead = () if experts is None else (experts,)
        groups = in_features // group
        self.register_buffer("codes", torch.empty(lead + (out_features, in_features // 2), dtype=torch.uint8,
                                                  device=device))
        self.register_buffer("scales", torch.empty(lead + (out_features, groups), dtype=scale_dtype, device=device))
        self.register_buffer("zeros", torch.empty(lead + (out_features, groups), dtype=torch.uint8, device=device)
                             if asymmetric else None)
        self.register_buffer("perm", torch.empty(lead + (in_features,), dtype=torch.int64, device=device)
                             if act_order else None)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def in_features(self) -> int:
        return self.codes.shape[-1] * 2

    def nbytes(self) -> int:
        """The bytes this weight holds (what the memory plan counts)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros, self.perm)
                   if t is not None)

    @staticmethod
    def bytes_for(out_features: int, in_features: int, group: int, scale_element_size: int, asymmetric: bool = False,
                  act_order: bool = False, experts: int | None = None) -> int:
        """What nbytes() of a W4Weight of these arguments will be (the memory plan counts it from headers alone)."""
        groups = in_features // group
        one = (out_features * in_features // 2 + out_features * groups * scale_element_size
               + (out_features * groups if asymmetric else 0) + (in_features * 8 if act_order else 0))
        return one * (experts or 1)

    @classmethod
    def of(cls, codes: torch.Tensor, scales: torch.Tensor, group: int, kind: str = "int4",
           zeros: torch.Tensor | None = None, zero_point: int = 8, perm: torch.Tensor | None = None,
           global_scale: float = 1.0) -> "W4Weight":
        """A W4Weight over these buffers, already in the module docstring's layout (nothing is copied): what a
        checkpoint's 4-bit tensors are repacked into (tinyserve/four_bit.py)."""
        assert kind in KINDS and codes.dtype == torch.uint8 and codes.shape[-1] * 2 % group == 0, (kind, group)
        assert tuple(scales.shape) == (*codes.shape[:-1], codes.shape[-1] * 2 // group), (codes.shape, scales.shape)
        assert zeros is None or (zeros.dtype == torch.uint8 and zeros.shape == scales.shape)
        assert perm is None or (perm.dtype == torch.int64 and tuple(perm.shape) == (*codes.shape[:-2],
                                                                                    codes.shape[-1] * 2))
        w = cls.__new__(cls)
        nn.Module.__init__(w)
        w.kind, w.group, w.zero_point, w.global_scale = kind, group, zero_point, float(global_scale)
        w.blocked = False
        for name, t in (("codes", codes), ("scales", scales), ("zeros", zeros), ("perm", perm)):
            w.register_buffer(name, t)
        return w

    def copy_rows(self, start: int, part: "W4Weight") -> None:
        """Fill rows start:start + part's rows of this 2-D weight (or one expert's view) from `part`, a weight of the
        same layout (a checkpoint tensor that is one part of a fused projection: q of q|k|v, gate of gate|up). An
        act-order permutation is the whole weight's: every part of one weight carries the same."""
        assert (part.kind, part.group, part.zero_point, part.global_scale, part.scales.dtype) == \
            (self.kind, self.group, self.zero_point, self.global_scale, self.scales.dtype), (part, self)
        assert (part.zeros is None) == (self.zeros is None) and (part.perm is None) == (self.perm is None)
        assert not self.blocked and not part.blocked, "rows are copied before the codes are blocked"
        rows = slice(start, start + part.codes.shape[-2])
        with torch.no_grad():
            self.codes[rows].copy_(part.codes)
            self.scales[rows].copy_(part.scales)
            if self.zeros is not None:
                self.zeros[rows].copy_(part.zeros)
            if self.perm is not None:
                self.perm.copy_(part.perm)

    def folded(self) -> "W4Weight":
        """An fp4 weight with its global scale multiplied into its float32 group scales (global_scale 1): how the
        parts of one weight that carry different global scales (q, k, v; each expert of a MoE layer) share one.
        Each scale is rounded once to float32, so the weight is within an ulp of float32 of the unfolded one."""
        assert self.kind == "fp4" and self.scales.dtype == torch.float32 and not self.blocked
        return W4Weight.of(self.codes, self.scales * self.global_scale, self.group, "fp4", perm=self.perm)

    def expert(self, e: int) -> "W4Weight":
        """Expert e of a stacked weight: a 2-D W4Weight over views of this one's buffers (nothing is copied)."""
        assert self.codes.dim() == 3, "not a stacked experts weight"
        view = W4Weight.__new__(W4Weight)
        nn.Module.__init__(view)
        view.kind, view.group, view.zero_point, view.global_scale, view.blocked = \
            self.kind, self.group, self.zero_point, self.global_scale, self.blocked
        view.int8_activations = self.int8_activations
        for name in ("codes", "scales", "zeros", "perm"):
            t = getattr(self, name)
            view.register_buffer(name, None if t is None else t[e])
        return view

    def block_rows(self) -> bool:
        """Interleave the codes of each block of BLOCK_ROWS rows in PIECE-byte pieces, in place (the module
        docstring's CPU layout); False, and nothing done, where a row is not a whole number of pieces."""
        N, half = self.codes.shape[-2:]
        if self.blocked or half % PIECE:
            return self.blocked
        full = N // BLOCK_ROWS * BLOCK_ROWS
        rows = self.codes[..., :full, :]         # [.., block, row, piece, byte] -> [.., block, piece, row, byte]
        pieces = rows.reshape(*rows.shape[:-2], full // BLOCK_ROWS, BLOCK_ROWS, half // PIECE, PIECE)
        with torch.no_grad():
            rows.copy_(pieces.transpose(-3, -2).reshape(rows.shape))
        self.blocked = True
        return True

    def row_codes(self, rows: slice = slice(None)) -> torch.Tensor:
        """These rows' codes as rows, uint8 [..., rows, K // 2]: a view of the codes when not blocked, else a copy of
        the blocks they lie in (the torch reference reads a weight a slice of rows at a time)."""
        if not self.blocked:
            return self.codes[..., rows, :]
        N, half = self.codes.shape[-2:]
        start, stop, step = rows.indices(N)
        assert step == 1, rows
        full = N // BLOCK_ROWS * BLOCK_ROWS                  # rows past it are stored as rows
        a = start // BLOCK_ROWS * BLOCK_ROWS
        b = max(a, min(full, -(-stop // BLOCK_ROWS) * BLOCK_ROWS))
        blocks = self.codes[..., a:b, :]                     # [.., block, piece, row, byte] -> [.., block, row, ..]
        pieces = blocks.reshape(*blocks.shape[:-2], (b - a) // BLOCK_ROWS, half // PIECE, BLOCK_ROWS, PIECE)
        codes = torch.cat((pieces.transpose(-3, -2).reshape(blocks.shape), self.codes[..., b:max(b, stop), :]), dim=-2)
        return codes[..., start - a:stop - a, :]

    def unpacked(self) -> torch.Tensor:
        """The codes, one per element: uint8 [..., N, K] (still in the sorted column order under act-order)."""
        codes = self.row_codes()
        low, high = codes & 0x0F, codes >> 4
        return torch.stack((low, high), dim=-1).flatten(-2)

    def dequantize(self, dtype: torch.dtype, rows: slice | None = None) -> torch.Tensor:
        """W in `dtype`, columns in the checkpoint's order (act-order undone): the module docstring's formula, in
        fp32, rounded once. rows: only these output rows (a prefill dequantizes a block of rows at a time)."""
        codes = self.unpacked() if rows is None else W4Weight._rows(self, rows).unpacked()
        scales = self.scales if rows is None else self.scales[..., rows, :]
        expand = lambda t: t.float().repeat_interleave(self.group, dim=-1)      # noqa: E731 - [.., N, K]
        if self.kind == "fp4":
            values = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)[codes.long()]
            w = values * expand(scales) * self.global_scale
        else:
            zeros = self.zero_point if self.zeros is None else \
                (self.zeros if rows is None else self.zeros[..., rows, :]).repeat_interleave(self.group, dim=-1)
            w = (codes.to(torch.int16) - zeros).float() * expand(scales)
        if self.perm is not None:                      # column j of the sorted weight is checkpoint column perm[j]
            w = torch.empty_like(w).index_copy_(-1, self.perm, w) if w.dim() == 2 else \
                torch.stack([torch.empty_like(we).index_copy_(-1, p, we) for we, p in zip(w, self.perm)])
        return w.to(dtype)

    @staticmethod
    def _rows(w: "W4Weight", rows: slice) -> "W4Weight":
        view = W4Weight.__new__(W4Weight)
        nn.Module.__init__(view)
        view.kind, view.group, view.zero_point, view.global_scale = w.kind, w.group, w.zero_point, w.global_scale
        view.blocked = False
        view.register_buffer("codes", w.row_codes(rows))
        view.register_buffer("scales", w.scales[..., rows, :])
        view.register_buffer("zeros", None if w.zeros is None else w.zeros[..., rows, :])
        view.register_buffer("perm", w.perm)
        return view

    def extra_repr(self) -> str:
        sym = "asymmetric" if self.zeros is not None else f"zero {self.zero_point}" if self.kind == "int4" else ""
        return (f"{tuple(self.shape)}, {self.kind}, group={self.group}, {sym}, scales {self.scales.dtype}"
                + (", act-order" if self.perm is not None else "") + (", blocked" if self.blocked else "")
                + (", int8 activations" if self.int8_activations else ""))


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (0..15) -> the packed layout [..., K // 2] (column 2j low nibble, 2j + 1 high)."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def int8_rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] (columns in a weight's sorted order) in float32 with each row's groups of `group` columns rounded
    to int8 steps, as model.int8_activations multiplies them: q * d, q = round(x * (127 / amax)) (ties to even),
    d = amax / 127, amax the group's largest |x| (a group of zeros stays zero). kernels/w4_cpu.c's int8 path computes
    the same product in integers (sum (q_w - z) q per group, times s d); a prefill multiplies these values."""
    xg = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    # a true division (a Python number over a tensor is a reciprocal times the number: off by an ulp at times)
    step = torch.where(amax > 0, amax.new_full((), 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(xg * step) * (amax / 127.0)).reshape(x.shape)
