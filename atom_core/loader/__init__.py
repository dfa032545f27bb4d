"""Model directories, configs, tokenizers and weights."""
from atom_core.loader.model_dir import ModelFiles, resolve_model_files
from atom_core.loader.weights import init_dummy_weights, load_weights

__all__ = ["ModelFiles", "resolve_model_files", "load_weights", "init_dummy_weights"]
