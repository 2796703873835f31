"""The walls between the layers, read from the source (ast), so a shortcut fails here before it spreads:
- kernels/ imports the standard library, torch and triton, and itself: nothing else of ours;
- models/ imports, of ours, only kernels/;
- the cache, the scheduler and the tiers know nothing of the API (HTTP, protocols, tokenizer, parsers, metrics);
- the tiers are reached only through the cache: no module but the cache side imports them (build.py, which
  makes the engine, builds them);
- the API reaches the model only through the engine: it imports none of the engine's parts, and touches no private
  part of an engine object (model, scheduler, cache, pools, runner);
- no import cycle among our modules, counting the imports inside functions (they run when the function does) but
  not those under `if TYPE_CHECKING:` (they never run);
- the cli talks to the engine, the config and the API only.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("tinyserve", "models", "kernels")
API_MODULES = ("api", "http_images", "protocol", "generation", "json_body", "chat", "openai_api", "anthropic", "loads",
               "responses", "tokenizer", "parsers", "tool_calls", "tool_values", "metrics", "status", "cli")
ENGINE_PARTS = ("models", "kernels", "build", "loader", "model_config", "fp8_scheme", "runner", "static", "spec",
                "scheduler", "cache", "radix", "tiers", "host_tier", "file_tier", "file_index", "blob", "copies",
                "idle", "pools", "request", "plan")
TIERS = ("tiers", "host_tier", "file_tier", "file_index", "blob")
CACHE_SIDE = ("cache", "radix", "radix_check") + TIERS
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


@pytest.mark.parametrize("name", ["scheduler", "pools", "request", "runner", *CACHE_SIDE])
def test_cache_and_scheduler_know_nothing_of_the_api(name):
    for module in imports(ROOT / "tinyserve" / f"{name}.py"):
        assert ours(module) not in API_MODULES, f"{name}.py imports {module}"


@pytest.mark.parametrize("name", ["api", "http_images", "protocol", "generation", "json_body", "chat", "openai_api",
                                  "anthropic", "responses", "metrics", "status", "loads"])
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
            assert name in CACHE_SIDE or name == "build", f"{path.name} imports {module}"


def test_the_tree_imports_none_of_its_tiers():
    """radix.py (the tree) and snapshot_worth.py (its eviction order) import no tier and not the checks, not even for
    types: the tiers' policy (tiers.py) builds on the tree, which reaches it only through its own hooks."""
    for name in ("radix", "snapshot_worth"):
        for module in imports(ROOT / "tinyserve" / f"{name}.py"):
            assert ours(module) not in TIERS + ("radix_check",), f"{name}.py imports {module}"


def test_the_cache_side_imports_one_way_even_for_types():
    """No import cycle among the cache's modules, counting the imports under `if TYPE_CHECKING:` too (a module names
    what it reads of one that imports it with a Protocol instead)."""
    names = CACHE_SIDE + ("snapshot_worth", "divergences")
    modules = {f"tinyserve.{n}" for n in names}
    graph = {f"tinyserve.{n}": set(imports(ROOT / "tinyserve" / f"{n}.py")) & modules - {f"tinyserve.{n}"}
             for n in names}
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_cli_talks_to_the_engine_config_and_api_only():
    # build: makes the engine; plan and model_config: --check prints the memory plan from the checkpoint's headers,
    # and reports its errors, without importing torch (the engine does)
    path = ROOT / "tinyserve" / "cli.py"
    for module in imports(path):
        assert ours(module) in (None, "tinyserve", "engine", "build", "config", "api", "plan", "model_config",
                                "status"), \
            f"cli.py imports {module}"
    for attr, line in engine_attributes(path):
        assert attr not in ENGINE_PRIVATE or attr == "plan", f"cli.py reaches engine.{attr} (line {line})"


def module_name(path: Path) -> str:
    """The import name of one of our files (models/qwen3_next.py -> tinyserve.models.qwen3_next)."""
    package = {"kernels": "tinyserve.kernels", "models": "tinyserve.models"}.get(path.parent.name, "tinyserve")
    return package if path.stem == "__init__" else f"{package}.{path.stem}"


def runtime_imports(path: Path, modules: set[str]) -> set[str]:
    """Our modules a file imports when it runs: at the top, in functions and classes, anywhere but under
    `if TYPE_CHECKING:`. `from package import name` counts as importing the module package.name when it is one."""
    package = module_name(path).rsplit(".", 1)[0] if path.stem != "__init__" else module_name(path)
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    paths = files("tinyserve") + files("models") + files("kernels")
    modules = {module_name(p) for p in paths}
    return {module_name(p): runtime_imports(p, modules) - {module_name(p)} for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles as paths m -> ... -> m: one through each module on a cycle that no cycle found before passes."""
    def reach(start: str) -> dict[str, str | None]:
        """Every module reachable from start, with the module it was first reached from (a BFS tree)."""
        parent: dict[str, str | None] = {start: None}
        queue = [start]
        for m in queue:
            for n in sorted(graph[m]):
                if n not in parent:
                    parent[n] = m
                    queue.append(n)
        return parent

    found, seen = [], set()
    for m in sorted(graph):
        if m in seen:
            continue
        back = [n for n in sorted(graph) if m in graph[n]]       # modules that import m
        reached = reach(m)
        closing = next((n for n in back if n in reached), None)
        if closing is None:
            continue
        path = [closing]
        while reached[path[-1]] is not None:
            path.append(reached[path[-1]])
        cycle = path[::-1] + [m]
        seen.update(cycle)
        found.append(cycle)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "a.py").write_text("import tinyserve.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from tinyserve import c\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tinyserve.b\n"
                                   "else:\n    from . import a\n")
    (tmp_path / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tinyserve.a\n")
    modules = {f"tinyserve.{n}" for n in "abcd"}
    graph = {f"tinyserve.{n}": runtime_imports(tmp_path / f"{n}.py", modules) for n in "abcd"}
    assert graph["tinyserve.d"] == set()
    assert cycles(graph) == [["tinyserve.a", "tinyserve.b", "tinyserve.c", "tinyserve.a"]]


def test_no_import_cycle_among_our_modules():
    graph = import_graph()
    assert "tinyserve.kernels.gdn_triton" in graph["tinyserve.kernels.gdn"]      # imports in functions count
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)
