#!/usr/bin/env bash
# GPU validation of posenc_fast on an NVIDIA H100 / H200: on a fresh machine with the
# source tree (and, for the proof, the extension prebuilt on the CPU machine), in stages
# that each fit a device call.
#
#   benchmarks/gpu_validate.sh [--dry-run] STAGE|PRESET ...     run them, in that order
#   benchmarks/gpu_validate.sh --list                            stages and presets
#   benchmarks/gpu_validate.sh --proof-tests-k                   the proof's pytest -k
#
# THE ONE COMMAND (a GPU is lent rarely, for 15 minutes in all):
#   benchmarks/gpu_validate.sh proof
# validates and measures everything in order of value within 420 s (its own deadline) and
# leaves at most 8 files in $OUT. Prepare it on the CPU machine first:
# tools/prepare_gpu_build.sh (benchmarks/README.md has the exact device call).
#
# Stages (each writes under ${OUT:-./gpu_out}, prints its duration, and appends a line to
# stages.jsonl):
#   build        install the package (pip install --no-build-isolation --no-deps -e .)
#                and the extension: nothing when already built; a carried build
#                (.gpu_build/extension_build.tar.*, made by tools/prepare_gpu_build.sh, or
#                $GPU_BUILD_ARCHIVE) is installed instead of compiling, unless its
#                manifest says csrc/ changed since; otherwise it compiles for sm_90
#                (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16) and records how long that took.
#                Outside the proof, a fresh build is packed into extension_build.tar.gz.
#   tests        the test suite on CUDA (POSENC_FAST_TEST_DEVICE=cuda, the CUDA gate lifted),
#                pytest-xdist when installed -> tests_junit.xml. In the proof: only the
#                tests with the most value per second (PROOF_TESTS below: gradients,
#                determinism, > 2^31 elements, compile / export), --dist loadfile (the
#                > 2^31-element tests of one file run one after the other)
#   tests-large  the tests with more than 2^31 elements, serially -> tests_large_junit.xml
#   verify       python -m posenc_fast verify --device cuda (every op x dtype x backend
#                against float64; also kept in verify.txt for the summary)
#   ceilings     benchmarks/gpu_ceilings.py: copy, fill, bf16 / fp32 matmul -> ceilings.json
#   floater      benchmarks/floater_gpu.py (the FLOATER grid and goals) -> floater_gpu.json
#   lff          benchmarks/lff_gpu.py (LFF and tables vs eager / compile) -> lff_gpu.json
#   rotary       benchmarks/rotary.py --device cuda (LightGlue's rotary and the grid families
#                vs their eager code and torch.compile, float32 and bfloat16) -> rotary_gpu.json
#   bench        python -m posenc_fast bench --device cuda -> bench_cli.json
#   compile      tools/triton_compile_report.py for sm_90 (fails on sin.approx / cos.approx
#                in the PTX) -> compile_report.txt
#   sanitize     benchmarks/gpu_sanitize.py: compute-sanitizer's memcheck over every CUDA
#                and Triton kernel on small shapes, racecheck and synccheck over the CUDA
#                FLOATER integrator in every layout -> sanitize.json
#   summary      benchmarks/summarize_gpu.py over the folder -> summary.json, summary.md
# Presets (one device call each; benchmarks/README.md has the plan):
#          call1 = build tests-large verify tests summary
#          call2 = build ceilings floater summary
#          call3 = build compile lff rotary bench summary
#          proof = build verify tests ceilings lff floater rotary sanitize summary, within 420 s,
#                  limits and arguments of its own (PROOF_LIMIT, proof_args below): LFF
#                  (the memory-bound canonical case, then N = 2^20 F=768 H=256 D=1024 in
#                  bf16, the tables and fused adds, the same in fp32), FLOATER L=1024 S=12
#                  d=H=512, rotary: families then LightGlue (time budget). Files back: gpu_validate.log,
#                  tests_junit.xml, ceilings.json, lff_gpu.json, floater_gpu.json,
#                  rotary_gpu.json, summary.json, summary.md (stages.jsonl and verify.txt
#                  stay in $GPU_VALIDATE_WORK; summary.json holds them)
#          all   = every stage (longer than one 10-minute device call)
# Stages already listed are not repeated, and summary runs last (e.g. "call3 tests-large
# verify" adds those two before the summary).
# Also written: gpu_validate.log (everything printed) and stages.jsonl. A device call
# returns at most 8 files: the presets stay within that.
#
# Time: the whole invocation ends within $GPU_VALIDATE_DEADLINE seconds (default 560; 420
# for the proof): each
# stage gets min(its own limit, what is left, keeping 30 s for summary), is stopped with
# SIGINT at its limit (pytest still writes its junit file; the benchmarks have written
# their JSON after every case), and is skipped when too little is left.
#
# Environment: OUT (output folder), PYTHON (default python3: the one with torch there),
# GIT_SHA (recorded when the tree has no .git), GPU_VALIDATE_DEADLINE, GPU_VALIDATE_WORK
# (the proof's scratch folder, default a fresh temporary one), MAX_JOBS (16),
# TORCH_CUDA_ARCH_LIST (9.0), PYTEST_WORKERS (8; 1 = serial), PYTEST_ARGS, FLOATER_ARGS,
# LFF_ARGS, ROTARY_ARGS, BENCH_ARGS, COMPILE_ARGS (extra arguments of each stage), BUILD_VERBOSE=1.
#
# --dry-run runs every stage in a tiny CPU form (no build, no GPU), so that this script
# and the programs it calls can be tested anywhere (tests/common/test_gpu_scripts.py).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ALL_STAGES=(build tests tests-large verify ceilings floater lff rotary bench compile sanitize summary)
declare -A PRESETS=(
  [call1]="build tests-large verify tests summary"
  [call2]="build ceilings floater summary"
  [call3]="build compile lff rotary bench summary"
  [proof]="build verify tests ceilings lff floater rotary sanitize summary"
  [all]="${ALL_STAGES[*]}"
)
# stage: default time limit, minimum worth starting (seconds)
declare -A LIMIT=([build]=420 [tests]=480 [tests-large]=180 [verify]=120 [ceilings]=90
  [floater]=480 [lff]=300 [rotary]=120 [bench]=240 [compile]=150 [sanitize]=90 [summary]=60)
