"""Public hypothesis strategies for valid attnmeta inputs. Requires hypothesis.

Every strategy builds valid objects by construction (it draws lists and derives lengths; it never
draws a size first and never filters), takes keyword-only arguments with sensible defaults, and
accepts strategies for the knobs users want to vary. Impossible argument combinations raise
``hypothesis.errors.InvalidArgument`` when drawn.
"""

try:
    import hypothesis  # noqa: F401  (the strategies are hypothesis strategies)
except ImportError as _error:
    raise ImportError(f"attnmeta.testing.strategies needs hypothesis, which is not importable here ({_error}): "
                      f"pip install 'attnmeta[test]' (or pip install hypothesis)", name="hypothesis") from None

from attnmeta.testing.strategies import _attention, _batch, _mamba
from attnmeta.testing.strategies._attention import *  # noqa: F403
from attnmeta.testing.strategies._batch import *  # noqa: F403
from attnmeta.testing.strategies._mamba import *  # noqa: F403

__all__ = [*_batch.__all__, *_mamba.__all__, *_attention.__all__]
