#!/usr/bin/env bash
# Compile-only check of the C++ CPU module (posenc_fast._C) for aarch64 (AWS Graviton, Ampere,
# Apple Silicon under Linux), for CI machines that are x86-64: every CPU source of
# posenc_fast/_build_config.py (SOURCES["cpu"]) is compiled (-c, nothing linked or run) by
# Debian's cross compiler with the flags of the real build (CXX_FLAGS, the C++ standard and
# defines that torch.utils.cpp_extension adds) plus -march=armv8-a, the baseline every
# aarch64 CPU has. A warning or an error fails.
#
# What is checked: on aarch64 the x86 instruction-set dispatch (cpu/isa.h, cpu/per_isa.h,
# FLOATER's target attributes) is compiled out and every kernel compiles on its portable
# path (GNU vectors of 16 bytes = one NEON register, NEON's fused multiply-add and floor in
# cpu/simd.h). What is not: running it (no aarch64 machine here), linking against an aarch64
# libtorch.
#
# Headers: torch's include directories of the installed (x86-64) torch wheel. They are the
# same files in the aarch64 wheels (nothing architecture-specific is generated into them
# beyond build switches: no CUDA, no XPU), so a compile against them finds what an aarch64
# build would. Python.h: the host's; its pyconfig.h was generated for x86-64 Linux, which
# has the same type sizes as aarch64 Linux (LP64, 8-byte long and pointers, little-endian),
# so nothing the extension sees differs.
#
# Usage: tools/check_cpu_compile_aarch64.sh
# Environment: CXX_AARCH64 (default aarch64-linux-gnu-g++), PYTHON (default .venv/bin/python
# when present, else python; must import torch), JOBS (compilations in parallel, default 2),
# MARCH (default armv8-a).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
CXX_AARCH64="${CXX_AARCH64:-aarch64-linux-gnu-g++}"
JOBS="${JOBS:-2}"
MARCH="${MARCH:-armv8-a}"
if ! command -v "$CXX_AARCH64" > /dev/null; then
  echo "check_cpu_compile_aarch64: no aarch64 cross compiler '$CXX_AARCH64' on PATH" >&2
  echo "  (Debian/Ubuntu: apt-get install -y g++-aarch64-linux-gnu; or set CXX_AARCH64)" >&2
  exit 2
fi

# Sources and flags from the build config (read on its own, as setup.py reads it); include
# paths, the C++ standard and the libstdc++ ABI from the installed torch, as its
# cpp_extension passes them to the real build.
mapfile -t CFG < <("$PYTHON" - << 'EOF'
import re
import runpy
import sysconfig

import torch
import torch.utils.cpp_extension as ext

cfg = runpy.run_path("posenc_fast/_build_config.py")
print(" ".join(cfg["SOURCES"]["cpu"]))
print(" ".join(cfg["CXX_FLAGS"]))
print(" ".join(ext.include_paths() + [sysconfig.get_paths()["include"]]))
# The standard torch.utils.cpp_extension passes for this torch (c++17 before 2.10, c++20 since)
with open(ext.__file__) as f:
    stds = re.findall(r"'-std=(c\+\+\d\d)'", f.read())
print(max(stds, key=lambda s: int(s[3:])) if stds else "c++17")
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__)
EOF
)
read -r -a SOURCES <<< "${CFG[0]}"
read -r -a FLAGS <<< "${CFG[1]}"
read -r -a INCDIRS <<< "${CFG[2]}"
STD="${CFG[3]}"
ABI="${CFG[4]}"
INC=(-I csrc)
for p in "${INCDIRS[@]}"; do INC+=(-I "$p"); done
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

echo "== $("$CXX_AARCH64" --version | head -1), -march=$MARCH, -std=$STD, torch ${CFG[5]} headers"
echo "== compiling ${#SOURCES[@]} CPU sources for aarch64 ($JOBS at a time): ${FLAGS[*]}"
start=$SECONDS
# -fPIC, -DTORCH_API_INCLUDE_EXTENSION_H, -DTORCH_EXTENSION_NAME: as torch's build adds them
# (setup.py and the JIT build name the module _C). -Werror: a warning fails, as nvcc's does.
printf '%s\n' "${SOURCES[@]}" | xargs -P "$JOBS" -I{} sh -c '
  src="$1"; shift
  obj="'"$OUT"'/$(basename "$src" .cpp).o"
  if "$@" -c "$src" -o "$obj" 2> "$obj.log"; then echo "   ok: $src"
  else cat "$obj.log" >&2; echo "   FAILED: $src" >&2; exit 1; fi' _ {} \
  "$CXX_AARCH64" "${FLAGS[@]}" -march="$MARCH" -std="$STD" -fPIC -Wall -Werror \
  -D_GLIBCXX_USE_CXX11_ABI="$ABI" -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C \
  "${INC[@]}" || { echo "check_cpu_compile_aarch64: the CPU sources do not compile for aarch64" >&2; exit 1; }
# Every object is AArch64 code (not, by a mix-up of compilers, the host's); needs file(1).
if command -v file > /dev/null; then
  for obj in "$OUT"/*.o; do
    file -b "$obj" | grep -q "ARM aarch64" ||
      { echo "check_cpu_compile_aarch64: $obj is not aarch64 code: $(file -b "$obj")" >&2; exit 1; }
  done
fi
echo "== CPU sources compile for aarch64 in $((SECONDS - start)) s"
