#!/usr/bin/env bash
# Create ./.venv and install posenc_fast (editable) with the given extras, e.g.
#   tools/setup_venv.sh test      # what the test suite needs
#   tools/setup_venv.sh bench     # what `python -m posenc_fast bench` needs
# torch comes from constraints.txt (torch==2.13.0: the CPU wheel this kind of machine
# carries), installed first so that nothing pulls the multi-GB CUDA build from the index.
# The C++ extension is then compiled the way a user's first call compiles it (the
# first-use build into the user cache, ~/.cache/posenc_fast or $POSENC_FAST_CACHE), by
# `python -m posenc_fast build`, with the compiler's progress: one compile, reused by every
# later venv of the same torch and sources, and tested as users get it. Its failure fails
# this script (and so CI); POSENC_FAST_BUILD=none skips it (then a build already in the
# cache is still used).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
rm -f .venv/.setup-done
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0 "setuptools>=77" wheel ninja
# Editable, without build isolation (the torch above, no download of build requirements),
# and without an ahead-of-time build: the step below compiles.
POSENC_FAST_BUILD=none .venv/bin/python -m pip install -q -c constraints.txt \
    --no-build-isolation -e ".[${extras}]"
if [[ "${POSENC_FAST_BUILD:-auto}" != none ]]; then
    .venv/bin/python -m posenc_fast build
fi
# The test extra also gets timm, pinned, for the integration tests: with --no-deps, because
# its torchvision requirement would pull a multi-GB CUDA build (and PyPI's torchvision does
# not import beside the CPU torch). timm imports none of its other dependencies
# (huggingface_hub, safetensors, pyyaml) at import time; tests/_timm.py stands in for the
# torchvision names that `import timm` needs. It is not in the extra itself, where pip
# would resolve torchvision.
if [[ ",${extras}," == *,test,* || ",${extras}," == *,dev,* ]]; then
    .venv/bin/python -m pip install -q -c constraints.txt --no-deps "timm==1.0.31"
fi
touch .venv/.setup-done  # a complete venv (.ci/run's oldest-torch check waits for it)
echo "posenc_fast installed in $(pwd)/.venv with extras [${extras}]"
