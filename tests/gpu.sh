#!/usr/bin/env bash
# The GPU checks, in one go on a CUDA machine (about 20 minutes on an H200 with the profile), from the repository
# root:   bash tests/gpu.sh [stage ...]     (logs in $OUT, default /tmp/tinyserve-gpu; all five stages by default,
#                                           or those named: kernels engine gpu_check profile gpu)
#   1. the Triton kernel tests compiled on the device, their `gpu` tier included (bf16, Qwen3.5-27B shapes);
#   2. the engine's parity (against transformers), engine, NEXTN and cache-path tests with the model on the GPU
#      (TINYSERVE_TEST_DEVICE=cuda: the same tests and oracles as on the CPU);
#   3. bench/gpu_check.py: one decode layer in a CUDA graph, each kernel against its reference (time, error), the
#      vision tower;
#   4. bench/gpu.py --profile: a decode step (batch 1 at 8K, batch 8) and an 8K prefill chunk kernel by kernel
#      against the card's roofs, and our kernels against peers';
#   5. bench/gpu.py: the engine on a random Qwen3.5-27B-shaped FP8 model (decode, prefill, TTFT, kernel peers).
# It expects torch, triton, transformers, aiohttp, safetensors, tokenizers, jinja2, pillow and pytest installed; what
# else the tests need is installed from .gpu-wheels when that folder is in the checkout (tests/gpu_wheels.sh makes it
# where pip can download). The kernel tests run one process per file, side by side (a kernel's illegal memory access
# leaves the CUDA context unusable, which would fail every later test of its process); the engine tests run in one
# process, or on 4 workers where pytest-xdist is installed (-o addopts= drops pyproject's one worker per core). Each
# step has its own time limit and a failing one does not stop the next; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tinyserve-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .gpu-wheels ]; then
    python3 -m pip install -q --no-index --find-links .gpu-wheels llguidance tomli-w pytest-xdist execnet 2>&1 | tail -3
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
status=0
STAGES=${*:-kernels engine gpu_check profile gpu}
wanted() { [[ " $STAGES " == *" $1 "* ]]; }
stage() {   # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    local t0=$SECONDS
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}
if wanted kernels; then      # the files side by side (each mostly compiles kernels, on the CPU), logs per file
    t0=$SECONDS
    echo "== kernels: $(ls tests/test_triton_*.py | wc -l) files, one process each"
    rm -f "$OUT"/kernels.*
    for f in tests/test_triton_*.py; do
        name=kernels.$(basename "$f" .py)
        name=${name/test_triton_/}
        (timeout 300 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider -o addopts= "$f" > "$OUT/$name.txt" 2>&1
         echo "== exit $?" >> "$OUT/$name.txt") &
    done
    wait
    for log in "$OUT"/kernels.*.txt; do
        name=$(basename "$log" .txt)
        rc=$(tail -1 "$log" | sed -n 's/^== exit //p')
        echo "== $name: exit ${rc:-?}"
        grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/$name.txt" | tail -12
        [ "${rc:-1}" -eq 0 ] || status=1
    done
    echo "== kernels: $((SECONDS - t0)) s"
fi
# the engine tests on 4 workers where pytest-xdist is there (each its own small model on the one GPU; most of a test's
# time is the CPU's: Python, and Triton compiling kernels for new shapes)
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4 --dist loadfile")
stage engine 360 env TINYSERVE_TEST_DEVICE=cuda python3 -m pytest -q -rfEs -p no:cacheprovider -o addopts= $workers \
    tests/test_parity.py tests/test_engine.py tests/test_spec.py tests/test_tiers.py tests/test_async_copies.py tests/test_cuda_graphs.py
stage gpu_check 180 python3 bench/gpu_check.py --skip-tests
# fla (the GDN peer bench/gpu.py times) only now: where it is importable, transformers' Qwen3-Next runs its Triton
# kernels, which refuse the CPU tensors of the parity tests' oracle ("cannot be accessed from Triton (cpu tensor?)")
if [ -d .gpu-wheels ] && { wanted gpu || wanted profile; }; then
    python3 -m pip install -q --no-index --find-links .gpu-wheels fla-core 2>&1 | tail -3
fi
stage profile 300 python3 bench/gpu.py --profile
stage gpu 240 python3 bench/gpu.py
exit $status
