"""Plugin mode (atom_core/plugin/) on the GPU machine: vLLM with and without atom_core's classes."""
