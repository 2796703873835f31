"""tinyserve.config: defaults, the shipped files, every error class, and docs/example coverage."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from tinyserve import config
from tinyserve.config import (
    CacheSection,
    Config,
    ConfigError,
    EngineSection,
    HostCacheSection,
    all_keys,
    all_tables,
    dumps,
    from_dict,
    load,
    to_dict,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config.example.toml"
PRODUCTION = ROOT / "systemd" / "production.toml"
DOCS = ROOT / "docs" / "config.md"


def _nested(key: str, value: object) -> dict:
    """"engine.page_size", 3 -> {"engine": {"page_size": 3}}"""
    out: dict = {}
    node = out
    *tables, leaf = key.split(".")
    for t in tables:
        node = node.setdefault(t, {})
    node[leaf] = value
    return out


def _flat_keys(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in data.items():
        full = f"{prefix}.{k}" if prefix else k
        keys.extend(_flat_keys(v, full) if isinstance(v, dict) else [full])
    return keys


# --- defaults and shipped files --------------------------------------------------------------------------

def test_defaults_match_the_design() -> None:
    cfg = Config()
    assert cfg.model.path == "demo" and cfg.model.served_name == "tinyserve"
    assert (cfg.model.dtype, cfg.model.kv_cache_dtype, cfg.model.device) == ("auto", "auto", "auto")
    assert cfg.model.context_length == 0
    assert (cfg.server.host, cfg.server.port, cfg.server.api_key) == ("127.0.0.1", 8000, "")
    assert cfg.server.max_queued_requests == 64
    assert cfg.server.max_request_body_mb == 32.0 and cfg.server.drain_timeout_s == 30.0
    e = cfg.engine
    assert (e.max_running_requests, e.chunked_prefill_size, e.page_size) == (8, 2048, 16)
    assert e.mem_fraction_static == 0.90 and e.kv_cache_tokens == 0
    c = cfg.cache
    assert c.enabled is True and c.state_track_interval == 2048 and c.state_slots == 0
    assert c.host.size_gb == 0 and c.host.write_policy == "write_through"
    assert c.file.dir == "" and c.file.size_gb == 50 and c.file.prefetch_policy == "best_effort"
    s = cfg.speculative
    assert (s.num_steps, s.max_running) == (0, 4)
    assert (cfg.parsers.reasoning, cfg.parsers.tool_call) == ("", "")
    assert cfg.log.level == "info"


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("")
    assert load(p) == Config()
    assert from_dict({}) == Config()


def test_float_keys_accept_integers_and_store_floats() -> None:
    cfg = from_dict({"cache": {"host": {"size_gb": 24}}, "server": {"drain_timeout_s": 5}})
    assert cfg.cache.host.size_gb == 24.0 and isinstance(cfg.cache.host.size_gb, float)
    assert isinstance(cfg.server.drain_timeout_s, float)


def test_example_loads_with_the_demo_for_agents() -> None:
    """The shipped config takes a coding agent's session as it comes: the checkpoint's context, a derived pool (two
    full-length requests on the CPU: tests/test_plan.py) and the parsers agents need."""
    cfg = load(EXAMPLE)
    assert cfg.model.path == "demo" and cfg.model.device == "auto" and cfg.model.context_length == 0
    assert cfg.engine.kv_cache_tokens == 0 and cfg.engine.max_running_requests == 8
    assert (cfg.parsers.reasoning, cfg.parsers.tool_call) == ("qwen3", "qwen3_coder")


def test_production_loads_as_the_48gb_setup() -> None:
    cfg = load(PRODUCTION)
    assert cfg.model.path == "/srv/models/Qwen3.5-27B-FP8"
    assert cfg.model.context_length == 262144 and cfg.model.kv_cache_dtype == "fp8_e4m3"
    assert cfg.engine.max_running_requests == 1
    assert cfg.speculative.num_steps == 5
    assert cfg.cache.host.size_gb == 24 and cfg.cache.host.write_policy == "write_through"
    assert cfg.cache.file.dir.startswith("/var/cache/tinyserve/")
    assert (cfg.parsers.reasoning, cfg.parsers.tool_call) == ("qwen3", "qwen3_coder")
    assert cfg.server.host == "0.0.0.0" and cfg.server.api_key


def test_service_unit_matches_the_production_config() -> None:
    unit = (ROOT / "systemd" / "tinyserve.service").read_text()
    pairs = [ln.split("=", 1) for ln in unit.splitlines() if "=" in ln and not ln.startswith("#")]
    lines = {k: v for k, v in pairs}
    assert lines["Type"] == "notify" and lines["User"] == "tinyserve"
    assert lines["ExecStart"] == "/opt/tinyserve/.venv/bin/tinyserve /etc/tinyserve/config.toml"
    assert lines["CacheDirectory"] == "tinyserve" and "PrivateDevices" not in lines and "DynamicUser" not in lines
    # systemd must wait longer than the drain, or SIGKILL cuts the file-tier flush short.
    assert float(lines["TimeoutStopSec"]) > load(PRODUCTION).server.drain_timeout_s
    assert load(PRODUCTION).cache.file.dir.startswith("/var/cache/" + lines["CacheDirectory"])


def test_round_trip_through_dumps(tmp_path: Path) -> None:
    cfg = load(PRODUCTION)
    p = tmp_path / "effective.toml"
    p.write_text(dumps(cfg))
    assert load(p) == cfg
    assert _flat_keys(to_dict(cfg)) == all_keys()


def test_relative_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "c.toml"
    p.write_text('[model]\npath = "../ckpt"\n[cache.file]\ndir = "kv"\n')
    cfg = load(p)
    assert cfg.model.path == str((tmp_path / "ckpt").resolve())
    assert cfg.cache.file.dir == str((tmp_path / "sub" / "kv").resolve())


def test_sections_check_themselves_when_built_or_revalidated() -> None:
    assert Config(engine=EngineSection(page_size=64)).engine.page_size == 64
    with pytest.raises(ConfigError, match=r"engine\.page_size"):
        EngineSection(page_size=0)
    with pytest.raises(ConfigError, match=r"cache\.host\.size_gb"):
        HostCacheSection(size_gb=-1)
    with pytest.raises(ConfigError, match=r"cache\.state_track_interval"):
        Config(engine=EngineSection(page_size=64), cache=CacheSection(state_track_interval=96))
    cfg = Config()
    cfg.engine.page_size = "16"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"engine\.page_size"):
        cfg.validate()


# --- every error class names the key -------------------------------------------------------------------------

BAD_VALUES = [
    # key, value, words the message must contain (besides the key)
    ("model.path", "", ["empty"]),
    ("model.path", 3, ["a string", "3"]),
    ("model.dtype", "bf16", ["bfloat16", '"bf16"']),
    ("model.kv_cache_dtype", "fp8", ["fp8_e4m3", '"fp8"']),
    ("model.device", "gpu", ["cuda", '"gpu"']),
    ("model.context_length", -1, [">= 0", "-1"]),
    ("model.context_length", 1.5, ["an integer", "1.5"]),
    ("server.port", 0, ["1", "65535", "found 0"]),
    ("server.port", 70000, ["<= 65535", "70000"]),
    ("server.port", "8000", ["an integer", '"8000"']),
    ("server.api_key", 1234, ["a string", "1234"]),
    ("server.max_queued_requests", -1, [">= 0"]),
    ("server.max_request_body_mb", 0, ["> 0"]),
    ("server.drain_timeout_s", -1.0, [">= 0"]),
    ("engine.page_size", 0, [">= 1", "found 0"]),
    ("engine.page_size", True, ["an integer", "true"]),
    ("engine.chunked_prefill_size", 0, [">= 1"]),
    ("engine.max_running_requests", 0, [">= 1"]),
    ("engine.mem_fraction_static", 1.0, ["> 0", "< 1", "1.0"]),
    ("engine.mem_fraction_static", 0, ["> 0", "< 1"]),
    ("engine.mem_fraction_static", "0.9", ["a number", '"0.9"']),
    ("engine.kv_cache_tokens", -16, [">= 0"]),
    ("engine.idle_release_s", "yes", ["a number", '"yes"']),
    ("cache.enabled", "true", ["a boolean", '"true"']),
    ("cache.state_track_interval", 8, ["multiple of engine.page_size", "8"]),
    ("cache.state_track_interval", 520, ["multiple of engine.page_size", "520"]),
    ("cache.state_slots", -1, [">= 0"]),
    ("cache.host.size_gb", -1, [">= 0"]),
    ("cache.host.size_gb", "24GB", ["a number", '"24GB"']),
    ("cache.host.write_policy", "write-back", ["write_back", "write_through_selective"]),
    ("cache.file.size_gb", -5, [">= 0"]),
    ("cache.file.prefetch_policy", "eager", ["best_effort", "wait_complete", "timeout"]),
    ("speculative.num_steps", -1, [">= 0"]),
    ("parsers.reasoning", "deepseek_r1", ['"qwen3"']),
    ("parsers.tool_call", "hermes", ['"qwen3_coder"']),
    ("log.level", "verbose", ["debug", "info", "warning", "error", "critical"]),
    ("log.level", ["info"], ["a string", "array"]),
]


@pytest.mark.parametrize("key,value,words", BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_bad_value_names_the_key_and_what_is_allowed(key: str, value: object, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict(_nested(key, value), source="my.toml")
    msg = str(info.value)
    assert msg.startswith("my.toml: ")
    assert key in msg and info.value.key == key
    for w in words:
        assert w in msg, f"{w!r} missing from: {msg}"


def test_the_same_errors_come_from_a_file(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[engine]\npage_size = 0\n")
    with pytest.raises(ConfigError, match=re.escape(f"{p}: engine.page_size must be >= 1, found 0")):
        load(p)


def test_file_tier_needs_a_size_when_on() -> None:
    with pytest.raises(ConfigError, match=r"cache\.file\.size_gb must be > 0 when cache\.file\.dir is set"):
        from_dict({"cache": {"file": {"dir": "/tmp/kv", "size_gb": 0}}})
    assert from_dict({"cache": {"file": {"dir": "", "size_gb": 0}}}).cache.file.size_gb == 0


def test_state_track_interval_follows_page_size() -> None:
    for page in (1, 16, 64):
        assert from_dict({"engine": {"page_size": page}, "cache": {"state_track_interval": 512}})
    with pytest.raises(ConfigError, match=r"cache\.state_track_interval.*\(128\).*found 64"):
        from_dict({"engine": {"page_size": 128}, "cache": {"state_track_interval": 64}})


UNKNOWN = [
    # data, key named, suggestion expected in the message
    ({"engine": {"page_sise": 16}}, "engine.page_sise", "did you mean engine.page_size?"),
    ({"cache": {"host": {"szie_gb": 4}}}, "cache.host.szie_gb", "did you mean cache.host.size_gb?"),
    ({"servr": {"port": 1}}, "servr", "did you mean [server]?"),
    ({"cache": {"hots": {"size_gb": 1}}}, "cache.hots", "did you mean [cache.host]?"),
    ({"engine": {"context_length": 4096}}, "engine.context_length", "did you mean model.context_length (in [model])?"),
    ({"port": 8000}, "port", "did you mean server.port (in [server])?"),
    ({"engine": {"frobnicate": 1}}, "engine.frobnicate", "known keys in table [engine]: engine.max_running_requests"),
]


@pytest.mark.parametrize("data,key,hint", UNKNOWN, ids=[k for _, k, _ in UNKNOWN])
def test_unknown_key_or_table_names_it_and_the_closest_known_key(data: dict, key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict(data, source="c.toml")
    msg = str(info.value)
    assert key in msg and info.value.key == key
    assert "unknown" in msg and hint in msg, msg
    table = key.rsplit(".", 1)[0] if "." in key else None
    assert (f"in table [{table}]" if table else "at the top level") in msg


def test_table_where_a_value_belongs_and_the_reverse() -> None:
    with pytest.raises(ConfigError, match=r"\[cache\.host\] must be a table, found 24"):
        from_dict({"cache": {"host": 24}})
    with pytest.raises(ConfigError, match=r"\[model\] must be a table"):
        from_dict({"model": "demo"})
    with pytest.raises(ConfigError, match=r"engine\.page_size must be an integer, found a table"):
        from_dict({"engine": {"page_size": {"x": 1}}})


def test_invalid_toml_names_the_file_and_the_line(tmp_path: Path) -> None:
    p = tmp_path / "broken.toml"
    p.write_text('[model]\npath = "demo"\nserved_name = tinyserve\n')
    with pytest.raises(ConfigError) as info:
        load(p)
    msg = str(info.value)
    assert str(p) in msg and "not valid TOML" in msg and "line 3" in msg


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    p = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=re.escape(f"config file {p} not found")):
        load(p)
    with pytest.raises(ConfigError, match="is a directory"):
        load(tmp_path)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


# --- docs and example cover every key --------------------------------------------------------------------

def test_example_has_every_key_with_a_comment() -> None:
    text = EXAMPLE.read_text()
    assert sorted(_flat_keys(tomllib.loads(text))) == sorted(all_keys())
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^([a-z_]+)\s*=", line)
        if m:
            assert i > 0 and lines[i - 1].startswith("#"), f"config.example.toml: {m.group(1)} has no comment"
            assert "Default:" in _comment_block(lines, i), f"config.example.toml: {m.group(1)} has no default"


def _comment_block(lines: list[str], i: int) -> str:
    block = []
    j = i - 1
    while j >= 0 and lines[j].startswith("#"):
        block.append(lines[j])
        j -= 1
    return "\n".join(block)


@pytest.mark.parametrize("path", [PRODUCTION, PRODUCTION.with_name("production-32gb.toml")], ids=lambda p: p.name)
def test_production_has_a_comment_for_every_choice(path) -> None:
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+\s*=", line):
            assert lines[i - 1].startswith("#"), f"{path.name}: {line} has no comment"


def _doc_sections() -> dict[str, str]:
    parts = re.split(r"^## \[([a-z_.]+)\]\s*$", DOCS.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_docs_have_a_table_for_every_table_and_a_row_for_every_key() -> None:
    sections = _doc_sections()
    assert sorted(sections) == sorted(t for t in all_tables() if t), "docs/config.md tables"
    for key in all_keys():
        table, leaf = key.rsplit(".", 1)
        assert re.search(rf"^\| `{leaf}` \|", sections[table], flags=re.M), f"docs/config.md: no row for {key}"


def test_docs_defaults_match_the_dataclasses() -> None:
    sections = _doc_sections()
    defaults = to_dict(Config())
    for key in all_keys():
        table, leaf = key.rsplit(".", 1)
        row = re.search(rf"^\| `{leaf}` \| `([^`]*)` \|", sections[table], flags=re.M)
        assert row, f"docs/config.md: no default for {key}"
        node = defaults
        for part in key.split("."):
            node = node[part]
        documented = tomllib.loads(f"v = {row.group(1)}")["v"]
        assert documented == node, f"docs/config.md: {key} default {row.group(1)} != {node!r}"


def test_module_exports() -> None:
    for name in ("load", "from_dict", "to_dict", "dumps", "Config", "ConfigError", "ModelSection", "ServerSection",
                 "EngineSection", "CacheSection", "HostCacheSection", "FileCacheSection", "SpeculativeSection",
                 "ParsersSection", "LogSection"):
        assert hasattr(config, name), name


REMOVED_KEYS = [("speculative", "algorithm", "nextn", "speculative.num_steps > 0"),
                ("speculative", "num_draft_tokens", 4, "speculative.num_steps + 1"),
                ("engine", "sleep_on_idle", True, "always sleeps"),
                ("cache.host", "state_share", 0.25, "25% of cache.host.size_gb"),
                ("server", "keep_billing_header", False, "always dropped"),
                ("metrics", "enabled", True, "always served")]


@pytest.mark.parametrize("table,key,value,replaced_by", REMOVED_KEYS, ids=[f"{t}.{k}" for t, k, _, _ in REMOVED_KEYS])
def test_a_removed_key_fails_saying_what_replaced_it(tmp_path: Path, table, key, value, replaced_by) -> None:
    p = tmp_path / "old.toml"
    p.write_text(f"[{table}]\n{key} = {json.dumps(value)}\n")
    with pytest.raises(ConfigError) as e:
        load(p)
    dotted = "metrics" if table == "metrics" else f"{table}.{key}"
    assert e.value.key == dotted
    assert f"{'[metrics]' if table == 'metrics' else dotted} was removed" in str(e.value)
    assert replaced_by in str(e.value) and str(p) in str(e.value)


def test_the_config_has_at_most_39_keys() -> None:
    """38 after the last removals; 39 with model.int8_activations, which changes the results (an opt-in, never
    automatic)."""
    assert len(all_keys()) <= 39, all_keys()
