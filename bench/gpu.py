"""The engine on a GPU with a random Qwen3.5-27B-shaped block-FP8 model (the seed's model at its real size), in one
run of a few minutes on a CUDA machine (tests/gpu.sh runs it after the tests):

    python3 bench/gpu.py                  # from the repository root, tinyserve installed (-e . is enough)
    python3 bench/gpu.py --profile        # instead: the step kernel by kernel against the card's roofs (< 5 min)
    python3 bench/gpu.py --sweep          # instead: the decode / prefill GEMM tiles around their defaults, timed
    .venv/bin/python bench/gpu.py --dry-run   # no GPU: the same script on a tiny model on the CPU (checks it)
    .venv/bin/python bench/gpu.py --profile --dry-run   # no GPU: the profile's host pass, kernels interpreted

The model: Qwen3.5-27B's config (64 layers, 48 GDN + 16 attention, hidden 5120, MLP 17408, NEXTN head) with the
linear weights FP8 where Qwen's FP8 release has them, laid out by the plan from a folder of safetensors headers
(`loader.read_checkpoint(keep_fp8=True)`, as `tinyserve --check` does) and filled with random values on the device
(writing and reading back 28 GiB would take most of the session; the loader is tested on the CPU). Its layers' output
projections and the NEXTN head are set so the head agrees with the model (tests/checkpoints.make_agreeing_head's
construction), so "with NEXTN" is close to speculation's upper bound (the table says how many drafts were
accepted; the depth is what the engine's measured step costs choose); the kernels do the same work on any values.

Printed, one table: decode tokens/s at batch 1 and 8 with and without NEXTN, and batch-1 decode against the HBM
bound (weight bytes per token over the bandwidth measured by a device copy; target >= 70%); prefill tokens/s at 8K
and 32K; TTFT of a 170K-token prompt; then table (c) of the profile, our kernels against peers' (`kernel_peers`:
flash-linear-attention's GDN kernels when fla imports, torch SDPA, torch._scaled_mm, cuBLAS).

--profile (bench/gpu_profile.py): a decode step at batch 1 (8K context) and batch 8 inside its CUDA graph, and one
8K prefill chunk, kernel by kernel (time, bytes, FLOPs, the fraction of the HBM and tensor-core roofs of the card,
read from its name); their sum against the measured step (launch gaps and host work); the peers' table. Also to
$OUT/gpu_profile.txt.
In-process through the engine (engine_for_model, offline generate): the HTTP server adds the same per-request costs
as on the CPU (bench/serve.py), not per-token ones. Everything printed also goes to $OUT/gpu.txt.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG: list[str] = []
sys.path.insert(0, str(ROOT / "tests"))
from header_only import QWEN3_5_27B, make_header_only  # noqa: E402 - Qwen3.5-27B's config; its header-only folder

TINY = dict(QWEN3_5_27B, vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, intermediate_size=128, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096)


def say(line: str = "") -> None:
    print(line, flush=True)
    LOG.append(line)


def header_folder(config: dict) -> Path:
    """config.json with Qwen's block-FP8 quantization_config and a safetensors file of headers alone (F8_E4M3 linear
    weights with float32 128x128 scales, the rest bf16): what the plan lays the model out from."""
    return make_header_only(Path(tempfile.mkdtemp(prefix="tinyserve-gpu-")) / "q35", config, fp8_block=(128, 128))


def random_model(folder: Path, device, dtype):
    """The model the plan lays out for `folder`, FP8 where it keeps FP8, random values, the NEXTN head agreeing."""
    import torch

    from tinyserve.kernels.fp8_weight import Fp8Weight
    from tinyserve.loader import read_checkpoint
    from tinyserve.models.qwen3_next import Qwen3NextForCausalLM
    from tinyserve.models.weights import QuantizedWeights
    mc, weights = read_checkpoint(folder, keep_fp8=device.type == "cuda")
    fp8 = QuantizedWeights(mc.fp8_blocks, act_quant=True) if mc.fp8_blocks else None
    model = Qwen3NextForCausalLM(mc, dtype, device, fp8)
    g = torch.Generator(device=device).manual_seed(0)
    outputs = ("o_proj", "out_proj", "mlp.down")            # zero: every layer passes its input through
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.1)
            else:
                p.copy_((torch.randn(p.shape, generator=g, device=device) * 0.02).to(p.dtype))
        for name, m in model.named_modules():
            if isinstance(m, Fp8Weight):
                m.weight.copy_((torch.randn(m.weight.shape, generator=g, device=device) * 64).clamp(-448, 448)
                               .to(m.weight.dtype))
                m.scale.fill_(0.02 / 64)
                if name.endswith(outputs):
                    m.scale.zero_()
        for name, p in model.named_parameters():
            if name.endswith(outputs):
                p.zero_()
        H = mc.hidden_size                                  # the head: fc = [I | 0], its norm the model's
        fc = model.mtp.fc
        if isinstance(fc, torch.nn.Parameter):
            fc.zero_()
            fc[:, :H] = torch.eye(H, device=device, dtype=fc.dtype)
        model.mtp.pre_fc_norm_embedding.copy_(model.norm)
        model.mtp.norm.copy_(model.norm)
        for layer in model.layers:
            mixer = layer.mixer
            if hasattr(mixer, "A_log"):
                mixer.A_log.copy_(torch.log(torch.rand(mixer.A_log.shape, generator=g, device=device) * 15 + 1))
                mixer.dt_bias.zero_()
    return mc, weights, model


def engine(model, nextn: bool, context: int, dry: bool, kernels: str = "auto"):
    from tinyserve.config import from_dict
    from tinyserve.build import compile_while_serving, engine_for_model
    tables = {"model": {"dtype": "float32" if dry else "bfloat16", "kv_cache_dtype": "auto" if dry else "fp8_e4m3",
                        "context_length": context},
              "engine": {"max_running_requests": 8, "chunked_prefill_size": 512 if dry else 8192, "page_size": 64,
                         "kv_cache_tokens": 8192 if dry else 0, "kernels": kernels},
              "cache": {"enabled": False}}
    if kernels == "triton" and dry:
        tables["engine"]["compile_steps"] = False      # the interpreted kernels, eagerly (not torch.compile's CPU code)
    if nextn:
        tables["speculative"] = {"num_steps": 3, "max_running": 8}
    eng = engine_for_model(from_dict(tables), model)
    if nextn:
        eng.nextn.price(eng)
        compiled = compile_while_serving(eng)     # the CPU's NEXTN graphs: all made before anything is timed
        if compiled is not None:
            compiled.wait()
    return eng


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def decode_rate(eng, batch: int, new: int, vocab: int, device) -> float:
    """Decode tokens/s: a run of `new` tokens minus a run of one (the prefill), over the extra tokens."""
    from tinyserve.sampling import SamplingParams
    ps = prompts(batch, 32, vocab, seed=batch)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    eng.generate(ps, many)                                  # warm-up: compiles every kernel variant
    t1 = timed(lambda: eng.generate(ps, one), device)
    tn = timed(lambda: eng.generate(ps, many), device)
    return batch * (new - 1) / max(1e-9, tn - t1)


def prefill_seconds(eng, length: int, vocab: int, device) -> float:
    from tinyserve.sampling import SamplingParams
    p = prompts(1, length, vocab, seed=length)
    return timed(lambda: eng.generate(p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)), device)


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read and written (the HBM bound's bandwidth)."""
    import torch
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    t = min(timed(lambda: b.copy_(a), device) for _ in range(5))
    return 2 * a.numel() / t


