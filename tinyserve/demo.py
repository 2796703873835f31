"""The built-in demo checkpoint: a tiny random Qwen3.5-style hybrid model with a real byte-level BPE tokenizer.

`model.path = "demo"` serves it, so the whole stack (template, tokenizer, engine, cache, API, parsers) runs on any
machine without downloading anything. The weights are random, so the text is gibberish; everything around it is
the real thing. The folder is written once, deterministically (same bytes on every machine), into a temp folder
that is renamed into place, so a crash never leaves half a checkpoint behind.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tinyserve.tokenizer import bytes_to_unicode

DEMO_VERSION = "demo-v3"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
PARSER_TAGS = {"<think>", "</think>", "<tool_call>", "</tool_call>"}
EOS_TOKEN = "<|im_end|>"
NUM_MERGES = 400
# Qwen3.5's own context: coding agents open sessions of 16-48K tokens and grow them from there
DEMO_CONTEXT = 262144
SEED = 20240607
# The folder is complete when all of these exist (it is renamed into place only after all are written).
_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
          "model.safetensors"]

# A small built-in corpus for the BPE merges: chat markup, English prose, a little code and JSON.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest.
Hello! How can I help you today? I am a helpful assistant. Let me think about the question step by step.
The user asked about the weather in Paris. The weather in Paris is sunny and the temperature is twenty degrees.
You have access to the following functions. If you choose to call a function, reply in the following format.
<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
<parameter=unit>
celsius
</parameter>
</function>
</tool_call>
<tool_response>
{"temperature": 20, "condition": "sunny", "humidity": 0.4}
</tool_response>
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

import json
data = {"name": "tinyserve", "version": 1, "features": ["cache", "tools", "reasoning"]}
print(json.dumps(data, indent=2))

A language model predicts the next token from the tokens before it. The server keeps a cache of prefixes so that
a long conversation does not have to be computed again and again. The recurrent state of the linear attention
layers is saved together with the pages of the attention layers, in the memory of the device, of the host, and in
files on the disk. This is the demo model: its weights are random, so what it says is nonsense, but the tokenizer,
the chat template, the engine, the cache, the parsers and the server around it are all real.
Question: what is two plus two? Answer: two plus two is four. Question: what is the capital of France? Answer:
the capital of France is Paris. Thank you for your question, and have a nice day!
system user assistant tool function parameter content reasoning thinking answer
"""


def _train_merges(words: Counter[str], num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties: smallest pair), so it is deterministic.

    Once the frequent pairs are used up, pairs seen once merge too (whole corpus words become tokens).
    """
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, seq in seqs.items():
            i, out = 0, []
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
    return merges


def build_demo_tokenizer() -> Tokenizer:
    """Byte-level BPE: ids 0..255 are the bytes in order, then the merges, then the special tokens."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words: Counter[str] = Counter(w for w, _ in pre.pre_tokenize_str(_CORPUS))
    merges = _train_merges(words, NUM_MERGES)
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    # As in Qwen's own tokenizers, the think / tool-call tags are added tokens but not "special": detokenizing with
    # skip_special_tokens keeps them, so the reasoning and tool-call parsers see them.
    tok.add_tokens([AddedToken(t, special=t not in PARSER_TAGS, normalized=False) for t in SPECIAL_TOKENS])
    return tok


