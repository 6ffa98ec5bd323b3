"""The benchmark scripts' ``--device`` argument, checked when it is parsed (shared by the scripts in
``benchmarks/``): a device this machine has, so that ``--device cuda`` on a machine without CUDA is a
usage error that says so, before any model or package is loaded, not a traceback from torch."""

from __future__ import annotations

import argparse

import torch


def device_arg(value: str) -> str:
    """``argparse`` ``type=`` of ``--device``: ``value`` itself when it names a ``cpu``, ``meta`` or
    (where a CUDA device is present) ``cuda`` device.

    >>> device_arg("cpu")
    'cpu'
    >>> device_arg("xpu")
    Traceback (most recent call last):
    ...
    argparse.ArgumentTypeError: 'xpu': expected cpu, cuda or meta
    """
    try:
        dev = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected cpu, cuda or meta") from None
    if dev.type not in ("cpu", "cuda", "meta"):
        raise argparse.ArgumentTypeError(f"{value!r}: expected cpu, cuda or meta")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{value}: no CUDA device is available here (torch {torch.__version__}); "
                                         "use --device cpu")
    return value
