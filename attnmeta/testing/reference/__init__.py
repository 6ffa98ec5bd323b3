"""Device-side reference implementations: the oracle for every host derivation.

Each function takes torch tensors on any device and computes the same output the straightforward way
engines did before attnmeta (device arithmetic, boolean masks, ``bincount``, ``.item()``): obviously
correct, synchronisations and all. Property tests assert attnmeta's host path equals these bit for
bit, on ``cpu`` in CI and on ``cuda`` on a GPU machine.
"""

from attnmeta.testing.reference import attention as _attention
from attnmeta.testing.reference import eplb as _eplb
from attnmeta.testing.reference import gdn as _gdn
from attnmeta.testing.reference import kernel_blocks as _kernel_blocks
from attnmeta.testing.reference import layout as _layout
from attnmeta.testing.reference import mamba as _mamba
from attnmeta.testing.reference import mla as _mla
from attnmeta.testing.reference import mm_prefix as _mm_prefix
from attnmeta.testing.reference import ubatch as _ubatch
from attnmeta.testing.reference.attention import *  # noqa: F403
from attnmeta.testing.reference.eplb import *  # noqa: F403
from attnmeta.testing.reference.gdn import *  # noqa: F403
from attnmeta.testing.reference.kernel_blocks import *  # noqa: F403
from attnmeta.testing.reference.layout import *  # noqa: F403
from attnmeta.testing.reference.mamba import *  # noqa: F403
from attnmeta.testing.reference.mla import *  # noqa: F403
from attnmeta.testing.reference.mm_prefix import *  # noqa: F403
from attnmeta.testing.reference.ubatch import *  # noqa: F403

__all__ = [*_layout.__all__, *_mamba.__all__, *_attention.__all__, *_kernel_blocks.__all__, *_eplb.__all__, *_ubatch.__all__, *_mm_prefix.__all__, *_mla.__all__, *_gdn.__all__]
