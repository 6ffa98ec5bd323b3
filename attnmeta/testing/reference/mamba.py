"""Device-side reference implementations (mamba); see attnmeta.testing.reference."""

__all__: list[str] = []
