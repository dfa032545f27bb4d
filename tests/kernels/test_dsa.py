"""DeepSeek Sparse Attention kernels: the Triton indexer scores, top-k and sparse MLA against the
torch references of kernels/dsa_ref.py (on a GPU with the `gpu` marker; on the CPU under
TRITON_INTERPRET=1 with small shapes), and the references' own contract (selection order,
padding, sparse-over-everything equals dense MLA).

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_dsa.py -q
"""
from __future__ import annotations

import pytest
import torch

from atom_core.kernels import dsa_ref, mla_ref
from tests.kernels.tolerances import TOL, rel_err
from tests.kernels.test_mla import make_batch

CASES = {  # name: (q_lens, ctx_lens)
    "decode": ([1, 1, 1, 1], [0, 5, 40, 70]),
    "prefill_and_decode": ([9, 1, 20, 1], [0, 30, 13, 0]),
}


def index_batch(q_lens, ctx_lens, heads, dim, block_size, dtype, device, seed):
    """The MLA batch of test_mla (shuffled block tables) plus indexer queries, weights and keys."""
    args = make_batch(q_lens, ctx_lens, 4, 32, 16, block_size, dtype, device, seed)
    tables, qsl, seq_lens, max_q, max_s = args[3], args[4], args[5], args[7], args[8]
    gen = torch.Generator().manual_seed(seed + 100)
    num_tokens, num_blocks = sum(q_lens), args[2].shape[0]
    to = dict(dtype=dtype, device=device)
    index_q = torch.randn(num_tokens, heads, dim, generator=gen).to(**to)
    weights = torch.randn(num_tokens, heads, generator=gen).to(device)
    index_cache = torch.randn(num_blocks, block_size, 1, dim, generator=gen).to(**to)
    return args, (index_q, weights, index_cache, tables, qsl, seq_lens, dim ** -0.5, max_s, max_q)


def cpu(args):
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]


def owned_rows(qsl) -> int:
    return int(qsl[-1])


class TestIndexScores:
    @pytest.mark.parametrize("case", sorted(CASES))
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_matches_reference(self, device, case, dtype):
        from atom_core.kernels.triton import dsa_index_scores

        _, iargs = index_batch(*CASES[case], 4, 32, 16, dtype, device, seed=3)
        out = dsa_index_scores(*iargs).cpu()
        ref = dsa_ref.dsa_index_scores(*cpu(iargs))
        assert torch.equal(out.isinf(), ref.isinf())  # the same causal pattern of -inf
        finite = ref.isfinite()
        assert rel_err(out[finite], ref[finite]) < TOL[dtype]

    def test_rejects_weights_of_the_wrong_shape(self, device):
        from atom_core.kernels.triton import dsa_index_scores

        _, iargs = index_batch([1], [3], 4, 32, 16, torch.float32, device, seed=1)
        iargs = list(iargs)
        iargs[1] = iargs[1][:, :3]
        with pytest.raises(ValueError, match="weights"):
            dsa_index_scores(*iargs)


class TestTopk:
    @pytest.mark.parametrize("case", sorted(CASES))
    @pytest.mark.parametrize("k", [1, 8, 40])
    def test_matches_reference(self, device, case, k):
        """Rows seeing fewer than k tokens keep them all (k 40); ties go to the lower position."""
        from atom_core.kernels.triton import dsa_topk

        _, iargs = index_batch(*CASES[case], 4, 32, 16, torch.float32, device, seed=5)
        scores = dsa_ref.dsa_index_scores(*cpu(iargs))
        scores[:, 3:9] = scores[:, 3:9].round()  # ties (and zeros from relu) at the threshold
        scores = torch.where(torch.isinf(dsa_ref.dsa_index_scores(*cpu(iargs))), scores.new_tensor(float("-inf")),
                             scores)
        tables, qsl, seq_lens = iargs[3], iargs[4], iargs[5]
        out = dsa_topk(scores.to(device), k, tables, qsl, seq_lens, 16, iargs[8]).cpu()
        ref = dsa_ref.dsa_topk(scores, k, *cpu([tables, qsl, seq_lens]), 16)
        assert torch.equal(out, ref)


