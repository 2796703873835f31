"""What a user gets: a real `tinyserve CONFIG` server over HTTP, beside its peers, each in its own clean process.

    python bench/serve.py                                   # ~31M Qwen3.5-shaped random checkpoint, fp32, CPU
    python bench/serve.py --dtype bfloat16 --llama-server ~/llama/bin/llama-server --gguf model-bf16.gguf
    python bench/serve.py --config my.toml --rounds 5 --stat median
    python bench/serve.py --context 200,8000,30000,128000 --systems http llama --llama-server ... --gguf ...
    python bench/serve.py --model memory-bound --weights f32,bf16,w4 --gguf Q4_0 \\
        --llama-server ~/.cache/tinyserve/llama.cpp/bin/llama-server         # 4-bit beside llama.cpp's Q4_0

Systems (each one a separate process that runs nothing else; all load first, then they take turns):
  tinyserve HTTP        `tinyserve CONFIG` (the console script); streaming POST /v1/completions with token-id
                        prompts, ignore_eos, temperature 0, fixed max_tokens, from an aiohttp client in this process
  tinyserve HTTP eager  the same server with engine.compile_steps = false: every step eager (the compiled step's
                        gain, side by side; the same as tinyserve HTTP on a GPU)
  tinyserve in-process  a fresh Python subprocess: build_engine(cfg), then engine.generate(prompts, params)
  llama-server          with --llama-server and --gguf: `llama-server -m GGUF -np 8 -t THREADS -c ...`; the same
                        token-id prompts through streaming POST /completion (n_predict, ignore_eos, temperature 0)
  transformers          a fresh Python subprocess: model.generate on the same prompts, one after the other, greedy,
                        eos ignored (transformers has no server and no batching of independent requests)
  tinyserve f32 / bf16 / w4   with --weights f32,bf16,w4 instead of the above: one `tinyserve CONFIG` server per
                        entry, as tinyserve HTTP, serving the checkpoint in float32, in bfloat16, or its 4-bit twin
                        (w4: float32 activations; w4bf16: bfloat16 ones; w4q8: float32 ones rounded to int8 in
                        the GEMMs, model.int8_activations), beside llama-server with --llama-server

Measures (the same prompts for every system within a round, new prompts every round and for every warm-up, so
no prefix cache, tinyserve's or llama-server's, ever holds a prompt it is asked for):
  1 request x 48 tokens       tokens / wall time of the request (prompt 32-64 tokens)
  8 concurrent x 48 tokens    all 8 sent at once; 384 tokens / wall time until the last one ends
  prefill, 2000-token prompt  2000 / time to first token, with max_tokens = 1
  TTFT                        time to first token of one 32-token prompt, max_tokens = 1
Every time is wall clock taken by this script: around the HTTP request (send -> streamed token) for the servers,
around the call for in-process tinyserve and transformers; no server's self-reported timings are used. Each
figure is the best (or, with --stat median, the median) of --rounds rounds; inside a round the systems take
turns for each measure, in an order that rotates from round to round. --dtype picks the weights' dtype of
tinyserve and transformers (pass the GGUF of the same dtype); with bfloat16 the max abs difference of the bf16
logits from the fp32 logits (transformers, one prompt, every position) is printed too.

--model bench|memory-bound: the ~31M bench checkpoint (bench/common.BenchModelSpec, the default) or the ~190M one
whose decode reads its weights rather than paying per-op overhead (bench/common.MEMORY_BOUND, 0.76 GB in fp32); both
built once into the cache folder, shared with bench/spec.py.

--weights f32,bf16,w4: the systems are one tinyserve HTTP server per entry (and llama-server with --llama-server),
all measured in the same rounds. w4 serves the checkpoint's 4-bit twin, made once beside it (`<name>-w4a16-g128`)
in the layout llm-compressor publishes W4A16 in: compressed-tensors pack-quantized, symmetric int4 in groups of 128
input columns, float16 scales (amax / 7), packed by compressed-tensors' own pack_to_int32, the config written by its
ModelCompressor. Quantized: the decoder layers' linear weights (attention q/k/v/o, the GDN's in_proj_qkv / in_proj_z /
out_proj, the MLP's gate/up/down); left as stored, as published checkpoints leave them: embeddings, lm_head, norms,
A_log, dt_bias, conv1d and the GDN's small in_proj_a / in_proj_b (bench/common.w4_checkpoint). The ratios of w4 to
llama-server, to f32 and to bf16 are printed, and with --model memory-bound the issue's targets (w4 >= 1.0x
llama-server and >= 2.5x f32, decode of 1 request and of 8 concurrent).

--gguf TYPE (Q4_0, Q8_0, Q4_K_M, f32, bf16, ...) instead of a file: the GGUF is made from the checkpoint by llama.cpp's
own tools (bench/llama_cpp.sh): its converter writes f32 / bf16 / f16, its llama-quantize any other type from the f32
GGUF (llama-quantize from the folder of --llama-server's binary, else from bench/llama_cpp.sh build's); cached beside
the checkpoint as `<name>-<TYPE>.gguf`. The GGUF's file type is checked against TYPE (a file: against --dtype).

Every figure is printed with its spread over the rounds (min-max), every ratio with the spread of the rounds' own
ratios (the systems of a round measured one after the other). With --weights, the 1-request and 8-concurrent rows
are followed by their decode-only rates, on which the issue's targets are checked: the same requests' tokens that
arrived while all of them were decoding (after the last of their first tokens, up to the first of their last ones)
over that time. No prefill counts, whether a server prefilled the requests in one step or in two (tinyserve starts
on the first request to arrive and prefills the other seven in its next step; llama-server took all eight at once).

--context C1,C2,...: decode as the context grows instead. For each length, one prompt of that many tokens is sent
once to each system (its prefill, timed: prompt tokens / time to first token), then again each round with
--new-tokens tokens to generate (64 by default here): the prompt is then a prefix-cache hit for every system
(tinyserve's cache, llama-server's slot), and the figure is the decode rate, (tokens - 1) / (last token - first
token). tinyserve gets model.context_length and a KV pool for the longest length (and --kv-dtype for its KV
cache, e.g. float16 as llama-server's default cache), llama-server one slot of that length.

Start-up: each system's time from launch to ready is printed. The compiled CPU step (engine.compile_steps) keeps
inductor's cache in ~/.cache/tinyserve/compiled: run once to warm it; `TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python
bench/serve.py ...` measures a cold start.

The machine must be quiet: the load average before and after, and the CPU time that other processes took during
the run, are printed, with a warning when the machine was oversubscribed. Logs of every process are kept in the
work folder, printed at the end (removed after a successful run unless --keep).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # `bench.common` when run as a script

from bench.common import (BENCH_MODELS, CpuMeter, ServerProcess, Worker, fmt_table, free_port,  # noqa: E402
                          gguf_file_type, is_gguf_type, llama_gguf, load_average, serve_worker, stream_many,
                          token_prompts)

HTTP, EAGER, INPROC, LLAMA, HF = ("tinyserve HTTP", "tinyserve HTTP eager", "tinyserve in-process", "llama-server",
                                  "transformers")
SYSTEM_KEYS = {"http": HTTP, "eager": EAGER, "inprocess": INPROC, "llama": LLAMA, "transformers": HF}
WEIGHTS = {"f32": "float32", "bf16": "bfloat16", "w4": "float32",   # --weights: model.dtype (w4: its activations')
           "w4bf16": "bfloat16", "w4q8": "float32"}
W4_TARGETS = {LLAMA: 1.0, "f32": 2.5}     # the issue's, on the memory-bound model: w4 / each, 1 and 8, decode
ONE, BATCH, PREFILL, TTFT = "one", "batch", "prefill", "ttft"
DECODE = {ONE: "one decode", BATCH: "batch decode"}     # --weights: the same requests' decode-only figures
CONTEXT_NEW_TOKENS = 64
TTFT_PROMPT_TOKENS = 32
SETTLE_S = 0.2     # pause before each measure: the previous system's spinning threads go to sleep


@dataclass
class Shape:
    """The workload of one run (the defaults are the reported benchmark; smaller ones are for quick checks)."""

    new_tokens: int = 48
    concurrency: int = 8
    prefill_tokens: int = 2000
    vocab: int = 4096

    def prompts(self, kind: str, tag: str) -> tuple[list[list[int]], int]:
        """(prompts, max_tokens) of one measure; `tag` names the round, so each round gets new prompts."""
        seed = f"{kind}/{tag}"
        if kind == ONE:
            return token_prompts(1, 32, 64, self.vocab, seed), self.new_tokens
        if kind == BATCH:
            return token_prompts(self.concurrency, 32, 64, self.vocab, seed), self.new_tokens
        if kind == PREFILL:
            return token_prompts(1, self.prefill_tokens, self.prefill_tokens, self.vocab, seed), 1
        return token_prompts(1, TTFT_PROMPT_TOKENS, TTFT_PROMPT_TOKENS, self.vocab, seed), 1


@dataclass
class Sample:
    """One measure of one system: `seconds` is the wall time (one, batch) or the time to first token (prefill,
    ttft); `outputs` the generated ids per prompt."""

    seconds: float
    outputs: list[list[int]]
    counts: list[int] | None = None    # generated tokens per prompt when `outputs` may miss ids (llama-server)
    decode: float | None = None        # HTTP: tokens after the first / (last token - first token of any), tok/s

    def lengths(self) -> list[int]:
        return self.counts if self.counts is not None else [len(o) for o in self.outputs]


# ---------------------------------------------------------------------------------------------------------------
# Systems
# ---------------------------------------------------------------------------------------------------------------
class HTTPSystem:
    """A server process measured through streaming HTTP requests."""

    def __init__(self, name: str, server: ServerProcess, path: str, body, progress) -> None:
        self.name, self.server, self.path, self.body, self.progress = name, server, path, body, progress
        self.session = None
        self.info, self.ready_s, self.label = "", 0.0, name     # label: the name the report prints

    def _session(self):
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=3600),
                                                 # a new connection per request: llama-server may close
                                                 # an idle kept-alive one just as it is reused
                                                 connector=aiohttp.TCPConnector(limit=0, force_close=True))
        return self.session

    async def measure(self, prompts: list[list[int]], max_tokens: int, ttft: bool) -> Sample:
        wall, results = await stream_many(self._session(), self.server.url + self.path,
                                          [self.body(p, max_tokens) for p in prompts], self.progress)
        # decode: while every request is decoding (from the last first token to the first last one), so that no
        # prefill counts, whichever steps a server gave the requests' prefills
        a, b = max(r.first or r.end for r in results), min(r.end for r in results)
        return Sample(results[0].ttft if ttft else wall, [r.token_ids for r in results], [r.count for r in results],
                      sum(r.tokens_within(a, b) for r in results) / (b - a) if b > a else None)

    async def stream(self, prompt: list[int], max_tokens: int):
        """One streamed request, its StreamResult (start, first and last token)."""
        wall, results = await stream_many(self._session(), self.server.url + self.path,
                                          [self.body(prompt, max_tokens)], self.progress)
        return results[0]

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        self.server.stop()


class WorkerSystem:
    """A worker subprocess (tinyserve in-process or transformers) measured around its call."""

    def __init__(self, name: str, worker: Worker, info: str) -> None:
        self.name, self.worker, self.info = name, worker, info
        self.ready_s, self.label = 0.0, name

    async def measure(self, prompts: list[list[int]], max_tokens: int, ttft: bool) -> Sample:
        r = self.worker.call("run", prompts=prompts, max_tokens=max_tokens)
        return Sample(r["seconds"], r["outputs"])

    async def close(self) -> None:
        self.worker.stop()


def _tinyserve_progress(event: dict) -> tuple[list[int], int | None]:
    return [t for c in event.get("choices", []) for t in (c.get("token_ids") or [])], None


def _llama_progress(event: dict) -> tuple[list[int], int | None]:
    return list(event.get("tokens") or []), event.get("tokens_predicted")


def _tinyserve_body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True}


def _llama_body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "n_predict": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_tokens": True}


def _worker_argv(kind: str, spec: dict) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--spec", json.dumps(spec)]


def _tinyserve_argv(cfg_path: Path) -> list[str]:
    script = Path(sys.executable).parent / "tinyserve"
    return [str(script), str(cfg_path)] if script.exists() else [sys.executable, "-m", "tinyserve.cli",
                                                                   str(cfg_path)]


def _safetensors_mb(folder: str) -> float:
    return sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 1e6


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------------------------------
# Worker subprocesses (python bench/serve.py --worker KIND --spec JSON)
# ---------------------------------------------------------------------------------------------------------------
def worker_main(kind: str, spec: dict) -> None:
    """Loads its system once, then answers `run` (and `logits_diff`) requests from the orchestrator."""
    import torch

    if kind == "prepare":                     # resolve / build the checkpoint (needs torch + transformers)
        def prepare(op: str, req: dict) -> dict:
            from bench.common import bench_checkpoint, w4_checkpoint
            if req["path"] is None:
                folder = bench_checkpoint(req["dir"], *BENCH_MODELS[req["model"]])
            elif req["path"] == "demo":
                from tinyserve.demo import ensure_demo_checkpoint
                folder = ensure_demo_checkpoint()
            else:
                folder = Path(req["path"])
            cfg = json.loads((Path(folder) / "config.json").read_text())
            cfg = cfg.get("text_config", cfg)
            w4 = w4_checkpoint(folder) if req.get("w4") else None
            return {"folder": str(folder), "vocab": cfg["vocab_size"], "w4": w4 and str(w4)}
        serve_worker(prepare)
        return

    if kind == "tinyserve":
        from tinyserve import config as config_mod
        from tinyserve.build import build_engine
        from tinyserve.sampling import SamplingParams

        engine = build_engine(config_mod.load(spec["config"]))

        def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            return engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        info = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    else:                                     # transformers
        import transformers

        from bench.common import load_hf
        transformers.logging.set_verbosity_error()
        dtype = getattr(torch, spec["dtype"])
        device = spec["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        hf = load_hf(Path(spec["folder"]), dtype).to(device)
        hf.generation_config.eos_token_id = None      # ignore_eos, as the other systems' requests
        hf.generation_config.pad_token_id = 0

        @torch.inference_mode()
        def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            outs = []
            for p in prompts:                           # one by one: generate has no batching of requests
                ids = torch.tensor([p], device=device)
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  min_new_tokens=max_tokens, do_sample=False)
                outs.append(out[0, len(p):].tolist())
            return outs
        info = f"transformers {transformers.__version__}, torch {torch.__version__}, " \
               f"{torch.get_num_threads()} threads"

        @torch.inference_mode()
        def logits_diff(prompt: list[int]) -> dict:
            ref = load_hf(Path(spec["folder"]), torch.float32).to(device)
            ids = torch.tensor([prompt], device=device)
            a = ref(ids).logits.float()
            b = hf(ids).logits.float()
            return {"max_abs_diff": (a - b).abs().max().item(), "max_abs": a.abs().max().item(),
                    "argmax_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}

    def handle(op: str, req: dict) -> dict:
        if op == "info":
            return {"info": info}
        if op == "run":
            t0 = time.perf_counter()
            outs = generate(req["prompts"], req["max_tokens"])
            return {"seconds": time.perf_counter() - t0, "outputs": outs}
        if op == "logits_diff" and kind == "transformers":
            return logits_diff(req["prompt"])
        raise ValueError(f"unknown op {op!r}")

    serve_worker(handle)


# ---------------------------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Results:
    samples: dict[tuple[str, str], list[Sample]] = field(default_factory=dict)
    prompts: dict[tuple[str, str], tuple[list[list[int]], int]] = field(default_factory=dict)

    def add(self, system: str, kind: str, sample: Sample) -> None:
        self.samples.setdefault((system, kind), []).append(sample)


def value(kind: str, sample: Sample, prompts: list[list[int]]) -> float:
    """tokens/s (one, batch), prompt tokens/s (prefill), seconds (ttft)."""
    if kind in (ONE, BATCH):
        return sum(sample.lengths()) / sample.seconds
    if kind == PREFILL:
        return len(prompts[0]) / sample.seconds
    return sample.seconds


def check_lengths(system: str, kind: str, prompts: list[list[int]], max_tokens: int, sample: Sample) -> None:
    got = sample.lengths()
    if len(got) != len(prompts) or any(n != max_tokens for n in got):
        raise RuntimeError(f"{system}, {kind}: expected {len(prompts)} outputs of {max_tokens} tokens, got {got}")


async def run(args: argparse.Namespace) -> int:
    from tinyserve import config as config_mod

    meter = CpuMeter().start()
    load_before = load_average()
    threads = args.threads or len(os.sched_getaffinity(0))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tinyserve-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    weights = args.weights.split(",") if args.weights else []
    if weights:
        names = [f"tinyserve {w}" for w in weights] + ([LLAMA] if args.llama_server else [])
    else:
        names = [SYSTEM_KEYS[s] for s in args.systems] if args.systems else (
            [HTTP] if args.context else [HTTP, EAGER, INPROC, HF]) + ([LLAMA] if args.llama_server else [])
    if LLAMA in names and not (args.llama_server and args.gguf):
        raise SystemExit("llama-server needs --llama-server PATH and --gguf PATH (or --gguf TYPE, e.g. Q4_0)")

    # the tinyserve config: the user's, or one for the bench checkpoint; dtype, port and logging from here
    if args.config:
        data = config_mod.to_dict(config_mod.load(args.config))
        model_path = data["model"]["path"]
    else:
        data = config_mod.to_dict(config_mod.from_dict({"model": {"path": "demo", "device": "cpu"}}))
        model_path = None
    prep = Worker("prepare", _worker_argv("prepare", {}), work / "prepare.log", env)
    try:
        ckpt = prep.call("prepare", path=model_path, dir=str(args.dir) if args.dir else None, model=args.model,
                         w4=any(w.startswith("w4") for w in weights))
    finally:
        prep.stop()
    folder, shape = ckpt["folder"], Shape(args.new_tokens, args.concurrency, args.prefill_tokens, ckpt["vocab"])
    gguf_type = None
    if LLAMA in names and is_gguf_type(args.gguf):    # made here from the checkpoint, by llama.cpp's own tools
        gguf_type = args.gguf.upper()
        quantize = Path(args.llama_server).resolve().parent
        args.gguf = str(llama_gguf(folder, args.gguf, quantize.parent if (quantize / "llama-quantize").exists()
                                   else None))
    data["model"].update(path=folder, dtype=args.dtype)
    data["server"].update(host="127.0.0.1", port=free_port(), api_key="")
    data["log"]["level"] = "warning"
    data["engine"]["max_running_requests"] = max(data["engine"]["max_running_requests"], shape.concurrency)
    contexts = [int(c) for c in args.context.split(",")] if args.context else []
    if contexts:                                      # room for the longest prompt and its answer
        data["model"]["context_length"] = max(contexts) + 2 * shape.new_tokens + 256
        data["engine"]["kv_cache_tokens"] = 0
    if args.kv_dtype:
        data["model"]["kv_cache_dtype"] = args.kv_dtype
    cfg = config_mod.from_dict(data)
    cfg_path = work / "tinyserve.toml"
    cfg_path.write_text(config_mod.dumps(cfg))
    data["server"]["port"] = free_port()
    data["engine"]["compile_steps"] = False
    eager_cfg = config_mod.from_dict(data)
    eager_path = work / "tinyserve-eager.toml"
    eager_path.write_text(config_mod.dumps(eager_cfg))
    device = cfg.model.device           # "auto": the transformers worker picks as tinyserve does
    servers = {HTTP: (cfg, cfg_path), EAGER: (eager_cfg, eager_path)}    # tinyserve HTTP servers: (config, file)
    for w in weights:                   # --weights: one server each, with the HTTP server's config otherwise
        data["engine"]["compile_steps"] = cfg.engine.compile_steps
        data["model"].update(path=ckpt["w4"] if w.startswith("w4") else folder, dtype=WEIGHTS[w],
                             int8_activations=w == "w4q8")
        data["server"]["port"] = free_port()
        w_path = work / f"tinyserve-{w}.toml"
        w_path.write_text(config_mod.dumps(config_mod.from_dict(data)))
        servers[f"tinyserve {w}"] = (config_mod.from_dict(data), w_path)

    systems: dict[str, HTTPSystem | WorkerSystem] = {}
    context_figures = None
    try:
        # start every system (one after the other), then measure
        for name in names:
            t0 = time.perf_counter()
            if name in servers:
                c, path = servers[name]
                srv = ServerProcess(name, _tinyserve_argv(path), f"http://127.0.0.1:{c.server.port}",
                                    work / f"{path.stem}-server.log", env=env)
                systems[name] = HTTPSystem(name, srv, "/v1/completions", _tinyserve_body, _tinyserve_progress)
                srv.wait_ready()
                systems[name].info = f"`tinyserve {path.name}`, OMP_NUM_THREADS={threads}"
                if "compiling the CPU steps failed" in srv.log.read_text(errors="replace"):
                    systems[name].info += " (WARNING: compiling its steps failed, they run eagerly: see its log)"
                if weights:
                    systems[name].info += (f", {Path(c.model.path).name} in {c.model.dtype} "
                                           f"({_safetensors_mb(c.model.path):.0f} MB of safetensors)")
            elif name == LLAMA:
                per_slot = -(-(max(shape.prefill_tokens, TTFT_PROMPT_TOKENS + 64 + shape.new_tokens) + 256)
                             // 256) * 256
                slots = shape.concurrency
                if contexts:                          # one slot that holds the longest prompt and its answer
                    per_slot, slots = -(-(cfg.model.context_length) // 256) * 256, 1
                port = free_port()
                argv = [args.llama_server, "-m", args.gguf, "--host", "127.0.0.1", "--port", str(port),
                        "-np", str(slots), "-t", str(threads), "-c", str(per_slot * slots)]
                srv = ServerProcess(LLAMA, argv, f"http://127.0.0.1:{port}", work / "llama-server.log")
                systems[name] = HTTPSystem(name, srv, "/completion", _llama_body, _llama_progress)
                srv.wait_ready()
                build = _get_json(srv.url + "/props").get("build_info", "?")
                ftype = gguf_file_type(args.gguf)
                systems[name].info = (f"{Path(args.gguf).name} (file type {ftype}), build {build}, "
                                      f"{' '.join(argv[5:])}")
                if weights or gguf_type:
                    systems[name].label = f"{LLAMA} {ftype}"
                want = gguf_type or (None if weights else {"float32": "F32", "bfloat16": "BF16"}[args.dtype])
                if want and ftype != want:
                    print(f"warning: {f'--gguf {gguf_type}' if gguf_type else f'--dtype {args.dtype}'} but the "
                          f"GGUF's file type is {ftype}", file=sys.stderr)
            else:
                kind = "tinyserve" if name == INPROC else "transformers"
                spec = {"config": str(cfg_path), "folder": folder, "dtype": args.dtype, "device": device}
                w = Worker(name, _worker_argv(kind, spec), work / f"{kind}-worker.log", env)
                systems[name] = WorkerSystem(name, w, "")
                systems[name].info = w.call("info")["info"]
            systems[name].ready_s = time.perf_counter() - t0
            print(f"{name}: ready in {systems[name].ready_s:.1f} s", file=sys.stderr)

        if contexts:
            context_figures = await measure_contexts(args, shape, contexts, systems)
            return 0
        res = Results()
        kinds = [ONE, BATCH, PREFILL, TTFT]

        async def measure(name: str, kind: str, tag: str, max_tokens: int | None = None) -> Sample:
            prompts, n = shape.prompts(kind, tag)
            n = max_tokens or n
            time.sleep(SETTLE_S)
            sample = await systems[name].measure(prompts, n, ttft=kind in (PREFILL, TTFT))
            check_lengths(name, kind, prompts, n, sample)
            return sample

        # warm-up: every path once (few tokens), with prompts no round uses
        for name in systems:
            for kind in kinds:
                await measure(name, kind, "warm-up", 4 if kind in (ONE, BATCH) else None)
        order = list(systems)
        for rnd in range(args.rounds):
            for k, kind in enumerate(kinds):
                shift = (rnd + k) % len(order)
                for name in order[shift:] + order[:shift]:
                    res.add(name, kind, await measure(name, kind, str(rnd)))
                    res.prompts[(kind, str(rnd))] = shape.prompts(kind, str(rnd))
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)

        diff = None
        diff_dtype = ("bfloat16" if "bf16" in weights else None) if weights else args.dtype
        if diff_dtype not in (None, "float32"):
            if HF in systems:
                w = systems[HF].worker
            else:
                w = Worker("transformers", _worker_argv("transformers", {
                    "folder": folder, "dtype": diff_dtype, "device": device}), work / "logits-worker.log", env)
            try:
                diff = w.call("logits_diff", prompt=token_prompts(1, 64, 64, shape.vocab, "logits")[0])
                diff["dtype"] = diff_dtype
            finally:
                if HF not in systems:
                    w.stop()
    except BaseException:
        print(f"the run failed; config and logs of every process are in {work}", file=sys.stderr)
        raise
    finally:
        for s in systems.values():
            await s.close()
        if context_figures is not None:  # printed once the servers are stopped: their CPU time then counts as ours
            report_contexts(args, shape, contexts, systems, threads, load_before, meter.others_cores(),
                            *context_figures)
    others = meter.others_cores()
    report(args, shape, folder, threads, systems, res, load_before, load_average(), others, diff)
    if args.keep:
        print(f"logs and config: {work}")
    elif not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


async def measure_contexts(args, shape: Shape, contexts: list[int], systems: dict) -> tuple[dict, dict]:
    """--context: each length's prompt prefilled once per system, then its decode rate each round (a cache hit).
    Returns (decode tok/s per round, prefill tok/s), keyed by (system, context)."""
    prefill: dict[tuple[str, int], float] = {}
    decode: dict[tuple[str, int], list[float]] = {}
    for context in contexts:
        prompt = token_prompts(1, context, context, shape.vocab, f"context/{context}")
        for name, system in systems.items():
            time.sleep(SETTLE_S)
            first = await system.measure(prompt, 1, ttft=True)
            prefill[(name, context)] = context / first.seconds
        for rnd in range(args.rounds):
            for name in (list(systems)[rnd % len(systems):] + list(systems)[:rnd % len(systems)]):
                time.sleep(SETTLE_S)
                stream = await systems[name].stream(prompt[0], shape.new_tokens)
                check_lengths(name, f"context {context}", prompt, shape.new_tokens,
                              Sample(stream.end - stream.start, [stream.token_ids], [stream.count]))
                decode.setdefault((name, context), []).append((stream.count - 1) / (stream.end - stream.first))
        print(f"context {context} done", file=sys.stderr)
    return decode, prefill


def report_contexts(args, shape: Shape, contexts: list[int], systems: dict, threads: int, load_before: str,
                    others: float, decode: dict, prefill: dict) -> None:
    names, label = list(systems), {n: s.label for n, s in systems.items()}
    pick = statistics.median if args.stat == "median" else max
    rows = []
    for context in contexts:
        rows.append((f"{context} tokens", *(f"{pick(decode[(n, context)]):.1f}" for n in names),
                     *(f"{prefill[(n, context)]:.0f}" for n in names)))
    print(f"\nbench/serve.py --context: decode of {shape.new_tokens} tokens after a cached prompt, "
          f"{'best' if args.stat == 'best' else 'median'} of {args.rounds} rounds, {threads} threads per system")
    for name in names:
        print(f"  {label[name]}: {systems[name].info}; start to ready {systems[name].ready_s:.1f} s")
    print(f"  load average before {load_before}, after {load_average()}; other processes used "
          f"{others:.2f} cores on average during the run\n")
    print(fmt_table(rows, ("context", *(f"{label[n]} decode tok/s" for n in names),
                           *(f"{label[n]} prefill tok/s" for n in names))))
    if len(names) > 1:
        base = names[0]
        print()
        for other in names[1:]:
            for context in contexts:
                a, b = pick(decode[(base, context)]), pick(decode[(other, context)])
                print(f"  {context} tokens: {label[base]} / {label[other]} decode {a / b:.2f}x")
        for name in names:
            first, last = pick(decode[(name, contexts[0])]), pick(decode[(name, contexts[-1])])
            print(f"  {label[name]}: {contexts[0]} -> {contexts[-1]} tokens slows decode {first / last:.2f}x")


def report(args, shape: Shape, folder: str, threads: int, systems: dict, res: Results, load_before: str,
           load_after: str, others: float, diff: dict | None) -> None:
    names = list(systems)
    weights = args.weights.split(",") if args.weights else []
    rounds: dict[tuple[str, str], list[float]] = {}       # each round's value, in round order
    for (name, kind), samples in res.samples.items():
        prompts = [res.prompts[(kind, str(i))][0] for i in range(len(samples))]
        rounds[(name, kind)] = [value(kind, s, p) for s, p in zip(samples, prompts)]
        if weights and kind in DECODE and all(s.decode for s in samples):
            rounds[(name, DECODE[kind])] = [s.decode for s in samples]
    pick = statistics.median if args.stat == "median" else max
    figures = {key: min(vals) if key[1] == TTFT and args.stat == "best" else pick(vals)
               for key, vals in rounds.items()}

    def number(kind: str, v: float) -> str:
        return f"{v * 1e3:.1f}" if kind == TTFT else f"{v:.1f}" if v < 100 else f"{v:.0f}"

    c, n = shape.concurrency, shape.new_tokens
    labels = {ONE: f"1 request x {n} tokens (tok/s)", BATCH: f"{c} concurrent x {n} tokens (tok/s)",
              DECODE[ONE]: "  decode only (tok/s)", DECODE[BATCH]: "  decode only (tok/s)",
              PREFILL: f"prefill, {shape.prefill_tokens}-token prompt (tok/s)",
              TTFT: f"TTFT, one {TTFT_PROMPT_TOKENS}-token prompt (ms)"}
    rows = []
    for kind in (ONE, DECODE[ONE], BATCH, DECODE[BATCH], PREFILL, TTFT) if weights else (ONE, BATCH, PREFILL, TTFT):
        cells = []
        for name in names:
            v, vals = figures.get((name, kind)), rounds.get((name, kind), [])
            spread = f" ({number(kind, min(vals))}-{number(kind, max(vals))})" if len(vals) > 1 else ""
            cells.append("" if v is None else number(kind, v) + spread)
        rows.append((labels[kind], *cells))

    def ratio(a: str, b: str, kind: str) -> str:
        """a's figure over b's, and the spread of the rounds' own ratios."""
        x, y = figures.get((a, kind)), figures.get((b, kind))
        if not (x and y):
            return "n/a"
        each = [p / q for p, q in zip(rounds[(a, kind)], rounds[(b, kind)])]
        return f"{x / y:.2f}x" + (f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else "")

    stat = "best" if args.stat == "best" else "median"
    what = f"{', '.join(weights)} weights (a tinyserve server each)" if weights else f"{args.dtype} weights"
    print(f"\nbench/serve.py: {Path(folder).name} ({folder}), {what}, {threads} threads per system, "
          f"{stat} of {args.rounds} rounds" + (" (min-max of the rounds in brackets)" if args.rounds > 1 else ""))
    for name in names:
        print(f"  {systems[name].label}: {systems[name].info}; start to ready {systems[name].ready_s:.1f} s")
    print(f"  load average before {load_before}, after {load_after}; other processes used {others:.2f} cores "
          f"on average during the run ({os.cpu_count()} CPUs)")
    print("  times: wall clock in this script (HTTP: request sent -> streamed token; in-process and "
          "transformers: around the call)" + ("; decode only: the tokens that arrived while every request was "
                                              "decoding (last first token -> first last token) over that time"
                                              if weights else "") + "\n")
    print(fmt_table(rows, ("measure", *(systems[name].label for name in names))))
    spread = " (per-round ratios' min-max in brackets)" if args.rounds > 1 else ""
    if weights:
        pairs = [(f"tinyserve {w}", LLAMA) for w in weights if LLAMA in systems] + \
            [(f"tinyserve {a}", f"tinyserve {b}") for a, b in (("w4", "f32"), ("w4bf16", "f32"), ("w4q8", "f32"),
                                                                ("w4q8", "w4"), ("w4", "bf16"), ("w4bf16", "bf16"),
                                                                ("bf16", "f32"))
             if a in weights and b in weights]
        kinds = (ONE, DECODE[ONE], BATCH, DECODE[BATCH], PREFILL, TTFT)
        print(f"\nratios{spread}\n")
        print(fmt_table([(f"{systems[a].label} / {systems[b].label}", *(ratio(a, b, k) for k in kinds))
                         for a, b in pairs],
                        ("ratio", "1 request", "  decode only", f"{c} concurrent", "  decode only", "prefill",
                         "TTFT")))
    else:
        print(f"\nratios{spread} (tinyserve = the HTTP server, what a user gets)")
    ratio_rows = []
    if HTTP in systems and EAGER in systems:
        ratio_rows.append(("tinyserve HTTP / eager", f"1 request {ratio(HTTP, EAGER, ONE)}",
                           f"{c} requests {ratio(HTTP, EAGER, BATCH)}", f"prefill {ratio(HTTP, EAGER, PREFILL)}"))
    if HTTP in systems and INPROC in systems:
        ratio_rows.append(("tinyserve HTTP / in-process", f"1 request {ratio(HTTP, INPROC, ONE)}",
                           f"{c} requests {ratio(HTTP, INPROC, BATCH)}"))
    for peer in (LLAMA, HF):
        for ours, label in ((HTTP, "tinyserve"), (EAGER, "tinyserve eager")):
            if ours in systems and peer in systems:
                ratio_rows.append((f"{label} / {peer}", f"1 request {ratio(ours, peer, ONE)}",
                                   f"{c} requests {ratio(ours, peer, BATCH)}",
                                   f"prefill {ratio(ours, peer, PREFILL)}",
                                   f"TTFT {ratio(ours, peer, TTFT)}"))
    width = [max(len(r[i]) if i < len(r) else 0 for r in ratio_rows) for i in range(5)] if ratio_rows else []
    for r in ratio_rows:
        print("  " + "   ".join(cell.ljust(w) for cell, w in zip(r, width)).rstrip())
    if args.model == "memory-bound" and not args.config:
        checks = []
        for (peer, target), w4 in itertools.product(W4_TARGETS.items(), [w for w in weights if w.startswith("w4")]):
            other = peer if peer == LLAMA else f"tinyserve {peer}"
            for kind, what in ((ONE, "1 request"), (BATCH, f"{c} concurrent")):
                x, y = figures.get((f"tinyserve {w4}", DECODE[kind])), figures.get((other, DECODE[kind]))
                if x and y:
                    checks.append(f"tinyserve {w4} / {systems[other].label}, {what}, decode: {x / y:.2f}x "
                                  f"{'>=' if x / y >= target else '< (MISSED)'} {target}x")
        if checks:
            print("\ntargets (the issue's, on the memory-bound model; from the decode figures above):\n  "
                  + "\n  ".join(checks))

    ref = next((r for r in (HTTP, "tinyserve f32") if r in systems), names[0])
    same = []
    for name in names:
        if name == ref:
            continue
        a, b = res.samples.get((ref, BATCH), []), res.samples.get((name, BATCH), [])
        pairs = [(x, y) for sa, sb in zip(a, b) for x, y, n in zip(sa.outputs, sb.outputs, sb.lengths())
                 if len(y) == n]             # llama-server's streamed ids can miss some (see stream_sse)
        same.append(f"{systems[name].label} {sum(x == y for x, y in pairs)}/{len(pairs)}")
    if same:
        note = (" (bf16 and a random model: near-ties may flip)" if args.dtype != "float32" and not weights else
                " (other weights than f32 and a random model: near-ties flip, then the rest of an output differs)"
                if weights else "")
        print(f"\ngreedy outputs equal to {systems[ref].label}'s ({c} concurrent, every round): {', '.join(same)}"
              + note)
    if diff is not None:
        print(f"{diff['dtype']} logits vs fp32 logits (transformers, one 64-token prompt, every position): max abs "
              f"difference {diff['max_abs_diff']:.4f} (largest |logit| {diff['max_abs']:.2f}); argmax agrees at "
              f"{diff['argmax_agree']:.0%} of the positions")
    if others > 0.25 or float(load_before.split()[0]) > (os.cpu_count() or 1):
        print(f"\nWARNING: the machine was not quiet (other processes used {others:.2f} of {os.cpu_count()} cores; "
              f"load average before the run {load_before}). Every system here uses all {threads} threads, so any "
              "other load slows them unevenly; rerun on a quiet machine before trusting these figures.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="tinyserve TOML config (default: the bench checkpoint on CPU, default "
                                     "engine settings); its model.dtype, server address and log level are "
                                     "overridden")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="weights dtype of tinyserve and transformers (default float32; pass a GGUF of the same "
                         "dtype)")
    ap.add_argument("--model", choices=list(BENCH_MODELS),
                    help="the bench checkpoint: bench (~31M, the default) or memory-bound (~190M)")
    ap.add_argument("--weights", metavar="W1,W2,...",
                    help="comma-separated f32, bf16, w4: one tinyserve HTTP server per entry instead of the systems "
                         "above (w4: the checkpoint's 4-bit twin, compressed-tensors W4A16 g128, made once)")
    ap.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary")
    ap.add_argument("--gguf", metavar="PATH|TYPE",
                    help="the checkpoint converted to GGUF (f32 or bf16, as --dtype), or a llama.cpp type (Q4_0, "
                         "Q8_0, f32, ...): made from the checkpoint by llama.cpp's converter / llama-quantize, cached")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each figure is the best or median (default 3)")
    ap.add_argument("--stat", choices=["best", "median"], default="best", help="figure over the rounds")
    ap.add_argument("--threads", type=int, default=0,
                    help="threads of every system: llama-server -t, OMP_NUM_THREADS of the torch processes "
                         "(default: the CPUs this process may run on)")
    ap.add_argument("--systems", nargs="+", choices=list(SYSTEM_KEYS),
                    help="systems to run (default: http eager inprocess transformers, and llama with "
                         "--llama-server)")
    ap.add_argument("--dir", type=Path, help="cache folder of the bench checkpoint (default: "
                                             "$TINYSERVE_BENCH_DIR or ~/.cache/tinyserve/bench)")
    ap.add_argument("--workdir", type=Path, help="folder for the config and the logs (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (config, logs)")
    ap.add_argument("--context", help="comma-separated context lengths: measure decode after a cached prompt of "
                                      "each length instead (see above); http and llama systems only")
    ap.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16"],
                    help="tinyserve's model.kv_cache_dtype (llama-server's default KV cache is float16)")
    ap.add_argument("--new-tokens", type=int, default=None, help=argparse.SUPPRESS)    # quick checks only
    ap.add_argument("--concurrency", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--prefill-tokens", type=int, default=2000, help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker, json.loads(args.spec or "{}"))
        return 0
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.weights:
        bad = [w for w in args.weights.split(",") if w not in WEIGHTS]
        if bad or len(set(args.weights.split(","))) != len(args.weights.split(",")):
            ap.error(f"--weights: a comma-separated list of distinct {', '.join(WEIGHTS)}, got {args.weights!r}")
        if args.systems or args.dtype:
            ap.error("--weights picks the systems (a tinyserve server per entry, llama-server with --llama-server) "
                     "and their dtypes: leave out --systems and --dtype")
    if args.config and args.model:
        ap.error("--model picks a bench checkpoint; --config serves its own model.path")
    args.dtype, args.model = args.dtype or "float32", args.model or "bench"
    if args.new_tokens is None:
        args.new_tokens = CONTEXT_NEW_TOKENS if args.context else 48
    if args.context and set(args.systems or []) - {"http", "eager", "llama"}:
        ap.error("--context measures the servers: --systems http, eager, llama")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
