"""Benchmarks: named tree workloads, baselines, timing and report tables."""
