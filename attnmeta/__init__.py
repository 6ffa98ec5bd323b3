"""attnmeta: attention metadata for LLM serving, derived on the host, uploaded in one copy.

See README.md and docs/ for the guide. The public surface is re-exported here.
"""

from attnmeta.spec import BatchSpec, ContextParallel

__all__ = ["BatchSpec", "ContextParallel"]
__version__ = "0.1.0"
