"""``Staged``: what a builder hands back while its step is still open.

A builder writes a step's host arrays into the step's pinned slot and returns a :class:`Staged`: its
**host part** at once (typed per builder, for later builders of the same step to reuse) and its
finished **metadata** (device views included) from :meth:`Staged.result` once the step has
committed. Before the commit the device memory does not hold the step's data yet, so
:meth:`Staged.result` raises :class:`~attnmeta.staging.StepNotCommittedError` rather than hand out
views of stale bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from attnmeta._fields import MetadataBase
from attnmeta.staging.stager import Step, StepNotCommittedError

__all__ = ["Staged"]

H = TypeVar("H")
M = TypeVar("M")


class Staged(Generic[H, M]):
    """A builder's output in an open step: ``host`` now, :meth:`result` after the commit.

    Parameters
    ----------
    step : Step
        The step the builder staged into.
    host : H
        The builder's typed host part (documented by each builder: e.g.
        :class:`attnmeta.metadata.CommonHost` for the common metadata).
    make : callable
        Builds the finished metadata; called once, by the first :meth:`result` after the commit.

    The host part (when it is a metadata object) and the finished metadata are tied to the step's
    lifetime (:meth:`Step.own`): once a newer step claims the step's memory, reading them raises
    :class:`~attnmeta.staging.StepExpiredError`.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmeta.staging import Stager
    >>> stager = Stager("cpu")
    >>> with stager.step() as step:
    ...     step.alloc("x", 2, np.int32)[:] = [4, 2]
    ...     staged = Staged(step, "host part", lambda: step.device("x").tolist())
    ...     staged.host
    'host part'
    >>> staged.result()
    [4, 2]
    """

    __slots__ = ("_make", "_result", "host", "step")

    def __init__(self, step: Step, host: H, make: Callable[[], M]) -> None:
        self.step = step
        self.host = step.own(host) if isinstance(host, MetadataBase) else host
        self._make = make
        self._result: M | None = None

    def result(self) -> M:
        """The finished metadata (device fields are views into the step's device arena).

        Raises
        ------
        StepNotCommittedError
            The step has not committed yet, or was abandoned.
        """
        r = self._result
        if r is not None:
            return r
        if not self.step.committed:
            if self.step.state == "abandoned":
                raise StepNotCommittedError(self.step._closed("result()"))
            raise StepNotCommittedError(
                "result(): the step has not committed; leave the `with stager.step()` block (or call "
                "step.commit()) before reading device metadata"
            )
        r = self._result = self._make()
        if isinstance(r, MetadataBase):
            self.step.own(r)
        return r

    def __repr__(self) -> str:
        state = "ready" if self._result is not None else self.step.state
        return f"Staged({type(self.host).__name__}, {state})"
