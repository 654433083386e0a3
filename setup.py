"""Build script for posenc_fast (metadata lives in pyproject.toml; the install routes and
build variables: docs/installation.md).

Every wheel and sdist carries the C++/CUDA sources (posenc_fast/csrc). A plain, isolated
``pip install .`` has no torch here: it compiles nothing, and the first use compiles the
extension against the torch that runs (posenc_fast/_extension.py). Where torch is
importable (``pip install --no-build-isolation .``, a wheel built for one torch), the
extension is compiled here by torch.utils.cpp_extension's BuildExtension, as two modules
(posenc_fast/_build_config.py: sources, flags, POSENC_FAST_BUILD):
- ``posenc_fast._C``, the CPU part: its failure fails the install (pip must not report
  success without it; POSENC_FAST_BUILD=none installs pure Python);
- ``posenc_fast._C_cuda``, the CUDA part: where torch has CUDA and torch finds a toolkit
  (CUDA_HOME). Its failure, torch's check of the toolkit's CUDA version included, installs
  the CPU part with one warning, unless POSENC_FAST_REQUIRE_EXTENSION=1.
Beside the binaries, a build record per part (_build_info.json, _build_info_cuda.json):
what each was built for, which the loader checks before importing it, or why the CUDA part
was not built (pip shows a build's output only with -v; ``python -m posenc_fast info``
shows the record).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import warnings

import setuptools
from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))

# pyproject.toml's `license = "Apache-2.0"` (an SPDX string) needs setuptools >= 77; older
# ones reject it with "project.license must be valid exactly by one definition". A plain
# `pip install` builds in isolation with the setuptools pyproject.toml asks for; with
# --no-build-isolation the environment's own is used (a new Python 3.11 venv has 65), so
# say so first, in one line.
MIN_SETUPTOOLS = (77, 0)
_have = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
if _have < MIN_SETUPTOOLS:
    sys.exit(
        f"posenc_fast: building needs setuptools>=77 (this environment has "
        f"{setuptools.__version__}): `pip install 'setuptools>=77'` first, or install "
        "without --no-build-isolation"
    )


def _load_build_config() -> dict:
    # executed on its own: importing posenc_fast would import torch and the whole package
    path = os.path.join(ROOT, "posenc_fast", "_build_config.py")
    scope: dict = {"__file__": path, "__name__": "posenc_fast_build_config"}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    return scope


CFG = _load_build_config()
HOW = "setup.py (ahead of time)"
REQUIRE_ENV = "POSENC_FAST_REQUIRE_EXTENSION"
ARCH_HINT = "TORCH_CUDA_ARCH_LIST is unset and torch sees no GPU to build for: set it"


def _required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def _describe(exc: BaseException) -> str:
    """``Type: message``, with torch's ``RuntimeError(format, *args)`` (its CUDA version
    check) formatted."""
    args, msg = exc.args, str(exc)
    if len(args) > 1 and isinstance(args[0], str) and "%s" in args[0]:
        with contextlib.suppress(TypeError):  # not a format after all
            msg = args[0] % args[1:]
    return f"{type(exc).__name__}: {msg.strip().splitlines()[0] if msg.strip() else ''}"


def _cuda_message(why: str) -> str:
    head = f"posenc_fast: the CUDA part of the extension (posenc_fast._C_cuda) is not built: {why}."
    if _required():
        return f"{head} {REQUIRE_ENV}=1 makes this an error."
    return (
        f"{head} Installing the C++ CPU part without it; `python -m posenc_fast info` says "
        f"why. {REQUIRE_ENV}=1 makes this an error, POSENC_FAST_BUILD=cpu skips the CUDA part."
    )


def _extension_setup() -> dict:
    """setup() keywords for the compiled extension, or {} for a pure-Python install."""
    choice, refused = CFG["build_choice"]()
    if refused:
        raise RuntimeError(f"posenc_fast: {refused}")
    if choice == "none":
        print("posenc_fast: POSENC_FAST_BUILD=none: installing pure Python")
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # an isolated build, or no torch yet
        print(
            f"posenc_fast: torch is not importable in this build ({type(exc).__name__}: {exc}); "
            "installing the package with the C++ sources: the extension is compiled against "
            "the torch it runs with on first use (or by `python -m posenc_fast build`)."
        )
        return {}
    cxx = (os.environ.get("CXX") or "c++").split()[0]
    if shutil.which(cxx) is None:
        msg = f"posenc_fast: no C++ compiler found ({cxx!r}): installing pure Python"
        if _required():
            raise RuntimeError(f"{msg}; {REQUIRE_ENV}=1 makes this an error")
        print(msg)
        return {}

    if choice == "cpu":
        cuda_skip = "POSENC_FAST_BUILD=cpu"
    elif choice == "auto" and torch.version.cuda is None:
        cuda_skip = f"torch {torch.__version__} is built without CUDA"
    elif choice == "auto" and cpp_extension.CUDA_HOME is None:
        cuda_skip = "torch.utils.cpp_extension finds no CUDA toolkit (set CUDA_HOME)"
    else:
        cuda_skip = None
    print(f"posenc_fast: building the C++ CPU part; the CUDA part: {cuda_skip or 'building'}")
    include = [os.path.join(ROOT, "csrc")]
    exts = [
        cpp_extension.CppExtension(
            name="posenc_fast._C",
            sources=list(CFG["SOURCES"]["cpu"]),
            include_dirs=include,
            extra_compile_args={"cxx": CFG["CXX_FLAGS"]},
            extra_link_args=CFG["LD_FLAGS"],
        )
    ]
    cuda_error = None  # the CUDA part failed before its build (said at build time)
    if cuda_skip is None:
        try:
            exts.append(
                cpp_extension.CUDAExtension(
                    name="posenc_fast._C_cuda",
                    sources=list(CFG["SOURCES"]["cuda"]),
                    include_dirs=include,
                    extra_compile_args={"cxx": CFG["CXX_FLAGS"], "nvcc": CFG["NVCC_FLAGS"]},
                )
            )
        except Exception as exc:  # e.g. no CUDA_HOME: torch cannot name its libraries
            cuda_error = exc
    part_of = {"posenc_fast._C": "cpu", "posenc_fast._C_cuda": "cuda"}

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's BuildExtension that builds the CPU and the CUDA module independently and
        writes each one's build record beside the binaries."""

        def _record(self, part: str, **fields) -> None:
            out_dir = os.path.dirname(self.get_ext_fullpath("posenc_fast._C"))
            os.makedirs(out_dir, exist_ok=True)
            record = CFG["record"](torch, part, ROOT, HOW, **fields)
            CFG["write_record"](os.path.join(out_dir, CFG["RECORDS"][part]), record)

        def _cuda_failed(self, ext, exc: BaseException) -> None:
            error = _describe(exc)
            if isinstance(exc, IndexError) and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
                error += f" ({ARCH_HINT})"  # torch's empty list of visible GPUs
            self._record("cuda", built=False, error=error)
            stale = self.get_ext_fullpath("posenc_fast._C_cuda")  # an earlier build's binary
            if os.path.exists(stale):
                os.remove(stale)
            if _required():
                raise RuntimeError(_cuda_message(f"building it failed ({error})")) from exc
            if ext is not None:
                ext.optional = True  # setuptools then skips copying the missing binary
            warnings.warn(_cuda_message(f"building it failed ({error})"), stacklevel=1)

        def build_extensions(self):
            if cuda_skip:
                self._record("cuda", built=False, error=cuda_skip, cuda_archs=None)
            if cuda_error is not None:
                self._cuda_failed(None, cuda_error)
            self._started = False
            try:
                super().build_extensions()
                return
            except Exception as exc:
                cuda_ext = [e for e in self.extensions if part_of[e.name] == "cuda"]
                if self._started or not cuda_ext:
                    raise
                # torch checks the toolkit (its CUDA version against torch's) before
                # building anything: a CUDA failure; build the CPU part alone
                self._cuda_failed(cuda_ext[0], exc)
            self.extensions = [e for e in self.extensions if part_of[e.name] == "cpu"]
            super().build_extensions()

        def build_extension(self, ext):
            self._started = True
            part = part_of[ext.name]
            try:
                super().build_extension(ext)
            except Exception as exc:
                if part == "cuda":
                    self._cuda_failed(ext, exc)
                    return
                self._record("cpu", built=False, error=_describe(exc))
                raise RuntimeError(
                    "posenc_fast: building the C++ CPU part of the extension (posenc_fast._C) "
                    f"failed ({_describe(exc)}; the compiler's output is above, `pip install "
                    "-v` shows it). POSENC_FAST_BUILD=none installs pure Python without it."
                ) from exc
            self._record(part, built=True, binary=os.path.basename(self.get_ext_fullpath(ext.name)))

        def copy_extensions_to_source(self):
            # editable installs (and --inplace): the records travel with the binaries
            super().copy_extensions_to_source()
            build_py = self.get_finalized_command("build_py")
            src = os.path.join(self.build_lib, "posenc_fast")
            dst = build_py.get_package_dir("posenc_fast")
            for name in CFG["RECORDS"].values():
                if os.path.exists(os.path.join(src, name)):
                    shutil.copy2(os.path.join(src, name), os.path.join(dst, name))

    return {
        "ext_modules": exts,
        "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)},
    }


if __name__ == "__main__":  # setuptools' PEP 517 backend runs this file as __main__
    setup(**_extension_setup())
