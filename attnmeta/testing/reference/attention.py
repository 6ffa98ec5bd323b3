"""Device-side reference implementations (attention); see attnmeta.testing.reference."""

__all__: list[str] = []
