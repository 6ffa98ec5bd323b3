"""Hypothesis strategies (_batch). Requires hypothesis."""

__all__: list[str] = []
