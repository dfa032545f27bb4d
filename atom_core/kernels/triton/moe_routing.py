"""Mixture-of-experts routing and token-to-expert alignment (Triton), for kernels/triton/moe.py.
Same contracts as `kernels/moe_ref.py`: one launch for routing (a program per token); one or two
for alignment (sorted by expert, runs padded to the GEMM tile, no host sync).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from atom_core.kernels.moe_ref import check_route_args, max_padded_slots
from atom_core.kernels.triton.common import (
    check_dim, check_float, check_int, check_last_dim_contiguous, check_same_device, next_pow2,
)

# Assignments one alignment program sorts; beyond this the work spreads over chunks.
ALIGN_MAX_CHUNK = 1024


# ---------------------------------------------------------------------------------------------
# routing


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scaling,
    NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, GROUPS_P: tl.constexpr, GROUP_P: tl.constexpr,
    TOP_K: tl.constexpr, K_P: tl.constexpr, TOPK_GROUP: tl.constexpr,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    """One token row. Experts sit in a [groups, group size] tile (one group when ungrouped);
    every top-k is K rounds of (max, lowest index holding it), the stable rule of the reference."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_P)[:, None]
    j = tl.arange(0, GROUP_P)[None, :]
    valid = (g < NUM_GROUPS) & (j < GROUP_SIZE)
    expert = g * GROUP_SIZE + j
    x = tl.load(logits_ptr + row * stride_l + expert, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        p = tl.exp(x - tl.max(tl.max(x, 1), 0))
        scores = p / tl.sum(tl.sum(p, 1), 0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    if GROUPED:
        top1 = tl.max(tl.where(valid, choice, float("-inf")), 1)
        if SIGMOID:  # group score = top1 + top2; drop one lane holding top1, take the max again
            first = tl.min(tl.where(valid & (choice == top1[:, None]), j, GROUP_P), 1)
            group_score = top1 + tl.max(tl.where(valid & (j != first[:, None]), choice, float("-inf")), 1)
        else:
            group_score = top1
        gi = tl.arange(0, GROUPS_P)
        kept = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            free = (gi < NUM_GROUPS) & (kept == 0)
            best = tl.max(tl.where(free, group_score, float("-inf")), 0)
            pick = tl.min(tl.where(free & (group_score == best), gi, GROUPS_P), 0)
            kept = kept | (gi == pick)
        kept2 = kept[:, None]
        if SIGMOID:  # DeepSeek-V3 / GLM: masked experts can still be picked, with their score
            choice = tl.where(kept2, choice, float("-inf"))
        else:  # DeepSeek-V2: masked probabilities become 0, so a masked pick weighs 0
            scores = tl.where(kept2, scores, 0.0)
            choice = tl.where(kept2, choice, 0.0)
    offs_k = tl.arange(0, K_P)
    out_w = tl.zeros([K_P], dtype=tl.float32)
    out_id = tl.zeros([K_P], dtype=tl.int32)
    taken = expert < 0
    for k in tl.static_range(TOP_K):
        free = valid & (taken == 0)
        best = tl.max(tl.max(tl.where(free, choice, float("-inf")), 1), 0)
        pick = tl.min(tl.min(tl.where(free & (choice == best), expert, NUM_GROUPS * GROUP_SIZE), 1), 0)
        hit = expert == pick
        taken = taken | hit
        out_w = tl.where(offs_k == k, tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0), out_w)
        out_id = tl.where(offs_k == k, pick, out_id)
    if RENORMALIZE:
        out_w = out_w / (tl.sum(out_w, 0) + 1e-20)
    k_ok = offs_k < TOP_K
    tl.store(weights_ptr + row * TOP_K + offs_k, out_w * scaling, mask=k_ok)
    tl.store(ids_ptr + row * TOP_K + offs_k, out_id, mask=k_ok)


def _route(router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
           correction_bias: Optional[torch.Tensor], num_expert_group: Optional[int], topk_group: Optional[int],
           routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_route_args(router_logits, top_k, scoring, correction_bias, num_expert_group, topk_group)
    check_float("router_logits", router_logits)
    check_last_dim_contiguous("router_logits", router_logits)
    num_tokens, num_experts = router_logits.shape
    if num_experts > 512 or top_k > 16:
        raise ValueError(f"the routing kernel handles E <= 512 and top_k <= 16, got E={num_experts}, top_k={top_k}")
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    grouped = num_expert_group is not None and num_expert_group > 1
    num_groups = num_expert_group if grouped else 1
    group_size = num_experts // num_groups
    bias = correction_bias if correction_bias is not None else weights
    if correction_bias is not None:
        check_same_device(router_logits=router_logits, correction_bias=correction_bias)
    experts_p = next_pow2(num_groups) * next_pow2(group_size)
    _route_kernel[(num_tokens,)](
        router_logits, bias, weights, ids, router_logits.stride(0), float(routed_scaling_factor),
        NUM_GROUPS=num_groups, GROUP_SIZE=group_size, GROUPS_P=next_pow2(num_groups),
        GROUP_P=next_pow2(group_size), TOP_K=top_k, K_P=next_pow2(top_k),
        TOPK_GROUP=topk_group if grouped else 1, SIGMOID=scoring == "sigmoid",
        HAS_BIAS=correction_bias is not None, GROUPED=grouped, RENORMALIZE=renormalize,
        num_warps=max(1, min(4, experts_p // 128)),
    )
    return weights, ids


# ---------------------------------------------------------------------------------------------
# alignment


@triton.jit
def _expert_histogram(e, ok, EXPERTS_P: tl.constexpr):
    # Dropped ids are counted in bin 0 and taken off again: tl.histogram's mask argument is
    # missing from older Tritons.
    hist = tl.histogram(tl.where(ok, e, 0), EXPERTS_P)
    num_dropped = tl.sum((ok == 0).to(tl.int32), 0)
    return hist - tl.where(tl.arange(0, EXPERTS_P) == 0, num_dropped, 0)


@triton.jit(do_not_specialize=["num_assignments"])
def _align_count_kernel(ids_ptr, counts_ptr, num_assignments,
                        NUM_EXPERTS: tl.constexpr, EXPERTS_P: tl.constexpr, CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < num_assignments, other=-1).to(tl.int32)
    hist = _expert_histogram(e, (e >= 0) & (e < NUM_EXPERTS), EXPERTS_P)
    tl.store(counts_ptr + chunk * EXPERTS_P + tl.arange(0, EXPERTS_P), hist)


@triton.jit(do_not_specialize=["num_assignments", "num_chunks", "num_blocks"])
def _align_scatter_kernel(
    ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, num_assignments, num_chunks, num_blocks,
    NUM_EXPERTS: tl.constexpr, EXPERTS_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
    COUNT_HERE: tl.constexpr, BLOCKS_TILE: tl.constexpr, PAD_TILE: tl.constexpr,
):
    """Program c places chunk c's assignments. Every program derives the expert offsets from
    the per-chunk histograms itself (no cross-program sync); with a single chunk it counts
    them here (COUNT_HERE) and the histogram launch is skipped."""
    chunk = tl.program_id(0)
    offs_e = tl.arange(0, EXPERTS_P)
    local = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + local
    e = tl.load(ids_ptr + offs, mask=offs < num_assignments, other=-1).to(tl.int32)
    ok = (e >= 0) & (e < NUM_EXPERTS)
    if COUNT_HERE:
        mine = _expert_histogram(e, ok, EXPERTS_P)
        total = mine
        before = mine * 0
    else:
        total = tl.zeros([EXPERTS_P], dtype=tl.int32)
        before = tl.zeros([EXPERTS_P], dtype=tl.int32)
        for c in range(num_chunks):
            row = tl.load(counts_ptr + c * EXPERTS_P + offs_e)
            total += row
            before += tl.where(c < chunk, row, 0)
        mine = tl.load(counts_ptr + chunk * EXPERTS_P + offs_e)
    padded = (total + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    # Sorting (expert, position) keys puts expert e's ids of this chunk at sorted positions
    # [excl(e), excl(e) + mine[e]); they belong at starts[e] + before[e] onwards.
    base = starts + before - (tl.cumsum(mine, 0) - mine)
    keys = tl.sort(tl.where(ok, e, EXPERTS_P) * CHUNK + local)
    sorted_e = keys // CHUNK
    pos = tl.gather(base, tl.minimum(sorted_e, EXPERTS_P - 1), 0) + local
    tl.store(sorted_ptr + pos, chunk * CHUNK + keys % CHUNK, mask=sorted_e < NUM_EXPERTS)

    # A block's expert is the number of experts whose padded run ends at or before it.
    for b0 in range(chunk * BLOCKS_TILE, num_blocks, num_chunks * BLOCKS_TILE):
        b = b0 + tl.arange(0, BLOCKS_TILE)
        owner = tl.sum((ends[None, :] <= b[:, None] * BLOCK_SIZE).to(tl.int32), 1)
        tl.store(expert_ids_ptr + b, tl.where(owner < NUM_EXPERTS, owner, -1), mask=b < num_blocks)
    if chunk == 0:
        tl.store(num_post_ptr, tl.sum(padded, 0))
        fill = padded - total  # pad slots after each expert's ids get the sentinel T*K
        for j0 in range(0, tl.max(fill, 0), PAD_TILE):
            j = j0 + tl.arange(0, PAD_TILE)
            ptrs = sorted_ptr + (starts + total)[:, None] + j[None, :]
            tl.store(ptrs, num_assignments, mask=j[None, :] < fill[:, None])


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `moe_ref.moe_align_block_size`; entries of sorted_token_ids past
    num_tokens_post_padded are left unwritten."""
    max_padded = max_padded_slots(topk_ids.numel(), num_experts, block_size)
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.empty((triton.cdiv(max_padded, block_size),), dtype=torch.int32, device=topk_ids.device)
    num_post = torch.empty((1,), dtype=torch.int32, device=topk_ids.device)
    launch_moe_align(topk_ids, block_size, num_experts, sorted_ids, expert_ids, num_post)
    return sorted_ids, expert_ids, num_post


def launch_moe_align(topk_ids: torch.Tensor, block_size: int, num_experts: int, sorted_ids: torch.Tensor,
                     expert_ids: torch.Tensor, num_post: torch.Tensor) -> None:
    """moe_align_block_size into given buffers (sized as it sizes them)."""
    check_dim("topk_ids", topk_ids, 2)
    check_int("topk_ids", topk_ids)
    if not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous, got strides {topk_ids.stride()}")
    if block_size < 1 or num_experts < 1:
        raise ValueError(f"block_size={block_size} and num_experts={num_experts} must be positive")
    num_assignments = topk_ids.numel()
    num_blocks = expert_ids.shape[0]
    assert sorted_ids.shape[0] == max_padded_slots(num_assignments, num_experts, block_size), "sorted_ids size"
    assert num_blocks == triton.cdiv(sorted_ids.shape[0], block_size), "expert_ids size"
    if num_assignments == 0:
        expert_ids.fill_(-1)
        num_post.zero_()
        return
    chunk = max(64, min(ALIGN_MAX_CHUNK, next_pow2(num_assignments)))
    num_chunks = triton.cdiv(num_assignments, chunk)
    experts_p = next_pow2(num_experts)
    counts = expert_ids  # unused when one chunk counts for itself
    if num_chunks > 1:
        counts = torch.empty((num_chunks, experts_p), dtype=torch.int32, device=topk_ids.device)
        _align_count_kernel[(num_chunks,)](topk_ids, counts, num_assignments,
                                           NUM_EXPERTS=num_experts, EXPERTS_P=experts_p, CHUNK=chunk)
    _align_scatter_kernel[(num_chunks,)](
        topk_ids, counts, sorted_ids, expert_ids, num_post, num_assignments, num_chunks, num_blocks,
        NUM_EXPERTS=num_experts, EXPERTS_P=experts_p, BLOCK_SIZE=block_size, CHUNK=chunk,
        COUNT_HERE=num_chunks == 1, BLOCKS_TILE=max(1, min(64, 8192 // experts_p)),
        PAD_TILE=max(1, min(next_pow2(block_size), 8192 // experts_p)), num_warps=4,
    )


@torch.library.custom_op("atom::moe_route", mutates_args=())
def moe_route_op(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
                 correction_bias: Optional[torch.Tensor] = None, num_expert_group: Optional[int] = None,
                 topk_group: Optional[int] = None,
                 routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return _route(router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
                  routed_scaling_factor)


@moe_route_op.register_fake
def _(router_logits, top_k, scoring="softmax", renormalize=False, correction_bias=None, num_expert_group=None,
      topk_group=None, routed_scaling_factor=1.0):
    check_route_args(router_logits, top_k, scoring, correction_bias, num_expert_group, topk_group)
    shape = (router_logits.shape[0], top_k)
    return (router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int32))


def moe_route(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = False,
              correction_bias: Optional[torch.Tensor] = None, num_expert_group: Optional[int] = None,
              topk_group: Optional[int] = None,
              routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `moe_ref.moe_route`, one launch (a program per token)."""
    route = moe_route_op if torch.compiler.is_compiling() else _route
    return route(router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
                 routed_scaling_factor)
