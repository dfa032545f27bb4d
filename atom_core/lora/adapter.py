"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors), read and checked.

What is served: LoRA on the attention and MLP projections (q/k/v/o, gate/up/down) of a decoder's
layers, one rank and alpha for every module, scaling alpha / r (alpha / sqrt(r) with rsLoRA).
Everything else PEFT can write is refused with the reason, before any request uses the adapter:
embedding and lm_head adapters, DoRA, trained biases, modules_to_save, per-module rank or alpha
patterns, other PEFT types, a rank above --max-lora-rank.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<kind>[AB])\.weight$")
_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<target>\w+)$")
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclass(frozen=True)
class LoRAAdapter:
    """weights: HF module path (model.layers.N.self_attn.q_proj) -> (A [r, in], B [out, r]) on the CPU."""

    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> list[str]:
        return sorted({m.rsplit(".", 1)[1] for m in self.weights})


def _config(path: Path) -> dict:
    file = path / "adapter_config.json"
    if not path.is_dir():
        raise ValueError(f"LoRA adapter {str(path)!r} is not a directory")
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no adapter_config.json (a PEFT adapter directory is expected)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"LoRA adapter {str(path)!r}: adapter_config.json is not valid JSON ({e})") from None


def _check_config(cfg: dict, where: str, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a PEFT LoRA config this engine can serve; ValueError naming what it cannot."""
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg['peft_type']!r} is not supported; expected LORA")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={cfg['bias']!r} is not supported; expected 'none' (no trained biases)")
    if cfg.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save {cfg['modules_to_save']} is not supported "
                         "(embedding / lm_head adapters and fully trained modules are not served)")
    for name in ("rank_pattern", "alpha_pattern"):
        if cfg.get(name):
            raise ValueError(f"{where}: {name} is not supported (one rank and alpha for every module)")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out (Conv1D layers) is not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{where}: lora_alpha={alpha!r} must be a positive number")
    return rank, alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)


def load_adapter(path: str | Path, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter directory; ValueError names what is wrong with it."""
    from safetensors.torch import load_file

    path = Path(path)
    where = f"LoRA adapter {str(path)!r}"
    rank, scaling = _check_config(_config(path), where, max_rank)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise ValueError(f"{where} has no adapter_model.safetensors (save it with safe_serialization=True)")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        match = _KEY.match(key)
        if match is None:
            if "embedding" in key or "lm_head" in key or "embed_tokens" in key:
                raise ValueError(f"{where}: embedding / lm_head adapters are not supported (tensor {key!r})")
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA A/B weight (DoRA magnitudes, biases and "
                             "other PEFT tensors are not supported)")
        pairs.setdefault(match["module"], {})[match["kind"]] = tensor
    if not pairs:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for module, ab in sorted(pairs.items()):
        target = module.rsplit(".", 1)[-1]
        if target in ("lm_head", "embed_tokens"):
            raise ValueError(f"{where}: embedding / lm_head adapters are not supported (module {module!r})")
        if target not in TARGET_MODULES:
            raise ValueError(f"{where}: target module {target!r} ({module}) is not supported; "
                             f"expected some of: {', '.join(TARGET_MODULES)}")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: module {module!r} lacks its lora_{'B' if 'A' in ab else 'A'} weight")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{where}: module {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                             f"expected A [r, in] and B [out, r] with r = {rank}")
        weights[module] = (a, b)
    return LoRAAdapter(str(path), rank, scaling, weights)


def _projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in, out) of each target projection of a standard decoder layer, from the HF config."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _is_moe(hf_config) -> bool:
    return any(getattr(hf_config, name, 0) for name in ("num_experts", "num_local_experts", "n_routed_experts"))


def check_adapter_shapes(adapter: LoRAAdapter, hf_config) -> None:
    """ValueError unless every module of `adapter` is a projection of the base model, of its shape."""
    where = f"LoRA adapter {adapter.path!r}"
    shapes = _projection_shapes(hf_config)
    for module, (a, b) in adapter.weights.items():
        match = _MODULE.match(module)
        if match is None or _BLOCK[match["target"]] != match["block"]:
            raise ValueError(f"{where}: module {module!r} is not a decoder layer projection "
                             "(model.layers.N.self_attn.{q,k,v,o}_proj or model.layers.N.mlp.{gate,up,down}_proj)")
        if int(match["layer"]) >= hf_config.num_hidden_layers:
            raise ValueError(f"{where}: module {module!r} is past the base model's {hf_config.num_hidden_layers} layers")
        if match["block"] == "mlp" and _is_moe(hf_config):
            raise ValueError(f"{where}: module {module!r}: MLP adapters on a mixture-of-experts model are not supported")
        want_in, want_out = shapes[match["target"]]
        if a.shape[1] != want_in or b.shape[0] != want_out:
            raise ValueError(f"{where}: module {module!r} maps {a.shape[1]} -> {b.shape[0]} features; the base model's "
                             f"maps {want_in} -> {want_out} (an adapter for another model?)")
