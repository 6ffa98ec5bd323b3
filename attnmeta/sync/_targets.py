"""Audit targets: the builders the sync audit must cover, running them, and the table it prints.

:func:`register_audit_target` adds a builder ``fn(device, seed)`` to a process-wide registry
(:func:`unregister_audit_target` removes one, :func:`audit_targets` lists them);
:func:`run_audit` runs each under :func:`no_device_sync` for a number of seeds and devices and
counts what it trips over, one :class:`AuditRow` per target and device;
:func:`format_audit_table` prints the rows (``python -m attnmeta audit``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Final, TypeAlias, overload

import torch

from attnmeta.sync._context import no_device_sync
from attnmeta.sync._errors import DeviceSyncError
from attnmeta.sync._state import CudaMode

__all__ = [
    "AuditRow",
    "AuditTable",
    "AuditTarget",
    "audit_targets",
    "format_audit_table",
    "register_audit_target",
    "run_audit",
    "unregister_audit_target",
]

AuditTarget: TypeAlias = Callable[[torch.device, int], object]
"""``fn(device, seed)``: build metadata for one generated batch (chosen by ``seed``) on ``device``;
what it returns is ignored."""

_TARGETS: dict[str, AuditTarget] = {}
_TARGETS_LOCK: Final = threading.Lock()


@overload
def register_audit_target(name: str, fn: AuditTarget, *, replace: bool = False) -> AuditTarget: ...


@overload
def register_audit_target(
    name: str, fn: None = None, *, replace: bool = False
) -> Callable[[AuditTarget], AuditTarget]: ...


def register_audit_target(
    name: str, fn: AuditTarget | None = None, *, replace: bool = False
) -> AuditTarget | Callable[[AuditTarget], AuditTarget]:
    """Register a builder that :func:`run_audit` must run under the audit.

    Parameters
    ----------
    name : str
        The row name in the audit table (e.g. ``"flash_attn"``).
    fn : callable, optional
        ``fn(device, seed)``: builds metadata for one generated batch on ``device`` (the same seed
        gives the same batch; the return value is ignored). Omit it to use this as a decorator.
    replace : bool, default False
        Replace an existing target of the same name instead of raising.

    Returns
    -------
    callable
        ``fn`` (or a decorator that registers and returns its argument).

    Raises
    ------
    ValueError
        If ``name`` is empty, or is taken and ``replace`` is False.

    Examples
    --------
    >>> import torch
    >>> from attnmeta.sync import audit_targets, register_audit_target, unregister_audit_target
    >>> @register_audit_target("doc_upload")
    ... def build(device: torch.device, seed: int) -> None:
    ...     torch.arange(seed + 1).to(device, non_blocking=True)
    >>> "doc_upload" in audit_targets()
    True
    >>> unregister_audit_target("doc_upload")
    """
    if not name:
        raise ValueError("register_audit_target: name must be a non-empty string")

    def register(f: AuditTarget) -> AuditTarget:
        with _TARGETS_LOCK:
            if name in _TARGETS and not replace and _TARGETS[name] is not f:
                raise ValueError(f"audit target {name!r} is already registered (pass replace=True)")
            _TARGETS[name] = f
        return f

    return register if fn is None else register(fn)


def unregister_audit_target(name: str) -> None:
    """Remove a registered audit target.

    Raises
    ------
    KeyError
        If no target of that name is registered.

    Examples
    --------
    >>> from attnmeta.sync import register_audit_target, unregister_audit_target
    >>> _ = register_audit_target("doc_noop", lambda device, seed: None)
    >>> unregister_audit_target("doc_noop")
    """
    with _TARGETS_LOCK:
        if name not in _TARGETS:
            raise KeyError(f"no audit target named {name!r}; registered: {sorted(_TARGETS)}")
        del _TARGETS[name]


def audit_targets() -> dict[str, AuditTarget]:
    """The registered audit targets, in registration order (a copy).

    Examples
    --------
    >>> from attnmeta.sync import audit_targets
    >>> isinstance(audit_targets(), dict)
    True
    """
    with _TARGETS_LOCK:
        return dict(_TARGETS)


@dataclasses.dataclass(frozen=True, slots=True)
class AuditRow:
    """What :func:`run_audit` found for one builder on one device.

    Counts are of batches: the first violation stops a batch, so a batch counts once.

    Examples
    --------
    >>> from attnmeta.sync import AuditRow
    >>> AuditRow("flash_attn", "meta", batches=8).clean
    True
    """

    builder: str
    """The audit target's name."""
    device: str
    """The device the batches were built on (``"cuda"``, ``"meta"``, ``"cpu"``)."""
    batches: int
    """Batches tried."""
    syncs: int = 0
    """Batches stopped by a host read of device data or a blocking copy."""
    pageable_copies: int = 0
    """Batches stopped by a non-blocking copy from pageable or non-contiguous host memory."""
    races: int = 0
    """Batches stopped by a non-blocking device->host copy."""
    errors: int = 0
    """Batches that raised something other than :class:`DeviceSyncError`."""
    first_problem: str | None = None
    """The message of the first violation or error (``"seed N: ..."``), or None."""

    @property
    def clean(self) -> bool:
        """True when every batch ran without a violation or an error."""
        return self.syncs == self.pageable_copies == self.races == self.errors == 0


