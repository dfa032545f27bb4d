"""Plain PyTorch kernels: the CPU path and the oracle for every Triton kernel test.

Every function here has a Triton twin in `kernels/triton/` with the same signature.
Shapes use these names:
  T  tokens in the flat batch        S  sequences in the batch
  H  query heads   KH  kv heads      D  head dim
  NB KV blocks     BS  block size    MB max blocks per sequence
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * (x / rms(x)), the normalisation in float32 like HF, then cast to x.dtype
    before the weight multiply (so the result takes the promoted dtype of weight and x)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual' = x + residual (type-promoted); returns (rms_norm(residual'), residual')."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> silu(x[..., :I]) * x[..., I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor,  # [T] int
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KH, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32: cos in [:rot_dim/2], sin after
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding on the first rot_dim dims of each head; returns new (q, k)."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, rot/2]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rot_dim].float(), x[..., rot_dim:]
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((out, rest), dim=-1) if rest.numel() else out

    return rotate(query), rotate(key)


def store_kv_cache(
    key: torch.Tensor,  # [T, KH, D]
    value: torch.Tensor,  # [T, KH, D]
    k_cache: torch.Tensor,  # [NB, BS, KH, D]
    v_cache: torch.Tensor,  # [NB, BS, KH, D]
    slot_mapping: torch.Tensor,  # [T] int; slot = block * BS + offset; < 0 means skip (padding)
    k_scale: float | torch.Tensor = 1.0,  # FP8 caches: K is stored as K / k_scale (see to_kv_cache)
    v_scale: float | torch.Tensor = 1.0,  # or [NB, BS, KH] float32 per-token-head scales, written here
) -> None:
    """Write each token's K and V into its cache slot, in place. With per-token-head scale
    tensors each (token, kv head) row is quantized by its own scale (quantize_per_token_head),
    and the scale goes to the same (block, offset, head) of the scale tensor."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if isinstance(scale, torch.Tensor):
            cache[blocks, offsets], scale[blocks, offsets] = quantize_per_token_head(x[valid], cache.dtype)
        else:
            cache[blocks, offsets] = to_kv_cache(x[valid], cache.dtype, scale)


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_kv_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x (model dtype) as a cache element: a plain cast, or for FP8 x * (1 / scale) in float32,
    saturated to the format's largest finite value, rounded to nearest even."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(dtype)


