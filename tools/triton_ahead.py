"""Compile posenc_fast's Triton kernels ahead of time, for a GPU that is not here.

    python tools/triton_ahead.py run --record R.jsonl [--log L.jsonl] -- COMMAND ...
    python tools/triton_ahead.py compile R.jsonl ... --arch 90 --sm-count 132 \\
        [--benchmarks benchmarks/lff_gpu.py ...] [--manifest M.json]
    python tools/triton_ahead.py check M.json [--arch 90]
    python tools/triton_ahead.py relocate CACHE_DIR
    python tools/triton_ahead.py pack CACHE_DIR ARCHIVE.tar.gz

Why: a GPU is lent rarely and for minutes, and compiling Triton kernels there cost the first
GPU run most of its verify stage. Triton compiles for any NVIDIA target without a GPU (its
bundled ptxas makes the cubin); what it cannot know without one is *which* kernels a run
needs: each launch's specialisation (dtypes, constexprs, 16-byte alignment of pointers,
divisibility by 16 of integers, the configurations an autotuner offers) is part of the
cache key. So the launches are recorded where a run makes them and replayed for the target.
Everything here reaches into the package from outside; the package knows nothing of it:

record   ``run --record FILE -- COMMAND``: every call of a launcher of posenc_fast's Triton
         kernels (the public ``*_fwd`` / ``*_bwd`` functions of the LAUNCHER_MODULES in
         posenc_fast.triton_kernels, wrapped when their module is imported) appends one JSON
         line, its name and arguments (tensors as shape, strides, dtype and storage offset),
         in COMMAND's Python processes and their children: the folder triton_ahead_hooks/
         goes first on PYTHONPATH, and its sitecustomize installs the hooks where
         TRITON_AHEAD_RECORD / TRITON_AHEAD_LOG name files (benchmarks/gpu_validate.sh sets
         them for every stage). On the CPU under the interpreter (the verify cases, the
         tests a GPU run selects) or on the GPU itself (for the next time).
log      ``run --log FILE``: every Triton compilation, a hit or a miss of the cache, appends
         one JSON line (Triton's compilation listener; benchmarks/summarize_gpu.py counts
         them), so a run shows what it still compiled.
compile  each recorded call again on `meta` tensors (no data, no arithmetic), Triton's
         driver replaced by a stand-in for the target and posenc_fast's questions about the
         device (the dispatcher's device test, the launchers' SM count, name and
         architecture) answered for it: every kernel, in every configuration its autotuner
         may offer there, compiles into TRITON_CACHE_DIR without being launched or timed,
         with its C launcher. The same for what the GPU benchmarks call (``--benchmarks``:
         each script's ``triton_calls(device)``).

A cache entry is found on the GPU machine when its key matches there: the kernel's source,
the specialisation, the options, the backend's hash (ptxas version and arch),
``triton_key()`` (Triton's own sources and libtriton) and the cache-invalidating
environment. ``compile`` writes the last three of this install into a manifest; ``check``
compares them with the GPU machine's. Group files in the cache hold absolute paths:
``relocate`` rewrites them for the directory the cache is unpacked into.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.abc
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Callable

# (nothing here imports torch or triton at module level: the startup hook imports this
# module in every Python process of a recorded run)

HERE = os.path.dirname(os.path.abspath(__file__))
HOOKS_DIR = os.path.join(HERE, "triton_ahead_hooks")  # its sitecustomize.py
RECORD_ENV, LOG_ENV = "TRITON_AHEAD_RECORD", "TRITON_AHEAD_LOG"
RECORD_VERSION = 1
PACKAGE = "posenc_fast.triton_kernels"
# The modules whose public ``*_fwd`` / ``*_bwd`` functions are the launchers the registries
# call (tests/common/test_triton_ahead.py checks that every op's Triton path is recorded).
LAUNCHER_MODULES = ("encodings", "lff_backward", "lff_forward", "lff_gemm", "rotary")
_LAUNCHER_NAME = re.compile(r"^[a-z]\w*_(fwd|bwd)$")

# ---------------------------------------------------------------- recording


def encode(value):
    """A launcher argument as JSON: tensors by their layout, never their values."""
    import torch

    if isinstance(value, torch.Tensor):
        return {
            "tensor": {
                "shape": list(value.shape),
                "stride": list(value.stride()),
                "dtype": str(value.dtype).removeprefix("torch."),
                "offset": value.storage_offset(),
                "requires_grad": value.requires_grad,
            }
        }
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [encode(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot record an argument of type {type(value).__name__}")


def decode(value, device: str = "meta"):
    """The argument :func:`encode` described, with tensors of that layout on ``device``
    (their values are not recorded: random where the device holds data)."""
    import torch

    if isinstance(value, dict):
        if "tensor" in value:
            t = value["tensor"]
            dtype = getattr(torch, t["dtype"])
            shape, stride, offset = t["shape"], t["stride"], t["offset"]
            # the storage the strided view needs, past its offset
            extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0)
            numel = offset + extent if all(n > 0 for n in shape) else offset
            if dtype.is_floating_point:
                base = torch.randn(numel, dtype=dtype, device=device)
            else:
                base = torch.zeros(numel, dtype=dtype, device=device)
            out = base.as_strided(shape, stride, offset)
            return out.requires_grad_(t["requires_grad"]) if dtype.is_floating_point else out
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        if "list" in value:
            return [decode(v, device) for v in value["list"]]
        if "tuple" in value:
            return tuple(decode(v, device) for v in value["tuple"])
    return value


def launcher_names(module) -> list[str]:
    """The launchers a launcher module defines: its public ``*_fwd`` / ``*_bwd`` functions."""
    return sorted(
        name
        for name, fn in vars(module).items()
        if _LAUNCHER_NAME.match(name)
        and callable(fn)
        and getattr(fn, "__module__", None) == module.__name__
    )


class Recorder:
    """Writes each launcher call with new arguments to ``path``, one JSON line per call,
    appended (several processes may share the file). Only the outermost launcher of a call
    is written (a launcher calling another is replayed whole)."""

    def __init__(self, path: str):
        self.path = path
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._depth = threading.local()

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn``, the launcher ``name`` ("triton_kernels.lff_forward:lff_fwd"), recording."""

        @functools.wraps(fn)
        def call(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                self.write(name, args, kwargs)
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        call.__wrapped_launcher__ = fn
        return call

    def write(self, name: str, args: tuple, kwargs: dict) -> None:
        from posenc_fast.triton_kernels import _env

        try:
            rec = {"v": RECORD_VERSION, "launcher": name, "args": [encode(a) for a in args]}
            if kwargs:
                rec["kwargs"] = {k: encode(v) for k, v in kwargs.items()}
            # whether the autotuners offered all their configurations or only the first
            rec["autotune"] = _env.autotune_enabled()
            line = json.dumps(rec, sort_keys=True)
        except TypeError as exc:
            print(f"triton_ahead: not recorded: {name}: {exc}", file=sys.stderr)
            return
        with self._lock:
            if line in self._seen:
                return
            self._seen.add(line)
            with open(self.path, "a") as f:
                f.write(line + "\n")


def record_launchers(module, recorder: Recorder) -> list[str]:
    """Replace ``module``'s launchers by recording wrappers (the registries and the plans
    look them up on the module at each call). Returns their names."""
    names = launcher_names(module)
    short = module.__name__.removeprefix("posenc_fast.")
    for name in names:
        fn = getattr(module, name)
        if not hasattr(fn, "__wrapped_launcher__"):
            setattr(module, name, recorder.wrap(f"{short}:{name}", fn))
    return names


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``actions[name](module)`` right after the module ``name`` is executed."""

    def __init__(self, actions: dict[str, Callable]):
        self.actions = actions

    def find_spec(self, name, path, target=None):
        action = self.actions.get(name)
        if action is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _Then(spec.loader, action)
        return spec


class _Then(importlib.abc.Loader):
    """A loader that runs an action after the real loader executed the module."""

    def __init__(self, loader, action):
        self._loader, self._action = loader, action

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._action(module)

    def __getattr__(self, name):  # get_source, get_filename, ...: the real loader's
        return getattr(self._loader, name)


def install_hooks(record: str | None = None, log: str | None = None) -> None:
    """In this process: record every launcher call to ``record``, log every Triton
    compilation to ``log`` (either may be None). Modules already imported are patched now,
    the others when they are imported."""
    actions: dict[str, Callable] = {}
    if record:
        recorder = Recorder(record)
        for short in LAUNCHER_MODULES:
            actions[f"{PACKAGE}.{short}"] = lambda m, r=recorder: record_launchers(m, r)
    if log:
        # posenc_fast's kernels import triton through _launch: the listener goes in then
        actions[f"{PACKAGE}._launch"] = lambda m: install_log(log)
    for name, action in list(actions.items()):
        if name in sys.modules:
            action(sys.modules[name])
            del actions[name]
    if actions:
        sys.meta_path.insert(0, _AfterImport(actions))


def hook_environment(record: str | None, log: str | None, env=None) -> dict:
    """``env`` (default os.environ) for a command whose Python processes install the hooks."""
    env = dict(os.environ if env is None else env)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = HOOKS_DIR + (os.pathsep + path if path else "")
    for var, value in ((RECORD_ENV, record), (LOG_ENV, log)):
        if value:
            env[var] = os.path.abspath(value)
    return env


def read_records(paths: Iterable[str]) -> list[dict]:
    """The distinct records of the files (in first-seen order)."""
    out, seen = [], set()
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line or line in seen:
                    continue
                seen.add(line)
                rec = json.loads(line)
                if rec.get("v") != RECORD_VERSION:
                    raise ValueError(f"{path}: record version {rec.get('v')}, expected 1")
                out.append(rec)
    return out


def launcher(name: str) -> Callable:
    """The launcher a record names ("triton_kernels.lff_forward:lff_fwd")."""
    module, attr = name.split(":")
    return getattr(importlib.import_module(f"posenc_fast.{module}"), attr)


# ---------------------------------------------------------------- the compile-log


def install_log(path: str) -> bool:
    """Append one JSON line per Triton compilation of this process to ``path``: the
    kernel, its module, whether the cache had it, and the seconds it took. False where the
    installed Triton has no compilation listener (before 3.4)."""
    try:
        from triton import knobs
    except ImportError:
        return False
    if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
        return False
    previous = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit, **_):
        fn = getattr(src, "fn", None)
        total = getattr(times, "total", None)
        row = {
            "kernel": getattr(src, "name", "?"),
            "module": getattr(fn, "module", None),
            "hit": bool(cache_hit),
            "us": total() if callable(total) else _total_us(times),
            "hash": (metadata or {}).get("hash"),
            "pid": os.getpid(),
        }
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if previous is not None:
            previous(
                src=src,
                metadata=metadata,
                metadata_group=metadata_group,
                times=times,
                cache_hit=cache_hit,
            )

    knobs.compilation.listener = listener
    return True


def _total_us(times) -> int | None:
    try:
        return int(
            times.ir_initialization + sum(t for _, t in times.lowering_stages) + times.store_results
        )
    except (AttributeError, TypeError):
        return None


# ---------------------------------------------------------------- compiling for a target


def _target_driver(arch: int):
    """A stand-in for Triton's CUDA driver that answers for a GPU that is not here: its
    target is sm_``arch``, device 0, stream 0; it cannot launch or time anything."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class TargetDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            from triton.backends.nvidia.driver import ty_to_cpp

            return ty_to_cpp(ty)

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("meta")

        def get_benchmarker(self):
            raise RuntimeError("compiling ahead: nothing is timed")

        @property
        def utils(self):
            # Triton's own: building it builds its cuda_utils module into the cache (the
            # launchers of Triton >= 3.7 live there); it loads against the stub driver
            from triton.backends.nvidia.driver import CudaUtils

            return CudaUtils()

    return TargetDriver()


def _stub_libcuda(folder: str) -> str:
    """An impostor libcuda.so.1 in ``folder``, loaded into this process: every entry point
    that Triton's bundled cuda.h declares, each returning an error. Triton's C launchers
    and its cuda_utils module link against the driver and reference some of its functions
    directly; with the impostor they build into the cache and load here (nothing calls
    them), and on the GPU machine the same files load the real driver. Returns ``folder``."""
    import ctypes
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia import driver as nv

    os.makedirs(folder, exist_ok=True)
    lib = os.path.join(folder, "libcuda.so.1")
    if not os.path.exists(lib):
        with open(os.path.join(nv.include_dirs[0], "cuda.h")) as f:
            header = f.read()
        names = set(re.findall(r"CUresult CUDAAPI (cu\w+)\(", header))
        names |= set(re.findall(r"#define\s+cu\w+\s+(cu\w+)\s*$", header, re.MULTILINE))
        body = "".join(f"int {n}(void) {{ return 999; }}\n" for n in sorted(names))
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "libcuda_stub.c")
            with open(src, "w") as f:
                f.write(
                    "/* not the CUDA driver: link and load targets only (triton_ahead.py) */\n"
                    + body
                )
            out = os.path.join(tmp, "libcuda.so.1")
            subprocess.check_call(
                ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", out, src]
            )
            os.replace(out, lib)
    # A loaded object with the soname libcuda.so.1 satisfies the launchers' dependency.
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return folder


