"""Verifies draft tokens so the output follows the target model's distribution exactly.

Each sampling request owns 1 + k consecutive logit rows: row j scores the token after draft j
(row 0: after the pending token). A proposer that drafts deterministically (n-gram) is a point
mass q = delta(d): draft d at row j is accepted with probability p_j(d); on the first rejection
the request's next token is drawn from the residual max(p_j - q, 0) / Z, i.e. p_j without d;
when all k are accepted a bonus token comes from row k. Then every emitted token is distributed
as the target's (Leviathan et al. 2023). Greedy rows accept d iff d is the argmax and emit the
argmax, so greedy output equals non-speculative decoding token for token.

p_j is exactly what the Sampler samples from: penalties (over the outputs including the drafts
before row j), logit_bias, the min_tokens ban, a grammar's mask, temperature, top-k, top-p, min-p. Randomness: seeded rows
hash (seed, output index) as the Sampler does, so seeded requests are reproducible.
"""
from __future__ import annotations

import torch
from torch import nn

from atom_core.model_ops.sampler import (SamplingBatch, adjusted_logits, hashed_exponential, mix32, sampling_probs,
                                         unit_interval)

_MASK32 = 0xFFFFFFFF


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """U(0, 1) [B] from (seed, position), independent of hashed_exponential's noise (own salt)."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    row = mix32(lo ^ mix32(hi ^ mix32(positions & _MASK32)))
    return unit_interval(mix32(mix32(row ^ 0x68E31DA4) ^ 0x1B56C4E9))


class RejectionSampler(nn.Module):
    """logits [R, V] + a per-row SamplingBatch + draft_ids [R] (the draft verified at each row;
    -1 on a request's last row) -> [2, R] int64: (accepted, replacement). accepted[r]: row r's
    draft stands; replacement[r]: the token emitted when row r is the first rejected one (or the
    bonus token on the last row). `emitted_tokens` turns them into each request's tokens.
    No host sync."""

    def forward(self, logits: torch.Tensor, batch: SamplingBatch, draft_ids: torch.Tensor) -> torch.Tensor:
        logits = adjusted_logits(logits.float(), batch)
        has_draft = draft_ids >= 0
        draft = draft_ids.clamp(min=0).unsqueeze(1)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return torch.stack([(greedy_tokens == draft_ids).long(), greedy_tokens])
        probs = sampling_probs(logits, batch)
        if batch.seeds is not None:
            uniform = hashed_uniform(batch.seeds, batch.positions)
            noise = hashed_exponential(batch.seeds, batch.positions, probs.shape[-1])
        else:
            uniform = torch.rand(probs.shape[0], device=probs.device)
            noise = torch.empty_like(probs).exponential_()
        accepted = has_draft & (uniform < probs.gather(1, draft).squeeze(1))
        residual = torch.where(has_draft.unsqueeze(1), probs.scatter(1, draft, 0.0), probs)
        replacement = (residual / noise).argmax(dim=-1)
        if batch.any_greedy:
            is_greedy = batch.temperatures == 0
            accepted = torch.where(is_greedy, greedy_tokens == draft_ids, accepted)
            replacement = torch.where(is_greedy, greedy_tokens, replacement)
        return torch.stack([accepted.long(), replacement])


def emitted_tokens(verdict: list[list[int]], first_rows: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Host side: each request's accepted drafts plus its replacement or bonus token.
    verdict: the RejectionSampler's output as lists; first_rows: each request's first row."""
    accepted, replacement = verdict
    tokens = []
    for r0, draft in zip(first_rows, drafts):
        a = 0
        while a < len(draft) and accepted[r0 + a]:
            a += 1
        tokens.append(draft[:a] + [replacement[r0 + a]])
    return tokens
