"""Exclusive numbered roles in a shared-memory segment: one process per number.

A :class:`~attnmeta.staging.shared.SharedRing` counts on each reader number being used by one reader
at a time: the header's ``received`` and ``done`` words of a number are written by that reader alone,
and the writer frees a slot when those words say so. Two readers under one number would each release
slots the other still reads, and the writer would rewrite a slot under one of them: torn metadata,
with no error. A claim makes that an error at construction.

A claim is one header word per number holding the claimant's process id (0: free). It is taken under
an exclusive ``flock`` of the segment's file, held only while the word is read and written, so two
processes claiming at once are serialised; within a process a registry of weak references to the
claimants does the same (``flock`` locks belong to an open file, not to a thread). A word that names
a process that no longer exists is stale (its reader died without ``close()``) and is taken over.

Limits: process ids are compared within this machine's PID namespace. Processes in different
namespaces (containers sharing ``/dev/shm``) may take a live claimant for a dead one, and a recycled
process id may keep a dead reader's number taken; ``SharedRing.release_reader`` frees a number by
hand. Without ``/dev/shm`` (not Linux) the claim is checked within each process only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import weakref
from collections.abc import Iterator

import numpy as np

__all__ = ["ClaimError", "claim", "release"]

_LOCK = threading.Lock()
_HELD: dict[tuple[str, int], weakref.ref[object]] = {}


class ClaimError(ValueError):
    """A numbered role is already held by a live object of this process or by another live process."""


def _alive(pid: int) -> bool:
    """Whether a process with this id exists (one we may not signal exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(fd: int | None) -> Iterator[None]:
    """This process's claims serialised by a thread lock, other processes' by ``flock`` on ``fd``."""
    with _LOCK:
        if fd is None:
            yield
            return
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


def claim(header: np.ndarray, word: int, fd: int | None, key: tuple[str, int], owner: object, what: str) -> None:
    """Take role ``key`` for ``owner``: write this process's id into ``header[word]``.

    Parameters
    ----------
    header : numpy.ndarray
        int64, host (shared memory): the segment's header words.
    word : int
        The role's claim word.
    fd : int or None
        An open descriptor of the segment's file, for ``flock``; None checks this process only.
    key : tuple of (str, int)
        The segment's name and the role's number.
    owner : object
        The claimant; the role is free again for this process once it is collected, for every process
        once :func:`release` is called or this process exits.
    what : str
        The role, for the error (``"reader 0 of ring 'x'"``).

    Raises
    ------
    ClaimError
        Another live object of this process, or another live process, holds the role.
    """
    me = os.getpid()
    with _locked(fd):
        ref = _HELD.get(key)
        held = ref() if ref is not None else None
        if held is not None:
            raise ClaimError(f"{what} is already taken in this process by {held!r}: each reader needs a number "
                             f"of its own (close() the other first)")
        pid = int(header[word])
        if pid and pid != me and _alive(pid):
            raise ClaimError(f"{what} is already taken by process {pid}: each reader needs a number of its own. "
                             f"If that process is not a reader of this ring (a recycled process id, or a "
                             f"reader in another PID namespace that has exited), free the number with "
                             f"SharedRing.release_reader({key[1]})")
        header[word] = me
        _HELD[key] = weakref.ref(owner)


def release(header: np.ndarray, word: int, fd: int | None, key: tuple[str, int], owner: object | None) -> None:
    """Give role ``key`` up: clear ``header[word]`` if this process holds it (any process's claim when
    ``owner`` is None: a forced release), and forget ``owner``'s registration."""
    me = os.getpid()
    with _locked(fd):
        ref = _HELD.get(key)
        held = ref() if ref is not None else None
        if owner is None or held is owner or held is None:
            _HELD.pop(key, None)
            if owner is None or int(header[word]) == me:
                header[word] = 0
