"""A file-tier blob: its format on disk, its name, and the hash chain and model fingerprint that name it.

A blob holds one cached run of pages (a radix node): a header (magic, version, fingerprint, the chain hashes at the
run's start and end, lengths, CRC32 of the payload), then the run's token ids (int32 LE), its KV pages in the device
pool's page-major layout and, when the node had one, the state snapshot at its end (conv, then SSM). It is named
`<start>-<end>.tsb` by the hash chain at its ends. The chain is seeded by a fingerprint of the model (config, tensor
names, shapes, dtypes, a sample of the weights), the KV dtype, the page size and the format version, so another
model or setting never hits. A state blob (the state at a point inside a stored run) has the same format with no
tokens and no pages, and is named `<at>.tss` by its chain hash.
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import asdict, dataclass

import torch

FORMAT_VERSION = 1
MAGIC = b"TSKVBLOB"
# magic, version, fingerprint, start hash, end hash, n_tokens, n_pages, kv bytes, conv bytes, ssm bytes, crc32
HEADER = struct.Struct("<8sI32s32s32sIIQQQI")
SUFFIX = ".tsb"
STATE_SUFFIX = ".tss"      # a state blob: the state snapshot at one chain hash, no pages (start hash = end hash)
WEIGHT_SAMPLES = 4096      # values read from each tensor for the weight digest


def _parameters_but_vision(module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and buffers (FP8 weights and their scales are buffers) by name, a model's vision
    tower left out: it decides no text page's KV (image tokens are keyed on a digest of it instead)."""
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    return sorted(((n, p) for n, p in tensors if not n.startswith("visual.")), key=lambda t: t[0])


@torch.no_grad()
def weights_digest(model) -> bytes:
    """Digest of a strided sample of every parameter's values (the vision tower's left out). Two checkpoints of the
    same architecture (a fine-tune, another seed) differ almost everywhere, so a sample tells them apart, while
    hashing all weights of a 27B model would cost tens of seconds at every start."""
    h = hashlib.sha256()
    for name, p in _parameters_but_vision(model):
        flat = p.detach().reshape(-1)
        n = flat.numel()
        if n > WEIGHT_SAMPLES:
            idx = torch.linspace(0, n - 1, WEIGHT_SAMPLES, device=flat.device).long()
            flat = flat.index_select(0, idx)
        h.update(name.encode())
        h.update(flat.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.digest()


_NOT_IN_FINGERPRINT = ("folder", "vision_config", "vision_parameters", "image_token_id", "vision_start_token_id",
                       "vision_end_token_id", "fp8_blocks")      # FP8 kept or not: the weights' digest tells


def model_fingerprint(model, kv_dtype: torch.dtype, page_size: int) -> bytes:
    """Identity of everything that decides the bytes of a cached page: a blob from any other set-up never hits.
    Config, tensor names/shapes/dtypes and a sample of the weight values (another checkpoint of the same
    architecture must not hit), KV dtype, page size, the weights that round activations to int8 and the format
    version."""
    # where the checkpoint lies and whether its vision tower is loaded change no text page
    config = {k: v for k, v in asdict(model.cfg).items() if k not in _NOT_IN_FINGERPRINT}
    desc = {
        "format": FORMAT_VERSION,
        "config": config,
        "tensors": [(n, list(p.shape), str(p.dtype)) for n, p in _parameters_but_vision(model)],
        "weights": weights_digest(model).hex(),
        "kv_dtype": str(kv_dtype),
        "state_dtype": str(model.dtype),
        "page_size": page_size,
        # model.int8_activations: the same weights, other activations, other pages
        "int8_activations": sorted(n for n, m in model.named_modules() if getattr(m, "int8_activations", False)),
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).digest()


def chain_hashes(seed: bytes, tokens: list[int], page_size: int) -> list[bytes]:
    """h[0] = seed; h[i+1] = sha256(h[i] + page i's token ids as int32 LE). One per full page boundary."""
    out = [seed]
    for i in range(len(tokens) // page_size):
        page = struct.pack(f"<{page_size}i", *tokens[i * page_size:(i + 1) * page_size])
        out.append(hashlib.sha256(out[-1] + page).digest())
    return out


def blob_name(start: bytes, end: bytes) -> str:
    """A blob's file name: `<start>-<end>.tsb` for a run of pages, `<at>.tss` for a state blob (start = end)."""
    return f"{start.hex()}{STATE_SUFFIX}" if start == end else f"{start.hex()}-{end.hex()}{SUFFIX}"


@dataclass
class Blob:
    """One run of pages read back from the file tier (CPU tensors), or to be written."""
    start_hash: bytes
    end_hash: bytes
    tokens: list[int]
    kv: torch.Tensor                      # [n_pages, *page shape]
    conv: torch.Tensor | None = None      # [*slot shape] state snapshot at the run's end
    ssm: torch.Tensor | None = None
    stored_run: tuple[bytes, bytes] | None = None     # read back: the stored blob (start, end) holding these pages
                                                      # (longer than the run when its prefix was used)
    stored_state: tuple[bytes, bytes] | None = None   # read back: the stored blob holding the state (None: no state)


def encode(blob: Blob, fingerprint: bytes) -> list[memoryview]:
    """A blob's header + payload parts (views, no concatenated copy); the CRC is computed part by part."""
    def raw(t: torch.Tensor | None):
        return memoryview(t.contiguous().view(torch.uint8).numpy()) if t is not None else memoryview(b"")
    tokens = memoryview(struct.pack(f"<{len(blob.tokens)}i", *blob.tokens))
    kv, conv, ssm = raw(blob.kv), raw(blob.conv), raw(blob.ssm)
    crc = 0
    for part in (tokens, kv, conv, ssm):
        crc = zlib.crc32(part, crc)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, fingerprint, blob.start_hash, blob.end_hash,
                         len(blob.tokens), blob.kv.shape[0], kv.nbytes, conv.nbytes, ssm.nbytes, crc)
    return [memoryview(header), tokens, kv, conv, ssm]