class TestReferenceContract:
    def test_topk_picks_the_best_visible_positions_ascending_and_pads(self):
        scores = torch.tensor([[5.0, 1.0, 7.0, 1.0, float("-inf"), float("-inf")],
                               [0.0, 0.0, 0.0, 2.0, 0.0, 9.0]])
        tables = torch.tensor([[3, 1]], dtype=torch.int32)  # block size 4: positions 4.. are in block 1
        qsl, seq_lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
        slots = dsa_ref.dsa_topk(scores, 3, tables, qsl, seq_lens, 4)
        # row 0: 7 (pos 2), 5 (pos 0), then the tie at 1.0 goes to pos 1; row 1: 9, 2, first 0
        assert slots.tolist() == [[12, 13, 14], [12, 15, 5]]
        assert dsa_ref.dsa_topk(scores[:1, :3], 5, tables, torch.tensor([0, 1], dtype=torch.int32),
                                torch.tensor([3], dtype=torch.int32), 4).tolist() == [[12, 13, 14, -1, -1]]

    def test_sparse_over_every_visible_slot_is_dense_mla(self):
        args = make_batch([9, 1, 20, 1], [0, 30, 13, 0], 4, 32, 16, 16, torch.float32, "cpu", seed=2)
        tables, qsl, seq_lens = args[3], args[4], args[5]
        num_tokens, num_blocks = args[0].shape[0], args[2].shape[0]
        scores = dsa_ref.dsa_index_scores(torch.ones(num_tokens, 1, 16), torch.ones(num_tokens, 1),
                                          torch.ones(num_blocks, 16, 1, 16), tables, qsl, seq_lens, 1.0,
                                          int(seq_lens.max()))
        slots = dsa_ref.dsa_topk(scores, 64, tables, qsl, seq_lens, 16)
        sparse = dsa_ref.mla_sparse_attention(args[0], args[1], args[2], slots, args[6])
        assert rel_err(sparse, mla_ref.mla_attention(*args)) < 1e-5


class TestSparseMLA:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_matches_reference(self, device, dtype):
        from atom_core.kernels.triton import mla_sparse_attention

        args, iargs = index_batch([9, 1, 20, 1], [0, 30, 13, 0], 4, 32, 16, dtype, device, seed=9)
        scores = dsa_ref.dsa_index_scores(*cpu(iargs))
        slots = dsa_ref.dsa_topk(scores, 12, *cpu([iargs[3], iargs[4], iargs[5]]), 16)
        slots[-1] = -1  # a row with no slot at all: output 0
        out = mla_sparse_attention(args[0], args[1], args[2], slots.to(device), args[6], block_n=16).cpu()
        ref = dsa_ref.mla_sparse_attention(*cpu([args[0], args[1], args[2]]), slots, args[6])
        assert rel_err(out, ref) < TOL[dtype]
        assert not out[-1].any()

    def test_heads_not_a_power_of_two(self, device):
        from atom_core.kernels.triton import mla_sparse_attention

        args = make_batch([1, 3], [20, 9], 6, 32, 16, 8, torch.float32, device, seed=4)
        slots = torch.randint(-1, int(args[5].sum()), (4, 10), generator=torch.Generator().manual_seed(0))
        slots = slots.clamp(max=args[2].shape[0] * 8 - 1).to(torch.int32)
        out = mla_sparse_attention(args[0], args[1], args[2], slots.to(device), args[6], block_n=16).cpu()
        assert rel_err(out, dsa_ref.mla_sparse_attention(*cpu([args[0], args[1], args[2]]), slots, args[6])) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_shapes_decode_bf16():
    """DeepSeek-V3.2 shapes (128 heads, latent 512 + rope 64, indexer 64 x 128, top-2048) at
    batch 4 and 3000-token contexts: every kernel against its reference."""
    from atom_core.kernels.triton import dsa_index_scores, dsa_topk, mla_sparse_attention

    args = make_batch([1] * 4, [2999, 100, 2500, 3000], 128, 512, 64, 16, torch.bfloat16, "cuda", seed=11)
    tables, qsl, seq_lens, max_s = args[3], args[4], args[5], args[8]
    gen = torch.Generator(device="cuda").manual_seed(3)
    index_q = torch.randn(4, 64, 128, device="cuda", generator=gen).bfloat16()
    weights = torch.randn(4, 64, device="cuda", generator=gen)
    index_cache = torch.randn(args[2].shape[0], 16, 1, 128, device="cuda", generator=gen).bfloat16()
    iargs = (index_q, weights, index_cache, tables, qsl, seq_lens, 128 ** -0.5, max_s, 1)
    scores = dsa_index_scores(*iargs)
    ref_scores = dsa_ref.dsa_index_scores(*iargs)
    finite = ref_scores.isfinite()
    assert rel_err(scores[finite], ref_scores[finite]) < TOL[torch.bfloat16]
    slots = dsa_topk(ref_scores, 2048, tables, qsl, seq_lens, 16, 1)
    assert torch.equal(slots, dsa_ref.dsa_topk(ref_scores, 2048, tables, qsl, seq_lens, 16))
    out = mla_sparse_attention(args[0], args[1], args[2], slots, args[6])
    assert rel_err(out, dsa_ref.mla_sparse_attention(args[0], args[1], args[2], slots, args[6])) < TOL[torch.bfloat16]


