"""MoonViT, Kimi-K2.5's vision tower, and the patch-merger projector that feeds its text model.

Per image (an image is `grid = (1, h, w)` patches of `patch_size`² pixels, h and w multiples of the
merge kernel): a linear patch embedding (the checkpoint's conv, kernel = stride = patch size), plus the
learned [pos_emb_height, pos_emb_width] position table resampled bicubically to (h, w); blocks of
pre-LayerNorm bidirectional attention with 2-D rotary positions and a GELU(tanh) MLP; a final
LayerNorm; then the projector merges each 2x2 block of patches into one text-token embedding
(LayerNorm per patch, concatenation, Linear, GELU, Linear to the text hidden size).

2-D RoPE: each head's dims pair up as (2i, 2i+1) and rotate as complex numbers; pair 2k by
col * f_k, pair 2k+1 by row * f_k, f_k = theta^(-4k / head_dim). This is the published checkpoint's
layout (MoonViT's `wqkv` holds q and k in it); transformers permutes q/k rows on load to rotate halves
instead, which is the same product.

Module names follow the published checkpoint (vision_tower.patch_embed.*, vision_tower.encoder.blocks.N.
{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1}, mm_projector.{pre_norm, proj.0, proj.2}). Images only: a video
(t > 1) is refused. The tower's linears are replicated under tensor parallelism (each rank encodes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from atom_core.model_ops.linear import ReplicatedLinear
from atom_core.model_ops.vision_attention import segment_attention
from atom_core.quant import QuantConfig

VISION_NORM_EPS = 1e-5  # MoonViT's LayerNorms (blocks and final) are built with this eps
_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass(frozen=True)
class KimiVisionDims:
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    pos_emb_height: int
    pos_emb_width: int
    merge_kernel: tuple[int, int]
    rope_theta: float
    gelu_approximate: str  # F.gelu's `approximate` for the blocks' MLP
    projector_eps: float
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_size(self) -> int:
        return self.merge_kernel[0] * self.merge_kernel[1]


def _field(config, names: tuple[str, ...], default=None):
    """The first of `names` the config carries (the published checkpoint's own names first: vt_*,
    init_pos_emb_*, ... ; then transformers' kimi_k25_vision names)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"Kimi-K2.5 vision config has none of {', '.join(names)}")
    return default


def kimi_vision_dims(config) -> KimiVisionDims:
    """The tower's sizes from the config models/kimi_k25.py is built with: the text model's config carrying
    the outer config's `vision_config` and projector fields (loader/model_dir.py); ValueError for an option
    this tower does not implement."""
    vc = config.vision_config
    for name, expected in (("merge_type", "sd2_tpool"), ("pos_emb_type", "divided_fixed"),
                           ("mm_projector_type", "patchmerger"), ("projector_hidden_act", "gelu")):
        value = getattr(vc, name, None)
        if value not in (None, expected):
            raise ValueError(f"Kimi-K2.5 vision_config.{name} {value!r} is not supported; expected {expected}")
    act = _field(vc, ("hidden_act",), "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ValueError(f"Kimi-K2.5 vision hidden_act {act!r} is not supported; expected one of: "
                         f"{', '.join(_ACTIVATIONS)}")
    rope = getattr(vc, "rope_parameters", None) or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"Kimi-K2.5 vision rope_type {rope['rope_type']!r} is not supported; expected axial")
    dims = KimiVisionDims(
        patch_size=int(_field(vc, ("patch_size",))),
        hidden_size=int(_field(vc, ("vt_hidden_size", "hidden_size"))),
        intermediate_size=int(_field(vc, ("vt_intermediate_size", "intermediate_size"))),
        num_heads=int(_field(vc, ("vt_num_attention_heads", "num_attention_heads"))),
        num_layers=int(_field(vc, ("vt_num_hidden_layers", "num_hidden_layers"))),
        pos_emb_height=int(_field(vc, ("init_pos_emb_height", "pos_emb_height"))),
        pos_emb_width=int(_field(vc, ("init_pos_emb_width", "pos_emb_width"))),
        merge_kernel=tuple(int(k) for k in _field(vc, ("merge_kernel_size",))),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        gelu_approximate=_ACTIVATIONS[act],
        projector_eps=float(_field(vc, ("projector_ln_eps",), getattr(config, "projection_layer_norm_eps", 1e-5))),
        text_hidden_size=int(config.hidden_size),
    )
    projected = _field(vc, ("mm_hidden_size",), getattr(config, "projection_hidden_size", None) or dims.hidden_size)
    if int(projected) != dims.hidden_size:
        raise ValueError(f"Kimi-K2.5 projector input size {projected} differs from the tower's hidden size "
                         f"{dims.hidden_size}")
    if dims.hidden_size % dims.num_heads or dims.head_dim % 4:
        raise ValueError(f"Kimi-K2.5 vision head size {dims.hidden_size}/{dims.num_heads} must be a multiple of 4 "
                         "(2-D rotary: two axes of complex pairs)")
    return dims


