#!/usr/bin/env bash
# The GPU checks, in one go on a CUDA machine (under 8 minutes on an H200), from the repository
# root:   bash tests/gpu.sh        (logs in $OUT, default /tmp/tinyserve-gpu)
#   1. the Triton kernel tests compiled on the device, their `gpu` tier included (bf16, Qwen3.5-27B shapes);
#   2. the engine's parity (against transformers), engine, NEXTN and cache-path tests with the model on the GPU
#      (TINYSERVE_TEST_DEVICE=cuda: the same tests and oracles as on the CPU);
#   3. bench/gpu_check.py: one decode layer in a CUDA graph, each kernel against its reference (time, error), the
#      vision tower;
#   4. bench/gpu.py: the engine on a random Qwen3.5-27B-shaped FP8 model (decode, prefill, TTFT, kernel peers).
# The device image has torch, triton, transformers, aiohttp, safetensors, tokenizers, jinja2, pillow, pytest; what it
# lacks is installed from .gpu-wheels when that folder was carried (tests/gpu_wheels.sh makes it, here).
# The pytest stages run in one process (-o addopts= drops pyproject's xdist workers: one GPU, and the device image
# may lack pytest-xdist). Each stage has its own time limit and a failing stage does not stop the next; the exit
# status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tinyserve-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .gpu-wheels ]; then
    python3 -m pip install -q --no-index --find-links .gpu-wheels llguidance tomli-w 2>&1 | tail -3
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
status=0
stage() {   # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}
stage kernels 120 python3 -m pytest -q -rfEs -p no:cacheprovider -o addopts= tests/test_triton_kernels.py \
    tests/test_triton_gdn_prefill.py tests/test_triton_prefill.py tests/test_triton_fp8.py tests/test_triton_moe.py
stage engine 120 env TINYSERVE_TEST_DEVICE=cuda python3 -m pytest -q -rfEs -p no:cacheprovider -o addopts= -x \
    tests/test_parity.py tests/test_engine.py tests/test_spec.py tests/test_tiers.py tests/test_async_copies.py tests/test_cuda_graphs.py
stage gpu_check 75 python3 bench/gpu_check.py --skip-tests
# fla (the GDN peer bench/gpu.py times) only now: where it is importable, transformers' Qwen3-Next runs its Triton
# kernels, which refuse the CPU tensors of the parity tests' oracle ("cannot be accessed from Triton (cpu tensor?)")
if [ -d .gpu-wheels ]; then
    python3 -m pip install -q --no-index --find-links .gpu-wheels fla-core 2>&1 | tail -3
fi
stage gpu 150 python3 bench/gpu.py
exit $status
