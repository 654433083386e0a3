"""``python -m posenc_fast build``: _extension.build, then report what loads."""

from __future__ import annotations

from .. import _extension


def run(args) -> int:
    cuda = {"auto": None, "yes": True, "no": False}[args.cuda]
    try:
        results = _extension.build(cuda=cuda, force=args.force)
    except RuntimeError as exc:
        print(exc)
        return 1
    status = 0
    for part, result in results.items():
        module = _extension.module_name(part)
        if result["path"]:
            print(f"{module}: ready: {result['path']} (from {result['source']})")
        elif result["skipped"]:
            print(f"{module}: not built: {result['skipped']}")
        else:
            print(f"{module}: build failed: {'; '.join(result['reasons'])}")
        if part == "cpu" and not result["path"]:
            status = 1  # the cpp backend is what this command is for
        if part == "cuda" and _extension.flag(_extension.REQUIRE_ENV) and not result["skipped"]:
            status = max(status, int(not result["path"]))  # any failure is fatal (CI)
    return status
