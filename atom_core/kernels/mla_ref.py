"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, in plain
PyTorch: the CPU path and the oracle for `kernels/triton/mla.py`. The step before it
(`mla_rope_store`: RoPE, latent norm and the cache store, oracle of `kernels/triton/mla_prep.py`)
is in torch_ref.py, beside the rotary, norm and cache-store references it composes.

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


def sequence_rows(cache: torch.Tensor, block_tables: torch.Tensor, s: int, seq_len: int) -> torch.Tensor:
    """Sequence s's first seq_len cache rows [L, W] (cache [NB, BS, 1, W]) in float32."""
    block_size = cache.shape[1]
    blocks = block_tables[s, :(seq_len + block_size - 1) // block_size].long()
    return cache[blocks].reshape(-1, cache.shape[3])[:seq_len].float()


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
        kv = sequence_rows(kv_cache, block_tables, s, seq_len)  # [L, C + R]
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
    out = torch.zeros(num_tokens, num_heads, v_dim)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = qsl[s], qsl[s + 1]
        if q_end == q_start:
            continue
        kv = sequence_rows(kv_cache, block_tables, s, seq_len)
        kv_heads = torch.einsum("lc,hec->lhe", kv[:, :latent_dim], w)  # [L, H, N + V]
        k = torch.cat([kv_heads[..., :nope], kv[:, None, latent_dim:].expand(-1, num_heads, -1)], dim=-1)
        q = torch.cat([q_nope[q_start:q_end], q_rope[q_start:q_end]], dim=-1).float()
        scores = torch.einsum("qhd,lhd->hql", q, k) * scale
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len)[:, None]
        scores.masked_fill_(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
        out[q_start:q_end] = torch.einsum("hql,lhv->qhv", torch.softmax(scores, -1), kv_heads[..., nope:])
    return out
