"""The core and its optional parts (NEXTN, images, grammar, prompt logprobs, the static steps, the CPU's compiled
decode, idle release): each is one module, held by the core objects that call it under its own name, None when off.

- From the source: each part's methods are called at one place each, on `self.<part>` in the scheduler, the runner,
  the intake (request.py) or the engine (the table below is where a reader finds them); nothing binds methods with setattr; a
  part's module is imported by build.py alone (and its own helpers), so deleting it and its lines in build.py leaves
  the rest whole; 0 import circles.
- Running: with every part off an engine serves the greedy tokens of an engine with all of them on; each part alone
  works, and the plain requests beside it get their plain tokens; a request that asks for no part runs none of the
  per-request parts' code (grammar, images, prompt logprobs), traced.
"""
from __future__ import annotations

import ast
import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoints import make_qwen3_5_vl
from conftest import assert_no_leaks, engine_for, static_steps, tokens
from tinyserve.images import ImageSource
from tinyserve.loader import load_model
from tinyserve.sampling import Constraint, SamplingParams
from tinyserve.tokenizer import Tokenizer
from test_vision_engine import png, user_turn

ROOT = Path(__file__).resolve().parent.parent
CORE = {"scheduler": "scheduler", "runner": "runner", "request": "intake", "engine": "engine"}   # module: holder
# part -> (its module, {holder: the methods that holder calls}): where each is called, and by whom
CALLS = {
    "nextn": ("spec", {"scheduler": {"drafts", "drop"}, "runner": {"verify", "draft"}, "engine": {"stats"}}),
    "images": ("multimodal", {"scheduler": {"drop"}, "runner": {"model_inputs", "after_step"},
                              "intake": {"attach"}, "engine": {"encode", "stats"}}),
    "grammar": ("grammar", {"runner": {"masks"}, "intake": {"attach"}, "engine": {"advance"}}),
    "prompt_logprobs": ("prompt_logprobs", {"runner": {"read"}, "intake": {"attach"}}),
    "steps": ("static", {"runner": {"takes", "forward"}}),
    "compiled": ("compiled", {"runner": {"decode", "logits"}}),
    "idle": ("idle", {"engine": {"wake", "timeout", "release", "stats"}}),
}
PARTS = tuple(CALLS)
# the parts an engine here switches on and runs: all but the CPU's compiled graphs, which take minutes to make (their
# running rules: tests/test_compiled.py, tests/test_compiled_nextn.py)
RUNNING = tuple(p for p in PARTS if p != "compiled")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


# ---------------------------------------------------------------------------------------------------------------
# From the source

