"""The stager: one pinned, event-fenced host->device copy per step.

Ownership and stream contract
-----------------------------
A :class:`Stager` belongs to one device and is driven by one thread at a time. It owns

- a ring of ``num_slots`` (default 3) **pinned host slots**: host derivations write a step's arrays
  straight into the current slot through numpy views handed out by :meth:`Step.alloc`;
- **device arenas**: in eager mode one per slot, in graph mode one shared arena with a fixed layout.

:meth:`Step.commit` issues **exactly one** non-blocking H2D copy that covers everything the step
staged, on the commit stream (the current stream unless one was given), then records an event on that
stream. On CUDA, commits on the current stream (eager and graph mode) make both calls through the
driver API when it is available (:mod:`attnmeta.staging._driver`: the same copy and event, less host
time), and through torch otherwise. A slot's pinned memory is rewritten only after the event recorded after its last copy has
completed: before a step begins on a slot the stager queries that event and, only if the GPU is still
behind, waits for it (counted in :attr:`StagerStats.waits`). With ``num_slots >= 2`` the host never
waits in steady state unless it runs ``num_slots - 1`` steps ahead of the GPU.

Device tensors handed out by a committed step are views into a device arena. Kernels enqueued on the
commit stream after the commit see exactly this step's data: either the complete old state or the
complete new one, never a mix. Asking for a step's device views before it commits raises
:class:`StepNotCommittedError`; asking after its eager-mode slot has been reused raises
:class:`StepExpiredError`.

Graph mode
----------
With a :class:`~attnmeta.profile.StaticProfile` (``Stager(device, profile=...)``) every field has a
fixed offset and capacity in one device arena, so a CUDA graph captured over kernels that read the
fields can be replayed after any later commit. Rows past a step's length hold the field's sentinel
(``fill``): every declared field is fully defined after every commit, also when a step does not stage
it. Fields are laid out on first use; :meth:`Stager.freeze` (call it before capturing) forbids new
fields, after which exceeding a capacity or adding a field raises.

On ``cpu`` the same API works without pinning (plain copies); on ``meta`` the device tensors carry no
data at all, so the sync audit can prove nothing reads them.

Modules
-------
The contract is split along its seams: the slots, field layouts and groups
(:mod:`attnmeta.staging._layout`), the memory and graph mode (:mod:`~attnmeta.staging._arena`), the
ring with its fences, commit and the state of a step (:mod:`~attnmeta.staging._ring`), the lifetimes
of handed-out metadata (:mod:`~attnmeta.staging._lifetime`) and the step API
(:mod:`attnmeta.staging.step`). This module is the public face: :class:`Stager`.
"""

from __future__ import annotations

from attnmeta.staging._layout import (
    STAGEABLE_DTYPES,
    CapacityError,
    FieldGroup,
    FieldLayout,
    StagerStats,
    StepExpiredError,
    StepLayout,
    StepNotCommittedError,
    StepStats,
    bucket_rows,
)
from attnmeta.staging._lifetime import is_expired
from attnmeta.staging._ring import DEFAULT_MAX_STEP_BYTES, MAX_SLOTS, Ring, UncheckedBlockIdsWarning
from attnmeta.staging.step import Step

__all__ = [
    "DEFAULT_MAX_STEP_BYTES",
    "MAX_SLOTS",
    "STAGEABLE_DTYPES",
    "CapacityError",
    "FieldGroup",
    "FieldLayout",
    "Stager",
    "StagerStats",
    "Step",
    "StepExpiredError",
    "StepLayout",
    "StepNotCommittedError",
    "StepStats",
    "UncheckedBlockIdsWarning",
    "bucket_rows",
    "is_expired",
]