def _default_devices() -> list[torch.device]:
    return [torch.device("cuda" if torch.cuda.is_available() else "meta")]


def run_audit(
    *,
    devices: Iterable[str | torch.device] | None = None,
    batches: int = 16,
    targets: Iterable[str] | None = None,
    seed: int = 0,
    check_copies: bool = True,
    cuda_mode: CudaMode = "error",
) -> list[AuditRow]:
    """Run every registered builder under :func:`no_device_sync` and count what it trips over.

    Each batch ``i`` calls ``fn(device, seed + i)`` inside its own audit, with ``device.type``
    declared as device data; a :class:`DeviceSyncError` (or any other exception) is counted and
    the next batch runs. A ``DeviceSyncError`` the target catches itself is counted too
    (:attr:`SyncAudit.raised`): outside the audit that code would sync.

    Parameters
    ----------
    devices : iterable of str or torch.device, optional
        Where to build; default ``cuda`` if available, else ``meta``. ``"cpu"`` audits CPU tensors
        as device data.
    batches : int, default 16
        Batches (seeds) per builder and device.
    targets : iterable of str, optional
        Names of the targets to run; default all, in registration order.
    seed : int, default 0
        The first seed.
    check_copies : bool, default True
        As for :func:`no_device_sync`.
    cuda_mode : {"error", "warn", "off"}, default "error"
        As for :func:`no_device_sync`.

    Returns
    -------
    list of AuditRow
        One row per target and device, targets outermost.

    Raises
    ------
    ValueError
        If ``batches`` < 1 or a named target is not registered.

    Examples
    --------
    >>> import torch
    >>> from attnmeta.sync import format_audit_table, register_audit_target, run_audit
    >>> from attnmeta.sync import unregister_audit_target
    >>> def good(device, seed):
    ...     torch.arange(seed + 1, dtype=torch.int32).to(device, non_blocking=True)
    >>> def bad(device, seed):
    ...     torch.arange(seed + 1, device=device).sum().item()
    >>> _ = register_audit_target("doc_good", good)
    >>> _ = register_audit_target("doc_bad", bad)
    >>> rows = run_audit(devices=["meta"], batches=3, targets=["doc_good", "doc_bad"])
    >>> [(r.builder, r.batches, r.syncs, r.clean) for r in rows]
    [('doc_good', 3, 0, True), ('doc_bad', 3, 3, False)]
    >>> rows[1].first_problem.split(" at ")[0]
    'seed 0: aten._local_scalar_dense.default'
    >>> for name in ("doc_good", "doc_bad"):
    ...     unregister_audit_target(name)
    """
    if batches < 1:
        raise ValueError(f"run_audit: batches={batches}, expected >= 1")
    registered = audit_targets()
    names = list(registered) if targets is None else list(targets)
    missing = [n for n in names if n not in registered]
    if missing:
        raise ValueError(f"run_audit: no audit target named {missing}; registered: {sorted(registered)}")
    devs = _default_devices() if devices is None else [torch.device(d) for d in devices]
    rows: list[AuditRow] = []
    for name in names:
        fn = registered[name]
        for dev in devs:
            counts = {"sync": 0, "pageable-copy": 0, "race": 0, "error": 0}
            first: str | None = None
            for i in range(batches):
                batch_seed = seed + i
                try:
                    with no_device_sync(devices={dev.type}, check_copies=check_copies, cuda_mode=cuda_mode) as audit:
                        fn(dev, batch_seed)
                    if audit.raised:  # raised in the target and caught there: its code syncs outside the audit
                        e = audit.raised[0]
                        counts[e.kind] += 1
                        first = first or f"seed {batch_seed}: {e} (caught inside the target)"
                except DeviceSyncError as e:
                    counts[e.kind] += 1
                    first = first or f"seed {batch_seed}: {e}"
                except Exception as e:
                    counts["error"] += 1
                    first = first or f"seed {batch_seed}: {type(e).__name__}: {e}"
            rows.append(
                AuditRow(
                    builder=name,
                    device=str(dev),
                    batches=batches,
                    syncs=counts["sync"],
                    pageable_copies=counts["pageable-copy"],
                    races=counts["race"],
                    errors=counts["error"],
                    first_problem=first,
                )
            )
    return rows


