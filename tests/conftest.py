"""Shared fixtures and the hypothesis profiles.

Profiles (select with ``ATTNMETA_HYPOTHESIS_PROFILE``; default ``dev``):

- ``dev``: 50 examples per property, for a quick local loop.
- ``ci``: 100 examples per property, no deadline (``.ci/run`` selects it; the suite takes 6-7 min on
  2 cores, a fresh checkout that compiles every kernel first included; 8-10 with the set-up).
- ``thorough``: 1000 examples per property, no deadline (a property with a count of its own, through
  ``profile_helpers.scaled_examples``, runs ten times that count).
- ``gpu``: 25 derandomized examples per property, for the GPU machine.

``dev``, ``ci`` and ``gpu`` keep a property's own count as it is.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
settings.register_profile("dev", max_examples=50, **_COMMON)
settings.register_profile("ci", max_examples=100, print_blob=True, **_COMMON)
settings.register_profile("thorough", max_examples=1000, print_blob=True, **_COMMON)
settings.register_profile("gpu", max_examples=25, derandomize=True, **_COMMON)
settings.load_profile(os.environ.get("ATTNMETA_HYPOTHESIS_PROFILE", "dev"))

# Reference computations on CPU tensors are tiny; torch's intra-op thread pool only adds contention
# on the 2-core CI machine (repeat_interleave: ~16 ms with 2 threads under load vs ~0.1 ms with 1).
torch.set_num_threads(1)


def _devices() -> list[str]:
    devs = ["cpu"]
    if torch.cuda.is_available():
        devs.append("cuda")
    return devs


@pytest.fixture(scope="session", params=_devices())
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The device the reference implementations run on: ``cpu`` always, ``cuda`` where present."""
    yield torch.device(request.param)


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    """A CUDA device; skips (with the reason shown by ``-ra``) where none is present."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; run tests/gpu on the GPU machine (see docs/benchmarks.md)")
    return torch.device("cuda")
