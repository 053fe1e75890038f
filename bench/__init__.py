"""Benchmarks: ftrt and its baselines measured side by side in the same run (``python -m bench``)."""