def part_calls() -> dict[str, dict[str, list[str]]]:
    """part -> holder -> the methods called as `self.<part>.<method>(...)` there (one entry per call site)."""
    out: dict[str, dict[str, list[str]]] = {p: {} for p in PARTS}
    for module, holder in CORE.items():
        for n in ast.walk(ast.parse((ROOT / "tinyserve" / f"{module}.py").read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                    and isinstance(n.func.value, ast.Attribute) and n.func.value.attr in CALLS \
                    and isinstance(n.func.value.value, ast.Name) and n.func.value.value.id == "self":
                out[n.func.value.attr].setdefault(holder, []).append(n.func.attr)
    return out


def test_each_part_is_called_by_name_at_one_place_per_method():
    calls = part_calls()
    assert {p: {m: set(names) for m, names in by.items()} for p, by in calls.items()} == \
        {p: methods for p, (_, methods) in CALLS.items()}
    twice = [(p, m, name) for p, by in calls.items() for m, names in by.items() for name in names
             if names.count(name) > 1]
    assert not twice, twice


def test_the_parts_methods_exist_where_the_core_calls_them():
    """The table above names real methods of each part's class (a renamed method fails here, not in serving)."""
    from tinyserve.grammar import Grammar
    from tinyserve.idle import IdleRelease
    from tinyserve.multimodal import Images
    from tinyserve.prompt_logprobs import PromptLogprobs
    from tinyserve.spec import NextN
    from tinyserve.static import StaticStep
    from tinyserve.compiled import CompiledSteps
    classes = {"nextn": NextN, "images": Images, "grammar": Grammar, "prompt_logprobs": PromptLogprobs,
               "steps": StaticStep, "compiled": CompiledSteps, "idle": IdleRelease}
    for part, (_, by_holder) in CALLS.items():
        for methods in by_holder.values():
            assert all(callable(getattr(classes[part], m, None)) for m in methods), (part, methods)


def test_nothing_binds_methods_with_setattr():
    for path in sorted((ROOT / "tinyserve").glob("*.py")):
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id == "setattr"]
        assert not calls, path.name


def importers(module: str) -> set[str]:
    """Our modules that import tinyserve.<module> (anywhere in the file)."""
    out = set()
    for path in sorted((ROOT / "tinyserve").glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module == f"tinyserve.{module}" and path.stem != module:
                out.add(path.stem)
    return out


def test_a_part_module_is_imported_by_build_alone():
    """What may be deleted with its lines in build.py: the core names a part's interface (a Protocol next to the
    code that calls it), never its module."""
    assert importers("spec") == {"build"}
    assert importers("verify") == {"spec"}
    assert importers("static") <= {"build", "compiled"}
    assert importers("compiled") <= {"build"}
    for module in ("idle", "prompt_logprobs", "grammar", "multimodal"):
        assert importers(module) == {"build"}, module


# ---------------------------------------------------------------------------------------------------------------
# Running: every part off, each alone

@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """A tiny multimodal Qwen3.5 with a NEXTN head and a tokenizer: every part has something to do."""
    folder, _ = make_qwen3_5_vl(tmp_path_factory.mktemp("vl"), with_mtp=True)
    return load_model(folder, torch.float32), Tokenizer.from_folder(folder)


def switch_off(eng, part: str) -> None:
    """The part off: None in every core object that holds it (CALLS' holders)."""
    holders = {"engine": eng, "scheduler": eng.scheduler, "runner": eng.runner, "intake": eng.intake}
    for holder in CALLS[part][1]:
        setattr(holders[holder], part, None)


def engine(vl, keep: tuple[str, ...] = RUNNING):
    """An engine with every part on (the static steps unbuilt), then only those in `keep`."""
    model, tok = vl
    eng = engine_for(model, tok, engine={"page_size": 16, "kv_cache_tokens": 2048, "idle_release_s": 60},
                     speculative={"num_steps": 2, "max_running": 0})
    static_steps(eng)
    for part in RUNNING:
        assert getattr(eng.runner, part, None) is not None or getattr(eng, part) is not None, part
        if part not in keep:
            switch_off(eng, part)
    return eng


PLAIN = [tokens(40, 1), tokens(9, 2)]


def plain_tokens(eng) -> list[list[int]]:
    return eng.generate(PLAIN, GREEDY)


@pytest.fixture(scope="module")
def everything(vl):
    """What the engine with every part on gives: the plain tokens, an image request's, the prompt logprobs."""
    eng = engine(vl)
    out = {"plain": plain_tokens(eng), "image": image_request(eng, vl)[0].output_ids,
           "prompt_logprobs": prompt_logprobs(eng)}
    assert_no_leaks(eng)
    return out


def image_request(eng, vl):
    ids, images = eng.images.prepare(vl[1].encode(user_turn("What is this? <|vision_start|><|image_pad|>"
                                                            "<|vision_end|>")),
                                     [ImageSource("img", png(40, 24, 3), "image/png")])
    return eng.run_requests([ids], GREEDY, [images])


def prompt_logprobs(eng) -> list:
    (r,) = eng.run_requests([PLAIN[0]], dataclasses.replace(GREEDY, prompt_logprobs=2))
    return r.report.get("prompt_logprobs")


def test_every_part_off_serves_the_plain_tokens(vl, everything):
    eng = engine(vl, keep=())
    assert plain_tokens(eng) == everything["plain"]
    assert prompt_logprobs(eng) is None                # off: the request runs, its prompt's logprobs are not made
    stats = eng.stats()
    assert stats.nextn is None and stats.images is None and stats.idle is None
    assert_no_leaks(eng)


@pytest.mark.parametrize("name", RUNNING)
def test_each_part_alone(vl, everything, name):
    eng = engine(vl, keep=(name,))
    if name == "nextn":                                # lossless, and it drafted
        assert plain_tokens(eng) == everything["plain"] and eng.nextn.totals.num_drafts > 0
    elif name == "images":                             # the image's features reach the model: the all-on tokens
        assert image_request(eng, vl)[0].output_ids == everything["image"]
        assert eng.stats().images.encoded == 1
        assert plain_tokens(eng) == everything["plain"]
    elif name == "grammar":                            # the output is held to the grammar from its first token
        params = dataclasses.replace(GREEDY, constraint=Constraint("json_object"), ignore_eos=False, max_tokens=16)
        (r,) = eng.run_requests([tokens(12, 4)], params)
        assert vl[1].decode(r.output_ids).lstrip().startswith("{") and not r.grammar.error
        assert plain_tokens(eng) == everything["plain"]
    elif name == "prompt_logprobs":
        got, want = prompt_logprobs(eng), everything["prompt_logprobs"]
        assert len(got) == len(PLAIN[0]) - 1 and [t for _, t in got] == [t for _, t in want]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in want], abs=1e-5)
        assert plain_tokens(eng) == everything["plain"]
    elif name == "steps":                              # the decode steps run through the static buffers
        ran = []
        run = eng.runner.steps.run
        eng.runner.steps.run = lambda *a, **k: ran.append(a[0].num_seqs) or run(*a, **k)
        assert plain_tokens(eng) == everything["plain"] and ran
    elif name == "idle":                               # the pools go when idle and come back for the next request
        idle = eng.idle
        assert idle.timeout() == pytest.approx(60, abs=1)
        idle.idle_since = time.monotonic() - 61
        idle.release()
        assert idle.pools_freed and eng.stats().idle.times == 1
        assert plain_tokens(eng) == everything["plain"] and not idle.pools_freed
    assert_no_leaks(eng)


def test_a_plain_request_runs_none_of_the_per_request_parts(vl, everything):
    """Grammar, images and prompt logprobs on: a request that asks for none of them enters none of their modules'
    functions (traced), and gets the plain tokens."""
    eng = engine(vl, keep=("images", "grammar", "prompt_logprobs"))
    watched = {str(ROOT / "tinyserve" / f"{m}.py") for m in ("grammar", "multimodal", "prompt_logprobs")}
    entered: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in watched:
            entered.add(f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        out = plain_tokens(eng)
    finally:
        sys.setprofile(None)
    assert out == everything["plain"] and not entered, sorted(entered)
    assert_no_leaks(eng)


def test_the_grammar_off_leaves_a_constrained_request_free(vl):
    """With every part off a constrained request is served as a free one (its matcher is never made)."""
    eng = engine(vl, keep=())
    params = dataclasses.replace(GREEDY, constraint=Constraint("json_object"), ignore_eos=False, max_tokens=16)
    (r,) = eng.run_requests([tokens(12, 4)], params)
    (free,) = eng.run_requests([tokens(12, 4)], dataclasses.replace(params, constraint=None))
    assert r.output_ids == free.output_ids and r.grammar is None
    json.dumps(r.report)                               # nothing of the matcher in what the result hears
