"""Imported by Python at start-up where this folder is first on PYTHONPATH (put there by
``python tools/triton_ahead.py run`` and benchmarks/gpu_validate.sh): where
TRITON_AHEAD_RECORD / TRITON_AHEAD_LOG name files, installs tools/triton_ahead.py's
recorder of launcher calls and its compile log in this process (and so in every child
Python of a run: pytest's workers, verify's parts). Then runs the sitecustomize this one
hides, if any."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_record, _log = os.environ.get("TRITON_AHEAD_RECORD"), os.environ.get("TRITON_AHEAD_LOG")
if _record or _log:
    sys.path.insert(0, os.path.dirname(_here))
    try:
        import triton_ahead

        triton_ahead.install_hooks(record=_record, log=_log)
    finally:
        sys.path.remove(os.path.dirname(_here))

_others = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _others)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