@contextlib.contextmanager
def meta_stands_for(arch: int, sm_count: int, name: str) -> Iterator[None]:
    """Within: posenc_fast takes `meta` tensors for the target GPU's. The dispatcher lets
    the triton backend run them (its environment test and the devices of its SUPPORT
    tables), and the launchers' questions about their device (``_launch.sm_count``,
    ``_launch.device_name``, ``_configs.device_arch``, wherever imported) get the target's
    answers; other devices get the usual ones. Everything is restored afterwards."""
    import dataclasses

    import torch
    from posenc_fast.triton_kernels import _configs, _launch

    import posenc_fast  # noqa: F401  (every op's registry)
    from posenc_fast import _dispatch

    def meta(device) -> bool:
        return torch.device(device).type == "meta"

    sm, gpu, cc = _launch.sm_count, _launch.device_name, _configs.device_arch
    answers = {
        id(sm): (sm, lambda device: sm_count if meta(device) else sm(device)),
        id(gpu): (gpu, lambda device: name if meta(device) else gpu(device)),
        id(cc): (cc, lambda device: arch if meta(device) else cc(device)),
    }
    patched = []  # (module, attribute, original)
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("posenc_fast"):
            continue
        for attr, value in list(vars(module).items()):
            original, answer = answers.get(id(value), (None, None))
            if original is not None and value is original:
                setattr(module, attr, answer)
                patched.append((module, attr, original))
    backend = _dispatch.BACKENDS["triton"]
    saved_backend = (backend.environment_reasons, backend.auto_devices)
    backend.environment_reasons = list  # no reason against it
    if backend.auto_devices is not None:
        backend.auto_devices = (*backend.auto_devices, "meta")
    saved_support = []
    for registry in _dispatch.REGISTRIES.values():
        impl = registry.get("triton")
        devices = impl.support.devices if impl is not None else None
        if devices is not None and "meta" not in devices:
            saved_support.append((impl, impl.support))
            impl.support = dataclasses.replace(impl.support, devices=(*devices, "meta"))
    try:
        yield
    finally:
        for impl, support in saved_support:
            impl.support = support
        backend.environment_reasons, backend.auto_devices = saved_backend
        for module, attr, original in patched:
            setattr(module, attr, original)


