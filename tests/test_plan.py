"""The memory plan: every derived size decided from the config and the checkpoint's headers, before any weight is
loaded; `tinyserve --check` prints it for a 27B-shaped folder that holds headers only; a host tier that does not
fit fails naming its key."""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import QWEN3_5_27B, make_header_only
from server_util import write_config
from tinyserve import cli
from tinyserve import plan as planmod
from tinyserve.config import ConfigError, from_dict
from tinyserve.loader import read_checkpoint
from tinyserve.plan import (CPU_KV_CONTEXTS, GIB, SNAPSHOTS_PER_RUNNING_REQUEST, MemoryPlan, activation_bytes,
                            host_available_bytes, kv_bytes_per_token, state_bytes_per_slot)


@pytest.fixture(scope="module")
def header_folder(tmp_path_factory):
    return make_header_only(tmp_path_factory.mktemp("q35-27b"), QWEN3_5_27B)


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """Qwen3.5-27B block FP8 as Qwen ships it: lm_head, embed_tokens, in_proj_a/b and mtp.fc stay bf16."""
    return make_header_only(tmp_path_factory.mktemp("q35-27b-fp8"), QWEN3_5_27B, fp8_block=(128, 128))


def test_headers_alone_give_the_config_and_the_weight_count(header_folder):
    mc, weights = read_checkpoint(header_folder)
    assert (mc.hidden_size, mc.num_hidden_layers, len(mc.gdn_layer_ids), len(mc.attn_layer_ids)) == (5120, 64, 48, 16)
    assert mc.num_mtp_layers == 1
    assert 27.0e9 < weights.values < 27.6e9 and weights.fp8_values == 0     # a "27B" model, MTP layer included


def test_derived_sizes(header_folder, monkeypatch):
    monkeypatch.setattr(planmod, "host_available_bytes", lambda: 256 * GIB)
    mc, weights = read_checkpoint(header_folder)
    cfg = from_dict({"model": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"},
                     "engine": {"max_running_requests": 2}})
    plan = MemoryPlan.resolve(cfg, mc, "cpu", weights)
    assert plan.dtype == "bfloat16" and plan.kv_dtype == "fp8_e4m3"
    assert plan.weights_bytes == 2 * weights.values
    assert plan.kv_tokens == CPU_KV_CONTEXTS * 262144 and plan.context_length == 262144
    assert plan.kv_bytes_per_token == 16 * 2 * 4 * 256 * 1           # 16 attention layers, K and V, fp8
    # 48 GDN layers: conv state (bf16) + SSM state (fp32) per slot
    assert plan.state_bytes_per_slot == 48 * ((2 * 16 * 128 + 48 * 128) * 3 * 2 + 48 * 128 * 128 * 4)
    assert plan.state_slots == 2 and plan.snapshot_slots == SNAPSHOTS_PER_RUNNING_REQUEST * 2
    assert plan.host_pages == plan.host_snapshots == 0 and plan.file_dir == ""
    assert kv_bytes_per_token(mc, "fp8_e4m3") == plan.kv_bytes_per_token
    assert state_bytes_per_slot(mc, "bfloat16") == plan.state_bytes_per_slot


