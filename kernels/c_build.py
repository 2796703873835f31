"""Building the CPU's C kernels (attention_cpu.c, w4_cpu.c) once per machine and source, into the cache folder:
what -march=native compiles for, where the libraries go, and the build of a kernel's library with its torch op (the
C++ half of its source)."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("tinyserve.kernels")


def cpu_info() -> list[str]:
    """/proc/cpuinfo's model name and flags lines (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return [line for line in f if line.startswith(("model name", "flags"))]
    except OSError:
        return []


def cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and flags, part of a built library's key."""
    return "".join(cpu_info())[:4096] or os.uname().machine


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tinyserve" / "kernels"


def c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def run(step: list[str]) -> None:
    """One compiler or linker step; its error's tail as an OSError."""
    done = subprocess.run(step, capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(done.stderr.strip()[-500:])


def build_library(name: str, source: Path, flags: Sequence[str], link: Sequence[str], op_define: str | None,
                  without_op: str = "its op runs in Python, ~20 us more a call") -> Path:
    """`source` built with `flags` into the cache folder as `name`-<key>.so, once per machine, source, flags and (with
    an op) torch: the kernel in C and, with `op_define`, the torch op of the source's second half (that macro
    defined) compiled as C++ against torch's headers and linked in, so that its registration runs when the library
    is loaded. An op called so costs a few us more than its kernel, where a Python op around a ctypes call costs
    ~20 us more than that (attention_cpu.py's figures). Without a C++ compiler or torch's headers the library is
    the kernel alone (one warning, ending in `without_op`: what the caller runs then). Returns the library's path;
    an OSError when there is no C compiler or the kernel's build fails."""
    import torch
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler (CC, cc or gcc)")
    key = source.read_bytes() + " ".join([*flags, *link]).encode() + cpu_id().encode() + \
        (f"{op_define}, torch {torch.__version__}".encode() if op_define else b"")
    target = cache_dir() / f"{name}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        so, obj, op_obj = Path(tmp) / target.name, Path(tmp) / f"{name}.o", Path(tmp) / f"{name}_op.o"
        run([compiler, *flags, "-c", str(source), "-o", str(obj)])
        try:
            if op_define is None:
                raise OSError("not asked for")
            cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
            if cxx is None:
                raise OSError("no C++ compiler")
            root = Path(torch.__file__).parent
            abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
            run([cxx, "-O2", "-std=c++17", "-fPIC", "-w", f"-D{op_define}", abi, "-I", str(root / "include"),
                 "-x", "c++", "-c", str(source), "-o", str(op_obj)])
            run([cxx, str(obj), str(op_obj), *link, f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10", "-o", str(so)])
        except OSError as e:
            if op_define is not None:
                log.warning("building the C++ half of %s failed (%s): %s", source.name, e, without_op)
            run([compiler, str(obj), *link, "-o", str(so)])
        os.replace(so, target)                        # atomic: another process may be building it too
    return target
