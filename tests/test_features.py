"""The core and its features (features.py): the hook contract.

- The core's types (Request, ForwardBatch, EngineStats, the scheduled and packed sequences) and its scheduler and
  runner name no optional feature; every hook is called from one place; a feature module that can go (NEXTN, the
  static and compiled steps, idle release, prompt logprobs) is imported by build.py alone, so deleting it and its
  registration leaves the rest whole. Read from the source.
- With every feature off an engine serves, and gives the greedy tokens of an engine with all of them on.
- With each feature alone, that feature works and the plain requests beside it get their plain tokens.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import time
from pathlib import Path

import pytest
import torch

from checkpoints import make_qwen3_5_vl
from conftest import assert_no_leaks, engine_for, static_steps, tokens
from tinyserve.engine import EngineStats
from tinyserve.features import HOOKS, Feature
from tinyserve.images import ImageSource
from tinyserve.loader import load_model
from tinyserve.models.qwen3_next import ForwardBatch
from tinyserve.request import Request
from tinyserve.runner import Packed
from tinyserve.sampling import Constraint, SamplingParams
from tinyserve.scheduler import ScheduledSeq
from tinyserve.tokenizer import Tokenizer
from test_vision_engine import png, user_turn

ROOT = Path(__file__).resolve().parent.parent
FEATURE_WORDS = ("nextn", "draft", "verify", "spec", "image", "vision", "mrope", "rope", "grammar", "constraint",
                 "static", "graph", "compiled", "prompt_logprob", "idle", "tier", "host", "prefetch")
ALL = ("nextn", "images", "grammar", "prompt_logprobs", "idle", "static")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------------------------------------------------------
# From the source

def named_after_a_feature(name: str) -> bool:
    """Whether a feature's word is one of the name's words (snake_case or CamelCase; plurals too)."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    return any(re.search(rf"(^|_){word}s?($|_)", snake) for word in FEATURE_WORDS)


def test_the_core_types_name_no_feature():
    assert named_after_a_feature("num_verify") and named_after_a_feature("ImageRows")    # the check itself
    assert named_after_a_feature("drafts") and not named_after_a_feature("staticmethod")
    for cls in (Request, ForwardBatch, EngineStats, ScheduledSeq, Packed):
        fields = [f.name for f in dataclasses.fields(cls)]
        assert not [f for f in fields if named_after_a_feature(f)], cls.__name__


@pytest.mark.parametrize("module", ["scheduler", "runner"])
def test_the_scheduler_and_the_runner_name_no_feature(module):
    """No name in their code (variables, attributes, functions, parameters) is a feature's, but the kernels' own
    (kernels.verify_layout: the layout of decodes with extra tokens)."""
    tree = ast.parse((ROOT / "tinyserve" / f"{module}.py").read_text())
    kernels = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and (n.module or "").startswith("tinyserve.kernels") for a in n.names}
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
    assert not sorted(n for n in names - kernels if named_after_a_feature(n))


