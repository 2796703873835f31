"""The memory plan: every derived size decided from the config and the checkpoint's headers, before any weight is
loaded; `tinyserve --check` prints it for a 27B-shaped folder that holds headers only; a host tier that does not
fit fails naming its key."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from checkpoints import QWEN3_5_27B, make_header_only
from server_util import write_config
from tinyserve.config import ConfigError, from_dict
from tinyserve.loader import read_checkpoint
from tinyserve.plan import (CPU_DEFAULT_KV_TOKENS, GIB, SNAPSHOTS_PER_RUNNING_REQUEST, MemoryPlan,
                            host_available_bytes, kv_bytes_per_token, state_bytes_per_slot)


@pytest.fixture(scope="module")
def header_folder(tmp_path_factory):
    return make_header_only(tmp_path_factory.mktemp("q35-27b"), QWEN3_5_27B)


def test_headers_alone_give_the_config_and_the_weight_count(header_folder):
    mc, values = read_checkpoint(header_folder)
    assert (mc.hidden_size, mc.num_hidden_layers, len(mc.gdn_layer_ids), len(mc.attn_layer_ids)) == (5120, 64, 48, 16)
    assert mc.num_mtp_layers == 1
    assert 27.0e9 < values < 27.6e9                       # a "27B" model, MTP layer included


def test_derived_sizes(header_folder):
    mc, values = read_checkpoint(header_folder)
    cfg = from_dict({"model": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3"},
                     "engine": {"max_running_requests": 2}})
    plan = MemoryPlan.resolve(cfg, mc, "cpu", values)
    assert plan.dtype == "bfloat16" and plan.kv_dtype == "fp8_e4m3"
    assert plan.weights_bytes == 2 * values
    assert plan.kv_tokens == CPU_DEFAULT_KV_TOKENS and plan.context_length == 262144
    assert plan.kv_bytes_per_token == 16 * 2 * 4 * 256 * 1           # 16 attention layers, K and V, fp8
    # 48 GDN layers: conv state (bf16) + SSM state (fp32) per slot
    assert plan.state_bytes_per_slot == 48 * ((2 * 16 * 128 + 48 * 128) * 3 * 2 + 48 * 128 * 128 * 4)
    assert plan.state_slots == 2 and plan.snapshot_slots == SNAPSHOTS_PER_RUNNING_REQUEST * 2
    assert plan.host_pages == plan.host_snapshots == 0 and plan.file_dir == ""
    assert kv_bytes_per_token(mc, "fp8_e4m3") == plan.kv_bytes_per_token
    assert state_bytes_per_slot(mc, "bfloat16") == plan.state_bytes_per_slot


def test_host_tier_split_and_explicit_keys(header_folder):
    mc, values = read_checkpoint(header_folder)
    cfg = from_dict({"model": {"dtype": "bfloat16", "context_length": 65536},
                     "engine": {"kv_cache_tokens": 4096, "page_size": 64},
                     "cache": {"state_slots": 3, "host": {"size_gb": 1.0, "state_share": 0.5}}})
    plan = MemoryPlan.resolve(cfg, mc, "cpu", values)
    assert plan.kv_pages == 64 and plan.snapshot_slots == 3 and plan.context_length == 65536
    assert plan.host_snapshots == int(0.5 * GIB // plan.state_bytes_per_slot)
    page_bytes = plan.kv_bytes_per_token * 64
    assert plan.host_pages == (GIB - plan.host_snapshots * plan.state_bytes_per_slot) // page_bytes
    off = MemoryPlan.resolve(from_dict({"cache": {"enabled": False, "host": {"size_gb": 1.0}}}), mc, "cpu", values)
    assert off.snapshot_slots == 0 and off.host_pages == 0      # no prefix cache: no snapshots, no tiers


def test_a_host_tier_larger_than_the_host_fails_naming_the_key(header_folder):
    mc, values = read_checkpoint(header_folder)
    too_big = host_available_bytes() / GIB * 2 + 1
    with pytest.raises(ConfigError, match="cache.host.size_gb") as e:
        MemoryPlan.resolve(from_dict({"cache": {"host": {"size_gb": too_big}}}), mc, "cpu", values)
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
            f"plan_for(from_dict({{'model': {{'path': {str(header_folder)!r}, 'device': 'cpu'}}}})); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_check_fails_naming_the_host_key(header_folder, tmp_path):
    out = check(tmp_path, {"model": {"path": str(header_folder), "device": "cpu"},
                           "cache": {"host": {"size_gb": host_available_bytes() / GIB * 2 + 1}}})
    assert out.returncode == 1 and "cache.host.size_gb" in out.stderr and "Traceback" not in out.stderr
