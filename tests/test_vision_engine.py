"""Image input through the engine: the model's prompt logits and greedy tokens against transformers'
Qwen3_5ForConditionalGeneration (the oracle: its own processor-free path with our pixel values, which
tests/test_vision.py checks bit for bit against its image processor), and every prefix-cache path against a cold
run of the same request (identical tokens, the expected cached counts).

The cache keys an image's tokens on its pixels (intake.image_keys), so: the same image twice is a hit through
the image; a different image of the same size diverges at its first pad; the same image after different text
misses the KV but skips the vision tower (feature cache); a later turn that adds an image resumes from the previous
turn; a file-tier hit after a restart gives the cold tokens."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from checkpoints import make_qwen3_5_vl
from conftest import assert_no_leaks, engine_for, nextn, prefill_logits
from tinyserve.engine import RequestError
from tinyserve.images import ImageSource
from tinyserve.loader import load_model
from tinyserve.sampling import SamplingParams
from tinyserve.tokenizer import Tokenizer

MARK = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PS = 16


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    folder, oracle = make_qwen3_5_vl(tmp_path_factory.mktemp("vl"), with_mtp=True)
    return folder, oracle, load_model(folder, torch.float32), Tokenizer.from_folder(folder)


def png(w: int, h: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def user_turn(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def prepare(eng, tok, text: str, pictures: list[bytes]):
    ids = tok.encode(text)
    return eng.images.prepare(ids, [ImageSource(f"img{i}", p, "image/png") for i, p in enumerate(pictures)])


def hf_inputs(vl, ids: list[int], images) -> dict:
    image_id = vl[2].cfg.image_token_id
    kw = dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
              mm_token_type_ids=torch.tensor([[int(t == image_id) for t in ids]]))
    if images:
        kw.update(pixel_values=torch.cat([im.pixel_values for im in images]),
                  image_grid_thw=torch.tensor([im.grid_thw for im in images]))
    return kw


def engine_logits(eng, ids, images) -> torch.Tensor:
    """Logits of every prompt position through the scheduler's chunked prefill and the runner."""
    return prefill_logits(eng, eng.intake.make_request(ids, SamplingParams(max_tokens=1), None, images))


CASES = {
    "image first": (user_turn(MARK + "What is in the picture?"), [(40, 24, 1)]),
    "image last": (user_turn("Describe this one: " + MARK), [(64, 40, 2)]),
    "two images": (user_turn("Left " + MARK + " and right " + MARK + " differ how?"), [(40, 24, 3), (24, 56, 4)]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [2048, 10])
def test_prompt_logits_and_greedy_tokens_match_transformers(vl, case, chunk):
    """chunk 10: prefill chunks end inside every image (the tower still sees each image whole)."""
    folder, oracle, model, tok = vl
    text, sizes = CASES[case]
    eng = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048, "chunked_prefill_size": chunk},
                     cache={"enabled": False})
    ids, images = prepare(eng, tok, text, [png(*s) for s in sizes])
    assert len(ids) == len(tok.encode(text)) - len(images) + sum(im.num_tokens for im in images)
    with torch.no_grad():
        ref = oracle(**hf_inputs(vl, ids, images)).logits[0]
        want = oracle.generate(**hf_inputs(vl, ids, images), max_new_tokens=6, do_sample=False)[0, len(ids):]
    assert (engine_logits(eng, ids, images) - ref).abs().max().item() < 1e-4
    eng2 = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048, "chunked_prefill_size": chunk},
                      cache={"enabled": False})
    (r,) = eng2.run_requests([ids], GREEDY, [images])
    assert r.output_ids == want.tolist()


def test_text_only_requests_are_unchanged_by_the_vision_tower(vl):
    folder, oracle, model, tok = vl
    ids = tok.encode(user_turn("No picture here, just words."))
    eng = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048}, cache={"enabled": False})
    with torch.no_grad():
        want = oracle.generate(**hf_inputs(vl, ids, []), max_new_tokens=6, do_sample=False)[0, len(ids):]
    assert eng.generate([ids], GREEDY)[0] == want.tolist()


