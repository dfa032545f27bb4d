"""torch.compile for levels 2 and 3: the model compiled with the graph split at attention.

Attention (KV store + paged attention) runs as one opaque custom op, `atom::paged_attention`,
so Dynamo/Inductor compile everything between attention calls (projections stay cuBLAS;
norms, residual adds, RoPE and SiLU-and-mul become Inductor-fused kernels, so the
elementwise layers use their torch reference implementations here). Token count is a dynamic
dimension: one compiled graph serves prefill chunks and every decode batch size.
Compiled artifacts are cached by Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR), so a
second start of the same model compiles much faster.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from atom_core.kernels import torch_ref
from atom_core.model_ops.activation import SiluAndMul
from atom_core.model_ops.attention import Attention
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from atom_core.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def compile_model(runner: "ModelRunner") -> None:
    for module in runner.model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul, RotaryEmbedding)):
            module.ops = torch_ref  # Inductor fuses these better than separate launches
        if isinstance(module, Attention):
            module.use_custom_op = True
    inner = runner.model.model
    inner.forward = torch.compile(inner.forward, dynamic=True, fullgraph=True)
    logger.info("model compiled lazily on first call (graph split at attention)")
