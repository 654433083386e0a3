"""The first-use build of the compiled extension into the user cache, and ``python -m
posenc_fast build``: torch.utils.cpp_extension with ninja in a child process, with progress
on stderr, under a file lock so that concurrent processes build once and the others wait,
in a temporary folder renamed into place when complete."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from . import _build_config as _cfg
from . import _extension_cache as _cache

WAIT_ENV = "POSENC_FAST_BUILD_WAIT"

DEFAULT_WAIT_S = 1800.0  # a full -O3 build took 13 min on a busy 2-core machine


def _say(message: str) -> None:
    print(f"posenc_fast: {message}", file=sys.stderr, flush=True)


def blockers() -> Optional[str]:
    """Why this process cannot compile at all (None: it can try)."""
    if _cache.source_root() is None:
        return _cache.INSTALL_HINT
    cxx, why = _cfg.find_cxx()
    if cxx is None:
        return f"{why}: install one (e.g. g++) or set CXX, then {_cache.BUILD_HINT}"
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return f"ninja is not installed (`pip install ninja`), then {_cache.BUILD_HINT}"
    return None


def first_use_build(part: str) -> tuple[Optional[Path], str]:
    """Build ``part`` into the cache on first use, where allowed: (binary, "") or (None,
    why it is unavailable, saying how to build)."""
    what = _cache.label(part)
    if _cache.flag(_cache.NO_BUILD_ENV):
        return None, (
            f"{what} is not built for this torch and {_cache.NO_BUILD_ENV} forbids building it on "
            f"first use: {_cache.BUILD_HINT}"
        )
    blocker = blockers()
    if blocker:
        return None, f"{what} is not built for this torch and cannot be built here: {blocker}"
    try:
        return build_part(part, first_use=True)
    except Exception as exc:  # the first call of an op must fall back, not crash
        return None, (
            f"building {what} on first use failed ({type(exc).__name__}: {exc}): "
            f"{_cache.BUILD_HINT}"
        )


def _wait_limit() -> float:
    try:
        return float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    except ValueError:
        return DEFAULT_WAIT_S


@contextlib.contextmanager
def _exclusive(lock_path: Path, wait_s: float, waiting: Callable[[], None]):
    """Hold an exclusive flock on ``lock_path``: yields True once held, False when another
    holder kept it for ``wait_s`` seconds (``waiting()`` is called once, when it must wait).
    flock, not a lock file's existence: the lock dies with its process, so a crashed build
    never blocks the next one."""
    import fcntl

    with open(lock_path, "a+") as f:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                if not told:
                    waiting()
                    told = True
                time.sleep(0.5)
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_part(
    part: str = "cpu",
    *,
    first_use: bool = False,
    force: bool = False,
    verbose: bool = False,
    plan: Optional[dict] = None,
) -> tuple[Optional[Path], str]:
    """Compile ``part`` into the cache folder of this process (``_extension_cache.cache_dir``)
    unless a valid build is already there; (binary, "") or (None, why not). Safe across processes:
    one builds under an exclusive lock on ``<key>/<part>.lock``, the others wait for it
    (POSENC_FAST_BUILD_WAIT seconds) and load its result. The build runs in a temporary
    folder renamed into place when complete, so no process ever sees half a build.

    first_use: a failed build is remembered (``<part>.failed.json``) and not retried on
    first use, only by an explicit build (otherwise every process, every DataLoader worker,
    would spend minutes failing again). force: rebuild even where a valid build exists.
    plan: _build_config.plan_build's result to build from (default: this process's)."""
    what = _cache.label(part)
    target = _cache.cache_dir(part)
    if target is None:
        return None, f"{what} is not built and cannot be: {_cache.INSTALL_HINT}"
    key_dir = target.parent
    failed = key_dir / f"{part}.failed.json"
    try:
        key_dir.mkdir(parents=True, exist_ok=True)
        lock_path = key_dir / f"{part}.lock"
        lock_path.touch()
    except OSError as exc:
        return None, (
            f"{what} is not built for this torch and the build cache {_cache.cache_root()} is not "
            f"writable ({type(exc).__name__}: {exc}): set {_cache.CACHE_ENV} to a writable folder, "
            f"then {_cache.BUILD_HINT}"
        )
    wait_s = _wait_limit()

    def waiting():
        _say(f"another process is building {what} into {target}; waiting for it (up to "
             f"{wait_s:.0f} s, {WAIT_ENV})")  # fmt: skip

    with _exclusive(lock_path, wait_s, waiting) as held:
        if not held:
            return None, (
                f"another process has been building {what} into {target} for over "
                f"{wait_s:.0f} s ({WAIT_ENV}): using the fallback in this process"
            )
        if not force:
            cached, _stale = _cache.cache_candidate(part)
            if cached is not None:  # built by another process meanwhile, or earlier
                if not first_use:
                    _say(f"{what} is already built for this torch and these sources: {cached}")
                return cached, ""
            record = _cache.read_record(failed)
            if first_use and record is not None:
                return None, _cache.failure_reason(part, record, " on first use")
        return _compile_into(part, target, failed, verbose=verbose, plan=plan)


# The child process that compiles. torch.utils.cpp_extension.load() also imports what it
# built; the CUDA part cannot be imported without the CPU part (it implements ops defined
# there), and the parent imports the binary from its final place anyway: the import is
# replaced by a no-op (a private function of torch: where it is renamed, load() imports
# the CPU part harmlessly and the CUDA part's import error fails the build, not silently).
_CHILD = """
import json, sys
from torch.utils import cpp_extension
spec = json.loads(sys.argv[1])
cuda_home = spec.pop("cuda_home")
if cuda_home:  # the toolkit _build_config.find_cuda_toolkit found, not torch's guess
    cpp_extension.CUDA_HOME = cuda_home
