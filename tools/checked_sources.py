"""The portability checks, each run once per state of what it reads.

CI's checks of platforms this machine is not (the CUDA sources for every GPU architecture,
the C++ CPU sources for aarch64, the Triton kernels under older Tritons), ThreadSanitizer
over the CUDA emulation and the oldest torch installed as a user installs it give the same
answer for the same inputs: the files they compile or install and the tools' versions. A
passing run appends the SHA-256 of those inputs (its key) to tools/checked_sources.tsv, with
the date, the commit and its time; a later run whose key is there is skipped with that
line, and any change to an input (a source, the check's own script, a compiler version)
makes a new key and the check runs again. So CI pays for a check when its sources changed
without the check having been run and recorded, not on every commit:

    python tools/checked_sources.py run cuda          # skip if recorded, else run and record
    python tools/checked_sources.py run --all         # every check (before committing a
                                                      # change to the package or its kernels)
    python tools/checked_sources.py key cuda          # the key alone
    python tools/checked_sources.py skip oldest-torch # exit 0 (and say so) if recorded
    python tools/checked_sources.py run --all --except oldest-torch
    CHECKED_SOURCES_FORCE=1 ...                       # run even if recorded

Exit status: the check's (0 when skipped). Run with the venv's python (tools/setup_venv.sh):
the keys include torch's version, whose headers the C++ checks compile against.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "tools" / "checked_sources.tsv"
CUDA_ARCHS = ("80", "86", "89", "90", "100", "120")
TRITONS = ("3.1.0", "3.6.0")  # torch 2.5's pin, torch 2.10/2.11's


def _tool_version(*cmd: str) -> str | None:
    """The first line of a tool's --version, or None where the tool is missing."""
    if shutil.which(cmd[0]) is None and not os.path.isfile(cmd[0]):
        return None
    out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, check=False)
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[-1] if cmd[0].endswith("nvcc") else (lines[0] if lines else None)


@functools.cache
def _torch_version() -> str:
    import torch

    return torch.__version__


def _nvcc() -> str:
    sys.path.insert(0, str(ROOT / "posenc_fast"))  # _build_config is torch-free
    import _build_config

    root = _build_config.find_cuda_toolkit()["root"]
    return os.path.join(root, "bin", "nvcc") if root else "nvcc"


def _cuda() -> dict:
    return {
        "inputs": ["csrc", "posenc_fast/_build_config.py", "tools/check_cuda_compile.sh"],
        "tools": {
            "nvcc": _tool_version(_nvcc()),
            "g++": _tool_version("g++"),
            "torch": _torch_version(),
        },
        "command": ["tools/check_cuda_compile.sh", *CUDA_ARCHS],
    }


def _debian() -> str:
    try:
        return "Debian " + Path("/etc/debian_version").read_text().strip()
    except OSError:
        return "not Debian"


def _aarch64() -> dict:
    # CI installs Debian's cross compiler when it runs this check (it is not on a fresh
    # machine), so the key cannot ask it its version: it names the native g++ and the Debian
    # release instead, whose aarch64 cross compiler is built from the same GCC
    cxx = os.environ.get("CXX_AARCH64", "aarch64-linux-gnu-g++")
    command = ["tools/check_cpu_compile_aarch64.sh"]
    if shutil.which(cxx) is None and os.geteuid() == 0:  # Debian's cross compiler (56 MB)
        install = "apt-get install -y -q g++-aarch64-linux-gnu > /dev/null"
        script = f"{install} || {{ apt-get update -q > /dev/null && {install}; }}; exec $0"
        command = ["bash", "-c", script, *command]
    return {
        "inputs": ["csrc", "posenc_fast/_build_config.py", "tools/check_cpu_compile_aarch64.sh"],
        "tools": {"g++": _tool_version("g++"), "os": _debian(), "torch": _torch_version()},
        "command": command,
    }


def _triton(version: str) -> dict:
    # The Triton wheel alone in a folder of its own, over the venv's torch: no torch download
    script = (
        "target=$(mktemp -d) && trap 'rm -rf \"$target\"' EXIT && "
        f'"$0" -m pip install -q --no-deps --target "$target" triton=={version} && '
        'env -u TRITON_INTERPRET PYTHONPATH="$target" "$0" '
        "tools/triton_compile_report.py --arch 80,90 --filter '^lff_'"
    )
    return {
        "inputs": ["triton_kernels", "tools/triton_compile_report.py"],
        "tools": {"triton": version, "torch": _torch_version()},
        "command": ["bash", "-c", script, sys.executable],
    }


def _triton_venv() -> dict:
    """The suite's compile test (tests/common/test_triton_compile.py) under the venv's own
    Triton: every kernel, one configuration each, for sm_80 and sm_90."""
    test = "tests/common/test_triton_compile.py"
    try:
        from importlib.metadata import version

        triton = version("triton")
    except Exception:  # not installed: no key, the test says why it skips
        triton = None
    return {
        "inputs": ["triton_kernels", "tools/triton_compile_report.py", test],
        "tools": {"triton": triton, "torch": _torch_version()},
        "command": [
            *("env", "POSENC_FAST_COMPILE_TEST=1", sys.executable, "-m", "pytest"),
            *("-q", "-n", "0", "-p", "no:cacheprovider", "-rs"),
            f"{test}::test_kernels_compile_for_sm80_and_sm90_without_approximate_trig",
        ],
    }


_EMULATION_TEST = "tests/floater/test_extension_cuda_emulation.py"


