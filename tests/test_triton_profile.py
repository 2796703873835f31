"""The pure parts of `bench/gpu.py --profile` (bench/gpu_profile.py) on the CPU: the cards' roofs by name, each kernel's bytes and FLOPs
from its call, the host pass that records a step's calls and launches (through the real kernels, interpreted), and
the join of device times into tables (a) and (b). The profile itself needs a CUDA machine."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from triton_setup import DEV, backend, gen_, rnd  # noqa: F401  (first)
from tinyserve.kernels.fp8_weight import FP8, Fp8Weight  # noqa: E402
from tinyserve.kernels.linear import InputNorm, linear  # noqa: E402

pytestmark = pytest.mark.slow          # the interpreter: left out of the quick tier with the other Triton files
_spec = importlib.util.spec_from_file_location("gpu_profile",
                                               Path(__file__).parent.parent / "bench" / "gpu_profile.py")
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


@pytest.mark.parametrize("name, card", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA GeForce RTX 5090", "RTX 5090"), ("NVIDIA L40S", "L40S"), ("NVIDIA L40", "L40"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"), ("NVIDIA A100-SXM4-40GB", "A100 40GB")])
def test_roofs_by_device_name(name, card):
    assert gpu.roofs_for(name).card == card


def test_unknown_card_takes_the_measured_bandwidth():
    r = gpu.roofs_for("Some Future GPU", 1.5e12)
    assert r.hbm == 1.5e12 and r.bf16 != r.bf16 and "unknown" in r.card
    h200 = gpu.roofs_for("NVIDIA H200")
    assert h200.hbm == 4.8e12 and h200.fp8 == 2 * h200.bf16       # the datasheet's dense rates


def fp8_weight(N: int, K: int) -> Fp8Weight:
    w = Fp8Weight(N, K, (128, 128), DEV, act_quant=True)
    w.weight.copy_((torch.randn(N, K, generator=gen_(1)) * 50).clamp(-448, 448).to(FP8))
    w.scale.fill_(1e-3)
    return w


def test_gemm_cost():
    """A fused gate_up + silu_mul decode GEMM: the FP8 weight and its scales, x in, [M, N / 2] out; 2 M N K."""
    M, N, K = 3, 256, 384
    w, x = fp8_weight(N, K), torch.zeros(M, K, dtype=torch.float16)
    c = gpu.OP_COSTS["linear_triton.decode_linear"]({"x": x, "weight": w, "silu_mul": True})
    assert c.nbytes == N * K + 2 * 3 * 4 + M * K * 2 + M * N // 2 * 2
    assert c.flops == 2 * M * N * K and c.fp8
    plain = gpu.OP_COSTS["fp8_triton.fp8_linear"]({"x": x, "w": torch.zeros(N, K, dtype=torch.float16)})
    assert plain.nbytes == N * K * 2 + M * K * 2 + M * N * 2 and not plain.fp8


def test_every_costed_function_exists_with_the_arguments_its_cost_reads():
    """OP_COSTS names the Triton modules' public functions; a renamed one would silently drop out of the profile."""
    import inspect
    from importlib import import_module
    for key in gpu.OP_COSTS:
        module, name = key.split(".")
        fn = getattr(import_module(f"tinyserve.kernels.{module}"), name)
        params = set(inspect.signature(fn).parameters)
        assert params & {"x", "q", "ba", "k"}, key


def test_attention_costs():
    """Decode: every row's keys once; a verify's rows (table_rows) share their sequence's keys. Prefill: the causal
    pairs of each sequence's new tokens over its whole context."""
    kv = torch.zeros(10, 2, 16, 2, 32, dtype=torch.float16)            # [pages, 2, page, KV, hd]
    q = torch.zeros(3, 4, 32, dtype=torch.float16)
    per_key = 2 * 2 * 32 * 2
    lens = torch.tensor([100, 101, 102])
    dec = gpu.OP_COSTS["attention_triton.paged_attention_decode"]({"q": q, "kv_cache": kv, "seq_lens": lens})
    assert dec.nbytes == 303 * per_key + 2 * q.numel() * 2 and dec.flops == 4 * 303 * 4 * 32
    ver = gpu.OP_COSTS["attention_triton.paged_attention_decode"](
        {"q": q, "kv_cache": kv, "seq_lens": lens, "table_rows": torch.tensor([0, 0, 0])})
    assert ver.nbytes == 102 * per_key + 2 * q.numel() * 2
    cu, seq_lens = [0, 2, 3], [5, 1]                   # 2 new tokens after 3 cached; 1 new token, nothing cached
    pairs = sum(L - n + j + 1 for (n, L) in [(2, 5), (1, 1)] for j in range(n))
    pre = gpu.OP_COSTS["attention_sdpa.prefill"]({"q": q, "kv_cache": kv, "cu_seqlens": cu, "seq_lens": seq_lens})
    assert pre.flops == 4 * pairs * 4 * 32 and pre.nbytes == 6 * per_key + 2 * q.numel() * 2


