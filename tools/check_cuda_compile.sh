#!/usr/bin/env bash
# Compile-only check of the CUDA sources, for CI machines without a GPU (and usually with a
# CPU-only torch, so setup.py builds no CUDA part there):
#   1. nvcc compiles csrc/floater/floater_cuda.cu for every architecture given, in one
#      invocation: the host side once, the device code of each architecture on its own
#      thread (JOBS at a time); a warning or an error fails. Registers, stack, spills and
#      static shared memory of every kernel are printed per architecture, for the log (the
#      integrator's shared memory is dynamic: choose_layout sizes it per problem and device,
#      up to the device's opt-in limit, and reports it in the layout's summary).
#   2. the host glue of the CUDA module posenc_fast._C_cuda (csrc/module_cuda.cpp,
#      csrc/floater/floater_cuda_ops.cpp) is syntax-checked against torch's headers and the
#      toolkit's.
# Nothing is linked or run.
# Usage: tools/check_cuda_compile.sh [arch ...]   (e.g. 80 86 89 90 100 120; default: 90)
# Environment: CUDA_HOME (the toolkit; default $CUDA_PATH, else /usr/local/cuda: not the
# directory above the nvcc on PATH, which may be a wrapper script), NVCC (default
# $CUDA_HOME/bin/nvcc), CXX (default g++), PYTHON (default
# .venv/bin/python when present, else python; must import torch for its include paths),
# JOBS (device compilations in parallel; default: the number of CPUs).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ARCHS=("${@:-90}")
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
CXX="${CXX:-g++}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
TOOLKIT="$(readlink -f "${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}")"
NVCC="${NVCC:-$TOOLKIT/bin/nvcc}"
CUDA_INC="$TOOLKIT/include"
[[ -f "$CUDA_INC/cuda_runtime.h" && -x "$NVCC" ]] ||
  { echo "check_cuda_compile: no CUDA toolkit at $TOOLKIT (set CUDA_HOME)" >&2; exit 2; }
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

echo "== nvcc: $("$NVCC" --version | grep release) (toolkit: $TOOLKIT)"
GENCODE=()
for arch in "${ARCHS[@]}"; do GENCODE+=(-gencode "arch=compute_${arch},code=sm_${arch}"); done
echo "== compiling csrc/floater/floater_cuda.cu for$(printf ' sm_%s' "${ARCHS[@]}") ($JOBS at a time)"
start=$SECONDS
# -Werror all-warnings: a warning in our kernels fails CI (the toolkit headers are clean)
"$NVCC" -std=c++17 -O3 -lineinfo -Werror all-warnings -Xptxas=-v --threads "$JOBS" \
  "${GENCODE[@]}" -I csrc -c csrc/floater/floater_cuda.cu -o "$OUT/floater_cuda.o" \
  2> "$OUT/ptxas.txt" || { cat "$OUT/ptxas.txt" >&2; exit 1; }
echo "   compiled in $((SECONDS - start)) s"
# Per architecture and kernel: registers; stack frame and spills (ptxas -v, demangled).
for arch in "${ARCHS[@]}"; do
  echo "== sm_${arch}: registers, stack, spills and static shared memory per kernel"
  awk -v want="'sm_${arch}'" '
    /Compiling entry function/ { name = $7; on = ($9 == want) }
    on && /spill stores/ { sp = $0; sub(/^ +/, "", sp); spill = $5 + 0 }
    on && /Used [0-9]+ registers/ {
      smem = 0; if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH) + 0
      gsub(/\047/, "", name); print name "\t" $5 " registers;\t" sp ";\t" smem " bytes static smem"
      n++; if ($5 + 0 > regs) regs = $5 + 0
      if (spill > 0) { spilled++; if (spill > most) most = spill } }
    END { printf "summary: %d kernels, at most %d registers, %d with spills (at most %d bytes of spill stores)\n", n, regs, spilled, most }' \
    "$OUT/ptxas.txt" | (c++filt 2>/dev/null || cat) |
    sed -E 's/posenc_fast::floater::cuda::\(anonymous namespace\):://g; s/posenc_fast::floater::cuda::\(anonymous namespace\)::Params<[a-z]+>//g' |
    sed 's/^/   /'
done

echo "== syntax-checking the CUDA module's host code against torch's headers"
mapfile -t TORCH_INC < <("$PYTHON" -c "from torch.utils.cpp_extension import include_paths; print('\n'.join(include_paths()))")
PY_INC="$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
INC=(-I csrc -I "$CUDA_INC" -I "$PY_INC")
for p in "${TORCH_INC[@]}"; do INC+=(-I "$p"); done
# C10_CUDA_NO_CMAKE_CONFIGURE_FILE: a CPU-only torch ships c10/cuda headers without the
# generated cuda_cmake_macros.h, which only defines build switches of libc10_cuda itself.
for src in csrc/module_cuda.cpp csrc/floater/floater_cuda_ops.cpp; do
  "$CXX" -std=c++20 -fsyntax-only -Wall -Werror -Wno-psabi \
    -DPF_CUDA_ARCHS='"9.0"' -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE \
    -DTORCH_EXTENSION_NAME=_C_cuda -DTORCH_API_INCLUDE_EXTENSION_H "${INC[@]}" "$src"
  echo "   ok: $src"
done
echo "== CUDA sources compile"
