"""Every scenario by name, and :func:`run_bench`: what ``python -m attnmeta bench`` runs.

The scenarios are the curated ones (:data:`attnmeta.bench.scenarios.CURATED`) followed by one per
registered builder (:func:`attnmeta.bench.builders.builder_scenarios`).

Examples
--------
>>> names = scenario_names()
>>> names[:3], "builder:flashinfer" in names
(['staging', 'decode', 'mixed'], True)
"""

from __future__ import annotations

import torch

from attnmeta.bench.builders import builder_scenarios
from attnmeta.bench.harness import BenchRow, Case, measure
from attnmeta.bench.scenarios import CURATED, ScenarioFn

__all__ = ["run_bench", "scenario_names", "scenarios"]


def scenarios() -> dict[str, ScenarioFn]:
    """Every scenario by name: the curated ones, then ``builder:<name>`` for each registered builder.

    Returns
    -------
    dict of str to callable
        ``(device, quick) -> list of Case``, in the order the bench runs them.
    """
    return _all()


def _all() -> dict[str, ScenarioFn]:
    return {**CURATED, **builder_scenarios()}


def scenario_names() -> list[str]:
    """The names :func:`run_bench` and ``--scenario`` accept, in the order the bench runs them."""
    return list(scenarios())


def run_bench(
    *,
    device: str | torch.device,
    scenarios: list[str] | None = None,
    quick: bool = False,
    reps: int | None = None,
    progress: bool = True,
) -> list[BenchRow]:
    """Run scenarios and return one :class:`~attnmeta.bench.harness.BenchRow` per (scenario, batch, path).

    Torch runs on one intra-op thread meanwhile, as an engine's host loop does (its pool only adds
    jitter to the small ops every path runs).

    Parameters
    ----------
    device : str or torch.device
        ``cuda`` or ``cpu`` (on ``cpu`` the "device" data lives in host memory and an upload is a copy).
    scenarios : list of str, optional
        Names from :func:`scenario_names` (default: all).
    quick : bool, default False
        Small batches, 5 timed steps per path (unless ``reps``), short warm-up and counting.
    reps : int, optional
        Timed steps per path (default 200; ``quick`` 5).
    progress : bool, default True
        A progress line on stderr.

    Returns
    -------
    list of BenchRow
        In the order of the scenarios, their batch sizes and their paths.

    Raises
    ------
    ValueError
        An unknown scenario name (the message lists the names).
    """
    table = _all()
    chosen = list(scenarios) if scenarios else list(table)
    unknown = [s for s in chosen if s not in table]
    if unknown:
        raise ValueError(f"unknown scenario(s) {unknown}; choose from {list(table)}")
    dev = torch.device(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases: list[Case] = []
        for s in chosen:
            cases += table[s](dev, quick)
        return measure(cases, dev, reps=reps or (5 if quick else 200), warmup=2 if quick else 20,
                       count_steps=3 if quick else 10, progress=progress)
    finally:
        torch.set_num_threads(threads)
