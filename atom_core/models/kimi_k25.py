"""Kimi-K2.5 (KimiK25ForConditionalGeneration in the published config, Kimi_K25ForConditionalGeneration in
transformers): the MoonViT tower and patch-merger projector (models/kimi_k25_vision.py) in front of the
DeepSeek-V3 text model (models/deepseek_v2.py, Kimi-K2's). Each image's `<|media_pad|>` run in the prompt
takes the projector's outputs in place of token embeddings (the kit's embeddings-input seam); positions stay
token indices (the text model's rotary is 1-D).

Built from the text model's config, which carries the outer config's vision_config and projector fields
(loader/model_dir.py). Checkpoints: the published layout (language_model.model.*, language_model.lm_head,
vision_tower.{patch_embed, encoder}.*, mm_projector.*), and the one transformers' save_pretrained writes,
which differs in three names (`checkpoint_name`).
"""
from __future__ import annotations

import torch

from atom_core.models.deepseek_v2 import DeepseekV3ForCausalLM
from atom_core.models.kimi_k25_vision import KimiProjector, KimiVisionTower, kimi_vision_dims
from atom_core.multimodal.inputs import MultimodalItem
from atom_core.quant import QuantConfig


def image_patches(item: MultimodalItem, patch_size: int, device: torch.device) -> torch.Tensor:
    """An item's padded uint8 image -> normalised patches [gh * gw, 3, p, p] in float32, as transformers'
    processor lays them out (multimodal/processors/kimi_k25.py)."""
    data = item.data
    _, gh, gw = (int(x) for x in data["grid_thw"])
    pixels = torch.from_numpy(data["pixels"]).to(device, non_blocking=True).permute(2, 0, 1).float()
    mean = torch.from_numpy(data["mean"]).to(device).view(-1, 1, 1)
    std = torch.from_numpy(data["std"]).to(device).view(-1, 1, 1)
    pixels = (pixels - mean) / std
    return pixels.view(3, gh, patch_size, gw, patch_size).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, patch_size,
                                                                                         patch_size)


class KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM):
    supports_images = True

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        super().__init__(config, prefix, quant_config)
        dims = kimi_vision_dims(config)
        self.vision_tower = KimiVisionTower(dims, "vision_tower", quant_config)
        self.mm_projector = KimiProjector(dims, "mm_projector", quant_config)

    def encode_images(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """All items through the tower in one packed batch (attention stays within each image)."""
        device = self.lm_head.weight.device
        patch = self.vision_tower.dims.patch_size
        grids = [tuple(int(x) for x in item.data["grid_thw"]) for item in items]
        pixels = torch.cat([image_patches(item, patch, device) for item in items])
        embeds = self.mm_projector(self.vision_tower(pixels, grids), grids)
        return list(embeds.split([item.length for item in items]))

    def checkpoint_name(self, name: str) -> str:
        if name.startswith("language_model.model.blocks."):  # save_pretrained renames every "layers"
            return "model.layers." + name[len("language_model.model.blocks."):]
        for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                         ("model.language_model.", "model."), ("model.mm_projector.", "mm_projector."),
                         ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")):
            if name.startswith(old):
                return new + name[len(old):]
        return name
