"""Fixtures for tests and benchmarks: random models at a given geometry and profiler-trace readers.
Nothing in the product imports this package."""
