"""Weight loading from safetensors (single or sharded), and dummy weights for benchmarks.

Checkpoint names are matched to parameters by whole dotted components, by rules the model
declares, most specific first (after the model's `checkpoint_name`, where it has one, moved a
name into its own namespace, e.g. a vision-language checkpoint's model.language_model.* to model.*):

1. `expert_params_mapping` entries (param, checkpoint, expert_id, shard_id): the checkpoint
   name ends with the components of `checkpoint` (leaf included, e.g.
   "experts.7.gate_proj.weight"); the target is the name's prefix + `param`
   (e.g. "experts.w13_weight"), loaded with (shard_id, expert_id).
2. `stacked_params_mapping` entries (param, checkpoint, shard_id): the module right before the
   leaf is `checkpoint` (e.g. "q_proj" in "...self_attn.q_proj.weight"); it becomes `param`,
   the leaf stays ("...self_attn.qkv_proj.weight"), loaded with shard_id.
3. The name itself.

A rewrite counts only if its target parameter exists, so a dense rule never claims an
expert's tensor (`mlp.experts.7.gate_proj.weight` has no `mlp.experts.7.gate_up_proj.weight`):
it goes to the experts' parameter when the model has one, else it is reported as unexpected.
The loader never converts a tensor: each parameter's `weight_loader` owns dtype and layout.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
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


class NameMapper:
    """Checkpoint name -> (parameter name, loader kwargs), by the rules in the module docstring."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter]):
        self.params = params
        # (checkpoint suffix components) -> (param components, kwargs); looked up by suffix length.
        self.experts: dict[tuple[str, ...], tuple[tuple[str, ...], dict]] = {}
        for param, ckpt, expert_id, shard_id in getattr(model, "expert_params_mapping", []):
            self.experts[tuple(ckpt.split("."))] = (tuple(param.split(".")), {"shard_id": shard_id,
                                                                             "expert_id": expert_id})
        self.expert_lengths = sorted({len(k) for k in self.experts}, reverse=True)
        # (module components before the leaf) -> [(param components, shard_id)]: one checkpoint
        # module may feed several params across models (a rule per entry), first existing wins.
        self.stacked: dict[tuple[str, ...], list[tuple[tuple[str, ...], object]]] = {}
        for param, ckpt, shard_id in getattr(model, "stacked_params_mapping", []):
            self.stacked.setdefault(tuple(ckpt.split(".")), []).append((tuple(param.split(".")), shard_id))
        # KV-cache scales: checkpoints name them self_attn.k_scale / v_scale; our Attention layer
        # sits at self_attn.attn (the rule applies only where that parameter exists).
        self.stacked.setdefault(("self_attn",), []).append((("self_attn", "attn"), None))
        self.stacked_lengths = sorted({len(k) for k in self.stacked}, reverse=True)

    def map(self, name: str) -> tuple[str, dict] | None:
        parts = tuple(name.split("."))
        for n in self.expert_lengths:
            hit = self.experts.get(parts[-n:]) if n <= len(parts) else None
            if hit is not None:
                target = ".".join(parts[:-n] + hit[0])
                if target in self.params:
                    return target, dict(hit[1])
        leaf, module = parts[-1], parts[:-1]
        for n in self.stacked_lengths:
            for param_parts, shard_id in self.stacked.get(module[-n:], []) if n <= len(module) else []:
                target = ".".join(module[:-n] + param_parts + (leaf,))
                if target in self.params:
                    return target, {"shard_id": shard_id}
        return (name, {}) if name in self.params else None


def load_weights(model: nn.Module, path: Path) -> None:
    """Stream every tensor of the safetensors in `path` into its parameter (`load_named_tensors`)."""
    load_named_tensors(model, _read_checkpoint(path), str(path))


def _read_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_named_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> set[str]:
    """Load (checkpoint name, tensor) pairs into the parameters through each parameter's
    weight_loader; returns every parameter's name (each was filled, or keeps its default where it is
    optional_in_checkpoint). ValueError naming `source` when a tensor has no parameter or a
    parameter got nothing.

    A packed parameter (`expected_shards` set by its layer) counts as loaded once every shard
    arrived, or once a checkpoint tensor filled it whole.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    mapper = NameMapper(model, params)
    tied = getattr(model.config, "tie_word_embeddings", False)
    skip = getattr(model, "skip_checkpoint_weight", lambda name: False)
    rename = getattr(model, "checkpoint_name", lambda name: name)  # a checkpoint's namespace -> the model's
    loaded: dict[str, set] = {}  # param name -> (shard_id, expert_id) keys loaded; (None, None) = whole
    for stored, tensor in tensors:
        name = rename(stored)
        if skip(name):
            continue
        mapped = mapper.map(name)
        if mapped is None:
            if name == "lm_head.weight" and tied:
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        target, kwargs = mapped
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor, **kwargs)
        # An expert rule without an expert id fills every expert at once (its shard id names a layout).
        whole = "expert_id" in kwargs and kwargs["expert_id"] is None
        loaded.setdefault(target, set()).add((None, None) if whole else (kwargs.get("shard_id"),
                                                                         kwargs.get("expert_id")))
    missing = []
    for name, param in params.items():
        keys = loaded.get(name)
        if keys is None:
            if not (tied and name == "lm_head.weight") and not getattr(param, "optional_in_checkpoint", False):
                missing.append(name)
            continue
        expected = getattr(param, "expected_shards", None)
        if expected is not None and (None, None) not in keys and not expected <= keys:
            lacking = sorted(expected - keys, key=str)
            missing.append(f"{name} (shards {', '.join(_shard_name(k) for k in lacking[:4])})")
    if missing:
        raise ValueError(f"checkpoint {source} lacks weights for: {', '.join(sorted(missing)[:8])}")
    return set(params)


def _shard_name(key: tuple) -> str:
    shard_id, expert_id = key
    return str(shard_id) if expert_id is None else f"expert {expert_id} {shard_id}"


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, scale: float = 1e-3) -> None:
    """Small uniform random weights drawn on the parameters' device (fast for 8B+ models).

    Values never affect speed; norms get 1 +- scale so activations keep their size. Every
    parameter is filled in its own dtype: integer ones (packed or quantized weights) with
    random integers of their dtype, low-precision floats (fp8) drawn in float32 and converted.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if getattr(param, "optional_in_checkpoint", False):
            continue  # keeps its default (e.g. KV-cache scales of 1.0): random ones would be meaningless
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if not param.dtype.is_floating_point:
            info = torch.iinfo(param.dtype)  # (almost) any bit pattern: packed weights use the sign bit too
            param.random_(info.min, info.max, generator=gen)
            continue
        low, high = (1 - scale, 1 + scale) if "norm" in name else (-scale, scale)
        if param.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            param.uniform_(low, high, generator=gen)
        else:
            param.copy_(torch.empty(param.shape, device=param.device).uniform_(low, high, generator=gen))
