"""NEXTN speculative decoding, measured as a user runs it: `tinyserve CONFIG` processes over HTTP, speculation off
and on, each in its own clean process, all up side by side (started one after another) and measured in alternating
rounds, with the ratios printed from the one run.

Random NEXTN heads accept almost nothing, so two of the three checkpoints (built once from the ~31M bench
checkpoint, see tests/checkpoints.make_agreeing_head) agree with the model by construction:
  exact   every layer's output projections are zero, so the next token depends on the last token only, and the
          head passes the token embedding through: it drafts exactly the model's next token (all accepted);
  half    the same model with the head's fc perturbed: about half of the drafts accepted;
  random  the bench checkpoint itself with a random head: almost nothing accepted (the adaptive depth at work).
The models compute exactly what a real one of their shape does (zero weights are still multiplied).

Per checkpoint: single-stream decode tokens/s (one greedy request, from its first token to its last) and the
aggregate tokens/s of 8 concurrent requests, speculation off vs on (medians over the rounds; a ratio is the
median of each round's ratio, the servers of a round measured one right after the other); the accept length from
/metrics. At 8 the default speculative.max_running (4) turns speculation off; the row "8, forced" sets
max_running = 0 to show why.
Targets: single stream >= 2.2x (exact, 3 steps), >= 1.4x (half), >= 0.95x (random); >= 0.95x at 8 in every case.
`--model memory-bound` runs the same on a ~190M-parameter model (bench/common.MEMORY_BOUND, 0.76 GB in fp32) whose
decode step reads weights rather than paying per-op overhead: there a verify's GEMMs cost little more than one
token's; targets 1.8x (exact), 1.2x (half), 0.95x (random). `--eager` serves with engine.compile_steps = false.

With --llama-server, llama.cpp's server runs beside it on the same checkpoints (converted with its own converter,
which keeps mtp.*), with and without `--spec-type draft-mtp --spec-draft-n-max STEPS`: its speed-up is the anchor.

    python bench/spec.py [--dir DIR] [--model bench|memory-bound] [--eager] [--new-tokens 256] [--rounds 3]
                         [--num-steps 3] [--llama-server PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from common import (DEFAULT_DIR, MEMORY_BOUND, BenchModelSpec, ServerProcess, bench_checkpoint,  # noqa: E402
                    cpu_server_config, fmt_table, free_port, load_average, make_prompts, stream_many, stream_sse)

HEADS = {"exact": (0.0, 0.0), "half": (0.0, 0.006), "random": None}     # (mix, head_noise); None: as is
MODELS = {"bench": (BenchModelSpec(), "qwen3_5_30m"), "memory-bound": (MEMORY_BOUND, "qwen3_5_190m")}
SPEED_TARGETS = {"bench": {"exact": 2.2, "half": 1.4, "random": 0.95},
                 "memory-bound": {"exact": 1.8, "half": 1.2, "random": 0.95}}
LLAMA_CPP_SH = Path(__file__).resolve().parent / "llama_cpp.sh"      # build and convert (see its header)


def spec_checkpoint(base: Path, name: str, root: Path) -> Path:
    """The bench checkpoint plus an mtp.* head (random, or made to agree with the model), built once."""
    from checkpoints import _mtp_tensors, add_tensors, make_agreeing_head, update_config
    folder = root / f"{base.name}_spec_{name}"
    marker = folder / "spec_head.json"
    want = json.dumps({"head": HEADS[name], "base": (base / "bench_spec.json").read_text()})
    if marker.exists() and marker.read_text() == want:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(base, folder)
    cfg = json.loads((folder / "config.json").read_text())
    add_tensors(folder, _mtp_tensors(cfg, moe=False, seed=1), "model-mtp.safetensors")
    update_config(folder, mtp_num_hidden_layers=1)
    if HEADS[name] is not None:
        mix, noise = HEADS[name]
        make_agreeing_head(folder, mix=mix, head_noise=noise)
    marker.write_text(want)
    return folder


def tinyserve_config(folder: Path, port: int, spec: bool, args, max_running: int) -> str:
    return cpu_server_config(folder, port, f"[speculative]\nnum_steps = {args.num_steps if spec else 0}\n"
                                           f"max_running = {max_running}\n", compile_steps=not args.eager)


def body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True}


def progress(event: dict):
    return [t for c in event.get("choices", []) for t in (c.get("token_ids") or [])], None


def llama_body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_tokens": True}


def llama_progress(event: dict):
    return list(event.get("tokens") or []), event.get("tokens_predicted")


def metric(url: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    m = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


@dataclass
class Target:
    """A server the rounds measure: its URL, streaming path, request body and progress reader."""
    url: str
    path: str
    body: Callable[[list[int], int], dict]
    progress: Callable[[dict], tuple]


async def measure(targets: list[Target], prompts: list[list[int]], new_tokens: int,
                  rounds: int) -> list[tuple[list[float], list[float]]]:
    """Per target and round: (single-stream decode tokens/s, aggregate tokens/s of len(prompts) concurrent
    requests). The targets take turns within every round, so a machine that speeds up or slows down for a while
    (other tenants, frequency) moves them alike: compare them round by round (`ratio`)."""
    import aiohttp
    single: list[list[float]] = [[] for _ in targets]
    many: list[list[float]] = [[] for _ in targets]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        # warm-up, not counted: one request and one concurrent batch each, full length, so that every graph, GEMM
        # shape and draft depth a round meets has run once (first calls pay one-off set-up) and the acceptance
        # estimate has seen this head
        for t in targets:
            await stream_sse(session, t.url + t.path, t.body(prompts[-1], new_tokens), t.progress)
            await stream_many(session, t.url + t.path, [t.body(p, new_tokens // 2) for p in prompts], t.progress)
        for r in range(rounds):
            for i, t in enumerate(targets):
                res = await stream_sse(session, t.url + t.path, t.body(prompts[r % len(prompts)], new_tokens),
                                       t.progress)
                single[i].append((res.count - 1) / (res.end - res.first))
            for i, t in enumerate(targets):
                wall, results = await stream_many(session, t.url + t.path,
                                                  [t.body(p, new_tokens // 2) for p in prompts], t.progress)
                many[i].append(sum(x.count for x in results) / wall)
    return list(zip(single, many))


def ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of a's tokens/s over b's in the same round."""
    return statistics.median(x / y for x, y in zip(a, b))


