"""Bidirectional attention over the patches of each image of a packed batch (vision towers).

A vision tower packs every image's patches into one sequence [num_patches, ...]; a patch attends to
all patches of its own image and to none of another's (a block-diagonal mask). There is no KV cache:
the tower runs once per image, so this is plain torch SDPA (flash / memory-efficient kernels on GPUs).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                      scale: float) -> torch.Tensor:
    """q, k, v: [num_patches, num_heads, head_dim], the images' patches one after another, image i
    `seq_lens[i]` rows long. Returns [num_patches, num_heads * head_dim].

    Images of one size (the common case: a benchmark's, or one image) go through SDPA as one batch;
    mixed sizes one image at a time."""
    assert sum(seq_lens) == q.shape[0], f"segments {seq_lens} do not cover {q.shape[0]} patches"
    num_patches, num_heads, head_dim = q.shape
    if len(set(seq_lens)) == 1:
        batch, length = len(seq_lens), seq_lens[0]
        q, k, v = (t.view(batch, length, num_heads, head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [B, heads, L, head_dim]
        return out.transpose(1, 2).reshape(num_patches, num_heads * head_dim)
    outs = []
    for qs, ks, vs in zip(q.split(seq_lens), k.split(seq_lens), v.split(seq_lens)):
        out = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), scale=scale)
        outs.append(out.transpose(0, 1).reshape(-1, num_heads * head_dim))
    return torch.cat(outs)
