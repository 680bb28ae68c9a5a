"""Helpers the tests and benchmarks share; never published (see ../../README.md)."""
