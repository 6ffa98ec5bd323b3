"""The project's one numba configuration.

Every compiled kernel in attnmeta is decorated with :func:`njit` from this module, never with a raw
``numba.njit``: caching, ``nogil`` and ``fastmath=False`` are fixed here once (a CI grep enforces it).
``NUMBA_DISABLE_JIT=1`` turns every kernel back into plain Python (coverage, pdb).

Where compiled code is cached: numba looks for a writable directory when a kernel is decorated (at
import), in this order: ``NUMBA_CACHE_DIR`` if set, the ``__pycache__`` folder next to the kernel's
source file, numba's user-wide cache (``~/.cache/numba`` on Linux); with none of them writable it
raises ``RuntimeError: cannot cache function ...: no locator available``. attnmeta never lets that
fail an import: the first kernel that meets it switches every later kernel of attnmeta (and only
attnmeta's) to a private per-user folder under :func:`tempfile.gettempdir`, or, when that is not
writable either, to no on-disk cache at all (every process compiles again), and says so in ONE
``RuntimeWarning`` that names the folder and ``NUMBA_CACHE_DIR``. Setting ``NUMBA_CACHE_DIR`` to a
writable directory avoids the fallback (docs/deployment.md).

Editing kernels: numba's on-disk cache (``__pycache__/*.nbi``, ``*.nbc`` next to each source file)
is checked against the kernel's own file only. A kernel that calls a compiled helper from another
file (every caller of :mod:`attnmeta._intdiv`, the kernels of :mod:`attnmeta.host.common` calling
those of :mod:`attnmeta.host.layout`) keeps the helper's old code, inlined, until its own file
changes. After editing such a helper, run with ``NUMBA_CACHE_DIR`` set to a fresh directory or
delete the caches (``find attnmeta -name '*.nb[ic]' -delete``). An installed release is unaffected
(every file is new), and a fresh checkout has no caches.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import numba

__all__ = ["CacheInfo", "cache_info", "compile_progress", "fallback_dir", "kernels", "njit", "njit_parallel",
           "pool_threads"]

F = TypeVar("F", bound=Callable[..., Any])

_OPTIONS: dict[str, Any] = {"nogil": True, "fastmath": False, "boundscheck": False}
_KERNELS: list[Any] = []
"""Every numba dispatcher made here, in decoration order (none under ``NUMBA_DISABLE_JIT=1``)."""
_NO_LOCATOR = "no locator available"  # numba.core.caching.CacheImpl's message when no directory is writable
_DEFAULT = "numba"
_fallback: str | None = _DEFAULT
"""Where attnmeta's kernels are cached: ``_DEFAULT`` (numba's own choice), a fallback directory, or
None (no on-disk cache)."""


class CacheInfo(NamedTuple):
    """Where this process caches attnmeta's compiled kernels (see the module docstring)."""

    fallback: bool
    """True when numba found no writable cache directory and attnmeta chose one (or none)."""
    directory: str | None
    """The fallback directory; None without a fallback (numba's own choice: ``NUMBA_CACHE_DIR``, the
    kernel's ``__pycache__`` or numba's user-wide cache) or when nothing is cached on disk."""


def cache_info() -> CacheInfo:
    """Where this process caches attnmeta's compiled kernels."""
    return CacheInfo(_fallback != _DEFAULT, None if _fallback == _DEFAULT else _fallback)


def kernels() -> tuple[Any, ...]:
    """Every compiled kernel (numba dispatcher) decorated so far, in decoration order; empty under
    ``NUMBA_DISABLE_JIT=1``. Their ``stats.cache_hits`` / ``stats.cache_misses`` count the
    specializations loaded from the on-disk cache and compiled (:func:`attnmeta.warmup`)."""
    return tuple(_KERNELS)


def njit(fn: F) -> F:
    """Compile ``fn`` in nopython mode with attnmeta's fixed options.

    Options: ``cache=True`` (compiled code is reused across processes; where it is kept: the module
    docstring), ``nogil=True`` (a serving framework may build metadata for several devices from
    several threads), ``fastmath=False`` (integer code only; nothing may be reassociated),
    ``boundscheck=False``.
    """
    return _jit(fn, _OPTIONS)


def njit_parallel(fn: F) -> F:
    """:func:`njit` with ``parallel=True``: ``numba.prange`` loops run on numba's thread pool, with as
    many threads as ``numba.get_num_threads()`` of the calling thread when the loop starts (set it
    around the call; a ``numba.set_num_threads`` inside compiled code would make it uncacheable).
    """
    return _jit(fn, {**_OPTIONS, "parallel": True})


def _jit(fn: F, options: dict[str, Any]) -> F:
    global _fallback
    compiled: F
    if _fallback == _DEFAULT:
        try:
            compiled = numba.njit(cache=True, **options)(fn)
        except RuntimeError as e:
            if _NO_LOCATOR not in str(e):
                raise
            _fallback = _choose_fallback(fn)
        else:
            return _keep(compiled)
    if _fallback is None:
        compiled = numba.njit(cache=False, **options)(fn)
    else:
        with _cache_dir(_fallback):
            compiled = numba.njit(cache=True, **options)(fn)
    return _keep(compiled)


