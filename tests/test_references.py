"""Docstrings and comments name real things: every `module.attribute` or `Class.attribute` they mention of ours
(runner.ModelRunner, kernels.gdn.snapshot_alignment, Engine.submit) exists, and every `name.py` they mention is a
file of the project. Read from the source (tokenize and ast), so a rename that leaves a stale mention fails here.

What counts as ours: the short names of our modules (engine, radix, gdn, qwen3_next; `tinyserve.`, `models.` and
`kernels.` prefixes resolved as the imports are) and the classes they define. An attribute exists when the module
defines it at the top level (or it is a submodule of a package), or when a class of that module has it: a method,
a class attribute, a dataclass field or an attribute set on `self` in one of its methods. A name a module merely
imports is not its attribute (a package's __init__ aside): `runner.StaticStep` names static.py's class by the wrong
module. A mention like
`engine.intake` reads the instance the module's class makes, so the classes of the module count for it.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

from tinyserve.config import REMOVED, all_keys

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("tinyserve", "models", "kernels")
FILE_FOLDERS = ("tinyserve", "models", "kernels", "tests", "bench", "docs", "systemd", ".")
DOTTED = re.compile(r"(?<![\w.*/-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
OUTSIDE = {"models.retrieve"}     # the OpenAI SDKs' client.models.retrieve, not our models/ package
# short module names that prose uses far more often for something else: `request.images` is an API request's
# images, not request.py's (its class is Request)
AMBIGUOUS = {"request"}
EXTENSIONS = ("py", "md", "toml", "json", "html", "sh", "txt", "safetensors", "jinja", "service", "bin", "cfg", "c",
              "h", "cpp", "cu", "so")


def product_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).glob("*.py"))


class Names:
    """What each of our modules defines: top-level names, and per class the names its instances have."""

    def __init__(self) -> None:
        self.modules: dict[str, Path] = {}        # short name and dotted names -> file
        self.top: dict[Path, set[str]] = {}
        self.classes: dict[str, set[str]] = {}    # class name -> attributes (every class of that name, merged)
        self.module_classes: dict[Path, list[str]] = {}
        for path in product_files():
            package = {"models": "models", "kernels": "kernels"}.get(path.parent.name, "tinyserve")
            self.modules[path.stem] = self.modules.get(path.stem, path)
            self.modules[f"{package}.{path.stem}"] = path
            self.modules[f"tinyserve.{package}.{path.stem}"] = path
            self._read(path)
        for package in ("models", "kernels"):
            init = ROOT / package / "__init__.py"
            self.modules[package] = self.modules[f"tinyserve.{package}"] = init
            self.top[init] |= {p.stem for p in (ROOT / package).glob("*.py")}

    def _read(self, path: Path) -> None:
        tree = ast.parse(path.read_text(), str(path))
        top: set[str] = set()
        self.module_classes[path] = []
        for node in tree.body:
            top |= defined(node)
            if path.name == "__init__.py" and isinstance(node, (ast.Import, ast.ImportFrom)):
                top |= {(a.asname or a.name).split(".")[0] for a in node.names}     # what a package re-exports
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, set()).update(class_attributes(node))
                self.module_classes[path].append(node.name)
        self.top[path] = top

    def class_has(self, cls: str, attr: str) -> bool:
        return attr in self.classes.get(cls, set())

    def missing(self, chain: str) -> str | None:
        """Why `chain` (a.b.c) names nothing of ours, or None when it exists or is not ours."""
        parts = chain.split(".")
        for k in range(len(parts) - 1, 0, -1):        # the longest module prefix
            path = self.modules.get(".".join(parts[:k]))
            if path is None or ".".join(parts[:k]) in AMBIGUOUS:
                continue
            attr = parts[k]
            if attr in self.top[path] or any(self.class_has(c, attr) for c in self.module_classes[path]):
                if attr in self.classes and k + 1 < len(parts) and not self.class_has(attr, parts[k + 1]):
                    return f"{attr} has no {parts[k + 1]}"
                return None
            return f"{path.relative_to(ROOT)} defines no {attr}"
        if parts[0] in self.classes and not self.class_has(parts[0], parts[1]):
            return f"class {parts[0]} has no {parts[1]}"
        return None


def defined(node: ast.AST) -> set[str]:
    """Names a top-level statement defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.If, ast.Try)):
        out: set[str] = set()
        for child in ast.iter_child_nodes(node):
            out |= defined(child)
        return out
    return set()


def class_attributes(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes and fields, and what its methods set on self (registered buffers too)."""
    out: set[str] = set()
    for node in cls.body:
        out |= defined(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self" \
                        and isinstance(sub.ctx, ast.Store):
                    out.add(sub.attr)
                elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.args \
                        and sub.func.attr in ("register_buffer", "register_parameter") \
                        and isinstance(sub.args[0], ast.Constant):
                    out.add(sub.args[0].value)
    return out


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a file."""
    source = path.read_text()
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                for k, line in enumerate(first.value.value.splitlines()):
                    out.append((first.lineno + k, line))
    return out


def project_files() -> set[str]:
    return {p.name for folder in FILE_FOLDERS for p in (ROOT / folder).glob("*") if p.is_file()}


NAMES = Names()
FILES = project_files()
CONFIG_KEYS = set(all_keys()) | set(REMOVED)     # engine.kernels, cache.enabled: the TOML's names


def stale(path: Path) -> list[str]:
    """Each stale mention in a file's comments and docstrings, as "line: mention: why"."""
    found = []
    for line, text in prose(path):
        for m in DOTTED.finditer(text):
            chain = m.group(1)
            last = chain.split(".")[-1]
            if last in EXTENSIONS:                    # a file name: a Python file must exist in the project
                if last == "py" and chain not in FILES:
                    found.append(f"{line}: {chain} is no file of the project")
                continue
            if chain in CONFIG_KEYS or chain in OUTSIDE:
                continue
            why = NAMES.missing(chain)
            if why:
                found.append(f"{line}: {chain}: {why}")
    return found


# Stale mentions in files whose owners fix them next (strict: the test fails once a mention is fixed, so the entry
# goes with it)
KNOWN: dict[str, str] = {}


def _param(path: Path):
    known = KNOWN.get(str(path.relative_to(ROOT)))
    marks = [pytest.mark.xfail(strict=True, reason=known)] if known else []
    return pytest.param(path, marks=marks, id=f"{path.parent.name}/{path.name}")


@pytest.mark.parametrize("path", [_param(p) for p in product_files()])
def test_docstrings_and_comments_name_what_exists(path):
    assert not stale(path), "\n".join(stale(path))


def test_the_checker_finds_a_stale_mention(tmp_path):
    """The checker itself: a mention of a missing attribute, of a missing method and of a missing file fail; real
    ones pass."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""Calls runner.NoSuchThing and Engine.no_such_method (see nowhere.py)."""\n'
                   "# the engine's loop: engine.Engine.submit, kernels.gdn.snapshot_alignment, radix.py\n")
    found = stale(bad)
    assert any("runner.NoSuchThing" in f for f in found)
    assert any("Engine.no_such_method" in f for f in found)
    assert any("nowhere.py" in f for f in found)
    assert not any("submit" in f or "snapshot_alignment" in f or "radix.py" in f for f in found), found
