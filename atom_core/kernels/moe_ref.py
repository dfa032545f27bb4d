"""Mixture-of-experts in plain PyTorch: the CPU path and the oracle for `kernels/triton/moe.py`.

Shapes: T tokens, E experts, K experts per token (top_k), H hidden size, I expert intermediate
size. Expert weights are stacked like HF transformers' fused experts: w13 [E, 2I, H] holds the
gate rows [:I] and the up rows [I:], w2 [E, H, I] is the down projection.

Routing follows the installed HF transformers routers (v5 modeling files), including where they
cast:
  * Mixtral (`MixtralTopKRouter`): softmax(logits.float()), top-k, always renormalised.
  * Qwen3-MoE (`Qwen3MoeTopKRouter`): softmax(logits, dtype=float), top-k, renormalised iff
    norm_topk_prob; HF then casts the weights to the logits' dtype (bf16 in a bf16 model). Here
    they stay float32, so HF's experts see weights one bf16 rounding away from ours.
  * DeepSeek-V3 / GLM-4.5 (`DeepseekV3TopkRouter`, `Glm4MoeTopkRouter`, "noaux_tc"): logits in
    float32 (HF runs the router matmul in float32), scores = sigmoid, choice = scores + bias;
    group score = sum of the top 2 choices in the group; experts outside the topk_group best
    groups get choice -inf (`masked_fill(~mask, float("-inf"))`); weights = the unbiased scores
    of the chosen ids, divided by (sum + 1e-20) iff norm_topk_prob, times routed_scaling_factor.
  * DeepSeek-V2 (`DeepseekV2TopkRouter`, "group_limited_greedy"): softmax in float32, group
    score = max prob in the group, other groups' probs become 0.0, top-k of those masked probs
    (so a masked pick weighs 0), times routed_scaling_factor; no renormalisation.
Renormalising divides by (sum + 1e-20) for softmax too: for top-k softmax weights the sum is at
least K/E, where adding 1e-20 leaves the float32 sum unchanged, so this equals HF bit for bit.

Ties: torch.topk breaks ties arbitrarily (on the CPU it is not even stable), so every top-k
here is a stable sort, i.e. among equal values the lower index wins. Where no tie straddles
the cut this is the same set as torch.topk's; the Triton kernel uses the same rule, so the two
providers agree id for id.

Expert ids outside [0, E) (e.g. experts on another rank under expert parallelism) are dropped:
they take no slot in the alignment and contribute nothing to fused_moe.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Scoring = Literal["softmax", "sigmoid"]
SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "swigluoai")
SWIGLU_ALPHA = 1.702  # GPT-OSS's sigmoid gain (HF swiglu_alpha); every released config uses it


def check_route_args(router_logits: torch.Tensor, top_k: int, scoring: str, correction_bias: torch.Tensor | None,
                     num_expert_group: int | None, topk_group: int | None) -> None:
    """Shared by both providers: everything here is host metadata, safe under graph capture."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if scoring not in SCORINGS:
        raise ValueError(f"unknown scoring '{scoring}'; expected one of: {', '.join(SCORINGS)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(f"correction_bias must be [{num_experts}], got {tuple(correction_bias.shape)}")
    if num_expert_group is not None:
        if num_expert_group < 1 or num_experts % num_expert_group:
            raise ValueError(f"num_expert_group={num_expert_group} must divide num_experts={num_experts}")
        if topk_group is None or not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, num_expert_group={num_expert_group}]")
        if scoring == "sigmoid" and num_experts // num_expert_group < 2:
            raise ValueError("sigmoid group scores sum each group's top 2 experts: groups need >= 2 experts")


