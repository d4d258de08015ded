"""Benchmarks: ``python -m benchmarks`` prints a table and writes the same figures as JSON."""
