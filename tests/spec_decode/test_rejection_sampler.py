"""The rejection sampler keeps the target distribution: chi-square tests on a tiny vocabulary,
greedy exactness, seeded reproducibility."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from atom_core.model_ops.sampler import SamplingBatch
from atom_core.spec_decode.rejection_sampler import RejectionSampler, emitted_tokens

V = 8


def batch(rows: int, temperature: float, top_k: int | None = None, seeds=None, positions=None) -> SamplingBatch:
    temps = torch.full((rows,), temperature)
    return SamplingBatch(
        temperatures=temps, top_ks=None if top_k is None else torch.full((rows,), top_k, dtype=torch.int64),
        top_ps=None, min_ps=None, seeds=seeds, positions=positions,
        all_greedy=temperature == 0, any_greedy=temperature == 0)


def run(position_logits: torch.Tensor, drafts: list[int], n: int, sb_kwargs: dict, seed: int = 0):
    """n requests, each verifying `drafts` against rows with logits position_logits[j]."""
    k = len(drafts)
    logits = position_logits[: k + 1].repeat(n, 1)  # request-major: rows 0..k of each request
    draft_ids = torch.tensor((drafts + [-1]) * n)
    torch.manual_seed(seed)
    verdict = RejectionSampler()(logits, batch(n * (k + 1), **sb_kwargs), draft_ids)
    return emitted_tokens(verdict.tolist(), [i * (k + 1) for i in range(n)], [drafts] * n)


def target(logits: torch.Tensor, temperature: float, top_k: int | None = None) -> np.ndarray:
    scaled = logits / temperature
    if top_k is not None:
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.softmax(-1).double().numpy()


def assert_distribution(samples: list[int], probs: np.ndarray) -> None:
    counts = np.bincount(samples, minlength=V)
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}"
    expected = probs[support] / probs[support].sum() * len(samples)
    assert chisquare(counts[support], expected).pvalue > 1e-3, (counts, expected)


LOGITS = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
                       [0.0, 1.0, 2.5, 0.3, 0.3, -1.0, 0.8, 0.1],
                       [1.0, 0.0, 0.0, 2.0, 0.5, 0.5, 0.0, 1.2]])


class TestDistribution:
    @pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, None), (1.3, 4)])
    def test_every_emitted_position_follows_the_target(self, temperature, top_k):
        drafts = [1, 2]
        out = run(LOGITS, drafts, 30000, {"temperature": temperature, "top_k": top_k})
        p = [target(LOGITS[j], temperature, top_k) for j in range(3)]
        assert_distribution([t[0] for t in out], p[0])
        # Given the first draft stood, the second token is the target's at position 1, etc.
        assert_distribution([t[1] for t in out if t[0] == drafts[0]], p[1])
        assert_distribution([t[2] for t in out if t[:2] == drafts], p[2])

    def test_acceptance_rate_is_the_target_probability_of_the_draft(self):
        out = run(LOGITS, [0], 20000, {"temperature": 1.0})
        rate = sum(len(t) == 2 for t in out) / len(out)
        assert rate == pytest.approx(target(LOGITS[0], 1.0)[0], abs=0.015)

    def test_draft_outside_top_k_is_always_rejected(self):
        out = run(LOGITS, [7], 2000, {"temperature": 1.0, "top_k": 3})
        assert all(len(t) == 1 and t[0] in (0, 1, 2) for t in out)


class TestGreedy:
    def test_emits_the_argmax_chain(self):
        # argmaxes of the rows: 0, 2, 3. Drafts [0, 2] both stand, the bonus is 3.
        assert run(LOGITS, [0, 2], 3, {"temperature": 0.0}) == [[0, 2, 3]] * 3
        # first draft wrong: one token, the argmax, and nothing after it
        assert run(LOGITS, [1, 2], 2, {"temperature": 0.0}) == [[0]] * 2
        assert run(LOGITS, [0, 5], 1, {"temperature": 0.0}) == [[0, 2]]

    def test_all_rejected_still_gains_one_token(self):
        out = run(LOGITS, [7, 7, 7][:2], 500, {"temperature": 1.0})
        assert all(len(t) >= 1 for t in out)


class TestSeeds:
    def test_same_seed_and_position_same_tokens(self):
        n = 200
        seeds = torch.tensor([1234] * (3 * n))
        positions = torch.arange(3).repeat(n)
        kwargs = {"temperature": 1.0, "seeds": seeds, "positions": positions}
        a = run(LOGITS, [1, 2], n, kwargs, seed=1)
        b = run(LOGITS, [1, 2], n, kwargs, seed=2)  # the torch RNG does not matter
        assert a == b and len(set(map(tuple, a))) == 1
        per_request = torch.arange(3 * n) // 3
        d = run(LOGITS, [1, 2], n, {**kwargs, "seeds": per_request})
        assert len(set(map(tuple, d))) > 3
