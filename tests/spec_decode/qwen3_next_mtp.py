"""A tiny Qwen3-Next checkpoint with a random multi-token-prediction layer in the published layout
(`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`: a full gated-attention
block with the shared-expert MoE, `mtp.norm`), which transformers skips on load (HF parity stays the
target's). The block's tensors are a second random model's full-attention layer, every 1-D one random."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_models import build_tiny_model

FULL_LAYER = 3  # tiny_models' hybrid: layers 0-2 gated DeltaNet, layer 3 full attention (MoE)


def build_tiny_qwen3_next_mtp(path: Path, seed: int = 0) -> Path:
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(Path(path), "qwen3_next", seed=seed)
    donor = load_file(str(build_tiny_model(path.parent / f"{path.name}_donor", "qwen3_next", seed=seed + 7)
                          / "model.safetensors"))
    weights = load_file(str(path / "model.safetensors"))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    gen = torch.Generator().manual_seed(seed + 1)
    source = f"model.layers.{FULL_LAYER}."
    for name, tensor in donor.items():
        if name.startswith(source):
            weights["mtp.layers.0." + name[len(source):]] = tensor.clone()
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):  # zero-centred: scale 1 + w
        weights[f"mtp.{norm}.weight"] = 0.2 * torch.randn(hidden, generator=gen)
    weights["mtp.fc.weight"] = 0.15 * torch.randn(hidden, 2 * hidden, generator=gen)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path
