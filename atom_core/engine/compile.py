"""torch.compile for levels 2 and 3: the model compiled with the graph split at attention.

Attention (KV store + paged attention) runs as one opaque custom op, `atom::paged_attention`,
so Dynamo/Inductor compile everything around attention, one decoder layer at a time (projections stay cuBLAS;
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
    # Per decoder layer, not the whole model: the layers share one code object, so Dynamo traces
    # and Inductor compiles one layer (plus the first, which has no residual yet) and every
    # other layer reuses it; the fusions all sit inside a layer anyway. A whole-model compile
    # took ~55 s cold for Qwen3-0.6B on the GPU machine's CPU. Dynamo specialises a 1-token
    # step into its own graph (compiled while the batch-1 CUDA graph is captured, at startup).
    # Marking the token dimension unbacked avoided that compile but took the size hints from
    # Inductor and cost ~20% of decode throughput on the H100 (docs/PERFORMANCE.md).
    # Every engine in a process adds entries to the one layer code object's cache (first layer or
    # not x 1 token or many, per model shape and dtype); Dynamo's default limit of 8 failed the
    # third engine of a test process (fullgraph=True turns the limit into an error).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for layer in runner.model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, fullgraph=True)
    runner.compiled = True
    logger.info("decoder layers compiled lazily on first call (graph split at attention)")
