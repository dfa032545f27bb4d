"""Benchmarks and diagnostics of atom_core that users never call (not installed)."""
