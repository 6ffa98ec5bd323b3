"""How many examples a property with a count of its own runs under the loaded hypothesis profile.

Most properties take the profile's ``max_examples`` (tests/conftest.py: ``dev`` 50, ``ci`` 100,
``thorough`` 1000, ``gpu`` 25). A property whose examples are slow (a third party's builders, a kernel
under an interpreter) names its own count instead; :func:`scaled_examples` keeps that count under the everyday
profiles and scales it with a deeper one, so ``ATTNMETA_HYPOTHESIS_PROFILE=thorough`` runs every
property deeper, not only those without a count (tests/test_repo_rules.py checks that no
``@settings(max_examples=...)`` in the suite names a bare number).
"""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 100
"""``max_examples`` of the ``ci`` profile: the profile a property's own count is written for."""


def scaled_examples(count: int) -> int:
    """``count`` examples, or more under a profile deeper than ``ci``: ``count`` times the loaded
    profile's ``max_examples`` over ``ci``'s (``thorough``: ten times), never fewer than ``count``.

    >>> scaled_examples(40) >= 40
    True
    """
    if count < 1:
        raise ValueError(f"count: expected at least one example, got {count}")
    return max(count, count * settings.default.max_examples // CI_EXAMPLES)
