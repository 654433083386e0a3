#!/usr/bin/env bash
# Build the extension for the GPU machine's software here, on the CPU machine, so that the
# GPU proof (benchmarks/gpu_validate.sh proof) spends none of its 15 minutes compiling.
#
#   tools/prepare_gpu_build.sh            build, check the import, pack into .gpu_build/;
#                                         then the Triton kernels (5.)
#   tools/prepare_gpu_build.sh --check    only check that .gpu_build/ imports and is current
#                                         (the extension and the Triton cache)
#   tools/prepare_gpu_build.sh --sources-sha   print the hash of the sources (see 4.)
#
# The GPU machine (the device tool's H100 / H200) runs Python 3.12, torch 2.11.0+cu130,
# Triton 3.6 and nvcc 13.0 on sm_90. CUDA compiles without a GPU, so this script:
#   1. makes a Python 3.12 venv ($GPU_VENV, default .venv-gpu: git-ignored) with torch
#      $GPU_TORCH (default 2.11.0: PyPI's build for CUDA 13.0, about 3 GB the first time;
#      reused afterwards) — the CPU machine's own venv and torch are not touched;
#   2. builds both modules (_C: CPU kernels, _C_cuda: CUDA kernels for
#      TORCH_CUDA_ARCH_LIST, default 9.0) in a copy of the working tree (tracked and
#      untracked-not-ignored files), so that the build records of this checkout's own
#      build are not overwritten;
#   3. imports both modules against that torch (no GPU needed to load them) and reads
#      their build records;
#   4. packs them into .gpu_build/extension_build.tar.gz (the archive the `build` stage of
#      gpu_validate.sh installs instead of compiling) with .gpu_build/manifest.json: the
#      versions, architectures, git SHA and a hash of the sources it was built from (the
#      `build` stage compiles instead when the sources changed since);
#   5. runs tools/prepare_triton_cache.sh: the Triton kernels the GPU run launches,
#      compiled for sm_90 with that venv's Triton into .gpu_build/triton_cache.tar.gz
#      (PREPARE_TRITON=0 skips it).
# .gpu_build/ is git-ignored; the device call names it in `carry` (benchmarks/README.md).
#
# Environment: GPU_PYTHON (a Python 3.12 interpreter; default: python3.12 on PATH, else
# pyenv's), GPU_TORCH (2.11.0), GPU_VENV (.venv-gpu), TORCH_CUDA_ARCH_LIST (9.0),
# MAX_JOBS (2), CUDA_HOME (/usr/local/cuda: torch's own guess, the folder above the nvcc on
# PATH, is wrong where that nvcc is a wrapper script, as here).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="$ROOT/.gpu_build"
CHECK_ONLY=0
# The hash of what the binary is built from: csrc/, the build configuration and setup.py
# (benchmarks/gpu_validate.sh compares it with the manifest's through --sources-sha).
sources_sha() {
  (cd "$1" && find csrc -type f | LC_ALL=C sort | xargs sha256sum
   sha256sum setup.py posenc_fast/_build_config.py) | sha256sum | cut -d' ' -f1
}
# Copy the working tree's files (tracked and untracked-not-ignored; optionally under the
# pathspecs given) into $1, keeping their paths.
copy_tree() {
  local dest=$1
  shift
  git ls-files -z -co --exclude-standard -- "$@" | while IFS= read -r -d '' f; do
    [[ -e "$f" ]] && cp --parents "$f" "$dest/"
  done
  return 0
}
case "${1:-}" in
  --check) CHECK_ONLY=1 ;;
  --sources-sha) sources_sha "$ROOT"; exit 0 ;;
  -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  "") ;;
  *) echo "prepare_gpu_build: unknown argument '$1' (--check, --help)" >&2; exit 2 ;;
esac
say() { echo "[prepare_gpu_build $(date -u +%T)] $*"; }
die() { echo "prepare_gpu_build: ERROR: $*" >&2; exit 1; }

GPU_TORCH="${GPU_TORCH:-2.11.0}"
GPU_VENV="${GPU_VENV:-$ROOT/.venv-gpu}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"

find_python() {
  if [[ -n "${GPU_PYTHON:-}" ]]; then echo "$GPU_PYTHON"; return; fi
  # a candidate must run: pyenv's shim is on PATH but fails when 3.12 is not selected
  local p
  for p in "$(command -v python3.12 || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [[ -x "$p" ]] && "$p" -c pass >/dev/null 2>&1 && { echo "$p"; return; }
  done
  return 1
}

# ------------------------------------------------------------------ 1. the venv
if [[ ! -x "$GPU_VENV/bin/python" ]]; then
  ((CHECK_ONLY)) && die "no venv $GPU_VENV: run tools/prepare_gpu_build.sh first"
  py="$(find_python)" || die "no Python 3.12 found: set GPU_PYTHON (the GPU machine runs 3.12)"
  say "venv $GPU_VENV from $py"
  "$py" -m venv "$GPU_VENV"
fi
PY="$GPU_VENV/bin/python"
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' ||
  die "$GPU_VENV is not Python 3.12 (the GPU machine's); remove it or set GPU_VENV"
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$GPU_TORCH')" 2>/dev/null; then
  ((CHECK_ONLY)) && die "$GPU_VENV has no torch $GPU_TORCH"
  say "installing torch==$GPU_TORCH (PyPI's CUDA build: several GB the first time) into $GPU_VENV"
  t0=$SECONDS
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==$GPU_TORCH" "setuptools>=77" wheel ninja numpy
  say "torch installed in $((SECONDS - t0)) s"
