"""attnmeta's property-test toolkit.

- :mod:`attnmeta.testing.strategies`: hypothesis strategies for valid batches (requires hypothesis).
- :mod:`attnmeta.testing.reference`: straightforward device-side torch implementations of every host
  derivation (the way engines used to compute metadata, synchronisations included): the oracle.
- :mod:`attnmeta.testing.assertions`: bit-exact comparison of host results with device tensors.
- :mod:`attnmeta.testing.workloads`: seeded random batches (numpy only) for audits and benchmarks.
- :mod:`attnmeta.testing.builders`: :func:`check_builder` (a builder's fields against its reference),
  :func:`check_metadata` (metadata staged any other way, a step composer's for one, against the same
  reference), :func:`check_reads_lengths` and :func:`check_any_rows_key` (the promises of
  ``Builder.reads_lengths`` and ``Builder.any_rows_key``, which :func:`check_builder` checks too) and :func:`audit_builder` (a builder under the sync audit), for any
  registered builder.

Nothing here is used on the serving path; these modules may read device tensors on the host.
"""

from attnmeta.testing.builders import (
    audit_builder,
    check_any_rows_key,
    check_builder,
    check_metadata,
    check_reads_lengths,
    check_replay,
    writable_host_arrays,
)

__all__ = ["audit_builder", "check_any_rows_key", "check_builder", "check_metadata", "check_reads_lengths",
           "check_replay", "writable_host_arrays"]
