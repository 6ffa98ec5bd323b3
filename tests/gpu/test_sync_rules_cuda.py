"""The sync audit's shape rules against CUDA itself: where a rule decides from shapes alone whether torch
will read device data on the host (``isin``: torch's own heuristic picks a sorting path that calls
``unique``), the audit on ``meta`` tensors must flag exactly the calls that synchronise on CUDA, which
``torch.cuda.set_sync_debug_mode("error")`` tells without the audit.

Runs only where CUDA is present (the GPU machine: ``bash benchmarks/gpu_all.sh OUT gpu``).
"""

from __future__ import annotations

import pytest
import torch
from audit_helpers import sync_error_mode
from sync_kernel_cases import CASES, Case

from attnmeta.sync import DeviceSyncError, no_device_sync

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device (run on the GPU machine)", allow_module_level=True)


def _syncs_on_cuda(n: int, m: int, assume_unique: bool) -> bool:
    x, t = torch.arange(n, device="cuda"), torch.arange(m, device="cuda")
    torch.cuda.synchronize()
    try:
        with sync_error_mode():
            torch.isin(x, t, assume_unique=assume_unique)
    except RuntimeError as e:
        assert "synchroniz" in str(e), e
        return True
    finally:
        torch.cuda.synchronize()
    return False


def _flagged_on_meta(n: int, m: int, assume_unique: bool) -> bool:
    x, t = torch.empty(n, dtype=torch.int64, device="meta"), torch.empty(m, dtype=torch.int64, device="meta")
    try:
        with no_device_sync():
            torch.isin(x, t, assume_unique=assume_unique)
    except DeviceSyncError:
        return True
    return False


@pytest.mark.parametrize("n", [1, 8, 100, 5000])
def test_isin_is_flagged_exactly_where_cuda_synchronises(n: int) -> None:
    threshold = int(10.0 * float(n) ** 0.145)
    for m in (1, threshold - 1, threshold, 4 * threshold):
        for assume_unique in (False, True):
            if m < 1:
                continue
            cuda = _syncs_on_cuda(n, m, assume_unique)
            assert _flagged_on_meta(n, m, assume_unique) == cuda, (n, m, assume_unique, cuda)
            if m == 4 * threshold:
                assert cuda, "the case the rule exists for: torch's sorting path synchronises"


@pytest.mark.filterwarnings("ignore:torch.cholesky is deprecated:UserWarning")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_kernel_read_the_audit_flags_synchronises_on_cuda(case: Case) -> None:
    """The audit's kernel-read rules (tests/sync_kernel_cases.py) were written from torch's source and docs:
    here CUDA's debug mode says whether each really synchronises (a rule for one that does not would be a
    false alarm in users' suites)."""
    thunk = case.make(torch.device("cuda"))
    torch.cuda.synchronize()
    try:
        with sync_error_mode(), pytest.raises(RuntimeError, match="synchroniz"):
            thunk()
    finally:
        torch.cuda.synchronize()
