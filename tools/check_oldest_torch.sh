#!/usr/bin/env bash
# The oldest torch the README claims, installed as a new user installs it (CI runs this
# beside the main suite, which runs the newest, unless tools/checked_sources.py has a pass
# recorded for the same package, packaging and tools: `checked_sources.py run oldest-torch`
# runs it and records it):
#
#   tools/check_oldest_torch.sh [--download-only]
#
#   1. a fresh venv (`python -m venv`: the pip and setuptools it brings), then
#      `pip install torch==$OLDEST_TORCH` from the index: its CUDA 12.4 build with the
#      Triton it pins (~3.5 GB; --download-only stops after this, so that CI can start it
#      early, while the main suite runs, and finish later);
#   2. the --no-build-isolation route with the venv's own setuptools (65 on Python 3.11):
#      it must stop at once, with the one line naming setuptools>=77;
#   3. `pip install .`, plain (an isolated build: nothing is compiled ahead);
#   4. `import posenc_fast`;
#   5. the first-use build as users meet it, in that venv: the test of the plain install
#      (tests/common/test_extension_build.py::test_plain_pip_install_builds_on_first_use_
#      then_reuses, run by the checkout's own pytest, $PYTEST_PYTHON): two processes start
#      together, one builds the C++ CPU part against that torch (torch.utils.cpp_extension,
#      through a $CXX that compiles at -O0 without debug information: quicker; the
#      optimised build is the version matrix's), the other waits; later ones reuse the
#      cache; `build` of the CUDA part that cannot be built there (no GPU to build for, or
#      no toolkit) says why; a binary recorded for another torch is refused; no build means
#      the torch fallback with one warning. The main suite skips that test:
#      this is where it runs, on the build this check needs anyway. Then `python -m
#      posenc_fast info` must show the cpp backend available from that cache, without
#      building;
#   6. `python -m posenc_fast verify`: every CPU backend (reference, torch, cpp) of every op
#      against the float64 reference.
# Environment: OLDEST_TORCH (2.5.1), OLDEST_DIR (the venv and cache; default a temporary
# folder, removed at the end unless --download-only or OLDEST_KEEP=1), MAX_JOBS (2),
# PYTEST_PYTHON (a Python with pytest and this checkout's test dependencies; default
# .venv/bin/python, what tools/setup_venv.sh test makes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${OLDEST_TORCH:-2.5.1}"
DIR="${OLDEST_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/posenc-oldest.XXXXXX")}"
export MAX_JOBS="${MAX_JOBS:-2}" PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS
say() { echo "[oldest torch $((SECONDS - start)) s] $*"; }
die() { echo "check_oldest_torch: FAILED: $*" >&2; exit 1; }
DOWNLOAD_ONLY=0
[[ "${1:-}" == --download-only ]] && DOWNLOAD_ONLY=1
if ((!DOWNLOAD_ONLY)) && [[ "${OLDEST_KEEP:-0}" != 1 ]]; then
  trap 'rm -rf "$DIR"' EXIT
fi
py="$DIR/venv/bin/python"

# ------------------------------------------------------------------ 1. torch
if [[ ! -f "$DIR/torch.done" ]]; then
  python3 -m venv "$DIR/venv"
  say "installing torch==$TORCH_VERSION from the index into $DIR/venv"
  "$py" -m pip install -q --no-cache-dir "torch==$TORCH_VERSION" > "$DIR/torch.log" 2>&1 ||
    { tail -20 "$DIR/torch.log"; die "pip install torch==$TORCH_VERSION"; }
  touch "$DIR/torch.done"
  say "torch $("$py" -c 'import torch; print(torch.__version__)'), triton $("$py" -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
fi
((DOWNLOAD_ONLY)) && exit 0

# ------------------------------------------------------------------ 2. --no-build-isolation
old="$("$py" -c 'import setuptools; print(setuptools.__version__)')"
if "$py" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) >= 77)'; then
  out="$(cd "$ROOT" && "$py" -m pip install --no-build-isolation --no-deps . 2>&1 || true)"
  grep -q "posenc_fast: building needs setuptools>=77 (this environment has $old)" <<<"$out" ||
    { echo "$out" | tail -20; die "--no-build-isolation with setuptools $old did not stop with its one line"; }
  say "--no-build-isolation with the venv's setuptools $old: stopped with the line naming setuptools>=77"
else
  say "the venv's setuptools is $old: the --no-build-isolation check does not apply"
fi

# ------------------------------------------------------------------ 3-4. plain install
"$py" -m pip install -q --no-cache-dir "$ROOT" > "$DIR/install.log" 2>&1 ||
  { tail -20 "$DIR/install.log"; die "pip install ."; }
cd "$DIR"  # not the source tree: the installed package
export POSENC_FAST_CACHE="$DIR/cache"
"$py" -c "import posenc_fast, torch; print('import posenc_fast', posenc_fast.__version__, 'on torch', torch.__version__)" ||
  die "import posenc_fast"
say "installed and imported"

# ------------------------------------------------------------------ 5. first-use build
PYTEST_PYTHON="${PYTEST_PYTHON:-$ROOT/.venv/bin/python}"
"$PYTEST_PYTHON" -c "import pytest" 2> /dev/null ||
  die "$PYTEST_PYTHON has no pytest (tools/setup_venv.sh test makes one; or set PYTEST_PYTHON)"
t0=$SECONDS
(cd "$ROOT" && POSENC_FAST_PLAIN_VENV="$DIR/venv" POSENC_FAST_PLAIN_CACHE="$DIR/cache" \
  "$PYTEST_PYTHON" -m pytest -q -n 0 -p no:cacheprovider -rfEs \
  "tests/common/test_extension_build.py::test_plain_pip_install_builds_on_first_use_then_reuses") \
  > "$DIR/build.log" 2>&1 || { tail -40 "$DIR/build.log"; die "the plain install's first-use build test"; }
grep -q "1 passed" "$DIR/build.log" || { tail -20 "$DIR/build.log"; die "the first-use build test did not run"; }
say "the first-use build test passed in $((SECONDS - t0)) s (the C++ CPU part built at -O0 -g0)"
export POSENC_FAST_BUILD=none  # that build, from the cache: nothing rebuilt
"$py" -m posenc_fast info > "$DIR/info.txt" 2>&1 || { cat "$DIR/info.txt"; die "python -m posenc_fast info"; }
grep -q "cpp        available" "$DIR/info.txt" || { cat "$DIR/info.txt"; die "info: the cpp backend is not available"; }

# ------------------------------------------------------------------ 6. verify
"$py" -m posenc_fast verify > "$DIR/verify.txt" 2>&1 || { cat "$DIR/verify.txt"; die "verify"; }
grep -q "^PASS  lff       cpp" "$DIR/verify.txt" || { cat "$DIR/verify.txt"; die "verify did not check the cpp backend"; }
say "verify: $(grep -c '^PASS' "$DIR/verify.txt") lines passed ($(tail -1 "$DIR/verify.txt"))"
say "ok: torch $TORCH_VERSION"
