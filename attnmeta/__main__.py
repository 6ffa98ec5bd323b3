"""``python -m attnmeta demo | bench | audit``.

- ``demo``: build the metadata of a built-in mixed batch and print every field readably.
- ``bench``: side-by-side host timings (see ``python -m attnmeta bench --help``).
- ``audit``: run every registered builder under the sync audit and print a table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m attnmeta``; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m attnmeta", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_demo = sub.add_parser("demo", help="print the metadata of a built-in mixed batch")
    p_demo.add_argument("--device", default=None, help="cuda, cpu or meta (default: cuda if present, else cpu)")
    p_demo.add_argument("--limit", type=int, default=16, help="values shown per array (default 16)")
    p_bench = sub.add_parser("bench", help="side-by-side host timings of attnmeta vs the reference paths")
    from attnmeta.bench import add_arguments as bench_args

    bench_args(p_bench)
    p_audit = sub.add_parser("audit", help="run every builder under the sync audit")
    p_audit.add_argument("--device", default=None, help="meta (default on CPU) or cuda")
    p_audit.add_argument("--batches", type=int, default=50, help="generated batches per builder (default 50)")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from attnmeta.demo import run_demo

        print(run_demo(args.device or _default_device(), limit=args.limit))
        return 0
    if args.cmd == "bench":
        from attnmeta.bench import run_from_args

        return run_from_args(args)
    if args.cmd == "audit":
        from attnmeta.audit import run_audit_cli

        return int(run_audit_cli(device=args.device, batches=args.batches))
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
