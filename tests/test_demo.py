"""tinyserve.demo: the built-in checkpoint is complete, written once, deterministic, and loads everywhere."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinyserve.demo import DEMO_VERSION, SPECIAL_TOKENS, ensure_demo_checkpoint
from tinyserve.loader import load_model
from tinyserve.model_config import read_model_config
from tinyserve.generation import IncrementalDetokenizer
from tinyserve.tokenizer import Tokenizer

FILES = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]


def _digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("cache"))


def test_layout(demo):
    assert demo.name == DEMO_VERSION
    assert sorted(p.name for p in demo.iterdir()) == FILES
    assert [p.name for p in demo.parent.iterdir()] == [DEMO_VERSION]   # no temp folder left behind


def test_written_once(demo):
    before = {f.name: f.stat().st_mtime_ns for f in demo.iterdir()}
    assert ensure_demo_checkpoint(demo.parent) == demo
    assert {f.name: f.stat().st_mtime_ns for f in demo.iterdir()} == before


def test_deterministic(demo, tmp_path):
    assert _digests(ensure_demo_checkpoint(tmp_path)) == _digests(demo)


@pytest.mark.slow
def test_deterministic_across_processes_and_concurrent_writers(demo, tmp_path):
    """Other interpreters (other hash seeds, e.g. in Rust maps) write the very same bytes, and two of them racing
    for the same cache folder both end up with one complete checkpoint."""
    code = ("import sys, pathlib; from tinyserve.demo import ensure_demo_checkpoint; "
            "print(ensure_demo_checkpoint(pathlib.Path(sys.argv[1])))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate()[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1]
    assert _digests(Path(outs[0])) == _digests(demo)
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_VERSION]


def test_default_location_and_incomplete_folder(tmp_path, monkeypatch, demo):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    partial = tmp_path / "tinyserve" / DEMO_VERSION
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{half")          # a crash of some older writer
    path = ensure_demo_checkpoint()
    assert path == partial
    assert _digests(path) == _digests(demo)


def test_config(demo):
    raw = json.loads((demo / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text" and raw["architectures"] == ["Qwen3_5ForCausalLM"]
    cfg = read_model_config(demo)
    tok = Tokenizer.from_folder(demo)
    assert cfg.vocab_size == tok.vocab_size
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (64, 4, 4, 2, 32)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim) == (2, 4, 16, 16, 4)
    assert cfg.partial_rotary_factor == 0.25 and cfg.rope_theta == 1e7
    assert cfg.intermediate_size == 128 and cfg.max_position_embeddings == 262144   # Qwen3.5's own: agents' sessions fit
    assert cfg.num_mtp_layers == 1 and not cfg.interleaved_gdn_proj
    assert set(cfg.eos_token_ids) == set(tok.eos_token_ids) == {tok.token_to_id("<|im_end|>"),
                                                                 tok.token_to_id("<|endoftext|>")}


def test_tokenizer(demo):
    tok = Tokenizer.from_folder(demo)
    for t in SPECIAL_TOKENS:
        assert tok.token_to_id(t) is not None and tok.encode(t) == [tok.token_to_id(t)]
    assert [tok.id_to_token(i) for i in (0, 32, 65)] == ["Ā", "Ġ", "A"]    # ids 0..255 are the bytes in order
    text = "The weather in Paris is sunny. 天気 ☀️"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())                                 # the merges do compress
    det = IncrementalDetokenizer(tok)
    assert "".join(det.add([i]) for i in ids) + det.flush() == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # as Qwen3.5's template, one system message, first; the opening ones are joined, a later one is a user turn
    prompt = tok.apply_chat_template([{"role": "system", "content": "A"}, {"role": "developer", "content": "B"},
                                      {"role": "user", "content": "hi"}, {"role": "system", "content": "C"}])
    assert prompt == ("<|im_start|>system\nA\n\nB<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                      "<|im_start|>user\n<system-reminder>\nC\n</system-reminder><|im_end|>\n<|im_start|>assistant\n")


def test_weights_load(demo):
    model = load_model(demo, torch.float32, "cpu")
    state = dict(model.named_parameters())
    assert state and all(torch.isfinite(t).all() for t in state.values())
    a_log = [t for n, t in state.items() if n.endswith("A_log")]
    assert a_log and all((t >= 0).all() and (t <= torch.log(torch.tensor(16.0))).all() for t in a_log)


def test_transformers_loads_it(demo):
    """The checkpoint is a real Qwen3.5 text checkpoint: transformers reads it and its outputs are finite."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(demo), dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    tok = Tokenizer.from_folder(demo)
    ids = tok.encode("Hello world, how are you?")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), tok.vocab_size) and torch.isfinite(logits).all()
    assert logits.std() > 0.01       # random weights, but not a dead network
