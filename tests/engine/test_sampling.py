"""Sampling: seeds, greedy equivalences, distributions (chi-square), truncation, penalties, logprobs.

Distribution tests call the real `Sampler` on hand-made logits; the rest run the real
LLMEngine on the tiny random Llama on the CPU.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from atom_core import LLMEngine, SamplingParams
from atom_core.model_ops.sampler import Sampler, SamplingBatch, apply_penalties

PROMPTS = ["Hello world", "The quick brown fox", "naïve café 🚀", "0123456789 +"]
P_VALUE = 1e-3
N_SAMPLES = 20000


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(str(tiny_llama), device="cpu", num_kv_blocks=256)


@pytest.fixture(scope="module")
def greedy_outputs(engine):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o["token_ids"] for o in engine.generate(PROMPTS, params)]


def sampled(**kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 1.0), max_tokens=kw.pop("max_tokens", 10),
                          ignore_eos=True, **kw)


# ---- helpers for the Sampler-level tests ----------------------------------------------------
def make_batch(num_rows: int, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
               min_p: float | None = None, seeds: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> SamplingBatch:
    def full(value, dtype):
        return None if value is None else torch.full((num_rows,), value, dtype=dtype)

    if seeds is not None and positions is None:
        positions = torch.zeros(num_rows, dtype=torch.int64)
    return SamplingBatch(
        temperatures=torch.full((num_rows,), temperature), top_ks=full(top_k, torch.int64),
        top_ps=full(top_p, torch.float32), min_ps=full(min_p, torch.float32), seeds=seeds,
        positions=positions, all_greedy=False, any_greedy=False,
    )


def sample_counts(probs: list[float], batch: SamplingBatch) -> np.ndarray:
    logits = torch.tensor(probs).log().expand(batch.temperatures.shape[0], -1).contiguous()
    tokens = Sampler()(logits, batch).token_ids
    return np.bincount(tokens.numpy(), minlength=len(probs))


def assert_follows(counts: np.ndarray, expected_probs: list[float]) -> None:
    expected = np.asarray(expected_probs, dtype=np.float64)
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}"
    expected = expected[support] / expected[support].sum() * counts.sum()
    p = chisquare(counts[support], expected).pvalue
    assert p > P_VALUE, f"counts {counts.tolist()} do not follow {expected_probs} (p={p:.2e})"


DIST = [0.05, 0.1, 0.2, 0.3, 0.15, 0.1, 0.07, 0.03]
DIST_MINP = [0.05, 0.1, 0.2, 0.3, 0.14, 0.1, 0.08, 0.03]  # no token sits on the min_p=0.5 floor


class TestSeeds:
    def test_same_seed_same_tokens_alone_and_in_a_mixed_batch(self, engine):
        seeded = sampled(seed=1234)
        alone = engine.generate([PROMPTS[0]], seeded)[0]["token_ids"]
        mixed = engine.generate(
            [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[3]],
            [sampled(), seeded, sampled(seed=99), sampled(temperature=0.7, seed=5), sampled(temperature=0)],
        )
        assert mixed[1]["token_ids"] == alone
        # the same seed on a different prompt or a different seed on the same prompt differ
        assert mixed[3]["token_ids"] != alone
        assert engine.generate([PROMPTS[0]], sampled(seed=1235))[0]["token_ids"] != alone
        # and repeating it in another batch shape (no other seeded rows) still agrees
        again = engine.generate([PROMPTS[0], PROMPTS[2]], [seeded, sampled()])[0]["token_ids"]
        assert again == alone

    @pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
    def test_seeded_output_survives_chunked_prefill_and_preemption(self, engine, tiny_llama, async_scheduling):
        seeded = sampled(seed=77, max_tokens=12)
        expected = engine.generate([PROMPTS[2]], seeded)[0]["token_ids"]
        cramped = LLMEngine(str(tiny_llama), device="cpu", num_kv_blocks=6, block_size=4, max_num_batched_tokens=8,
                            max_model_len=24, async_scheduling=async_scheduling)
        long_prompt = engine.tokenizer.encode(PROMPTS[1])[:8]
        outs = cramped.generate([long_prompt, PROMPTS[2], long_prompt],
                                [sampled(max_tokens=12), seeded, sampled(max_tokens=12)])
        assert cramped.core.scheduler.num_preemptions > 0, "the setup no longer forces preemption"
        assert outs[1]["token_ids"] == expected
        assert cramped.core.kv.num_free_blocks == cramped.core.kv.num_blocks

    def test_seeded_row_ignores_its_neighbours_in_the_sampler(self):
        torch.manual_seed(0)
        logits = torch.randn(16, 100)
        seeds = torch.randint(0, 2**62, (16,))
        positions = torch.arange(16) * 3
        together = Sampler()(logits, make_batch(16, seeds=seeds, positions=positions)).token_ids
        for r in (0, 7, 15):
            alone = Sampler()(logits[r : r + 1], make_batch(1, seeds=seeds[r : r + 1], positions=positions[r : r + 1]))
            assert alone.token_ids.item() == together[r].item()
        moved = Sampler()(logits, make_batch(16, seeds=seeds, positions=positions + 1)).token_ids
        assert not torch.equal(moved, together), "noise must depend on the output position"


class TestGreedyEquivalents:
    @pytest.mark.parametrize("params", [
        dict(temperature=1.0, top_k=1),
        dict(temperature=0.0),
        dict(temperature=1.0, top_p=1e-6),
        dict(temperature=1.0, min_p=1.0),
        dict(temperature=0.8, top_k=1, seed=3),
        dict(temperature=1.0, top_p=1e-6, seed=11),
    ], ids=["top_k=1", "temperature=0", "top_p=1e-6", "min_p=1", "top_k=1+seed", "top_p=1e-6+seed"])
    def test_equals_greedy(self, engine, greedy_outputs, params):
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True, **params))
        assert [o["token_ids"] for o in outs] == greedy_outputs

    def test_greedy_rows_unaffected_by_sampled_rows_in_the_batch(self, engine, greedy_outputs):
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = engine.generate(PROMPTS + PROMPTS, [greedy] * 4 + [sampled(), sampled(seed=1), sampled(top_k=5), sampled(top_p=0.9)])
        assert [o["token_ids"] for o in outs[:4]] == greedy_outputs


class TestDistribution:
    def test_unseeded_samples_follow_softmax(self):
        torch.manual_seed(0)
        assert_follows(sample_counts(DIST, make_batch(N_SAMPLES)), DIST)

    def test_seeded_samples_with_distinct_seeds_follow_softmax(self):
        seeds = torch.arange(N_SAMPLES, dtype=torch.int64) * 1_000_003 + 17
        assert_follows(sample_counts(DIST, make_batch(N_SAMPLES, seeds=seeds)), DIST)

    def test_one_seed_across_positions_follows_softmax(self):
        seeds = torch.full((N_SAMPLES,), 2**40 + 5, dtype=torch.int64)
        positions = torch.arange(N_SAMPLES, dtype=torch.int64)
        assert_follows(sample_counts(DIST, make_batch(N_SAMPLES, seeds=seeds, positions=positions)), DIST)

    @pytest.mark.parametrize("seeded", [False, True])
    def test_temperature_sharpens_to_p_to_the_one_over_t(self, seeded):
        torch.manual_seed(1)
        seeds = torch.arange(N_SAMPLES) * 7919 + 3 if seeded else None
        expected = np.asarray(DIST) ** 2  # T = 0.5
        assert_follows(sample_counts(DIST, make_batch(N_SAMPLES, temperature=0.5, seeds=seeds)), expected.tolist())

    @pytest.mark.parametrize("kw, kept", [
        (dict(top_k=3), [3, 2, 4]),  # the three largest: 0.3, 0.2, 0.15
        (dict(top_p=0.6), [3, 2, 4]),  # 0.3 + 0.2 < 0.6, adding 0.15 reaches it
        (dict(min_p=0.5), [3, 2]),  # on DIST_MINP: the floor 0.5 * 0.3 keeps 0.3 and 0.2 only
    ], ids=["top_k", "top_p", "min_p"])
    def test_truncated_distribution_is_renormalised(self, kw, kept):
        torch.manual_seed(2)
        probs = DIST if "min_p" not in kw else DIST_MINP
        expected = [p if i in kept else 0.0 for i, p in enumerate(probs)]
        assert_follows(sample_counts(probs, make_batch(N_SAMPLES, **kw)), expected)


class TestTruncationSets:
    ROWS, REPEATS, VOCAB = 32, 64, 50

    def _logits(self, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(self.ROWS, self.VOCAB, generator=g) * 2).repeat_interleave(self.REPEATS, dim=0)

    @staticmethod
    def _nucleus(probs: torch.Tensor, top_p: float) -> list[set[int]]:
        """Per row: the most likely tokens until their mass reaches top_p (mass above < top_p)."""
        sets = []
        for row in probs:
            p_sorted, order = row.sort(descending=True)
            above = p_sorted.cumsum(0) - p_sorted
            sets.append(set(order[above < top_p].tolist()))
        return sets

    def _check(self, tokens: torch.Tensor, allowed: list[set[int]]) -> None:
        tokens = tokens.view(self.ROWS, self.REPEATS)
        for r in range(self.ROWS):
            got = set(tokens[r].tolist())
            assert got <= allowed[r], f"row {r}: sampled {got - allowed[r]} outside {allowed[r]}"
        distinct = sum(len(set(tokens[r].tolist())) > 1 for r in range(self.ROWS))
        assert distinct > self.ROWS // 2, "truncation left a single token almost everywhere"

    @pytest.mark.parametrize("seeded", [False, True])
    def test_top_k(self, seeded):
        torch.manual_seed(3)
        logits = self._logits(0)
        n = logits.shape[0]
        seeds = torch.arange(n) * 31 + 1 if seeded else None
        tokens = Sampler()(logits, make_batch(n, top_k=5, seeds=seeds)).token_ids
        allowed = [set(row.topk(5).indices.tolist()) for row in logits[:: self.REPEATS]]
        self._check(tokens, allowed)

    @pytest.mark.parametrize("seeded", [False, True])
    def test_top_p(self, seeded):
        torch.manual_seed(4)
        logits = self._logits(1)
        n = logits.shape[0]
        seeds = torch.arange(n) * 37 + 2 if seeded else None
        tokens = Sampler()(logits, make_batch(n, top_p=0.7, seeds=seeds)).token_ids
        self._check(tokens, self._nucleus(logits[:: self.REPEATS].softmax(-1), 0.7))

    def test_top_k_then_top_p_on_the_renormalised_top_k(self):
        torch.manual_seed(5)
        logits = self._logits(2)
        n = logits.shape[0]
        tokens = Sampler()(logits, make_batch(n, top_k=8, top_p=0.6)).token_ids
        rows = logits[:: self.REPEATS]
        kth = rows.topk(8).values[:, -1:]
        renorm = rows.masked_fill(rows < kth, float("-inf")).softmax(-1)
        self._check(tokens, self._nucleus(renorm, 0.6))

    def test_min_p(self):
        torch.manual_seed(6)
        logits = self._logits(3)
        n = logits.shape[0]
        tokens = Sampler()(logits, make_batch(n, min_p=0.2)).token_ids
        probs = logits[:: self.REPEATS].softmax(-1)
        allowed = [set(torch.nonzero(row >= 0.2 * row.max()).flatten().tolist()) for row in probs]
        self._check(tokens, allowed)

    def test_engine_top_k_samples_stay_in_the_models_top_k(self, engine, tiny_llama):
        from transformers import AutoModelForCausalLM

        prompt = engine.tokenizer.encode(PROMPTS[1])
        outs = engine.generate([prompt] * 24, sampled(top_k=3, max_tokens=1))
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
        with torch.no_grad():
            top3 = set(model(torch.tensor([prompt])).logits[0, -1].topk(3).indices.tolist())
        first = {o["token_ids"][0] for o in outs}
        assert first <= top3 and len(first) > 1


class TestPenalties:
    def _batch(self, logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
               rep: list[float], pres: list[float], freq: list[float]) -> SamplingBatch:
        b, v = logits.shape
        sb = make_batch(b)
        sb.prompt_mask = torch.zeros(b, v, dtype=torch.bool)
        sb.output_counts = torch.zeros(b, v)
        for r in range(b):
            sb.prompt_mask[r, prompt_ids[r]] = True
            for t in output_ids[r]:
                sb.output_counts[r, t] += 1
        sb.repetition_penalties = torch.tensor(rep)
        sb.presence_penalties = torch.tensor(pres)
        sb.frequency_penalties = torch.tensor(freq)
        return sb

    def test_documented_formulas_exactly(self):
        # token 0 in the prompt; outputs 1, 1, 3; token 2 and 4 unseen.
        logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 4)
        sb = self._batch(logits, [[0]] * 4, [[1, 1, 3]] * 4,
                         rep=[2.0, 1.0, 1.0, 2.0], pres=[0.0, 0.25, 0.0, 0.25], freq=[0.0, 0.0, 0.5, 0.5])
        out = apply_penalties(logits.clone(), sb)
        expected = torch.tensor([
            # repetition 2: positive logits of seen tokens (prompt or output) / 2, negative * 2
            [1.0, -2.0, 0.5, 1.5, -2.0],
            # presence 0.25: minus 0.25 for each token present in the output (not the prompt)
            [2.0, -1.25, 0.5, 2.75, -2.0],
            # frequency 0.5: minus 0.5 per output occurrence
            [2.0, -2.0, 0.5, 2.5, -2.0],
            # all three: repetition first, then frequency and presence
            [1.0, -2.0 - 1.0 - 0.25, 0.5, 1.5 - 0.5 - 0.25, -2.0],
        ])
        torch.testing.assert_close(out, expected, rtol=0, atol=0)

    def test_neutral_values_leave_logits_unchanged(self):
        logits = torch.randn(2, 30)
        sb = self._batch(logits, [[1, 2], [3]], [[4, 4, 5], []], rep=[1.0, 1.0], pres=[0.0, 0.0], freq=[0.0, 0.0])
        torch.testing.assert_close(apply_penalties(logits.clone(), sb), logits, rtol=0, atol=0)

    def test_negative_presence_and_frequency_encourage_repeats(self):
        logits = torch.zeros(1, 4)
        sb = self._batch(logits, [[0]], [[2, 2]], rep=[1.0], pres=[-1.0], freq=[-0.5])
        torch.testing.assert_close(apply_penalties(logits, sb), torch.tensor([[0.0, 0.0, 2.0, 0.0]]))

    def test_sampler_applies_penalties_before_picking(self):
        logits = torch.tensor([[5.0, 4.0, 1.0]])
        sb = self._batch(logits, [[]], [[0]], rep=[1.0], pres=[0.0], freq=[2.0])
        sb.all_greedy = True
        assert Sampler()(logits, sb).token_ids.tolist() == [1]

    @pytest.fixture(scope="class")
    @classmethod
    def base(cls, engine):
        return engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))

    @pytest.mark.parametrize("kw", [dict(repetition_penalty=1.5), dict(frequency_penalty=1.0),
                                    dict(presence_penalty=1.0)], ids=lambda kw: next(iter(kw)))
    def test_engine_penalties_reduce_repeats(self, engine, base, kw):
        def repeats(outs):
            return sum(len(o["token_ids"]) - len(set(o["token_ids"])) for o in outs)

        penalised = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw))
        assert repeats(base) >= 10, "the tiny model no longer repeats itself; pick other prompts"
        assert repeats(penalised) < repeats(base) / 2


class TestLogprobs:
    @pytest.fixture(scope="class")
    @classmethod
    def hf_model(cls, tiny_llama):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()

    def _hf_logprobs(self, model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
        n = len(prompt_ids)
        return logits[n - 1 : n - 1 + len(output_ids)].log_softmax(-1)  # row j scores output j

    def test_chosen_and_top_logprobs_match_hf(self, engine, hf_model):
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
        params = [sampled(seed=5, max_tokens=6, logprobs=5), sampled(seed=6, max_tokens=6, logprobs=2),
                  SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)]
        outs = engine.generate(prompts, params)
        for prompt, sp, out in zip(prompts, params, outs):
            assert len(out["logprobs"]) == len(out["token_ids"]) == 6
            ref = self._hf_logprobs(hf_model, prompt, out["token_ids"])
            for j, (tok, (chosen, top)) in enumerate(zip(out["token_ids"], out["logprobs"])):
                assert chosen == pytest.approx(ref[j, tok].item(), abs=1e-4)
                assert len(top) == sp.logprobs
                values = list(top.values())
                assert values == sorted(values, reverse=True)
                if sp.logprobs:
                    ref_top = ref[j].topk(sp.logprobs)
                    assert list(top) == ref_top.indices.tolist()
                    assert values == pytest.approx(ref_top.values.tolist(), abs=1e-4)
            if sp.temperature == 0:  # greedy picks the most likely token
                assert all(chosen == pytest.approx(ref[j].max().item(), abs=1e-4)
                           for j, (chosen, _) in enumerate(out["logprobs"]))

    def test_sampled_tokens_are_not_always_the_top_one(self, engine):
        out = engine.generate([PROMPTS[0]], sampled(seed=8, max_tokens=8, logprobs=1))[0]
        assert any(tok not in top for tok, (_, top) in zip(out["token_ids"], out["logprobs"]))

    def test_no_logprobs_unless_asked(self, engine):
        out = engine.generate([PROMPTS[0]], sampled(max_tokens=2))[0]
        assert out["logprobs"] is None


def test_hashed_uniforms_stay_strictly_inside_the_unit_interval():
    from atom_core.model_ops.sampler import unit_interval

    u = unit_interval(torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 512, 2**32 - 1], dtype=torch.int64))
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert bool((-torch.log(u) > 0).all())  # Exp(1) noise never 0, so p / E is never NaN
