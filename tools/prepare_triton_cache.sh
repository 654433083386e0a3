#!/usr/bin/env bash
# Compile, here on the CPU machine, the Triton kernels a GPU run will launch, for the GPU
# machine (sm_90, its Triton), so that the proof compiles none of them there.
#
#   tools/prepare_triton_cache.sh           record, compile, pack into .gpu_build/
#   tools/prepare_triton_cache.sh --check   is .gpu_build/'s cache current, and does the
#                                           GPU machine's Triton ($GPU_VENV's) find it?
#   tools/prepare_triton_cache.sh --fresh   start from an empty cache (else incremental)
#
# (tools/prepare_gpu_build.sh runs it after building the extension.) Steps
# (tools/triton_ahead.py explains the mechanism):
#   1. record the launcher calls the proof's correctness stages make, by running them here
#      on CPU tensors under Triton's interpreter ($MAIN_VENV, default .venv: Triton >= 3.9),
#      with POSENC_FAST_TRITON_AUTOTUNE=0 as the proof runs them (`tools/triton_ahead.py run
#      --record`): `verify`, and the proof's
#      selection of tests (benchmarks/gpu_validate.sh --proof-tests-k); add the calls that
#      GPU runs recorded (benchmarks/results/gpu_*/summary.json, "triton" "records");
#   2. compile them, and the Triton paths the proof's benchmarks time (the `triton_calls`
#      of benchmarks/lff_gpu.py and rotary.py, every autotuner configuration), for sm_90
#      with the GPU machine's Triton ($GPU_VENV, Python 3.12: tools/prepare_gpu_build.sh
#      makes it) into $TRITON_CACHE_DIR (default /tmp/posenc_fast-triton-sm90: the GPU run
#      unpacks it to the same absolute path, relocating only if it must);
#   3. pack binaries and metadata into .gpu_build/triton_cache.tar.gz, with
#      .gpu_build/triton_manifest.json: the Triton install's identity (version, key, ptxas,
#      environment), the kernels, the hash of triton_kernels/ it was compiled from.
# Time: ~3 minutes to record, 10-20 minutes to compile from an empty cache on 2 cores
# (seconds when nothing changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="$ROOT/.gpu_build"
MAIN_VENV="${MAIN_VENV:-$ROOT/.venv}"
GPU_VENV="${GPU_VENV:-$ROOT/.venv-gpu}"
ARCH="${GPU_ARCH:-90}"
SM_COUNT="${GPU_SM_COUNT:-132}"
AHEAD="$ROOT/tools/triton_ahead.py"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/posenc_fast-triton-sm$ARCH}"
say() { echo "[prepare_triton_cache $(date -u +%T)] $*"; }
die() { echo "prepare_triton_cache: ERROR: $*" >&2; exit 1; }

kernels_sha() {  # what the cache entries were compiled from
  (cd "$ROOT" && find triton_kernels -name '*.py' | LC_ALL=C sort | xargs sha256sum) |
    sha256sum | cut -d' ' -f1
}

# The package as it is installed (triton_kernels/ is posenc_fast.triton_kernels), for the
# GPU venv, which has no install of it: the kernels' module names are part of their keys.
layout() {
  local dest=$1
  mkdir -p "$dest"
  git ls-files -z -co --exclude-standard -- posenc_fast triton_kernels |
    while IFS= read -r -d '' f; do [[ -e "$f" ]] && cp --parents "$f" "$dest/"; done
  mv "$dest/triton_kernels" "$dest/posenc_fast/triton_kernels"
}

FRESH=0
CHECK_ONLY=0
case "${1:-}" in
  --check) CHECK_ONLY=1 ;;
  --fresh) FRESH=1 ;;
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) die "unknown argument '$1' (--check, --fresh, --help)" ;;
esac
[[ -x "$GPU_VENV/bin/python" ]] || die "no $GPU_VENV: run tools/prepare_gpu_build.sh (it makes the GPU machine's venv)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
layout "$work/pkg"
gpu_py() { (cd "$work" && env -u TRITON_INTERPRET PYTHONPATH="$work/pkg" POSENC_FAST_NO_BUILD=1 "$GPU_VENV/bin/python" "$@"); }

