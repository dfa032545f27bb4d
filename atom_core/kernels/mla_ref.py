"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, in plain
PyTorch: the CPU path and the oracle for `kernels/triton/mla.py` (attention) and
`kernels/triton/mla_prep.py` (`mla_rope_store`: RoPE, latent norm and the cache store).

The cache holds one row of C + R values per token ([NB, BS, 1, C + R]): the normalised KV
latent (C = kv_lora_rank) and the roped shared key part (R = qk_rope_head_dim). Attention runs
in the absorbed form: the caller has folded kv_b_proj's key half into the query
(q_latent = q_nope @ W_UK, [T, H, C]) and applies its value half to the output
(o = o_latent @ W_UV^T), so every head scores q_latent . latent + q_rope . k_rope and averages
the latents themselves. Shapes as in torch_ref: T tokens, S sequences, H heads, NB blocks,
BS block size, MB max blocks per sequence.
"""
from __future__ import annotations

import torch


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
    from atom_core.kernels import torch_ref  # here, not at the top: torch_ref re-exports this module

    rope = cos_sin_cache.shape[1]
    latent_dim = kv_cache.shape[3] - rope
    if q.shape[2] <= rope or kv_a.shape[1] != latent_dim + rope:
        raise ValueError(f"q {tuple(q.shape)} / kv_a {tuple(kv_a.shape)} do not end in the rope dim {rope} of "
                         f"the cache row {kv_cache.shape[3]}")
    q_pe, k_pe = q[..., q.shape[2] - rope:], kv_a[:, None, latent_dim:]
    if interleaved:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_pe, k_pe = torch_ref.rotary_embedding(positions, q_pe, k_pe, cos_sin_cache)
    latent = torch_ref.rms_norm(kv_a[:, None, :latent_dim], kv_norm_weight, eps)
    row = torch.cat([latent, k_pe.to(latent.dtype)], dim=-1)  # [T, 1, C + R]
    torch_ref.store_kv_cache(row, row, kv_cache, kv_cache, slot_mapping)
    return q_pe.contiguous()


def mla_attention(
    q_latent: torch.Tensor,  # [T, H, C]
    q_rope: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [NB, BS, 1, C + R]: latent, then roped key
    block_tables: torch.Tensor,  # [S, MB] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32, KV length after this step
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [T, H, C]
) -> torch.Tensor:
    """out[t, h] = sum_j softmax_j(scale * (q_latent[t, h] . c_j + q_rope[t, h] . r_j)) c_j over
    the cached positions j <= the position of row t (causal: a sequence's query rows are its
    last q_len positions). Returns [T, H, C] in q_latent's dtype; fp32 arithmetic. Rows of
    sequences with q_len 0, and rows past query_start_loc[-1], are left as they were in `out`.
    """
    num_tokens, num_heads, latent_dim = q_latent.shape
    block_size = kv_cache.shape[1]
    if kv_cache.shape[3] != latent_dim + q_rope.shape[2]:
        raise ValueError(f"kv_cache row {kv_cache.shape[3]} != latent {latent_dim} + rope {q_rope.shape[2]}")
    if out is None:
        out = torch.zeros_like(q_latent)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    q = torch.cat([q_latent, q_rope], dim=-1).float()
    for s, seq_len in enumerate(lens):
        q_start, q_end = qsl[s], qsl[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        blocks = block_tables[s, :(seq_len + block_size - 1) // block_size].long()
        kv = kv_cache[blocks].reshape(-1, kv_cache.shape[3])[:seq_len].float()  # [L, C + R]
        scores = torch.einsum("qhd,ld->hql", q[q_start:q_end], kv) * scale  # [H, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(seq_len, device=q.device)[None, :] > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hql,lc->qhc", probs, kv[:, :latent_dim]).to(out.dtype)
    return out


def mla_expanded_reference(
    q_nope: torch.Tensor,  # [T, H, N]
    q_rope: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [NB, BS, 1, C + R]
    kv_b_weight: torch.Tensor,  # [H * (N + V), C]: kv_b_proj's weight
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention in HF's expanded form (per-head keys [k_nope, k_rope] and values from
    kv_b_proj applied to every cached latent); [T, H, V] in fp32. Tests compare the absorbed
    form against it."""
    num_tokens, num_heads, nope = q_nope.shape
    latent_dim = kv_cache.shape[3] - q_rope.shape[2]
    w = kv_b_weight.float().view(num_heads, -1, latent_dim)  # [H, N + V, C]
    v_dim = w.shape[1] - nope
    block_size = kv_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, v_dim)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = qsl[s], qsl[s + 1]
        if q_end == q_start:
            continue
        blocks = block_tables[s, :(seq_len + block_size - 1) // block_size].long()
        kv = kv_cache[blocks].reshape(-1, kv_cache.shape[3])[:seq_len].float()
        kv_heads = torch.einsum("lc,hec->lhe", kv[:, :latent_dim], w)  # [L, H, N + V]
        k = torch.cat([kv_heads[..., :nope], kv[:, None, latent_dim:].expand(-1, num_heads, -1)], dim=-1)
        q = torch.cat([q_nope[q_start:q_end], q_rope[q_start:q_end]], dim=-1).float()
        scores = torch.einsum("qhd,lhd->hql", q, k) * scale
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len)[:, None]
        scores.masked_fill_(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out[q_start:q_end] = torch.einsum("hql,lhv->qhv", torch.softmax(scores, -1), kv_heads[..., nope:])
    return out
