#!/usr/bin/env bash
# Build the documentation site (docs/, mkdocs.yml) the way CI checks it:
# `mkdocs build --strict`, so a broken link or anchor, a page missing from the navigation
# or a docstring the API reference cannot parse fails the build. Installs the `docs` extra
# into ./.venv first if it is missing there (~20 s; none of it pulls torch). The site goes
# to ./site (git-ignored) unless another folder is given:
#   tools/check_docs.sh [SITE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
python=.venv/bin/python
[[ -x $python ]] || { echo "no .venv here: run tools/setup_venv.sh first" >&2; exit 1; }
if ! $python -c "import mkdocs, material, mkdocstrings_handlers.python" 2> /dev/null; then
    t0=$SECONDS
    # The extra's requirements as pyproject.toml lists them, not `-e .[docs]`: no
    # reinstall of the package, and constraints.txt keeps the venv's torch.
    mapfile -t reqs < <($python -c 'import tomllib
for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]:
    print(r)')
    $python -m pip install -q -c constraints.txt "${reqs[@]}"
    echo "installed the docs extra in $((SECONDS - t0)) s"
fi
t0=$SECONDS
NO_MKDOCS_2_WARNING=1 $python -m mkdocs build --strict --site-dir "${1:-site}"
echo "mkdocs build --strict passed in $((SECONDS - t0)) s"
