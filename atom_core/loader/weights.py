"""Weight loading from safetensors (single or sharded), and dummy weights for benchmarks."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from atom_core.model_ops.linear import default_weight_loader


def _checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}; use load_format='dummy' for random weights")
    return files


def load_weights(model: nn.Module, path: Path) -> None:
    """Stream every tensor into its parameter through the parameter's weight_loader.

    Checkpoint names like `...q_proj.weight` are routed to packed parameters through the
    model's `packed_modules_mapping` (q/k/v -> qkv_proj shard 'q'/'k'/'v').
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping = getattr(model, "packed_modules_mapping", {})
    loaded: set[str] = set()
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb.inv_freq" in name:
                    continue
                target, shard = name, None
                for ckpt_part, (packed, shard_id) in mapping.items():
                    if f".{ckpt_part}." in name:
                        target, shard = name.replace(f".{ckpt_part}.", f".{packed}."), shard_id
                        break
                param = params.get(target)
                if param is None:
                    if name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False):
                        continue
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
                loader = getattr(param, "weight_loader", default_weight_loader)
                tensor = f.get_tensor(name)
                loader(param, tensor.to(param.dtype), shard) if shard is not None else loader(param, tensor.to(param.dtype))
                loaded.add(target)
    missing = {n for n in params if n not in loaded}
    if getattr(model.config, "tie_word_embeddings", False):
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for: {', '.join(sorted(missing)[:8])}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, scale: float = 1e-3) -> None:
    """Small uniform random weights drawn on the parameters' device (fast for 8B+ models).

    Values never affect speed; norms get 1 +- scale so activations keep their size.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        low, high = (1 - scale, 1 + scale) if "norm" in name else (-scale, scale)
        param.uniform_(low, high, generator=gen)
