"""Benchmarks: offline evaluation, search and end-to-end, each writing JSON, PNG and markdown."""