cpp_extension._import_module_from_library = lambda *args, **kwargs: None
cpp_extension.load(verbose=True, **spec)
"""


_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]\s+(.*)$")


def ninja_step(line: str) -> Optional[str]:
    """A ninja progress line ("[3/10] c++ ... -c /x/csrc/lff/lff_cpu.cpp -o lff_cpu.o") as
    "[3/10] compiled lff_cpu.cpp"; None for any other line. Into a pipe, ninja prints a
    step's line when the step has finished ([finished/total])."""
    m = _NINJA_STEP.match(line.strip())
    if not m:
        return None
    n, total, command = m.groups()
    src = re.search(r"\s-c\s+(\S+)", command)
    done = f"compiled {os.path.basename(src.group(1))}" if src else "linked"
    return f"[{n}/{total}] {done}"


def _compile_into(
    part: str, target: Path, failed: Path, verbose: bool, plan: Optional[dict]
) -> tuple[Optional[Path], str]:
    """Compile ``part`` in a child process into a temporary folder beside ``target``, then
    rename it into place (under the caller's lock)."""
    what = _cache.label(part)
    root = _cache.source_root()
    assert root is not None
    plan = plan or _cfg.plan_build(
        torch_version=torch.__version__,
        torch_cuda_version=torch.version.cuda,
        debug=_cache.debug(),
        no_cuda="first-use build: CPU part only" if part == "cpu" else None,
        cxx11_abi=getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
        source_root=root,
        sanitize=_cache.sanitizers(),
    )
    spec = plan[part]
    tmp = Path(tempfile.mkdtemp(prefix=f".{part}.tmp", dir=target.parent))
    build_dir, out_dir = tmp / "build", tmp / "out"
    build_dir.mkdir()
    out_dir.mkdir()
    child = {
        "name": spec["module"],
        "sources": [str(root / s) for s in spec["sources"]],
        # load() writes these into its ninja file unquoted (setup.py's builds quote them):
        # the shell would strip the quotes of -DPOSENC_FAST_CUDA_ARCHS="..." and split at ';'
        "extra_cflags": [shlex.quote(flag) for flag in spec["cxx"]],
        "extra_cuda_cflags": spec.get("nvcc") if part == "cuda" else None,
        "extra_ldflags": spec["ldflags"] if part == "cpu" else None,
        "extra_include_paths": [str(root / "csrc")],
        "build_directory": str(build_dir),
        "with_cuda": part == "cuda",
        "is_python_module": True,
    }
    child["cuda_home"] = plan["toolkit"]["root"] if part == "cuda" else None
    # The child imports torch only; PYTHONPATH is not needed (it never imports posenc_fast).
    jobs = os.environ.get("MAX_JOBS") or "ninja's default"
    _say(f"building {what} for torch {torch.__version__} into {target} (once per torch "
         f"version and sources; a few minutes; MAX_JOBS={jobs}; {_cache.NO_BUILD_ENV}=1 forbids "
         "first-use builds)")  # fmt: skip
    start = time.monotonic()
    log_path = target.parent / f"{part}.build.log"
    tail: collections.deque[str] = collections.deque(maxlen=400)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(child)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=dict(os.environ, PYTHONUNBUFFERED="1"),  # torch's messages as they come
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            log.flush()  # the log is what to read while a build seems slow
            tail.append(line)
            step = ninja_step(line)
            if verbose:
                print(line, end="", file=sys.stderr, flush=True)
            elif step:
                _say(step)
        rc = proc.wait()
    seconds = time.monotonic() - start
    built = build_dir / f"{spec['module']}.so"
    record = dict(
        spec["record"],
        how="first-use build (posenc_fast._extension, torch.utils.cpp_extension.load)",
        build_time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        build_seconds=round(seconds, 1),
        log=str(log_path),
    )
    if rc != 0 or not built.is_file():
        error = "".join(tail) or f"the compiler process exited with status {rc}"
        record.update(built=False, error=_cfg.error_record(error))
        _cfg.write_json_atomic(failed, record)
        shutil.rmtree(tmp, ignore_errors=True)
        summary = _cfg.error_summary(error)
        _say(f"building {what} failed after {seconds:.0f} s ({summary}); the log: {log_path}")
        return (
            None,
            f"building {what} failed ({summary}; the log: {log_path}): fix it, then "
            f"{_cache.BUILD_HINT}",
        )
    binary = out_dir / f"{spec['module']}{sysconfig.get_config_var('EXT_SUFFIX')}"
    os.replace(built, binary)
    _cfg.write_json_atomic(
        _cache.record_path(part, out_dir), dict(record, built=True, binary=binary.name)
    )
    if target.exists():  # a forced rebuild, or a build refused as incomplete: set aside
        os.replace(target, tmp / "old")  # processes that mapped the old binary keep it
    os.replace(out_dir, target)  # atomic: other processes see no build or a complete one
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        failed.unlink()
    _say(f"built {what} in {seconds:.0f} s: {target}")
    return target / binary.name, ""


