"""The walls between the layers, read from the source (ast), so a shortcut fails here before it spreads:
- kernels/ imports the standard library, torch and triton, and itself: nothing else of ours;
- models/ imports, of ours, only kernels/;
- the cache, the scheduler and the tiers know nothing of the API (HTTP, protocols, tokenizer, parsers, metrics);
- the API reaches the model only through the engine: it imports none of the engine's parts, and touches no private
  part of an engine object (model, scheduler, cache, pools, runner).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("tinyserve", "models", "kernels")
API_MODULES = ("api", "protocol", "chat", "openai_api", "anthropic", "responses", "tokenizer", "parsers", "metrics",
               "cli")
ENGINE_PARTS = ("models", "kernels", "loader", "runner", "scheduler", "cache", "radix", "tiers", "kv", "state",
                "request", "plan")
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


@pytest.mark.parametrize("name", ["cache", "radix", "scheduler", "tiers", "kv", "state", "request", "runner"])
def test_cache_and_scheduler_know_nothing_of_the_api(name):
    for module in imports(ROOT / "tinyserve" / f"{name}.py"):
        assert ours(module) not in API_MODULES, f"{name}.py imports {module}"


@pytest.mark.parametrize("name", ["api", "protocol", "chat", "openai_api", "anthropic", "responses", "metrics"])
def test_the_api_reaches_the_model_only_through_the_engine(name):
    path = ROOT / "tinyserve" / f"{name}.py"
    for module in imports(path):
        assert ours(module) not in ENGINE_PARTS, f"{name}.py imports {module}"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_PRIVATE:
            owner = node.value
            name_of = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            assert name_of != "engine", f"{name}.py reaches engine.{node.attr} (line {node.lineno})"
