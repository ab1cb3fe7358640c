"""Benchmarks run as modules (``python -m pagedlm.benchmarks.<name>``)."""
