"""``python -m flexgen warmup module:function``: compile a serving model's kernels ahead of time
(``flexgen.runtime.warmup``)."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flexgen", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("warmup", help="run a function's attention calls once, filling the disk caches")
    w.add_argument("target", help="module:function; the function makes its calls, or returns an "
                                  "iterable of zero-argument callables (one call each)")
    w.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    from .errors import FlexgenError
    from .runtime.warmup import warmup
    try:
        summary = warmup(args.target, progress=not args.no_progress)
    except FlexgenError as exc:
        print(f"flexgen warmup: {exc}", file=sys.stderr)
        return 2
    calls = "" if summary["calls"] is None else f"{summary['calls']} calls, "
    print(f"flexgen warmup: {calls}{summary['kernels']} kernels in {summary['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
