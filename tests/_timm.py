"""Importing the real timm in the tests, where torchvision cannot be installed.

timm 1.0 imports torchvision at import time (FrozenBatchNorm2d for its ResNet utilities;
datasets and transforms in timm.data), although its VisionTransformer and Attention never
use it. torchvision cannot be installed here: PyPI's build fails to import beside the CPU
torch ("operator torchvision::nms does not exist") and the matching build is a multi-GB
CUDA download. So, only while ``import timm`` runs, and only where torchvision is missing,
the names timm imports from torchvision resolve to stand-in classes that raise if they are
ever used; afterwards no torchvision module is left in sys.modules. Everything tested is
timm's own code. With torchvision installed, nothing is stood in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest

REASON = (
    "timm is not installed (tools/setup_venv.sh test installs timm==1.0.31 with --no-deps; "
    "CI runs these tests)"
)


class _Unavailable(type):
    """Metaclass of the stand-ins: any attribute of one (InterpolationMode.BILINEAR) is
    another stand-in, so module-level tables in timm.data can be built."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{cls.__name__}.{name}")


def _stand_in(name: str) -> type:
    def fail(*args, **kwargs):
        raise RuntimeError(f"torchvision is not installed: {name} is a stand-in (tests/_timm.py)")

    return _Unavailable(name, (), {"__init__": fail, "__call__": fail})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision" and not fullname.startswith("torchvision."):
            return None
        if fullname.startswith("torchvision.models"):
            return None  # timm's optional FX feature extraction: let it see torchvision missing
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def import_timm():
    """The real timm, or pytest.skip(REASON) where it is not installed."""
    if "timm" in sys.modules:
        return sys.modules["timm"]
    if importlib.util.find_spec("timm") is None:
        pytest.skip(REASON)
    if importlib.util.find_spec("torchvision") is not None:
        import timm

        return timm
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        import timm
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    return timm


def timm_available() -> bool:
    try:
        import_timm()
    except pytest.skip.Exception:
        return False
    return True
