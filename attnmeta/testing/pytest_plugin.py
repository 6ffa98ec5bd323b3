"""Placeholder replaced by the sync-audit work: the pytest plugin of attnmeta.sync."""