def build(
    cuda: Optional[bool] = None, force: bool = False, verbose: bool = False
) -> dict[str, dict[str, Any]]:
    """``python -m posenc_fast build``: build what this process lacks into the cache, with
    progress, whatever POSENC_FAST_NO_BUILD says (it is explicit). The CPU part unless the
    package's own build is valid here (force: in any case); the CUDA part where torch has
    CUDA and a matching toolkit is found (cuda None; POSENC_FAST_NO_CUDA and
    POSENC_FAST_FORCE_CUDA apply as in setup.py), never (False) or in any case (True).
    Returns per part {"built": path or None, "skipped": why not built or None, "error": why
    the build failed or None}. Through _extension.build, which refuses where the extension
    is already loaded."""
    from torch.utils import cpp_extension

    blocker = blockers()
    if blocker:
        raise RuntimeError(f"posenc_fast: cannot build {_cache.label('cpu')} here: {blocker}")
    plan = _cfg.plan_build(
        torch_version=torch.__version__,
        torch_cuda_version=torch.version.cuda,
        debug=_cache.debug(),
        no_cuda=(
            "not requested (--cuda no)"
            if cuda is False
            else "POSENC_FAST_NO_CUDA is set"
            if cuda is None and _cache.flag("POSENC_FAST_NO_CUDA")
            else None
        ),
        force_cuda=(
            "requested (--cuda yes)"
            if cuda
            else "POSENC_FAST_FORCE_CUDA is set"
            if cuda is None and _cache.flag("POSENC_FAST_FORCE_CUDA")
            else None
        ),
        cxx11_abi=getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None),
        source_root=_cache.source_root(),
        sanitize=_cache.sanitizers(),
    )
    if plan["cuda"]["build"]:
        _cfg.use_toolkit(cpp_extension, plan["toolkit"])
    out: dict[str, dict[str, Any]] = {}
    for part in _cache.PARTS:
        result: dict[str, Any] = {"built": None, "skipped": None, "error": None}
        out[part] = result
        if part == "cuda" and not plan["cuda"]["build"]:
            result["skipped"] = plan["cuda"]["record"]["cuda_decision"]
            continue
        package_ok = not _cache.record_reasons(
            part, _cache.read_build_info(part), _cache.binary_path(part)
        )
        if part == "cpu" and not force and package_ok:
            result["skipped"] = (
                f"the package's own build {_cache.binary_path(part)} is valid for this torch "
                "(--force builds into the cache anyway)"
            )
            continue
        if part == "cuda" and out["cpu"]["error"]:
            result["skipped"] = "the CPU part failed to build"
            continue
        path, why = build_part(part, force=force, verbose=verbose, plan=plan)
        result["built"], result["error"] = (str(path), None) if path else (None, why)
    return out
