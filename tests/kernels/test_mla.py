"""MLA attention over the paged latent cache: the Triton kernel against the torch reference
(on a GPU with the `gpu` marker; on the CPU under TRITON_INTERPRET=1 with small shapes), and
the absorbed form against HF's expanded form (always, on the CPU).

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_mla.py -q
"""
from __future__ import annotations

import pytest
import torch

from atom_core.kernels import mla_ref
from tests.kernels.tolerances import TOL, rel_err


def make_batch(q_lens, ctx_lens, num_heads, latent, rope, block_size, dtype, device, seed):
    """Sequence s: ctx_lens[s] cached tokens before q_lens[s] new ones (all already in the
    cache, as the backend stores before attending); blocks shuffled across sequences."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq)
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    cache = torch.randn(num_blocks, block_size, 1, latent + rope, generator=gen)
    num_tokens = sum(q_lens)
    q_latent = torch.randn(num_tokens, num_heads, latent, generator=gen) * 0.3
    q_rope = torch.randn(num_tokens, num_heads, rope, generator=gen) * 0.3
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    to = dict(dtype=dtype, device=device)
    return (q_latent.to(**to), q_rope.to(**to), cache.to(**to), tables.to(device), qsl.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), (latent + rope) ** -0.5,
            max(q_lens), max(seq_lens))


def reference(args):
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    return mla_ref.mla_attention(*cpu)


CASES = {  # name: (q_lens, ctx_lens)
    "decode_ctx1": ([1, 1, 1], [0, 5, 17]),
    "decode_over_blocks": ([1] * 5, [40, 3, 70, 16, 33]),
    "prefill_and_decode": ([9, 1, 20, 1], [0, 30, 13, 0]),
}


class TestTritonMatchesReference:
    @pytest.mark.parametrize("case", sorted(CASES))
    @pytest.mark.parametrize("splits", [1, 3])
    def test_fp32(self, device, case, splits):
        from atom_core.kernels.triton.mla import launch_mla_attention

        q_lens, ctx_lens = CASES[case]
        args = make_batch(q_lens, ctx_lens, 4, 32, 16, 16, torch.float32, device, seed=len(case) + splits)
        out = launch_mla_attention(*args, num_kv_splits=splits)
        assert rel_err(out.cpu(), reference(args)) < TOL[torch.float32]

    def test_bf16_heads_not_a_power_of_two(self, device):
        from atom_core.kernels.triton import mla_attention

        args = make_batch([1, 1, 6], [20, 1, 9], 6, 32, 16, 8, torch.bfloat16, device, seed=7)
        assert rel_err(mla_attention(*args).cpu(), reference(args)) < TOL[torch.bfloat16]

    def test_rejects_a_cache_of_the_wrong_width(self, device):
        from atom_core.kernels.triton import mla_attention

        args = list(make_batch([1], [3], 4, 32, 16, 16, torch.float32, device, seed=1))
        args[2] = args[2][..., :40]
        with pytest.raises(ValueError, match="kv_cache"):
            mla_attention(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestOnGPU:
    """Real shapes (V2-Lite: 16 heads, 512 + 64): batch, context 1 and many blocks, splits on/off."""

    @pytest.mark.parametrize("splits", [None, 1, 4])
    @pytest.mark.parametrize("num_heads", [16, 128])
    def test_decode_real_shapes(self, splits, num_heads):
        from atom_core.kernels.triton.mla import launch_mla_attention

        args = make_batch([1] * 8, [0, 1, 15, 16, 17, 300, 1000, 2047], num_heads, 512, 64, 16, torch.bfloat16,
                          "cuda", seed=3)
        out = launch_mla_attention(*args, num_kv_splits=splits)
        assert rel_err(out.cpu(), reference(args)) < TOL[torch.bfloat16]

    def test_prefill_chunks_real_shapes(self):
        from atom_core.kernels.triton import mla_attention

        args = make_batch([100, 1, 37], [0, 500, 64], 16, 512, 64, 16, torch.bfloat16, "cuda", seed=4)
        assert rel_err(mla_attention(*args).cpu(), reference(args)) < TOL[torch.bfloat16]

    def test_graph_replay_equals_eager(self):
        from atom_core.kernels.triton import mla_attention

        args = make_batch([1] * 4, [10, 200, 33, 700], 16, 512, 64, 16, torch.bfloat16, "cuda", seed=5)
        eager = mla_attention(*args)
        out = torch.empty_like(eager)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            mla_attention(*args, out=out)  # warm-up compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mla_attention(*args, out=out)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


class TestAbsorbedEqualsExpanded:
    def test_reference_absorbed_equals_expanded(self):
        """q_latent = q_nope @ W_UK and out = o_latent @ W_UV^T give HF's expanded attention."""
        gen = torch.Generator().manual_seed(0)
        heads, nope, rope, v_dim, latent = 4, 8, 16, 12, 32
        q_lens, ctx_lens = [5, 1, 1], [0, 20, 40]
        args = make_batch(q_lens, ctx_lens, heads, latent, rope, 16, torch.float32, "cpu", seed=2)
        _, q_rope, cache, tables, qsl, seq_lens, _, max_q, max_s = args
        scale = 0.17
        q_nope = torch.randn(q_rope.shape[0], heads, nope, generator=gen)
        w = torch.randn(heads * (nope + v_dim), latent, generator=gen) * 0.2
        w_heads = w.view(heads, nope + v_dim, latent)
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_heads[:, :nope])
        o_latent = mla_ref.mla_attention(q_latent, q_rope, cache, tables, qsl, seq_lens, scale, max_q, max_s)
        absorbed = torch.einsum("thc,hvc->thv", o_latent, w_heads[:, nope:])
        expanded = mla_ref.mla_expanded_reference(q_nope, q_rope, cache, w, tables, qsl, seq_lens, scale)
        torch.testing.assert_close(absorbed, expanded, rtol=1e-4, atol=1e-5)