def start_tinyserve(folder: Path, spec: bool, args, max_running: int, work: Path, env) -> ServerProcess:
    port = free_port()
    cfg = work / f"{folder.name}-{'spec' if spec else 'plain'}-{max_running}.toml"
    cfg.write_text(tinyserve_config(folder, port, spec, args, max_running))
    exe = Path(sys.executable).parent / "tinyserve"
    argv = [str(exe), str(cfg)] if exe.exists() else [sys.executable, "-m", "tinyserve.cli", str(cfg)]
    return ServerProcess("tinyserve", argv, f"http://127.0.0.1:{port}", cfg.with_suffix(".log"), env=env)


def start_llama(folder: Path, spec: bool, args, work: Path, env) -> ServerProcess:
    gguf = work / f"{folder.name}.gguf"
    if not gguf.exists():
        subprocess.run(["bash", str(LLAMA_CPP_SH), "convert", str(folder), str(gguf), "f32"], check=True,
                       stdout=subprocess.DEVNULL, env={**os.environ, "PYTHON": sys.executable})
    port = free_port()
    argv = [args.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "8",
            "-c", str(8 * 1024), "-t", str(os.cpu_count())]
    if spec:
        argv += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(args.num_steps)]
    return ServerProcess("llama-server", argv, f"http://127.0.0.1:{port}", work / f"llama-{folder.name}-{spec}.log",
                         env=env)


