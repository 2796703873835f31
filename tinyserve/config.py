"""tinyserve's configuration: one TOML file, one dataclass per TOML table.

The TOML keys are the public interface (docs/config.md is the reference, config.example.toml the commented
example). Attribute names equal the keys: ``cfg.engine.page_size`` is ``[engine] page_size``.

Every section checks itself when it is built (``__post_init__``) and ``Config`` adds the checks that span
tables, so ``Config()``, ``Config(engine=EngineSection(page_size=1))``, ``from_dict`` and ``load`` all give a
valid configuration or raise ``ConfigError`` with a message that names the full key (``engine.page_size``).
Unknown keys and tables fail loudly with the closest known key, because a misspelt key that is silently
ignored is the bug users of other engines hit most often with copied flags.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, get_type_hints

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 ships no tomllib
    import tomli as tomllib  # type: ignore[no-redef]

import tomli_w


class ConfigError(ValueError):
    """A configuration problem; ``key`` is the full dotted key (or table) it is about, when there is one."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# ---------------------------------------------------------------------------------------------------------
# Field helpers. Checks live in field metadata so one generic validator covers every key.
#   choices: allowed values; ge / gt / le / lt: numeric bounds; nonempty: a string that must not be "".

def _opt(default: Any, **checks: Any) -> Any:
    return field(default=default, metadata=checks)


DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8_e4m3")
DEVICES = ("auto", "cuda", "cpu")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
REASONING_PARSERS = ("", "qwen3")
TOOL_CALL_PARSERS = ("", "qwen3_coder")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
KERNELS = ("auto", "torch", "triton")


class _Section:
    """Base of every table: checks types and per-key bounds on construction."""

    TABLE: ClassVar[str] = ""

    def __post_init__(self) -> None:
        _check_section(self)


@dataclass
class ModelSection(_Section):
    TABLE: ClassVar[str] = "model"
    path: str = _opt("demo", nonempty=True)   # checkpoint folder or "demo"; existence is the loader's job
    served_name: str = _opt("tinyserve", nonempty=True)
    dtype: str = _opt("auto", choices=DTYPES)
    kv_cache_dtype: str = _opt("auto", choices=KV_CACHE_DTYPES)
    device: str = _opt("auto", choices=DEVICES)
    context_length: int = _opt(0, ge=0)       # 0: from the checkpoint
    # CPU, int4 weights (GPTQ, AWQ, compressed-tensors W4A16): each row of activations rounded to int8 per weight
    # group before the product, summed in integers (kernels/w4_weight.int8_rounded; llama.cpp's Q4_0 x Q8_0 alike)
    int8_activations: bool = False
    # Image input (Qwen3.5-family checkpoints with model.visual.*): false skips the vision tower (~0.9 GB on a
    # 27B) and answers 400 to image parts. Per request: at most max_images images, each at most
    # max_image_pixels (width x height as sent; the processor then resizes within the checkpoint's limits).
    vision: bool = True
    max_images: int = _opt(8, ge=0)
    max_image_pixels: int = _opt(16_777_216, ge=1)


@dataclass
class ServerSection(_Section):
    TABLE: ClassVar[str] = "server"
    host: str = _opt("127.0.0.1", nonempty=True)
    port: int = _opt(8000, ge=1, le=65535)
    api_key: str = ""                           # "": no auth
    max_queued_requests: int = _opt(64, ge=0)   # waiting beyond max_running_requests; more gets 503
    max_request_body_mb: float = _opt(32.0, gt=0)
    drain_timeout_s: float = _opt(30.0, ge=0)   # SIGTERM: time running requests get to finish
    fetch_image_urls: bool = False              # fetch http(s) image URLs; off: the server never fetches addresses


@dataclass
class EngineSection(_Section):
    TABLE: ClassVar[str] = "engine"
    max_running_requests: int = _opt(8, ge=1)
    chunked_prefill_size: int = _opt(2048, ge=1)
    page_size: int = _opt(16, ge=1)
    mem_fraction_static: float = _opt(0.90, gt=0, lt=1)
    kv_cache_tokens: int = _opt(0, ge=0)        # 0: derive from memory
    idle_release_s: float = _opt(0.0, ge=0)     # 0: off
    kernels: str = _opt("auto", choices=KERNELS)  # auto: Triton on CUDA, the torch reference on CPU
    compile_steps: bool = True                  # decode / verify steps: CUDA graphs captured, or compiled on the CPU


