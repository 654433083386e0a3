#!/usr/bin/env bash
# Create ./.venv and install posenc_fast (editable) with the given extras, e.g.
#   tools/setup_venv.sh test      # what the test suite needs
#   tools/setup_venv.sh bench     # what `python -m posenc_fast bench` needs
# torch comes from constraints.txt (torch==2.13.0: the CPU wheel this kind of machine
# carries), installed first so that nothing pulls the multi-GB CUDA build from the index.
# The install runs without build isolation so that setup.py sees that torch and can build
# the optional C++ extension against it (POSENC_FAST_SKIP_EXTENSION=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0 "setuptools>=64" wheel ninja
.venv/bin/python -m pip install -q -c constraints.txt --no-build-isolation -e ".[${extras}]"
# The test extra also gets timm, pinned, for the integration tests: with --no-deps, because
# its torchvision requirement would pull a multi-GB CUDA build (and PyPI's torchvision does
# not import beside the CPU torch). timm imports none of its other dependencies
# (huggingface_hub, safetensors, pyyaml) at import time; tests/_timm.py stands in for the
# torchvision names that `import timm` needs. It is not in the extra itself, where pip
# would resolve torchvision.
if [[ ",${extras}," == *,test,* || ",${extras}," == *,dev,* ]]; then
    .venv/bin/python -m pip install -q -c constraints.txt --no-deps "timm==1.0.31"
fi
echo "posenc_fast installed in $(pwd)/.venv with extras [${extras}]"
