#!/usr/bin/env bash
# The C++ and emulated CUDA kernels under sanitizers; exit status 0 only when every run is
# clean (no report, every test passed).
#
#   tools/check_sanitizers.sh [--quick] [asan] [tsan]     (default: both, the full run)
#
# asan: the CPU extension (posenc_fast._C) built with AddressSanitizer and
#   UndefinedBehaviorSanitizer (POSENC_FAST_SANITIZE=address,undefined: -fsanitize=address,
#   undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -O1 -g, set in
#   posenc_fast/_build_config.py) into a cache of its own (POSENC_FAST_SANITIZE_CACHE,
#   default ~/.cache/posenc_fast-sanitize; the normal build is never touched), then the
#   tests of the "cpp" backend in a Python whose first library is the ASan runtime
#   (LD_PRELOAD). Every op forward and backward, tails of every size class, the FLOATER
#   tape, the contention fallback, hostile inputs at the C++ boundary, 10,000 calls per op
#   (tests/common/test_cpp_tails.py, test_no_leaks.py, test_cpu_runtime.py and the cpp rows
#   of the shared matrices). The full run makes two passes: the best instruction set this
#   CPU has with 2 threads, then the baseline (POSENC_FAST_CPU_ISA=generic) with 1; the
#   tails sweep itself runs every instruction set at 1 and 2 threads in each.
#   Leak detection is off: Python and torch keep memory to the end of the process by design,
#   and LeakSanitizer cannot tell those from ours; test_no_leaks.py bounds the growth instead.
# tsan: the emulation of the CUDA FLOATER kernels (tools/cuda_emulation: one std::thread per
#   CUDA thread, std::barrier for __syncthreads, cluster and grid barriers) built with
#   ThreadSanitizer (pytest's --emulation-cxxflags), running its cases
#   (tests/floater/test_extension_cuda_emulation.py): a data race between threads of a block,
#   blocks of a team or teams, across any barrier, fails the case with the report.
#
# --quick: what CI runs (a few minutes on 2 cores, beside the other compile-only checks):
#   asan: the tails sweep (every op, instruction set, thread count, tape), the CPU runtime's
#   contention fallback and the hostile-input tests, one pass; tsan: the emulator with
#   blocks of 64 threads on one case of each layout (solo, cluster, grid, weights from L2).
#
# Environment: PYTHON (default .venv/bin/python), CXX (default c++: its sanitizer runtimes),
# MAX_JOBS (the ASan build's compile jobs, default 2), POSENC_FAST_SANITIZE_CACHE.
# Reports: printed at the end (ASan / UBSan write them to files, so those of child processes
# are caught too).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-.venv/bin/python}"
CXX="${CXX:-c++}"
QUICK=0
PARTS=()
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    asan | tsan) PARTS+=("$arg") ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "check_sanitizers: unknown argument '$arg' (--quick, asan, tsan)" >&2; exit 2 ;;
  esac
