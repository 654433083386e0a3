"""Build settings of the compiled extension (csrc/), shared by the ahead-of-time build
(setup.py) and the first-use build into the user cache (``posenc_fast._extension_build``),
and the build metadata both record beside each binary (read by
``posenc_fast._extension_cache`` before loading it)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig

# The extension is two Python modules, built and loaded independently, so that the CPU part
# never depends on the CUDA part building:
#
# - ``posenc_fast._C`` (CPU_SOURCES): the C++ CPU kernels; defines the ops. Built whenever a
#   C++ compiler is present; record ``_build_info.json``.
# - ``posenc_fast._C_cuda`` (CUDA_SOURCES): the CUDA kernels of the same ops. Built when torch
#   has CUDA and a matching toolkit is found (:func:`find_cuda_toolkit`,
#   :func:`cuda_decision`); record ``_build_info_cuda.json``, also when it was not built or
#   failed (it says why).
#
# Torch-free and import-free within the package: setup.py executes this file on its own
# (importing ``posenc_fast`` would import torch, which an isolated build does not have).
# Why each compiler flag is there: the table in setup.py's docstring.

# Relative to the source root (the directory that holds csrc/ and setup.py).
# The CPU module posenc_fast._C: every C++ CPU kernel and op registration goes here.
# One folder per op (its ops.cpp registration, cpu.cpp driver, kernels), the CPU runtime in
# csrc/cpu/ (headers only). Base names are unique: the JIT build names objects after them.
CPU_SOURCES = (
    "csrc/module.cpp",
    "csrc/floater/floater_ops.cpp",
    "csrc/floater/floater_cpu.cpp",
    "csrc/lff/lff_ops.cpp",
    "csrc/lff/lff_cpu.cpp",
    "csrc/encodings/encodings_ops.cpp",
    "csrc/encodings/encodings_cpu.cpp",
    "csrc/rotary/rotary_ops.cpp",
    "csrc/rotary/rotary_cpu.cpp",
)
# The CUDA module posenc_fast._C_cuda (registers CUDA kernels of ops that _C defines).
CUDA_SOURCES = (
    "csrc/module_cuda.cpp",
    "csrc/floater/floater_cuda_ops.cpp",
    "csrc/floater/floater_cuda.cu",
)
# part -> (module name within the package, build record beside it)
PARTS = {
    "cpu": ("_C", "_build_info.json"),
    "cuda": ("_C_cuda", "_build_info_cuda.json"),
}
BUILD_INFO = PARTS["cpu"][1]
CUDA_BUILD_INFO = PARTS["cuda"][1]

# What the sources hash covers: every file the compiler reads from csrc/ (README.md is not
# read). Installed packages carry the same files as package data (posenc_fast/csrc/).
SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")


def sources_hash(source_root: str | os.PathLike) -> str | None:
    """SHA-256 of csrc/ under ``source_root`` (relative paths and contents, in sorted
    order), or None where there is no csrc/. Recorded at build time, so a binary built from
    other sources (an edited checkout, a copied binary) is recognised as stale, and part of
    the user cache's key, so a first-use build is never reused for other sources."""
    csrc = os.path.join(os.fspath(source_root), "csrc")
    if not os.path.isfile(os.path.join(csrc, "module.cpp")):
        return None
    digest = hashlib.sha256()
    files = []
    for folder, _dirs, names in os.walk(csrc):
        files += [os.path.join(folder, n) for n in names if n.endswith(SOURCE_SUFFIXES)]
    for path in sorted(files, key=lambda p: os.path.relpath(p, csrc).replace(os.sep, "/")):
        digest.update(os.path.relpath(path, csrc).replace(os.sep, "/").encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
        digest.update(b"\0")
    return digest.hexdigest()


def abi_tag(torch_version: str, cxx11_abi: bool | None) -> str:
    """What a binary of the extension is tied to: torch's version (its C++ API and ABI
    change with every release), torch's C++ standard library ABI, the Python ABI and the
    machine architecture. The kernels choose their instruction set at run time
    (csrc/cpu/isa.h), so one binary serves every CPU of an architecture. Recorded at build
    time; a binary whose tag differs from the running process's is never loaded."""
    abi = "unknown" if cxx11_abi is None else int(bool(cxx11_abi))
    return (
        f"torch{torch_version}-cxx11abi{abi}-{sys.implementation.cache_tag}-"
        f"{platform.machine() or 'unknown'}"
    )


# Default CUDA targets: A100 (8.0), A10/RTX 30xx (8.6), L4/L40/RTX 40xx (8.9), H100/H200
# (9.0); B200 (10.0) and RTX 50xx / RTX PRO 6000 (12.0) where both the toolkit and torch's
# CUDA know them (12.8 and newer); PTX of the newest for GPUs after it.
CUDA_ARCHS = ("8.0", "8.6", "8.9", "9.0")
CUDA_ARCHS_SINCE_12_8 = ("10.0", "12.0")


# POSENC_FAST_SANITIZE=address,undefined: the CPU part built with AddressSanitizer and
# UndefinedBehaviorSanitizer (tools/check_sanitizers.sh). Such a binary only loads into a
# process whose sanitizer runtime came first (LD_PRELOAD of libasan), so it is cached under
# its own key and recorded: no other process ever loads it.
SANITIZE_ENV = "POSENC_FAST_SANITIZE"
SANITIZERS = ("address", "undefined")


def sanitizers(environ=None) -> tuple[tuple[str, ...], str | None]:
    """(the sanitizers POSENC_FAST_SANITIZE asks for, sorted; None or why the value is
    refused). Empty, "0", "no" or "off": none."""
    env = os.environ if environ is None else environ
    raw = (env.get(SANITIZE_ENV) or "").strip().lower()
    if raw in ("", "0", "no", "off", "false"):
        return (), None
    names = tuple(sorted({n.strip() for n in raw.split(",") if n.strip()}))
    unknown = [n for n in names if n not in SANITIZERS]
    if unknown:
        return (), (
            f"{SANITIZE_ENV}={raw!r}: {', '.join(map(repr, unknown))} is not a sanitizer the "
            f"build offers ({', '.join(SANITIZERS)})"
        )
    return names, None


def sanitizer_flags(names=()) -> tuple[list[str], list[str]]:
    """(compile flags, link flags) of the sanitizers ``names``. -O1 -g: what the sanitizers'
    own documentation recommends (reports name source lines; the build takes a third of
    -O3's time); every undefined behaviour is fatal (the first report fails the run)."""
    if not names:
        return [], []
    flag = "-fsanitize=" + ",".join(names)
    cxx = ["-O1", "-g", flag, "-fno-omit-frame-pointer"]
    if "undefined" in names:
        cxx.append("-fno-sanitize-recover=undefined")
    cxx.append("-DPOSENC_FAST_SANITIZE=" + "_".join(names))
    return cxx, [flag]


def cxx_flags(debug: bool = False, sanitize=()) -> list[str]:
    """Host compiler flags (sanitize: see :func:`sanitizer_flags`, which replaces -O3)."""
    san, _ = sanitizer_flags(sanitize)
    opt = ["-O0", "-g"] if debug else [] if san else ["-O3"]
    return [*opt, *san, "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]


def cpu_ldflags(sanitize=()) -> list[str]:
    """Link flags of the CPU part."""
    return ["-fopenmp", *sanitizer_flags(sanitize)[1]]


def nvcc_flags(debug: bool = False) -> list[str]:
    """nvcc flags (device code)."""
    return [*(["-O0", "-G"] if debug else ["-O3"]), "-lineinfo", "-std=c++17"]


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def default_cuda_archs(toolkit_release: str | None, torch_cuda_version: str | None) -> str:
    """TORCH_CUDA_ARCH_LIST when the user sets none: sm_80 .. sm_90, plus sm_100 and sm_120
    where the toolkit and torch's CUDA (when torch has one) are 12.8 or newer (older
    toolkits cannot compile for them, older torch rejects their names); +PTX on the newest."""
    versions = [_version_tuple(toolkit_release)]
    if torch_cuda_version is not None:
        versions.append(_version_tuple(torch_cuda_version))
    archs = list(CUDA_ARCHS)
    if all(v is not None and v >= (12, 8) for v in versions):
        archs += CUDA_ARCHS_SINCE_12_8
    return ";".join(archs) + "+PTX"


def resolve_cuda_archs(default: str) -> str:
    """TORCH_CUDA_ARCH_LIST, or ``default``, set in the environment: torch reads it, and
    unset it would ask a GPU for its architecture."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or default
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    return archs


def find_cxx(environ=None) -> tuple[str | None, str]:
    """(path of the C++ compiler torch's builds run, or None; what was looked for): $CXX,
    else ``c++`` on PATH (torch.utils.cpp_extension's own choice)."""
    env = os.environ if environ is None else environ
    name = (env.get("CXX") or "c++").split()[0]
    path = shutil.which(name, path=env.get("PATH"))
    if path is None:
        where = "CXX" if env.get("CXX") else "PATH"
        return None, f"no C++ compiler found ({name!r} from {where})"
    return path, f"C++ compiler {path}"


def _toolkit_problem(root: str) -> str | None:
    """Why ``root`` is not a CUDA toolkit's root directory (None: it is one)."""
    for rel in (os.path.join("include", "cuda_runtime.h"), os.path.join("bin", "nvcc")):
        if not os.path.isfile(os.path.join(root, rel)):
            return f"no {os.path.join(root, rel)}"
    return None


def find_cuda_toolkit(environ=None, default: str = "/usr/local/cuda") -> dict:
    """Where the CUDA toolkit is, without asking a GPU. Tried in order: $CUDA_HOME, then
    $CUDA_PATH (respected: when set and wrong, that is the answer, not a guess elsewhere);
    the directory above the ``nvcc`` on PATH, symlinks resolved; ``default``. A candidate
    counts only if it has include/cuda_runtime.h and bin/nvcc: an nvcc that is a wrapper
    script outside the toolkit (e.g. /usr/local/bin/nvcc) is not taken for one.

    Returns {"root": resolved path or None, "how": how it was found, or why none was,
    "problems": [candidates that were pointed at (variable, nvcc on PATH) but rejected]}.
    """
    env = os.environ if environ is None else environ
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = env.get(var)
        if value:
            root = os.path.realpath(value)
            problem = _toolkit_problem(root)
            if problem is None:
                return {"root": root, "how": f"{var}={value}", "problems": []}
            why = f"{var}={value} is not a CUDA toolkit ({problem})"
            return {"root": None, "how": why, "problems": [why]}
    problems = []
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc is not None:
        real = os.path.realpath(nvcc)
        root = os.path.dirname(os.path.dirname(real))
        problem = _toolkit_problem(root)
        shown = nvcc if real == nvcc else f"{nvcc} -> {real}"
        if problem is None:
            return {"root": root, "how": f"nvcc on PATH ({shown})", "problems": []}
        problems.append(f"the nvcc on PATH ({shown}) is not inside a CUDA toolkit ({problem})")
    root = os.path.realpath(default)
    problem = _toolkit_problem(root)
    if problem is None:
        how = "; ".join([default if root == default else f"{default} -> {root}", *problems])
        return {"root": root, "how": how, "problems": []}
    why = "; ".join(["no CUDA toolkit found (set CUDA_HOME)", *problems, problem])
    return {"root": None, "how": why, "problems": problems}


def cuda_decision(
    torch_version: str,
    torch_cuda_version: str | None,
    toolkit: dict,
    toolkit_release: str | None,
) -> dict:
    """Whether to build the CUDA part, from torch's build and the toolkit only (never a GPU):
    {"build": bool, "why": str, "warn": bool}. warn: the CUDA part is wanted (torch has CUDA)
    and a toolkit was pointed at, but it cannot be used: say so loudly at install time."""
    if torch_cuda_version is None:
        why = f"torch {torch_version} is built without CUDA"
        return {"build": False, "why": why, "warn": False}
    root = toolkit.get("root")
    if root is None:
        return {"build": False, "why": toolkit["how"], "warn": bool(toolkit.get("problems"))}
    have, want = _version_tuple(toolkit_release), _version_tuple(torch_cuda_version)
    if have is not None and want is not None and have[0] != want[0]:
        why = (
            f"the CUDA toolkit at {root} is CUDA {toolkit_release}, torch {torch_version} was "
            f"built with CUDA {torch_cuda_version}: torch builds no extension against another "
            f"major version (point CUDA_HOME at a CUDA {want[0]}.x toolkit)"
        )
        return {"build": False, "why": why, "warn": True}
    release = toolkit_release or "of unknown version"
    why = f"torch CUDA {torch_cuda_version}, toolkit CUDA {release} at {root} ({toolkit['how']})"
    return {"build": True, "why": why, "warn": False}


def error_summary(text: str | None, limit: int = 400) -> str:
    """A build error as one line for a reason or a warning: the compiler's or linker's first
    error where the text carries their output (JIT builds do), else the text itself."""
    text = text or ""
    errors = [
        line.strip()
        for line in text.splitlines()
        if re.search(r"(?:^|[\s:])(?:fatal )?error:|cannot find -l", line)
    ]
    line = " ".join((errors[0] if errors else text).split()) or "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def error_record(text: str, limit: int = 4000) -> str:
    """A build error as kept in a build record: whole when short, else its summary line and
    its end (a JIT build's error carries the whole compiler output)."""
    if len(text) <= limit:
        return text
    return f"{error_summary(text)}\n...\n{text[-(limit - 500) :]}"


def use_toolkit(cpp_extension, toolkit: dict) -> str | None:
    """Make torch.utils.cpp_extension build with the toolkit :func:`find_cuda_toolkit` found,
    where torch's own guess differs: torch takes the directory above the nvcc on PATH
    without resolving it, so a wrapper script (e.g. /usr/local/bin/nvcc) makes it guess a
    directory without CUDA's headers. Returns a note saying so, or None."""
    ours, theirs = toolkit["root"], getattr(cpp_extension, "CUDA_HOME", None)
    if ours is None or (theirs and os.path.realpath(theirs) == ours):
        return None
    cpp_extension.CUDA_HOME = ours
    os.environ["CUDA_HOME"] = ours
    guess = f"torch guessed CUDA_HOME={theirs}" if theirs else "torch found no CUDA_HOME"
    return f"{guess}; building with {ours} ({toolkit['how']})"


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an exception, with torch's ``RuntimeError(fmt, *args)`` style
    (its CUDA version mismatch) formatted."""
    args = exc.args
    msg = str(exc)
    if len(args) > 1 and isinstance(args[0], str) and "%s" in args[0]:
        with contextlib.suppress(TypeError):  # not a format after all: str(exc) it is
            msg = args[0] % args[1:]
    return f"{type(exc).__name__}: {msg}"


def package_version() -> str:
    scope: dict = {}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


def nvcc_version(cuda_home: str | None) -> str | None:
    if not cuda_home:
        return None
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    except Exception:
        return None
    for line in out.splitlines():
        if "release" in line:
            return line.strip()
    return None


def nvcc_release(version_line: str | None) -> str | None:
    """The release ("13.0") in nvcc's "Cuda compilation tools, release 13.0, V13.0.88"."""
    m = re.search(r"release (\d+\.\d+)", version_line or "")
    return m.group(1) if m else None


def plan_build(
    *,
    torch_version: str,
    torch_cuda_version: str | None,
    debug: bool = False,
    no_cuda: str | None = None,
    force_cuda: str | None = None,
    environ=None,
    cxx11_abi: bool | None = None,
    source_root: str | os.PathLike | None = None,
    sanitize: tuple[str, ...] = (),
) -> dict:
    """What to build and the metadata each part records (the builder adds built,
    build_time, binary or error). no_cuda / force_cuda: None, or the reason given (e.g.
    "POSENC_FAST_NO_CUDA is set") to skip the CUDA part, or to attempt it whatever the
    checks say (its failure is then handled like any other). cxx11_abi: torch's
    ``torch._C._GLIBCXX_USE_CXX11_ABI``; source_root: the directory holding csrc/ (both
    recorded: :func:`abi_tag`, :func:`sources_hash`); sanitize: :func:`sanitizers`' names,
    for the CPU part only (recorded: a sanitized binary loads only where they are asked for).

    Returns {"toolkit": find_cuda_toolkit(), "cpu": part, "cuda": part}; a part is
    {"module", "sources", "cxx", "record"}, the CPU part adds "ldflags", the CUDA part
    "build", "warn", "archs" and "nvcc" (with the toolkit root in its record)."""
    toolkit = find_cuda_toolkit(environ)
    nvcc_line = nvcc_version(toolkit["root"])
    release = nvcc_release(nvcc_line)
    if no_cuda:
        decision = {"build": False, "why": no_cuda, "warn": False}
    else:
        decision = cuda_decision(torch_version, torch_cuda_version, toolkit, release)
        if force_cuda and not decision["build"]:
            why = f"{force_cuda}, although {decision['why']}"
            decision = {"build": True, "why": why, "warn": False}
    archs = None
    if decision["build"]:
        archs = resolve_cuda_archs(default_cuda_archs(release, torch_cuda_version))
    cxx = cxx_flags(debug)
    cpu_cxx = cxx_flags(debug, sanitize)
    base = {
        "package_version": package_version(),
        "torch_version": torch_version,
        "torch_cuda_version": torch_cuda_version,
        "python_version": platform.python_version(),
        "python_abi": sysconfig.get_config_var("EXT_SUFFIX"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "debug": debug,
        "cxx_flags": cxx,
        "abi_tag": abi_tag(torch_version, cxx11_abi),
        "sources_hash": sources_hash(source_root) if source_root is not None else None,
    }
    cpu_module, cuda_module = PARTS["cpu"][0], PARTS["cuda"][0]
    cpu = {
        "module": cpu_module,
        "sources": list(CPU_SOURCES),
        "cxx": cpu_cxx,
        "ldflags": cpu_ldflags(sanitize),
        "record": dict(
            base,
            part="cpu",
            module=f"posenc_fast.{cpu_module}",
            cxx_flags=cpu_cxx,
            sanitize=list(sanitize),
        ),
    }
    cuda_cxx = [*cxx, f'-DPOSENC_FAST_CUDA_ARCHS="{archs}"'] if archs else cxx
    cuda = {
        "module": cuda_module,
        "sources": list(CUDA_SOURCES),
        "build": decision["build"],
        "warn": decision["warn"],
        "archs": archs,
        "cxx": cuda_cxx,
        "nvcc": nvcc_flags(debug),
        "record": dict(
            base,
            part="cuda",
            module=f"posenc_fast.{cuda_module}",
            attempted=decision["build"],
            cuda_decision=decision["why"],
            cuda_home=toolkit["root"],
            cuda_toolkit=nvcc_line,
            cuda_archs=archs,
            cxx_flags=cuda_cxx,
            nvcc_flags=nvcc_flags(debug) if decision["build"] else None,
        ),
    }
    return {"toolkit": toolkit, "cpu": cpu, "cuda": cuda}


def write_json_atomic(path: str | os.PathLike, record: dict) -> None:
    """Write record as JSON through a temporary file renamed over path (readers never see
    a partial file)."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
