"""Command line: ``python -m posenc_fast {info,build,verify,bench}``.

The first paragraph is the parser's description; each subcommand: its module (info.py, ...).
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m posenc_fast", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser(
        "info", help="backends, versions, and why unavailable backends are unavailable"
    )
    info.add_argument("--json", action="store_true", help="print JSON instead of text")

    build = sub.add_parser(
        "build",
        help="compile the C++ extension for this torch into the user cache (what the first "
        "use otherwise does)",
    )
    build.add_argument(
        "--cuda",
        choices=("auto", "yes", "no"),
        default="auto",
        help="the CUDA part: where torch has CUDA and torch finds a toolkit (auto; "
        "POSENC_FAST_BUILD=cpu|cuda make it no|yes), attempted in any case (yes), not built (no)",
    )
    build.add_argument(
        "--force",
        action="store_true",
        help="rebuild from scratch into the cache, and use that build even where the package "
        "has its own",
    )

    verify = sub.add_parser("verify", help="every usable backend against the float64 reference")
    verify.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    verify.add_argument("--seed", type=int, default=None, help="random seed (default: fresh)")
    verify.add_argument(
        "--ops",
        default="all",
        help="comma-separated subset of lff,encoding,encoding_nd,lff_rotary,apply_lff_rotary,"
        "floater",
    )

    bench_arguments(sub.add_parser("bench", help="time every implementation side by side"))
    return p


def bench_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``bench`` (benchmarks/cpu_lab.py adds its own to the same set)."""
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--quick", action="store_true", help="small size set (about a minute on 2 CPU cores)"
    )
    p.add_argument(
        "--ops",
        default="all",
        help="comma-separated subset of lff,sinusoidal,dft,floater,rotary (LightGlue's and the "
        "grid families': --families); 'all' (the default) is every op but rotary, which runs "
        "only when named",
    )
    p.add_argument(
        "--families",
        default=None,
        help="rotary: comma-separated subset of lightglue,axial,mixed,dinov3,nd (default: all)",
    )
    p.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated subset of fwd,fwd+bwd")
    p.add_argument(
        "--floater-sizes",
        metavar="LxD,...",
        default=None,
        help="FLOATER cases as (sample times L) x (d = H) pairs, replacing the default set, "
        "e.g. 512x64,512x512 (benchmarks/RESULTS.md's FLOATER table)",
    )
    p.add_argument(
        "--json", metavar="PATH", help="save the results (with machine, versions, git SHA)"
    )
    p.add_argument(
        "--plot", metavar="PATH", help="draw time against size as a PNG (needs matplotlib)"
    )
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument(
        "--max-autotune", action="store_true", help="also time torch.compile(mode='max-autotune')"
    )
    p.add_argument(
        "--compile-timeout",
        type=float,
        default=300.0,
        help="seconds one torch.compile may take before it is recorded as unfinished",
    )
    p.add_argument(
        "--min-time", type=float, default=None, help="seconds of timed runs per measurement"
    )
    p.add_argument(
        "--threads",
        default=None,
        help="comma-separated torch thread counts to run at, e.g. 1,2 (default: torch's)",
    )
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "info":
        from .info import run
    elif args.command == "build":
        from .build import run
    elif args.command == "verify":
        from .verify import run
    else:
        from .bench import run
    try:
        return run(args)
    except BrokenPipeError:  # e.g. `... info | head`: stop quietly, like other CLI tools
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
