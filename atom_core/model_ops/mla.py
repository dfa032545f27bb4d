"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): the attention layer over a latent KV
cache, and its backend (registered for kind "mla" in model_ops/attention_backends).

Per token the cache holds one row of kv_lora_rank + qk_rope_head_dim values (576 for V3): the
normalised latent c and the roped shared key part r. The backend normalises c, ropes q and r,
and stores [c, r] in one op (`mla_rope_store`), then attends in the absorbed form for every row
of the flat batch (prefill chunks and decode alike): kv_b_proj's key half is folded into the
query (q_latent = q_nope @ W_UK), the kernel averages latents, and the value half maps the
result back (o = o_latent @ W_UV^T). Kernels of the device's provider: `mla_rope_store`
(kernels/triton/mla_prep.py) and `mla_attention` (kernels/triton/mla.py); kernels/torch_ref.py and
kernels/mla_ref.py hold them for the CPU.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from atom_core.kernels import kernel_ops
from atom_core.kernel_config import KernelConfig, build_kernel_config
from atom_core.model_ops.attention_backends import AttentionBackend, get_attention_backend
from atom_core.model_ops.forward_context import get_attention_metadata
from atom_core.model_ops.kv_spec import KVSpec
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.rotary import RotaryEmbedding

_LAYERS: "weakref.WeakValueDictionary[int, MLAAttention]" = weakref.WeakValueDictionary()


@torch.library.custom_op("atom::mla_attention", mutates_args=())
def mla_attention_op(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, layer_key: torch.Tensor,
                     out_width: int) -> torch.Tensor:
    """Opaque to torch.compile, as atom::paged_attention: the cache store is a side effect the
    compiler never sees; the layer (weights, cache views) is looked up by key."""
    layer = _LAYERS[int(layer_key)]
    return layer.backend(q.device).forward(layer, q, kv_a, positions)


@mla_attention_op.register_fake
def _(q, kv_a, positions, layer_key, out_width):
    return q.new_empty(q.shape[0], out_width)


class MLAAttention(nn.Module):
    """q [T, H, N + R] and kv_a [T, C + R] (kv_a_proj_with_mqa's output: the latent before
    kv_a_layernorm, then k_pe before RoPE) -> [T, H * V] for the flat batch in the forward context.

    `kv_a_layernorm` and `kv_b_proj` are the model's own layers (kept registered where the
    checkpoint names them; held here through plain references): the norm's weight and eps go to
    the fused rope + norm + store op; kv_b_proj's weight, whatever its quant format, is read back
    once as W_UK / W_UV for the absorbed form. `interleaved`: the rope dims come in (x0, x1)
    pairs (DeepSeek's layout) rather than neox halves. The KV spec is kind "mla": one row of C + R.
    """

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float, rotary: RotaryEmbedding, kv_a_layernorm: RMSNorm,
                 kv_b_proj: nn.Module, interleaved: bool, prefix: str = ""):
        super().__init__()
        self.num_heads, self.v_head_dim = num_heads, v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank = qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank
        self.scale, self.interleaved, self.prefix = scale, interleaved, prefix
        self._refs = (rotary, kv_b_proj, kv_a_layernorm)  # not submodules: their owners register them
        self.dtype = torch.get_default_dtype()
        self.kv_spec = KVSpec("mla", 1, kv_lora_rank + qk_rope_head_dim, self.dtype)
        self.k_cache = self.v_cache = torch.empty(0)
        self.w_uk: torch.Tensor | None = None  # [H, N, C]
        self.w_uv_t: torch.Tensor | None = None  # [H, C, V]
        self._backend: AttentionBackend | None = None
        self.kernel_config = build_kernel_config()  # the backend's kernel choices (KernelConfig)
        self.layer_key = torch.tensor([id(self)], dtype=torch.int64, device="cpu")
        _LAYERS[id(self)] = self

    @property
    def rotary(self) -> RotaryEmbedding:
        return self._refs[0]

    @property
    def kv_a_layernorm(self) -> RMSNorm:
        return self._refs[2]

    def backend(self, device: torch.device) -> AttentionBackend:
        if self._backend is None:
            self._backend = get_attention_backend(self.kv_spec.kind, device, self.kernel_config)
        return self._backend

    @torch.no_grad()
    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, N, C], W_UV^T [H, C, V]) from kv_b_proj, on first use (after loading). A plain
        weight in the model dtype is viewed, not copied; any other format is read back once as
        kv_b_proj(I), its weight transposed, dequantized by its own quant method."""
        if self.w_uk is None:
            kv_b_proj = self._refs[1]
            weight = getattr(kv_b_proj, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dtype == self.dtype and weight.dim() == 2:
                w = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
            else:
                eye = torch.eye(self.kv_lora_rank, dtype=self.dtype, device=_device(kv_b_proj))
                w = kv_b_proj(eye).t().reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
            self.w_uk = w[:, :self.qk_nope_head_dim]
            self.w_uv_t = w[:, self.qk_nope_head_dim:].transpose(1, 2)
        return self.w_uk, self.w_uv_t

    def forward(self, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return mla_attention_op(q, kv_a, positions, self.layer_key, self.num_heads * self.v_head_dim)
        assert self.k_cache.numel(), "KV cache not allocated for this MLA layer"
        return self.backend(q.device).forward(self, q, kv_a, positions)


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class MLABackend(AttentionBackend):
    """Absorbed MLA over the paged latent cache. No sliding window, no sinks."""

    name = "mla"

    def __init__(self, device_type: str, kernel: KernelConfig | None = None):
        super().__init__(device_type, kernel)
        self.ops = kernel_ops(device_type)

    def forward(self, layer: MLAAttention, q: torch.Tensor, kv_a: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        num_tokens = q.shape[0]
        norm = layer.kv_a_layernorm
        q_rope = self.ops.mla_rope_store(q, kv_a, positions, layer.rotary.cos_sin_cache, layer.k_cache,
                                         meta.slot_mapping, norm.weight, norm.eps, layer.interleaved)  # [T, H, R]
        w_uk, w_uv_t = layer.absorbed_weights()
        q_nope = q[..., :layer.qk_nope_head_dim]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, C], rows strided
        o_latent = self.ops.mla_attention(q_latent, q_rope, layer.k_cache, meta.block_tables,
                                          meta.query_start_loc, meta.seq_lens, layer.scale, meta.max_query_len,
                                          meta.max_seq_len)
        out = torch.bmm(o_latent.transpose(0, 1), w_uv_t)  # [H, T, V]
        return out.transpose(0, 1).reshape(num_tokens, layer.num_heads * layer.v_head_dim)
