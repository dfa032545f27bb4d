"""Kernel micro-benchmarks and tuners: `python -m benchmarks.kernels.NAME` on a GPU."""