def side_by_side(starts: list[Callable[[], ServerProcess]], targets: Callable[[ServerProcess], Target], args,
                 prompts) -> tuple[list[tuple[list[float], list[float]]], list[float | None]]:
    """Start the servers one after another (each ready, its graphs compiled or loaded, before the next starts),
    measure them in alternating rounds, stop them; returns the measures and each one's NEXTN accept length."""
    servers: list[ServerProcess] = []
    try:
        for start in starts:
            servers.append(start())
            servers[-1].wait_ready(3600)    # a cold start compiles every step's graph: minutes on a larger model
        measured = asyncio.run(measure([targets(s) for s in servers], prompts, args.new_tokens, args.rounds))
        accepts = [metric(s.url, "tinyserve:spec_decode_mean_accept_length") for s in servers]
    finally:
        for s in servers:
            s.stop()
    return measured, accepts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--model", default="bench", choices=list(MODELS))
    ap.add_argument("--eager", action="store_true", help="serve with engine.compile_steps = false")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--llama-server", default="", help="path of llama-server, to run it beside tinyserve")
    args = ap.parse_args(argv)

    base = bench_checkpoint(args.dir, *MODELS[args.model])
    folders = {name: spec_checkpoint(base, name, args.dir) for name in args.heads}
    prompts = make_prompts(8, 32, 64, seed=5)
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), "TQDM_DISABLE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    work = Path(tempfile.mkdtemp(prefix="tinyserve-bench-spec-"))
    load = load_average()
    rows, misses = [], []
    for name, folder in folders.items():
        (plain, spec, forced), accepts = side_by_side(
            [lambda: start_tinyserve(folder, False, args, 4, work, env),
             lambda: start_tinyserve(folder, True, args, 4, work, env),
             lambda: start_tinyserve(folder, True, args, 0, work, env)],
            lambda s: Target(s.url, "/v1/completions", body, progress), args, prompts)
        accept, med = accepts[1], statistics.median
        one, eight, eight_forced = ratio(spec[0], plain[0]), ratio(spec[1], plain[1]), ratio(forced[1], plain[1])
        rows.append((name, f"{med(plain[0]):.1f}", f"{med(spec[0]):.1f}", f"{one:.2f}x", f"{med(plain[1]):.1f}",
                     f"{med(spec[1]):.1f}", f"{eight:.2f}x", f"{med(forced[1]):.1f} ({eight_forced:.2f}x)",
                     f"{accept:.2f}" if accept else "-"))
        target = SPEED_TARGETS[args.model][name]
        if one < target:
            misses.append(f"{name}: single stream {one:.2f}x < {target}x")
        if eight < 0.95:
            misses.append(f"{name}: 8 concurrent {eight:.2f}x < 0.95x")
        if args.llama_server:
            (lp, ls), _ = side_by_side([lambda: start_llama(folder, False, args, work, env),
                                        lambda: start_llama(folder, True, args, work, env)],
                                       lambda s: Target(s.url, "/completion", llama_body, llama_progress), args,
                                       prompts)
            rows.append((f"{name} (llama.cpp)", f"{med(lp[0]):.1f}", f"{med(ls[0]):.1f}",
                         f"{ratio(ls[0], lp[0]):.2f}x", f"{med(lp[1]):.1f}", f"{med(ls[1]):.1f}",
                         f"{ratio(ls[1], lp[1]):.2f}x", "-", "-"))
    print(f"NEXTN speculative decoding on {base.name} ({'eager' if args.eager else 'compiled'} steps), "
          f"{args.num_steps} steps, {args.new_tokens} new tokens, median of "
          f"{args.rounds} rounds (a ratio: of each round's ratio); CPU, fp32, OMP_NUM_THREADS={os.cpu_count()}; load before: {load}; logs in {work}\n")
    print(fmt_table(rows, ("head", "1 plain tok/s", "1 spec tok/s", "1 ratio", "8 plain tok/s", "8 spec tok/s",
                           "8 ratio", "8 spec forced (max_running=0)", "accept length")))
    print("\ntargets: " + ("all met" if not misses else "MISSED: " + "; ".join(misses)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
