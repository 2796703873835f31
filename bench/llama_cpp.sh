#!/usr/bin/env bash
# llama.cpp beside tinyserve: build its llama-server for this CPU, convert a Hugging Face checkpoint to GGUF with
# llama.cpp's own converter and quantize it with its own llama-quantize, so bench/serve.py and bench/spec.py can run
# both servers on the same model.
#
#   bash bench/llama_cpp.sh build [DEST]                          # DEST/bin/llama-server (~10 min on 2 cores)
#   bash bench/llama_cpp.sh convert CKPT OUT.gguf [f32|bf16] [--no-mtp] [DEST]
#   bash bench/llama_cpp.sh quantize IN.gguf OUT.gguf [Q4_0|Q8_0|...] [DEST]   # from the f32 GGUF
#
# DEST defaults to ~/.cache/tinyserve/llama.cpp. The source is the llama.cpp that the llama-cpp-python sdist on the
# package index vendors (pinned below: a llama.cpp that knows the qwen35 / qwen3next architectures and MTP), so
# pip is the only download. The converter runs under $PYTHON (default: python3), which needs transformers, torch,
# numpy and sentencepiece (tinyserve's .venv plus `pip install sentencepiece`). A tokenizer the converter does not
# recognise is converted with the qwen2 pre-tokenizer: the benchmarks send token ids, so only the ids matter.
set -euo pipefail
version=0.3.36
cmd=${1:-}
default_dest=${TINYSERVE_LLAMA_CPP:-$HOME/.cache/tinyserve/llama.cpp}
python=${PYTHON:-python3}
[[ $python == */* ]] && python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")"   # the converter runs elsewhere

source_dir() { echo "$1/src/llama_cpp_python-$version/vendor/llama.cpp"; }

fetch_source() {   # DEST: unpack llama-cpp-python's sdist once
  local dest=$1
  [[ -f $(source_dir "$dest")/CMakeLists.txt ]] && return
  mkdir -p "$dest/src"
  "$python" -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$version" -d "$dest/src"
  tar xzf "$dest/src/llama_cpp_python-$version.tar.gz" -C "$dest/src"
}

case $cmd in
  build)
    dest=${2:-$default_dest}
    fetch_source "$dest"
    src=$(source_dir "$dest")
    # GGML_NATIVE: tuned for this CPU's vector units, as a user building it at home would
    cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >"$dest/cmake.log"
    cmake --build "$src/build" --target llama-server llama-bench llama-quantize -j"$(nproc)" >>"$dest/cmake.log"
    mkdir -p "$dest/bin"
    cp -a "$src/build/bin/." "$dest/bin/"
    echo "$dest/bin/llama-server"
    ;;
  convert)
    ckpt=${2:?checkpoint folder} out=${3:?output .gguf}
    outtype=${4:-f32}
    extra=() dest=$default_dest
    for arg in "${@:5}"; do
      if [[ $arg == --* ]]; then extra+=("$arg"); else dest=$arg; fi
    done
    fetch_source "$dest"
    src=$(source_dir "$dest")
    mkdir -p "$(dirname "$out")"
    log="$out.convert.log"
    # the converter refuses a BPE pre-tokenizer it has no hash for; the token ids are what the benchmarks use
    if ! (cd "$src" && "$python" - "$ckpt" --outtype "$outtype" --outfile "$out" "${extra[@]}" <<'EOF'
import runpy
import sys

sys.path[:0] = ["gguf-py", "."]
import conversion.base as base  # noqa: E402

known_pre = base.TextModel.get_vocab_base_pre


def pre_or_qwen2(self, tokenizer):
    try:
        return known_pre(self, tokenizer)
    except NotImplementedError:
        return "qwen2"


base.TextModel.get_vocab_base_pre = pre_or_qwen2
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
EOF
    ) >"$log" 2>&1; then
      echo "conversion failed, see $log" >&2
      exit 1
    fi
    echo "$out"
    ;;
  quantize)
    in=${2:?input .gguf (f32)} out=${3:?output .gguf} type=${4:-Q4_0} dest=${5:-$default_dest}
    [[ -x $dest/bin/llama-quantize ]] || { echo "no $dest/bin/llama-quantize: run 'bash bench/llama_cpp.sh build'" >&2; exit 1; }
    "$dest/bin/llama-quantize" "$in" "$out" "$type" >"$out.quantize.log" 2>&1 || {
      echo "quantization failed, see $out.quantize.log" >&2; exit 1; }
    echo "$out"
    ;;
  *)
    echo "usage: bash bench/llama_cpp.sh build [DEST] | convert CKPT OUT.gguf [f32|bf16] [--no-mtp] [DEST]" \
      "| quantize IN.gguf OUT.gguf [Q4_0|Q8_0|...] [DEST]" >&2
    exit 2
    ;;
esac