def test_bad_image_inputs_are_request_errors_naming_the_part(vl):
    folder, oracle, model, tok = vl
    eng = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048},
                     model={"max_images": 1, "max_image_pixels": 4000})
    ids = tok.encode(user_turn(MARK + MARK))
    with pytest.raises(RequestError, match=r"model\.max_images") as e:
        eng.images.prepare(ids, [ImageSource("a", png(40, 24, 1)), ImageSource("b", png(40, 24, 2))])
    assert e.value.field == "b"
    with pytest.raises(RequestError, match=r"model\.max_image_pixels") as e:
        eng.images.prepare(tok.encode(user_turn(MARK)), [ImageSource("big", png(100, 50, 1))])
    assert e.value.field == "big"
    with pytest.raises(RequestError, match="cannot decode") as e:
        eng.images.prepare(tok.encode(user_turn(MARK)), [ImageSource("junk", b"not an image", "image/png")])
    assert e.value.field == "junk"
    with pytest.raises(RequestError, match="placeholder") as e:       # a literal pad typed in the text
        eng.images.prepare(tok.encode(user_turn(MARK + " <|image_pad|>")), [ImageSource("x", png(40, 24, 1))])
    assert e.value.field == "prompt"
    text = tok.encode(user_turn("a pad typed as text: " + MARK))      # no images: served as the text it is
    (r,) = eng.run_requests([text], GREEDY)
    assert len(r.output_ids) == GREEDY.max_tokens


def conversation(eng, tok, turns: list[tuple[str, list[bytes]]]):
    """Each (text, pictures) in turn through eng: the prompt and its prepared images."""
    return [prepare(eng, tok, text, pictures) for text, pictures in turns]


@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_hits_with_images_equal_cold_runs(vl, page_size):
    folder, oracle, model, tok = vl
    pool = {"page_size": page_size, "kv_cache_tokens": 4096}
    warm = engine_for(model, tok, engine=pool, cache={"state_track_interval": 64})
    cold = engine_for(model, tok, engine=pool, cache={"enabled": False})
    a, b = png(40, 24, 11), png(40, 24, 12)                 # same size, different pixels
    head = "<|im_start|>system\nYou look at pictures.<|im_end|>\n"
    prompts = conversation(warm, tok, [
        (head + user_turn(MARK + "What is this?"), [a]),                  # 0 cold
        (head + user_turn(MARK + "What is this?"), [a]),                  # 1 the same image again: a hit through it
        (head + user_turn(MARK + "What is this?"), [b]),                  # 2 another image of the same size
        (head + user_turn("Before it: " + MARK + "And now?"), [a]),       # 3 same image after different text
    ])
    done = []
    for ids, images in prompts:
        (r,) = warm.run_requests([ids], GREEDY, [images])
        assert r.output_ids == cold.run_requests([ids], GREEDY, [images])[0].output_ids
        warm.cache.check()
        done.append(r)
    first_pad = prompts[0][0].index(model.cfg.image_token_id)
    assert done[0].cached_tokens == 0
    assert done[1].cached_tokens == (len(prompts[1][0]) - 1) // page_size * page_size
    assert done[2].cached_tokens == first_pad // page_size * page_size          # diverges at its first pad
    assert done[2].cached_tokens < first_pad + 1
    assert warm.stats().images.encoded == 2     # a and b; 1 and 3 took a's features from the cache
    # a later turn adds an image: it resumes from the end of the previous turn (the request's end)
    prev = done[0]
    tail, tail_images = warm.images.prepare(tok.encode("<|im_end|>\n" + user_turn("And " + MARK + "?")),
                                            [ImageSource("t2", b, "image/png")])
    turn2, images2 = prev.prompt_ids + prev.output_ids + tail, prompts[0][1] + tail_images
    (r,) = warm.run_requests([turn2], GREEDY, [images2])
    assert r.output_ids == cold.run_requests([turn2], GREEDY, [images2])[0].output_ids
    end = len(prev.prompt_ids) + len(prev.output_ids) - 1        # the last token has no KV yet when it finished
    assert r.cached_tokens >= end // page_size * page_size - page_size
    assert_no_leaks(warm)


def test_an_image_keyed_cache_never_serves_a_text_only_prompt_the_image(vl):
    """A text-only request whose ids are the image request's with plain pads (fastllm #750) is a miss past the
    first pad, and a pad-free text prompt that is a prefix of an image request is a hit up to the image."""
    folder, oracle, model, tok = vl
    warm = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 4096})
    cold = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 4096}, cache={"enabled": False})
    text = "<|im_start|>system\nA long enough system prompt to fill two pages of tokens.<|im_end|>\n"
    ids, images = prepare(warm, tok, text + user_turn(MARK + "?"), [png(48, 32, 21)])
    warm.run_requests([ids], GREEDY, [images])
    plain = tok.encode(text + user_turn("no image"))
    (r,) = warm.run_requests([plain], GREEDY)
    assert r.output_ids == cold.generate([plain], GREEDY)[0]
    shared = next(i for i, (x, y) in enumerate(zip(ids, plain)) if x != y)
    assert r.cached_tokens == shared // PS * PS
    assert_no_leaks(warm)


