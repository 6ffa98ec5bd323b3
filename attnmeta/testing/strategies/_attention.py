"""Hypothesis strategies (_attention). Requires hypothesis."""

__all__: list[str] = []
