"""Build script for posenc_fast.

The pure-Python package (reference, torch and Triton backends) needs nothing compiled.
The optional C++/CUDA extension (FLOATER integrators, csrc/) is configured by
``posenc_fast_build.py``-style logic below once csrc/ has sources; until then this file
only maps the package layout (metadata lives in pyproject.toml).
"""

from setuptools import setup

setup()
