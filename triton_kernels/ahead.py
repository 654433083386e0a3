"""Compile the Triton kernels ahead of time, for a GPU that is not here."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Callable

import torch

from . import _env

# Why: a GPU is lent rarely and for minutes, and compiling Triton kernels there cost the first
# GPU run most of its verify stage. Triton compiles for any NVIDIA target without a GPU (its
# bundled ptxas makes the cubin); what it cannot know without one is *which* kernels a run
# needs: each launch's specialisation (dtypes, constexprs, 16-byte alignment of pointers,
# divisibility by 16 of integers, the configurations an autotuner offers) is part of the
# cache key. So the launches are recorded where a run makes them and replayed for the target:
#
# record   POSENC_FAST_TRITON_RECORD=<file>: every call of a launcher (``lff_fwd``,
#          ``encoding_fwd``, ...) appends one JSON line, its name and arguments (tensors as
#          shape, strides, dtype and storage offset). On the CPU under the interpreter (the
#          verify cases, the tests a GPU run selects) or on the GPU itself (for the next time).
# compile  ``python -m posenc_fast.triton_kernels.ahead compile --arch 90 --sm-count 132
#          RECORDS...``: each recorded call again on `meta` tensors (no data, no arithmetic),
#          Triton's driver replaced by a stand-in for the target: every kernel, in every
#          configuration its autotuner may offer there, compiles into TRITON_CACHE_DIR
#          without being launched or timed, with its C launcher. The same for what the GPU
#          benchmarks call (``--benchmarks``: each script's ``triton_calls(device)``).
# log      POSENC_FAST_TRITON_LOG=<file>: every compilation, a hit or a miss of the cache,
#          appends one JSON line (benchmarks/summarize_gpu.py counts them), so a run shows
#          what it still compiled.
#
# A cache entry is found on the GPU machine when its key matches there: the kernel's source,
# the specialisation, the options, the backend's hash (ptxas version and arch),
# ``triton_key()`` (Triton's own sources and libtriton) and the cache-invalidating
# environment. ``compile`` writes the last three of this install into a manifest; ``check``
# compares them with the GPU machine's. Group files in the cache hold absolute paths:
# ``relocate`` rewrites them for the directory the cache is unpacked into.

RECORD_VERSION = 1

# ---------------------------------------------------------------- recording


def encode(value):
    """A launcher argument as JSON: tensors by their layout, never their values."""
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


_seen: set[str] = set()
_lock = threading.Lock()


def recorded(name: str, fn: Callable) -> Callable:
    """``fn`` (the launcher ``name``, "triton_kernels.lff_forward:lff_fwd") writing each of
    its calls with new arguments to the file POSENC_FAST_TRITON_RECORD names, one JSON line
    per call, appended (several processes may share the file)."""

    def call(*args):
        path = _env.recording()
        if path:
            try:
                rec = {"v": RECORD_VERSION, "launcher": name, "args": [encode(a) for a in args]}
                # whether the autotuners offered all their configurations or only the first
                rec["autotune"] = _env.autotune_enabled()
                line = json.dumps(rec, sort_keys=True)
            except TypeError as exc:
                line = None
                print(f"posenc_fast: not recorded: {name}: {exc}", file=sys.stderr)
            if line is not None:
                with _lock:
                    new = line not in _seen
                    _seen.add(line)
                if new:
                    with open(path, "a") as f:
                        f.write(line + "\n")
        return fn(*args)

    call.__name__ = call.__qualname__ = getattr(fn, "__name__", name)
    return call


def record_tuned(kernel: str, arch: int, key: str, config: str) -> None:
    """Write down an autotuner's choice (measured on a GPU) with the launcher calls:
    ``tuned`` merges such lines into triton_kernels/tuned.json."""
    path = _env.recording()
    if path:
        # compiling ahead "chooses" the first configuration, timing nothing: not a measurement
        measured = _env.compile_target() is None
        line = json.dumps({"v": RECORD_VERSION, "tuned": kernel, "arch": arch, "key": key,
                           "config": config, "measured": measured}, sort_keys=True)  # fmt: skip
        with _lock, open(path, "a") as f:
            f.write(line + "\n")


def merge_tuned(records: Iterable[dict], table: dict) -> int:
    """Add the autotuner choices among ``records`` to ``table`` ({"sm_90": {kernel: {key:
    configuration}}}); the last record of a key wins. Returns how many were added."""
    n = 0
    for rec in records:
        if "tuned" in rec and rec.get("measured"):
            kernels = table.setdefault(f"sm_{rec['arch']}", {})
            kernels.setdefault(rec["tuned"], {})[rec["key"]] = rec["config"]
            n += 1
    return n


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
                f.write("/* not the CUDA driver: link and load targets only (ahead.py) */\n" + body)
            out = os.path.join(tmp, "libcuda.so.1")
            subprocess.check_call(
                ["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", out, src]
            )
            os.replace(out, lib)
    # A loaded object with the soname libcuda.so.1 satisfies the launchers' dependency.
    ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return folder


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
    cache and launches nothing; `meta` tensors stand for the target's (``_env``); every
    configuration an autotuner may offer there is compiled, none is timed (the first is
    "chosen"). With ``launchers``, each kernel's C launcher is built into the cache too."""
    if _env.interpreter_enabled():
        raise RuntimeError("compiling ahead needs TRITON_INTERPRET unset (it compiles nothing)")
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

    from triton import knobs

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
    _env.set_compile_target({"arch": arch, "sm_count": sm_count, "name": name})
    try:
        if launchers:
            _build_driver_utils(compiled)
        yield compiled
    finally:
        _env.set_compile_target(None)
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
        launcher(record["launcher"])(*[decode(a, "meta") for a in record["args"]])
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m posenc_fast.triton_kernels.ahead", description=__doc__.split("\n\n")[0]
    )
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="compile recorded calls for a target into TRITON_CACHE_DIR")
    c.add_argument("records", nargs="*", help="record files (POSENC_FAST_TRITON_RECORD)")
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
    t = sub.add_parser("tuned", help="merge the autotuner choices GPU runs recorded into a table")
    t.add_argument("records", nargs="+")
    t.add_argument("--into", required=True, help="the table (triton_kernels/tuned.json)")
    a = sub.add_parser("pack", help="a cache's kernels and launchers, binaries only, as tar.gz")
    a.add_argument("cache_dir")
    a.add_argument("archive")
    args = p.parse_args(argv)
    if args.command == "compile":
        return _compile_main(args)
    if args.command == "check":
        with open(args.manifest) as f:
            arch = args.arch or json.load(f)["identity"]["arch"]
        why = check(args.manifest, arch)
        verdict = "MISMATCH: " + "; ".join(why) if why else "the cache matches this install"
        print("ahead check: " + verdict)
        return 1 if why else 0
    if args.command == "tuned":
        table = {}
        if os.path.exists(args.into):
            with open(args.into) as f:
                table = json.load(f)
        n = merge_tuned(read_records(args.records), table)
        with open(args.into, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"ahead tuned: {n} choices merged into {args.into}")
        return 0
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
