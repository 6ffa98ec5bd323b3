"""``python -m attnmeta demo | bench | audit | warmup``: the command line (see :func:`main`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]

DESCRIPTION = """\
attnmeta: attention metadata derived on the host and staged in one copy per step.
Run 'python -m attnmeta COMMAND --help' for a command's options.
"""


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device_error(device: str | None, allowed: tuple[str, ...]) -> str | None:
    """Why ``--device device`` cannot be used here (None when it can): not a device of ``allowed``
    types, or a CUDA device that this machine does not have."""
    if device is None:
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device: {device!r} is not a device; use one of {', '.join(allowed)}"
    if dev.type not in allowed:
        return f"--device: {device!r}; use one of {', '.join(allowed)}"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            return (f"--device {device}: no CUDA device is available on this machine (torch {torch.__version__}, "
                    f"{build}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def _import_modules(names: Sequence[str]) -> str | None:
    """Import each module of ``--import`` (the current directory is on the path under ``python -m``);
    the error message of the first that fails, else None."""
    import importlib
    import traceback

    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # (any error of the user's module: a usage error naming it, with its cause)
            if isinstance(e, ModuleNotFoundError) and e.name == name.split(".")[0]:
                return (f"--import {name}: no module named {e.name!r} here; pass a module or package name "
                        f"importable from this directory (not a path)")
            if isinstance(e, ModuleNotFoundError) and name.endswith(".py"):
                return (f"--import {name}: a module's name, without '.py' (--import {name[:-3].replace('/', '.')})")
            where = traceback.extract_tb(e.__traceback__)[-1]
            return f"--import {name}: {type(e).__name__}: {e} (at {where.filename}:{where.lineno})"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m attnmeta``.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments (default: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status. Bad arguments exit with status 2 and an argparse-style message (a
        ``SystemExit``), before anything runs; no arguments at all print the help, with every command, on
        standard error and return 2.
    """
    parser = argparse.ArgumentParser(prog="python -m attnmeta", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    from attnmeta import __version__

    parser.add_argument("--version", action="version", version=f"attnmeta {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    imports = argparse.ArgumentParser(add_help=False)
    imports.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                         help="import this module first (repeatable), e.g. the one that registers your own "
                              "builder and its lab entry, so that the command finds them in the registry")
    args_in = list(sys.argv[1:] if argv is None else argv)
    # The modules first, so that what they register is in the parsers' help (bench's scenario list);
    # a module that fails is reported below, by its command's parser, after the arguments are parsed.
    import_error = _import_modules(imports.parse_known_args(args_in)[0].imports)
    p_demo = sub.add_parser("demo", help="print the metadata of a built-in mixed batch", parents=[imports],
                            description="Build the common metadata and every registered builder's for a built-in "
                                        "mixed batch, in one step, and print every field: where it lives, its "
                                        "dtype, shape and values.")
    p_demo.add_argument("--device", default=None, help="cuda, cpu or meta (default: cuda if present, else cpu)")
    p_demo.add_argument("--limit", type=int, default=16, help="values shown per array (default 16)")
    from attnmeta.bench.cli import DESCRIPTION as BENCH_DESCRIPTION
    from attnmeta.bench.cli import add_arguments as bench_args

    p_bench = sub.add_parser("bench", help="side-by-side host timings of attnmeta vs the ways engines do it",
                             description=BENCH_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                             parents=[imports])
    bench_args(p_bench)
    p_audit = sub.add_parser("audit", help="run every registered builder under the sync audit", parents=[imports],
                             description="Build every registered builder's metadata for generated batches under "
                                         "the sync audit and print, per builder, the syncs, pageable copies and "
                                         "device-to-host races found (all zero when clean).")
    p_audit.add_argument("--device", default=None, help="cuda, cpu or meta (default: cuda if present, else meta)")
    p_audit.add_argument("--batches", type=int, default=50,
                         help="generated batches of each kind per builder (default 50)")
    p_warm = sub.add_parser(
        "warmup", help="compile (or load from numba's cache) every kernel an engine will hit",
        formatter_class=argparse.RawDescriptionHelpFormatter, parents=[imports],
        description="Build every registered builder, the fused step builder and BatchSpec over specs that cover\n"
                    "their kernels' variants (prompts, drafts, upper bounds, padding, context parallelism; eager\n"
                    "and graph-mode stagers), so that every kernel is compiled and in numba's on-disk cache: a\n"
                    "later process with the same cache loads them instead of compiling. Prints one line per\n"
                    "stage on standard error and a summary.\n\n"
                    "Run it after installing attnmeta (e.g. in an image build), as the user and with the\n"
                    "NUMBA_CACHE_DIR the server will have; see docs/deployment.md.")
    p_warm.add_argument("--device", default="cpu", help="the device the stagers stage to (default cpu; the kernels "
                                                        "run on the host whatever it is)")
    p_warm.add_argument("--builder", action="append", default=None, metavar="NAME",
                        help="warm only this registered builder (repeatable; default: every one; BatchSpec and "
                             "the fused step builder are always warmed)")
    p_warm.add_argument("--quiet", action="store_true", help="print only the summary line")
    if not args_in:  # (no command: the commands, not only an error)
        parser.print_help(sys.stderr)
        return 2
    args, extra = parser.parse_known_args(args_in)
    command = {"demo": p_demo, "bench": p_bench, "audit": p_audit, "warmup": p_warm}[args.cmd]
    if extra:  # (the command's own usage, not the top level's)
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if import_error:
        command.error(import_error)
    if args.cmd == "demo":
        err = _device_error(args.device, ("cuda", "cpu", "meta"))
        if err:
            p_demo.error(err)
        if args.limit < 1:
            p_demo.error(f"--limit: expected an int >= 1 (values shown per array), got {args.limit}")
        from attnmeta._numba import compile_progress
        from attnmeta.bench.demo import demo_lines

        lines = demo_lines(args.device or _default_device(), limit=args.limit)
        print(next(lines), flush=True)  # the title, before anything is built (or compiled)
        with compile_progress(sys.stderr):
            rest = list(lines)
        print("\n".join(rest), flush=True)
        return 0
    if args.cmd == "bench":
        from attnmeta.bench.cli import argument_error, run_from_args

        err = _device_error(args.device, ("cuda", "cpu")) or argument_error(args)
        if err:
            p_bench.error(err)
        return run_from_args(args)
    if args.cmd == "audit":
        err = _device_error(args.device, ("cuda", "cpu", "meta"))
        if err:
            p_audit.error(err)
        if args.batches < 1:
            p_audit.error(f"--batches: expected an int >= 1 (generated batches of each kind per builder), got "
                          f"{args.batches}")
        from attnmeta.bench.audit import run_audit_cli

        return int(run_audit_cli(device=args.device, batches=args.batches))
    if args.cmd == "warmup":
        err = _device_error(args.device, ("cuda", "cpu"))
        if err:
            p_warm.error(err)
        from attnmeta.bench.warmup import warmup
        from attnmeta.builder import registry

        unknown = sorted(set(args.builder or ()) - set(registry()))
        if unknown:
            p_warm.error(f"--builder: no builder named {', '.join(map(repr, unknown))}; "
                         f"registered: {', '.join(sorted(registry()))}")
        report = warmup(progress=not args.quiet, device=args.device, builders=args.builder)
        if args.quiet:
            print(report.summary(), file=sys.stderr)
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