if ((CHECK_ONLY)); then
  [[ -f "$OUT_DIR/triton_cache.tar.gz" && -f "$OUT_DIR/triton_manifest.json" ]] ||
    die "no $OUT_DIR/triton_cache.tar.gz: run tools/prepare_triton_cache.sh"
  gpu_py "$AHEAD" check "$OUT_DIR/triton_manifest.json" ||
    die "the cache was made with another Triton than $GPU_VENV's"
  want="$("$GPU_VENV/bin/python" -c "import json, sys; print(json.load(open(sys.argv[1]))['kernels_sha256'])" "$OUT_DIR/triton_manifest.json")"
  [[ "$want" == "$(kernels_sha)" ]] || die "stale: triton_kernels/ changed since the cache was compiled"
  say "ok: $OUT_DIR/triton_cache.tar.gz is current"
  exit 0
fi

# ------------------------------------------------------------------ 1. record
[[ -x "$MAIN_VENV/bin/python" ]] || die "no $MAIN_VENV (tools/setup_venv.sh test makes it)"
records="$work/records"
mkdir -p "$records"
record() {  # name, command...: run it on the CPU under the interpreter, recording
  local name=$1
  shift
  local t0=$SECONDS
  TRITON_INTERPRET=1 POSENC_FAST_TRITON_AUTOTUNE=0 "$MAIN_VENV/bin/python" "$AHEAD" run \
    --record "$records/$name.jsonl" -- "$@" > "$work/$name.log" 2>&1 ||
    { tail -20 "$work/$name.log"; die "recording $name failed"; }
  say "recorded $name: $(wc -l < "$records/$name.jsonl") calls in $((SECONDS - t0)) s"
}
record verify "$MAIN_VENV/bin/python" -m posenc_fast verify --seed 1
record tests env -u POSENC_FAST_TEST_DEVICE "$MAIN_VENV/bin/python" -m pytest -q -x \
  -p no:cacheprovider tests -k "$(bash benchmarks/gpu_validate.sh --proof-tests-k)"
"$MAIN_VENV/bin/python" - "$records/gpu_runs.jsonl" benchmarks/results/gpu_*/summary.json <<'PY'
import json, sys
out, paths = sys.argv[1], sys.argv[2:]
lines = []
for path in paths:
    try:
        lines += json.load(open(path)).get("triton", {}).get("records", [])
    except (OSError, ValueError):
        pass
open(out, "w").write("".join(line + "\n" for line in lines))
print(f"[prepare_triton_cache] {len(lines)} calls recorded by earlier GPU runs")
PY

# ------------------------------------------------------------------ 2. compile
((FRESH)) && rm -rf "$TRITON_CACHE_DIR"
mkdir -p "$TRITON_CACHE_DIR"
say "compiling for sm_$ARCH with $("$GPU_VENV/bin/python" -c 'import triton; print("Triton", triton.__version__)') into $TRITON_CACHE_DIR"
gpu_py "$AHEAD" compile "$records"/*.jsonl --arch "$ARCH" \
  --sm-count "$SM_COUNT" --benchmarks "$ROOT/benchmarks/lff_gpu.py" "$ROOT/benchmarks/rotary.py" \
  --manifest "$work/manifest.json" || die "some calls did not compile (above)"

# ------------------------------------------------------------------ 3. pack
mkdir -p "$OUT_DIR"
gpu_py "$AHEAD" pack "$TRITON_CACHE_DIR" "$OUT_DIR/triton_cache.tar.gz"
sha="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
[[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] || sha="$sha-dirty"
"$GPU_VENV/bin/python" - "$work/manifest.json" "$OUT_DIR/triton_manifest.json" "$(kernels_sha)" "$sha" <<'PY'
import json, sys
src, dst, kernels_sha, sha = sys.argv[1:]
m = json.load(open(src))
m.update(kernels_sha256=kernels_sha, git_sha=sha)
json.dump(m, open(dst, "w"), indent=1)
PY
say "ok: $OUT_DIR/triton_cache.tar.gz ($(stat -c %s "$OUT_DIR/triton_cache.tar.gz") bytes) for sm_$ARCH; carried with .gpu_build"