def format_audit_table(rows: Sequence[AuditRow]) -> str:
    """A plain-text table of :func:`run_audit` rows, then the first problem of each failing row.

    Examples
    --------
    >>> from attnmeta.sync import AuditRow, format_audit_table
    >>> print(format_audit_table([
    ...     AuditRow("flash_attn", "cuda", 16),
    ...     AuditRow("mamba2", "cuda", 16, syncs=16, first_problem="seed 0: aten.nonzero.default ..."),
    ... ]))
    builder     device  batches  syncs  pageable copies  D2H races  errors  result
    ----------  ------  -------  -----  ---------------  ---------  ------  ------
    flash_attn  cuda         16      0                0          0       0  clean
    mamba2      cuda         16     16                0          0       0  FAIL
    <BLANKLINE>
    mamba2 on cuda: seed 0: aten.nonzero.default ...
    """
    table = AuditTable([r.builder for r in rows], [r.device for r in rows],
                       ([r.batches, r.syncs, r.pageable_copies, r.races, r.errors] for r in rows))
    out = [table.header(), *(table.row(r) for r in rows)]
    problems = table.problems(rows)
    if problems:
        out += ["", problems]
    return "\n".join(out)


_HEADER = ("builder", "device", "batches", "syncs", "pageable copies", "D2H races", "errors", "result")


class AuditTable:
    """The table of :func:`format_audit_table`, a row at a time: column widths fixed ahead from the
    builder names and devices (and, optionally, the counts) to come, so that rows can be printed as
    their builders finish.

    Examples
    --------
    >>> from attnmeta.sync import AuditRow, AuditTable
    >>> table = AuditTable(["flash_attn", "gdn"], ["cpu"])
    >>> print(table.header())
    builder     device  batches  syncs  pageable copies  D2H races  errors  result
    ----------  ------  -------  -----  ---------------  ---------  ------  ------
    >>> print(table.row(AuditRow("gdn", "cpu", 50)))
    gdn         cpu          50      0                0          0       0  clean
    """

    def __init__(self, builders: Iterable[str], devices: Iterable[str], counts: Iterable[Iterable[int]] = ()) -> None:
        cols = [[*_HEADER[:1], *builders], [*_HEADER[1:2], *devices]]
        widths = [max(len(c) for c in col) for col in cols]
        numbers = [list(_HEADER[2:7])] + [[str(c) for c in row] for row in counts]
        widths += [max(len(r[k]) for r in numbers) for k in range(5)]
        widths.append(len("result"))
        self.widths = widths

    def _line(self, cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if 2 <= i <= 6 else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, self.widths))).rstrip()

    def header(self) -> str:
        """The column names and the rule under them."""
        return self._line(_HEADER) + "\n" + "  ".join("-" * w for w in self.widths)

    def row(self, r: AuditRow) -> str:
        """One row's line."""
        return self._line((r.builder, r.device, str(r.batches), str(r.syncs), str(r.pageable_copies), str(r.races),
                           str(r.errors), "clean" if r.clean else "FAIL"))

    def problems(self, rows: Sequence[AuditRow]) -> str:
        """The first problem of each failing row, a line each ("" when every row is clean)."""
        return "\n".join(f"{r.builder} on {r.device}: {r.first_problem}" for r in rows if r.first_problem)
