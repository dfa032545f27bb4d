"""FP8 (e4m3) format, the torch quantizers and the token limits the FP8 kernels are built for.

Here, below quant/, because the Triton FP8 kernels need the same constants and their torch
references as oracles; `quant/fp8_ops.py` (the products and their dispatch) imports them from here.

Conventions:
  fp8 dtype     torch.float8_e4m3fn, finite range [-448, 448] (FP8_MAX); values are scaled into
                that range, rounded to nearest (torch's cast) and clamped.
  scales        float32 *dequantization* multipliers: real = fp8.float() * scale.
  block layout  weight fp8 [N, K] with scale_inv float32 [ceil(N/bn), ceil(K/bk)]; block (i, j)
                covers rows i*bn .. min((i+1)*bn, N) and columns j*bk .. min((j+1)*bk, K).
"""
from __future__ import annotations

import torch

from atom_core.kernels.torch_ref import ieee_div

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # an all-zero row/group gets a tiny positive scale (stays zero)
SMALL_M_MAX = 16  # tokens up to which a linear is decode-shaped: a weight stream (one BLOCK_M 16 tile row)
GEMV_MAX_TOKENS = 4  # tokens the FP8 GEMV takes (it keeps an accumulator per token)


def _cast(xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (fp8 like x, float32 scale [1]); dynamic (absmax / 448) unless a static `scale` is given."""
    xf = x.float()
    if scale is None:
        scale = ieee_div(xf.abs().amax(), FP8_MAX).clamp(min=MIN_SCALE).reshape(1)
    scale = scale.float().reshape(1).to(x.device)
    return _cast(xf, scale), scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, 1]), one absmax scale per row."""
    xf = x.float()
    scale = ieee_div(xf.abs().amax(dim=-1, keepdim=True), FP8_MAX).clamp(min=MIN_SCALE)
    return _cast(xf, scale), scale


def quantize_fp8_per_token_group(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, ceil(K / group_size)]); the last group may be partial."""
    m, k = x.shape
    groups = -(-k // group_size)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group_size - k)).reshape(m, groups, group_size)
    scale = ieee_div(xf.abs().amax(dim=-1, keepdim=True), FP8_MAX).clamp(min=MIN_SCALE)
    q = _cast(xf, scale).reshape(m, groups * group_size)[:, :k]
    return q.contiguous(), scale.squeeze(-1)


def quantize_fp8_block(w: torch.Tensor, block_size: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (fp8 [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)]), absmax per block
    (how DeepSeek-V3 / Qwen3-FP8 checkpoints are made; used for online quantization and tests)."""
    bn, bk = block_size
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    wf = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).reshape(nb, bn, kb, bk)
    scale = ieee_div(wf.abs().amax(dim=(1, 3), keepdim=True), FP8_MAX).clamp(min=MIN_SCALE)
    q = _cast(wf, scale).reshape(nb * bn, kb * bk)[:n, :k]
    return q.contiguous(), scale.reshape(nb, kb)


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Block fp8 W [N, K] with scale_inv [ceil(N/bn), ceil(K/bk)] -> float32 [N, K]."""
    bn, bk = block_size
    n, k = w.shape
    s = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return w.float() * s
