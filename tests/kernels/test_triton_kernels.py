"""Triton kernels vs the torch reference on fresh random inputs.

Runs two ways:
  * on a CUDA GPU (the `cuda` cases carry the `gpu` marker);
  * on the CPU under Triton's interpreter, with small shapes, only when the pytest process was
    started with TRITON_INTERPRET=1 (it must be set before triton is imported):
        TRITON_INTERPRET=1 python -m pytest tests/kernels -q
"""
from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import pytest
import torch

triton = pytest.importorskip("triton")

from atom_core.kernels import torch_ref  # noqa: E402
from atom_core.kernels import triton as tk  # noqa: E402
from atom_core.kernels.triton.attention import choose_num_kv_splits, launch_paged_attention  # noqa: E402
from tests.kernels.tolerances import DTYPES, TOL, rel_err  # noqa: E402


def randn(gen: torch.Generator, *shape: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# paged attention


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [NB, BS, KH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, MB] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    max_query_len: int
    max_seq_len: int

    def args(self):
        scale = self.query.shape[-1] ** -0.5
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, scale, self.max_query_len, self.max_seq_len)


def ref_paged_attention(*args) -> torch.Tensor:
    """torch_ref.paged_attention on CPU copies: the reference builds its causal mask on the CPU
    (torch.arange without device=), so it cannot take CUDA tensors as of this writing."""
    cpu_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    return torch_ref.paged_attention(*cpu_args).to(args[0].device)


