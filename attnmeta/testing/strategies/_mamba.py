"""Hypothesis strategies (_mamba). Requires hypothesis."""

__all__: list[str] = []
