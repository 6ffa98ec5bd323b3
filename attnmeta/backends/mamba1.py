"""Mamba1 metadata (vllm-semantics.md 6.12): the ``stage`` / ``build`` pair of the Mamba1 builder.

The implementation is shared with the Mamba2 builder in :mod:`attnmeta.backends.mamba2` (the two
differ only in the threshold, the spec-decode fields and the chunk metadata); this module gives it
the usual per-backend names. See :class:`~attnmeta.backends.mamba2.Mamba1Metadata` for the fields.

Shape legend
------------
- ``num_reqs`` (``B``), ``num_decodes`` (``D``), ``num_prefills`` (``P``): as in
  :mod:`attnmeta.backends.mamba2`.
"""

from __future__ import annotations

from attnmeta.backends.mamba2 import Mamba1Metadata, Mamba1Options, block_table_columns
from attnmeta.backends.mamba2 import build_mamba1 as build
from attnmeta.backends.mamba2 import stage_mamba1 as stage

__all__ = ["Mamba1Metadata", "Mamba1Options", "block_table_columns", "build", "stage"]