def make_paged_batch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                     device, seed, extra_tokens=0) -> PagedBatch:
    """Sequence s has ctx_lens[s] cached tokens and q_lens[s] new ones; blocks are shuffled and
    unused block-table entries point at random (wrong) blocks, so stray reads change results."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(q_lens, ctx_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    max_blocks = max(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.randint(0, num_blocks, (len(q_lens), max_blocks), generator=gen, dtype=torch.int32)
    start = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = perm[start:start + n].to(torch.int32)
        start += n
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    num_tokens = sum(q_lens) + extra_tokens
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return PagedBatch(
        query=randn(gen, num_tokens, num_heads, head_dim, dtype=dtype, device=device),
        k_cache=randn(gen, *cache_shape, dtype=dtype, device=device),
        v_cache=randn(gen, *cache_shape, dtype=dtype, device=device),
        block_tables=block_tables.to(device), query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )


# (q_lens, ctx_lens, H, KH, D, BS): q_len 1 rows are decode, others prefill chunks with context.
SMALL_CASES = {
    "mixed_gqa": ([1, 7, 1, 20], [30, 0, 5, 40], 4, 2, 64, 16),
    "decode_mqa": ([1, 1, 1], [50, 3, 17], 4, 1, 32, 16),
    "prefix_cached_prefill_mha": ([33], [48], 2, 2, 64, 32),
    "group3_d128": ([1, 5], [20, 10], 6, 2, 128, 16),
    "d256_block8": ([1, 3], [9, 40], 2, 1, 256, 8),
    "decode_d256_group8": ([1, 1], [150, 7], 8, 1, 256, 32),
}
LARGE_CASES = {
    "llama3_decode_b64": ([1] * 64, list(range(1, 4000, 63))[:64], 32, 8, 128, 16),
    "qwen3_decode_long": ([1] * 4, [4000, 3001, 77, 2048], 16, 8, 128, 32),
    "mixed_prefill_decode": ([1] * 12 + [300, 517, 64], [900 + 13 * i for i in range(12)] + [0, 1200, 3900],
                             32, 8, 128, 16),
    "prefill_2k_d64": ([2048], [0], 8, 2, 64, 16),
    "chunked_prefill_d256_mqa": ([129, 1], [3000, 4000], 8, 1, 256, 32),
    "mha_d64_block32": ([1, 40, 1], [700, 70, 4000], 12, 12, 64, 32),
    "decode_d256_gqa": ([1] * 6, [4000, 1, 17, 999, 2500, 64], 16, 2, 256, 16),
}


def _check_attention(case, dtype, device, splits_options, seed):
    batch = make_paged_batch(*case, dtype=dtype, device=device, seed=seed)
    ref = ref_paged_attention(*batch.args())
    for splits in splits_options:  # None: the wrapper's own heuristic
        out = torch.full_like(batch.query, float("nan"))
        launch_paged_attention(*batch.args(), out=out, num_kv_splits=splits)
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"rel err {err:.2e} (splits={splits})"


class TestPagedAttention:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("name", SMALL_CASES)
    def test_matches_reference(self, device, name, dtype):
        _check_attention(SMALL_CASES[name], dtype, device, [None, 1, 3], seed=zlib.crc32(f"{name}{dtype}".encode()))

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    @pytest.mark.parametrize("name", LARGE_CASES)
    def test_matches_reference_large(self, name, dtype):
        _check_attention(LARGE_CASES[name], dtype, "cuda", [None, 1, 8], seed=len(name))

    @pytest.mark.parametrize("splits", [1, 2])
    def test_empty_sequence_rows_give_zeros_and_padding_rows_stay_untouched(self, device, splits):
        # CUDA-graph padding: a seq_len-0 decode row, plus 3 trailing rows owned by no sequence.
        batch = make_paged_batch([1, 1, 1], [10, -1, 5], 4, 2, 32, 16, torch.float32, device, seed=5,
                                 extra_tokens=3)
        out = torch.full_like(batch.query, float("nan"))
        launch_paged_attention(*batch.args(), out=out, num_kv_splits=splits)
        ref = ref_paged_attention(*batch.args())
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # attention over nothing is 0
        assert rel_err(out[0::2][:2], ref[0::2][:2]) < 1e-4  # the two real rows, 0 and 2
        assert out[3:].isnan().all()

    @pytest.mark.parametrize("splits", [1, 3])
    def test_sequence_order_changes_nothing_but_the_schedule(self, device, splits):
        batch = make_paged_batch([1, 1, 4, 1, 1], [90, 3, 20, 40, 0], 4, 2, 64, 16, torch.float32, device, seed=9)
        plain = torch.full_like(batch.query, float("nan"))
        launch_paged_attention(*batch.args(), out=plain, num_kv_splits=splits)
        order = torch.argsort(batch.seq_lens, descending=True).to(torch.int32)
        ordered = torch.full_like(batch.query, float("nan"))
        launch_paged_attention(*batch.args(), out=ordered, num_kv_splits=splits, seq_order=order)
        assert torch.equal(ordered, plain)
        inner = torch.full_like(batch.query, float("nan"))
        launch_paged_attention(*batch.args(), out=inner, num_kv_splits=splits, seq_order=order, heads_inner=True)
        assert torch.equal(inner, plain)

    def test_public_wrapper_allocates_output(self, device):
        batch = make_paged_batch([3, 1], [20, 9], 4, 2, 64, 16, torch.bfloat16, device, seed=11)
        out = tk.paged_attention(*batch.args())
        assert rel_err(out, ref_paged_attention(*batch.args())) < TOL[torch.bfloat16]

    def test_rejects_mismatched_heads(self, device):
        batch = make_paged_batch([1], [4], 3, 2, 32, 16, torch.float32, device, seed=0)
        with pytest.raises(ValueError, match="num_heads"):
            tk.paged_attention(*batch.args())


class TestSplitHeuristic:
    # The CPU stands in for a 4-SM device here.
    def test_splits_small_decode_batches_with_long_context(self):
        assert choose_num_kv_splits(1, 4096, torch.device("cpu"), 1 << 16) > 1

    def test_keeps_one_split_for_short_context_or_many_programs(self):
        assert choose_num_kv_splits(1, 100, torch.device("cpu"), 1 << 16) == 1
        assert choose_num_kv_splits(4096, 4096, torch.device("cpu"), 1 << 16) == 1

    def test_bounds_split_scratch(self):
        assert choose_num_kv_splits(1, 1 << 20, torch.device("cpu"), 100 << 20) <= 2


@pytest.mark.gpu
def test_paged_attention_replays_in_cuda_graph():
    """Captured once, replayed with new lengths: proves the wrapper never syncs with the host."""
    dev = "cuda"
    batch = make_paged_batch([1] * 8, [100] * 8, 16, 8, 128, 16, torch.bfloat16, dev, seed=1)
    big = make_paged_batch([1] * 8, [3000 - 200 * i for i in range(8)], 16, 8, 128, 16,
                           torch.bfloat16, dev, seed=2)
    # Static buffers sized for the big batch; capture while they hold the small one.
    k_cache, v_cache, block_tables = big.k_cache, big.v_cache, big.block_tables.clone()
    seq_lens, query = batch.seq_lens.clone(), batch.query.clone()
    out = torch.empty_like(query)
    args = lambda: (query, k_cache, v_cache, block_tables, batch.query_start_loc, seq_lens,  # noqa: E731
                    128 ** -0.5, 1, 4096)
    torch.cuda.synchronize()
    tk.paged_attention(*args(), out=out)  # warm-up compiles outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.paged_attention(*args(), out=out)
    seq_lens.copy_(big.seq_lens)
    query.copy_(big.query)
    graph.replay()
    ref = ref_paged_attention(*args())
    assert rel_err(out, ref) < TOL[torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# KV store, rotary, norms, activation


class TestStoreKvCache:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (1, 128, 32), (3, 80, 8)])
    def test_matches_reference_and_skips_negative_slots(self, device, dtype, num_kv_heads, head_dim, block_size):
        gen = torch.Generator().manual_seed(head_dim + block_size)
        num_tokens, num_blocks = 24, 6
        # key/value as strided views of one fused buffer, like the model's qkv output.
        kv = randn(gen, num_tokens, 2 * num_kv_heads * head_dim + 8, dtype=dtype, device=device)
        key = kv[:, :num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
        value = kv[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[::5] = -1
        slots = slots.to(torch.int64 if block_size == 8 else torch.int32).to(device)
        caches = [randn(gen, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
                  for _ in range(2)]
        ref_k, ref_v = caches[0].clone(), caches[1].clone()
        torch_ref.store_kv_cache(key, value, ref_k, ref_v, slots)
        tk.store_kv_cache(key, value, caches[0], caches[1], slots)
        assert torch.equal(caches[0], ref_k) and torch.equal(caches[1], ref_v)


def _cos_sin_cache(rot_dim: int, max_pos: int, device) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


class TestRotaryEmbedding:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("heads,kv_heads,head_dim,rot_dim", [(4, 2, 64, 64), (6, 1, 128, 64), (2, 2, 256, 256)])
    def test_rotates_strided_qk_in_place_like_reference(self, device, dtype, heads, kv_heads, head_dim, rot_dim):
        gen = torch.Generator().manual_seed(heads * head_dim + rot_dim)
        num_tokens, max_pos = 19, 4096
        qkv = randn(gen, num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, device=device)
        q = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
        v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
        positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(device)
        cache = _cos_sin_cache(rot_dim, max_pos, device)
        ref_q, ref_k = torch_ref.rotary_embedding(positions, q.clone(), k.clone(), cache)
        out_q, out_k = tk.rotary_embedding(positions, q, k, cache)
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
        assert rel_err(q, ref_q) < TOL[dtype] and rel_err(k, ref_k) < TOL[dtype]
        assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)


class TestQkvRopeStore:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("qk_norm", [False, True])
    @pytest.mark.parametrize("heads,kv_heads,head_dim,rot_dim,block_size",
                             [(16, 8, 128, 128, 16), (4, 1, 64, 64, 32), (2, 2, 256, 256, 16), (6, 2, 128, 64, 8)])
    def test_matches_reference(self, device, dtype, qk_norm, heads, kv_heads, head_dim, rot_dim, block_size):
        gen = torch.Generator().manual_seed(heads * head_dim + rot_dim + qk_norm)
        num_tokens, max_pos, num_blocks = 21, 4096, 4
        width = (heads + 2 * kv_heads) * head_dim
        qkv = randn(gen, num_tokens, width + 32, dtype=dtype, device=device)[:, :width] * 3  # strided rows
        positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(device)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[::4] = -1  # padding rows store nothing
        slots = slots.to(device)
        cache = _cos_sin_cache(rot_dim, max_pos, device)
        norms = ([randn(gen, head_dim, dtype=dtype, device=device) for _ in range(2)] if qk_norm else [None, None])
        caches = [randn(gen, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
        ref_caches = [c.clone() for c in caches]
        ref_q = torch_ref.qkv_rope_store(qkv, positions, cache, *ref_caches, slots, heads, *norms, eps=1e-6)
        qkv_before = qkv.clone()
        q = tk.qkv_rope_store(qkv, positions, cache, *caches, slots, heads, *norms, eps=1e-6)
        assert q.shape == (num_tokens, heads, head_dim) and q.dtype == dtype
        assert rel_err(q, ref_q) < TOL[dtype]
        for out, ref in zip(caches, ref_caches):
            assert rel_err(out, ref) < TOL[dtype]
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[slots[slots >= 0].cpu()] = False
        for out, ref in zip(caches, ref_caches):  # slots not written keep their bytes
            assert torch.equal(out.flatten(0, 1)[untouched.to(device)], ref.flatten(0, 1)[untouched.to(device)])
        assert torch.equal(qkv, qkv_before)  # the input is read only

    def test_rejects_mismatched_widths_and_lone_norm_weight(self, device):
        k_cache = torch.zeros(2, 16, 2, 64, device=device)
        args = (torch.zeros(3, 64, device=device), torch.zeros(3, dtype=torch.int64, device=device),
                _cos_sin_cache(64, 8, device), k_cache, k_cache.clone(), torch.zeros(3, dtype=torch.int64, device=device))
        with pytest.raises(ValueError, match="does not hold"):
            tk.qkv_rope_store(*args, 4)
        qkv = torch.zeros(3, (4 + 4) * 64, device=device)
        with pytest.raises(ValueError, match="go together"):
            tk.qkv_rope_store(qkv, *args[1:], 4, torch.ones(64, device=device), None)


class TestRmsNorm:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("shape", [(7, 128), (33, 1000), (2, 3, 4096)])
    def test_matches_reference(self, device, dtype, shape):
        gen = torch.Generator().manual_seed(sum(shape))
        x = randn(gen, *shape, dtype=dtype, device=device) * 3
        weight = randn(gen, shape[-1], dtype=dtype, device=device)
        ref = torch_ref.rms_norm(x, weight, 1e-6)
        assert rel_err(tk.rms_norm(x, weight, 1e-6), ref) < TOL[dtype]

    def test_strided_per_head_view_and_fp32_weight(self, device):
        gen = torch.Generator().manual_seed(3)
        qkv = randn(gen, 9, (4 + 2 * 2) * 128, dtype=torch.bfloat16, device=device)
        q = qkv[:, :4 * 128].view(9, 4, 128)  # Qwen3 q-norm: per-head norm over a strided view
        weight = randn(gen, 128, device=device)
        out = tk.rms_norm(q, weight, 1e-6)
        ref = torch_ref.rms_norm(q, weight, 1e-6)
        assert out.dtype == ref.dtype == torch.float32
        assert rel_err(out, ref) < 5e-3

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("shape", [(5, 256), (17, 3000)])
    def test_fused_add_matches_reference_in_place(self, device, dtype, shape):
        gen = torch.Generator().manual_seed(shape[1])
        x = randn(gen, *shape, dtype=dtype, device=device)
        residual = randn(gen, *shape, dtype=dtype, device=device)
        weight = randn(gen, shape[-1], dtype=dtype, device=device)
        ref_out, ref_res = torch_ref.fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
        out, res = tk.fused_add_rms_norm(x, residual, weight, 1e-5)
        assert res.data_ptr() == residual.data_ptr()
        assert rel_err(res, ref_res) < TOL[dtype] and rel_err(out, ref_out) < TOL[dtype]


class TestSiluAndMul:
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("shape", [(6, 2 * 64), (3, 5, 2 * 1500)])
    def test_matches_reference(self, device, dtype, shape):
        gen = torch.Generator().manual_seed(shape[-1])
        x = randn(gen, *shape, dtype=dtype, device=device) * 2
        out = tk.silu_and_mul(x)
        assert out.shape == (*shape[:-1], shape[-1] // 2)
        assert rel_err(out, torch_ref.silu_and_mul(x)) < TOL[dtype]


class TestWarmUp:
    def test_warm_up_compiles_every_variant_a_run_uses(self, device):
        """After warm_up_variants, attention over any batch shape compiles nothing new."""
        from atom_core.kernels.triton.attention import _paged_attention_kernel, warm_up_variants

        gen = torch.Generator().manual_seed(11)
        k_cache = torch.randn(64, 16, 2, 64, generator=gen).to(device, torch.bfloat16)
        v_cache = torch.randn(64, 16, 2, 64, generator=gen).to(device, torch.bfloat16)
        launched = warm_up_variants(k_cache, v_cache, 8, torch.bfloat16, max_query_len=200)
        # decode, q tiles 2..32 and the saturated 64-row class, split or not; and decode split over a
        # subset of the sequences (a mixed step's decode launch merges by listed sequence)
        assert launched == 2 * 7 + 1

        def compiled() -> int:
            caches = getattr(_paged_attention_kernel, "device_caches", {})
            return sum(len(c[0]) for c in caches.values())

        before = compiled()
        # Block-table widths 19, 4, 10, 57, 16, 16, 19: a width of 16 must not be a new variant either.
        for q_lens, ctx in (([1] * 5, 300), ([3, 17], 40), ([150, 1, 9], 0), ([1], 900), ([1, 1], 240),
                            ([20], 220), ([200], 100)):
            lens = [q + ctx for q in q_lens]
            query = torch.randn(sum(q_lens), 8, 64, generator=gen).to(device, torch.bfloat16)
            qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
            tables = torch.randint(0, 64, (len(q_lens), max(lens) // 16 + 1), generator=gen, dtype=torch.int32).to(device)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
            order = torch.argsort(seq_lens, descending=True).to(torch.int32) if max(q_lens) == 1 else None  # as the engine
            launch_paged_attention(query, k_cache, v_cache, tables, qsl, seq_lens, 0.125, max(q_lens), max(lens),
                                   seq_order=order)
        assert compiled() == before
