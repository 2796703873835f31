"""The walls between the layers, read from the source (ast), so a shortcut fails here before it spreads:
- kernels/ imports the standard library, torch and triton, and itself: nothing else of ours;
- models/ imports, of ours, only kernels/;
- the cache, the scheduler and the tiers know nothing of the API (HTTP, protocols, tokenizer, parsers, metrics);
- the tiers are reached only through the cache: no module but the cache side imports them (the engine's
  construction builds them);
- the API reaches the model only through the engine: it imports none of the engine's parts, and touches no private
  part of an engine object (model, scheduler, cache, pools, runner);
- the cli talks to the engine, the config and the API only.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("tinyserve", "models", "kernels")
API_MODULES = ("api", "protocol", "anthropic", "responses", "tokenizer", "parsers", "metrics", "cli")
ENGINE_PARTS = ("models", "kernels", "loader", "runner", "scheduler", "cache", "radix", "host_tier", "file_tier",
                "blob", "kv", "state", "request", "plan")
TIERS = ("host_tier", "file_tier", "blob")
CACHE_SIDE = ("cache", "radix") + TIERS
ENGINE_PRIVATE = ("model", "model_config", "scheduler", "cache", "runner", "kv_pool", "state_pool", "allocator",
                  "plan")


def imports(path: Path) -> list[str]:
    """Absolute module names a file imports (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = {"kernels": "tinyserve.kernels", "models": "tinyserve.models"}.get(path.parent.name, "tinyserve")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
                out += [mod] if node.module else [f"{base}.{a.name}" for a in node.names]
            else:
                out.append(node.module)
    return out


def ours(module: str) -> str | None:
    """The part of ours a module name refers to (tinyserve.kernels.gdn -> "kernels", tinyserve.api -> "api")."""
    parts = module.split(".")
    if parts[0] in ("kernels", "models"):
        return parts[0]
    if parts[0] != "tinyserve":
        return None
    return parts[1] if len(parts) > 1 else "tinyserve"


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).glob("*.py"))


def test_the_walls_cover_real_files():
    assert files("kernels") and files("models") and (ROOT / "tinyserve" / "engine.py").exists()
    assert "tinyserve.kernels.gdn" in imports(ROOT / "models" / "qwen3_next.py")


@pytest.mark.parametrize("path", files("kernels"), ids=lambda p: p.name)
def test_kernels_import_only_torch_triton_and_themselves(path):
    for module in imports(path):
        top = module.split(".")[0]
        allowed = top in ("torch", "triton", "__future__") or top in sys.stdlib_module_names \
            or ours(module) == "kernels"
        assert allowed, f"{path.name} imports {module}"


@pytest.mark.parametrize("path", files("models"), ids=lambda p: p.name)
def test_models_import_only_kernels_of_ours(path):
    for module in imports(path):
        part = ours(module)
        assert part in (None, "kernels", "models"), f"{path.name} imports {module}"


@pytest.mark.parametrize("name", ["scheduler", "kv", "state", "request", "runner", *CACHE_SIDE])
def test_cache_and_scheduler_know_nothing_of_the_api(name):
    for module in imports(ROOT / "tinyserve" / f"{name}.py"):
        assert ours(module) not in API_MODULES, f"{name}.py imports {module}"


@pytest.mark.parametrize("name", ["api", "protocol", "metrics"])
def test_the_api_reaches_the_model_only_through_the_engine(name):
    path = ROOT / "tinyserve" / f"{name}.py"
    for module in imports(path):
        assert ours(module) not in ENGINE_PARTS, f"{name}.py imports {module}"
    for attr, line in engine_attributes(path):
        assert attr not in ENGINE_PRIVATE, f"{name}.py reaches engine.{attr} (line {line})"


def engine_attributes(path: Path) -> list[tuple[str, int]]:
    """(attribute, line) of every `engine.<attribute>` in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name_of = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name_of == "engine":
                out.append((node.attr, node.lineno))
    return out


@pytest.mark.parametrize("path", files("tinyserve"), ids=lambda p: p.name)
def test_the_tiers_are_reached_only_through_the_cache(path):
    name = path.stem
    for module in imports(path):
        if ours(module) in TIERS:
            assert name in CACHE_SIDE or name == "engine", f"{path.name} imports {module}"


def test_the_cli_talks_to_the_engine_config_and_api_only():
    # plan and loader: --check prints the memory plan from the checkpoint's headers, and reports its errors, without
    # importing torch (the engine does)
    path = ROOT / "tinyserve" / "cli.py"
    for module in imports(path):
        assert ours(module) in (None, "tinyserve", "engine", "config", "api", "plan", "loader"), \
            f"cli.py imports {module}"
    for attr, line in engine_attributes(path):
        assert attr not in ENGINE_PRIVATE or attr == "plan", f"cli.py reaches engine.{attr} (line {line})"
