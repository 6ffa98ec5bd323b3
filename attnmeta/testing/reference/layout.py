"""Device-side reference implementations (layout); see attnmeta.testing.reference."""

__all__: list[str] = []
