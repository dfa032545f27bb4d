"""Engine-level diagnostics: `python -m benchmarks.engine.NAME`."""
