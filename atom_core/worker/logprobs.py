"""The logprobs a step returns: of sampled tokens (with the sampler's top-k), of prompt tokens
(echo), and of the tokens a verify step emitted. Each entry is (logprob of the token, {token id:
logprob} of the top k); k 0 gives the token's own logprob only."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from atom_core.worker.input_batch import RequestState
    from atom_core.worker.verify_batch import VerifyRows


def sampled_logprobs(sampled, states: list[RequestState], seq_idx: list[int]) -> dict[int, list]:
    """Per batch index of a request that asked: its sampled token's logprob and top-k (the
    Sampler's output `sampled`, row r for request seq_idx[r])."""
    chosen = sampled.logprobs.tolist()
    tops = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
    top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
    result = {}
    for r, i in enumerate(seq_idx):
        k = states[i].sampling_params.logprobs
        if k is None:
            continue
        top = dict(zip(top_ids[r][:k], tops[r][:k])) if tops is not None and k > 0 else {}
        result[i] = [(chosen[r], top)]
    return result


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list:
    """Logprob of targets[j] under logits[j], with the top k (prompt logprobs)."""
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if k <= 0:
        return [(c, {}) for c in chosen]
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    return [(c, dict(zip(ids, vals))) for c, ids, vals in zip(chosen, top_ids.tolist(), top_vals.tolist())]


def emitted_logprobs(logits: torch.Tensor, rows: VerifyRows, tokens: list[list[int]], states: list[RequestState],
                     seq_idx: list[int]) -> dict[int, list]:
    """Raw-model logprobs of each emitted token (and the top-k), for requests that asked."""
    result = {}
    for r0, toks, i in zip(rows.first_rows, tokens, seq_idx):
        k = states[i].sampling_params.logprobs
        if k is None:
            continue
        raw = logits[r0 : r0 + len(toks)].log_softmax(dim=-1, dtype=torch.float32)
        chosen = raw.gather(1, torch.tensor(toks, device=raw.device).unsqueeze(1)).squeeze(1).tolist()
        if k > 0:
            vals, ids = raw.topk(k, dim=-1)
            tops = [dict(zip(i_, v_)) for i_, v_ in zip(ids.tolist(), vals.tolist())]
        else:
            tops = [{} for _ in toks]
        result[i] = list(zip(chosen, tops))
    return result
