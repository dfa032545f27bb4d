"""Model directories, configs, tokenizers and weights."""
from atom_core.loader.model_dir import ModelFiles, resolve_model, resolve_model_files
from atom_core.loader.model_loader import build_model, process_weights_after_loading
from atom_core.loader.weights import init_dummy_weights, load_named_tensors, load_weights

__all__ = ["ModelFiles", "build_model", "init_dummy_weights", "load_named_tensors", "load_weights",
           "process_weights_after_loading", "resolve_model", "resolve_model_files"]
