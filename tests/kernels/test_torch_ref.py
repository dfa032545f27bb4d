"""The torch reference kernels against independent naive implementations (CPU, normal CI).

torch_ref is the oracle for every Triton test, so it is itself checked here against code
written a different way: dense SDPA on unpaged K/V, complex-number rotation, float64 norms.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atom_core.kernels import torch_ref


def _scatter_to_pages(ks: list[torch.Tensor], vs: list[torch.Tensor], block_size: int, gen: torch.Generator):
    """Put each sequence's [L, KH, D] K and V into shuffled cache blocks; unused slots hold junk.

    Returns (k_cache, v_cache, block_tables), built by hand rather than with store_kv_cache.
    """
    blocks_per_seq = [-(-k.shape[0] // block_size) for k in ks]
    num_blocks, max_blocks = sum(blocks_per_seq) + 2, max(blocks_per_seq) + 1
    shape = (num_blocks, block_size, *ks[0].shape[1:])
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.zeros(len(ks), max_blocks, dtype=torch.int32)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    for s, (k, v) in enumerate(zip(ks, vs)):
        for j in range(blocks_per_seq[s]):
            block = free_blocks.pop()
            tables[s, j] = block
            rows = slice(j * block_size, (j + 1) * block_size)
            k_cache[block, :k[rows].shape[0]] = k[rows]
            v_cache[block, :v[rows].shape[0]] = v[rows]
    return k_cache, v_cache, tables


class TestPagedAttention:
    @pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
    @pytest.mark.parametrize("block_size", [4, 16])
    def test_matches_dense_causal_sdpa(self, num_heads, num_kv_heads, block_size):
        gen = torch.Generator().manual_seed(num_heads * 100 + block_size)
        head_dim, group = 32, num_heads // num_kv_heads
        q_lens, ctx_lens = [1, 9, 1, 30], [17, 0, 40, 25]  # decode, fresh prefill, prefix-cached chunk
        seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
        ks = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
        vs = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
        k_cache, v_cache, tables = _scatter_to_pages(ks, vs, block_size, gen)
        query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        out = torch.full_like(query, float("nan"))
        torch_ref.paged_attention(query, k_cache, v_cache, tables, qsl, torch.tensor(seq_lens, dtype=torch.int32),
                                  head_dim ** -0.5, max(q_lens), max(seq_lens), out=out)

        for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)):
            q = query[qsl[s]:qsl[s + 1]]
            for h in range(num_heads):
                k, v = ks[s][:, h // group], vs[s][:, h // group]
                # row i is position ctx + i and sees keys 0..ctx+i
                allowed = torch.arange(seq_lens[s])[None, :] <= (ctx + torch.arange(q_len))[:, None]
                expected = F.scaled_dot_product_attention(q[None, :, h], k[None], v[None], attn_mask=allowed[None])[0]
                torch.testing.assert_close(out[qsl[s]:qsl[s + 1], h], expected, rtol=1e-5, atol=1e-5)

    def test_empty_sequence_gives_zeros(self):
        # seq_len 0 (a CUDA-graph padding row): attention over nothing is defined as 0.
        query = torch.randn(1, 2, 16)
        cache = torch.randn(2, 4, 1, 16)
        out = torch_ref.paged_attention(query, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                        torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                        0.25, 1, 0)
        assert torch.equal(out, torch.zeros_like(out))

    def test_empty_sequence_among_decode_rows_gives_zeros(self):
        query = torch.randn(2, 2, 16)
        cache = torch.randn(2, 4, 1, 16)
        out = torch_ref.paged_attention(query, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                                        torch.tensor([0, 1, 2], dtype=torch.int32),
                                        torch.tensor([3, 0], dtype=torch.int32), 0.25, 1, 3)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


class TestRotaryEmbedding:
    @pytest.mark.parametrize("head_dim,rot_dim", [(16, 16), (32, 16)])
    def test_matches_complex_rotation(self, head_dim, rot_dim):
        gen = torch.Generator().manual_seed(head_dim + rot_dim)
        num_tokens, base = 7, 10000.0
        positions = torch.randint(0, 500, (num_tokens,), generator=gen)
        q = torch.randn(num_tokens, 3, head_dim, generator=gen)
        k = torch.randn(num_tokens, 1, head_dim, generator=gen)
        inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
        angles = torch.outer(torch.arange(500, dtype=torch.float64), inv_freq)
        cache = torch.cat((angles.cos(), angles.sin()), dim=-1).float()

        def rotate(x):  # neox pairs (i, i + rot/2) as the real and imaginary part
            half = rot_dim // 2
            z = torch.complex(x[..., :half].double(), x[..., half:rot_dim].double())
            z = z * torch.polar(torch.ones_like(angles[positions]), angles[positions])[:, None]
            return torch.cat((z.real, z.imag, x[..., rot_dim:].double()), dim=-1).float()

        out_q, out_k = torch_ref.rotary_embedding(positions, q, k, cache)
        torch.testing.assert_close(out_q, rotate(q), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out_k, rotate(k), rtol=1e-5, atol=1e-5)


class TestStoreKvCache:
    def test_writes_valid_slots_and_skips_negative(self):
        gen = torch.Generator().manual_seed(0)
        key, value = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
        k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
        slots = torch.tensor([0, -1, 6, 11, -1], dtype=torch.int32)
        torch_ref.store_kv_cache(key, value, k_cache, v_cache, slots)
        expected_k, expected_v = torch.zeros(12, 2, 8), torch.zeros(12, 2, 8)
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                expected_k[slot], expected_v[slot] = key[t], value[t]
        assert torch.equal(k_cache.view(12, 2, 8), expected_k)
        assert torch.equal(v_cache.view(12, 2, 8), expected_v)



class TestQkvRopeStore:
    @pytest.mark.parametrize("qk_norm", [False, True])
    def test_splits_norms_rotates_and_stores(self, qk_norm):
        gen = torch.Generator().manual_seed(int(qk_norm))
        heads, kv_heads, d, num_tokens = 4, 2, 16, 5
        qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * d, generator=gen)
        positions = torch.tensor([3, 0, 9, 4, 1])
        angles = torch.outer(torch.arange(16.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
        cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
        slots = torch.tensor([0, -1, 6, 11, 2])
        k_cache, v_cache = torch.zeros(3, 4, kv_heads, d), torch.zeros(3, 4, kv_heads, d)
        w = [torch.rand(d, generator=gen) + 0.5 for _ in range(2)] if qk_norm else [None, None]
        q = torch_ref.qkv_rope_store(qkv, positions, cache, k_cache, v_cache, slots, heads, *w, eps=1e-6)

        q_in, k_in, v_in = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q_in, k_in, v_in = q_in.view(-1, heads, d), k_in.view(-1, kv_heads, d), v_in.view(-1, kv_heads, d)
        if qk_norm:  # per-head RMSNorm by hand
            q_in = q_in / q_in.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w[0]
            k_in = k_in / k_in.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * w[1]
        want_q, want_k = torch_ref.rotary_embedding(positions, q_in, k_in, cache)
        torch.testing.assert_close(q, want_q)
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                torch.testing.assert_close(k_cache.view(12, kv_heads, d)[slot], want_k[t])
                assert torch.equal(v_cache.view(12, kv_heads, d)[slot], v_in[t])
        assert k_cache.view(12, kv_heads, d)[[1, 3, 4, 5, 7, 8, 9, 10]].abs().sum() == 0

    def test_rejects_lone_norm_weight(self):
        with pytest.raises(ValueError, match="go together"):
            torch_ref.qkv_rope_store(torch.zeros(1, 64), torch.zeros(1, dtype=torch.int64), torch.zeros(4, 16),
                                     torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16), torch.zeros(1, dtype=torch.int64),
                                     2, torch.ones(16), None)


class TestNormsAndActivation:
    def test_rms_norm_matches_float64(self):
        x, w = torch.randn(6, 64), torch.randn(64)
        expected = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
        torch.testing.assert_close(torch_ref.rms_norm(x, w, 1e-6), expected.float(), rtol=1e-5, atol=1e-5)

    def test_fused_add_rms_norm_returns_norm_of_sum_and_sum(self):
        x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
        normed, new_residual = torch_ref.fused_add_rms_norm(x, r, w, 1e-5)
        torch.testing.assert_close(new_residual, x + r)
        torch.testing.assert_close(normed, torch_ref.rms_norm(x + r, w, 1e-5))

    def test_silu_and_mul_matches_sigmoid_form(self):
        x = torch.randn(3, 2, 20)
        gate, up = x[..., :10], x[..., 10:]
        torch.testing.assert_close(torch_ref.silu_and_mul(x), gate * torch.sigmoid(gate) * up)
