#!/usr/bin/env bash
# Wheels of what a CUDA machine without network access lacks next to its own torch / triton / transformers: run
# this where pip can download, copy .gpu-wheels into the checkout on the CUDA machine, and tests/gpu.sh installs
# them. Built for Python 3.12 on x86-64.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu-wheels
python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d .gpu-wheels \
    llguidance tomli-w fla-core pytest-xdist execnet
du -sh .gpu-wheels && ls .gpu-wheels
