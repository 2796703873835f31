"""Building the CPU's C kernels (attention_cpu.c, w4_cpu.c) once per machine and source, into the cache folder:
what -march=native compiles for, where the libraries go, one compiler step, and the steps that add a kernel's torch
op (the C++ half of its source) to its library."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


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


def torch_op_steps(source: Path, define: str, op_obj: Path, kernel_obj: Path, so: Path) -> list[list[str]]:
    """The op half of `source` (what `define` switches on) compiled as C++ against this torch's headers, and linked
    with the kernel's object into one library: the op's registration then runs when the library is loaded. An op
    called so costs ~2 us more than its kernel, where a Python op around a ctypes call costs 10-30 us more."""
    import torch
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise OSError("no C++ compiler")
    root = Path(torch.__file__).parent
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [[cxx, "-O2", "-std=c++17", "-fPIC", "-w", f"-D{define}", abi, "-I", str(root / "include"),
             "-x", "c++", "-c", str(source), "-o", str(op_obj)],
            [cxx, str(kernel_obj), str(op_obj), "-shared", "-fopenmp", f"-L{root / 'lib'}", "-ltorch_cpu", "-lc10",
             "-o", str(so)]]
