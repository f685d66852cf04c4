"""Benchmarks behind `deepinfer bench`."""
