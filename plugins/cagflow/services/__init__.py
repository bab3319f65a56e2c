"""Local service runners used by development tooling and tests."""
