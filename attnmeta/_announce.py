"""``python -m attnmeta demo`` and ``audit`` say so on standard error before anything slow is imported.

The package's ``__init__`` imports this module first: torch and numba take seconds to import, and a
first run then compiles kernels, so without a word the command would look hung. ``sys.orig_argv`` is
the command line as given; nothing is printed for any other way of importing attnmeta (a program's
``import attnmeta``, ``python -m attnmeta`` with another command, ``--help``).
"""

from __future__ import annotations

import sys

__all__ = ["announce"]

COMMANDS = ("demo", "audit")


def announce(argv: tuple[str, ...] | list[str]) -> str | None:
    """The line to print first for the command line ``argv`` (``sys.orig_argv``), or None.

    Examples
    --------
    >>> announce(["python3", "-m", "attnmeta", "demo", "--device", "cpu"])
    'python -m attnmeta demo: loading torch and numba ...'
    >>> announce(["python3", "-m", "attnmeta", "demo", "--help"]) is None, announce(["python3", "app.py"]) is None
    (True, True)
    """
    if "-m" not in argv:
        return None
    rest = list(argv[list(argv).index("-m") + 1 :])
    if rest[:1] != ["attnmeta"] or len(rest) < 2 or rest[1] not in COMMANDS or {"-h", "--help"} & set(rest):
        return None
    return f"python -m attnmeta {rest[1]}: loading torch and numba ..."


_line = announce(getattr(sys, "orig_argv", ()))
if _line is not None:
    sys.stderr.write(_line + "\n")
    sys.stderr.flush()