fi
read -r torch_version torch_cuda < <("$PY" -c "import torch; print(torch.__version__, torch.version.cuda)")
[[ "$torch_cuda" != None ]] || die "torch $torch_version in $GPU_VENV has no CUDA: the GPU build needs PyPI's CUDA build"
say "torch $torch_version (CUDA $torch_cuda), Python $("$PY" -c 'import platform; print(platform.python_version())')"

# ------------------------------------------------------------------ 2. build in a copy
if ((!CHECK_ONLY)); then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  copy_tree "$work"
  say "building in $work for TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} with $MAX_JOBS jobs (the CPU part, then the CUDA part)"
  t0=$SECONDS
  (cd "$work" && POSENC_FAST_BUILD=cuda POSENC_FAST_REQUIRE_EXTENSION=1 \
    "$PY" setup.py -q build_ext --inplace) > "$work/build.log" 2>&1 ||
    { tail -40 "$work/build.log"; die "the build failed (log above)"; }
  build_s=$((SECONDS - t0))
  say "built in ${build_s} s"
  rm -rf "$OUT_DIR"
  mkdir -p "$OUT_DIR"
  files="$(cd "$work/posenc_fast" && ls _C*.so _build_info*.json | tr '\n' ' ')"
  [[ "$files" == *_C_cuda* && "$files" == *_build_info_cuda.json* ]] ||
    die "the CUDA module was not built (files: $files); see $work/build.log"
  # shellcheck disable=SC2086  # file names without spaces, on purpose
  tar -czf "$OUT_DIR/extension_build.tar.gz" -C "$work/posenc_fast" $files
  sha="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
  [[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] || sha="$sha-dirty"
  "$PY" - "$OUT_DIR/manifest.json" "$sha" "$(sources_sha "$work")" "$build_s" $files <<'PY'
import json, platform, sys, time, torch
path, sha, src, secs, *files = sys.argv[1:]
json.dump({
    "git_sha": sha, "sources_sha256": src, "build_seconds": int(secs), "files": files,
    "python": platform.python_version(), "torch": torch.__version__,
    "torch_cuda": torch.version.cuda, "arch_list": __import__("os").environ["TORCH_CUDA_ARCH_LIST"],
    "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
}, open(path, "w"), indent=1)
PY
fi

# ------------------------------------------------------------------ 3. check the import
[[ -f "$OUT_DIR/extension_build.tar.gz" && -f "$OUT_DIR/manifest.json" ]] ||
  die "no $OUT_DIR/extension_build.tar.gz: run tools/prepare_gpu_build.sh"
check="$(mktemp -d)"
copy_tree "$check" posenc_fast triton_kernels
# installed, triton_kernels/ is posenc_fast.triton_kernels (pyproject's package-dir), which
# the dispatcher imports: lay it out that way
mv "$check/triton_kernels" "$check/posenc_fast/triton_kernels"
tar -xzf "$OUT_DIR/extension_build.tar.gz" -C "$check/posenc_fast"
current="$(sources_sha "$ROOT")"
(cd "$check" && "$PY" - "$OUT_DIR/manifest.json" "$current" <<'PY'
import importlib, json, sys
import torch
manifest = json.load(open(sys.argv[1]))
from posenc_fast import _extension
cpu = _extension.load("cpu")
if cpu is None:
    sys.exit(f"the CPU module does not load: {_extension.reasons('cpu')}")
# The CUDA module loads without a GPU (it only registers kernels); the loader itself would
# refuse it here because torch sees no device, so import it directly after the CPU part.
cuda = importlib.import_module("posenc_fast._C_cuda")
record = _extension.extension_build_metadata("cuda") or {}
print(f"   _C: {cpu.__file__.rsplit('/', 1)[-1]} (isa {cpu.cpu_isa()}); "
      f"_C_cuda: {cuda.__file__.rsplit('/', 1)[-1]}, archs {record.get('cuda_archs')}")
if manifest["torch"] != torch.__version__:
    sys.exit(f"built for torch {manifest['torch']}, this venv has {torch.__version__}")
stale = manifest["sources_sha256"] != sys.argv[2]
print(f"   manifest: git {manifest['git_sha']}, torch {manifest['torch']}, python "
      f"{manifest['python']}, arch {manifest['arch_list']}, built {manifest['built']}"
      + ("; STALE: csrc/ or the build configuration changed since" if stale else "; current"))
sys.exit(2 if stale else 0)
PY
) || { rc=$?; rm -rf "$check"; ((rc == 2)) && die "the prebuilt module is stale: rerun tools/prepare_gpu_build.sh"; die "the prebuilt module does not import"; }
rm -rf "$check"

# ------------------------------------------------------------------ 5. the Triton kernels
if ((CHECK_ONLY)); then
  GPU_VENV="$GPU_VENV" "$ROOT/tools/prepare_triton_cache.sh" --check
elif [[ "${PREPARE_TRITON:-1}" != 0 ]]; then
  GPU_VENV="$GPU_VENV" "$ROOT/tools/prepare_triton_cache.sh"
fi
size=$(du -sb "$OUT_DIR" | cut -f1)
say "ok: $OUT_DIR ($size bytes) imports against torch $torch_version; carry it: \"carry\": [\".gpu_build\"]"
