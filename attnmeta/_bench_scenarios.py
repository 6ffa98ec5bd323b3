"""Benchmark scenarios for ``python -m attnmeta bench`` (see :mod:`attnmeta.bench`).

Each scenario builds, for each batch size, one callable per path that performs a whole step:
``attnmeta`` (host derivation into the pinned slot + one copy), ``reference`` (device-side reference
computations from raw uploads, the way engines did it) and ``per-tensor`` (attnmeta's host arrays,
each uploaded through its own freshly pinned tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from attnmeta._workloads import decode_spec, mixed_spec
from attnmeta.bench import Case, Uploads
from attnmeta.spec import BatchSpec

__all__ = ["SCENARIOS"]



# ------------------------------------------------------------------------------------ uploads
def _uploader(device: torch.device, counter: Uploads) -> Callable[[np.ndarray], torch.Tensor]:
    """Per-tensor upload the way ``async_tensor_h2d`` does it: a fresh pinned tensor per array."""
    pin = device.type == "cuda"

    def up(a: np.ndarray) -> torch.Tensor:
        counter.add(a)
        t = torch.from_numpy(np.ascontiguousarray(a))
        if pin:
            return t.pin_memory().to(device, non_blocking=True)
        return t.clone()

    return up


def _raw_uploader(device: torch.device, counter: Uploads) -> Callable[[np.ndarray], torch.Tensor]:
    """The engine-style upload of raw inputs: ``torch.as_tensor(np, device=...)`` (blocking H2D)."""

    def up(a: np.ndarray) -> torch.Tensor:
        counter.add(a)
        return torch.as_tensor(a, device=device)

    return up


# ------------------------------------------------------------------------------------ batches
# ------------------------------------------------------------------------------------ paths
def _common_paths(spec: BatchSpec, device: torch.device, stage_extra: Callable[[Any, Any], Any] | None,
                  ref_extra: Callable[[dict[str, torch.Tensor], Callable[[np.ndarray], torch.Tensor]], Any] | None,
                  host_extra: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None) -> Case:
    from attnmeta.host import layout
    from attnmeta.metadata import stage_common
    from attnmeta.staging import Stager
    from attnmeta.testing import reference as ref

    stager = Stager(device)
    ups = {"attnmeta": Uploads(), "reference": Uploads(), "per-tensor": Uploads()}

    def attnmeta_step() -> Any:
        with stager.step() as step:
            common = stage_common(spec, step)
            extra = stage_extra(common, step) if stage_extra is not None else None
        ups["attnmeta"].copies += step.stats.copies
        ups["attnmeta"].bytes += step.stats.bytes
        out = common.result()
        return out if extra is None else (out, extra.result())

    raw = _raw_uploader(device, ups["reference"])
    W = int(-(-spec.max_seq_len // spec.block_size)) if spec.num_reqs else 1

    def reference_step() -> Any:
        c, q = raw(spec.num_computed_tokens), raw(spec.num_scheduled_tokens)
        bt = raw(np.ascontiguousarray(spec.block_table[:, :W]))
        Bp, Tp = spec.padded_num_reqs, spec.padded_num_tokens
        fields = {
            "query_start_loc": ref.ref_query_start_loc(q, Bp),
            "seq_lens": ref.ref_seq_lens(c, q, Bp),
            "block_table": bt,
        }
        fields["positions"], fields["slot_mapping"] = ref.ref_token_layout(c, q, bt, spec.block_size, Tp)
        if ref_extra is not None:
            return ref_extra(fields, raw)
        return fields

    per = _uploader(device, ups["per-tensor"])

    def per_tensor_step() -> Any:
        c, q = spec.num_computed_tokens, spec.num_scheduled_tokens
        Bp, Tp = spec.padded_num_reqs, spec.padded_num_tokens
        host = {
            "query_start_loc": layout.query_start_loc(q, num_reqs_padded=Bp),
            "seq_lens": layout.seq_lens(c, q, num_reqs_padded=Bp),
            "block_table": np.ascontiguousarray(spec.block_table[:, :W]),
        }
        host["positions"], host["slot_mapping"] = layout.token_layout(
            c, q, spec.block_table, spec.block_size, num_tokens_padded=Tp)
        if host_extra is not None:
            host.update(host_extra(host))
        return {k: per(v) for k, v in host.items()}

    return Case("", spec.num_reqs, {"attnmeta": attnmeta_step, "reference": reference_step,
                                    "per-tensor": per_tensor_step}, ups, stager)


def _scenario_common(name: str, specs: list[tuple[int, BatchSpec]], device: torch.device) -> list[Case]:
    cases = []
    for batch, spec in specs:
        case = _common_paths(spec, device, None, None, None)
        case.scenario, case.batch = name, batch
        cases.append(case)
    return cases


def decode_common(device: torch.device, quick: bool) -> list[Case]:
    """Common metadata only, decode batches of 1..1024 (2048-column table, page 16)."""
    rng = np.random.default_rng(0)
    sizes = [1, 8, 64] if quick else [1, 8, 64, 256, 1024]
    return _scenario_common("decode-common", [(b, decode_spec(b, rng)) for b in sizes], device)


def mixed_common(device: torch.device, quick: bool) -> list[Case]:
    """Common metadata of the mixed batch (64 prefills, 192 decodes)."""
    rng = np.random.default_rng(1)
    spec = mixed_spec(rng, prefills=8 if quick else 64, decodes=24 if quick else 192)
    return _scenario_common("mixed-common", [(spec.num_reqs, spec)], device)


SCENARIOS: dict[str, Callable[[torch.device, bool], list[Case]]] = {
    "decode-common": decode_common,
    "mixed-common": mixed_common,
}