def test_file_tier_hit_with_an_image_after_a_restart(vl, tmp_path):
    folder, oracle, model, tok = vl
    tables = dict(engine={"page_size": PS, "kv_cache_tokens": 4096},
                  cache={"file": {"dir": str(tmp_path / "blobs"), "prefetch_policy": "wait_complete"}})
    first = engine_for(model, tok, **tables)
    ids, images = prepare(first, tok, user_turn(MARK + "Tell me about it in detail."), [png(56, 40, 31)])
    want = first.run_requests([ids], GREEDY, [images])[0].output_ids
    first.close()
    again = engine_for(model, tok, **tables)                  # a new process's engine: an empty tree
    (r,) = again.run_requests([ids], GREEDY, [images])
    assert r.output_ids == want
    assert r.report["cached_by_tier"]["file"] == r.cached_tokens == (len(ids) - 1) // PS * PS
    other, other_images = prepare(again, tok, user_turn(MARK + "Tell me about it in detail."), [png(56, 40, 32)])
    (r2,) = again.run_requests([other], GREEDY, [other_images])    # same size, other pixels: no file hit past it
    assert r2.cached_tokens < other.index(model.cfg.image_token_id) + 1
    assert_no_leaks(again)


def test_nextn_with_images_gives_the_cold_unspeculated_tokens(vl):
    folder, oracle, model, tok = vl
    pool = {"page_size": PS, "kv_cache_tokens": 4096}
    spec = engine_for(model, tok, engine=pool, speculative={"num_steps": 2})
    cold = engine_for(model, tok, engine=pool, cache={"enabled": False})
    ids, images = prepare(spec, tok, user_turn("Two: " + MARK + MARK + "go"), [png(40, 24, 41), png(32, 48, 42)])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for _ in range(2):                                       # cold, then a cache hit through both images
        (r,) = spec.run_requests([ids], params, [images])
        assert r.output_ids == cold.run_requests([ids], params, [images])[0].output_ids
    assert r.cached_tokens > 0
    assert_no_leaks(spec)


def nextn_kv(vl, chunk: int, ids, images) -> torch.Tensor:
    """The NEXTN layer's KV at the prompt's positions after its prefill (chunked at `chunk`)."""
    folder, oracle, model, tok = vl
    eng = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048, "chunked_prefill_size": chunk},
                     speculative={"num_steps": 2})
    (r,) = eng.run_requests([ids], SamplingParams(max_tokens=1, temperature=0), [images])
    m = eng.cache.tree.match(r.cache_ids[:len(ids)])     # the prompt's pages, kept by the prefix cache
    layer = eng.kv_pool.layer(nextn(eng).kv_layer)        # [pages, 2 (k, v), page_size, heads, head_dim]
    return torch.stack([layer[m.pages[p // PS], :, p % PS] for p in range(m.length)])


def test_the_nextn_head_embeds_image_tokens_as_their_features(vl):
    """The head's input at position p is the embedding of the token at p + 1: at an image token, that image's
    feature row (as the target's input). Its KV over the prompt is the same whether the prefill chunks end inside
    the images or not (the next token of a chunk's last row is the next chunk's first). Another picture of the same
    size changes it from the position before its first pad on (the target's hidden there is the same: only the
    head's embedding of the next token can tell the pictures apart)."""
    folder, oracle, model, tok = vl
    eng = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048})
    text = user_turn("Two: " + MARK + MARK + "go")
    ids, images = prepare(eng, tok, text, [png(40, 24, 51), png(32, 48, 52)])
    whole, split = nextn_kv(vl, 2048, ids, images), nextn_kv(vl, 7, ids, images)
    assert (whole - split).abs().max().item() < 1e-5
    _, others = prepare(eng, tok, text, [png(40, 24, 53), png(32, 48, 52)])
    other = nextn_kv(vl, 2048, ids, others)
    first = ids.index(model.cfg.image_token_id)
    assert (whole[:first - 1] - other[:first - 1]).abs().max().item() < 1e-6       # the text before: the same
    assert (whole[first - 1] - other[first - 1]).abs().max().item() > 1e-3         # next token an image: its feature


@pytest.mark.parametrize("chunk", [2048, 16])
def test_each_image_is_encoded_once_per_prefill_and_let_go_after_it(vl, chunk):
    """With NEXTN the head embeds the token after each row, so it reads an image's features one row past the
    target; neither may drop them before both are done (a feature cache too small to help must not make the tower
    run twice). Once the prompt is computed, or the request is preempted or aborted, the request holds none on the
    device; it keeps them on the host in place of its pixels, so a recompute after preemption skips the tower,
    and its output is the cold run's."""
    folder, oracle, model, tok = vl
    eng = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048, "chunked_prefill_size": chunk},
                     speculative={"num_steps": 2})
    eng.images.cache.max_bytes = 0                      # nothing is kept across requests
    ids, images = prepare(eng, tok, user_turn("Two: " + MARK + MARK + "go"), [png(40, 24, 61), png(32, 48, 62)])
    req = eng.intake.make_request(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), None, images)
    eng.scheduler.add(req)
    while req.num_computed < len(ids):
        eng._step()
    assert eng.stats().images.encoded == 2
    assert all(item.features is None for item in req.images.items)
    # the request keeps the features on the host, not the pixels; a recompute after preemption needs no tower
    assert all(item.image.pixel_values is None and item.encoded is not None for item in req.images.items)
    eng.scheduler.preempt(req)
    while req.num_computed < len(ids):
        eng._step()
    assert eng.stats().images.encoded == 2
    other = eng.intake.make_request(ids, SamplingParams(max_tokens=4), None, images)
    eng.scheduler.add(other)
    eng._step()                                            # part of the prompt (and an image's features) held
    eng.scheduler.abort(other)
    assert all(item.features is None for item in other.images.items)
    while req.status.value != "finished":
        eng._step()
    cold = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048}, cache={"enabled": False})
    assert req.output_ids == cold.run_requests([ids], req.params, [images])[0].output_ids
    assert_no_leaks(eng)


