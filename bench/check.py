"""How long `tinyserve --check` takes on a Qwen3.5-27B-shaped checkpoint folder (target: under 2 s).

    .venv/bin/python bench/check.py [--runs 5]

The folder holds config.json and one safetensors file with the header alone (every tensor's name, dtype, shape and
offsets, no data: 27.3e9 bf16 values described in a few hundred KB), so --check can only succeed by planning from
the headers, as it does for a real 55 GB release. Each run is a fresh `python -m tinyserve.cli --check` process,
timed from start to exit (interpreter and torch import included), as a user meets it.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))      # the header-only checkpoint maker lives with the test checkpoints

from checkpoints import QWEN3_5_27B, make_header_only  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_header_only(Path(tmp) / "q35-27b", QWEN3_5_27B)
        config = Path(tmp) / "check.toml"
        config.write_text(f'[model]\npath = "{folder}"\ndevice = "cpu"\ndtype = "bfloat16"\n'
                          'kv_cache_dtype = "fp8_e4m3"\n[engine]\nmax_running_requests = 1\n'
                          'kv_cache_tokens = 262144\n')
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "tinyserve.cli", "--check", str(config)],
                                 capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if out.returncode != 0:
                sys.exit(f"--check failed: {out.stderr}")
        print(out.stdout.strip().splitlines()[-1])
        print(f"tinyserve --check on a 27B-shaped folder of headers: median {statistics.median(times):.2f} s, "
              f"min {min(times):.2f} s over {args.runs} runs (target < 2 s)")


if __name__ == "__main__":
    main()
