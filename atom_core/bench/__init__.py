"""Benchmarks: the online serving client (serve_*), its datasets, sweeps and plots."""
