"""Build script for posenc_fast (metadata lives in pyproject.toml).

The pure-Python package (reference, torch and Triton backends) needs nothing compiled.
The extension (csrc/: every op in C++ for the CPU, the FLOATER integrator in CUDA) ships as
sources in every wheel and sdist (package data posenc_fast/csrc/, mapped from the top-level
csrc/ in pyproject.toml), and is built either
- ahead of time, here, when torch is importable during the build, that is with
  ``pip install --no-build-isolation .`` (or ``-e .``): an isolated build (plain
  ``pip install .``) has no torch, and torch is deliberately not a build requirement (it
  would replace the user's own, and a binary is only valid for the torch it was built
  against); or
- on first use, by posenc_fast/_extension_build.py, against the torch the process runs, into a
  user cache (``python -m posenc_fast build`` does it explicitly). That is what a plain
  ``pip install`` gets, and what replaces an ahead-of-time binary that no longer matches.
pip hides a build backend's output unless ``pip install -v``: the ahead-of-time build's
ninja progress ([n/m] lines) shows only there, the first-use build always shows it.

It is two modules, built independently, so that the CUDA part can never cost the CPU part:
- ``posenc_fast._C``, the C++ CPU kernels ("cpp" backend): built whenever a C++ compiler
  is present ($CXX, else ``c++``). If it fails to build, the install fails (set
  POSENC_FAST_SKIP_EXTENSION=1 to install pure Python): pip must not report success
  without it.
- ``posenc_fast._C_cuda``, the CUDA kernels ("cuda" backend, which needs both): built when
  torch has CUDA and a toolkit of the same major version is found. Nothing here probes a
  GPU. A version mismatch (torch raises it inside build_extensions(), before building
  anything), or a CUDA compile or link error, installs the CPU part with one warning and
  the reason recorded; ``python -m posenc_fast info`` and the "cuda" backend's refusal show
  it.

The toolkit (``find_cuda_toolkit`` in posenc_fast/_build_config.py): $CUDA_HOME, then
$CUDA_PATH (when set but without include/cuda_runtime.h: reported, not guessed past); the
directory above the nvcc on PATH with symlinks resolved, if it has include/cuda_runtime.h
(an nvcc wrapper script such as /usr/local/bin/nvcc is not a toolkit); /usr/local/cuda.
Where torch.utils.cpp_extension guessed another CUDA_HOME, the build uses this one.

Build flags (environment variables)
-----------------------------------
| variable                        | default            | effect                              |
|---------------------------------|--------------------|-------------------------------------|
| POSENC_FAST_SKIP_EXTENSION=1    | unset              | pure-Python install, nothing built  |
| POSENC_FAST_NO_CUDA=1           | unset              | the CPU module only                 |
| POSENC_FAST_FORCE_CUDA=1        | unset              | attempt the CUDA module even where  |
|                                 |                    | the checks say no (torch without    |
|                                 |                    | CUDA, no toolkit, version mismatch) |
| POSENC_FAST_REQUIRE_EXTENSION=1 | unset              | any failure fails the install (CI): |
|                                 |                    | no C++ compiler; a CUDA module that |
|                                 |                    | fails to build; a toolkit pointed at|
|                                 |                    | that cannot be used (CUDA_HOME      |
|                                 |                    | without headers, nvcc wrapper only, |
|                                 |                    | other major version than torch's).  |
|                                 |                    | By default: one warning, CPU only   |
| POSENC_FAST_DEBUG=1             | unset              | -O0 -g (host), -G (device)          |
| POSENC_FAST_SANITIZE=           | unset              | the CPU module with ASan and UBSan  |
|   address,undefined             |                    | (-O1 -g; tools/check_sanitizers.sh):|
|                                 |                    | loads only with libasan preloaded   |
| TORCH_CUDA_ARCH_LIST            | 8.0;8.6;8.9;9.0;   | CUDA targets: A100, A10/RTX 30xx,   |
|                                 | 10.0;12.0+PTX      | L4/L40/RTX 40xx, H100/H200, B200,   |
|                                 | (toolkit and torch | RTX 50xx/RTX PRO 6000; PTX of the   |
|                                 | CUDA >= 12.8; else | newest for later GPUs. Set here when|
|                                 | 8.0;8.6;8.9;9.0+PTX| unset, so that torch does not ask a |
|                                 |                    | GPU for its architecture            |
| MAX_JOBS                        | ninja's            | parallel compile jobs               |
| CUDA_HOME / CUDA_PATH           | found (see above)  | the CUDA toolkit                    |
| CXX                             | c++                | the C++ compiler                    |

Compiler flags (and why)
------------------------
| flag               | where | why                                                       |
|--------------------|-------|-----------------------------------------------------------|
| -O3                | all   | the kernels are loops to unroll and vectorise             |
| -fopenmp           | host  | at::parallel_for is inline OpenMP (ATen/ParallelOpenMP.h);|
|                    |       | the process reuses torch's libgomp (same SONAME)          |
| -ffp-contract=fast | host  | -std=c++17 turns GCC's FMA contraction off; the kernels   |
|                    |       | want fused multiply-adds (one rounding, half the work)    |
| -Wno-psabi         | host  | notes on vector-argument ABIs: vectors never cross calls  |
| (no -march=native) | host  | instruction sets are chosen at run time (csrc/cpu/isa.h;  |
|                    |       | per-set code by target attributes): a wheel runs anywhere |
| (no fast math)     | nvcc  | approximate exp/erf/tanh would break the accuracy goals   |
| -lineinfo          | nvcc  | source lines in profiles, no runtime cost                 |

The sources, flags, toolkit search, CUDA decision, default architectures and the build
records' fields are shared with the opt-in JIT build through ``posenc_fast/_build_config.py``
(torch-free, executed here on its own like ``_version.py``: importing the package would
import torch). Beside the binaries, ``posenc_fast/_build_info.json`` (CPU) and
``_build_info_cuda.json`` (CUDA) record the torch, CUDA and Python versions each was built
for, or why it was not built or failed; ``posenc_fast/_extension_cache.py`` reads them before
loading, so a mismatch is reported instead of crashing.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
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
    path = os.path.join(ROOT, "posenc_fast", "_build_config.py")
    scope: dict = {"__file__": path, "__name__": "posenc_fast_build_config"}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    return scope


_CFG = _load_build_config()


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _sanitize() -> tuple:
    names, problem = _CFG["sanitizers"]()
    if problem:
        raise RuntimeError(f"posenc_fast: {problem}")
    return names


def _plan(torch, cpp_extension) -> dict:
    """What to build (posenc_fast._build_config.plan_build), never asking a GPU."""
    plan = _CFG["plan_build"](
        torch_version=torch.__version__,
        torch_cuda_version=torch.version.cuda,
        debug=_flag("POSENC_FAST_DEBUG"),
        no_cuda="POSENC_FAST_NO_CUDA is set" if _flag("POSENC_FAST_NO_CUDA") else None,
        force_cuda="POSENC_FAST_FORCE_CUDA is set" if _flag("POSENC_FAST_FORCE_CUDA") else None,
        cxx11_abi=getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
        source_root=ROOT,
        sanitize=_sanitize(),
    )
    if plan["cuda"]["build"]:
        note = _CFG["use_toolkit"](cpp_extension, plan["toolkit"])
        if note:
            print(f"posenc_fast: {note}")
    return plan


def _cuda_message(why: str, require: bool) -> str:
    head = f"posenc_fast: the CUDA part of the extension (posenc_fast._C_cuda) is not built: {why}."
    if require:
        return head + " POSENC_FAST_REQUIRE_EXTENSION=1 makes this an error."
    return head + (
        " Installing the C++ CPU part without it; the 'cuda' backend and "
        "`python -m posenc_fast info` report why. Set POSENC_FAST_REQUIRE_EXTENSION=1 to make "
        "this an error, POSENC_FAST_NO_CUDA=1 to silence it."
    )


def _extension_setup() -> dict:
    """setup() keywords for the compiled extension, or {} for a pure-Python install."""
    if _flag("POSENC_FAST_SKIP_EXTENSION"):
        print("posenc_fast: POSENC_FAST_SKIP_EXTENSION is set, installing pure Python")
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except Exception as exc:  # isolated build, or no torch yet
        print(
            f"posenc_fast: torch is not importable in this build ({type(exc).__name__}: {exc}); "
            "installing the package with the C++ sources: the extension is compiled against "
            "the torch it runs with on first use (or by `python -m posenc_fast build`)."
        )
        return {}
    require = _flag("POSENC_FAST_REQUIRE_EXTENSION")
    cxx_path, cxx_why = _CFG["find_cxx"]()
    if cxx_path is None:
        msg = f"posenc_fast: {cxx_why}: installing pure Python (set CXX to build the extension)"
        if require:
            raise RuntimeError(msg + "; POSENC_FAST_REQUIRE_EXTENSION=1 makes this an error")
        print(msg)
        return {}

    plan = _plan(torch, cpp_extension)
    cpu, cuda = plan["cpu"], plan["cuda"]
    print(f"posenc_fast: building the C++ CPU part ({cxx_why})")
    print(f"posenc_fast: CUDA part: {'building' if cuda['build'] else 'not built'} "
          f"({cuda['record']['cuda_decision']})")  # fmt: skip
    skip_warning = None  # the CUDA part is not built, which the user should hear once
    if not cuda["build"] and cuda["warn"]:
        skip_warning = _cuda_message(cuda["record"]["cuda_decision"], require)
        if require:
            raise RuntimeError(skip_warning)

    include = [os.path.join(ROOT, "csrc")]
    exts = [
        cpp_extension.CppExtension(
            name=f"posenc_fast.{cpu['module']}",
            sources=cpu["sources"],
            include_dirs=include,
            extra_compile_args={"cxx": cpu["cxx"]},
            extra_link_args=cpu["ldflags"],
        )
    ]
    if cuda["build"]:
        exts.append(
            cpp_extension.CUDAExtension(
                name=f"posenc_fast.{cuda['module']}",
                sources=cuda["sources"],
                include_dirs=include,
                extra_compile_args={"cxx": cuda["cxx"], "nvcc": cuda["nvcc"]},
            )
        )
    parts = {f"posenc_fast.{plan[p]['module']}": p for p in ("cpu", "cuda")}

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's BuildExtension (ninja) that builds the CPU and the CUDA module
        independently and records how each went beside the binaries. A CUDA failure leaves
        the CPU part installed with one warning (an error with POSENC_FAST_REQUIRE_EXTENSION);
        a CPU failure fails the install: pip must not report success without it."""

        def _record(self, part: str, **fields) -> None:
            out_dir = os.path.dirname(self.get_ext_fullpath(f"posenc_fast.{cpu['module']}"))
            os.makedirs(out_dir, exist_ok=True)
            record = dict(
                plan[part]["record"],
                build_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                how="setup.py (ahead of time)",
            )
            record.update(fields)
            _CFG["write_json_atomic"](os.path.join(out_dir, _CFG["PARTS"][part][1]), record)

        def _cuda_failed(self, ext, exc: BaseException, compiling: bool) -> None:
            error = _CFG["describe_error"](exc)
            self._record("cuda", built=False, error=_CFG["error_record"](error))
            stale = self.get_ext_fullpath(ext.name)  # an earlier build's binary
            if os.path.exists(stale):
                os.remove(stale)
            why = f"building it failed ({_CFG['error_summary'](error)})"
            if compiling:
                why += " (the compiler's messages are in the build output: `pip install -v`)"
            if require:
                raise RuntimeError(_cuda_message(why, require)) from exc
            ext.optional = True  # setuptools then skips copying the missing binary
            warnings.warn(_cuda_message(why, require), stacklevel=1)

        def build_extensions(self):
            if not cuda["build"]:
                self._record("cuda", built=False)
            if skip_warning:  # here, not at plan time: pip runs setup.py several times
                warnings.warn(skip_warning, stacklevel=1)
            self._started = False
            try:
                super().build_extensions()
                return
            except Exception as exc:
                cuda_ext = [e for e in self.extensions if parts[e.name] == "cuda"]
                if self._started or not cuda_ext:
                    raise
                # torch checks the toolkit for all extensions before building any (e.g.
                # its CUDA version against torch's): a CUDA failure; build the CPU part.
                self._cuda_failed(cuda_ext[0], exc, compiling=False)
            self.extensions = [e for e in self.extensions if parts[e.name] == "cpu"]
            super().build_extensions()

        def build_extension(self, ext):
            self._started = True
            part = parts[ext.name]
            try:
                super().build_extension(ext)
            except Exception as exc:
                if part == "cuda":
                    self._cuda_failed(ext, exc, compiling=True)
                    return
                error = _CFG["describe_error"](exc)
                self._record("cpu", built=False, error=_CFG["error_record"](error))
                raise RuntimeError(
                    "posenc_fast: building the C++ CPU part of the extension (posenc_fast._C) "
                    f"failed ({_CFG['error_summary'](error)}; the compiler's output is above, "
                    "`pip install -v` shows it). Set POSENC_FAST_SKIP_EXTENSION=1 to install "
                    "pure Python without it."
                ) from exc
            self._record(part, built=True, binary=os.path.basename(self.get_ext_fullpath(ext.name)))

        def copy_extensions_to_source(self):
            # --inplace / editable: copy the binaries into the source tree, and the records
            # that describe them (also after a failed or skipped build: they say why).
            # Atomically (a new file renamed over the old one): processes that have the old
            # binary mapped keep their inode instead of crashing on a file truncated under
            # them.
            build_py = self.get_finalized_command("build_py")
            pairs = [self._get_inplace_equivalent(build_py, ext)[::-1] for ext in self.extensions]
            src_dir, dst_dir = (os.path.dirname(f) for f in pairs[0])
            for _module, record in _CFG["PARTS"].values():
                pairs.append((os.path.join(src_dir, record), os.path.join(dst_dir, record)))
            for src, dst in pairs:
                if not os.path.exists(src):
                    continue
                tmp = f"{dst}.tmp{os.getpid()}"
                shutil.copy2(src, tmp)
                os.replace(tmp, dst)

    return {
        "ext_modules": exts,
        "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)},
    }


if __name__ == "__main__":  # setuptools' PEP 517 backend runs this file as __main__
    setup(**_extension_setup())