def test_cpu_kv_pool_holds_full_length_sessions_within_host_memory(header_folder, monkeypatch):
    """engine.kv_cache_tokens = 0 on the CPU: two full-length requests where a quarter of the available memory holds
    them, else what that quarter holds; less than one full-length request fails naming the key to change."""
    mc, weights = read_checkpoint(header_folder)
    cfg = from_dict({"model": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", "context_length": 65536}})
    per_token = kv_bytes_per_token(mc, "fp8_e4m3")
    monkeypatch.setattr(planmod, "host_available_bytes", lambda: 64 * GIB)
    assert MemoryPlan.resolve(cfg, mc, "cpu", weights).kv_tokens == 2 * 65536
    monkeypatch.setattr(planmod, "host_available_bytes", lambda: 12 * GIB)
    assert MemoryPlan.resolve(cfg, mc, "cpu", weights).kv_tokens == 3 * GIB // per_token // 16 * 16
    monkeypatch.setattr(planmod, "host_available_bytes", lambda: 4 * GIB)
    with pytest.raises(ConfigError) as e:
        MemoryPlan.resolve(cfg, mc, "cpu", weights)
    assert e.value.key == "model.context_length" and "engine.kv_cache_tokens" in str(e.value)
    explicit = from_dict({"model": {"context_length": 65536}, "engine": {"kv_cache_tokens": 4096}})
    assert MemoryPlan.resolve(explicit, mc, "cpu", weights).kv_tokens == 4096


def test_host_tier_split_and_explicit_keys(header_folder, monkeypatch):
    monkeypatch.setattr(planmod, "HOST_STATE_SHARE", 0.5)
    mc, weights = read_checkpoint(header_folder)
    cfg = from_dict({"model": {"dtype": "bfloat16", "context_length": 65536},
                     "engine": {"kv_cache_tokens": 4096, "page_size": 64},
                     "cache": {"state_slots": 3, "host": {"size_gb": 1.0}}})
    plan = MemoryPlan.resolve(cfg, mc, "cpu", weights)
    assert plan.kv_pages == 64 and plan.snapshot_slots == 3 and plan.context_length == 65536
    assert plan.host_snapshots == int(0.5 * GIB // plan.state_bytes_per_slot)
    page_bytes = plan.kv_bytes_per_token * 64
    assert plan.host_pages == (GIB - plan.host_snapshots * plan.state_bytes_per_slot) // page_bytes
    off = MemoryPlan.resolve(from_dict({"engine": {"kv_cache_tokens": 4096},
                                        "cache": {"enabled": False, "host": {"size_gb": 1.0}}}), mc, "cpu", weights)
    assert off.snapshot_slots == 0 and off.host_pages == 0      # no prefix cache: no snapshots, no tiers


def test_a_host_tier_larger_than_the_host_fails_naming_the_key(header_folder):
    mc, weights = read_checkpoint(header_folder)
    too_big = host_available_bytes() / GIB * 2 + 1
    with pytest.raises(ConfigError, match="cache.host.size_gb") as e:
        MemoryPlan.resolve(from_dict({"engine": {"kv_cache_tokens": 4096}, "cache": {"host": {"size_gb": too_big}}}),
                           mc, "cpu", weights)
    assert e.value.key == "cache.host.size_gb"


def check(tmp_path, config: dict) -> subprocess.CompletedProcess:
    path = write_config(tmp_path, config)
    return subprocess.run([sys.executable, "-m", "tinyserve.cli", "--check", str(path)], capture_output=True,
                          text=True, timeout=120)


def test_check_prints_the_plan_of_a_27b_folder_of_headers(header_folder, tmp_path):
    """No tensor data in the folder: --check can only succeed without loading a weight."""
    out = check(tmp_path, {"model": {"path": str(header_folder), "device": "cpu", "dtype": "bfloat16",
                                     "kv_cache_dtype": "fp8_e4m3"},
                           "engine": {"max_running_requests": 1, "kv_cache_tokens": 262144}})
    assert out.returncode == 0, out.stderr
    plan = out.stdout.strip().splitlines()[-1]
    assert "weights 50.89 GiB" in plan and "KV pool 262144 tokens" in plan and "fp8_e4m3" in plan, plan
    assert "context 262144 tokens" in plan


def test_planning_needs_no_torch(header_folder):
    """A CPU plan (what `tinyserve --check` prints) comes from config.json and the headers without importing torch,
    so it answers at once even for a 27B release."""
    code = ("import sys; from tinyserve.config import from_dict; from tinyserve.plan import plan_for; "
            f"plan_for(from_dict({{'model': {{'path': {str(header_folder)!r}, 'device': 'cpu', "
            "'context_length': 32768}})); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_check_fails_naming_the_host_key(header_folder, tmp_path):
    out = check(tmp_path, {"model": {"path": str(header_folder), "device": "cpu"}, "engine": {"kv_cache_tokens": 4096},
                           "cache": {"host": {"size_gb": host_available_bytes() / GIB * 2 + 1}}})
    assert out.returncode == 1 and "cache.host.size_gb" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------------------------------------------------------
# CUDA plans: FP8 weights kept FP8, and a card that is not here (--gpu-memory-gb)

def test_fp8_weights_count_one_byte_on_cuda(fp8_folder, header_folder):
    mc, deq = read_checkpoint(fp8_folder)                     # a CPU plan dequantizes: every value in the dtype
    _, kept = read_checkpoint(fp8_folder, keep_fp8=True)
    _, bf16 = read_checkpoint(header_folder)
    assert deq.values == kept.values == bf16.values and deq.fp8_values == 0
    # every 2-D linear weight but lm_head, mtp.fc and in_proj_b|a (48 rows each: not on a 128-row block) stays FP8
    embed = 2 * mc.vocab_size * mc.hidden_size
    ba = 48 * 2 * mc.hidden_size * 48
    assert kept.fp8_values == kept.values - embed - ba - 2 * mc.hidden_size ** 2 - _small(mc)
    assert kept.fp8_scales == pytest.approx(kept.fp8_values / 128 ** 2, rel=0.01)
    gib = kept.bytes(2) / GIB
    assert 27.5 < gib < 28.3 and bf16.bytes(2) / GIB > 50          # the 27B: ~28 GiB kept, 51 GiB in bf16


def _small(mc) -> int:
    """Values of the 1-D and conv weights (norms, A_log, dt_bias, conv1d) of the 27B: what is not a linear weight."""
    gdn, attn = len(mc.gdn_layer_ids), len(mc.attn_layer_ids) + 1           # + the NEXTN layer
    H = mc.hidden_size
    per_gdn = mc.conv_dim * mc.linear_conv_kernel_dim + 2 * 48 + 128 + 2 * H
    per_attn = 2 * mc.head_dim + 2 * H
    return gdn * per_gdn + attn * per_attn + H + 3 * H                       # final norm; NEXTN's three norms


def check_card(tmp_path, config: dict, gb: float) -> subprocess.CompletedProcess:
    """`tinyserve --check CONFIG --gpu-memory-gb GB` through the CLI's own main() in this process: a card's plan
    needs torch (FP8 placement builds the model on the meta device), whose import is most of a fresh process's
    time; the command itself runs as a process in the tests above."""
    path = write_config(tmp_path, config)
    args = [str(path), "--check", "--gpu-memory-gb", str(gb)]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(args)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def production(folder, tmp_path, name: str = "production.toml") -> dict:
    """systemd/production.toml (the seed's set-up: 27B FP8, fp8 KV, 262,144 tokens, one running request, NEXTN
    with 5 steps, a 24 GB host tier), or another of systemd/'s set-ups, with its model path and file tier moved
    here."""
    from tinyserve.config import load, to_dict
    data = to_dict(load(str(Path(__file__).parents[1] / "systemd" / name)))
    data["model"]["path"] = str(folder)
    data["cache"]["file"]["dir"] = str(tmp_path / "kv")
    return data


def test_the_seeds_setup_fits_a_48_gb_card(fp8_folder, tmp_path):
    out = check_card(tmp_path, production(fp8_folder, tmp_path), 48)
    assert out.returncode == 0, out.stderr
    plan, host, fits = out.stdout.strip().splitlines()[-3:]
    assert "device cuda (bfloat16); weights 27.89 GiB (23.01 GiB of them kept FP8, w8a8)" in plan, plan
    assert "fp8_e4m3" in plan and "context 262144 tokens" in plan and "NEXTN" in plan
    kv = int(plan.split("KV pool ")[1].split(" tokens")[0])
    assert 262144 <= kv < 450_000                                     # the whole context, and then some
    assert "not checked against this machine" in host                 # a 24 GB host tier is the other box's RAM
    assert fits.startswith("fits a 48 GiB card (47.4 GiB free)"), fits


def test_the_32_gb_setup_fits_a_5090_with_the_4_bit_27b(tmp_path):
    """systemd/production-32gb.toml with Qwen3.5-27B W4A16 g128 (GPTQ, header only): the 4-bit weights at their size,
    the whole 262,144-token context with fp8 KV and NEXTN, on a 32 GB card."""
    folder = make_header_only(tmp_path / "q35-27b-gptq", QWEN3_5_27B, gptq_group=128)
    out = check_card(tmp_path, production(folder, tmp_path, "production-32gb.toml"), 32)
    assert out.returncode == 0, out.stderr
    plan, host, fits = out.stdout.strip().splitlines()[-3:]
    assert "weights 17.26 GiB (11.68 GiB of them 4-bit, gptq g128)" in plan, plan
    assert "fp8_e4m3" in plan and "context 262144 tokens" in plan and "NEXTN" in plan
    assert int(plan.split("KV pool ")[1].split(" tokens")[0]) >= 262144
    assert fits.startswith("fits a 32 GiB card"), fits


@pytest.mark.parametrize("gb, key", [(32, "engine.mem_fraction_static"), (40, "model.context_length")])
def test_a_card_too_small_fails_naming_the_key(fp8_folder, tmp_path, gb, key):
    """32 GB (an RTX 5090): the 28 GiB of weights leave no room for KV; 40 GB: room, but not for 262,144 tokens."""
    out = check_card(tmp_path, production(fp8_folder, tmp_path), gb)
    assert out.returncode == 1 and key in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_shorter_context_fits_a_5090(fp8_folder, tmp_path):
    """The 27B FP8 on a 32 GB card: a 32K context without NEXTN, one snapshot slot and 95% for the static share."""
    data = production(fp8_folder, tmp_path)
    data["speculative"]["num_steps"] = 0                  # no verify slots and no NEXTN KV
    data["model"]["context_length"] = 32768
    data["engine"]["chunked_prefill_size"] = 2048
    data["cache"]["state_slots"] = 1
    data["engine"]["mem_fraction_static"] = 0.95           # what the 32 GiB error above suggests
    out = check_card(tmp_path, data, 32)
    assert out.returncode == 0, out.stderr
    assert "fits a 32 GiB card" in out.stdout.splitlines()[-1]


def test_bf16_weights_do_not_fit_48_gb(header_folder, tmp_path):
    out = check_card(tmp_path, production(header_folder, tmp_path), 48)
    assert out.returncode == 1 and "50.9 GiB of weights" in out.stderr, out.stderr


def test_an_explicit_kv_pool_too_large_fails_naming_it(fp8_folder, tmp_path):
    data = production(fp8_folder, tmp_path)
    data["engine"]["kv_cache_tokens"] = 1_000_000
    out = check_card(tmp_path, data, 48)
    assert out.returncode == 1 and "engine.kv_cache_tokens = 1000000 needs" in out.stderr, out.stderr


def test_activations_that_do_not_fit_fail_naming_the_chunk_size(fp8_folder, tmp_path):
    data = production(fp8_folder, tmp_path)
    data["engine"]["chunked_prefill_size"] = 65536
    data["engine"]["mem_fraction_static"] = 0.95
    out = check_card(tmp_path, data, 48)
    assert out.returncode == 1 and "engine.chunked_prefill_size" in out.stderr, out.stderr


def test_activation_estimate_grows_with_the_chunk(fp8_folder):
    mc, _ = read_checkpoint(fp8_folder)
    small = activation_bytes(from_dict({"engine": {"chunked_prefill_size": 1024}}), mc, "bfloat16")
    large = activation_bytes(from_dict({"engine": {"chunked_prefill_size": 8192}}), mc, "bfloat16")
    assert 0.1 * GIB < small < large < 4 * GIB


def test_gpu_memory_needs_check(fp8_folder, tmp_path):
    path = write_config(tmp_path, {"model": {"path": str(fp8_folder)}})
    out = subprocess.run([sys.executable, "-m", "tinyserve.cli", str(path), "--gpu-memory-gb", "48"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--gpu-memory-gb N needs --check" in out.stderr


def test_the_graph_estimate_knows_the_attention_kernels_split_limit():
    """plan.py does not import triton (planning needs none), so it restates the decode kernel's split limit."""
    from tinyserve import plan
    attention_triton = pytest.importorskip("tinyserve.kernels.attention_triton")
    assert plan.ATTENTION_MAX_SPLITS == attention_triton.MAX_SPLITS


def test_running_out_of_memory_at_start_names_the_key(xdg):
    """A pool the machine cannot allocate (here 10^13 tokens of KV on the CPU; on CUDA a plan the estimate got
    wrong) fails at start as a ConfigError naming the key to lower, not a traceback from the allocator."""
    from tinyserve.build import build_engine
    cfg = from_dict({"model": {"path": "demo", "device": "cpu"}, "engine": {"kv_cache_tokens": 10 ** 13},
                     "cache": {"enabled": False}})
    with pytest.raises(ConfigError, match="out of memory.*lower engine.kv_cache_tokens") as e:
        build_engine(cfg)
    assert e.value.key == "engine.kv_cache_tokens"


def test_fp8_kv_on_a_gpu_without_fp8_fails_naming_the_key(fp8_folder):
    """Triton has no e4m3 before sm_89 (an RTX 3090 or A6000 is sm_86): an fp8 KV pool there is refused at
    planning, naming model.kv_cache_dtype, not a compile error at the first forward."""
    _, weights = read_checkpoint(fp8_folder, keep_fp8=True)
    mc, _ = read_checkpoint(fp8_folder)
    fp8_kv = {"model": {"kv_cache_dtype": "fp8_e4m3", "context_length": 32768}}
    with pytest.raises(ConfigError) as e:
        MemoryPlan.resolve(from_dict(fp8_kv), mc, "cuda", weights, gpu_free_bytes=96 * GIB, cuda_capability=(8, 6))
    assert e.value.key == "model.kv_cache_dtype" and "sm_86" in str(e.value)
    for ok in [(fp8_kv, (8, 9)), (fp8_kv, (12, 0)), ({"model": {"context_length": 32768}}, (8, 6)),
               ({**fp8_kv, "engine": {"kernels": "torch"}}, (8, 6))]:
        MemoryPlan.resolve(from_dict(ok[0]), mc, "cuda", weights, gpu_free_bytes=96 * GIB, cuda_capability=ok[1])