class Compiled:
    """What :func:`compiling_for` compiled: kernel names and cache hashes, launchers."""

    def __init__(self):
        self.kernels: dict[str, dict] = {}  # cache hash -> {"kernel", "module"}
        self.hits = 0  # compilations the cache already had
        self.misses = 0
        self.launchers = 0
        self.launcher_errors: list[str] = []


@contextlib.contextmanager
def compiling_for(
    arch: int, sm_count: int, launchers: bool = True, name: str = "NVIDIA H200"
) -> Iterator[Compiled]:
    """Within: Triton compiles every kernel the launchers run for sm_``arch`` into its
    cache and launches nothing; `meta` tensors stand for the target's
    (:func:`meta_stands_for`); every configuration an autotuner may offer there is
    compiled, none is timed (the first is "chosen"). With ``launchers``, each kernel's C
    launcher is built into the cache too. Autotuners built within keep their stand-in
    timing: run it in a process of its own (the ``compile`` command)."""
    from posenc_fast.triton_kernels import _env

    if _env.interpreter_enabled():
        raise RuntimeError("compiling ahead needs TRITON_INTERPRET unset (it compiles nothing)")
    from triton import knobs
    from triton.runtime import autotuner as tuner_module
    from triton.runtime import jit as jit_module
    from triton.runtime.driver import driver

    compiled = Compiled()
    names = ("POSENC_FAST_TRITON_AUTOTUNE", "TRITON_LIBCUDA_PATH")
    saved_env = {k: os.environ.get(k) for k in names}
    os.environ["POSENC_FAST_TRITON_AUTOTUNE"] = "1"  # every allowed configuration
    if launchers:
        cache_root = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
        stub = _stub_libcuda(os.path.join(cache_root, "..", "stub-libcuda"))
        os.environ["TRITON_LIBCUDA_PATH"] = stub
    run, bench = jit_module.JITFunction.run, tuner_module.Autotuner._bench
    built: set[str] = set()

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        key = kernel.metadata.hash
        compiled.kernels.setdefault(key, {"kernel": kernel.name, "module": self.module})
        if launchers and key not in built:
            built.add(key)
            _build_launcher(kernel, compiled)
        return kernel

    def no_timing(self, *args, config, **meta):
        self.fn.run(*args, **{**meta, **config.all_kwargs()})
        return [0.0, 0.0, 0.0]

    listener = knobs.compilation.listener

    def count(*, cache_hit, **kwargs):
        if cache_hit:
            compiled.hits += 1
        else:
            compiled.misses += 1
        if listener is not None:
            listener(cache_hit=cache_hit, **kwargs)

    knobs.compilation.listener = count
    previous = driver._active  # (None: not chosen yet; no public getter)
    driver.set_active(_target_driver(arch))
    jit_module.JITFunction.run = compile_only
    tuner_module.Autotuner._bench = no_timing
    try:
        with meta_stands_for(arch, sm_count, name):
            if launchers:
                _build_driver_utils(compiled)
            yield compiled
    finally:
        jit_module.JITFunction.run, tuner_module.Autotuner._bench = run, bench
        driver._active = previous
        knobs.compilation.listener = listener
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _build_launcher(kernel, compiled: Compiled) -> None:
    """Build (into the cache) the C launcher Triton makes for ``kernel`` on first launch."""
    from triton.backends.nvidia.driver import CudaLauncher

    try:
        CudaLauncher(kernel.src, kernel.metadata)
    except Exception as exc:
        compiled.launcher_errors.append(f"{kernel.name}: {type(exc).__name__}: {exc}")
        return
    compiled.launchers += 1


