"""Benchmarks: each prints its figures (``python -m tools.bench.<name> --help``); ``run`` runs them all side by side."""