def from_kv_cache(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Cache elements -> float32 values (FP8: times its scale; a tensor broadcasts, e.g. [..., KH, 1])."""
    return x.float() * scale if x.dtype in FP8_KV_DTYPES else x.float()


def ieee_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor rounded as IEEE division, on every device. On CUDA, torch divides by a Python
    scalar as a multiply by its reciprocal, which differs from the Triton kernels' div.rn in the
    last bit and then flips FP8 codes at rounding boundaries; a tensor divisor divides exactly."""
    return x / torch.full_like(x, divisor)


def quantize_per_token_head(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, KH, D] -> (codes [N, KH, D] of FP8 `dtype`, scales [N, KH] float32): each row's
    scale is amax / FP8 max (float32 division), its codes x * (1 / scale) saturated and rounded
    to nearest even; an all-zero row gets scale 0 and codes 0. Dequantized: codes * scale."""
    limit = torch.finfo(dtype).max
    xf = x.float()
    scale = ieee_div(xf.abs().amax(dim=-1), limit)
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return (xf * inv.unsqueeze(-1)).clamp(-limit, limit).to(dtype), scale


def _token_scales(scale: float | torch.Tensor, blocks: torch.Tensor, length: int) -> float | torch.Tensor:
    """A per-layer scale as it is; per-token-head scales [NB, BS, KH] gathered for `blocks`
    ([nb] or [B, nb]) to [..., length, KH, 1], broadcasting over head_dim."""
    if not isinstance(scale, torch.Tensor):
        return scale
    gathered = scale[blocks]  # [..., nb, BS, KH]
    return gathered.reshape(*blocks.shape[:-1], -1, scale.shape[-1])[..., :length, :, None]


def qkv_rope_store(
    qkv: torch.Tensor,  # [T, (H + 2 * KH) * D]: q, k, v heads side by side (a fused projection's output)
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, rot_dim] float32, as for rotary_embedding
    k_cache: torch.Tensor,  # [NB, BS, KH, D]
    v_cache: torch.Tensor,  # [NB, BS, KH, D]
    slot_mapping: torch.Tensor,  # [T] int; < 0 means skip (padding)
    num_heads: int,
    q_norm_weight: torch.Tensor | None = None,  # [D]: per-head RMSNorm of q and k first (Qwen3)
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: float | torch.Tensor = 1.0,  # FP8 caches: the scales K and V are stored by (store_kv_cache)
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Everything between the QKV projection and attention, in one op: optional per-head
    RMSNorm of q and k, RoPE on both, K and V into the cache. Returns the new q [T, H, D].

    The same arithmetic as rms_norm, rotary_embedding and store_kv_cache applied in turn.
    """
    num_tokens, head_dim, num_kv_heads = qkv.shape[0], k_cache.shape[3], k_cache.shape[2]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache)
    store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q.contiguous()


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [NB, BS, KH, D]
    v_cache: torch.Tensor,  # [NB, BS, KH, D]
    block_tables: torch.Tensor,  # [S, MB] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32: sequence s owns query rows [qsl[s], qsl[s+1])
    seq_lens: torch.Tensor,  # [S] int32: KV length of s after this step (cached context + new tokens)
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [T, H, D]
    seq_order: torch.Tensor | None = None,  # [S] int32: a launch schedule for kernels; no effect on results
    sliding_window: int | None = None,  # a row at position p sees KV positions (p - window, p]
    sinks: torch.Tensor | None = None,  # [H] float: a per-head logit in the softmax denominator, no value
    k_scale: float | torch.Tensor = 1.0,  # FP8 caches: stored K times k_scale is K (from_kv_cache),
    v_scale: float | torch.Tensor = 1.0,  # or [NB, BS, KH] float32 per-token-head scales
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged KV (already stored).

    The query rows of sequence s are its last q_len tokens, so row i sits at position
    seq_len - q_len + i and sees KV positions [0, that position]. Works for prefill chunks with
    cached context and for decode (q_len == 1) alike; GQA by repeating KV heads.
    max_query_len / max_seq_len are host-side upper bounds (kernels size grids with them).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [s for s in range(len(lens)) if qsl[s + 1] - qsl[s] == 1]
    if len(decode) > 1:
        _decode_rows(query, k_cache, v_cache, block_tables, qsl, lens, decode, scale, out, sliding_window, sinks,
                     k_scale, v_scale)
    decode_set = set(decode) if len(decode) > 1 else set()
    for s, seq_len in enumerate(lens):
        q_start, q_end = qsl[s], qsl[s + 1]
        q_len = q_end - q_start
        if q_len == 0 or s in decode_set:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[s, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k = from_kv_cache(k, _token_scales(k_scale, blocks, seq_len))
        v = from_kv_cache(v, _token_scales(v_scale, blocks, seq_len))
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q_start:q_end].float().transpose(0, 1)  # [H, q_len, D]
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        probs = _softmax_with_sinks(scores, sinks)
        out[q_start:q_end] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores [H, ..., L]; a sink (one logit per head) joins the
    denominator as an extra column whose probability is dropped (it carries no value)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def _decode_rows(query, k_cache, v_cache, block_tables, qsl, lens, seqs, scale, out,
                 sliding_window=None, sinks=None, k_scale=1.0, v_scale=1.0) -> None:
    """All single-token rows at once: gather each sequence's KV padded to the longest, mask the pad."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    device = query.device
    idx = torch.tensor(seqs, device=device)
    seq_lens = torch.tensor([lens[s] for s in seqs], device=device)
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    blocks = block_tables[idx, :num_blocks].long()  # [B, nb]
    k = from_kv_cache(k_cache[blocks].reshape(len(seqs), -1, num_kv_heads, head_dim)[:, :max_len],
                      _token_scales(k_scale, blocks, max_len))  # [B, L, KH, D]
    v = from_kv_cache(v_cache[blocks].reshape(len(seqs), -1, num_kv_heads, head_dim)[:, :max_len],
                      _token_scales(v_scale, blocks, max_len))
    rows = torch.tensor([qsl[s] for s in seqs], device=device)
    q = query[rows].float().view(len(seqs), num_kv_heads, group, head_dim)  # [B, KH, G, D]
    scores = torch.einsum("bkgd,blkd->bkgl", q, k) * scale
    k_pos = torch.arange(max_len, device=device)[None, :]
    pad = k_pos >= seq_lens[:, None]  # [B, L]
    if sliding_window is not None:  # the row sits at position seq_len - 1
        pad |= k_pos <= seq_lens[:, None] - 1 - sliding_window
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    if sinks is not None:  # [B, KH, G, L] -> heads first for _softmax_with_sinks
        probs = _softmax_with_sinks(scores.permute(1, 2, 0, 3).reshape(num_heads, len(seqs), max_len), sinks)
        probs = probs.view(num_kv_heads, group, len(seqs), max_len).permute(2, 0, 1, 3)
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.nan_to_num(0.0)  # seq_len 0: attention over nothing is 0
    o = torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(len(seqs), num_heads, head_dim)
    out[rows] = o.to(out.dtype)


def gumbel_argmax(
    logits: torch.Tensor,  # [B, V] float
    temperatures: torch.Tensor,  # [B] float32; 0 (or less) = greedy
    seed: int,
    offset: int,
) -> torch.Tensor:
    """One sample per row of softmax(logits / T) by the Gumbel-max trick: argmax(l + T * G).

    Returns [B] int64. Rows with T == 0 give argmax(logits) exactly. The noise comes from a
    torch.Generator seeded from (seed, offset), so it differs from the Triton kernel's Philox
    noise: compare distributions, or exact ids only where the noise cannot matter.
    """
    mixed = (seed * 0x9E3779B97F4A7C15 + offset) % (1 << 63)
    gen = torch.Generator(device=logits.device).manual_seed(mixed)
    u = torch.rand(logits.shape, generator=gen, device=logits.device)
    gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(torch.float32).tiny)))  # u < 1: finite
    temps = temperatures.float().clamp_min(0.0).unsqueeze(1)
    return (logits.float() + temps * gumbel).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------
# MLA (the attention itself is in mla_ref.py)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): DeepSeek's rope pairs as neox halves."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def mla_rope_store(
    q: torch.Tensor,  # [T, H, N + R]: per head the no-rope part, then the rope part
    kv_a: torch.Tensor,  # [T, C + R]: kv_a_proj_with_mqa's output, the latent (not yet normalised) then k_pe
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, R] float32: cos in [:R/2], sin after
    kv_cache: torch.Tensor,  # [NB, BS, 1, C + R]
    slot_mapping: torch.Tensor,  # [T] int; < 0 means skip (padding)
    kv_norm_weight: torch.Tensor,  # [C]: kv_a_layernorm's weight
    eps: float,
    interleaved: bool,  # the rope dims come as (x0, x1) pairs (DeepSeek) rather than neox halves
) -> torch.Tensor:
    """Everything between MLA's projections and the latent attention: RoPE on every head's
    query rope part and on k_pe, RMSNorm of the latent, and the cache row [latent | roped k_pe]
    into the slot of each token. Returns the roped query part [T, H, R], contiguous.

    Interleaved pairs come out as neox halves (pair i at dims i and R/2 + i), in the query and
    in the cache alike, so their dot products are those of the interleaved layout. The same
    arithmetic as rms_norm, rotary_embedding and store_kv_cache applied in turn."""
    rope = cos_sin_cache.shape[1]
    latent_dim = kv_cache.shape[3] - rope
    if q.shape[2] <= rope or kv_a.shape[1] != latent_dim + rope:
        raise ValueError(f"q {tuple(q.shape)} / kv_a {tuple(kv_a.shape)} do not end in the rope dim {rope} of "
                         f"the cache row {kv_cache.shape[3]}")
    q_pe, k_pe = q[..., q.shape[2] - rope:], kv_a[:, None, latent_dim:]
    if interleaved:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe, k_pe = rotary_embedding(positions, q_pe, k_pe, cos_sin_cache)
    latent = rms_norm(kv_a[:, None, :latent_dim], kv_norm_weight, eps)
    row = torch.cat([latent, k_pe.to(latent.dtype)], dim=-1)  # [T, 1, C + R]
    store_kv_cache(row, row, kv_cache, kv_cache, slot_mapping)
    return q_pe.contiguous()


# The MoE, MLA, gated-DeltaNet, sparse-attention and LoRA functions live in their own *_ref.py; re-exported so both
# providers list the same functions.
from atom_core.kernels.moe_ref import fused_moe, moe_align_block_size, moe_route  # noqa: E402,F401
from atom_core.kernels.mla_ref import mla_attention  # noqa: E402,F401
from atom_core.kernels.gdn_ref import (  # noqa: E402,F401
    causal_conv1d, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, gated_rms_norm,
)
from atom_core.kernels.dsa_ref import dsa_index_scores, dsa_topk, mla_sparse_attention  # noqa: E402,F401
from atom_core.kernels.lora_ref import lora_expand, lora_shrink  # noqa: E402,F401