def _build_driver_utils(compiled: Compiled) -> None:
    """Triton's cuda_utils module (built on the GPU machine's first use of the driver)."""
    from triton.runtime.driver import driver

    try:
        driver.active.utils  # noqa: B018  (built on first access)
    except Exception as exc:
        compiled.launcher_errors.append(f"cuda_utils: {type(exc).__name__}: {exc}")


def replay(record: dict) -> None:
    """Call the launcher a record names with `meta` tensors of the recorded layouts, its
    autotuners offering what they offered when it was recorded (all configurations, or
    the first with POSENC_FAST_TRITON_AUTOTUNE=0, as the GPU run's correctness stages)."""
    saved = os.environ.get("POSENC_FAST_TRITON_AUTOTUNE")
    os.environ["POSENC_FAST_TRITON_AUTOTUNE"] = "1" if record.get("autotune", True) else "0"
    try:
        args = [decode(a, "meta") for a in record["args"]]
        kwargs = {k: decode(v, "meta") for k, v in record.get("kwargs", {}).items()}
        launcher(record["launcher"])(*args, **kwargs)
    finally:
        os.environ["POSENC_FAST_TRITON_AUTOTUNE"] = saved if saved is not None else "1"


def benchmark_calls(paths: Iterable[str], device: str = "meta") -> Iterator[tuple[str, Callable]]:
    """(name, call) for every Triton path the GPU benchmark scripts measure: each script's
    ``triton_calls(device)``, imported by path."""
    for path in paths:
        name = os.path.splitext(os.path.basename(path))[0]
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in sys.path:  # the scripts import their neighbours (_gpu_common)
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(f"_posenc_bench_{name}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        for case, call in module.triton_calls(device):
            yield f"{name}:{case}", call


# ---------------------------------------------------------------- the cache's identity


def identity(arch: int) -> dict:
    """What decides whether this install's cache entries are found by another install:
    Triton's version and key, the backend's hash for sm_``arch`` (ptxas version), the
    cache-invalidating environment, and the platform of the C launchers."""
    import platform

    import triton
    from triton.runtime.cache import triton_key

    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        env = get_cache_invalidating_env_vars()
    except ImportError:
        env = {}
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    return {
        "triton": triton.__version__,
        "triton_key": triton_key(),
        "backend_hash": make_backend(GPUTarget("cuda", arch, 32)).hash(),
        "env": dict(sorted(env.items())),
        "python": ".".join(map(str, sys.version_info[:2])),
        "platform": platform.machine(),
        "arch": arch,
    }


def check(manifest_path: str, arch: int) -> list[str]:
    """Why this install would not find the entries of the cache ``manifest_path``
    describes (empty: it would)."""
    with open(manifest_path) as f:
        want = json.load(f)["identity"]
    have = identity(arch)
    return [
        f"{k}: cache {want.get(k)!r}, here {have.get(k)!r}"
        for k in ("triton", "triton_key", "backend_hash", "env", "python", "platform", "arch")
        if want.get(k) != have.get(k)
    ]


def relocate(cache_dir: str) -> int:
    """Point the group files of the cache in ``cache_dir`` (which hold the absolute paths
    of their entries, as built elsewhere) at ``cache_dir``. Returns the files changed."""
    cache_dir = os.path.abspath(cache_dir)
    changed = 0
    for entry in os.listdir(cache_dir):
        folder = os.path.join(cache_dir, entry)
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if not (name.startswith("__grp__") and name.endswith(".json")):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                group = json.load(f)
            paths = group.get("child_paths", {})
            new = {k: os.path.join(folder, os.path.basename(v)) for k, v in paths.items()}
            if new != paths:
                group["child_paths"] = new
                with open(path, "w") as f:
                    json.dump(group, f)
                changed += 1
    return changed


# What a kernel needs from the cache on the GPU machine: its metadata and its binary (the
# launchers' and cuda_utils' shared objects are entries of their own). The intermediate
# forms (Triton IR, LLVM IR, PTX: ~75% of the bytes) are left out of the archive.
PACKED_SUFFIXES = (".json", ".cubin", ".so")


def pack(cache_dir: str, archive: str) -> dict:
    """Write the entries of ``cache_dir`` to the tar.gz ``archive``, each kernel with only
    what loading it needs (:data:`PACKED_SUFFIXES`), its group file listing just those.
    Returns counts (entries, files, bytes)."""
    import io
    import tarfile

    entries = files = 0
    with tarfile.open(archive, "w:gz") as tar:
        for entry in sorted(os.listdir(cache_dir)):
            folder = os.path.join(cache_dir, entry)
            if not os.path.isdir(folder):
                continue
            entries += 1
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                if name.startswith("__grp__") and name.endswith(".json"):
                    with open(path) as f:
                        group = json.load(f)
                    group["child_paths"] = {
                        k: v
                        for k, v in group.get("child_paths", {}).items()
                        if k.endswith(PACKED_SUFFIXES)
                    }
                    data = json.dumps(group).encode()
                    info = tarfile.TarInfo(f"{entry}/{name}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                elif name.endswith(PACKED_SUFFIXES):
                    tar.add(path, arcname=f"{entry}/{name}")
                else:
                    continue
                files += 1
    return {"entries": entries, "files": files, "bytes": os.path.getsize(archive)}


# ---------------------------------------------------------------- command line


def _compile_main(args) -> int:
    if not os.environ.get("TRITON_CACHE_DIR"):
        print("ahead compile: set TRITON_CACHE_DIR (the GPU machine's cache)", file=sys.stderr)
        return 2
    records = read_records(args.records)
    t0 = time.time()
    failures: list[str] = []
    calls = 0
    target = {"launchers": not args.no_launchers, "name": args.device_name}
    with compiling_for(args.arch, args.sm_count, **target) as compiled:
        # Autotuned calls first: an autotuner decides once per key, and a key first met
        # with one configuration offered would not compile the others later.
        for name, call in benchmark_calls(args.benchmarks or []):
            calls += 1
            try:
                call()
            except Exception as exc:
                failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
        calls_only = [r for r in records if "launcher" in r]
        for rec in sorted(calls_only, key=lambda r: not r.get("autotune", True)):
            calls += 1
            try:
                replay(rec)
            except Exception as exc:
                failures.append(f"{rec['launcher']}: {type(exc).__name__}: {str(exc)[:300]}")
    seconds = time.time() - t0
    manifest = {
        "identity": identity(args.arch),
        "cache_dir": os.path.abspath(os.environ["TRITON_CACHE_DIR"]),
        "sm_count": args.sm_count,
        "device_name": args.device_name,
        "calls": calls,
        "records": len(records),
        "kernels": sorted(compiled.kernels.values(), key=lambda k: (k["module"], k["kernel"])),
        "launchers": compiled.launchers,
        "compiled": compiled.misses,
        "already_cached": compiled.hits,
        "failures": failures + compiled.launcher_errors,
        "seconds": round(seconds, 1),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.manifest:
        with open(args.manifest, "w") as f:
            json.dump(manifest, f, indent=1)
    print(
        f"ahead: {calls} calls ({len(records)} recorded), {len(compiled.kernels)} kernels "
        f"({compiled.misses} compiled, {compiled.hits} already in the cache) and "
        f"{compiled.launchers} launchers for sm_{args.arch} in {seconds:.0f} s "
        f"(Triton {manifest['identity']['triton']}), {len(manifest['failures'])} failures"
    )
    for line in manifest["failures"]:
        print(f"  FAILED {line}")
    return 1 if manifest["failures"] else 0


def _run_main(args) -> int:
    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    if not command:
        print("ahead run: give the command after --", file=sys.stderr)
        return 2
    if not (args.record or args.log):
        print("ahead run: --record and/or --log", file=sys.stderr)
        return 2
    return subprocess.call(command, env=hook_environment(args.record, args.log))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python tools/triton_ahead.py", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "run",
        help="run a command whose Python processes record launcher calls / log compilations",
    )
    r.add_argument("--record", help="append every launcher call here (JSON lines)")
    r.add_argument("--log", help="append every Triton compilation here (JSON lines)")
    r.add_argument("command_line", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    c = sub.add_parser("compile", help="compile recorded calls for a target into TRITON_CACHE_DIR")
    c.add_argument("records", nargs="*", help="record files (run --record)")
    c.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90)")
    c.add_argument("--sm-count", type=int, default=132, help="the target's SMs (H200: 132)")
    c.add_argument("--device-name", default="NVIDIA H200", help="the target's name, as torch's")
    c.add_argument("--benchmarks", nargs="*", help="GPU benchmark scripts (their triton_calls)")
    c.add_argument("--manifest", help="write the manifest (identity, kernels) here")
    c.add_argument("--no-launchers", action="store_true", help="no C launchers")
    k = sub.add_parser("check", help="does this install find the entries of a prepared cache?")
    k.add_argument("manifest")
    k.add_argument("--arch", type=int, help="default: the manifest's")
    r = sub.add_parser("relocate", help="point a cache's group files at the folder it lies in")
    r.add_argument("cache_dir")
    a = sub.add_parser("pack", help="a cache's kernels and launchers, binaries only, as tar.gz")
    a.add_argument("cache_dir")
    a.add_argument("archive")
    args = p.parse_args(argv)
    if args.command == "run":
        return _run_main(args)
    if args.command == "compile":
        return _compile_main(args)
    if args.command == "check":
        with open(args.manifest) as f:
            arch = args.arch or json.load(f)["identity"]["arch"]
        why = check(args.manifest, arch)
        verdict = "MISMATCH: " + "; ".join(why) if why else "the cache matches this install"
        print("ahead check: " + verdict)
        return 1 if why else 0
    if args.command == "pack":
        counts = pack(args.cache_dir, args.archive)
        print(f"ahead pack: {counts['entries']} entries, {counts['files']} files, "
              f"{counts['bytes']} bytes -> {args.archive}")  # fmt: skip
        return 0
    n = relocate(args.cache_dir)
    print(f"ahead relocate: {n} group files pointed at {os.path.abspath(args.cache_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