def _keep(compiled: F) -> F:
    if hasattr(compiled, "stats"):  # a dispatcher (under NUMBA_DISABLE_JIT numba returns the function)
        _KERNELS.append(compiled)
    return compiled


@contextlib.contextmanager
def _cache_dir(path: str) -> Iterator[None]:
    """``numba.config.CACHE_DIR`` set to ``path`` while a kernel is decorated: numba's locator reads
    it then and keeps the path; other code's kernels keep the process's own setting."""
    config = _config()
    before = config.CACHE_DIR
    config.CACHE_DIR = path
    try:
        yield
    finally:
        config.CACHE_DIR = before


def fallback_dir() -> str:
    """The per-user fallback cache directory under :func:`tempfile.gettempdir`."""
    user = str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return os.path.join(tempfile.gettempdir(), f"attnmeta-numba-cache-{user}")


def _private_dir(path: str) -> str | None:
    """Make ``path`` (mode 0700) if missing; why it cannot hold this user's cache, or None when it can.

    The cache is pickled code, so a folder in a shared temporary directory is used only if it is a
    real directory (not a link), owned by this user and writable by no one else, and writable by us.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        return f"cannot create it ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return "another user owns it or may write to it"
    try:
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        return f"cannot write to it ({e.strerror})"
    return None


def _config() -> Any:
    """``numba.config`` (its settings are module attributes set from the environment at run time)."""
    return numba.config


def _numba_dirs(fn: Callable[..., Any]) -> str:
    """The directories numba tried for ``fn``, for the warning."""
    tried = []
    cache_dir = _config().CACHE_DIR
    if cache_dir:
        tried.append(f"NUMBA_CACHE_DIR={cache_dir}")
    source = getattr(getattr(fn, "__code__", None), "co_filename", "")
    tried.append(os.path.join(os.path.dirname(os.path.abspath(source)), "__pycache__"))
    try:
        appdirs: Any = importlib.import_module("numba.misc.appdirs")
        tried.append(appdirs.AppDirs(appname="numba", appauthor=False).user_cache_dir)
    except (ImportError, AttributeError):  # pragma: no cover - numba moved its copy of appdirs
        tried.append("numba's user-wide cache")
    return ", ".join(tried)


def _choose_fallback(fn: Callable[..., Any]) -> str | None:
    """The fallback for a process where numba found no writable cache directory; warns once."""
    path = fallback_dir()
    why = _private_dir(path)
    head = (f"attnmeta: numba cannot cache compiled kernels: no writable cache directory "
            f"(tried {_numba_dirs(fn)}). ")
    tail = ("Set NUMBA_CACHE_DIR to a writable directory to choose where the cache lives "
            "(see attnmeta's docs/deployment.md).")
    if why is None:
        warnings.warn(f"{head}attnmeta caches them in {path} instead. {tail}", RuntimeWarning, stacklevel=4)
        return path
    warnings.warn(f"{head}The fallback {path} cannot be used either ({why}), so attnmeta's kernels are "
                  f"not cached on disk: every process compiles them again on first use. {tail}",
                  RuntimeWarning, stacklevel=4)
    return None


_POOL_STARTED = False


def pool_threads(n: int) -> int:
    """Have numba's thread pool run the calling thread's next :func:`njit_parallel` loops on ``n``
    threads; returns the count to restore with ``numba.set_num_threads``.

    The first call starts numba's threading layer, whose OpenMP start changes the thread count that
    torch's CPU ops see: torch's count is put back as it was. A process that never calls this never
    starts the layer.
    """
    import torch

    global _POOL_STARTED
    torch_threads = None if _POOL_STARTED else torch.get_num_threads()
    was = int(numba.get_num_threads())
    numba.set_num_threads(n)
    if torch_threads is not None:
        if torch.get_num_threads() != torch_threads:
            torch.set_num_threads(torch_threads)
        _POOL_STARTED = True
    return was


COMPILE_NOTE = "compiling kernels (first run only; `python -m attnmeta warmup` compiles them ahead)"
"""The line :func:`compile_progress` starts with."""


@contextlib.contextmanager
def compile_progress(stream: Any, *, note: str = COMPILE_NOTE) -> Iterator[None]:
    """While the block runs, report numba compiling attnmeta's kernels (a cache miss: loading from the
    on-disk cache is not reported) on ``stream``, a text stream: ``note`` at the first compile, a dot
    per kernel specialization compiled, and at the end of the block how many and how long. Nothing
    is written when every kernel is in memory or in the cache already, so a warm run stays quiet.

    A first run spends most of its time here (tens of seconds on a small machine); without a word it
    looks hung.
    """
    from numba.core import event

    state = {"n": 0, "t0": 0.0, "depth": 0}
    clock = time.perf_counter

    class _Progress(event.Listener):  # type: ignore[misc]
        def on_start(self, ev: Any) -> None:
            if state["n"] == 0 and state["depth"] == 0:
                state["t0"] = clock()
                stream.write(note + " ")
                stream.flush()
            state["depth"] += 1

        def on_end(self, ev: Any) -> None:
            state["depth"] -= 1
            state["n"] += 1
            stream.write(".")
            stream.flush()

    with event.install_listener("numba:compile", _Progress()):
        yield
    if state["n"]:
        stream.write(f" {state['n']} compiled in {clock() - state['t0']:.1f} s\n")
        stream.flush()
