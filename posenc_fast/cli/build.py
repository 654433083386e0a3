"""``python -m posenc_fast build``: compile the extension for the running torch into the
user cache (posenc_fast._extension.build), with progress, then report what loads."""

from __future__ import annotations

import os

from .. import _extension


def run(args) -> int:
    cuda = {"auto": None, "yes": True, "no": False}[args.cuda]
    try:
        results = _extension.build(cuda=cuda, force=args.force, verbose=args.verbose)
    except RuntimeError as exc:
        print(exc)
        return 1
    require = os.environ.get("POSENC_FAST_REQUIRE_EXTENSION", "") not in ("", "0")
    status = 0
    for part, result in results.items():
        module = _extension.module_name(part)
        if result["error"]:
            print(f"{module}: build failed: {result['error']}")
        elif result["built"]:
            print(f"{module}: ready: {result['built']}")
        else:
            print(f"{module}: not built: {result['skipped']}")
        available = _extension.load(part) is not None
        reasons = "; ".join(_extension.reasons(part))
        print(f"  loads here: {'yes' if available else 'no: ' + reasons}")
        if part == "cpu" and not available:
            status = 1  # the cpp backend is what this command is for
        if part == "cuda" and require and result["error"]:
            status = 1  # as setup.py: POSENC_FAST_REQUIRE_EXTENSION makes any failure fatal
    return status