done
((${#PARTS[@]})) || PARTS=(asan tsan)
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT
FAILED=()
SUMMARY=()

# run_pytest VAR=value ... -- pytest arguments: pytest under a sanitizer, -p no:cacheprovider
# (nothing written into the tree), the extension required (a sanitized build that did not
# load must not become skipped tests); no test collected fails too (pytest's status 5)
run_pytest() {
  local envs=()
  while [[ "$1" != -- ]]; do envs+=("$1"); shift; done
  shift
  env POSENC_FAST_REQUIRE_EXTENSION=1 "${envs[@]}" "$PYTHON" -m pytest -q -n 0 -p no:cacheprovider -rfE "$@"
}

# The plumbing must report what it is there to report: a planted heap overflow (ASan), a
# planted signed overflow (UBSan) in a library loaded as the extension is, a planted race
# (TSan) in a program built as the emulator is. Without this a broken preload or option
# would pass every test silently.
canary_asan() {  # $@: the sanitized environment (env ... LD_PRELOAD=...)
  local dir="$LOGS/canary" what
  mkdir -p "$dir"
  cat > "$dir/canary.c" << 'CANARY'
#include <stdlib.h>
int overflow(int n) { int* p = malloc(n * sizeof(int)); int v = p[n]; free(p); return v; }
int add(int a, int b) { return a + b; }
CANARY
  "$CXX" -x c -shared -fPIC -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
    "$dir/canary.c" -o "$dir/canary.so"
  # each planted error must halt the process and be reported: in its log file, or on
  # stderr (gcc 12's UBSan beside ASan prints there whatever log_path says; the test whose
  # process it halts fails and shows it)
  local what report i=0
  for what in "overflow(4)|heap-buffer-overflow" "add(2147483647, 1)|signed integer overflow"; do
    i=$((i + 1))
    report=${what#*|}
    what=${what%|*}
    if "$@" ASAN_OPTIONS="halt_on_error=1:detect_leaks=0:log_path=$dir/asan" \
      UBSAN_OPTIONS="halt_on_error=1:log_path=$dir/ubsan" "$PYTHON" -c \
      "import ctypes; ctypes.CDLL('$dir/canary.so').$what" 2> "$dir/stderr.$i"; then
      echo "check_sanitizers: a planted error ($what) went unreported: the sanitizer plumbing is broken" >&2
      return 1
    fi
    grep -qs -e "$report" "$dir"/asan.* "$dir"/ubsan.* "$dir/stderr.$i" ||
      { echo "check_sanitizers: a planted error ($what) halted without a '$report' report" >&2; return 1; }
  done
  echo "   the plumbing reports a planted heap overflow and a planted signed overflow"
}

canary_tsan() {
  local dir="$LOGS/canary" rc=0
  mkdir -p "$dir"
  cat > "$dir/race.cpp" << 'CANARY'
#include <thread>
int shared = 0;
int main() { std::thread t([] { shared = 1; }); shared = 2; t.join(); return shared == 3; }
CANARY
  "$CXX" -std=c++20 -O1 -pthread -g -fsanitize=thread "$dir/race.cpp" -o "$dir/race"
  TSAN_OPTIONS="halt_on_error=1:exitcode=66" "$dir/race" 2> "$dir/race.log" || rc=$?
  ((rc == 66)) || { echo "check_sanitizers: a planted race went unreported (rc $rc)" >&2; return 1; }
  echo "   the plumbing reports a planted race"
}

reports() {  # the sanitizer reports written under $LOGS/$1*, printed; status 1 if any
  local found=0 f
  for f in "$LOGS/$1".*; do
    [[ -e "$f" ]] || continue
    found=1
    echo "---- $f"
    head -c 20000 "$f"
  done
  return "$found"
}

asan() {
  local start=$SECONDS
  export POSENC_FAST_SANITIZE=address,undefined
  export POSENC_FAST_CACHE="${POSENC_FAST_SANITIZE_CACHE:-$HOME/.cache/posenc_fast-sanitize}"
  echo "== asan: building the CPU extension with ASan + UBSan into $POSENC_FAST_CACHE" \
    "(once per torch and sources; MAX_JOBS=${MAX_JOBS:-2})"
  MAX_JOBS="${MAX_JOBS:-2}" "$PYTHON" -m posenc_fast build --cuda no 2>&1 | grep -v '^  loads here' || true
  local build_s=$((SECONDS - start))
  local libasan libstdcxx
  libasan="$("$CXX" -print-file-name=libasan.so)"
  [[ -f "$libasan" ]] || { echo "check_sanitizers: no ASan runtime ($CXX -print-file-name=libasan.so)" >&2; return 1; }
  # libstdc++ preloaded too: python does not link it, and ASan's interceptor of C++
  # exceptions (__cxa_throw) must find it when the runtime starts, or the first exception
  # a kernel's argument check throws stops the process ("CHECK failed ... real___cxa_throw")
  libstdcxx="$("$CXX" -print-file-name=libstdc++.so)"
  # detect_leaks=0: see the header; halt_on_error: the first report ends the process (and
  # fails its test); log_path: reports of child processes are kept too (ASan's; UBSan's go
  # to the halted process's stderr, see canary_asan).
  local opts="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:log_path=$LOGS/asan"
  local ubopts="halt_on_error=1:print_stacktrace=1:log_path=$LOGS/ubsan"
  canary_asan env LD_PRELOAD="$libasan $libstdcxx" || return 1
  local san=(LD_PRELOAD="$libasan $libstdcxx" ASAN_OPTIONS="$opts" UBSAN_OPTIONS="$ubopts")
  # the sanitized build must be the one that loads
  env "${san[@]}" "$PYTHON" -c "
from posenc_fast import _extension as e
m = e.load()
assert m is not None, '; '.join(e.reasons())
info = m.build_info()
assert info.get('sanitize') == 'address_undefined', info
print('   loaded', e._state['cpu']['origin'], '(isa', m.cpu_isa(), 'of', info['cpu_isa_best'] + ')')
" || { echo "check_sanitizers: the sanitized extension does not load" >&2; return 1; }
  local tests
  if ((QUICK)); then
    tests=(tests/common/test_cpp_tails.py tests/common/test_cpu_runtime.py
      tests/common/test_extension.py -k "bad or empty or noncontiguous or split or recompute")
  else
    tests=(tests/common/test_cpp_tails.py tests/common/test_cpu_runtime.py
      tests/common/test_no_leaks.py tests/common/test_extension.py
      tests/lff/test_cpp_fourier.py tests/rotary/test_cpp_rotary.py
      tests/floater/test_floater_tape.py tests/floater/test_floater.py tests/lff/test_lff.py
      tests/encodings/test_encodings.py tests/rotary/test_rotary.py tests/common/test_fuzz.py
      # the cpp rows and the tests of the extension itself; not the wheel / sdist builds
      # (pip and the compiler under the preloaded runtime: minutes, nothing of ours)
      -k "(cpp or extension or tape or cpu or kernel or isa or thread or tails or leak or grow or fuzz) and not wheel and not sdist and not triton")
  fi
  local rc=0 pass passes=("best ISA, 2 threads|")
  ((QUICK)) || passes+=("baseline ISA, 1 thread|POSENC_FAST_CPU_ISA=generic OMP_NUM_THREADS=1")
  for pass in "${passes[@]}"; do
    local t0=$SECONDS
    echo "== asan: ${pass%%|*}: pytest ${tests[*]}"
    # shellcheck disable=SC2086  # the pass's variables: words on purpose
    run_pytest "${san[@]}" ${pass#*|} -- "${tests[@]}" || rc=1
    echo "   (${pass%%|*}: $((SECONDS - t0)) s)"
  done
  reports asan || rc=1
  reports ubsan || rc=1
  SUMMARY+=("asan+ubsan: $( ((rc)) && echo FAILED || echo clean) in $((SECONDS - start)) s (build $build_s s)")
  return "$rc"
}

tsan() {
  local start=$SECONDS
  # TSan's own options: the first race ends the emulator (rc 66), its report goes to the
  # test's failure message
  # (not the tests that leave a barrier out on purpose: they check the emulator's own race
  # checker, and TSan would stop them first)
  local args=(tests/floater/test_extension_cuda_emulation.py -k "not race_checker")
  if ((QUICK)); then
    # one case of each layout: solo (with a partial tape), a cluster of 2 and one whose
    # weights half stay in L2, a cooperative grid with vectors from L2 and one with many
    # states per team
    args=(tests/floater/test_extension_cuda_emulation.py -k "match_reference and (soloC1-Sg2-smemW-tape2 or clusterC2-Sg2-smemW-tape0 or clusterC3-Sg1-halfW or gridC3-Sg1-l2W-l2X or gridC2-Sg3-halfW)")
  fi
  echo "== tsan: pytest ${args[*]} with the emulator built -fsanitize=thread"
  canary_tsan || return 1
  local rc=0
  run_pytest TSAN_OPTIONS="halt_on_error=1:exitcode=66:second_deadlock_stack=1" -- \
    --emulation-cxxflags="-fsanitize=thread -g" "${args[@]}" || rc=1
  SUMMARY+=("tsan (CUDA emulation): $( ((rc)) && echo FAILED || echo clean) in $((SECONDS - start)) s")
  return "$rc"
}

for part in "${PARTS[@]}"; do
  "$part" || FAILED+=("$part")
done
echo "== check_sanitizers$( ((QUICK)) && echo ' --quick'):"
for line in "${SUMMARY[@]}"; do echo "   $line"; done
if ((${#FAILED[@]})); then
  echo "check_sanitizers: not clean: ${FAILED[*]}" >&2
  exit 1
fi
echo "   every run clean"
