"""torch.compile for levels 2 and 3: the model compiled with the graph split at attention.

Attention (q/k-norm + RoPE + KV store in one kernel, then paged attention) runs as one opaque
custom op, `atom::paged_attention` (a gated DeltaNet's conv + delta rule + gated norm likewise,
`atom::gated_delta_net`), so Dynamo/Inductor compile everything around it, one
decoder layer at a time (projections stay cuBLAS; norms, residual adds and SiLU-and-mul become
Inductor-fused kernels, so those layers use their torch reference implementations here). Token count is a dynamic
dimension: one compiled graph serves prefill chunks and every decode batch size.
Piecewise CUDA graphs (worker/piecewise.py) split the forward at the same op, at runtime.
Compiled artifacts are cached by Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR), so a
second start of the same model compiles much faster.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from atom_core.kernels import torch_ref
from atom_core.model_ops.activation import SiluAndMul
from atom_core.model_ops.attention import Attention
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.linear_attention import GatedDeltaNet

logger = logging.getLogger(__name__)


def compile_model(model: nn.Module) -> None:
    """Compile `model.model.layers[*]` in place (lazily, on their first call)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMul)):
            module.ops = torch_ref  # Inductor fuses these better than separate launches
        if isinstance(module, (Attention, GatedDeltaNet)):  # atom::paged_attention, atom::gated_delta_net
            module.use_custom_op = True
    # Per decoder layer, not the whole model: the layers share one code object, so Dynamo
    # compiles one layer graph (plus the first layer's, which has no residual yet) for all of
    # them, where a whole-model compile traces every layer and takes far longer cold. A 1-token
    # step gets its own specialisation, compiled when the batch-1 CUDA graph is captured (an
    # unbacked token dim avoided that but made decode measurably slower, see docs/PERFORMANCE.md). Each engine in a
    # process adds cache entries, and Dynamo's default limit (8) failed the third one.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, fullgraph=True)
    logger.info("decoder layers compiled lazily on first call (graph split at attention)")
