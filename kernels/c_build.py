"""Building the CPU's C kernels (attention_cpu.c, w4_cpu.c) once per machine and source, into the cache folder:
what -march=native compiles for, where the libraries go, and one compiler step."""
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