def test_aten_costs():
    pool = torch.zeros(1 << 20)
    values = torch.zeros(64)
    c = gpu.aten_cost("index_put_", [pool, torch.zeros(64, dtype=torch.long), values], [pool])
    assert c.nbytes == 64 * 8 + 64 * 4 + 64 * 4                       # indices and values in, values written
    a, b = torch.zeros(4, 8), torch.zeros(8, 16)
    mm = gpu.aten_cost("mm", [a, b], [torch.zeros(4, 16)])
    assert mm.flops == 2 * 4 * 8 * 16 and mm.nbytes == (32 + 128 + 64) * 4
    table = torch.zeros(1 << 22)
    row = gpu.aten_cost("embedding", [table, torch.zeros(1, dtype=torch.long)], [torch.zeros(4)])
    assert row.nbytes < 1 << 21                                         # the table is indexed, not read whole


class TinyForward(torch.nn.Module):
    """Stands for a model: one fused decode GEMM and a residual add, as a step's forward would call them."""

    def __init__(self) -> None:
        super().__init__()
        self.w = fp8_weight(64, 256)
        self.norm = InputNorm(torch.ones(256), 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :64] + linear(x, self.w, norm=self.norm)


def test_recording_a_step():
    """The host pass: each kernel function's call with its cost and the Triton kernels it launched; launches counted
    inside the model's forward only; the same calls made outside add cost but no launches."""
    model = TinyForward()
    x = rnd(2, 256, gen=gen_(2))
    with backend("triton"), gpu.recording(gpu.Tally(), model) as tally:
        model(x)
        linear(x, model.w)                                           # outside the forward (as the logits are)
    calls, nbytes, flops, fp8, kernels = tally.ops["linear_triton.decode_linear"]
    assert calls == 2 and fp8 and kernels == {"_decode_gemm_kernel"}
    assert flops == 2 * 2 * 2 * 64 * 256
    assert tally.launches == {"triton _decode_gemm_kernel": 1, "torch add": 1}
    assert tally.ops["torch: other ops"][0] == 1                     # the residual add
    assert "forward" not in vars(model)                              # the model is left as it was


def test_per_step_is_the_difference_over_steps():
    one, many = gpu.Tally(), gpu.Tally()
    for t, n in ((one, 1), (many, 5)):
        for _ in range(n):
            t.add("norm_triton.rms_norm", gpu.Cost(100, 0), ("_rms_norm_kernel",))
        t.launches = {"triton _rms_norm_kernel": n}
    step = many.per_step(one, 4)
    assert step.ops["norm_triton.rms_norm"][:3] == [1, 100, 0] and step.launches == {"triton _rms_norm_kernel": 1}


def test_tables_join_device_times():
    tally = gpu.Tally()
    tally.add("linear_triton.decode_linear", gpu.Cost(2_000_000, 4_000_000, True), ("_decode_gemm_kernel",))
    tally.add("norm_triton.rms_norm", gpu.Cost(20_000, 0), ("_rms_norm_kernel",))
    tally.add("torch: other ops", gpu.Cost(1_000, 0))
    tally.launches = {"triton _decode_gemm_kernel": 1, "triton _rms_norm_kernel": 1, "torch add": 1}
    kernel_us = {"_decode_gemm_kernel": 1.0, "_rms_norm_kernel": 2.0,
                 "void at::native::vectorized_elementwise_kernel<4, add>": 1.0, "Memcpy HtoD (Pageable -> Device)": 0.5}
    roofs = gpu.Roofs("test", 4e12, 1e15, 2e15)
    rows = {r[0]: r for r in gpu.profile_rows(tally, kernel_us, 10.0, roofs)}
    gemm = rows["linear_triton.decode_linear"]
    assert gemm[2] == 1.0 and gemm[3] == 0.1
    assert abs(gemm[6] - 2000) < 1e-6 and abs(gemm[7] - 0.5) < 1e-9   # 2 MB in 1 us: 2 TB/s, half of 4 TB/s
    assert abs(gemm[9] - 4e6 / 1e-6 / 2e15) < 1e-9                    # against the FP8 roof
    assert rows["torch: other ops"][2] == 1.0 and rows["copies"][2] == 0.5
    lines = gpu.format_profile("t", list(rows.values()), 10.0, tally.launches, 4)
    text = "\n".join(lines)
    assert "2 Triton kernels + 1 torch ops" in text and "kernels on the device per step (the profiler): 4" in text
    assert "launch gaps and host work 6 us (55%)" in text and "non-GEMM kernels 35% of the step" in text


@pytest.mark.parametrize("kernel, op", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "torch: cuBLAS GEMM"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNN", "torch: cuBLAS GEMM"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64>>", "attention_sdpa.prefill"),
    ("Memset (Device)", "copies"), ("void at::native::index_elementwise_kernel", "torch: other ops")])
def test_device_kernels_find_their_rows(kernel, op):
    assert gpu.device_op(kernel, {"_prefill_kernel": "attention_sdpa.prefill"}) == op