@dataclass
class HostCacheSection(_Section):
    TABLE: ClassVar[str] = "cache.host"
    size_gb: float = _opt(0.0, ge=0)            # 0: off
    write_policy: str = _opt("write_through", choices=WRITE_POLICIES)
    # The host tier gives memory back (evicts, frees segments) while the machine has less than this available,
    # and does not grow past it. 0: no floor.
    min_free_gb: float = _opt(4.0, ge=0)


@dataclass
class FileCacheSection(_Section):
    TABLE: ClassVar[str] = "cache.file"
    dir: str = ""                               # "": off
    size_gb: float = _opt(50.0, ge=0)
    prefetch_policy: str = _opt("best_effort", choices=PREFETCH_POLICIES)


@dataclass
class CacheSection(_Section):
    TABLE: ClassVar[str] = "cache"
    enabled: bool = True
    # A state snapshot every N tokens (multiple of engine.page_size, checked by Config). 2048: a snapshot of a
    # 27B costs the KV of ~4,700 tokens; resume points (prompt ends, branches) are taken anyway
    # (docs/cache-sizing.md).
    state_track_interval: int = _opt(2048, ge=1)
    state_slots: int = _opt(0, ge=0)              # 0: derive from memory
    host: HostCacheSection = field(default_factory=HostCacheSection)
    file: FileCacheSection = field(default_factory=FileCacheSection)


@dataclass
class SpeculativeSection(_Section):
    TABLE: ClassVar[str] = "speculative"
    num_steps: int = _opt(0, ge=0)              # > 0: NEXTN with up to this many drafts per step; 0: off
    max_running: int = _opt(4, ge=0)


@dataclass
class ParsersSection(_Section):
    TABLE: ClassVar[str] = "parsers"
    reasoning: str = _opt("", choices=REASONING_PARSERS)
    tool_call: str = _opt("", choices=TOOL_CALL_PARSERS)


@dataclass
class LogSection(_Section):
    TABLE: ClassVar[str] = "log"
    level: str = _opt("info", choices=LOG_LEVELS)


@dataclass
class Config(_Section):
    TABLE: ClassVar[str] = ""
    model: ModelSection = field(default_factory=ModelSection)
    server: ServerSection = field(default_factory=ServerSection)
    engine: EngineSection = field(default_factory=EngineSection)
    cache: CacheSection = field(default_factory=CacheSection)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    parsers: ParsersSection = field(default_factory=ParsersSection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every key again (sections are mutable) and the rules that span tables."""
        _check_section(self, "")
        self._check_cross()

    def _check_cross(self) -> None:
        page = self.engine.page_size
        interval = self.cache.state_track_interval
        # Snapshots sit on page boundaries: the radix tree only holds whole pages, so a snapshot in the middle
        # of a page could never be matched.
        if interval < page or interval % page != 0:
            raise ConfigError(
                f"cache.state_track_interval must be a multiple of engine.page_size ({page}) and at least "
                f"that large, found {interval}",
                "cache.state_track_interval",
            )
        if self.cache.file.dir and self.cache.file.size_gb == 0:
            raise ConfigError(
                f'cache.file.size_gb must be > 0 when cache.file.dir is set (dir = {_show(self.cache.file.dir)}); '
                'set cache.file.dir = "" to turn the file tier off',
                "cache.file.size_gb",
            )


# ---------------------------------------------------------------------------------------------------------
# Validation

def _show(value: Any) -> str:
    """A value as it would look in TOML, for messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, (list, tuple)):
        return f"an array {json.dumps(value, default=str)}"
    return repr(value)


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean (true or false)", str: "a string"}


def _kind(value: Any) -> str:
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string")):
        if isinstance(value, t):  # bool first: it is a subclass of int
            return name
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, (list, tuple)):
        return "an array"
    return type(value).__name__


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _is_section_type(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, _Section)


