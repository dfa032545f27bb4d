"""gumbel_argmax (Triton) against torch.argmax, the torch reference and softmax(l / T).

Runs like tests/kernels/test_triton_kernels.py:
  * on a CUDA GPU (the `cuda` cases carry the `gpu` marker);
  * on the CPU under Triton's interpreter, with small shapes and few draws (it runs about
    20 ms a program), only when pytest was started with TRITON_INTERPRET=1:
        TRITON_INTERPRET=1 python -m pytest tests/kernels/test_sampling_kernel.py -q

Distribution tests draw with fixed seeds, so they are deterministic; P_VALUE is strict enough
that a correct kernel cannot fail by chance in practice, and each test also checks that a
wrong temperature's distribution is rejected, so the test has the power to catch one.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

triton = pytest.importorskip("triton")

from atom_core.kernels import torch_ref  # noqa: E402
from atom_core.kernels import triton as tk  # noqa: E402
from atom_core.model_ops.sampler import Sampler, SamplingBatch  # noqa: E402

P_VALUE = 1e-4
NEG = float("-inf")


def temps(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def draw_counts(row: torch.Tensor, temperature: float, draws: int, seeds: list[int], num_buckets: int,
                bucket_of=None) -> np.ndarray:
    """Counts of `draws` samples of one logits row: the row repeated (stride 0) in a batch,
    one call per seed; each row of a call gets its own noise."""
    batch = row.unsqueeze(0).expand(draws // len(seeds), -1)
    t = torch.full((batch.shape[0],), temperature, device=row.device)
    ids = torch.cat([tk.gumbel_argmax(batch, t, seed, offset=7) for seed in seeds]).cpu()
    if bucket_of is not None:
        ids = bucket_of(ids)
    return np.bincount(ids.numpy(), minlength=num_buckets)


def p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    assert counts[probs == 0].sum() == 0, f"sampled outside the support: {counts}"
    keep = probs > 0
    return chisquare(counts[keep], probs[keep] / probs[keep].sum() * counts.sum()).pvalue


def softmax(logits: torch.Tensor, temperature: float) -> np.ndarray:
    return torch.softmax(logits.double().cpu() / temperature, dim=-1).numpy()


class TestGreedyRows:
    SHAPES = {"cpu": [(1, 7), (3, 1000), (2, 2500), (4, 4096)],
              "cuda": [(1, 7), (1, 151936), (5, 151936), (64, 32000), (256, 128256), (3, 1025)]}

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("splits", [None, 1, 3])
    def test_equal_torch_argmax(self, device, dtype, splits):
        gen = torch.Generator().manual_seed(splits or 0)
        for rows, vocab in self.SHAPES[device]:
            # bf16/fp16 rounding makes ties: the lowest index must win, as in torch.argmax.
            logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype=dtype, device=device)
            out = tk.gumbel_argmax(logits, torch.zeros(rows, device=device), seed=1, offset=2, num_splits=splits)
            assert out.dtype == torch.int64
            assert torch.equal(out, logits.float().argmax(dim=-1)), (rows, vocab)

    @pytest.mark.parametrize("splits", [None, 2])
    def test_ties_across_splits_keep_the_lowest_index(self, device, splits):
        logits = torch.zeros(3, 3000, device=device)
        logits[0, [2999, 1500, 1024]] = 1.0
        logits[1, [2048, 1023]] = 5.0
        out = tk.gumbel_argmax(logits, torch.zeros(3, device=device), seed=0, offset=0, num_splits=splits)
        assert out.tolist() == [1024, 1023, 0]

    def test_strided_rows(self, device):
        gen = torch.Generator().manual_seed(5)
        wide = torch.randn(6, 3000 + 40, generator=gen).to(device)
        for logits in (wide[:, 16:3016], wide[::2, :2500]):  # row stride != V; misaligned start
            out = tk.gumbel_argmax(logits, torch.zeros(logits.shape[0], device=device), seed=3, offset=0)
            assert torch.equal(out, logits.argmax(dim=-1))

    def test_negative_temperature_counts_as_greedy(self, device):
        logits = torch.randn(2, 600, generator=torch.Generator().manual_seed(1)).to(device)
        out = tk.gumbel_argmax(logits, temps([-1.0, 0.0], device), seed=3, offset=0)
        assert torch.equal(out, logits.argmax(dim=-1))


class TestMixedBatch:
    def test_greedy_and_dominant_rows_match_argmax_and_reference(self, device):
        gen = torch.Generator().manual_seed(11)
        vocab = 2100 if device == "cpu" else 151936
        logits = torch.randn(6, vocab, generator=gen)
        dominant = [1, 4]  # sampled rows where one logit leads by 60: it wins with certainty
        logits[dominant, [77, vocab - 1]] += 60.0
        logits = logits.to(device=device, dtype=torch.bfloat16)
        t = temps([0.0, 1.0, 0.0, 0.7, 1.5, 0.0], device)
        out = tk.gumbel_argmax(logits, t, seed=123, offset=4)
        ref = torch_ref.gumbel_argmax(logits, t, seed=123, offset=4)
        exact = [0, 2, 5] + dominant
        assert torch.equal(out[exact], logits.float().argmax(dim=-1)[exact])
        assert torch.equal(out[exact], ref[exact])


class TestMasking:
    def test_minus_inf_is_never_sampled(self, device):
        gen = torch.Generator().manual_seed(2)
        vocab = 300
        row = torch.randn(vocab, generator=gen)
        masked = torch.rand(vocab, generator=gen) < 0.5
        row[masked] = NEG
        rows = row.to(device).unsqueeze(0).expand(64, -1)
        out = tk.gumbel_argmax(rows, torch.full((64,), 5.0, device=device), seed=9, offset=1).cpu()
        assert not masked[out].any()
        assert len(set(out.tolist())) > 10, "high temperature should spread the samples"

    def test_all_minus_inf_row_gives_zero_and_single_finite_logit_wins(self, device):
        logits = torch.full((4, 2500), NEG, device=device)
        logits[2, 1999] = -1e30
        logits[3, 2400] = 0.0
        out = tk.gumbel_argmax(logits, temps([0.0, 1.0, 3.0, 1.0], device), seed=1, offset=1, num_splits=3)
        assert out.tolist() == [0, 0, 1999, 2400]


class TestDistribution:
    # (draws, seeds) per device: the interpreter affords a few hundred draws.
    DRAWS = {"cpu": (400, [1, 2]), "cuda": (200_000, [1, 2, 3, 4])}

    def test_small_vocab_follows_softmax_at_temperature(self, device):
        draws, seeds = self.DRAWS[device]
        probs_at_t = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.15, 0.1, 0.07, 0.03])
        temperature = 0.5
        logits = (probs_at_t.log() * temperature + 3.0).to(device)  # softmax(l / 0.5) = probs_at_t
        counts = draw_counts(logits, temperature, draws, seeds, len(probs_at_t))
        assert p_value(counts, softmax(logits, temperature)) > P_VALUE, counts
        # Negative control: the same counts are rejected against a wrong temperature.
        assert p_value(counts, softmax(logits, temperature / 2)) < P_VALUE, counts
        if device == "cuda":
            for wrong in (0.8 * temperature, 1.25 * temperature):
                assert p_value(counts, softmax(logits, wrong)) < P_VALUE, (wrong, counts)

    @pytest.mark.gpu
    def test_random_vocab_50_follows_softmax(self):
        logits = torch.randn(50, generator=torch.Generator().manual_seed(3)).cuda()
        counts = draw_counts(logits, 0.8, 200_000, [5, 6, 7, 8], 50)
        assert p_value(counts, softmax(logits, 0.8)) > P_VALUE
        assert p_value(counts, softmax(logits, 0.9)) < P_VALUE

    def test_large_vocab_with_mass_on_few_tokens(self, device):
        # Three tokens (in different chunks, one in the ragged tail) hold 80%; the other
        # V - 3 tokens share 20%, which tests that the long tail is sampled at its weight.
        draws, seeds = (200, [3]) if device == "cpu" else (65_536, [1, 2, 3, 4])
        vocab = 2500 if device == "cpu" else 151936
        heads = [5, 1100, vocab - 3]
        temperature = 1.3
        probs = torch.full((vocab,), 0.2 / (vocab - 3), dtype=torch.float64)
        probs[heads] = torch.tensor([0.4, 0.25, 0.15], dtype=torch.float64)
        logits = (probs.log() * temperature).float().to(device)

        def bucket_of(ids: torch.Tensor) -> torch.Tensor:  # heads -> 0, 1, 2; the rest -> 3
            out = torch.full_like(ids, 3)
            for i, h in enumerate(heads):
                out[ids == h] = i
            return out

        def bucket_probs(temperature: float) -> np.ndarray:
            p = softmax(logits, temperature)
            return np.array([*p[heads], 1.0 - p[heads].sum()])

        counts = draw_counts(logits, temperature, draws, seeds, 4, bucket_of)
        assert p_value(counts, bucket_probs(temperature)) > P_VALUE, counts
        assert p_value(counts, bucket_probs(temperature / 2)) < P_VALUE, counts
        if device == "cuda":
            assert p_value(counts, bucket_probs(1.1 * temperature)) < P_VALUE, counts


class TestDeterminism:
    def _sample(self, device, seed, offset, splits=None):
        logits = torch.randn(8, 3000, generator=torch.Generator().manual_seed(0)).to(device)
        return tk.gumbel_argmax(logits, torch.ones(8, device=device), seed=seed, offset=offset,
                                num_splits=splits)

    def test_same_seed_and_offset_repeat_and_others_differ(self, device):
        first = self._sample(device, seed=2**40 + 5, offset=3)
        assert torch.equal(first, self._sample(device, seed=2**40 + 5, offset=3))
        assert not torch.equal(first, self._sample(device, seed=6, offset=3))
        assert not torch.equal(first, self._sample(device, seed=2**40 + 5, offset=4))
        assert not torch.equal(first, self._sample(device, seed=2**40 + 5, offset=3 + 2**33))

    def test_noise_does_not_depend_on_the_split(self, device):
        assert torch.equal(self._sample(device, 1, 1, splits=1), self._sample(device, 1, 1, splits=3))

    def test_repeated_rows_get_independent_noise(self, device):
        row = torch.zeros(1, 1000, device=device).expand(32, -1)
        out = tk.gumbel_argmax(row, torch.ones(32, device=device), seed=4, offset=0)
        assert len(set(out.tolist())) > 25  # uniform over 1000: repeats are rare


class TestArguments:
    def test_rejects_bad_inputs(self, device):
        logits = torch.zeros(2, 10, device=device)
        with pytest.raises(ValueError, match="temperatures"):
            tk.gumbel_argmax(logits, torch.zeros(2, dtype=torch.float64, device=device), 0, 0)
        with pytest.raises(ValueError, match="temperatures"):
            tk.gumbel_argmax(logits, torch.zeros(3, device=device), 0, 0)
        with pytest.raises(ValueError, match="dtype"):
            tk.gumbel_argmax(logits.long(), torch.zeros(2, device=device), 0, 0)
        with pytest.raises(ValueError, match="contiguous"):
            tk.gumbel_argmax(logits.t(), torch.zeros(10, device=device), 0, 0)

    def test_empty_batch(self, device):
        out = tk.gumbel_argmax(torch.zeros(0, 10, device=device), torch.zeros(0, device=device), 0, 0)
        assert out.shape == (0,) and out.dtype == torch.int64


@pytest.mark.gpu
def test_replays_in_cuda_graph():
    """Captured once and replayed: proves the wrapper never syncs with the host. The graph
    freezes seed and offset, so a replay equals an eager call with the same arguments."""
    logits = torch.randn(16, 151936, device="cuda", dtype=torch.bfloat16)
    t = torch.linspace(0.0, 1.5, 16, device="cuda")
    torch.cuda.synchronize()
    tk.gumbel_argmax(logits, t, seed=5, offset=9)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.gumbel_argmax(logits, t, seed=5, offset=9)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    assert torch.equal(out, tk.gumbel_argmax(logits, t, seed=5, offset=9))
    assert torch.equal(out[0], logits[0].float().argmax())


def sampling_batch(temperatures: torch.Tensor, **kw) -> SamplingBatch:
    greedy = temperatures == 0
    return SamplingBatch(temperatures=temperatures, top_ks=None, top_ps=None, min_ps=None, seeds=None,
                         positions=None, all_greedy=bool(greedy.all()), any_greedy=bool(greedy.any()), **kw)


@pytest.mark.gpu
class TestSamplerFusedPath:
    """model_ops.Sampler on CUDA: temperature-only batches go through the kernel."""

    def test_greedy_rows_exact_and_fresh_noise_per_call(self):
        logits = torch.randn(8, 151936, device="cuda", dtype=torch.bfloat16)
        t = temps([0.0, 1.0, 0.0, 0.8, 1.2, 0.0, 1.0, 1.0], "cuda")
        sampler = Sampler()
        first = sampler(logits, sampling_batch(t)).token_ids
        second = sampler(logits, sampling_batch(t)).token_ids
        assert sampler.philox_offset == 2
        greedy = [0, 2, 5]
        assert torch.equal(first[greedy], logits.float().argmax(dim=-1)[greedy])
        assert torch.equal(second[greedy], first[greedy])
        assert not torch.equal(first, second)

    def test_bf16_logits_follow_softmax(self):
        probs = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.15, 0.1, 0.07, 0.03])
        logits = (probs.log() * 0.7).to(device="cuda", dtype=torch.bfloat16)
        sampler = Sampler()
        rows = logits.unsqueeze(0).expand(50_000, -1)
        batch = sampling_batch(torch.full((50_000,), 0.7, device="cuda"))
        ids = torch.cat([sampler(rows, batch).token_ids for _ in range(4)]).cpu()
        counts = np.bincount(ids.numpy(), minlength=8)
        assert p_value(counts, softmax(logits.float(), 0.7)) > P_VALUE
        assert p_value(counts, softmax(logits.float(), 0.8)) < P_VALUE

    def test_seeded_and_truncated_batches_keep_the_torch_path(self):
        logits = torch.randn(4, 1000, device="cuda")
        sampler = Sampler()
        plain = sampling_batch(torch.ones(4, device="cuda"))
        seeded = replace(plain, seeds=torch.arange(4, device="cuda"),
                         positions=torch.zeros(4, dtype=torch.int64, device="cuda"))
        sampler(logits, seeded)
        sampler(logits, replace(plain, top_ps=torch.full((4,), 0.9, device="cuda")))
        assert sampler.philox_offset == 0


class TestTorchReference:
    """The reference itself, on the CPU (no interpreter needed)."""

    def test_greedy_rows_and_distribution(self):
        probs = torch.tensor([0.05, 0.1, 0.2, 0.3, 0.15, 0.1, 0.07, 0.03])
        logits = (probs.log() * 0.5).unsqueeze(0).expand(20_000, -1)
        t = torch.full((20_000,), 0.5)
        t[:10] = 0.0
        out = torch_ref.gumbel_argmax(logits, t, seed=1, offset=0)
        assert (out[:10] == 3).all()
        counts = np.bincount(out[10:].numpy(), minlength=8)
        assert p_value(counts, probs.double().numpy()) > P_VALUE
        assert p_value(counts, softmax(logits[0], 0.25)) < P_VALUE

    def test_seed_and_offset_pick_the_stream(self):
        logits = torch.zeros(4, 1000)
        t = torch.ones(4)
        first = torch_ref.gumbel_argmax(logits, t, seed=1, offset=0)
        assert torch.equal(first, torch_ref.gumbel_argmax(logits, t, seed=1, offset=0))
        assert not torch.equal(first, torch_ref.gumbel_argmax(logits, t, seed=1, offset=1))
