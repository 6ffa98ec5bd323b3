"""Scenarios derived from the builder registry: every registered builder is benchmarked.

For each builder of :func:`attnmeta.registry` there is a scenario ``builder:<name>`` that times the
generic :func:`attnmeta.build` (common metadata with exactly what the builder reads, the builder's
metadata, one copy, ``result()``) with the builder's lab defaults (:meth:`attnmeta.testing.lab.Lab.defaults`), on mixed
steps of :func:`attnmeta.testing.workloads.mixed_spec` at :data:`SIZES`, against the builder's
:meth:`~attnmeta.Builder.reference` path when it has one (the straightforward device-side
computations, syncs and all). So a new builder is benchmarked by being registered: nothing here
names one.

Paths: ``attnmeta`` and, where :meth:`~attnmeta.Builder.reference` returns values, ``reference``.
Each walks :data:`STEPS` distinct steps per size in turn. The reference path's uploads are its own
(``.to(device)`` of the raw arrays); they and its syncs are counted on CUDA only.

Examples
--------
>>> "builder:flash_attn" in builder_scenarios()
True
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from attnmeta.bench.harness import Case, PathFn
from attnmeta.bench.scenarios import ScenarioFn
from attnmeta.builder import AnyBuilder, build, registry
from attnmeta.spec import BatchSpec
from attnmeta.staging import Stager
from attnmeta.testing.lab import lab
from attnmeta.testing.workloads import mixed_spec

__all__ = ["PREFIX", "SIZES", "STEPS", "builder_cases", "builder_scenarios"]

PREFIX = "builder:"
"""Scenario names are ``PREFIX + builder.name``."""

SIZES = ((1, 3), (8, 24), (64, 192))
"""(prefills, decodes) of the mixed steps: batches of 4, 32 and 256 requests (``quick``: the first two)."""

STEPS = 8
"""Distinct steps per size that each path walks in turn."""


_Step = tuple[BatchSpec, Any, dict[str, Any]]
"""One step of a walk: the spec, the builder's options and inputs for it."""


def _steps(builder: AnyBuilder, prefills: int, decodes: int, seed: int) -> list[_Step]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        spec = mixed_spec(rng, prefills=prefills, decodes=decodes)
        options, inputs = lab(builder).defaults(spec)
        options, inputs = builder.options(options), builder.inputs(inputs)
        reasons = builder.unsupported_reasons(spec, options, inputs)
        if reasons:
            raise ValueError(f"{PREFIX}{builder.name}: the builder's defaults() cannot serve a mixed step of "
                             f"{prefills} prefills and {decodes} decodes: " + "; ".join(reasons))
        out.append((spec, options, inputs))
    return out


def builder_cases(builder: AnyBuilder, device: torch.device, quick: bool) -> list[Case]:
    """The cases of the scenario ``builder:<name>`` of one builder.

    Parameters
    ----------
    builder : Builder
        The builder (registered or not).
    device : torch.device
        Where the metadata goes.
    quick : bool
        The first two sizes of :data:`SIZES` only.

    Returns
    -------
    list of Case
        One per size; paths ``attnmeta`` and, when the builder has a reference, ``reference``.

    Raises
    ------
    ValueError
        The builder's lab defaults (:meth:`attnmeta.testing.lab.Lab.defaults`) give options or inputs it cannot serve a mixed
        step with (every reason listed).
    """
    dev = torch.device(device)
    return [_case(builder, dev, _steps(builder, prefills, decodes, seed=100 + i), prefills + decodes)
            for i, (prefills, decodes) in enumerate(SIZES[:2] if quick else SIZES)]


def _case(builder: AnyBuilder, device: torch.device, steps: list[_Step], batch: int) -> Case:
    stager = Stager(device)
    at = {"attnmeta": 0, "reference": 0}

    def nxt(path: str) -> _Step:
        k = at[path]
        at[path] = (k + 1) % len(steps)
        return steps[k]

    def attnmeta_step() -> Any:
        spec, options, inputs = nxt("attnmeta")
        return build(spec, stager, builder, options, inputs)

    def reference_step() -> Any:
        spec, options, inputs = nxt("reference")
        return lab(builder).reference(spec, options, device, inputs)

    paths: dict[str, PathFn] = {"attnmeta": attnmeta_step}
    if lab(builder).has_reference:
        paths["reference"] = reference_step
    return Case(PREFIX + builder.name, batch, paths, {}, stager, oracle_paths=frozenset({"reference"}))


def builder_scenarios() -> dict[str, ScenarioFn]:
    """One scenario per registered builder, by name (``builder:<name>``, sorted by builder name).

    Returns
    -------
    dict of str to callable
        ``(device, quick) -> cases`` (:func:`builder_cases` of that builder).
    """
    return {PREFIX + name: functools.partial(_cases_of, name) for name in sorted(registry())}


def _cases_of(name: str, device: torch.device, quick: bool) -> list[Case]:
    return builder_cases(registry()[name], device, quick)