def kernel_peers(device, roofs) -> None:
    """Table (c): our kernels against peers' on the same inputs, where the peer imports: the chunked GDN and the
    recurrent GDN decode against flash-linear-attention's (fla; target >= 0.8x), prefill attention (ours against
    torch SDPA's flash kernels), the block-FP8 GEMM against torch._scaled_mm (row-wise scales; target >= 0.8x) and,
    at decode rows, cuBLAS's bf16 GEMM (twice the bytes: what the FP8 weights save)."""
    import torch
    if device.type != "cuda":
        say("   kernel peers: GPU only")
        return
    from triton.testing import do_bench

    from gpu_profile import OP_COSTS, Cost
    from tinyserve.kernels import attention_sdpa, attention_triton, backend_set_to
    from tinyserve.kernels.fp8_weight import Fp8Weight
    from tinyserve.kernels.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule_decode
    from tinyserve.kernels.linear import linear
    g = torch.Generator(device=device).manual_seed(1)

    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)
    say(f"{'op':<30} {'shape':<26} {'ours us':>9} {'HBM':>5} {'TC':>5}  {'peer':<22} {'peer us':>9} {'speed':>6}")

    def row(op: str, shape: str, cost: Cost, ours, peer_name: str, peer) -> None:
        with backend_set_to("triton"):
            t = do_bench(ours) * 1e3
        try:
            p, note = do_bench(peer) * 1e3, ""
        except Exception as e:                            # not installed, or an API change: say so, go on
            p, note = float("nan"), f" not run ({type(e).__name__}: {str(e)[:60]})"
        peak = roofs.fp8 if cost.fp8 else roofs.bf16
        tc = f"{cost.flops / (t * 1e-6) / peak:>5.0%}" if cost.flops and peak == peak else f"{'-':>5}"
        say(f"{op:<30} {shape:<26} {t:>9.1f} {cost.nbytes / (t * 1e-6) / roofs.hbm:>5.0%} {tc}  {peer_name:<22} "
            f"{p:>9.1f} {p / t:>5.2f}x{note}")

    H, HV, D = 16, 48, 128                                # Qwen3.5-27B's GDN heads
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except Exception as e:
        fla_chunk = fla_recurrent = None
        say(f"   fla not importable ({type(e).__name__}): its rows say so")
    for T in (1, 8, 8192):
        q = torch.nn.functional.normalize(randn(T, H, D, dtype=torch.float32), dim=-1).bfloat16()
        k = torch.nn.functional.normalize(randn(T, H, D, dtype=torch.float32), dim=-1).bfloat16()
        v, gate = randn(T, HV, D), -torch.rand(T, HV, generator=g, device=device) * 0.5
        beta = torch.rand(T, HV, generator=g, device=device)
        qs = q * D ** -0.5                                 # our kernels take q scaled; fla scales inside
        if T == 8192:
            pool = torch.zeros(2, HV, D, D, device=device)
            cost = OP_COSTS["gdn_triton.chunk_gated_delta_rule"]({"q": q, "k": k, "v": v, "state": pool,
                                                                  "slot_ids": [1]})
            row("gdn chunk (prefill)", f"{T} tokens", cost,
                lambda: chunk_gated_delta_rule(qs, k, v, gate, beta, pool, [0, T], [1]), "fla chunk",
                lambda: fla_chunk(q[None], k[None], v[None], g=gate[None], beta=beta[None], scale=D ** -0.5,
                                  initial_state=pool[:1], output_final_state=True))
        else:
            pool, slots = randn(T, HV, D, D, dtype=torch.float32, scale=0.1), torch.arange(T, device=device)
            cost = OP_COSTS["gdn_triton.recurrent_gated_delta_rule_decode"]({"q": q, "k": k, "v": v, "state": pool,
                                                                             "slot_ids": slots})
            row("gdn recurrent (decode)", f"{T} sequences", cost,
                lambda: recurrent_gated_delta_rule_decode(qs, k, v, gate, beta, pool, slots), "fla fused_recurrent",
                lambda: fla_recurrent(q[:, None], k[:, None], v[:, None], g=gate[:, None], beta=beta[:, None],
                                      scale=D ** -0.5, initial_state=pool, output_final_state=True))
    NH, NKV, HD, page = 24, 4, 256, 64                    # the 27B's attention
    for cached, new in ((0, 8192), (8192, 2048)):
        L = cached + new
        cache = randn(-(-L // page) + 1, 2, page, NKV, HD)
        table = torch.arange(-(-L // page), device=device, dtype=torch.int32)[None]
        q = randn(new, NH, HD)
        args = (q, cache, table, [0, new], [L], HD ** -0.5)
        cost = OP_COSTS["attention_sdpa.prefill"](dict(q=q, kv_cache=cache, cu_seqlens=[0, new], seq_lens=[L]))
        row("prefill attention (ours)", f"{cached} cached + {new}", cost,
            lambda: attention_triton.paged_attention_prefill(*args), "torch SDPA (flash)",
            lambda: attention_sdpa.prefill(*args))
    for M, K, N in ((1, 5120, 34816), (8, 5120, 34816), (1, 17408, 5120), (16, 17408, 5120), (2048, 5120, 34816),
                    (8192, 5120, 34816), (8192, 17408, 5120)):
        w = Fp8Weight(N, K, (128, 128), device, act_quant=True)
        w.weight.copy_(randn(N, K, dtype=torch.float32, scale=64).clamp(-448, 448).to(w.weight.dtype))
        w.scale.fill_(1e-3)
        x = randn(M, K)
        xq = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
        sx, sw = torch.ones(M, 1, device=device), torch.ones(1, N, device=device)
        cost = Cost(N * K + (M * K + M * N) * 2, 2 * M * N * K, fp8=True)
        row("block-FP8 GEMM w8a8", f"{M}x{K} @ {N}x{K}", cost, lambda: linear(x, w), "torch._scaled_mm rowwise",
            lambda: torch._scaled_mm(xq, w.weight.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))
        if M <= 16:
            wb = randn(N, K, scale=K ** -0.5)
            row("bf16 GEMM (decode rows)", f"{M}x{K} @ {N}x{K}", Cost(2 * N * K + (M * K + M * N) * 2,
                                                                   2 * M * N * K),
                lambda: linear(x, wb), "cuBLAS bf16 (F.linear)", lambda: torch.nn.functional.linear(x, wb))


def run_profile(model, mc, device, dry: bool) -> None:
    """--profile: tables (a) and (b) for a decode step at batch 1 (8K context) and 8, and one 8K prefill chunk;
    table (c), the peers (bench/gpu_profile.py)."""
    import torch

    from gpu_profile import profile_phase, roofs_for
    name = "CPU (dry run)" if dry else torch.cuda.get_device_name()
    roofs = roofs_for(name, copy_bandwidth(device))
    say(f"roofs: {roofs.card}: HBM {roofs.hbm / 1e12:.2f} TB/s, bf16 {roofs.bf16 / 1e12:.0f} TFLOP/s, "
        f"FP8 {roofs.fp8 / 1e12:.0f} TFLOP/s (dense)")
    context, chunk = (256, 128) if dry else (8192, 8192)
    eng = engine(model, False, 4 * context + 64, dry, kernels="triton" if dry else "auto")
    steps = 4 if dry else 16
    for batch, ctx in ((1, context), (8, context // 4)):
        for line in profile_phase(eng, prompts(batch, ctx, mc.vocab_size, seed=ctx), steps, device, roofs,
                                  f"== (a) decode step, batch {batch}, {ctx}-token context"):
            say(line)
    for line in profile_phase(eng, prompts(1, chunk, mc.vocab_size, seed=7), 0, device, roofs,
                              f"== (a) prefill, one {chunk}-token chunk"):
        say(line)
    eng.close()
    say("== (c) peers")
    kernel_peers(device, roofs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU: checks the script")
    parser.add_argument("--profile", action="store_true", help="kernel by kernel against the card's roofs (a few "
                        "minutes); with --dry-run the host pass alone, the Triton kernels interpreted")
    parser.add_argument("--sweep", action="store_true", help="instead: the decode and prefill GEMMs' tiles around "
                        "their defaults, timed on this card (a few minutes; no model)")
    args = parser.parse_args()
    dry = args.dry_run
    if dry and args.profile:           # the GPU's kernels, interpreted: set before any kernel module is defined
        os.environ["TRITON_INTERPRET"] = "1"
        import triton_setup  # noqa: F401 - the tests' interpreter fixes (its fp32 -> fp8 rounding is wrong)
    import torch
    if not dry and not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA device (or --dry-run)")
    device = torch.device("cpu" if dry else "cuda")
    say(f"device {'CPU (dry run)' if dry else torch.cuda.get_device_name()}, torch {torch.__version__}")
    t0 = time.time()
    if args.sweep:
        from gpu_profile import sweep_tiles
        sweep_tiles(device, say)
        return
    folder = header_folder(TINY if dry else QWEN3_5_27B)
    mc, weights, model = random_model(folder, device, torch.float32 if dry else torch.bfloat16)
    weight_bytes = weights.bytes(4 if dry else 2)
    say(f"model: {weight_bytes / 2**30:.2f} GiB of weights ({weights.fp8_values / 1e9:.2f} G values kept FP8), "
        f"built in {time.time() - t0:.0f} s")
    if args.profile:
        run_profile(model, mc, device, dry)
        say(f"total {time.time() - t0:.0f} s")
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "gpu_profile.txt").write_text("\n".join(LOG) + "\n")
        return
    bw = copy_bandwidth(device)
    # a decode step reads every weight once but the embedding (one row) and the NEXTN head (not run without NEXTN)
    per_token = weight_bytes - mc.vocab_size * mc.hidden_size * (4 if dry else 2)
    context = 4096 if dry else 180_000
    lengths = (256, 1024) if dry else (8192, 32768)
    long = 2048 if dry else 170_000
    new = 8 if dry else 64
    rows = []
    for nextn in (False, True):
        eng = engine(model, nextn, context, dry)
        for batch in (1, 8):
            if nextn:
                eng.nextn.totals = type(eng.nextn.totals)()
            rate = decode_rate(eng, batch, new, mc.vocab_size, device)
            note = ""
            if batch == 1 and not nextn and bw == bw:
                bound = bw / per_token
                note = f"HBM bound {bound:.0f} tok/s: {rate / bound:.0%} (target >= 70%)"
            if nextn:
                st = eng.nextn.totals
                note = (f"{st.num_drafts} rounds, {st.num_accepted_tokens} of {st.num_draft_tokens} drafts accepted"
                        if st.num_drafts else "no drafting (the measured step costs chose depth 0)")
            rows.append((f"decode batch {batch}{' NEXTN' if nextn else ''}", f"{rate:.1f} tok/s", note))
        if not nextn:
            for n in lengths:
                s = prefill_seconds(eng, n, mc.vocab_size, device)
                rows.append((f"prefill {n} tokens", f"{n / s:.0f} tok/s", f"{s:.2f} s"))
            s = prefill_seconds(eng, long, mc.vocab_size, device)
            rows.append((f"TTFT {long} tokens", f"{s:.2f} s", f"{long / s:.0f} tok/s"))
        eng.close()
        del eng
        if device.type == "cuda":
            torch.cuda.empty_cache()                        # the next engine plans from free memory
    say(f"{'measurement':<36} {'value':>14}  notes")
    for name, value, note in rows:
        say(f"{name:<36} {value:>14}  {note}")
    if bw == bw:
        say(f"device copy bandwidth {bw / 1e12:.2f} TB/s; weight bytes per decoded token {per_token / 2**30:.2f} GiB")
    from gpu_profile import roofs_for
    kernel_peers(device, roofs_for(torch.cuda.get_device_name() if device.type == "cuda" else "", bw))
    say(f"total {time.time() - t0:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu.txt").write_text("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
