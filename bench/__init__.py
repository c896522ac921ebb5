"""Benchmarks: each measures a physical limit in the same run and reports its result as a ratio to it."""