def _tsan() -> dict:
    return {
        "inputs": ["csrc", "tools/cuda_emulation", "tools/check_sanitizers.sh", _EMULATION_TEST],
        "tools": {"g++": _tool_version("g++")},
        "command": ["tools/check_sanitizers.sh", "--quick", "tsan"],
    }


def _oldest_torch() -> dict:
    """The oldest torch the README claims, installed as a user installs it
    (tools/check_oldest_torch.sh: import, the plain install's first-use build, verify). It
    reads the whole package as a plain `pip install .` ships it, the build and its test,
    and asks pip for torch $OLDEST_TORCH; the CUDA part's refusal names the toolkit."""
    return {
        "inputs": [
            *("posenc_fast", "triton_kernels", "csrc"),
            *("setup.py", "pyproject.toml", "MANIFEST.in"),
            *("tests/conftest.py", "tests/common/test_extension_build.py"),
            "tools/check_oldest_torch.sh",
        ],
        "tools": {
            "python": _tool_version("python3"),
            "g++": _tool_version("g++"),
            "nvcc": _tool_version(_nvcc()) or "none",
            "torch": os.environ.get("OLDEST_TORCH", "2.5.1"),
        },
        "command": ["tools/check_oldest_torch.sh"],
    }


CHECKS = {
    "cuda": _cuda,
    "aarch64": _aarch64,
    "triton": _triton_venv,
    **{f"triton-{v}": (lambda v=v: _triton(v)) for v in TRITONS},
    "tsan": _tsan,
    "oldest-torch": _oldest_torch,
}


def _files(inputs: list[str]) -> list[Path]:
    """The inputs' files as git sees them (tracked, or untracked and not ignored): build
    outputs and caches beside the sources do not change a key."""
    listing = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--"]
    out = subprocess.run([*listing, *inputs], cwd=ROOT, capture_output=True, check=True)
    names = sorted({n for n in out.stdout.decode().split("\0") if n})
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def key(spec: dict) -> str | None:
    """SHA-256 of the inputs' paths and contents and the tools' versions; None where a tool
    is missing (the check must run: it may install it)."""
    if any(v is None for v in spec["tools"].values()):
        return None
    digest = hashlib.sha256()
    for name, version in sorted(spec["tools"].items()):
        digest.update(f"{name}={version}\n".encode())
    for path in _files(spec["inputs"]):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def recorded(check: str, digest: str | None) -> str | None:
    """The record's line of a passing run of ``check`` on inputs of that key, if any."""
    if digest is None or not RECORD.is_file():
        return None
    for line in RECORD.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 2 and fields[0] == check and fields[1] == digest:
            return line
    return None


def _commit() -> str:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip()

    # the record itself does not count as a change (it changes with every pass)
    dirty = git(
        "status",
        "--porcelain",
        "--untracked-files=no",
        "--",
        ".",
        f":!{RECORD.relative_to(ROOT).as_posix()}",
    )
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+changes" if dirty else "")


def skip(check: str, digest: str | None) -> bool:
    """Whether ``check`` may be skipped: its inputs (of key ``digest``) passed before and no
    run is forced; says when and where."""
    line = recorded(check, digest)
    if not line or os.environ.get("CHECKED_SOURCES_FORCE") == "1":
        return False
    _, _, date, commit, seconds, *_ = line.split("\t")
    where = f"{seconds} s; key {digest[:12]}, tools/checked_sources.tsv"
    print(f"== {check}: skipped: these inputs passed on {date} at {commit} ({where})")
    return True


def run(check: str) -> int:
    spec = CHECKS[check]()
    digest = key(spec)
    if skip(check, digest):
        return 0
    shown = digest[:12] if digest else "unknown: a tool is missing"
    print(f"== {check}: {' '.join(spec['command'][:2])} ... (key {shown})", flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(spec["command"], cwd=ROOT, check=False).returncode
    seconds = round(time.monotonic() - t0)
    print(f"== {check}: rc {rc} in {seconds} s")
    if rc == 0:
        spec = CHECKS[check]()  # a tool the check installed is in the key now
        after = key(spec)
        if digest is not None and after != digest:
            print(f"== {check}: its inputs changed while it ran: not recorded")
        elif after and not recorded(check, after):
            date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
            tools = ", ".join(f"{k} {v}" for k, v in sorted(spec["tools"].items()))
            with RECORD.open("a") as f:
                f.write(f"{check}\t{after}\t{date}\t{_commit()}\t{seconds}\t{tools}\n")
    return rc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verb", choices=("run", "key", "skip"))
    parser.add_argument("checks", nargs="*", help=", ".join(CHECKS))
    parser.add_argument("--all", action="store_true", help="every check")
    parser.add_argument("--except", dest="but", action="append", default=[],
                        metavar="CHECK", help="with --all: not this one (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    checks = [c for c in CHECKS if c not in args.but] if args.all else args.checks
    unknown = [c for c in [*checks, *args.but] if c not in CHECKS]
    if not checks or unknown:
        parser.error(f"name checks among {', '.join(CHECKS)}, or --all (got {unknown or 'none'})")
    if args.verb == "key":
        for check in checks:
            print(check, key(CHECKS[check]()) or "unknown: a tool is missing")
        return 0
    if args.verb == "skip":  # exit 0 only when every check named may be skipped
        return 0 if all([skip(check, key(CHECKS[check]())) for check in checks]) else 1
    return max(run(check) for check in checks)


if __name__ == "__main__":
    sys.exit(main())
