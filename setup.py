"""Build script for posenc_fast (metadata lives in pyproject.toml).

The pure-Python package (reference, torch and Triton backends) needs nothing compiled.
The optional extension ``posenc_fast._C`` (csrc/: the FLOATER integrator in C++ for the
CPU and in CUDA) is built ahead of time when torch is importable during the build, that is
with ``pip install --no-build-isolation .`` (or ``-e .``): an isolated build has no torch,
and torch is deliberately not a build requirement (it would replace the user's own).
Nothing here probes a GPU: whether CUDA is built depends on torch and the toolkit only.

Build flags (environment variables)
-----------------------------------
| variable                        | default             | effect                              |
|---------------------------------|---------------------|-------------------------------------|
| POSENC_FAST_SKIP_EXTENSION=1    | unset               | pure-Python install, nothing built  |
| POSENC_FAST_FORCE_CUDA=1        | unset               | the CUDA part must be built: fail   |
|                                 |                     | if torch lacks CUDA or no toolkit   |
| POSENC_FAST_NO_CUDA=1           | unset               | C++ CPU kernels only                |
| POSENC_FAST_REQUIRE_EXTENSION=1 | unset               | a failed build fails the install    |
|                                 |                     | (CI); by default: warn, pure Python |
| POSENC_FAST_DEBUG=1             | unset               | -O0 -g (host), -G (device)          |
| TORCH_CUDA_ARCH_LIST            | 8.0;8.6;8.9;9.0+PTX | CUDA targets (9.0: H100/H200); set  |
|                                 |                     | here when unset, so that torch does |
|                                 |                     | not ask a GPU for its architecture  |
| MAX_JOBS                        | ninja's             | parallel compile jobs               |
| CUDA_HOME                       | found by torch      | the CUDA toolkit                    |

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
| (no -march=native) | host  | instruction sets are chosen at run time (target attributes|
|                    |       | in csrc/floater/floater_cpu.cpp): a wheel runs anywhere   |
| (no fast math)     | nvcc  | approximate exp/erf/tanh would break the accuracy goals   |
| -lineinfo          | nvcc  | source lines in profiles, no runtime cost                 |

The sources, flags, default architectures and the build metadata's fields are shared with
the opt-in JIT build through ``posenc_fast/_build_config.py`` (torch-free, executed here on
its own like ``_version.py``: importing the package would import torch).
Beside the binary, ``posenc_fast/_build_info.json`` records the torch, CUDA and Python
versions it was built for (or why the build failed); ``posenc_fast/_extension.py`` reads it
before loading, so a mismatch is reported instead of crashing.
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
import warnings

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_config() -> dict:
    path = os.path.join(ROOT, "posenc_fast", "_build_config.py")
    scope: dict = {"__file__": path, "__name__": "posenc_fast_build_config"}
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), scope)
    return scope


_CFG = _load_build_config()
BUILD_INFO = _CFG["BUILD_INFO"]


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _cuda_decision(torch, cpp_extension) -> tuple[bool, str]:
    """(build CUDA?, why) from torch and the toolkit only: never asks a GPU."""
    if _flag("POSENC_FAST_NO_CUDA"):
        return False, "POSENC_FAST_NO_CUDA is set"
    ok, why = _CFG["cuda_availability"](
        torch.__version__, torch.version.cuda, cpp_extension.CUDA_HOME
    )
    if not ok and _flag("POSENC_FAST_FORCE_CUDA"):
        raise RuntimeError("POSENC_FAST_FORCE_CUDA=1 but " + why)
    return ok, why


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
            "installing pure Python. Build the C++/CUDA extension with "
            "`pip install --no-build-isolation .` in an environment that has torch."
        )
        return {}

    with_cuda, cuda_why = _cuda_decision(torch, cpp_extension)
    debug = _flag("POSENC_FAST_DEBUG")
    cxx = _CFG["cxx_flags"](debug)
    nvcc = _CFG["nvcc_flags"](debug)
    define_macros = []
    sources = list(_CFG["CPU_SOURCES"])
    archs = None
    if with_cuda:
        archs = _CFG["resolve_cuda_archs"]()
        sources += _CFG["CUDA_SOURCES"]
        define_macros += [("POSENC_FAST_WITH_CUDA", None), ("POSENC_FAST_CUDA_ARCHS", f'"{archs}"')]
        ext_cls = cpp_extension.CUDAExtension
        extra = {"cxx": cxx, "nvcc": nvcc}
    else:
        ext_cls = cpp_extension.CppExtension
        extra = {"cxx": cxx}
    what = "C++ and CUDA" if with_cuda else "C++ CPU only"
    print(f"posenc_fast: building the extension ({what}: {cuda_why})")

    ext = ext_cls(
        name="posenc_fast._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define_macros,
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
    )
    meta = _CFG["build_metadata"](
        torch_version=torch.__version__,
        torch_cuda_version=torch.version.cuda,
        with_cuda=with_cuda,
        cuda_decision=cuda_why,
        cuda_home=cpp_extension.CUDA_HOME,
        cuda_archs=archs,
        debug=debug,
        cxx=cxx,
        nvcc=nvcc,
    )
    require = _flag("POSENC_FAST_REQUIRE_EXTENSION")

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's BuildExtension (ninja) that records build metadata beside the binary and,
        unless POSENC_FAST_REQUIRE_EXTENSION is set, turns a failed build into a warning."""

        def build_extension(self, ext):
            out_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
            os.makedirs(out_dir, exist_ok=True)
            info_path = os.path.join(out_dir, BUILD_INFO)
            record = dict(meta, built=False, build_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
            try:
                super().build_extension(ext)
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
                _CFG["write_json_atomic"](info_path, record)
                if require:
                    raise
                # setuptools then skips copying the missing binary (editable installs)
                ext.optional = True
                traceback.print_exc()
                warnings.warn(
                    "posenc_fast: building the C++/CUDA extension failed; installing without it "
                    "(the 'cpp' and 'cuda' backends will report why). "
                    "Set POSENC_FAST_REQUIRE_EXTENSION=1 to make this an error.",
                    stacklevel=1,
                )
                return
            record["built"] = True
            record["binary"] = os.path.basename(self.get_ext_fullpath(ext.name))
            _CFG["write_json_atomic"](info_path, record)

        def copy_extensions_to_source(self):
            # --inplace / editable: copy the binary into the source tree, and the metadata
            # that describes it (also after a failed build: it says why). Atomically (a new
            # file renamed over the old one): processes that have the old binary mapped
            # keep their inode instead of crashing on a file truncated under them.
            build_py = self.get_finalized_command("build_py")
            for ext in self.extensions:
                inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
                pairs = [(regular_file, inplace_file)]
                pairs.append(
                    (
                        os.path.join(os.path.dirname(regular_file), BUILD_INFO),
                        os.path.join(os.path.dirname(inplace_file), BUILD_INFO),
                    )
                )
                for src, dst in pairs:
                    if not os.path.exists(src):
                        continue
                    tmp = f"{dst}.tmp{os.getpid()}"
                    shutil.copy2(src, tmp)
                    os.replace(tmp, dst)

    return {
        "ext_modules": [ext],
        "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=True)},
    }


if __name__ == "__main__":  # setuptools' PEP 517 backend runs this file as __main__
    setup(**_extension_setup())
