"""Triton kernels for CUDA and ROCm GPUs; same names and signatures as `kernels.torch_ref`."""
from atom_core.kernels.triton.activation import silu_and_mul
from atom_core.kernels.triton.attention import paged_attention
from atom_core.kernels.triton.kv_store import store_kv_cache
from atom_core.kernels.triton.norm import fused_add_rms_norm, rms_norm
from atom_core.kernels.triton.qkv_prep import qkv_rope_store
from atom_core.kernels.triton.rotary import rotary_embedding
from atom_core.kernels.triton.sampling import gumbel_argmax

__all__ = [
    "fused_add_rms_norm", "gumbel_argmax", "paged_attention", "qkv_rope_store", "rms_norm", "rotary_embedding",
    "silu_and_mul", "store_kv_cache",
]
from atom_core.kernels.triton.moe import fused_moe, moe_align_block_size, moe_route  # noqa: E402

__all__ += ["fused_moe", "moe_align_block_size", "moe_route"]
from atom_core.kernels.triton.mla import mla_attention  # noqa: E402
from atom_core.kernels.triton.mla_prep import mla_rope_store  # noqa: E402

__all__ += ["mla_attention", "mla_rope_store"]
from atom_core.kernels.triton.causal_conv1d import causal_conv1d  # noqa: E402
from atom_core.kernels.triton.gated_delta import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa: E402
from atom_core.kernels.triton.norm import gated_rms_norm  # noqa: E402

__all__ += ["causal_conv1d", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "gated_rms_norm"]
from atom_core.kernels.triton.dsa_index import dsa_index_scores, dsa_topk  # noqa: E402
from atom_core.kernels.triton.dsa_mla import mla_sparse_attention  # noqa: E402

__all__ += ["dsa_index_scores", "dsa_topk", "mla_sparse_attention"]
from atom_core.kernels.triton.lora import lora_expand, lora_shrink  # noqa: E402

__all__ += ["lora_expand", "lora_shrink"]