def _stable_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, largest first, lower index first on ties."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def moe_route(
    router_logits: torch.Tensor,  # [T, E], any float dtype
    top_k: int,
    scoring: Scoring = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,  # [E]
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token; returns (weights [T, K] float32, ids [T, K] int32), ids in
    descending order of the choice score. See the module docstring for which HF router each
    argument combination reproduces."""
    check_route_args(router_logits, top_k, scoring, correction_bias, num_expert_group, topk_group)
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        num_tokens, num_experts = logits.shape
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)
        if scoring == "sigmoid":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, _stable_topk(group_scores, topk_group), True)
        kept = kept.repeat_interleave(num_experts // num_expert_group, dim=1)  # [T, E]
        if scoring == "sigmoid":
            choice = choice.masked_fill(~kept, float("-inf"))
        else:  # DeepSeek-V2 masks the probabilities themselves, so a masked pick weighs 0
            scores = scores.masked_fill(~kept, 0.0)
            choice = choice.masked_fill(~kept, 0.0)
    ids = _stable_topk(choice, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def max_padded_slots(num_assignments: int, num_experts: int, block_size: int) -> int:
    """Static size of the aligned id list: T*K ids plus under block_size pad slots for each
    expert that has any, and at most min(E, T*K) experts have any."""
    return num_assignments + min(num_experts, num_assignments) * (block_size - 1)


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, K] int32
    block_size: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*K (token, slot) assignments by expert, each expert's run padded to a multiple
    of block_size, so every block of the list belongs to one expert.

    Returns
      sorted_token_ids [max_padded] int32: flat ids t*K + k, by expert, ascending within an
        expert; pad slots hold the sentinel T*K. max_padded = max_padded_slots(T*K, E, bs).
      expert_ids [cdiv(max_padded, bs)] int32: the expert of each block; -1 past the end.
      num_tokens_post_padded [1] int32: length of the used prefix of sorted_token_ids.
    Entries of sorted_token_ids at or past num_tokens_post_padded are unspecified (here they
    hold the sentinel). Ids outside [0, E) are dropped.
    """
    num_assignments = topk_ids.numel()
    device = topk_ids.device
    max_padded = max_padded_slots(num_assignments, num_experts, block_size)
    flat = topk_ids.flatten().long()
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[valid], minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(torch.where(valid, flat, num_experts), stable=True).indices[:int(valid.sum())]
    experts = flat[order]
    rank = torch.arange(order.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    sorted_ids = torch.full((max_padded,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids[starts[experts] + rank] = order.to(torch.int32)
    num_blocks = -(-max_padded // block_size)
    block_experts = torch.repeat_interleave(torch.arange(num_experts, device=device), padded // block_size)
    expert_ids = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
    expert_ids[:block_experts.numel()] = block_experts.to(torch.int32)
    total = padded.sum().reshape(1).to(torch.int32)
    return sorted_ids, expert_ids, total


def check_activation(activation: str, swiglu_limit: float | None) -> None:
    """Shared by both providers: silu takes no limit, swigluoai needs a positive one."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation '{activation}'; expected one of: {', '.join(ACTIVATIONS)}")
    if activation == "swigluoai" and not (swiglu_limit is not None and swiglu_limit > 0):
        raise ValueError(f"activation 'swigluoai' needs swiglu_limit > 0 (the config's swiglu_limit), "
                         f"got {swiglu_limit}")
    if activation == "silu" and swiglu_limit is not None:
        raise ValueError(f"swiglu_limit={swiglu_limit} applies to activation 'swigluoai' only, not 'silu'")


def apply_activation(h: torch.Tensor, activation: str, swiglu_limit: float | None = None) -> torch.Tensor:
    """h [..., 2I] (gate columns, then up columns) -> [..., I], in h's dtype.

    silu: silu(gate) * up. swigluoai (GPT-OSS, HF `GptOssExperts._apply_gate`): gate clamped
    above at the limit, up clamped to [-limit, limit], then (up + 1) * gate * sigmoid(1.702 * gate).
    """
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int32
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    w2_bias: torch.Tensor | None = None,  # [E, H]
    swiglu_limit: float | None = None,  # swigluoai's clamp; None for silu
) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * (act(x_t @ w13[e].T + b13[e]) @ w2[e].T + b2[e]) with
    e = topk_ids[t, k] and act = apply_activation (silu(h[:I]) * h[I:], or GPT-OSS's swigluoai).

    Precision: both matmuls and the activation run in hidden's dtype (each result rounded to it,
    as an eager HF expert does); the weighted sum over the K experts accumulates in float32 and is
    cast to hidden's dtype once at the end (HF accumulates in hidden's dtype with index_add_).
    """
    check_activation(activation, swiglu_limit)
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat = topk_ids.flatten().long()
    flat_weights = topk_weights.flatten().float()
    h_dtype = hidden.dtype  # biases of another float dtype are rounded to it, as F.linear needs
    for e in torch.unique(flat).tolist():
        if not 0 <= e < num_experts:
            continue
        slots = (flat == e).nonzero().squeeze(1)
        tokens = slots // top_k
        h = F.linear(hidden.index_select(0, tokens), w13[e], None if w13_bias is None else w13_bias[e].to(h_dtype))
        y = F.linear(apply_activation(h, activation, swiglu_limit), w2[e],
                     None if w2_bias is None else w2_bias[e].to(h_dtype))
        out.index_add_(0, tokens, y.float() * flat_weights[slots, None])
    return out.to(hidden.dtype)