declare -A MIN_TIME=([build]=60 [tests]=60 [tests-large]=30 [verify]=20 [ceilings]=20
  [floater]=60 [lff]=60 [rotary]=30 [bench]=40 [compile]=30 [sanitize]=30 [summary]=5)
# The proof: 420 s in all, so that one rerun still fits a session's 15 minutes of device
# time. Installing the prebuilt extension and unpacking the Triton cache take ~30 s of the
# build's limit (compiling sm_90 instead, 2-4 min, leaves less to the rest, which the
# deadline cuts in reverse order of value); with the cache, verify and the tests compile
# none of posenc_fast's kernels. compute-sanitizer comes last: the first stage cut.
declare -A PROOF_LIMIT=([build]=240 [verify]=60 [tests]=60 [ceilings]=15 [lff]=115
  [floater]=60 [rotary]=45 [sanitize]=20 [summary]=30)
declare -A PROOF_MIN_TIME=([build]=30 [verify]=20 [tests]=30 [ceilings]=10 [lff]=40
  [floater]=30 [rotary]=25 [sanitize]=15 [summary]=5)
# The proof's tests: one pytest -k term per kind of test worth its seconds on the GPU (the
# dry run checks that each still selects tests, so a rename cannot silently drop a kind).
PROOF_TESTS=(gradcheck gradient determinis 2_31 compile_fullgraph export)
# ... less the CPU-only ones (the C++ kernels, gloo's DDP / FSDP workers) and the slowest
# compile (a whole timm ViT): no GPU value for their seconds
PROOF_TESTS_EXCLUDE=(distributed cpp_ timm)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
short_usage() { echo "usage: benchmarks/gpu_validate.sh [--dry-run] STAGE|PRESET ...  (--list, --help)"; }
die() { echo "gpu_validate: ERROR: $*" >&2; exit 2; }

DRY=0
LIST=0
PRINT_K=0
REQUESTED=()
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --list) LIST=1 ;;
    --proof-tests-k) PRINT_K=1 ;;
    -h | --help) usage; exit 0 ;;
    -*) echo "gpu_validate: unknown option '$arg'" >&2; short_usage >&2; exit 2 ;;
    *) REQUESTED+=("$arg") ;;
  esac
done
proof_tests_k() {  # "(gradcheck or gradient or ...) and not (...)": the proof's selection
  local IFS='|'
  local want="${PROOF_TESTS[*]}" skip="${PROOF_TESTS_EXCLUDE[*]}"
  echo "(${want//|/ or }) and not (${skip//|/ or })"
}
if ((PRINT_K)); then  # (tools/prepare_triton_cache.sh records what these tests launch)
  proof_tests_k
  exit 0
fi
if ((LIST)); then
  echo "stages: ${ALL_STAGES[*]}"
  for p in proof call1 call2 call3 all; do echo "preset $p: ${PRESETS[$p]}"; done
  exit 0