def _check_section(obj: _Section, table: str | None = None) -> None:
    table = obj.TABLE if table is None else table
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{table}.{f.name}" if table else f.name
        expected = hints[f.name]
        value = getattr(obj, f.name)
        if _is_section_type(expected):
            if not isinstance(value, expected):
                raise ConfigError(f"[{key}] must be a table ({expected.__name__}), found {_show(value)}", key)
            _check_section(value, key)
            continue
        value = _check_type(key, expected, value)
        object.__setattr__(obj, f.name, value)  # ints become floats for float keys
        _check_value(key, value, f.metadata)


def _check_type(key: str, expected: type, value: Any) -> Any:
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)  # true is not 1 here
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
            if not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number, found {value!r}", key)
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise ConfigError(
            f"{key} must be {_TYPE_NAMES.get(expected, expected.__name__)}, found {_show(value)} ({_kind(value)})",
            key,
        )
    return value


def _check_value(key: str, value: Any, rules: Mapping[str, Any]) -> None:
    if "choices" in rules and value not in rules["choices"]:
        allowed = " | ".join(_show(c) for c in rules["choices"])
        hint = ""
        close = difflib.get_close_matches(str(value).lower(), [c for c in rules["choices"] if c], n=1)
        if close:
            hint = f"; did you mean {_show(close[0])}?"
        raise ConfigError(f"{key} must be one of {allowed}, found {_show(value)}{hint}", key)
    if rules.get("nonempty") and value == "":
        raise ConfigError(f"{key} must not be empty", key)
    # Each test is written as "not (ok)" so that a NaN can never pass.
    out_of_range = (
        ("ge" in rules and not value >= rules["ge"])
        or ("gt" in rules and not value > rules["gt"])
        or ("le" in rules and not value <= rules["le"])
        or ("lt" in rules and not value < rules["lt"])
    )
    if out_of_range:
        raise ConfigError(f"{key} must be {_describe_bounds(rules)}, found {_show(value)}", key)


def _describe_bounds(rules: Mapping[str, Any]) -> str:
    lo = f">= {rules['ge']}" if "ge" in rules else f"> {rules['gt']}" if "gt" in rules else ""
    hi = f"<= {rules['le']}" if "le" in rules else f"< {rules['lt']}" if "lt" in rules else ""
    return " and ".join(p for p in (lo, hi) if p)


# ---------------------------------------------------------------------------------------------------------
# Key inventory (used by unknown-key suggestions, --check and the docs/example tests)

def _table_keys(cls: type, table: str) -> list[str]:
    """Dotted names of the leaf keys of one table class, nested tables included."""
    out: list[str] = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{table}.{f.name}" if table else f.name
        if _is_section_type(hints[f.name]):
            out.extend(_table_keys(hints[f.name], key))
        else:
            out.append(key)
    return out


def all_keys() -> list[str]:
    """Every key of the configuration as a dotted name, in declaration order (``model.path``, ...)."""
    return _table_keys(Config, "")


def all_tables() -> list[str]:
    """Every table as a dotted name (``model``, ``cache``, ``cache.host``, ...)."""
    keys = all_keys()
    tables: list[str] = []
    for k in keys:
        parts = k.split(".")[:-1]
        for i in range(1, len(parts) + 1):
            t = ".".join(parts[:i])
            if t not in tables:
                tables.append(t)
    return tables


# ---------------------------------------------------------------------------------------------------------
# dict -> Config

# Keys an older config file may still hold, with what replaced them.
REMOVED = {
    "speculative.algorithm": 'NEXTN is on when speculative.num_steps > 0 (algorithm = "nextn" with num_steps = 3 '
                             'is now num_steps = 3; algorithm = "" is num_steps = 0)',
    "speculative.num_draft_tokens": "it is always speculative.num_steps + 1 (the drafts and the token before them)",
    "engine.sleep_on_idle": "an idle server always sleeps until a request wakes it",
    "cache.host.state_share": "the host tier keeps a fixed 25% of cache.host.size_gb for state snapshots "
                              "(chosen by bench/simulate.py on agent traces; docs/cache-sizing.md)",
    "server.keep_billing_header": "Claude Code's per-request x-anthropic-billing-header system block is always "
                                  "dropped (it would defeat the prefix cache)",
    "engine.cuda_graphs": "engine.compile_steps does it (CUDA graphs on a GPU, torch.compile on the CPU)",
    "metrics": "GET /metrics is always served (behind server.api_key), and usage always reports cached tokens",
}