# A ChatML template in the Qwen3 style, with tools in the qwen3_coder XML calling format; as Qwen3.5's own, it takes a
# system message only first.
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
{%- if content is none -%}{{- '' -}}{%- elif content is string -%}{{- content -}}
{%- else -%}{%- for part in content -%}{%- if part is mapping and part.text is defined -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if not messages -%}{{- raise_exception('No messages provided.') -}}{%- endif -%}
{%- set ns = namespace(system='', start=0, last_query_index=messages|length - 1, multi_step_tool=true) -%}
{%- if messages[0].role == 'system' -%}
    {%- set ns.system = render_content(messages[0].content) -%}
    {%- set ns.start = 1 -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if ns.system -%}{{- ns.system + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' -}}{{- (tool.function if tool.function is defined else tool) | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like a normal assistant, with no tool call\n</IMPORTANT><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}
{%- endif -%}
{#- Reasoning of assistant turns before the last real user query is dropped, as Qwen3 does. -#}
{%- for message in messages[::-1] -%}
    {%- set index = (messages|length - 1) - loop.index0 -%}
    {%- if ns.multi_step_tool and message.role == 'user' -%}
        {%- set ns.multi_step_tool = false -%}
        {%- set ns.last_query_index = index -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages[ns.start:] -%}
    {%- set index = loop.index0 + ns.start -%}
    {%- set content = render_content(message.content) -%}
    {%- if message.role == 'system' -%}
        {{- raise_exception('System message must be at the beginning.') -}}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {%- set content = content.lstrip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if index > ns.last_query_index and reasoning -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls -%}
            {%- for tool_call in message.tool_calls -%}
                {%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
                {%- if loop.first and content -%}{{- '\n\n' -}}{%- elif not loop.first -%}{{- '\n' -}}{%- endif -%}
                {{- '<tool_call>\n<function=' + call.name + '>\n' -}}
                {%- if call.arguments is mapping -%}
                    {%- for name, value in call.arguments | items -%}
                        {{- '<parameter=' + name + '>\n' -}}
                        {{- value if value is string else value | tojson -}}
                        {{- '\n</parameter>\n' -}}
                    {%- endfor -%}
                {%- endif -%}
                {{- '</function>\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[index - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[index + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- else -%}
        {{- raise_exception('Unexpected message role: ' + (message.role | string)) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def demo_config(vocab_size: int, eos_ids: list[int], bos_id: int) -> dict:
    """config.json of the demo: a Qwen3.5 text model (dense MLP, split GDN projections), with one MTP layer."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        "rope_theta": 10000000.0,
        "max_position_embeddings": DEMO_CONTEXT,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "attn_output_gate": True,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": bos_id,
        "dtype": "float32",
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _checkpoint_name(canonical: str) -> str:
    """Canonical (engine) tensor name -> the name a Qwen3.5 text checkpoint stores it under."""
    if canonical.startswith(("lm_head.", "mtp.")):
        return canonical
    return "model." + canonical


def _init_tensor(name: str, shape: tuple[int, ...], gen):  # -> torch.Tensor
    """Deterministic random init that keeps activations in a sane range (output is gibberish by design)."""
    import torch

    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if name.endswith("A_log"):
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if name.endswith("dt_bias"):
        return torch.empty(shape).uniform_(-0.1, 0.1, generator=gen)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + 0.02 * torch.randn(shape, generator=gen)       # gated norm: plain weight, keep it near 1
    if name.endswith("norm.weight") or "norm" in module:
        return 0.05 * torch.randn(shape, generator=gen)              # zero-centred (1 + w) norms: small w
    if name.endswith("conv1d.weight"):
        return 0.2 * torch.randn(shape, generator=gen)
    return 0.02 * torch.randn(shape, generator=gen)                  # matrices, embeddings, anything else


def _write_weights(folder: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from tinyserve.model_config import read_model_config
    from tinyserve.models.qwen3_next import Qwen3NextForCausalLM

    # The loader counts MTP layers from the tensors it finds; none exist yet, so say what config.json declares.
    declared = json.loads((folder / "config.json").read_text(encoding="utf-8"))["mtp_num_hidden_layers"]
    cfg = dataclasses.replace(read_model_config(folder), num_mtp_layers=declared)
    expected = Qwen3NextForCausalLM(cfg, torch.float32, "cpu").expected_tensors()
    gen = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name in sorted(expected):  # sorted: the random stream does not depend on dict order
        tensors[_checkpoint_name(name)] = _init_tensor(name, tuple(expected[name]), gen).to(torch.float32).contiguous()
    # One metadata key only: safetensors writes metadata from a hash map, so several keys come out in random order.
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")


def write_demo_tokenizer_files(folder: Path) -> None:
    """Everything but the weights: tokenizer, template, config.json and generation_config.json."""
    tok = build_demo_tokenizer()
    tok.save(str(folder / "tokenizer.json"), pretty=False)
    eos_id = tok.token_to_id(EOS_TOKEN)
    bos_id = tok.token_to_id("<|endoftext|>")
    eos_ids = [eos_id, bos_id]   # <|im_end|> ends a chat turn, <|endoftext|> a plain completion
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": DEMO_CONTEXT,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    _write_json(folder / "generation_config.json", {
        "bos_token_id": bos_id, "eos_token_id": eos_ids, "pad_token_id": bos_id,
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
    })
    _write_json(folder / "config.json", demo_config(tok.get_vocab_size(with_added_tokens=True), eos_ids, bos_id))


def write_demo_checkpoint(folder: Path) -> None:
    """Write every file of the demo checkpoint into `folder` (which must exist)."""
    write_demo_tokenizer_files(folder)
    _write_weights(folder)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tinyserve"


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _FILES)


def ensure_demo_checkpoint(cache_dir: Path | None = None) -> Path:
    """Path of the demo checkpoint under `cache_dir` (default $XDG_CACHE_HOME/tinyserve), writing it if missing."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / DEMO_VERSION
    if _complete(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}-", dir=cache_dir))
    try:
        os.chmod(tmp, 0o755)   # mkdtemp makes it private; the finished checkpoint is an ordinary folder
        write_demo_checkpoint(tmp)
        if _complete(target):  # another process finished first: keep theirs (it may be in use)
            return target
        if target.exists():    # a half-written folder (not from this code, which never leaves one): move it away
            trash = tmp.with_name(tmp.name + ".old")
            try:
                os.rename(target, trash)
            except OSError:
                pass
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _complete(target):  # lost a race to a writer that finished meanwhile: fine; else a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
