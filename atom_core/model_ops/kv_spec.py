"""Per-layer KV cache specs, and the functions the worker sizes, allocates and checks KV with.

Each attention layer declares a frozen `KVSpec` at construction; the worker never reads an HF
config field for KV. Layers with equal specs share one cache tensor
[2, layers_in_group, num_blocks, block_size, kv_heads, head_size] (MLA: [1, ...], one latent),
and layer i of a group gets the views [0, i] (K) and [1, i] (V). Block ids are global: block b
of every layer is the same token range, so the KV manager stays one block pool.

FP8 with per-token-head scales (--kv-cache-dtype fp8_per_token_head) adds one float32 tensor
[2, layers_in_group, num_blocks, block_size, kv_heads] per group: layer i's K scales at [0, i]
and V scales at [1, i] (k_scale_cache / v_scale_cache), indexed by the same block and slot as
the codes, so prefix caching, preemption and rollback need nothing of their own.

A sparse-attention MLA layer (DeepSeek Sparse Attention) also caches its indexer's key per token
(index_head_dim > 0): one tensor [layers_in_group, num_blocks, block_size, 1, index_head_dim] per
group in the spec's dtype, layer i's view at [i] (index_cache), indexed by the same blocks and
slots as the latent, and counted in bytes_per_token, so it is sized, prefix-cached, preempted and
freed with the latent. With FP8 indexer keys (--index-cache-dtype fp8, index_fp8) the tensor
is float8_e4m3fn [layers, num_blocks, block_size, G, index_head_dim / G] with G = one group per
128 values, beside float32 scales [layers, num_blocks, block_size, G] (index_scale_cache): each
group of a token's key stored divided by its own amax / 448.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from atom_core.config import KVCacheFormat

if TYPE_CHECKING:
    from atom_core.model_ops.attention import Attention

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSpec:
    """What one attention layer stores per token.

    mha: K and V, each num_kv_heads x head_size. mla: one compressed latent of head_size per
    token (num_kv_heads is 1; V is read from the latent, so nothing separate is stored).
    per_token_head_scales (FP8 mha only): a float32 scale per token, KV head and plane besides.
    index_head_dim (mla only): the sparse-attention indexer's key per token besides, in `dtype`,
    or with index_fp8 in e4m3 plus one float32 scale per INDEX_FP8_GROUP values.
    """

    kind: Literal["mha", "mla"]
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    sliding_window: int | None = None
    has_sinks: bool = False
    per_token_head_scales: bool = False
    index_head_dim: int = 0
    index_fp8: bool = False

    def __post_init__(self):
        if self.kind not in ("mha", "mla"):
            raise ValueError(f"unknown attention kind {self.kind!r}; expected one of: mha, mla")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ValueError(f"an mla layer stores one latent per token, not {self.num_kv_heads} kv heads")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.per_token_head_scales and (self.kind != "mha" or self.dtype not in FP8_KV_DTYPES):
            raise ValueError(f"per-token-head KV scales need an FP8 mha cache, not {self.kind} {self.dtype}")
        if self.index_head_dim < 0 or (self.index_head_dim and self.kind != "mla"):
            raise ValueError(f"an indexer key cache (index_head_dim {self.index_head_dim}) needs an mla layer, "
                             f"not {self.kind}")
        if self.index_fp8 and (not self.index_head_dim or self.index_head_dim % self.index_groups):
            raise ValueError(f"FP8 indexer keys need an indexer whose key dim ({self.index_head_dim}) is below "
                             f"{INDEX_FP8_GROUP} or a multiple of it")

    @property
    def index_groups(self) -> int:
        """Scale groups per indexer key (index_fp8): one per INDEX_FP8_GROUP values."""
        return -(-self.index_head_dim // INDEX_FP8_GROUP)

    @property
    def num_planes(self) -> int:
        """Cache planes per token: K and V for mha, the latent alone for mla."""
        return 2 if self.kind == "mha" else 1

    @property
    def bytes_per_token(self) -> int:
        scale_bytes = 4 if self.per_token_head_scales else 0  # one float32 per (plane, kv head)
        if self.index_fp8:
            index_bytes = self.index_head_dim + 4 * self.index_groups
        else:
            index_bytes = self.index_head_dim * self.dtype.itemsize
        return self.num_planes * self.num_kv_heads * (self.head_size * self.dtype.itemsize + scale_bytes) + index_bytes


def attention_layers(model: nn.Module) -> list["Attention"]:
    """Every attention layer of `model`, in module order (the order KV views are handed out)."""
    return [m for m in model.modules() if isinstance(getattr(m, "kv_spec", None), KVSpec)]


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INDEX_FP8_GROUP = 128  # indexer key values per FP8 scale (the public recipe's quantization block)


def set_index_cache_dtype(layers: list["Attention"], name: str) -> None:
    """--index-cache-dtype: `auto` keeps the indexer keys in the layer dtype (what HF computes);
    `fp8` stores them as e4m3 with a scale per 128 values, after a Hadamard rotation of the
    indexer's query and key (the public DeepSeek-V3.2 recipe). Call before sizing and allocating."""
    if name == "auto":
        return
    indexed = [layer for layer in layers if layer.kv_spec.index_head_dim]
    if not indexed:
        raise ValueError(f"--index-cache-dtype {name}: the model has no sparse-attention indexer "
                         f"(DeepSeek-V3.2, GLM-5); use auto")
    for layer in indexed:
        dim = layer.kv_spec.index_head_dim
        if dim & (dim - 1):
            raise ValueError(f"{layer.prefix}: --index-cache-dtype {name} rotates the indexer by a Hadamard "
                             f"transform, which needs a power-of-two index_head_dim, not {dim}")
        layer.kv_spec = dataclasses.replace(layer.kv_spec, index_fp8=True)


