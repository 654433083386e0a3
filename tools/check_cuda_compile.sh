#!/usr/bin/env bash
# Compile-only check of the CUDA sources, for CI machines without a GPU (and usually with a
# CPU-only torch, so setup.py builds no CUDA there):
#   1. nvcc compiles csrc/floater/floater_cuda.cu for sm_90 (H100/H200); a CUDA error fails.
#   2. the host glue that a CUDA build adds (floater_cuda_ops.cpp, module.cpp with
#      POSENC_FAST_WITH_CUDA) is syntax-checked against torch's headers and the toolkit's.
# Nothing is linked or run. Usage: tools/check_cuda_compile.sh [arch ...]  (default: 90)
# Environment: NVCC (default: nvcc on PATH, else $CUDA_HOME/bin/nvcc), CXX (default g++),
# PYTHON (default .venv/bin/python when present, else python; must import torch for its
# include paths).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ARCHS=("${@:-90}")
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
CXX="${CXX:-g++}"
if [[ -z "${NVCC:-}" ]]; then
  if command -v nvcc >/dev/null 2>&1; then NVCC=nvcc
  elif [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then NVCC="$CUDA_HOME/bin/nvcc"
  else echo "check_cuda_compile: no nvcc found (set NVCC or CUDA_HOME)" >&2; exit 2
  fi
fi
CUDA_INC="$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")/include"
[[ -f "$CUDA_INC/cuda_runtime.h" ]] || CUDA_INC="${CUDA_HOME:-/usr/local/cuda}/include"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

echo "== nvcc: $("$NVCC" --version | grep release)"
for arch in "${ARCHS[@]}"; do
  echo "== compiling csrc/floater/floater_cuda.cu for sm_${arch}"
  # -Werror all-warnings: a warning in our kernels fails CI (the toolkit headers are clean)
  "$NVCC" -std=c++17 -O3 -lineinfo -Werror all-warnings -Xptxas=-v \
    -gencode "arch=compute_${arch},code=sm_${arch}" -I csrc \
    -c csrc/floater/floater_cuda.cu -o "$OUT/floater_cuda_sm${arch}.o" 2> "$OUT/ptxas.txt" || {
      cat "$OUT/ptxas.txt" >&2; exit 1; }
  # registers and spills per kernel, for the log
  awk "/Compiling entry function/ {name=\$7} /spill stores/ {sp=\$0} /Used [0-9]+ registers/ {print name, \$5, \"registers;\", sp}" \
    "$OUT/ptxas.txt" | sed -E "s/'//g" | (c++filt 2>/dev/null || cat) | \
    sed -E 's/posenc_fast::floater::cuda::\(anonymous namespace\):://g; s/posenc_fast::floater::cuda::\(anonymous namespace\)::Params<[a-z]+>//g' || true
done

echo "== syntax-checking the CUDA host glue against torch's headers"
mapfile -t TORCH_INC < <("$PYTHON" -c "from torch.utils.cpp_extension import include_paths; print('\n'.join(include_paths()))")
PY_INC="$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
INC=(-I csrc -I "$CUDA_INC" -I "$PY_INC")
for p in "${TORCH_INC[@]}"; do INC+=(-I "$p"); done
# C10_CUDA_NO_CMAKE_CONFIGURE_FILE: a CPU-only torch ships c10/cuda headers without the
# generated cuda_cmake_macros.h, which only defines build switches of libc10_cuda itself.
for src in csrc/floater/floater_cuda_ops.cpp csrc/module.cpp; do
  "$CXX" -std=c++20 -fsyntax-only -Wall -Werror -Wno-psabi \
    -DPOSENC_FAST_WITH_CUDA -DPOSENC_FAST_CUDA_ARCHS='"9.0"' -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE \
    -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H "${INC[@]}" "$src"
  echo "   ok: $src"
done
echo "== CUDA sources compile"
