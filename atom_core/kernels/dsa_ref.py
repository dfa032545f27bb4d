"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2 / GLM-5) in plain PyTorch: the CPU path and
the oracle of `kernels/triton/dsa_index.py` and `kernels/triton/dsa_mla.py`.

A "lightning indexer" scores every cached token j for each query token t,

    score[t, j] = sum_h w[t, h] * relu(scale * q[t, h] . k[j])      (j <= position of t)

over its own per-token key cache ([NB, BS, 1, D], beside the MLA latent, same blocks and slots),
keeps the index_topk best positions per query row, and MLA (absorbed form, as kernels/mla_ref.py)
attends only to their latent rows. The weights w already carry the indexer's n_heads^-0.5.

Selection order: the k largest scores; among equal scores the lower position first; positions
scoring -inf (future or past seq_len) are never selected, so a row that sees fewer than k tokens
keeps all of them. Returned as KV cache slots in ascending position order, -1 padded to k: a
fixed shape, so decode stays CUDA-graph safe. Shapes as in torch_ref (T tokens, S sequences,
NB blocks, BS block size, MB max blocks per sequence); Hi indexer heads, D indexer head dim,
K index_topk, W the score row width (max_seq_len).

FP8 indexer keys (the public recipe; HF keeps bf16 keys): the indexer's query and key are
rotated by the normalized Hadamard matrix after RoPE (orthogonal: the exact scores are
unchanged, while outlier dims are spread before rounding), and each key is stored as e4m3 in
groups of 128 values, each with its float32 scale amax / 448 ([NB, BS, G, D / G] codes and
[NB, BS, G] scales; the query stays in the model dtype). The scores read key = code * scale.
"""
from __future__ import annotations

import torch

from atom_core.kernels.mla_ref import sequence_rows


def _query_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int):
    """(sequence [T], position [T]) of every query row; rows past query_start_loc[-1] get
    sequence -1 (graph padding owns no sequence)."""
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    seq = torch.full((num_tokens,), -1, dtype=torch.int64)
    pos = torch.zeros(num_tokens, dtype=torch.int64)
    for s, seq_len in enumerate(lens):
        q_start, q_end = qsl[s], qsl[s + 1]
        seq[q_start:q_end] = s
        pos[q_start:q_end] = torch.arange(seq_len - (q_end - q_start), seq_len)
    return seq, pos


def hadamard_matrix(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix [dim, dim] float32 (orthogonal, symmetric);
    `dim` a power of two."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two dim, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * dim ** -0.5).to(device)


def dequantize_index_cache(index_cache: torch.Tensor, index_scale_cache: torch.Tensor) -> torch.Tensor:
    """FP8 codes [NB, BS, G, D / G] and scales [NB, BS, G] -> keys [NB, BS, 1, D] float32."""
    keys = index_cache.float() * index_scale_cache[..., None]
    return keys.flatten(2).unsqueeze(2)


def dsa_index_scores(
    index_q: torch.Tensor,  # [T, Hi, D]: the indexer's roped queries
    weights: torch.Tensor,  # [T, Hi] float: per-head weights (times Hi^-0.5)
    index_cache: torch.Tensor,  # [NB, BS, 1, D]: the indexer's roped keys (FP8: [NB, BS, G, D / G] codes)
    block_tables: torch.Tensor,  # [S, MB] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32, KV length after this step
    scale: float,  # the indexer's softmax scale, D^-0.5
    max_seq_len: int,  # W: the width of the score rows
    max_query_len: int | None = None,  # an upper bound of any sequence's rows (kernels size grids with it)
    index_scale_cache: torch.Tensor | None = None,  # [NB, BS, G] float32: FP8 keys' scales (module doc)
) -> torch.Tensor:
    """score [T, W] float32: sum_h weights[t, h] * relu(scale * index_q[t, h] . key_j) at the
    positions j <= t's position, -inf elsewhere; rows past query_start_loc[-1] are undefined
    (here -inf)."""
    if index_scale_cache is not None:
        index_cache = dequantize_index_cache(index_cache, index_scale_cache)
    num_tokens = index_q.shape[0]
    out = torch.full((num_tokens, max_seq_len), float("-inf"), dtype=torch.float32, device=index_q.device)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = qsl[s], qsl[s + 1]
        if q_end == q_start:
            continue
        keys = sequence_rows(index_cache, block_tables, s, seq_len)  # [L, D]
        dots = torch.einsum("qhd,ld->qhl", index_q[q_start:q_end].float(), keys) * scale
        scores = torch.einsum("qh,qhl->ql", weights[q_start:q_end].float(), dots.relu())
        q_pos = torch.arange(seq_len - (q_end - q_start), seq_len, device=out.device)[:, None]
        scores.masked_fill_(torch.arange(seq_len, device=out.device)[None, :] > q_pos, float("-inf"))
        out[q_start:q_end, :seq_len] = scores
    return out


def dsa_topk(
    scores: torch.Tensor,  # [T, W] float32 (dsa_index_scores)
    index_topk: int,  # K
    block_tables: torch.Tensor,  # [S, MB] int32
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_size: int,
    max_query_len: int | None = None,  # as for dsa_index_scores
) -> torch.Tensor:
    """slots [T, K] int32: the KV cache slots of each row's selected positions (see the module
    doc: the K best, ties to the lower position, never a -inf one), ascending, -1 padded. Rows
    past query_start_loc[-1] are all -1."""
    num_tokens, width = scores.shape
    seq, _ = _query_positions(query_start_loc, seq_lens, num_tokens)
    k = min(index_topk, width)
    # A stable descending sort keeps equal scores in position order, so ties go to the lower one.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]  # [T, k]
    chosen = scores.gather(1, order) > float("-inf")
    positions = torch.where(chosen, order, torch.full_like(order, width)).sort(dim=1).values  # -1 pads last
    seq = seq.to(scores.device)
    chosen = (positions < width) & (seq[:, None] >= 0)
    positions = torch.where(chosen, positions, torch.zeros_like(positions))
    blocks = block_tables[seq.clamp(min=0)].long().gather(1, positions // block_size)  # [T, k]
    slots = torch.where(chosen, blocks * block_size + positions % block_size, torch.full_like(positions, -1))
    out = torch.full((num_tokens, index_topk), -1, dtype=torch.int32, device=scores.device)
    out[:, :k] = slots.to(torch.int32)
    return out


def mla_sparse_attention(
    q_latent: torch.Tensor,  # [T, H, C]
    q_rope: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [NB, BS, 1, C + R]: latent, then roped key (kernels/mla_ref.py)
    slots: torch.Tensor,  # [T, K] int: the cache slots row t attends to; -1 = none
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, C]
) -> torch.Tensor:
    """out[t, h] = sum_j softmax_j(scale * (q_latent[t, h] . c_j + q_rope[t, h] . r_j)) c_j over
    the slots j of row t (no causal mask: the selection is causal already). A row without a
    slot gets 0. Returns [T, H, C] in q_latent's dtype; fp32 arithmetic."""
    latent_dim = q_latent.shape[2]
    if kv_cache.shape[3] != latent_dim + q_rope.shape[2]:
        raise ValueError(f"kv_cache row {kv_cache.shape[3]} != latent {latent_dim} + rope {q_rope.shape[2]}")
    if slots.shape[0] != q_latent.shape[0]:
        raise ValueError(f"slots {tuple(slots.shape)} must have a row per query token ({q_latent.shape[0]})")
    rows = kv_cache.reshape(-1, kv_cache.shape[3])
    valid = slots >= 0  # [T, K]
    kv = rows[slots.long().clamp(min=0)].float()  # [T, K, C + R]
    q = torch.cat([q_latent, q_rope], dim=-1).float()
    scores = torch.einsum("thd,tkd->thk", q, kv) * scale
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no slot: all -inf
    o = torch.einsum("thk,tkc->thc", probs, kv[..., :latent_dim]).to(q_latent.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out