def set_kv_cache_dtype(layers: list["Attention"], kv_format: torch.dtype | KVCacheFormat) -> None:
    """Store every layer's K/V in `kv_format` (--kv-cache-dtype; a bare dtype: per-layer scales):
    an FP8 type halves the bytes a token costs, so sizing (kv_bytes_per_block) gives twice the
    tokens. Call before sizing and allocating. FP8 is stored scaled by the layer's k_scale /
    v_scale, or with per_token_head_scales by a scale per token and KV head written at store time."""
    if isinstance(kv_format, torch.dtype):
        kv_format = KVCacheFormat(kv_format)
    dtype, per_token = kv_format.dtype, kv_format.per_token_head_scales
    name = f"{dtype}{' with per-token-head scales' if per_token else ''}"
    for layer in layers:
        if layer.kv_spec.dtype == dtype and not per_token:
            continue
        if layer.kv_spec.kind != "mha":
            raise ValueError(f"{layer.prefix or 'an attention layer'}: --kv-cache-dtype {name} is not supported "
                             f"for {layer.kv_spec.kind} attention (its cache is the compressed latent); use auto")
        if dtype not in FP8_KV_DTYPES:
            raise ValueError(f"a {dtype} KV cache for a {layer.kv_spec.dtype} model: attention reads K/V as "
                             f"the query's type; use auto or an fp8 type")
        layer.kv_spec = dataclasses.replace(layer.kv_spec, dtype=dtype, per_token_head_scales=per_token)


def finalize_kv_scales(layers: list["Attention"]) -> None:
    """After loading: each layer's k_scale / v_scale as host floats (one sync now, none per step).

    With per-token-head scales the checkpoint's static scales are not used: each token's own
    scale (amax / FP8 max) fits its values at least as well as a calibrated per-layer one, so
    the dynamic mode wins and says so once."""
    ignored = []
    for layer in layers:
        if hasattr(layer, "k_scale"):
            k, v = float(layer.k_scale), float(layer.v_scale)
            if not (k > 0 and v > 0):
                raise ValueError(f"{layer.prefix or 'an attention layer'}: KV cache scales must be positive, got "
                                 f"k_scale={k}, v_scale={v}")
            layer.kv_scales = (k, v)
            if layer.kv_spec.per_token_head_scales and (k, v) != (1.0, 1.0):
                ignored.append(layer.prefix or "an attention layer")
    if ignored:
        logger.warning("--kv-cache-dtype fp8_per_token_head: the checkpoint's static k_scale / v_scale of %d "
                       "layer(s) (%s, ...) are not used; every token and KV head gets its own scale",
                       len(ignored), ignored[0])


def kv_bytes_per_block(layers: list["Attention"], block_size: int) -> int:
    """Bytes one KV block (block_size tokens) costs summed over all layers."""
    return sum(layer.kv_spec.bytes_per_token for layer in layers) * block_size


