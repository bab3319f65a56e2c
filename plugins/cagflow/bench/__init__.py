"""Benchmarks behind ``cagflow bench``: reported and saved, never asserted."""
