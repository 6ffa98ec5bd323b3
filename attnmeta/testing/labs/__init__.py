"""The built-in builders' lab entries (:mod:`attnmeta.testing.lab`), one module per family.

:data:`BUILTIN` maps each built-in builder's registry name to its :class:`LabEntry`: the reference,
sample and defaults functions of that family's module here. :mod:`attnmeta.testing.lab` registers them.
"""

from __future__ import annotations

from attnmeta.testing.labs._entry import Defaults, LabEntry, LeadingColumns, Reference, Sample
from attnmeta.testing.labs.attention import ENTRIES as _ATTENTION
from attnmeta.testing.labs.mamba import ENTRIES as _MAMBA
from attnmeta.testing.labs.mla import ENTRIES as _MLA
from attnmeta.testing.labs.mm_prefix import ENTRIES as _MM_PREFIX

__all__ = ["BUILTIN", "Defaults", "LabEntry", "LeadingColumns", "Reference", "Sample"]

BUILTIN: dict[str, LabEntry] = {**_ATTENTION, **_MAMBA, **_MLA, **_MM_PREFIX}
"""Every built-in builder's lab entry, by registry name."""