def _unknown(name: str, table: str, cls: type, wrote_table: bool) -> ConfigError:
    key = f"{table}.{name}" if table else name
    where = f"in table [{table}]" if table else "at the top level"
    what = f"table [{key}]" if wrote_table else f"key {key}"
    known = [f.name for f in dataclasses.fields(cls)]
    hints = _hints(cls)
    is_table = {n: _is_section_type(hints[n]) for n in known}
    shown = {n: (f"[{table}.{n}]" if table else f"[{n}]") if is_table[n] else (f"{table}.{n}" if table else n)
             for n in known}
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {shown[close[0]]}?"
    else:
        # The right key in the wrong table ("context_length" under [engine]) or a typo of a key elsewhere.
        leaf_keys = all_keys()
        same = [k for k in leaf_keys if k.rsplit(".", 1)[-1] == name]
        if not same:
            by_leaf = {k.rsplit(".", 1)[-1]: k for k in leaf_keys}
            same = [by_leaf[n] for n in difflib.get_close_matches(name, list(by_leaf), n=1, cutoff=0.75)]
        if same:
            hint = f"did you mean {same[0]} (in [{same[0].rsplit('.', 1)[0]}])?"
        else:
            hint = f"known keys {where}: " + ", ".join(shown[n] for n in known)
    return ConfigError(f"unknown {what} {where}; {hint}", key)


def _build(cls: type, data: Any, table: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"[{table}] must be a table, found {_show(data)} ({_kind(data)})", table)
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{table}.{name}" if table else name
        if key in REMOVED:
            what = f"[{key}]" if isinstance(value, Mapping) else key
            raise ConfigError(f"{what} was removed: {REMOVED[key]}; delete it from the file", key)
        if name not in names:
            raise _unknown(name, table, cls, wrote_table=isinstance(value, Mapping))
        expected = hints[name]
        if _is_section_type(expected):
            kwargs[name] = _build(expected, value, key)
        else:
            if isinstance(value, Mapping):
                raise ConfigError(f"{key} must be {_TYPE_NAMES[expected]}, found a table", key)
            kwargs[name] = value
    # Sections are built (and checked) before Config, so a bad key is reported before a cross-table rule.
    return cls(**kwargs)


def from_dict(data: Mapping[str, Any], source: str = "<config>") -> Config:
    """Build a Config from parsed TOML. ``source`` (a file name) prefixes every error message."""
    try:
        return _build(Config, data, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}", e.key) from None


def load(path: str | Path) -> Config:
    """Read and check one TOML config file.

    Relative ``model.path`` and ``cache.file.dir`` are taken relative to the config file's folder (and ``~`` is
    expanded), so a config means the same thing whatever the working directory (systemd runs us from /).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {p} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {p} is a directory, not a TOML file") from None
    except PermissionError:
        raise ConfigError(f"config file {p} is not readable (permission denied)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # its message carries "(at line L, column C)"
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    cfg = from_dict(data, source=str(p))
    cfg.model.path = _resolve_path(cfg.model.path, p.parent, keep="demo")
    cfg.cache.file.dir = _resolve_path(cfg.cache.file.dir, p.parent, keep="")
    return cfg


def _resolve_path(value: str, base: Path, keep: str) -> str:
    if value == keep:
        return value
    q = Path(value).expanduser()
    if not q.is_absolute():
        q = (base / q).resolve()
    return str(q)


# ---------------------------------------------------------------------------------------------------------
# Config -> dict / TOML (for `tinyserve --check`)

def to_dict(cfg: Config) -> dict[str, Any]:
    """The effective configuration as nested plain dicts (TOML tables)."""
    return dataclasses.asdict(cfg)


def dumps(cfg: Config) -> str:
    """The effective configuration as TOML text; ``load`` of it gives an equal Config."""
    return tomli_w.dumps(to_dict(cfg))