def rotary_2d(grids: list[tuple[int, int, int]], head_dim: int, theta: float, device) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """cos, sin [num_patches, head_dim / 2] of each patch's complex pairs (module docstring), float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device) / (head_dim // 2))
    angles = []
    for _, h, w in grids:
        rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
        cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
        pairs = torch.stack([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1)  # [h*w, hd/4, 2]
        angles.append(pairs.flatten(1))
    angles = torch.cat(angles)
    return angles.cos(), angles.sin()


def apply_rotary_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]: rotate each (2i, 2i+1) pair by its patch's angle, in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)


class KimiPatchEmbed(nn.Module):
    """Patches [N, 3, p, p] -> [N, hidden]: the conv as one matmul, plus the resampled position table."""

    def __init__(self, dims: KimiVisionDims):
        super().__init__()
        p = dims.patch_size
        self.proj = nn.Conv2d(3, dims.hidden_size, kernel_size=p, stride=p)
        self.pos_emb = nn.Module()
        self.pos_emb.weight = nn.Parameter(torch.empty(dims.pos_emb_height, dims.pos_emb_width, dims.hidden_size),
                                           requires_grad=False)
        self.proj.requires_grad_(False)

    def position_table(self, h: int, w: int) -> torch.Tensor:
        table = self.pos_emb.weight
        if (h, w) == tuple(table.shape[:2]):
            return table.flatten(0, 1)
        # transformers and MoonViT resample with bicubic, half-pixel centres, edge clamping
        resized = F.interpolate(table.permute(2, 0, 1)[None].float(), size=(h, w), mode="bicubic",
                                align_corners=False)
        return resized[0].permute(1, 2, 0).flatten(0, 1).to(table.dtype)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        weight = self.proj.weight
        hidden = F.linear(pixels.to(weight.dtype).flatten(1), weight.flatten(1), self.proj.bias)
        pos = torch.cat([self.position_table(h, w) for _, h, w in grids])
        return hidden + pos


class KimiVisionBlock(nn.Module):
    def __init__(self, dims: KimiVisionDims, prefix: str, quant_config: QuantConfig | None):
        super().__init__()
        d = dims.hidden_size
        self.num_heads, self.head_dim = dims.num_heads, dims.head_dim
        self.gelu_approximate = dims.gelu_approximate
        self.norm0 = nn.LayerNorm(d, eps=VISION_NORM_EPS)
        self.norm1 = nn.LayerNorm(d, eps=VISION_NORM_EPS)
        self.wqkv = ReplicatedLinear(d, 3 * d, bias=True, quant_config=quant_config, prefix=f"{prefix}.wqkv")
        self.wo = ReplicatedLinear(d, d, bias=True, quant_config=quant_config, prefix=f"{prefix}.wo")
        self.mlp = nn.Module()
        self.mlp.fc0 = ReplicatedLinear(d, dims.intermediate_size, bias=True, quant_config=quant_config,
                                        prefix=f"{prefix}.mlp.fc0")
        self.mlp.fc1 = ReplicatedLinear(dims.intermediate_size, d, bias=True, quant_config=quant_config,
                                        prefix=f"{prefix}.mlp.fc1")
        for norm in (self.norm0, self.norm1):
            norm.requires_grad_(False)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                seq_lens: list[int]) -> torch.Tensor:
        q, k, v = self.wqkv(self.norm0(hidden)).view(hidden.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rotary_2d(q, *rope), apply_rotary_2d(k, *rope)
        hidden = hidden + self.wo(segment_attention(q, k, v, seq_lens, self.head_dim ** -0.5))
        mlp = F.gelu(self.mlp.fc0(self.norm1(hidden)), approximate=self.gelu_approximate)
        return hidden + self.mlp.fc1(mlp)


class KimiVisionEncoder(nn.Module):
    def __init__(self, dims: KimiVisionDims, prefix: str, quant_config: QuantConfig | None):
        super().__init__()
        self.blocks = nn.ModuleList(KimiVisionBlock(dims, f"{prefix}.blocks.{i}", quant_config)
                                    for i in range(dims.num_layers))
        self.final_layernorm = nn.LayerNorm(dims.hidden_size, eps=VISION_NORM_EPS)
        self.final_layernorm.requires_grad_(False)


class KimiVisionTower(nn.Module):
    """pixels [num_patches, 3, p, p] (every image's patches, row-major within an image) + each image's
    grid (1, h, w) -> the final hidden states [num_patches, hidden]."""

    def __init__(self, dims: KimiVisionDims, prefix: str = "vision_tower", quant_config: QuantConfig | None = None):
        super().__init__()
        self.dims = dims
        self.patch_embed = KimiPatchEmbed(dims)
        self.encoder = KimiVisionEncoder(dims, f"{prefix}.encoder", quant_config)

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        check_image_grids(grids, self.dims, pixels.shape[0])
        hidden = self.patch_embed(pixels, grids)
        rope = rotary_2d(grids, self.dims.head_dim, self.dims.rope_theta, hidden.device)
        seq_lens = [h * w for _, h, w in grids]
        for block in self.encoder.blocks:
            hidden = block(hidden, rope, seq_lens)
        return self.encoder.final_layernorm(hidden)


def check_image_grids(grids: list[tuple[int, int, int]], dims: KimiVisionDims, num_patches: int) -> None:
    kh, kw = dims.merge_kernel
    for t, h, w in grids:
        if t != 1:
            raise ValueError(f"Kimi-K2.5 vision tower takes images (grid t = 1), got t = {t}")
        if h % kh or w % kw:
            raise ValueError(f"image grid {h}x{w} is not a multiple of the merge kernel {kh}x{kw}")
    total = sum(h * w for _, h, w in grids)
    if total != num_patches:
        raise ValueError(f"image grids {grids} cover {total} patches, pixel values hold {num_patches}")


class KimiProjector(nn.Module):
    """Tower states [num_patches, hidden] -> text embeddings [num_patches / merge_size, text_hidden]: each
    kh x kw block of patches (row-major within the block, blocks row-major) becomes one token."""

    def __init__(self, dims: KimiVisionDims, prefix: str = "mm_projector", quant_config: QuantConfig | None = None):
        super().__init__()
        self.dims = dims
        merged = dims.hidden_size * dims.merge_size
        self.pre_norm = nn.LayerNorm(dims.hidden_size, eps=dims.projector_eps)
        self.pre_norm.requires_grad_(False)
        self.proj = nn.Sequential(
            ReplicatedLinear(merged, merged, bias=True, quant_config=quant_config, prefix=f"{prefix}.proj.0"),
            nn.GELU(),
            ReplicatedLinear(merged, dims.text_hidden_size, bias=True, quant_config=quant_config,
                             prefix=f"{prefix}.proj.2"),
        )

    def forward(self, hidden: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        kh, kw = self.dims.merge_kernel
        hidden = self.pre_norm(hidden)
        merged = []
        for image, (_, h, w) in zip(hidden.split([h * w for _, h, w in grids]), grids):
            blocks = image.view(h // kh, kh, w // kw, kw, -1).permute(0, 2, 1, 3, 4)
            merged.append(blocks.reshape((h // kh) * (w // kw), -1))
        return self.proj(torch.cat(merged))
