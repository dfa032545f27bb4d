"""Rotary position embedding (neox style): the cos/sin cache, with the rope scalings our models use."""
from __future__ import annotations

import functools
import json
import math

import torch
from torch import nn


def rope_parameters(config) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from an HF config: new style (rope_parameters) or old (rope_scaling)."""
    params = getattr(config, "rope_parameters", None)
    if params:
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        scaling = params
    else:
        theta = getattr(config, "rope_theta", 10000.0)
        scaling = getattr(config, "rope_scaling", None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def partial_rotary_dim(config, head_dim: int) -> int:
    """head_dim * partial_rotary_factor (rope_parameters first, then the top-level field), as HF
    rounds it; for the families whose HF rotary reads the factor (e.g. GLM-4-MoE)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return int(head_dim * (1.0 if factor is None else factor))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, short kept."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (HF `_compute_yarn_parameters`): frequencies blended between interpolated (/factor)
    and original over a ramp of dims, and the factor cos/sin are multiplied by (`attention_factor`,
    else mscale / mscale_all_dim as DeepSeek sets them)."""
    factor = scaling["factor"]
    old_len = scaling["original_max_position_embeddings"]

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else get_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """The float32 cos/sin cache [max_position, rotary_dim] RoPE reads; the rotation itself runs
    inside the attention op's fused q/k-norm + RoPE + KV-store kernel (`qkv_rope_store`)."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_dim={head_dim}]")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim))
        kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(inv_freq, rotary_dim, base, scaling)
        elif kind is not None:
            raise ValueError(f"unsupported rope scaling {kind!r}; expected one of: llama3, linear, yarn")
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        if kind == "yarn":
            cache = cache * attention_factor
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()), persistent=False)


@functools.lru_cache(maxsize=8)
def _cached_rotary(head_dim: int, rotary_dim: int, max_position: int, base: float, scaling_json: str,
                   device: str) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, json.loads(scaling_json))


def shared_rotary_embedding(head_dim: int, rotary_dim: int, max_position: int, base: float,
                            scaling: dict | None = None) -> RotaryEmbedding:
    """One RotaryEmbedding (on the default device) for every layer with these arguments: a
    131072-position cache is 33 MB at head_dim 64, so a model whose layers all rotate alike
    should not hold one per layer. The cache is constant, so sharing it is safe."""
    return _cached_rotary(head_dim, rotary_dim, max_position, float(base), json.dumps(scaling, sort_keys=True),
                          str(torch.get_default_device()))


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE, interleaved (Qwen3-VL, Qwen3.5; HF's `recomposition_frequencies`): a token has
    a temporal, a height and a width position, and frequency j of the rotary dims turns with the
    height position when j % 3 == 1 and j < 3 * section[1], with the width position when j % 3 == 2
    and j < 3 * section[2], else with the temporal one. Text tokens have three equal positions, so
    for them this is plain RoPE over the same cache; `cos_sin_rows` gives image rows their own."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float, mrope_section: list[int]):
        super().__init__(head_dim, rotary_dim, max_position, base)
        if len(mrope_section) != 3:
            raise ValueError(f"mrope_section {mrope_section} must have 3 entries (temporal, height, width)")
        axis = torch.zeros(rotary_dim // 2, dtype=torch.int64, device="cpu")
        for dim in (1, 2):
            axis[dim : 3 * mrope_section[dim] : 3] = dim
        # per column of the [cos | sin] cache row: the axis whose position it reads
        self.register_buffer("column_axis", torch.cat([axis, axis]).to(torch.get_default_device()), persistent=False)

    def cos_sin_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [3, T] -> each token's cos/sin row [T, rotary_dim] (float32)."""
        rows = self.cos_sin_cache[positions]  # [3, T, rotary_dim]
        index = self.column_axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        return rows.gather(0, index).squeeze(0)