def fp8_keys(index_cache: torch.Tensor, groups: int):
    """Keys [NB, BS, 1, D] -> e4m3 codes [NB, BS, G, D / G] and float32 scales [NB, BS, G]
    (amax / 448 per group, the store's quantization)."""
    from atom_core.kernels.torch_ref import quantize_per_token_head

    nb, bs, _, dim = index_cache.shape
    codes, scales = quantize_per_token_head(index_cache.reshape(nb * bs, groups, dim // groups), torch.float8_e4m3fn)
    return codes.view(nb, bs, groups, -1), scales.view(nb, bs, groups)


class TestFP8IndexScores:
    @pytest.mark.parametrize("dim,groups", [(32, 1), (256, 2)])
    def test_matches_reference(self, device, dim, groups):
        from atom_core.kernels.triton import dsa_index_scores

        _, iargs = index_batch(*CASES["prefill_and_decode"], 4, dim, 16, torch.float32, device, seed=5)
        codes, scales = fp8_keys(iargs[2], groups)
        iargs = (*iargs[:2], codes, *iargs[3:])
        out = dsa_index_scores(*iargs, index_scale_cache=scales).cpu()
        ref = dsa_ref.dsa_index_scores(*cpu(iargs), index_scale_cache=scales.cpu())
        assert torch.equal(out.isinf(), ref.isinf())
        finite = ref.isfinite()
        assert rel_err(out[finite], ref[finite]) < 1e-5

    def test_rotated_fp8_scores_stay_close_to_exact_and_keep_the_selection(self):
        """Hadamard-rotated e4m3 keys against the unquantized scores: within e4m3's relative
        step (2^-3 per value, averaged over the dot) and most of each row's top-8 kept."""
        _, iargs = index_batch([1, 1, 1], [40, 70, 90], 4, 32, 16, torch.float32, "cpu", seed=9)
        exact = dsa_ref.dsa_index_scores(*iargs)
        rotation = dsa_ref.hadamard_matrix(32)
        q, keys = iargs[0] @ rotation, iargs[2] @ rotation
        codes, scales = fp8_keys(keys, 1)
        fp8 = dsa_ref.dsa_index_scores(q, iargs[1], codes, *iargs[3:], index_scale_cache=scales)
        finite = exact.isfinite()
        assert torch.equal(fp8.isfinite(), finite)
        assert rel_err(fp8[finite], exact[finite]) < 2 ** -4
        overlap = [len(set(a.topk(8).indices.tolist()) & set(b.topk(8).indices.tolist())) for a, b in zip(exact, fp8)]
        assert min(overlap) >= 6, overlap

    def test_hadamard_is_orthogonal(self):
        h = dsa_ref.hadamard_matrix(64)
        assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
        with pytest.raises(ValueError, match="power-of-two"):
            dsa_ref.hadamard_matrix(48)

    def test_rejects_fp8_keys_without_scales(self, device):
        from atom_core.kernels.triton import dsa_index_scores

        _, iargs = index_batch([1], [3], 4, 32, 16, torch.float32, device, seed=1)
        codes, _ = fp8_keys(iargs[2], 1)
        with pytest.raises(ValueError, match="index_scale_cache"):
            dsa_index_scores(*iargs[:2], codes, *iargs[3:])

    def test_rejects_scale_groups_narrower_than_a_dot(self, device):
        from atom_core.kernels.triton import dsa_index_scores

        _, iargs = index_batch([1], [3], 4, 32, 16, torch.float32, device, seed=1)
        codes, scales = fp8_keys(iargs[2], 4)  # groups of 8 values
        with pytest.raises(ValueError, match="a scale group of 8 values"):
            dsa_index_scores(*iargs[:2], codes, *iargs[3:], index_scale_cache=scales)
