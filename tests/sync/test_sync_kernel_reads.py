"""The sync audit flags each case of :mod:`sync_kernel_cases` (tests/sync_kernel_cases.py) in the modes it
names: operations that synchronise with the GPU on CUDA, which the audit once let through on CPU-only
CI (found by a review that hunted for false negatives; each case's ``why`` gives its evidence).
"""

from __future__ import annotations

import pytest
from sync_kernel_cases import CASES, MODES, Case

from attnmeta.sync import DeviceSyncError, no_device_sync

pytestmark = pytest.mark.filterwarnings("ignore:torch.cholesky is deprecated:UserWarning")

PARAMS = [pytest.param(case, mode, id=f"{case.name}-{mode}") for case in CASES for mode in case.modes]


@pytest.mark.parametrize(("case", "mode"), PARAMS)
def test_cuda_sync_is_flagged_on_cpu_ci(case: Case, mode: str) -> None:
    device, declare = MODES[mode]
    thunk = case.make(device)
    with pytest.raises(DeviceSyncError) as info, no_device_sync(devices=declare):
        thunk()
    assert info.value.kind == "sync", str(info.value)
