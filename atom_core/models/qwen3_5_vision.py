"""Qwen3.5's vision tower (HF Qwen3_5VisionModel, a Qwen3-VL tower without its deepstack mergers):
patches -> Conv3d patch embedding + a learned position grid resampled bilinearly to each image's grid ->
pre-norm ViT blocks (full attention within each image, 2-D rotary over the patch row and column) ->
a merger that folds each 2x2 block of patches into one text-model token.

Its inputs come from the resized uint8 image the API process made (multimodal/processors/qwen3_5.py):
`pixel_patches` rescales, normalises and lays out the patches on the device as HF's image processor
does on the host. Replicated on every tensor-parallel rank (it is small next to the text model).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.multimodal.inputs import MultimodalItem

_GELU = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


def pixel_patches(pixels: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, patch_size: int, merge_size: int,
                  temporal_patch_size: int) -> torch.Tensor:
    """uint8 [H, W, C] -> float32 [grid_h * grid_w, C * T * P * P] as HF's Qwen2VL image processor lays
    them out: x * (1/255) in float64 then float32, (x - mean) / std in float32, patches in 2x2-merge block
    order, each patch's frame repeated T times (an image is a clip of one frame)."""
    image = (pixels.permute(2, 0, 1).to(torch.float64) * (1 / 255)).to(torch.float32)
    image = (image - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    channels, height, width = image.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = image.reshape(channels, grid_h // merge_size, merge_size, patch_size, grid_w // merge_size,
                            merge_size, patch_size)
    patches = patches.permute(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    patches = patches.unsqueeze(5).expand(*patches.shape[:5], temporal_patch_size, *patches.shape[5:])
    return patches.reshape(grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = (((t.float() * cos) + (_rotate_half(t.float()) * sin)).to(x.dtype) for t in (q, k))
        outs, start = [], 0
        for length in lengths:  # attention within each image only
            s = slice(start, start + length)
            o = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1),
                                               scale=self.head_dim**-0.5)
            outs.append(o.transpose(0, 1).reshape(length, -1))
            start += length
        return self.proj(torch.cat(outs) if len(outs) > 1 else outs[0])


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        if act not in _GELU:
            raise ValueError(f"unsupported vision hidden_act {act!r}; expected one of: {', '.join(_GELU)}")
        self.linear_fc1, self.linear_fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), _GELU[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x, cos, sin, lengths):
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.shape = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        kernel = self.shape[1:]
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = patches.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(x.shape[0], -1)


class PatchMerger(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden = config.hidden_size * config.spatial_merge_size**2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x).view(-1, self.hidden))))


class Qwen3_5VisionTower(nn.Module):
    """Checkpoint names as HF's model.visual.* (the VLM maps them to visual.*)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.grid_side = int(config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        head_dim = config.hidden_size // config.num_heads
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device="cpu") / spatial))
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, C*T*P*P] of the images in `grids` order ((t, h, w) patches each) -> [N / merge^2, out]."""
        x = self.patch_embed(patches)
        indices, weights = self._position_taps(grids, x.device)
        x = x + (self.pos_embed(indices) * weights[:, :, None]).sum(1).to(x.dtype)
        rows, cols = self._patch_coordinates(grids, x.device)
        freqs = torch.cat([rows[:, None].float() * self.inv_freq, cols[:, None].float() * self.inv_freq], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [N, 1, head_dim]
        cos, sin = freqs.cos(), freqs.sin()
        lengths = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        return self.merger(x)

    def encode(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """MultimodalItems -> their embeddings [t * h * w / merge^2, out]: patches built on the device from
        each item's pixels and its processor's mean and std, one forward over all of them."""
        device = self.inv_freq.device
        c = self.config
        patches, grids = [], []
        for item in items:
            data = {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in item.data.items()}
            patches.append(pixel_patches(data["pixels"], data["image_mean"], data["image_std"], c.patch_size,
                                         self.merge, c.temporal_patch_size))
            grids.append(tuple(int(v) for v in item.data["grid_thw"]))
        out = self(torch.cat(patches), grids)
        return list(out.split([t * h * w // self.merge**2 for t, h, w in grids]))

    def _patch_coordinates(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, col) in its image, patches in merge-block order (block row, block col,
        row in block, col in block), repeated per frame."""
        rows, cols, m = [], [], self.merge
        for t, h, w in grids:
            r = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            c = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            rows.append(r.transpose(1, 2).reshape(-1).repeat(t))
            cols.append(c.transpose(1, 2).reshape(-1).repeat(t))
        return torch.cat(rows), torch.cat(cols)

    def _position_taps(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Bilinear (align_corners) taps into the square learned grid, per patch: 4 indices, 4 weights."""
        side = self.grid_side
        rows, cols = self._patch_coordinates(grids, device)
        heights = torch.cat([torch.full((t * h * w,), h, device=device) for t, h, w in grids])
        widths = torch.cat([torch.full((t * h * w,), w, device=device) for t, h, w in grids])

        def axis(index, size):
            src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
            floor = torch.floor(src)
            offsets = torch.arange(0, 2, device=device)
            taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
            return taps, (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)

        h_taps, h_weights = axis(rows, heights)
        w_taps, w_weights = axis(cols, widths)
        indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        return indices, (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
