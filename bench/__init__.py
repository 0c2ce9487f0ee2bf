"""Benchmarks: throughput of the pipeline and the trainer, with machine-readable results."""
