"""A half-size KV cache on the CPU (model.kv_cache_dtype bfloat16 / float16 with float32 weights, as llama.cpp's
default f16 cache): the logits stay within the tolerances docs/config.md writes down, measured against
transformers' fp32 model on the parity checkpoints (prompt positions 0..299, chunked prefill, page size 16):

    KV dtype   max |logit difference| measured   bound here
    bfloat16   6.8e-4 .. 8.2e-4                  3e-3
    float16    0.8e-4 .. 1.1e-4                  5e-4

and the argmax agrees at every position; decode reads the half-size pages (the CPU kernel converts as it reads)."""
from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, engine_for, prefill_logits
from test_parity import FAMILIES
from tinyserve.loader import load_model
from tinyserve.request import Request
from tinyserve.sampling import SamplingParams

BOUNDS = {"bfloat16": 3e-3, "float16": 5e-4}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    folder, hf = FAMILIES[request.param](tmp_path_factory.mktemp(request.param))
    return hf, load_model(folder, torch.float32, TEST_DEVICE)


def make_engine(model, kv_dtype: str):
    return engine_for(model, model={"kv_cache_dtype": kv_dtype},
                      engine={"page_size": 16, "kv_cache_tokens": 1024, "max_running_requests": 2,
                              "chunked_prefill_size": 50})


@pytest.mark.parametrize("kv_dtype", list(BOUNDS))
def test_half_kv_logits_within_the_written_bound(family, kv_dtype):
    hf, model = family
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(300)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    eng = make_engine(model, kv_dtype)
    assert eng.kv_pool.buffer.dtype == getattr(torch, kv_dtype)
    ours = prefill_logits(eng, Request("r", ids, SamplingParams(max_tokens=1), seed=0)).cpu()
    assert (ours - ref).abs().max().item() < BOUNDS[kv_dtype]
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("kv_dtype", list(BOUNDS))
def test_half_kv_decode_follows_the_full_kv(family, kv_dtype):
    """Greedy decode over a half-size cache gives the full-size cache's tokens on these checkpoints."""
    _, model = family
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 70)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = make_engine(model, "float32").generate(prompts, params)
    assert make_engine(model, kv_dtype).generate(prompts, params) == want
