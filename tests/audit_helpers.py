"""Helpers shared by the kernel checks (tests/gpu, tests/kernels); importable from any test module
(``tests/`` is on the path: pytest prepends the directory of the root ``conftest.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from attnmeta.sync import no_device_sync


@contextmanager
def sync_error_mode() -> Iterator[None]:
    """torch's own sync debug mode at "error" (CUDA): a synchronising call torch sees raises."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


@contextmanager
def audited() -> Iterator[None]:
    """attnmeta's audit (host reads, unsafe copies), plus :func:`sync_error_mode` where CUDA is
    present, so a sync torch sees inside a kernel raises too."""
    if not torch.cuda.is_available():
        with no_device_sync():
            yield
        return
    with sync_error_mode(), no_device_sync():
        yield


@dataclasses.dataclass
class KernelResults:
    """A kernel-check module's tally: per kernel, batches, rows, context chunks and the worst error;
    and counts of notable cases. :meth:`print` writes them as the ``KERNEL ...`` and ``NOTE ...`` lines
    that ``benchmarks/gpu_all.sh`` collects (run pytest with ``-s``)."""

    tolerance: str
    """What the errors were held to, printed after each worst error (e.g. ``"atol 0.01, rtol 0.01"``)."""
    kernels: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    notes: dict[str, int] = dataclasses.field(default_factory=dict)

    def record(self, kernel: str, err: float, rows: int, chunks: int = 0) -> None:
        """Fold one batch's worst error, its row count and its context chunks into ``kernel``'s tally."""
        r = self.kernels.setdefault(kernel, {"batches": 0, "rows": 0, "chunks": 0, "worst": 0.0})
        r["batches"] += 1
        r["rows"] += rows
        r["chunks"] += chunks
        r["worst"] = max(r["worst"], err)

    def note(self, what: str) -> None:
        """Count one notable case."""
        self.notes[what] = self.notes.get(what, 0) + 1

    def print(self) -> None:
        """One ``KERNEL`` line per kernel, then one ``NOTE`` line per notable case."""
        for name, r in self.kernels.items():
            chunks = f", {int(r['chunks'])} context chunks" if r["chunks"] else ""
            print(f"\nKERNEL {name}: {int(r['batches'])} batches, {int(r['rows'])} rows{chunks}, "
                  f"worst |err| {r['worst']:.3e} ({self.tolerance})")
        for what, count in self.notes.items():
            print(f"\nNOTE {what}: {count}")
