"""MoE token exchange by all-to-all, for data-parallel replicas sharing experts (--ep-dispatch alltoall).

The default exchange (communication.dispatch_tokens / combine_tokens) all-gathers every replica's
tokens to every rank and reduce-scatters the partial outputs back: fixed sizes, no per-peer
counts. This one sends a token only to the ranks that own one of its top-k experts, with those
experts' weights and local ids; each rank runs its experts on what it received and sends the
outputs back, and the sender adds them up per token. It moves less when a token's experts sit on
few ranks (many ranks, small top-k), and costs a count exchange and a device-to-host sync per
layer; which of the two wins depends on the rank count and the model's top-k, so both exist.

Experts are owned in contiguous blocks: rank r holds [r * per_rank, (r + 1) * per_rank).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from atom_core.distributed.parallel_state import GroupCoordinator

RunExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _exchange_rows(x: torch.Tensor, send: list[int], recv: list[int], group: GroupCoordinator) -> torch.Tensor:
    """Rows x[sum(send[:i]) : sum(send[:i+1])] go to rank i; returns the rows received, by source rank."""
    out = x.new_empty(sum(recv), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group.device_group)
    return out


def moe_all_to_all(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts_per_rank: int,
                   group: GroupCoordinator, run_experts: RunExperts) -> torch.Tensor:
    """hidden [n, H] this replica's tokens, weights / ids [n, k] their routing (global expert ids)
    -> [n, H]: the sum over each token's top-k experts, wherever they live. run_experts(h, w, local_ids)
    runs this rank's experts (weight 0 for slots routed elsewhere)."""
    world = group.world_size
    owner = (ids // experts_per_rank).long()  # [n, k]
    needs = torch.zeros(hidden.shape[0], world, dtype=torch.bool, device=hidden.device)
    needs.scatter_(1, owner, True)
    dest, row = needs.t().nonzero(as_tuple=True)  # by destination rank, then token: the send order
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group.device_group)
    send, recv = send_counts.tolist(), recv_counts.tolist()  # split sizes live on the host
    mine = owner[row] == dest[:, None]  # [m, k]: the slots of each sent row that its destination owns
    local_ids = torch.where(mine, ids[row] - (dest * experts_per_rank)[:, None].to(ids.dtype), 0).to(ids.dtype)
    got_h = _exchange_rows(hidden[row], send, recv, group)
    got_w = _exchange_rows(weights[row] * mine, send, recv, group)
    got_ids = _exchange_rows(local_ids, send, recv, group)
    out_rows = run_experts(got_h, got_w, got_ids) if got_h.shape[0] else got_h.new_zeros(0, hidden.shape[1])
    back = _exchange_rows(out_rows.to(hidden.dtype), recv, send, group)  # in send order
    out = torch.zeros_like(hidden)
    return out.index_add_(0, row, back)