fi
((${#REQUESTED[@]})) || { short_usage >&2; echo "gpu_validate: name at least one stage or preset" >&2; exit 2; }

PROOF=0
for name in "${REQUESTED[@]}"; do [[ "$name" == proof ]] && PROOF=1; done
if ((PROOF)); then
  for s in "${!PROOF_LIMIT[@]}"; do
    LIMIT[$s]=${PROOF_LIMIT[$s]}
    MIN_TIME[$s]=${PROOF_MIN_TIME[$s]}
  done
fi
STAGES=()
add_stage() {
  local s
  for s in "${STAGES[@]:-}"; do [[ "$s" == "$1" ]] && return 0; done
  STAGES+=("$1")
}
for name in "${REQUESTED[@]}"; do
  if [[ -n "${PRESETS[$name]:-}" ]]; then
    for s in ${PRESETS[$name]}; do add_stage "$s"; done
  elif [[ -n "${LIMIT[$name]:-}" ]]; then
    add_stage "$name"
  else
    die "unknown stage or preset '$name' (stages: ${ALL_STAGES[*]}; presets: proof call1 call2 call3 all)"
  fi
done
if [[ " ${STAGES[*]} " == *" summary "* ]]; then  # the summary comes last, after any additions
  ORDERED=()
  for s in "${STAGES[@]}"; do [[ "$s" == summary ]] || ORDERED+=("$s"); done
  STAGES=("${ORDERED[@]}" summary)
fi

PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/gpu_out}"
DEADLINE="${GPU_VALIDATE_DEADLINE:-$( ((PROOF)) && echo 420 || echo 560)}"
[[ "$DEADLINE" =~ ^[0-9]+$ ]] || die "GPU_VALIDATE_DEADLINE must be a number of seconds, got '$DEADLINE'"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/gpu_validate.log"
# A device call brings back at most 8 files: the proof keeps its stage records and the
# verify output in a scratch folder, and summary.json carries them home.
if ((PROOF)); then
  WORK_DIR="${GPU_VALIDATE_WORK:-$(mktemp -d)}"
  mkdir -p "$WORK_DIR"
  WORK_DIR="$(cd "$WORK_DIR" && pwd)"
else
  WORK_DIR="$OUT_DIR"
fi
STAGES_JSONL="$WORK_DIR/stages.jsonl"
STAGE_NOTE=""
# The proof checks, it does not tune: its verify and tests stages offer one Triton
# configuration per shape (one compile each on a fresh machine); the benchmarks autotune.
AUTOTUNE=1
((PROOF)) && AUTOTUNE=0
START=$SECONDS
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if ((DRY)); then
  # a dry run is the same on every machine: CPU tensors, never the test device of a caller
  unset POSENC_FAST_TEST_DEVICE
fi
if [[ -z "${GIT_SHA:-}" ]] && command -v git >/dev/null 2>&1 && git rev-parse HEAD >/dev/null 2>&1; then
  GIT_SHA="$(git rev-parse HEAD)"
  [[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] || GIT_SHA="$GIT_SHA-dirty"
fi
# the benchmark scripts record it (--git-sha): the GPU machine's tree has no .git
SHA_ARG=(--git-sha "${GIT_SHA:-}")
# torch's guess of the CUDA toolkit (the folder above the nvcc on PATH) is wrong where that
# nvcc is a wrapper script outside the toolkit, as on the GPU machine
if [[ -z "${CUDA_HOME:-}" && -f /usr/local/cuda/include/cuda_runtime.h ]]; then
  export CUDA_HOME=/usr/local/cuda
fi
# Every Triton compilation (a hit or a miss of the prepared cache) and every launcher call
# of every stage, written down from outside the package (what `tools/triton_ahead.py run
# --record ... --log ...` does for one command: its start-up hook, first on PYTHONPATH,
# installs the recorder and the compile log in every Python process): the summary counts
# the misses, and the calls are what the next tools/prepare_gpu_build.sh compiles ahead.
export TRITON_AHEAD_LOG="$WORK_DIR/triton_compiles.jsonl"
export TRITON_AHEAD_RECORD="$WORK_DIR/triton_records.jsonl"
export PYTHONPATH="$ROOT/tools/triton_ahead_hooks${PYTHONPATH:+:$PYTHONPATH}"
rm -f "$TRITON_AHEAD_LOG" "$TRITON_AHEAD_RECORD"

exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
trap 'exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null || true' EXIT

# ------------------------------------------------------------------ checks before anything

need_cmd() { command -v "$1" >/dev/null 2>&1 || die "command '$1' not found ($2)"; }
need_py() { "$PYTHON" -c "import $1" >/dev/null 2>&1 || die "Python module '$1' is missing for $PYTHON ($2)"; }
has_stage() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }

need_cmd "$PYTHON" "set PYTHON to the interpreter that has torch"
need_cmd timeout "coreutils"
need_cmd tar "to pack or unpack the extension build"
need_py torch "the GPU machine's image provides it"
if ((!DRY)); then
  need_cmd nvidia-smi "no NVIDIA driver?"
  "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    die "torch ($PYTHON) sees no CUDA device; on a CPU machine use --dry-run"
  if has_stage build; then
    need_cmd nvcc "the CUDA toolkit builds the extension"
    command -v ninja >/dev/null 2>&1 || need_py ninja "torch.utils.cpp_extension builds with ninja"
    need_py setuptools "the build backend (no build isolation: no registry there)"
  fi
  if has_stage tests || has_stage tests-large; then need_py pytest "the test suite"; fi
  if has_stage floater || has_stage tests; then need_py torchdiffeq "the FLOATER baselines"; fi
  if has_stage lff || has_stage compile || has_stage tests; then need_py triton "the Triton kernels"; fi
fi
echo "== gpu_validate $(date -u +%FT%TZ): stages ${STAGES[*]}$( ((DRY)) && echo ' (dry run: CPU)')"
echo "   root $ROOT, output $OUT_DIR, deadline ${DEADLINE} s, python $PYTHON, git ${GIT_SHA:-unknown}"
if ((!DRY)); then nvidia-smi -L || true; fi
"$PYTHON" -c "import sys, torch; print('   python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"

# ------------------------------------------------------------------ helpers

# A dry run checks the plumbing, not the time: on a loaded CPU machine its stages may take
# several times their GPU limits, so its clock runs SLACK times slower (the limits and the
# deadline it records and prints are the GPU run's).
SLACK=1
((DRY)) && SLACK=4
run_limited() { timeout -s INT -k 30 "$((STAGE_LIMIT * SLACK))" "$@"; }

record() {  # stage status rc seconds limit note
  local note="${6//[\"\\]/}"
  printf '{"stage": "%s", "status": "%s", "rc": %s, "seconds": %s, "limit_s": %s, "note": "%s", "dry_run": %s, "git_sha": "%s", "date": "%s"}\n' \
    "$1" "$2" "$3" "$4" "$5" "$note" "$( ((DRY)) && echo true || echo false)" "${GIT_SHA:-unknown}" \
    "$(date -u +%FT%TZ)" >>"$STAGES_JSONL"
}

extension_ready() {  # $1: cuda (the CUDA backend usable from this tree) or cpu (cpp)
  "$PYTHON" - "$1" <<'PY'
import os
import sys

os.environ.setdefault("POSENC_FAST_CUDA_UNVALIDATED", "1")
want = sys.argv[1]
try:
    import posenc_fast
    from posenc_fast import _dispatch, _extension

    if want == "cuda":
        import posenc_fast.triton_kernels  # noqa: F401  (the installed package mapping)
except Exception as exc:
    print(f"   not ready: import failed: {exc!r}")
    sys.exit(1)
tree = os.path.realpath("posenc_fast")
if os.path.dirname(os.path.realpath(posenc_fast.__file__)) != tree:
    print(f"   not ready: posenc_fast imports from {posenc_fast.__file__}, not this tree")
    sys.exit(1)
name = "cuda" if want == "cuda" else "cpp"
reasons = _dispatch.BACKENDS[name].environment_reasons()
if reasons:
    print(f"   not ready: backend {name}: {'; '.join(reasons)}")
    sys.exit(1)
meta = _extension.extension_build_metadata("cuda" if want == "cuda" else "cpu") or {}
print(f"   backend {name} ready (built {meta.get('build_time')}, archs {meta.get('cuda_archs')})")
PY
}

pip_install() {
  local verbose=()
  [[ "${BUILD_VERBOSE:-0}" == 1 ]] && verbose=(-v)
  run_limited "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index "${verbose[@]}" -e .
}

build_dir() {  # the folder of the loaded CPU module: the package's own build (this script's
  # build stage, pip install -e), or the user cache's first-use build (a dry run after
  # tools/setup_venv.sh); posenc_fast where none loads
  "$PYTHON" -c 'import os; from posenc_fast import _extension as e
e.load("cpu"); o = e._state["cpu"]["origin"]; print(os.path.dirname(o) if o else "posenc_fast")'
}

pack_build() {  # $1: archive path (.tar.gz; .tar.xz when gzip is over the 16 MiB limit)
  # both modules (_C: CPU, _C_cuda: CUDA; posenc_fast_C*.so from the cache) and their
  # build records
  local so dir
  dir="$(build_dir)"
  so="$(cd "$dir" && ls *_C*.so _build_info*.json 2>/dev/null | tr '\n' ' ' || true)"
  [[ "$so" == *_C.* && -f "$dir/_build_info.json" ]] || { echo "   no built extension to pack"; return 1; }
  # shellcheck disable=SC2086  # $so: file names without spaces, on purpose
  tar -czf "$1" -C "$dir" $so
  local size
  size=$(stat -c %s "$1")
  if ((size > 16 * 1024 * 1024)) && command -v xz >/dev/null 2>&1; then
    rm -f "$1"
    set -- "${1%.gz}.xz"
    # shellcheck disable=SC2086
    tar -cJf "$1" -C "$dir" $so
    size=$(stat -c %s "$1")
  fi
  if ((size > 16 * 1024 * 1024)); then
    echo "   warning: the packed build is $size bytes, over the 16 MiB a device call returns: dropped"
    rm -f "$1"
    return 0
  fi
  echo "   packed $so into $(basename "$1") ($size bytes); for the next calls:"
  echo "   copy it to .gpu_build/ in the repository (git-ignored) and carry .gpu_build"
}

# ------------------------------------------------------------------ stages

stage_build() {
  if ((DRY)); then
    echo "   [dry run] would run: TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}" \
      "POSENC_FAST_REQUIRE_EXTENSION=1 POSENC_FAST_BUILD=cuda $PYTHON -m pip install" \
      "--no-build-isolation --no-deps --no-index -e ."
    extension_ready cpu || return 1
    local tmp
    tmp="$(mktemp -d)"
    pack_build "$tmp/extension_build.tar.gz" || { rm -rf "$tmp"; return 1; }
    mkdir "$tmp/x"
    tar -xf "$tmp"/extension_build.tar.* -C "$tmp/x"
    ls "$tmp/x" | sed 's/^/   unpacked: /'
    local ok=0
    [[ -f "$tmp/x/_build_info.json" ]] && ls "$tmp/x"/*_C*.so >/dev/null 2>&1 && ok=1
    rm -rf "$tmp"
    ((ok)) || return 1
    if [[ -f .gpu_build/manifest.json ]]; then
      prebuilt_current && echo "   .gpu_build/ is current" || echo "   .gpu_build/ is stale"
    else
      echo "   no .gpu_build/ here (tools/prepare_gpu_build.sh makes it)"
    fi
    triton_cache_setup
    return 0
  fi
  if extension_ready cuda; then
    echo "   the extension is built and loads with CUDA: nothing to build"
    triton_cache_setup
    return 0
  fi
  local carried="${GPU_BUILD_ARCHIVE:-}"
  if [[ -z "$carried" ]]; then
    carried="$(ls .gpu_build/extension_build.tar.* 2>/dev/null | head -1 || true)"
  fi
  if [[ -n "$carried" && -f "$carried" ]] && ! prebuilt_current; then
    echo "   the carried build $carried was made from other sources (csrc/ or the build" \
      "configuration changed since tools/prepare_gpu_build.sh ran): building from source"
    carried=""
  fi
  if [[ -n "$carried" && -f "$carried" ]]; then
    echo "   installing the carried build $carried (editable install without compiling, then the binary)"
    if POSENC_FAST_BUILD=none pip_install && tar -xf "$carried" -C posenc_fast && extension_ready cuda; then
      STAGE_NOTE="prebuilt extension installed ($(manifest_line))"
      triton_cache_setup
      return 0
    fi
    echo "   the carried build does not load here: building from source"
  fi
  echo "   building the extension for TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} with ${MAX_JOBS:-16} jobs"
  local t0=$SECONDS
  TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
    POSENC_FAST_REQUIRE_EXTENSION=1 POSENC_FAST_BUILD=cuda pip_install || return $?
  STAGE_NOTE="compiled from source for TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} with ${MAX_JOBS:-16} jobs in $((SECONDS - t0)) s"
  echo "   $STAGE_NOTE"
  extension_ready cuda || return 1
  triton_cache_setup
  "$PYTHON" -m posenc_fast info | sed -n '1,/^C++/p' || true
  ((PROOF)) || pack_build "$OUT_DIR/extension_build.tar.gz" || true
}

# The Triton kernels compiled ahead on the CPU machine (tools/prepare_gpu_build.sh:
# .gpu_build/triton_cache.tar.gz and its manifest): unpacked into the folder they were
# built in (TRITON_CACHE_DIR, exported for every later stage; the group files' paths are
# rewritten should it differ) and checked against this machine's Triton (its key, ptxas,
# environment): a mismatch only means misses, which the compile log shows.
triton_cache_setup() {
  local archive=.gpu_build/triton_cache.tar.gz manifest=.gpu_build/triton_manifest.json
  local check="$WORK_DIR/triton_cache_check.txt"
  if [[ ! -f "$archive" || ! -f "$manifest" ]]; then
    echo "no Triton cache carried (tools/prepare_gpu_build.sh makes it): kernels compile here" |
      tee "$check"
    return 0
  fi
  local dir
  dir="$("$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))['cache_dir'])" "$manifest")"
  export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$dir}"
  mkdir -p "$TRITON_CACHE_DIR"
  tar -xzf "$archive" -C "$TRITON_CACHE_DIR" || { echo "   the Triton cache does not unpack" | tee "$check"; return 1; }
  "$PYTHON" tools/triton_ahead.py relocate "$TRITON_CACHE_DIR" | sed 's/^/   /'
  local arch=""
  ((DRY)) || arch="--arch $("$PYTHON" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(10 * a + b)')"
  # shellcheck disable=SC2086  # $arch: two words or none
  (unset TRITON_INTERPRET; "$PYTHON" tools/triton_ahead.py check "$manifest" $arch) |
    tee "$check" | sed 's/^/   /'
  STAGE_NOTE="${STAGE_NOTE:+$STAGE_NOTE; }Triton cache: $(tail -1 "$check" | cut -c1-160)"
}

prebuilt_current() {  # .gpu_build/ was made from the sources of this tree
  [[ -f .gpu_build/manifest.json ]] || return 1
  local want
  want="$("$PYTHON" -c "import json; print(json.load(open('.gpu_build/manifest.json'))['sources_sha256'])")" || return 1
  [[ "$want" == "$(bash tools/prepare_gpu_build.sh --sources-sha)" ]]
}

manifest_line() {
  "$PYTHON" -c "import json; m = json.load(open('.gpu_build/manifest.json')); print(f\"made at git {m['git_sha'][:12]} for torch {m['torch']}, python {m['python']}, arch {m['arch_list']}, {m['built']}\")" 2>/dev/null || echo "no manifest"
}

stage_tests() {
  local args=(-q -rfE -p no:cacheprovider --junitxml "$OUT_DIR/tests_junit.xml")
  if ((DRY && PROOF)); then
    # the selection still finds tests of every kind (a rename must not drop one silently);
    # one collection, each term matched as -k matches it (a substring of the test's id)
    local ids term n
    ids="$(run_limited "$PYTHON" -m pytest --collect-only -q -n 0 -p no:cacheprovider tests | grep '::')" ||
      { echo "   collecting the tests failed"; return 1; }
    for term in "${PROOF_TESTS[@]}"; do
      n=$(grep -ci -- "$term" <<<"$ids" || true)
      echo "   proof tests '-k $term': $n tests"
      ((n > 0)) || { echo "   no test matches '$term': update PROOF_TESTS"; return 1; }
    done
    n=$(grep -iE -- "$(IFS='|'; echo "${PROOF_TESTS[*]}")" <<<"$ids" |
      grep -ciEv -- "$(IFS='|'; echo "${PROOF_TESTS_EXCLUDE[*]}")" || true)
    echo "   proof tests in all: $n of $(wc -l <<<"$ids") (-k \"$(proof_tests_k)\")"
  fi
  if ((DRY)); then
    run_limited "$PYTHON" -m pytest "${args[@]}" -n 0 tests/common/test_repository.py -k pins_torch
    return
  fi
  args+=(--durations=25)
  if ((PROOF)); then
    # the kinds of test worth their seconds; the > 2^31-element ones included (their files
    # go to one worker each: --dist loadfile)
    args+=(-k "$(proof_tests_k)")
  else
    args+=(--ignore tests/common/test_large_gpu.py)
    args+=(--deselect tests/common/test_triton.py::test_more_than_2_31_output_elements)
  fi
  local workers="${PYTEST_WORKERS:-8}"
  if ((workers > 1)) && "$PYTHON" -c "import xdist" >/dev/null 2>&1; then
    args+=(-n "$workers" --dist loadfile)
  else
    args+=(-n 0)  # pyproject's addopts ask for -n auto
  fi
  if "$PYTHON" -c "import pytest_timeout" >/dev/null 2>&1; then
    args+=(--timeout "${PYTEST_TIMEOUT:-300}")
  fi
  # shellcheck disable=SC2086  # PYTEST_ARGS: words on purpose
  POSENC_FAST_TRITON_AUTOTUNE=$AUTOTUNE POSENC_FAST_TEST_DEVICE=cuda POSENC_FAST_CUDA_UNVALIDATED=1 \
    run_limited "$PYTHON" -m pytest "${args[@]}" ${PYTEST_ARGS:-}
}

stage_tests_large() {
  local args=(-q -rfEs -n 0 -p no:cacheprovider --junitxml "$OUT_DIR/tests_large_junit.xml")
  if ((DRY)); then
    run_limited "$PYTHON" -m pytest "${args[@]}" tests/common/test_large_gpu.py -k small_size
    return
  fi
  POSENC_FAST_TEST_DEVICE=cuda POSENC_FAST_CUDA_UNVALIDATED=1 run_limited "$PYTHON" -m pytest \
    "${args[@]}" tests/common/test_large_gpu.py tests/common/test_triton.py::test_more_than_2_31_output_elements
}

# verify's op groups, one process each, run side by side: on a fresh GPU machine verify's
# time is Triton compiling its kernels, one core per process (the first H200 run, 2026-11-27:
# ~18 s per LFF dtype; one process reached 11 of its lines in 70 s), and that machine has
# 16 cores. The dry run checks one group (the same code path).
VERIFY_GROUPS=(lff encoding,encoding_nd lff_rotary,apply_lff_rotary floater)
stage_verify() {
  local device=cuda groups=("${VERIFY_GROUPS[@]}")
  if ((DRY)); then device=cpu; groups=(floater); fi
  # one seed for all groups, printed in each part (verify --seed replays it)
  local seed="${VERIFY_SEED:-$(((RANDOM << 15) | RANDOM))}"
  local parts="$WORK_DIR/verify_parts" i rc=0 pids=()
  rm -rf "$parts"
  mkdir -p "$parts"
  for i in "${!groups[@]}"; do
    POSENC_FAST_TRITON_AUTOTUNE=$AUTOTUNE POSENC_FAST_CUDA_UNVALIDATED=1 run_limited "$PYTHON" \
      -m posenc_fast verify --device "$device" --seed "$seed" --ops "${groups[$i]}" \
      >"$parts/$i.txt" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { local r=$?; ((rc == 0 || r == 124)) && rc=$r; }
  done
  # kept beside the log for the summary (verify.txt: one line per op / backend / dtype, the
  # parts in group order; a part cut at the limit has no closing line)
  for i in "${!groups[@]}"; do cat "$parts/$i.txt"; done | tee "$WORK_DIR/verify.txt"
  rm -rf "$parts"
  return "$rc"
}

stage_ceilings() {
  local dry=()
  ((DRY)) && dry=(--dry-run)
  run_limited "$PYTHON" benchmarks/gpu_ceilings.py "${dry[@]}" "${SHA_ARG[@]}" --out "$OUT_DIR/ceilings.json"
}

stage_floater() {
  local budget=$((STAGE_LIMIT - 40))
  ((budget < 30)) && budget=30
  ((PROOF)) && budget=$((STAGE_LIMIT - 15))
  if ((DRY)); then
    run_limited "$PYTHON" benchmarks/floater_gpu.py --dry-run "${SHA_ARG[@]}" --methods rk38 \
      --impls cuda,torchdiffeq,graph --out "$OUT_DIR/floater_gpu.json"
    return
  fi
  local default=""
  # the docs/performance.md case: L=1024, S=12, d=H=512, rk38. Rows, in this order, within 60 s:
  # the subject (its float64 check on 17 sample times; fwd: the cluster integrator; bwd:
  # the adjoint over the GPU tape; bwd without a tape), then the CUDA-graphed loop (fwd,
  # bwd) and torchdiffeq's forward, each skipped when its estimate does not fit. Not here:
  # the adjoint's backward (~18 s a run at this length) and rk4 (the first run spent its
  # 45 s on rk38 and rk4 of the subject and reached no baseline).
  ((PROOF)) && default="--lengths 1024 --states 12 --dims 512 --methods rk38 --impls cuda,graph,torchdiffeq"
  # shellcheck disable=SC2086
  POSENC_FAST_CUDA_UNVALIDATED=1 run_limited "$PYTHON" benchmarks/floater_gpu.py "${SHA_ARG[@]}" \
    --out "$OUT_DIR/floater_gpu.json" --time-budget "$budget" ${FLOATER_ARGS:-$default}
}

# The proof's LFF rows, in order of value (the stage's limit cuts the tail; lff_gpu.py writes
# its JSON after every case): the compute-bound case in bf16, forward and backward, where
# the first run measured 0.60x / 0.04x torch.compile (auto takes the cuBLAS plan there;
# the fused plan beside it); the memory-bound canonical case (auto: the fused pass, retuned);
# <= 64k positions, forward (and its CUDA-graph replay); compute in fp32; the tables and
# fused adds. Each beside eager and torch.compile(default). With one Triton configuration
# per shape (POSENC_FAST_TRITON_AUTOTUNE=0: the first, the retuned one; autotuning ~6
# configurations per shape would spend the stage compiling).
LFF_PROOF_ARGS="--cases compute,canonical,small:fwd,compute-fp32,sinusoidal-table,sinusoidal-add,dft-add --modes fwd,bwd --impls eager,compile,auto,fused"

stage_lff() {
  if ((DRY)); then
    local cases=canonical
    ((PROOF)) && cases=compute,canonical,small:fwd,compute-fp32,sinusoidal-add,dft-add
    run_limited "$PYTHON" benchmarks/lff_gpu.py --dry-run "${SHA_ARG[@]}" --cases "$cases" --modes fwd \
      --impls eager,auto,fused --out "$OUT_DIR/lff_gpu.json"
    return
  fi
  local default="" autotune="${POSENC_FAST_TRITON_AUTOTUNE:-1}"
  ((PROOF)) && default="$LFF_PROOF_ARGS" && autotune=0
  # shellcheck disable=SC2086
  POSENC_FAST_TRITON_AUTOTUNE=$autotune run_limited "$PYTHON" benchmarks/lff_gpu.py "${SHA_ARG[@]}" \
    --out "$OUT_DIR/lff_gpu.json" ${LFF_ARGS:-$default}
}

stage_rotary() {
  if ((DRY)); then
    run_limited "$PYTHON" benchmarks/rotary.py --dry-run "${SHA_ARG[@]}" --out "$OUT_DIR/rotary_gpu.json"
    return
  fi
  # no case begins that would end past the stage's limit less the imports (a cut stage fails)
  local budget=$((STAGE_LIMIT - 9))
  ((budget < 20)) && budget=20
  local default="--dtypes bfloat16,float32"
  # the proof: the grid families first (not yet measured on a GPU), bf16 then fp32, as
  # many as fit (each compiles its torch.compile baseline), then LightGlue's
  ((PROOF)) && default="--cases nd-video,mixed-vit224,axial-vit448,dinov3-vit224,lightglue-2048,vit-1024 --dtypes bfloat16,float32"
  # shellcheck disable=SC2086
  run_limited "$PYTHON" benchmarks/rotary.py --device cuda "${SHA_ARG[@]}" --out "$OUT_DIR/rotary_gpu.json" \
    --time-budget "$budget" ${ROTARY_ARGS:-$default}
}

stage_bench() {
  if ((DRY)); then
    run_limited "$PYTHON" -m posenc_fast bench --device cpu --quick --ops sinusoidal \
      --modes fwd --no-compile --min-time 0.01 --json "$OUT_DIR/bench_cli.json"
    return
  fi
  # FLOATER is floater_gpu.py's; torch.compile baselines are lff_gpu.py's (bench would
  # compile every case twice: minutes)
  # shellcheck disable=SC2086
  POSENC_FAST_CUDA_UNVALIDATED=1 run_limited "$PYTHON" -m posenc_fast bench --device cuda \
    --json "$OUT_DIR/bench_cli.json" ${BENCH_ARGS:---ops lff,sinusoidal,dft --no-compile --min-time 0.1}
}

stage_compile() {
  local report="$OUT_DIR/compile_report.txt"
  if ((DRY)); then
    (unset TRITON_INTERPRET; run_limited "$PYTHON" tools/triton_compile_report.py --help) |
      tee "$report"
    return
  fi
  # shellcheck disable=SC2086
  (unset TRITON_INTERPRET; run_limited "$PYTHON" tools/triton_compile_report.py \
    --arch 90 ${COMPILE_ARGS:---quick}) | tee "$report"
}

stage_sanitize() {
  local dry=()
  ((DRY)) && dry=(--dry-run)
  POSENC_FAST_CUDA_UNVALIDATED=1 run_limited "$PYTHON" benchmarks/gpu_sanitize.py "${dry[@]}" "${SHA_ARG[@]}" \
    --budget "$((STAGE_LIMIT * SLACK - 5))" --out "$WORK_DIR/sanitize.json"  # (the proof: home in summary.json)
  # (SLACK: the dry run's clock, as run_limited's; the budget ran out on a loaded 2-core VM)
}

stage_summary() {
  local extra=()
  ((PROOF)) && extra=("$WORK_DIR")  # the stage records and verify.txt
  # this stage's own record is not written yet: the log has it
  "$PYTHON" benchmarks/summarize_gpu.py "$OUT_DIR" "${extra[@]}" --json "$OUT_DIR/summary.json" \
    --md "$OUT_DIR/summary.md"
}

# ------------------------------------------------------------------ run

FAILED=()
RESULTS=()
BUILD_FAILED=0
for stage in "${STAGES[@]}"; do
  elapsed=$(((SECONDS - START) / SLACK))
  reserve=0
  if [[ "$stage" != summary ]] && has_stage summary; then reserve=30; fi
  left=$((DEADLINE - elapsed - reserve))
  limit=${LIMIT[$stage]}
  ((left < limit)) && limit=$left
  if ((BUILD_FAILED)) && [[ "$stage" != summary ]]; then
    echo "== $stage: skipped (the build failed)"
    record "$stage" skipped null 0 0 "the build failed"
    RESULTS+=("$stage skipped (build failed)")
    continue
  fi
  if ((limit < ${MIN_TIME[$stage]})); then
    echo "== $stage: skipped (deadline: ${left} s left, it needs at least ${MIN_TIME[$stage]} s)"
    record "$stage" skipped null 0 "$limit" "deadline: ${left} s left of ${DEADLINE} s"
    RESULTS+=("$stage skipped (deadline)")
    FAILED+=("$stage")
    continue
  fi
  echo
  echo "== [$(date -u +%T)] stage $stage (limit ${limit} s, ${elapsed} s elapsed)"
  t0=$SECONDS
  rc=0
  STAGE_LIMIT=$limit "stage_${stage//-/_}" || rc=$?
  dt=$((SECONDS - t0))
  if ((rc == 0)); then
    status=ok
  elif ((rc == 124 || dt >= limit * SLACK)); then
    status=timeout
  else
    status=failed
  fi
  echo "== stage $stage: $status (rc $rc) in ${dt} s"
  record "$stage" "$status" "$rc" "$dt" "$limit" "$STAGE_NOTE"
  STAGE_NOTE=""
  RESULTS+=("$stage $status ${dt}s")
  if [[ "$status" != ok ]]; then
    FAILED+=("$stage")
    [[ "$stage" == build ]] && BUILD_FAILED=1
  fi
done

echo
echo "== gpu_validate finished in $((SECONDS - START)) s:"
for r in "${RESULTS[@]}"; do echo "   $r"; done
n_files=$(find "$OUT_DIR" -maxdepth 1 -type f | wc -l)
if ((n_files > 8)); then
  echo "   note: $n_files files in $OUT_DIR; a device call returns at most 8:" \
    "$(cd "$OUT_DIR" && ls | tr '\n' ' ')"
fi
if ((${#FAILED[@]})); then
  echo "   not ok: ${FAILED[*]}"
  exit 1
fi