def _groups(layers: list["Attention"]) -> dict[KVSpec, list["Attention"]]:
    groups: dict[KVSpec, list["Attention"]] = {}
    for layer in layers:
        groups.setdefault(layer.kv_spec, []).append(layer)
    return groups


def allocate_kv_cache(layers: list["Attention"], num_blocks: int, block_size: int,
                      device: torch.device | str) -> list[torch.Tensor]:
    """Zeroed caches, one tensor per group of equal specs (plus its scale tensor where the spec
    has per-token-head scales); sets each layer's k_cache / v_cache and k_scale_cache /
    v_scale_cache (None without per-token scales). Returns every tensor allocated.

    A dense model is one group: exactly [2, L, NB, BS, KH, D] with layer i at [0, i] / [1, i].
    """
    caches = []
    for spec, group in _groups(layers).items():
        shape = (spec.num_planes, len(group), num_blocks, block_size, spec.num_kv_heads, spec.head_size)
        cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        # Zeros: a slot never stored dequantizes to 0, never to NaN.
        scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device) if spec.per_token_head_scales else None
        index = index_scales = None
        if spec.index_head_dim:
            groups = spec.index_groups if spec.index_fp8 else 1
            index = torch.zeros(len(group), num_blocks, block_size, groups, spec.index_head_dim // groups,
                                dtype=torch.float8_e4m3fn if spec.index_fp8 else spec.dtype, device=device)
            if spec.index_fp8:
                index_scales = torch.zeros(index.shape[:-1], dtype=torch.float32, device=device)
        for i, layer in enumerate(group):
            # mla: the latent is both what K reads and what V is sliced from.
            layer.k_cache, layer.v_cache = cache[0, i], cache[spec.num_planes - 1, i]
            layer.k_scale_cache = scales[0, i] if scales is not None else None
            layer.v_scale_cache = scales[1, i] if scales is not None else None
            if index is not None:
                layer.index_cache = index[i]
                layer.index_scale_cache = index_scales[i] if index_scales is not None else None
        caches.append(cache)
        if scales is not None:
            caches.append(scales)
        caches.extend(t for t in (index, index_scales) if t is not None)
    return caches


def release_kv_cache(layers: list["Attention"]) -> None:
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
        layer.k_scale_cache = layer.v_scale_cache = None
        if layer.kv_spec.index_head_dim:
            layer.index_cache = torch.empty(0)
            layer.index_scale_cache = None


def check_attention_supported(layers: list["Attention"], max_model_len: int, device: torch.device | str) -> None:
    """ValueError when a layer needs what its backend on `device` does not implement.

    A sliding window matters only if a sequence can outgrow it: with max_model_len <= window,
    windowed attention equals full attention, so any backend serves it.
    """
    from atom_core.model_ops.attention_backends import get_attention_backend

    for layer in layers:
        spec = layer.kv_spec
        backend = get_attention_backend(spec.kind, device)  # what it supports: the same under any KernelConfig
        window = spec.sliding_window
        if window is not None and window < max_model_len and not backend.supports_sliding_window:
            raise ValueError(
                f"{layer.prefix or 'an attention layer'} uses sliding-window attention ({window} tokens), which "
                f"the {backend.name} attention backend does not implement; pass max_model_len <= {window}"
            )
        if spec.has_sinks and not backend.supports_sinks:
            raise ValueError(f"{layer.prefix or 'an attention layer'} uses attention sinks, which the "
                             f"{backend.name} attention backend does not implement")


def warm_up_attention(layers: list["Attention"], max_tokens: int, threads: int = 1) -> int:
    """Compile the attention kernels every step shape can need, now; returns how many launched
    (0 where nothing compiles, e.g. the CPU). Call after allocate_kv_cache."""
    if not layers:
        return 0
    count = 0
    for spec, group in _groups(layers).items():
        backend = group[0].backend(group[0].k_cache.device)  # the instance the layers run (their KernelConfig)
        count += backend.warm_up(group, max_tokens, threads)
    return count


# ---- per-sequence state (linear-attention layers) ----------------------------------------------
# A linear-attention (gated DeltaNet) layer keeps no KV per token: each sequence owns one fixed-size
# state, a recurrent matrix per value head plus the last conv_kernel - 1 inputs of its causal
# convolution. Pools hold `num_slots` such states per layer; row 0 of every pool is scratch for the
# padding rows of a CUDA graph replay, and the engine's slot s lives in row s + 1 (the batch builder
# adds the 1), so a graph's persistent slot buffer of zeros is padding already.

