"""Parity with transformers (the oracle): fp32 logits within 1e-4 and identical greedy continuations, through the
real engine path (loader -> scheduler -> runner -> paged KV + GDN state pools), on every page size and across
chunked-prefill boundaries."""
from __future__ import annotations

import pytest
import torch

from checkpoints import make_qwen3_5_conditional, make_qwen3_5_text, make_qwen3_next
from conftest import TEST_DEVICE, engine_for, prefill_logits
from tinyserve.loader import load_model
from tinyserve.sampling import SamplingParams
from tinyserve.request import Request

CTX = 512
FAMILIES = {
    # Qwen3-Next MoE, interleaved projections, GQA 4:2, GDN value heads per key head r = 2
    "qwen3_next": lambda p: make_qwen3_next(p, with_mtp=True, max_position_embeddings=CTX),
    # Qwen3.5 dense text-only, r = 3 and GQA 6:2
    "qwen3_5_text": lambda p: make_qwen3_5_text(p, max_position_embeddings=CTX, num_attention_heads=6,
                                                linear_num_value_heads=6),
    # Qwen3.5 release layout (ConditionalGeneration, vision tensors, mtp.*)
    "qwen3_5": lambda p: make_qwen3_5_conditional(p, with_mtp=True, max_position_embeddings=CTX),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder, hf = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    return folder, hf, load_model(folder, torch.float32, TEST_DEVICE)


def engine_logits(model, ids: list[int], page_size: int, chunk: int) -> torch.Tensor:
    """Logits of every prompt position, computed through the scheduler's chunked prefill and the runner."""
    eng = engine_for(model, engine={"page_size": page_size, "kv_cache_tokens": 1024, "max_running_requests": 2,
                                    "chunked_prefill_size": chunk})
    return prefill_logits(eng, Request("r", ids, SamplingParams(max_tokens=1), seed=0))


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):                       # full forward every token: independent of any cache
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("length", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_prompt_logits_match_transformers(family, length, page_size):
    folder, hf, model = family
    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    chunk = 50 if length > 64 else 2048       # 300 tokens in chunks of 50: GDN chunk and page boundaries inside
    ours = engine_logits(model, ids, page_size, chunk)
    assert (ours.cpu() - ref).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_greedy_continuation_matches_transformers(family, page_size):
    folder, hf, model = family
    eng = engine_for(model, engine={"page_size": page_size, "kv_cache_tokens": 2048, "max_running_requests": 4,
                                    "chunked_prefill_size": 64})
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 70)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(hf, p, 12)
