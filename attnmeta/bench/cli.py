"""The ``bench`` sub-command of ``python -m attnmeta``: its options, their checks, and the run.

:func:`add_arguments` registers the options on an :mod:`argparse` parser (``--scenario`` accepts
exactly the names of :func:`attnmeta.bench.scenario_names` and lists them in ``--help``);
:func:`argument_error` says what is wrong with parsed options before anything runs (``--plot``
without matplotlib); :func:`run_from_args` runs the bench and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import textwrap

import torch

from attnmeta.bench.report import PlotUnavailableError, format_table, plot, require_matplotlib, write_json
from attnmeta.bench.suite import run_bench, scenario_names

__all__ = ["CPU_NOTE", "DESCRIPTION", "add_arguments", "argument_error", "run_from_args"]

DESCRIPTION = """\
Side-by-side host timings of whole metadata steps, in one process. Each scenario builds
the same metadata several ways, interleaved in blocks of 16 steps:

  attnmeta    host derivation written into a pinned slot, ONE packed copy, the objects
  fused       (decode, spec-decode-k3) FusedStepBuilder: the same objects in one call
  reference   device-side computations from raw uploads, scalars read back (the old way)
  per-tensor  attnmeta's host arrays, each uploaded through its own pinned tensor

Reported per path: host microseconds per step (median, p99), GPU->CPU syncs, H2D copies
and bytes per step, staging waits. Compare paths within one run: absolute times belong
to the machine that produced them. The builder:<name> scenarios time every registered
builder's generic build against its reference, at three sizes of a mixed step.
"""
"""The plain-text description ``python -m attnmeta bench --help`` prints."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the ``bench`` sub-command's options on ``p``, and list the scenario names in its epilog
    (``p`` should use :class:`argparse.RawDescriptionHelpFormatter`).

    Parameters
    ----------
    p : argparse.ArgumentParser
        The sub-command's parser.
    """
    names = scenario_names()
    p.epilog = "scenarios:\n" + textwrap.fill(", ".join(names), width=88, initial_indent="  ", subsequent_indent="  ",
                                              break_on_hyphens=False, break_long_words=False)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present, else cpu)")
    p.add_argument("--scenario", action="append", default=None, metavar="NAME",
                   help="run only the scenario NAME (repeatable; default: all; the names are listed below)")
    p.add_argument("--quick", action="store_true", help="smoke run: few repetitions, small batches")
    p.add_argument("--reps", type=int, default=None, help="timed steps per path (default 200; with --quick 5)")
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help="write the rows as JSON to FILE (benchmarks/report.py turns it into a table)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="write a log-log plot of host time against batch size, one panel per scenario "
                        "(needs matplotlib: pip install 'attnmeta[plot]')")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def argument_error(args: argparse.Namespace) -> str | None:
    """What is wrong with parsed ``bench`` options, before anything runs; None when nothing is.

    Parameters
    ----------
    args : argparse.Namespace
        From a parser :func:`add_arguments` set up.

    Returns
    -------
    str or None
        A message for ``parser.error``: a ``--scenario`` no scenario is named (checked here, after
        ``--import`` has registered the user's builders, not by the parser), ``--plot`` without matplotlib
        (with how to install it), a ``--reps`` below 1, a ``--json`` file whose folder does not exist.
        A scenario named twice is dropped from ``args.scenario`` (it runs once).
    """
    names = scenario_names()
    if args.scenario:  # (a scenario named twice runs once)
        args.scenario = list(dict.fromkeys(args.scenario))
    unknown = [n for n in args.scenario or () if n not in names]
    if unknown:
        return (f"--scenario: no scenario named {', '.join(map(repr, unknown))}; the scenarios: "
                f"{', '.join(names)} (a builder of your own: pass its module with --import)")
    if args.reps is not None and args.reps < 1:
        return f"--reps: {args.reps} timed steps; give at least 1"
    for flag, path in (("--json", args.json_path), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not os.path.isdir(folder):
            return f"{flag} {path}: the folder {folder} does not exist"
    if args.plot:
        try:
            require_matplotlib()
        except PlotUnavailableError as e:
            return f"--plot: {e}"
    return None


CPU_NOTE = ("note: on a CPU device an upload is a host memcpy, with no transfer and no sync to pay, so the "
            "per-tensor path's many small uploads cost almost nothing here and the reference path's reads are "
            "free; the comparison that matters is on cuda (python -m attnmeta bench --device cuda)")
"""Printed under the table of a bench on a CPU device."""


def run_from_args(args: argparse.Namespace) -> int:
    """Run the bench from parsed options; print the table; write the JSON and the plot if asked.

    Parameters
    ----------
    args : argparse.Namespace
        From a parser :func:`add_arguments` set up (checked with :func:`argument_error` first).

    Returns
    -------
    int
        The exit status (0).
    """
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = run_bench(device=device, scenarios=args.scenario, quick=args.quick, reps=args.reps,
                     progress=not args.no_progress)
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "cpu"
    print(f"attnmeta bench on {device} ({name}); torch {torch.__version__}; host times in microseconds")
    print(format_table(rows))
    if not device.startswith("cuda"):
        print(CPU_NOTE)
    if args.json_path:
        write_json(args.json_path, rows, device=device, device_name=name)
    if args.plot:
        plot(rows, args.plot, title=f"attnmeta bench, {name}, {datetime.date.today().isoformat()}")
    return 0