def hook_calls() -> dict[str, list[str]]:
    """hook -> the modules that call `<...>.features.<hook>(...)`."""
    out: dict[str, list[str]] = {h: [] for h in HOOKS}
    for path in sorted((ROOT / "tinyserve").glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in HOOKS \
                    and isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "features":
                out[n.func.attr].append(path.stem)
    return out


def test_each_hook_is_called_from_one_place():
    calls = hook_calls()
    assert {h: len(c) for h, c in calls.items()} == dict.fromkeys(HOOKS, 1), calls
    assert {h: c[0] for h, c in calls.items()} == {
        "on_request": "intake", "decode_tokens": "scheduler", "free": "scheduler", "prepare": "engine", "model_inputs": "runner",
        "forward": "runner", "logit_masks": "runner", "accept": "runner", "after_forward": "runner",
        "commit": "engine", "wake": "engine", "idle_timeout": "engine", "on_idle": "engine", "stats": "engine"}


def importers(module: str) -> set[str]:
    """Our modules that import tinyserve.<module> (anywhere in the file)."""
    out = set()
    for path in sorted((ROOT / "tinyserve").glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module == f"tinyserve.{module}" and path.stem != module:
                out.add(path.stem)
    return out


def test_a_feature_module_is_reached_through_its_registration_alone():
    """What may be deleted with its registration line (build.py): only build.py (and the feature's own modules)
    import it; its records of a request are its own to make (Feature.on_request). The core finds a feature by its name (Features.named), never by importing it."""
    assert importers("spec") == {"build"}
    assert importers("verify") == {"spec"}
    assert importers("static") <= {"build", "compiled"}
    assert importers("compiled") <= {"build"}
    assert importers("idle") == {"build"}
    assert importers("prompt_logprobs") == {"build"}
    assert importers("grammar") == {"build"}
    assert importers("multimodal") == {"build"}


# ---------------------------------------------------------------------------------------------------------------
# Running: every feature off, each alone

@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """A tiny multimodal Qwen3.5 with a NEXTN head and a tokenizer: every feature has something to do."""
    folder, _ = make_qwen3_5_vl(tmp_path_factory.mktemp("vl"), with_mtp=True)
    return load_model(folder, torch.float32), Tokenizer.from_folder(folder)


def engine(vl, keep: tuple[str, ...] = ALL):
    """An engine with every feature registered (the static steps unbuilt), then only those in `keep`."""
    model, tok = vl
    eng = engine_for(model, tok, engine={"page_size": 16, "kv_cache_tokens": 2048, "idle_release_s": 60},
                     speculative={"num_steps": 2, "max_running": 0})
    static_steps(eng)
    assert sorted(f.name for f in eng.features.all) == sorted(ALL)
    kept = [f for f in eng.features.all if f.name in keep]
    eng.features.__init__(kept)                        # in place: the scheduler and the runner share it
    return eng


PLAIN = [tokens(40, 1), tokens(9, 2)]


def plain_tokens(eng) -> list[list[int]]:
    return eng.generate(PLAIN, GREEDY)


@pytest.fixture(scope="module")
def everything(vl):
    """What the engine with every feature on gives: the plain tokens, an image request's, the prompt logprobs."""
    eng = engine(vl)
    out = {"plain": plain_tokens(eng), "image": image_request(eng, vl)[0].output_ids,
           "prompt_logprobs": prompt_logprobs(eng)}
    assert_no_leaks(eng)
    return out


def image_request(eng, vl):
    ids, images = eng.intake.prepare_images(vl[1].encode(user_turn("What is this? <|vision_start|><|image_pad|>"
                                                                   "<|vision_end|>")),
                                            [ImageSource("img", png(40, 24, 3), "image/png")])
    return eng.run_requests([ids], GREEDY, [images])


def prompt_logprobs(eng) -> list:
    (r,) = eng.run_requests([PLAIN[0]], dataclasses.replace(GREEDY, prompt_logprobs=2))
    return r.report.get("prompt_logprobs")


def test_every_feature_off_serves_the_plain_tokens(vl, everything):
    eng = engine(vl, keep=())
    assert all(not fs for fs in eng.features.by_hook.values())
    assert plain_tokens(eng) == everything["plain"]
    assert prompt_logprobs(eng) is None                # off: the request runs, its prompt's logprobs are not made
    assert eng.stats().features == {}
    assert_no_leaks(eng)


@pytest.mark.parametrize("name", ALL)
def test_each_feature_alone(vl, everything, name):
    eng = engine(vl, keep=(name,))
    feature = eng.features.named(name)
    assert [f.name for f in eng.features.all] == [name] and isinstance(feature, Feature)
    if name == "nextn":                                # lossless, and it drafted
        assert plain_tokens(eng) == everything["plain"] and feature.totals.num_drafts > 0
    elif name == "images":                             # the image's features reach the model: the all-on tokens
        assert image_request(eng, vl)[0].output_ids == everything["image"]
        assert eng.stats().features["images"].encoded == 1
        assert plain_tokens(eng) == everything["plain"]
    elif name == "grammar":                            # the output is held to the grammar from its first token
        params = dataclasses.replace(GREEDY, constraint=Constraint("json_object"), ignore_eos=False, max_tokens=16)
        (r,) = eng.run_requests([tokens(12, 4)], params)
        assert vl[1].decode(r.output_ids).lstrip().startswith("{") and not r.features["grammar"].error
        assert plain_tokens(eng) == everything["plain"]
    elif name == "prompt_logprobs":
        got, want = prompt_logprobs(eng), everything["prompt_logprobs"]
        assert len(got) == len(PLAIN[0]) - 1 and [t for _, t in got] == [t for _, t in want]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-5)
        assert plain_tokens(eng) == everything["plain"]
    elif name == "static":                             # the decode steps run through the static buffers
        ran = []
        run = feature.run
        feature.run = lambda *a, **k: ran.append(a[0].num_seqs) or run(*a, **k)
        assert plain_tokens(eng) == everything["plain"] and ran
    elif name == "idle":                               # the pools go when idle and come back for the next request
        assert feature.idle_timeout() == pytest.approx(60, abs=1)
        feature.idle_since = time.monotonic() - 61
        feature.on_idle()
        assert feature.pools_freed and eng.stats().features["idle"].times == 1
        assert plain_tokens(eng) == everything["plain"] and not feature.pools_freed
    assert_no_leaks(eng)


def test_a_per_request_hook_reaches_only_the_requests_with_the_feature_record(vl):
    """logit_masks and commit (features.PER_REQUEST) reach a feature for the requests it keeps a record of alone,
    also when it is the only feature on the hook: the others meet none of its code."""
    class Marked(Feature):
        name = "marked"

        def __init__(self) -> None:
            self.masked, self.committed = [], []

        def on_request(self, req, images):
            if req.params.seed == 7:
                req.features[self.name] = True

        def logit_masks(self, reqs, rows):
            self.masked.append([r.params.seed for r in reqs])

        def commit(self, seq, out, kept):
            self.committed.append(seq.req.params.seed)

    eng = engine(vl, keep=())
    marked = Marked()
    eng.features.add(marked)
    eng.run_requests(PLAIN, [dataclasses.replace(GREEDY, seed=7), dataclasses.replace(GREEDY, seed=8)])
    assert marked.masked and all(seeds == [7] for seeds in marked.masked)
    assert marked.committed == [7] * GREEDY.max_tokens
    assert_no_leaks(eng)


def test_the_grammar_off_leaves_a_constrained_request_free(vl):
    """With every feature off a constrained request is served as a free one (its matcher is never consulted)."""
    eng = engine(vl, keep=())
    params = dataclasses.replace(GREEDY, constraint=Constraint("json_object"), ignore_eos=False, max_tokens=16)
    (r,) = eng.run_requests([tokens(12, 4)], params)
    (free,) = eng.run_requests([tokens(12, 4)], dataclasses.replace(params, constraint=None))
    assert r.output_ids == free.output_ids
    json.dumps(r.report)                               # nothing of the matcher in what the result hears
