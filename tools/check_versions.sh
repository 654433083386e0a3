#!/usr/bin/env bash
# One row of the version matrix: install posenc_fast on a given torch (and the Triton it
# pins, or the one named) in a fresh virtual environment, as a user would, and check it.
#
#   tools/check_versions.sh <torch> [<triton>]        e.g. tools/check_versions.sh 2.5.1
#
# Steps, each recorded in the result line:
#   1. a copy of this checkout (tracked and untracked, not ignored files; a git repository
#      of its own) and a fresh venv in a temporary directory (deleted at the end unless
#      CHECK_KEEP=1);
#   2. pip install torch==<torch> from the index (a CUDA build of several GB for most
#      versions: run one version at a time), and triton==<triton> over the pinned one
#      if given (--no-deps: pip warns that torch pins another);
#   3. pip install --no-build-isolation -e ".[test-core]": the package with its C++
#      extension built against that torch, and the test dependencies except Triton
#      (the `test` extra asks for triton>=3.9, which an older torch's exact pin of
#      Triton forbids: the tests skip what that Triton's interpreter cannot verify, and
#      say why). The extension must build (POSENC_FAST_REQUIRE_EXTENSION=1 unless the
#      caller sets it); other POSENC_FAST_* build variables are passed through and
#      recorded, e.g. POSENC_FAST_NO_CUDA=1;
#   4. import posenc_fast, `python -m posenc_fast info`;
#   5. the test suite (CHECK_PYTEST_ARGS, default: all of it, -q);
#   6. tools/triton_compile_report.py for sm_80 and sm_90
#      (CHECK_COMPILE_ARGS, default --quick: one configuration per kernel; "" for all).
# Appends one tab-separated line to tools/version_matrix.tsv (CHECK_RESULTS overrides)
# and keeps the full log beside it in $CHECK_LOG_DIR (default: the temporary directory,
# printed at the end when kept). CHECK_VENV=<dir> uses that venv (which must have this
# torch) instead of a fresh one. Exit status 0 when every step passed.
set -uo pipefail
if [ $# -lt 1 ]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
torch_version=$1
triton_version=${2:-}
root=$(cd "$(dirname "$0")/.." && pwd)
results=${CHECK_RESULTS:-$root/tools/version_matrix.tsv}
pytest_args=${CHECK_PYTEST_ARGS:--q -p no:cacheprovider}
compile_args=${CHECK_COMPILE_ARGS:---quick}
export MAX_JOBS=${MAX_JOBS:-2}
export POSENC_FAST_REQUIRE_EXTENSION=${POSENC_FAST_REQUIRE_EXTENSION:-1}
start=$SECONDS

work=$(mktemp -d "${TMPDIR:-/tmp}/posenc-versions.XXXXXX")
log=$work/check.log
cleanup() {
    if [ "${CHECK_KEEP:-0}" = 1 ]; then
        echo "kept $work (log: $log)"
    else
        rm -rf "$work"
    fi
}
trap cleanup EXIT
say() { echo "== $*" | tee -a "$log"; }
py=$work/venv/bin/python

say "copy of $root -> $work/src"
mkdir -p "$work/src"
(cd "$root" && git ls-files -z --cached --others --exclude-standard \
    | xargs -0 -I{} find {} -maxdepth 0 -type f -print0 \
    | tar --null -T - -cf -) | tar -C "$work/src" -xf -
sha=$(cd "$root" && git rev-parse --short HEAD)$(cd "$root" && git diff --quiet HEAD || echo "-dirty")
# a git checkout of its own: tests list the package's files with git ls-files
(cd "$work/src" && git init -q && git add -A \
    && git -c user.name=check_versions -c user.email=none commit -qm "copy of $sha") >>"$log" 2>&1

install_ok=1
if [ -n "${CHECK_VENV:-}" ]; then
    # an existing venv that already has this torch (saves the download when iterating)
    say "venv $CHECK_VENV (given), torch==$torch_version"
    py=$CHECK_VENV/bin/python
    $py -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" \
        >>"$log" 2>&1 || install_ok=0
else
    say "venv, torch==$torch_version ${triton_version:+triton==$triton_version}"
    python3 -m venv "$work/venv"
    $py -m pip install -q --no-cache-dir --upgrade pip >>"$log" 2>&1
    $py -m pip install -q --no-cache-dir "torch==$torch_version" "setuptools>=77" wheel ninja \
        >>"$log" 2>&1 || install_ok=0
fi
if [ "$install_ok" = 1 ] && [ -n "$triton_version" ]; then
    $py -m pip install -q --no-cache-dir --no-deps "triton==$triton_version" >>"$log" 2>&1 \
        || install_ok=0
fi
build_flags=$(env | grep -E '^POSENC_FAST_(NO_CUDA|FORCE_CUDA|SKIP_EXTENSION|REQUIRE_EXTENSION)=' \
    | sort | tr '\n' ' ')
build=failed
if [ "$install_ok" = 1 ]; then
    say "pip install --no-build-isolation -e .[test-core]  ($build_flags)"
    if (cd "$work/src" && $py -m pip install -q --no-cache-dir --no-build-isolation \
        -e ".[test-core]") >>"$log" 2>&1; then
        build=$(cd "$work" && $py -c "
from posenc_fast import _extension as e
m = e.load()
print('none' if m is None else ('cpp+cuda' if e.has_cuda() else 'cpp'))" 2>>"$log")
    fi
fi
versions=$(cd "$work" && $py -c "
import sys, torch
try:
    import triton; tv = triton.__version__
except Exception as exc:
    tv = 'none'
try:
    import numpy; nv = numpy.__version__
except Exception:
    nv = 'none'
print(f'{torch.__version__}\t{tv}\t{nv}\t{sys.version.split()[0]}')" 2>>"$log" \
    || printf 'torch %s (not importable)\t?\t?\t?' "$torch_version")

import_ok=no
tests="not run"
compiled=""
if [ "$build" != failed ]; then
    say "import posenc_fast, info"
    if (cd "$work" && $py -c "import posenc_fast" && $py -m posenc_fast info) >>"$log" 2>&1; then
        import_ok=yes
    fi
    say "pytest $pytest_args"
    # shellcheck disable=SC2086
    (cd "$work/src" && timeout 3600 $py -m pytest $pytest_args) >"$work/pytest.log" 2>&1
    cat "$work/pytest.log" >>"$log"
    # pytest's closing line, without its '=' padding and timing
    tests=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped)' "$work/pytest.log" | tail -1 \
        | sed -E 's/=//g; s/ in [0-9.]+s.*//; s/^ +//; s/ +$//')
    tests=${tests:-"no summary (see log)"}
    for arch in 80 90; do
        say "compile_report --arch $arch"
        (cd "$work" && env -u TRITON_INTERPRET TRITON_CACHE_DIR="$work/triton-cache" \
            timeout 1800 $py "$work/src/tools/triton_compile_report.py" --arch "$arch" $compile_args) \
            >"$work/compile_$arch.log" 2>&1
        status=$?
        cat "$work/compile_$arch.log" >>"$log"
        summary=$(grep -E '^sm_[0-9]+: ' "$work/compile_$arch.log" | tail -1)
        compiled+="${summary:-sm_$arch: exit $status (see log)}; "
        [ "$status" = 0 ] || import_ok="$import_ok (compile_report sm_$arch failed)"
    done
fi

elapsed=$((SECONDS - start))
line=$(printf '%s\t%s\t%s\t%s\timport %s\tpytest %s\t%s\t%s\t%s s\t%s' "$(date -u +%Y-%m-%d)" \
    "$versions" "${build_flags:-(defaults)}" "$build" "$import_ok" "$pytest_args" "$tests" \
    "${compiled%; }" "$elapsed" "$sha")
if [ ! -f "$results" ]; then
    printf '%s\t' date torch triton numpy python "build flags" extension import "tests run" \
        "test result" compile_report time >"$results"
    printf 'git\n' >>"$results"
fi
echo "$line" >>"$results"
echo "$line"
if [ -n "${CHECK_LOG_DIR:-}" ]; then
    mkdir -p "$CHECK_LOG_DIR" && cp "$log" "$CHECK_LOG_DIR/torch-$torch_version.log"
fi
case "$tests" in
*failed* | *error* | "not run" | no\ summary*) exit 1 ;;
esac
[ "$import_ok" = yes ] || exit 1
