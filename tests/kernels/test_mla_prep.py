"""MLA's fused RoPE + latent RMSNorm + cache store (`mla_rope_store`): the Triton kernel against
the torch reference (on a GPU with the `gpu` marker; on the CPU under TRITON_INTERPRET=1 with
small shapes), the MLA backend through both Triton kernels against the CPU backend, the sm_90
compile, and a CUDA-graph replay.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_mla_prep.py -q
"""
from __future__ import annotations

import pytest
import torch

from atom_core.kernels import torch_ref
from atom_core.model_ops.rotary import RotaryEmbedding
from tests.kernels.tolerances import INTERPRET, TOL, rel_err

YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
MAX_POSITION = 512


def make_inputs(num_tokens, heads, nope, latent, rope, dtype, device, seed, block_size=4, num_padded=0):
    """q as a view of a [T, H * (N + R)] projection output, kv_a [T, C + R], YaRN cos/sin, a cache
    of random rows (so a row written where it should not be shows), slots spread over shuffled
    blocks with the last `num_padded` tokens at -1 (CUDA-graph padding)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, heads * (nope + rope), generator=gen).view(num_tokens, heads, nope + rope)
    kv_a = torch.randn(num_tokens, latent + rope, generator=gen) * 2
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)
    cos_sin = RotaryEmbedding(rope, rope, MAX_POSITION, 10000.0, YARN).cos_sin_cache
    num_blocks = num_tokens // block_size + 3
    cache = torch.randn(num_blocks, block_size, 1, latent + rope, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if num_padded:
        slots[-num_padded:] = -1
    weight = 1 + 0.2 * torch.randn(latent, generator=gen)
    to = dict(dtype=dtype, device=device)
    return (q.to(**to), kv_a.to(**to), positions.to(device), cos_sin.to(device), cache.to(**to), slots.to(device),
            weight.to(**to), 1e-6)


def run_both(args, interleaved):
    """(q_rope, cache) from the Triton kernel and from the reference, each on its own cache copy."""
    from atom_core.kernels.triton.mla_prep import mla_rope_store

    cache = args[4].clone()
    q_rope = mla_rope_store(*args[:4], cache, *args[5:], interleaved)
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    ref_cache = cpu[4].clone()
    ref_q_rope = torch_ref.mla_rope_store(*cpu[:4], ref_cache, *cpu[5:], interleaved)
    return q_rope.cpu(), cache.cpu(), ref_q_rope, ref_cache


def assert_matches(args, interleaved):
    q_rope, cache, ref_q_rope, ref_cache = run_both(args, interleaved)
    dtype = args[0].dtype
    assert q_rope.shape == ref_q_rope.shape and q_rope.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(q_rope, ref_q_rope, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(q_rope, ref_q_rope) < TOL[dtype]
        assert rel_err(cache, ref_cache) < TOL[dtype]
    slots = args[5].cpu()
    untouched = torch.ones(cache.shape[0] * cache.shape[1], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    original = args[4].cpu().flatten(0, 1)
    assert torch.equal(cache.flatten(0, 1)[untouched], original[untouched]), "a row outside slot_mapping changed"


# name: (tokens, heads, nope, latent, rope); the real widths are 128 / 512 / 64
SHAPES = {
    "v2_lite_heads": (7, 16, 16, 64, 16),
    "v3_heads": (5, 128, 8, 32, 16),
    "heads_not_a_power_of_two": (6, 6, 8, 32, 16),
    "v2_lite_real_widths": (3, 16, 128, 512, 64),
}


class TestTritonMatchesReference:
    @pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
    @pytest.mark.parametrize("shape", sorted(SHAPES))
    def test_fp32(self, device, shape, interleaved):
        args = make_inputs(*SHAPES[shape], torch.float32, device, seed=len(shape))
        assert_matches(args, interleaved)

    @pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
    def test_bf16_with_padded_slots(self, device, interleaved):
        args = make_inputs(9, 16, 16, 64, 16, torch.bfloat16, device, seed=3, num_padded=3)
        assert_matches(args, interleaved)

    def test_padded_tokens_write_no_cache_row(self, device):
        from atom_core.kernels.triton.mla_prep import mla_rope_store

        args = make_inputs(4, 4, 8, 32, 16, torch.float32, device, seed=5, num_padded=4)
        cache = args[4].clone()
        q_rope = mla_rope_store(*args[:4], cache, *args[5:], True)
        assert torch.equal(cache, args[4])
        assert q_rope.shape == (4, 4, 16)  # the query rows are roped all the same (their outputs go unused)

    def test_no_tokens(self, device):
        from atom_core.kernels.triton.mla_prep import mla_rope_store

        args = list(make_inputs(0, 4, 8, 32, 16, torch.float32, device, seed=1))
        assert mla_rope_store(*args, True).shape == (0, 4, 16)

    def test_rejects_mismatched_widths_and_dtypes(self, device):
        from atom_core.kernels.triton.mla_prep import mla_rope_store

        args = list(make_inputs(2, 4, 8, 32, 16, torch.float32, device, seed=1))
        with pytest.raises(ValueError, match="kv_a"):
            mla_rope_store(args[0], args[1][:, :40], *args[2:], True)
        with pytest.raises(ValueError, match="share a dtype"):
            mla_rope_store(args[0].bfloat16(), *args[1:], True)
        with pytest.raises(ValueError, match="cos_sin_cache must be float32"):
            mla_rope_store(*args[:3], args[3].double(), *args[4:], True)
        with pytest.raises(ValueError, match="one latent row a token"):
            mla_rope_store(*args[:4], args[4].expand(-1, -1, 2, -1), *args[5:], True)
        with pytest.raises(ValueError, match="positions"):
            mla_rope_store(args[0], args[1], args[2][:1], *args[3:], True)
        with pytest.raises(ValueError, match="must be even"):
            mla_rope_store(*args[:3], args[3][:, :15], *args[4:], True)


def test_both_providers_expose_the_same_signature():
    import inspect

    from atom_core.kernels import triton as tk

    params = lambda fn: [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]  # noqa: E731
    assert params(torch_ref.mla_rope_store) == params(tk.mla_rope_store)


class TestReference:
    def test_interleaved_pairs_rotate_like_hf(self):
        """The reference's interleaved q . k equals HF DeepSeek's (apply_rotary_pos_emb_interleave:
        pairs regrouped as halves, then rotate_half), the invariant attention relies on."""
        args = make_inputs(5, 3, 8, 32, 16, torch.float32, "cpu", seed=9)
        q, kv_a, positions, cos_sin, cache, slots, weight, eps = args
        q_rope = torch_ref.mla_rope_store(q, kv_a, positions, cos_sin, cache, slots, weight, eps, True)
        k_rope = cache.flatten(0, 1)[slots, 0, 32:]

        cos, sin = cos_sin[positions].chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

        def hf_rope(x):  # x [..., R] interleaved
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]

        hf_scores = torch.einsum("thr,tr->th", hf_rope(q[..., 8:]), hf_rope(kv_a[:, None, 32:])[:, 0])
        torch.testing.assert_close(torch.einsum("thr,tr->th", q_rope, k_rope), hf_scores, rtol=1e-5, atol=1e-5)

    def test_rejects_a_kv_a_of_the_wrong_width(self):
        args = list(make_inputs(2, 4, 8, 32, 16, torch.float32, "cpu", seed=1))
        with pytest.raises(ValueError, match="rope dim 16"):
            torch_ref.mla_rope_store(args[0], args[1][:, :40], *args[2:], True)

    def test_cache_latent_is_rms_normed(self):
        q, kv_a, positions, cos_sin, cache, slots, weight, eps = make_inputs(3, 2, 8, 32, 16, torch.float32, "cpu", 2)
        torch_ref.mla_rope_store(q, kv_a, positions, cos_sin, cache, slots, weight, eps, False)
        latent = kv_a[:, :32]
        expected = weight * latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps)
        torch.testing.assert_close(cache.flatten(0, 1)[slots, 0, :32], expected)


def _mla_layer(heads, nope, rope, v_dim, latent, interleaved, dtype, device, seed):
    from atom_core.model_ops.layernorm import RMSNorm
    from atom_core.model_ops.mla import MLAAttention

    gen = torch.Generator().manual_seed(seed)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            rotary = RotaryEmbedding(rope, rope, MAX_POSITION, 10000.0, YARN)
            norm = RMSNorm(latent)
            kv_b = torch.nn.Linear(latent, heads * (nope + v_dim), bias=False)
            layer = MLAAttention(heads, nope, rope, v_dim, latent, (nope + rope) ** -0.5, rotary, norm, kv_b,
                                 interleaved)
        finally:
            torch.set_default_dtype(prev)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(latent, generator=gen))
        kv_b.weight.copy_(torch.randn(kv_b.weight.shape, generator=gen) * 0.1)
    return layer  # it holds rotary, norm and kv_b_proj


def _run_backend(device, heads, nope, latent, rope, dtype, q_lens, ctx_lens, seed):
    """One MLA layer over a flat batch (prefill chunks and decode rows) whose context an earlier
    step of the same backend stored -> (out [T, H * V], the cache)."""
    from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
    from atom_core.model_ops.mla import MLABackend

    block_size, v_dim = 4, 24
    layer = _mla_layer(heads, nope, rope, v_dim, latent, True, dtype, device, seed)
    backend = MLABackend(torch.device(device).type)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    num_blocks = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(num_blocks), generator=torch.Generator().manual_seed(seed)).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(num_blocks), dtype=torch.int32)
    for s, n in enumerate(num_blocks):
        tables[s, :n] = perm[sum(num_blocks[:s]):sum(num_blocks[:s + 1])]
    layer.k_cache = torch.zeros(sum(num_blocks), block_size, 1, latent + rope, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    to = dict(dtype=dtype, device=device)
    for starts, ends in ((([0] * len(ctx_lens)), ctx_lens), (ctx_lens, seq_lens)):  # the context, then the batch
        positions = [(s, p) for s, (a, b) in enumerate(zip(starts, ends)) for p in range(a, b)]
        slots = [int(tables[s, p // block_size]) * block_size + p % block_size for s, p in positions]
        lens = torch.tensor([b - a for a, b in zip(starts, ends)])
        meta = AttentionMetadata(torch.cat([torch.zeros(1), lens.cumsum(0)]).to(torch.int32).to(device),
                                 torch.tensor(ends, dtype=torch.int32, device=device), tables.to(device),
                                 torch.tensor(slots, dtype=torch.int64, device=device), int(lens.max()), max(ends))
        num_tokens = len(positions)
        q = torch.randn(num_tokens, heads * (nope + rope), generator=gen).view(num_tokens, heads, nope + rope)
        kv_a = torch.randn(num_tokens, latent + rope, generator=gen)
        with set_attention_metadata(meta):
            out = backend.forward(layer, q.to(**to), kv_a.to(**to), torch.tensor([p for _, p in positions],
                                                                                  device=device))
    return out.cpu(), layer.k_cache.cpu()


class TestBackendThroughTriton:
    """The MLA backend with both Triton kernels (the prep writes q_rope and the cache rows the
    latent kernel reads) against the backend with the CPU references, on a mixed batch."""

    def test_equals_the_reference_backend(self, device, monkeypatch):
        import atom_core.kernels.triton as triton_ops
        from atom_core.model_ops import mla as mla_module

        case = dict(heads=16, nope=16, latent=64, rope=16, dtype=torch.float32, q_lens=[1, 5, 1], ctx_lens=[9, 0, 3],
                    seed=4)
        ref_out, ref_cache = _run_backend("cpu", **case)
        if device == "cpu":  # under the interpreter: the Triton provider on CPU tensors
            monkeypatch.setattr(mla_module, "kernel_ops", lambda _device: triton_ops)
        out, cache = _run_backend(device, **case)
        torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("heads", [16, 128], ids=["v2_lite", "v3"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
def test_compiles_for_hopper_without_spills(heads, interleaved):
    """The kernel compiles for sm_90 with Triton's bundled toolchain (no GPU needed) at the real
    widths (nope 128, latent 512, rope 64; V2-Lite's 16 and V3's 128 heads) without local-memory
    spills, with 16-divisible pointers and row strides as Triton specializes them at launch."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_core.kernels.triton import mla_prep
    from tests.kernels.sm90_compile import cuobjdump_path, stack_bytes

    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")
    fn = mla_prep._mla_rope_store_kernel
    ptrs = {"q_ptr": "*bf16", "kv_a_ptr": "*bf16", "positions_ptr": "*i64", "cos_sin_ptr": "*fp32",
            "norm_w_ptr": "*bf16", "q_rope_ptr": "*bf16", "kv_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"}
    strides = ("stride_qt", "stride_qh", "stride_kvat", "stride_cs", "stride_qrt", "stride_cb", "stride_cslot")
    sig = {**ptrs, "eps": "fp32", "block_size": "i32", **{s: "i32" for s in strides}}
    half = 32
    consts = dict(NUM_HEADS=heads, NOPE=128, LATENT=512, HALF=half, PAIR_STEP=2 if interleaved else 1,
                  PAIR_OFFSET=1 if interleaved else half, BLOCK_H=min(heads, mla_prep.Q_TILE_ELEMS // half),
                  BLOCK_HALF=half, BLOCK_C=512)
    params = list(inspect.signature(fn.fn).parameters)
    attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, *strides)}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert stack_bytes(kernel) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestOnGPU:
    """Real shapes: V2-Lite (16 heads) and V3 (128 heads), nope 128, latent 512, rope 64, bf16."""

    @pytest.mark.parametrize("num_tokens", [1, 32, 300])
    @pytest.mark.parametrize("heads", [16, 128], ids=["v2_lite", "v3"])
    @pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "neox"])
    def test_real_shapes(self, num_tokens, heads, interleaved):
        args = make_inputs(num_tokens, heads, 128, 512, 64, torch.bfloat16, "cuda", seed=num_tokens,
                           block_size=16, num_padded=num_tokens // 8)
        assert_matches(args, interleaved)

    def test_graph_replay_equals_eager(self):
        """Captured once, replayed on new positions and slots (static buffers, no host sync)."""
        from atom_core.kernels.triton.mla_prep import mla_rope_store

        args = list(make_inputs(32, 16, 128, 512, 64, torch.bfloat16, "cuda", seed=1, block_size=16, num_padded=4))
        cache = args[4].clone()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            mla_rope_store(*args[:4], cache, *args[5:], True)  # warm-up compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            q_rope = mla_rope_store(*args[:4], cache, *args[5:], True)
        fresh = make_inputs(32, 16, 128, 512, 64, torch.bfloat16, "cuda", seed=2, block_size=16, num_padded=4)
        for i in (0, 1, 2, 5):  # q, kv_a, positions, slot_mapping
            args[i].copy_(fresh[i])
        cache.copy_(args[4])
        graph.replay()
        torch.cuda.synchronize()
        eager_cache = args[4].clone()
        eager = mla_rope_store(*args[:4], eager_cache, *args[5:], True)
        torch.testing.assert_close(q_rope, eager, rtol=0, atol=0)
        torch.testing.assert_close(cache, eager_cache, rtol=0, atol=0)
