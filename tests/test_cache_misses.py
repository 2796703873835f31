"""Why did this miss? A prompt that shares a cached prefix and then leaves a cached path that goes on (a divergence)
is counted (CacheStats.divergences, /metrics), and the first one at each branch point is logged with its position
and the decoded tokens either side (docs/cache-misses.md). The oracle for the position is the prompts' own token
lists: the first index where the new prompt differs from the cached one."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from conftest import TEST_DEVICE, assert_no_leaks, engine_for
from server_util import ServerProcess, free_port, http, server_config
from tinyserve.loader import load_model
from tinyserve.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
SYSTEM = ("You are a coding agent working in a git repository. Answer briefly and run the tools you need. "
          "Today is 2026-07-12. The user's shell is bash and the project is written in Python; tests run with "
          "pytest and the linter is ruff.")


@pytest.fixture(scope="module")
def demo(xdg):
    """The demo model and its tokenizer (byte-level BPE: readable decoded text)."""
    from tinyserve.demo import ensure_demo_checkpoint
    from tinyserve.tokenizer import Tokenizer
    folder = ensure_demo_checkpoint()
    return load_model(folder, torch.float32, TEST_DEVICE), Tokenizer.from_folder(folder)


def first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


def divergence_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "leaves a cached path" in r.getMessage()]


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_drifting_prompt_is_counted_and_logged_once_per_branch_point(demo, page_size, caplog):
    model, tok = demo
    eng = engine_for(model, tok, engine={"page_size": page_size, "kv_cache_tokens": 4096})
    caplog.set_level(logging.INFO, logger="tinyserve.cache")
    base = tok.encode(SYSTEM + "\nuser: list the files")
    drifted = tok.encode(SYSTEM.replace("07-12", "07-13") + "\nuser: list the files")
    at = first_difference(base, drifted)

    def run(ids: list[int]):
        (req,) = eng.run_requests([ids], PARAMS)
        return req

    first = run(base)
    assert eng.stats().cache.divergences == 0 and not divergence_lines(caplog)
    run(base + first.output_ids + tok.encode(" and the tests"))   # the next turn goes on past the cached path
    run(base[:at - 10])                                 # a prefix of it: no divergence either
    assert eng.stats().cache.divergences == 0
    req = run(drifted)                                  # the date changed: leaves the path inside the system prompt
    assert eng.stats().cache.divergences == 1
    (line,) = divergence_lines(caplog)
    assert f"{req.request_id} leaves a cached path at token {at} of {len(drifted)}" in line, line
    assert f"({req.cached_tokens} tokens reused)" in line and req.cached_tokens <= at
    q = r"""(['"].*['"])"""                              # a repr: quoted with ' or "
    before, prompt_after, cache_after = re.search(rf"\.\.\.{q} \| the prompt goes on {q}\.\.\. \| "
                                                  rf"the cache went on {q}\.\.\.$", line).groups()
    assert eval(before) == tok.decode(drifted[at - 8:at], skip_special_tokens=False)      # noqa: S307 - a repr
    assert eval(prompt_after) == tok.decode(drifted[at:at + 8], skip_special_tokens=False)  # noqa: S307
    assert eval(cache_after) == tok.decode(base[at:at + 8], skip_special_tokens=False)    # noqa: S307
    assert "2026-07-1" in eval(before) + eval(prompt_after)                              # noqa: S307
    again = tok.encode(SYSTEM.replace("07-12", "07-14") + "\nuser: list the files")
    run(again)                                          # the same branch point again: counted, not logged again
    assert eng.stats().cache.divergences == 2 and len(divergence_lines(caplog)) == 1
    run(base[:at + 20] + tok.encode(" something else entirely, from a later point on"))   # a new branch point
    assert eng.stats().cache.divergences == 3 and len(divergence_lines(caplog)) == 2
    run(tok.encode("A different conversation altogether, sharing no page with the others at all."))
    assert eng.stats().cache.divergences == 3           # nothing shared: a plain miss, not a divergence
    assert_no_leaks(eng)


def test_a_changed_last_message_resumes_where_that_message_starts(demo):
    """An agent resends its conversation with the last message changed (Qwen Code drops a reminder it put before
    the user's words): the next turn resumes where that message starts, though no interval snapshot lies on the
    path (the interval is longer than the prompts), and answers as a cold run does. The oracle for the places is
    the template rendering the messages before them."""
    model, tok = demo
    pages = {"page_size": 16, "kv_cache_tokens": 4096}
    eng = engine_for(model, tok, engine=pages, cache={"state_track_interval": 2048})
    cold = engine_for(model, tok, engine=pages, cache={"enabled": False})
    reminder = "<system-reminder>Today is 2026-07-12 and the shell is bash.</system-reminder>\n"
    system = {"role": "system", "content": SYSTEM}
    first = [system, {"role": "user", "content": reminder + reminder.replace("bash", "zsh") + "Say hello"}]
    ids = tok.encode(tok.apply_chat_template(first))
    message_start = len(tok.encode(tok.apply_chat_template(first[:1], add_generation_prompt=False)))
    answer_start = len(tok.encode(tok.apply_chat_template(first, add_generation_prompt=False)))
    (req,) = eng.run_requests([ids], PARAMS)
    assert req.resume_hints == (answer_start, message_start)
    nxt = [system, {"role": "user", "content": reminder + "Say hello"},
           {"role": "assistant", "content": tok.decode(req.output_ids)}, {"role": "user", "content": "Now goodbye"}]
    again = tok.encode(tok.apply_chat_template(nxt))
    assert message_start + 16 < first_difference(ids, again) < answer_start - 16
    (req,) = eng.run_requests([again], PARAMS)
    assert req.cached_tokens == message_start // 16 * 16
    assert req.output_ids == cold.generate([again], PARAMS)[0]
    eng.cache.check()
    assert_no_leaks(eng)


def test_no_divergence_without_a_prefix_cache(demo):
    model, tok = demo
    eng = engine_for(model, tok, engine={"page_size": 16}, cache={"enabled": False})
    ids = tok.encode(SYSTEM)
    eng.run_requests([ids, ids[:40] + tok.encode(" other")], PARAMS)
    assert eng.stats().cache.divergences == 0


@pytest.mark.slow
def test_divergences_over_http(xdg, tmp_path):
    """Through the server, Claude Code style: the per-request billing header in the system prompt is stripped, so
    turns that differ only there share their prefix (no divergence); turns that ask different questions leave the
    cached path where the question starts: /metrics counts each, the log shows the first with the text around it."""
    def messages(cch: str, question: str) -> dict:
        return {"model": "tinyserve", "max_tokens": 4, "temperature": 0,
                "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.3; cch={cch};"},
                           {"type": "text", "text": SYSTEM}],
                "messages": [{"role": "user", "content": question}]}

    def divergences(srv) -> float:
        _, _, body = http("GET", srv.base_url + "/metrics")
        m = re.search(r"^tinyserve:prefix_cache_divergences_total (\S+)$", body.decode(), re.M)
        assert m, body.decode()
        return float(m.group(1))

    with ServerProcess(tmp_path, server_config(free_port())) as srv:
        for cch in ("1a2b3", "9f8e7", "c0ffe"):            # the header differs: stripped, the prompts are one
            status, _, _ = http("POST", srv.base_url + "/v1/messages", messages(cch, "list the files"))
            assert status == 200
        assert divergences(srv) == 0
        assert not [ln for ln in srv.log().splitlines() if "leaves a cached path" in ln]
        for question in ("show every test you can find", "count the lines of each module"):
            status, _, _ = http("POST", srv.base_url + "/v1/messages", messages("1a2b3", question))
            assert status == 200
        lines = [ln for ln in srv.log().splitlines() if "leaves a cached path" in ln]
        assert divergences(srv) == 2 and len(lines) == 1, lines
        assert "show" in lines[0] and "list" in lines[0], lines[0]