class Stager(Ring):
    """Owns the pinned ring and device arenas of one device; hands out :class:`Step` objects.

    Parameters
    ----------
    device : torch.device or str
        Where device fields live: ``cuda[:n]``, ``cpu`` or ``meta``.
    num_slots : int, default 3
        Pinned ring slots; >= 2 so the host can build step N+1 while step N's copy is in flight, and at
        most 64.
    profile : StaticProfile, optional
        Enables graph mode: fixed per-field capacities and addresses.
    stream : torch.cuda.Stream, optional
        Stream for every commit; default: the current stream at commit time.
    initial_bytes : int, optional
        Initial slot size in eager mode (slots grow geometrically when a step needs more); default
        1 MiB, or ``max_step_bytes`` when that is smaller. On the CPU (``device="cpu"``, unpinned
        host slots) the slot and arena bytes are zeroed when allocated, so they are resident from
        the start: a later step that first reaches into a page (a new, larger layout) takes no page
        fault, at the price of resident memory for the whole slot. Pinned slots and CUDA arenas are
        resident anyway.
    num_kv_blocks : int, optional
        Blocks in the KV cache that the block tables of this stager's steps index. When given, every
        step's common pass checks each used block id (columns ``[0, cdiv(seq_len, block_size))`` of
        each row) against it and raises a ``ValueError`` naming the row and column of any id at or
        past it, before anything is copied: a slot mapping never points outside the cache. Without it
        only negative ids are refused; a CUDA stager made without it warns once per process
        (:class:`UncheckedBlockIdsWarning`).
    max_step_bytes : int, default 1 GiB
        The most bytes one step may stage (eager mode: what a slot may grow to; graph mode: the fixed
        layout). A step past it raises :class:`CapacityError` naming the field that asked for it
        (``num_tokens_padded=2**28`` on a small batch, say) instead of allocating gigabytes of pinned
        memory.
    check_lifetimes : bool, default True
        Expire the metadata objects of a step when a newer step claims its memory (see "Lifetimes"):
        reading any of their fields then raises :class:`StepExpiredError`. ``False`` skips the
        bookkeeping (a loop that proves its own lifetimes); expired objects then read whatever the
        newer step wrote. :meth:`Step.device` checks either way.
    debug_fill : int, optional
        For tests: a byte value (0-255) written over every pinned and device byte the stager allocates,
        instead of leaving it uninitialised (pinned, CUDA) or zeroed (the CPU). A builder that hands out
        a byte its step did not write (a padding row it never fills, say) then shows this pattern, not
        a zero that a reference may expect by chance. :func:`attnmeta.testing.check_builder` makes its
        own stagers with ``0xA5``.

    Lifetimes
    ---------
    A step's memory is its ring slot's pinned bytes (its host views and twins) and, in eager mode, the
    slot's device arena (its device views). Both are claimed by the step that next begins on the slot,
    ``num_slots`` steps later: from then on the step has *expired*, and reading any field of its
    metadata objects, or :meth:`Step.device`, raises :class:`StepExpiredError` naming both steps and
    the slot. So an engine may hold the metadata of its last ``num_slots - 1`` steps while it builds
    the next one; a larger ring holds more. A step that fails and is abandoned still claims its slot.
    In graph mode every step commits into the one device arena, so a step also expires when a later
    step commits. Arrays taken out of a metadata object (``cm.seq_lens_cpu``) are plain views of the
    memory: they are not checked, so copy what you keep past the step's life.

    Threads
    -------
    A stager is driven by one thread at a time: steps are begun, staged and committed in sequence,
    never concurrently. Handing it over between steps is fine. A second thread that begins a step
    while another thread's step is open, or is being begun, gets a ``RuntimeError`` naming both threads
    (the check and the claim of the slot are one atomic act). Several threads building metadata
    concurrently use one stager each (one per device, or several per device).

    A step left open
    ----------------
    A step begun outside ``with`` must commit or be abandoned before the next one begins. If its
    object is dropped while open, the next :meth:`step` abandons it with a ``RuntimeWarning``; if it is
    still referenced, :meth:`step` raises, and :meth:`reset` abandons it.

    Examples
    --------
    >>> import numpy as np
    >>> stager = Stager("cpu")
    >>> with stager.step() as step:
    ...     qsl = step.alloc("query_start_loc", 4, np.int32)
    ...     qsl[:] = [0, 3, 4, 9]
    >>> step.device("query_start_loc")
    tensor([0, 3, 4, 9], dtype=torch.int32)
    >>> step.stats.copies, stager.stats.steps
    (1, 1)
    """

    def step(self) -> Step:
        """Begin a step on the next ring slot (waiting only if that slot's last copy is unfinished).

        Use it as a context manager (``with stager.step() as step:``): leaving the block normally
        commits, leaving it with an exception abandons the step without copying anything.
        """
        return self._begin(Step)