def test_the_file_tiers_fingerprint_ignores_the_folder_and_the_vision_tower(vl, tmp_path):
    """Moving a checkpoint or turning model.vision off changes no text page, so the file tier keeps serving; image
    tokens are keyed on the tower's weights instead (Intake.vision_fingerprint)."""
    import shutil

    from tinyserve.blob import model_fingerprint
    folder, oracle, model, tok = vl
    moved = shutil.copytree(folder, tmp_path / "moved")
    prints = {model_fingerprint(m, torch.float32, PS) for m in (model, load_model(moved, torch.float32),
                                                               load_model(folder, torch.float32, vision=False))}
    assert len(prints) == 1


def test_an_image_the_tower_cannot_encode_fails_only_its_own_request(vl):
    """A malformed image (pixel rows that do not fit its grid, as nothing but the offline API can hand over) is
    refused by the tower: that request ends with finish_reason "error"; the request batched with it is served."""
    import dataclasses
    folder, oracle, model, tok = vl
    eng = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048})
    cold = engine_for(model, tok, engine={"page_size": PS, "kv_cache_tokens": 2048}, cache={"enabled": False})
    ids, (image,) = prepare(eng, tok, user_turn(MARK + "What?"), [png(40, 24, 71)])
    broken = dataclasses.replace(image, pixel_values=image.pixel_values[:-4], digest=b"\x01" * 32)
    good, good_images = prepare(eng, tok, user_turn("And this? " + MARK), [png(24, 40, 72)])
    bad, fine = eng.run_requests([ids, good], GREEDY, [[broken], good_images])
    assert bad.finish_reason == "error" and not bad.output_ids
    assert fine.output_ids == cold.run_requests([good], GREEDY, [good_images])[0].output_ids
    assert_no_leaks(eng)


def test_an_image_processor_that_cuts_other_patches_than_the_tower_is_a_config_error(vl, tmp_path):
    """A preprocessor_config.json whose patch size the vision tower does not take is refused at start, naming the
    file's folder and model.path; a folder without one takes the tower's own patch sizes."""
    import json
    import shutil

    from tinyserve.config import ConfigError
    folder, oracle, model, tok = vl
    bad = shutil.copytree(folder, tmp_path / "bad")
    settings = json.loads((bad / "preprocessor_config.json").read_text())
    (bad / "preprocessor_config.json").write_text(json.dumps({**settings, "patch_size": 16}))
    with pytest.raises(ConfigError, match=r"patch_size.*\(16, 2, 2\).*\(4, 2, 2\)") as e:
        engine_for(load_model(bad, torch.float32), tok)
    assert e.value.key == "model.path"
    (bad / "preprocessor_config.json").unlink()
    assert engine_for(load_model(bad, torch.float32), tok).images.processor.patch_size == 4