@dataclass(frozen=True)
class StateSpec:
    """What one linear-attention layer stores per sequence (this rank's heads and channels).

    recurrent: [num_heads, key_dim, value_dim] in recurrent_dtype (float32: the recurrence
    accumulates over the whole sequence); conv: [conv_channels, conv_kernel - 1] in conv_dtype
    (the inputs the convolution reads back, in the model dtype)."""

    num_heads: int
    key_dim: int
    value_dim: int
    conv_channels: int
    conv_kernel: int
    conv_dtype: torch.dtype
    recurrent_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if min(self.num_heads, self.key_dim, self.value_dim, self.conv_channels) < 1 or self.conv_kernel < 2:
            raise ValueError(f"a linear-attention state needs positive sizes and conv_kernel >= 2, got {self}")

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.key_dim, self.value_dim)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_channels, self.conv_kernel - 1)

    @property
    def bytes_per_slot(self) -> int:
        rec = self.num_heads * self.key_dim * self.value_dim * self.recurrent_dtype.itemsize
        return rec + self.conv_channels * (self.conv_kernel - 1) * self.conv_dtype.itemsize


def state_layers(model: nn.Module) -> list[nn.Module]:
    """Every layer of `model` that declares a `state_spec`, in module order."""
    return [m for m in model.modules() if isinstance(getattr(m, "state_spec", None), StateSpec)]


def state_bytes_per_slot(layers: list[nn.Module]) -> int:
    """Bytes one sequence's state costs summed over all linear-attention layers."""
    return sum(layer.state_spec.bytes_per_slot for layer in layers)


def allocate_state_cache(layers: list[nn.Module], num_slots: int, device: torch.device | str,
                         num_step_states: int = 0) -> list[torch.Tensor]:
    """Zeroed pools of num_slots + 1 rows (row 0: the padding rows' scratch) for every layer; sets
    each layer's `recurrent_state` [rows, H, Dk, Dv] and `conv_state` [rows, C, K - 1]. With
    num_step_states P > 0 (speculative decoding verifies up to P drafts a step), also
    `step_recurrent_state` [rows, P, H, Dk, Dv] and `step_conv_state` [rows, P, C, K - 1]: the
    states after each of a verify step's first P tokens, one of which `keep_verified_states`
    makes the sequence's when drafts are rejected. Returns the tensors allocated."""
    tensors = []
    for layer in layers:
        spec = layer.state_spec
        layer.recurrent_state = torch.zeros((num_slots + 1, *spec.recurrent_shape), dtype=spec.recurrent_dtype,
                                            device=device)
        layer.conv_state = torch.zeros((num_slots + 1, *spec.conv_shape), dtype=spec.conv_dtype, device=device)
        tensors += [layer.recurrent_state, layer.conv_state]
        layer.step_recurrent_state = layer.step_conv_state = None
        if num_step_states:
            layer.step_recurrent_state = torch.zeros((num_slots + 1, num_step_states, *spec.recurrent_shape),
                                                     dtype=spec.recurrent_dtype, device=device)
            layer.step_conv_state = torch.zeros((num_slots + 1, num_step_states, *spec.conv_shape),
                                                dtype=spec.conv_dtype, device=device)
            tensors += [layer.step_recurrent_state, layer.step_conv_state]
    return tensors


def keep_verified_states(layers: list[nn.Module], rows: list[int], steps: list[int], device) -> None:
    """After a verify step: pool row rows[i] takes the state after token steps[i] of that step
    (the pending token plus steps[i] accepted drafts) from the step pools, in every layer; the
    rows' states after the whole step saw rejected drafts. One gather a pool."""
    if not rows:
        return
    index = torch.tensor([rows, steps], dtype=torch.int64).to(device)
    for layer in layers:
        for pool, steps_pool in ((layer.recurrent_state, layer.step_recurrent_state),
                                 (layer.conv_state, layer.step_conv_state)):
            assert steps_pool is not None, f"{layer.prefix}: no step states allocated"
            pool.index_copy_(0, index[0], steps_pool[index[0], index[1]])


def release_state_cache(layers: list[nn.Module]) -> None:
    for layer in layers:
        layer.recurrent_state = layer.conv_state = torch.empty(0)
        layer.step_recurrent_state = layer.step_conv_state = None
