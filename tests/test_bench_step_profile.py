"""bench/step_profile.py wraps the engine's methods by name: a rename anywhere it reaches would break the profiler
only when someone next runs it, so its timers are installed here, in a fresh process, on the code as it is."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_step_profile_installs_its_timers():
    code = ("import sys; sys.path.insert(0, 'bench'); import step_profile; step_profile._install(); "
            "from tinyserve import engine, spec; "
            "assert engine.Engine.run_step.__wrapped__ and spec.NextN.verify.__wrapped__; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
