"""The reliability soak, ``python -m benchmarks soak``: see `benchmarks.soak.command`."""
