"""Contiguous prefill attention (kernels/triton/prefill_attention.py) and the split-by-context path.

Runs on the CPU under Triton's interpreter (tiny shapes) and on a GPU (`gpu` cases, Llama-3-8B /
Qwen3 shapes; written in a session without a GPU, NOT yet run there):
    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_prefill_attention.py -q
Without the interpreter the CPU runs the metadata and offline sm_90 compile checks.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from atom_core.kernels.triton import prefill_attention as pa  # noqa: E402
from atom_core.kernels.triton.attention import launch_paged_attention  # noqa: E402
from tests.kernels.tolerances import INTERPRET, TOL, rel_err  # noqa: E402

SMALL_TILES = pa.PrefillTileConfig(32, 16, 4, 2)  # several q and key tiles even at interpreter sizes


def recording(fn, log: list):
    """fn, appending each call's keyword arguments to log first."""
    def wrapper(*args, **kwargs):
        log.append(kwargs)
        return fn(*args, **kwargs)
    return wrapper


def varlen_inputs(lens, num_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(dtype=dtype, device=device)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, k, v, cu


def reference(q, k, v, cu, seq_ids, scale, window=None, sinks=None):
    """The engine's reference (torch_ref.paged_attention over a cache holding these rows), on the CPU."""
    cpu = [t.cpu() for t in (q, k, v, cu, seq_ids)]
    out = pa.prefill_attention_ref(*cpu, scale, 0, out=torch.zeros_like(cpu[0]), sliding_window=window,
                                   sinks=None if sinks is None else sinks.cpu())
    return out.to(q.device)


class TestKernelMatchesReference:
    # lengths: 1, tile multiples and not, several sequences; GQA groups 1/4/8 (8 pads no group), D 64/128
    @pytest.mark.parametrize("lens,heads,kv_heads,head_dim", [
        ([1, 37, 70], 4, 4, 64), ([33, 1, 16], 8, 2, 128), ([50, 9], 8, 1, 64), ([1], 4, 1, 128),
        ([64, 17], 6, 2, 64),  # group 3: padded to 4 lanes
    ])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_varlen_causal(self, device, lens, heads, kv_heads, head_dim, dtype):
        q, k, v, cu = varlen_inputs(lens, heads, kv_heads, head_dim, dtype, device)
        ids = torch.arange(len(lens), dtype=torch.int32, device=device)
        scale = head_dim ** -0.5
        want = reference(q, k, v, cu, ids, scale)
        for config in (SMALL_TILES, None):  # None: the default (sm_90) tiles
            got = pa.prefill_attention(q, k, v, cu, ids, scale, max(lens), config=config)
            assert rel_err(got, want) < TOL[dtype], config

    def test_listed_sequences_only_in_any_order(self, device):
        """seq_ids picks a subset in any order; rows of the others stay as they were."""
        lens = [20, 5, 41, 1]
        q, k, v, cu = varlen_inputs(lens, 4, 2, 64, torch.float32, device, seed=1)
        ids = torch.tensor([2, 0], dtype=torch.int32, device=device)
        out = torch.full_like(q, float("nan"))
        pa.prefill_attention(q, k, v, cu, ids, 0.125, 41, out, config=SMALL_TILES)
        want = reference(q, k, v, cu, ids, 0.125)
        rows = torch.cat([torch.arange(0, 20), torch.arange(25, 66)]).to(device)
        assert rel_err(out[rows], want[rows]) < 1e-5
        assert out[20:25].isnan().all() and out[66:].isnan().all()

    def test_strided_key_and_value_views(self, device):
        """K and V as views into a wider row (the backend passes V straight out of the QKV output)."""
        lens = [30, 12]
        q, k, v, cu = varlen_inputs(lens, 4, 2, 64, torch.float32, device, seed=2)
        wide = torch.cat([torch.randn(42, 3, 64, device=device), k, v], dim=1)
        ids = torch.arange(2, dtype=torch.int32, device=device)
        got = pa.prefill_attention(q, wide[:, 3:5], wide[:, 5:7], cu, ids, 0.1, 30, config=SMALL_TILES)
        assert rel_err(got, reference(q, k, v, cu, ids, 0.1)) < 1e-5

    @pytest.mark.parametrize("window,with_sinks", [(7, False), (None, True), (16, True)])
    def test_sliding_window_and_sinks(self, device, window, with_sinks):
        lens = [45, 3, 20]
        q, k, v, cu = varlen_inputs(lens, 8, 2, 64, torch.float32, device, seed=3)
        sinks = torch.randn(8, generator=torch.Generator().manual_seed(9)).to(device) if with_sinks else None
        ids = torch.arange(3, dtype=torch.int32, device=device)
        got = pa.prefill_attention(q, k, v, cu, ids, 0.125, 45, sliding_window=window, sinks=sinks,
                                   config=SMALL_TILES)
        assert rel_err(got, reference(q, k, v, cu, ids, 0.125, window, sinks)) < 1e-5

    def test_bad_arguments_are_clear_errors(self):
        q, k, v, cu = varlen_inputs([4], 4, 2, 16, torch.float32, "cpu")
        ids = torch.zeros(1, dtype=torch.int32)
        with pytest.raises(ValueError, match="must equal the query's"):
            pa.prefill_attention(q, k.half(), v.half(), cu, ids, 1.0, 4)
        with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
            pa.prefill_attention(q, torch.zeros(4, 3, 16), torch.zeros(4, 3, 16), cu, ids, 1.0, 4)
        with pytest.raises(ValueError, match="sinks must be"):
            pa.prefill_attention(q, k, v, cu, ids, 1.0, 4, sinks=torch.zeros(2))
        with pytest.raises(ValueError, match="seq_ids has dtype"):
            pa.prefill_attention(q, k, v, cu, ids.float(), 1.0, 4)


class TestRopeKRows:
    @pytest.mark.parametrize("with_norm,rot_dim", [(False, 64), (True, 32)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_equals_what_qkv_rope_store_writes_to_the_cache(self, device, with_norm, rot_dim, dtype):
        """Bit for bit: the contiguous path reads the same K values the paged path reads from the cache."""
        from atom_core.kernels import triton as tk

        gen = torch.Generator().manual_seed(4)
        heads, kv_heads, head_dim, tokens = 4, 2, 64, 19
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype=dtype, device=device)
        positions = torch.randperm(100, generator=gen)[:tokens].to(device)
        cos_sin = torch.randn(100, rot_dim, generator=gen).to(device)
        weights = (torch.randn(head_dim, generator=gen).to(dtype=dtype, device=device) for _ in range(2))
        q_norm, k_norm = weights if with_norm else (None, None)
        cache = torch.zeros(2, 16, kv_heads, head_dim, dtype=dtype, device=device)
        slots = torch.arange(tokens, device=device)
        tk.qkv_rope_store(qkv, positions, cos_sin, cache, torch.zeros_like(cache), slots, heads, q_norm, k_norm, 1e-5)
        k = pa.rope_k_rows(qkv, positions, cos_sin, heads, kv_heads, k_norm, 1e-5)
        assert torch.equal(k, cache.flatten(0, 1)[:tokens])


# ---------------------------------------------------------------------------------------------
# the split-by-context path through the backend


def make_layer(window=None, sinks=False, norms=False, rot_dim=32, heads=4, kv_heads=2, head_dim=32,
               dtype=torch.float32):
    from atom_core.model_ops.attention import Attention, QKTransform
    from atom_core.model_ops.layernorm import RMSNorm
    from atom_core.model_ops.rotary import RotaryEmbedding

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the layer's compute and KV dtype, as a model build sets it
    try:
        return _make_layer(window, sinks, norms, rot_dim, heads, kv_heads, head_dim, Attention, QKTransform,
                           RMSNorm, RotaryEmbedding)
    finally:
        torch.set_default_dtype(previous)


def _make_layer(window, sinks, norms, rot_dim, heads, kv_heads, head_dim, Attention, QKTransform, RMSNorm,
                RotaryEmbedding):
    gen = torch.Generator().manual_seed(5)
    norm_pair = (RMSNorm(head_dim), RMSNorm(head_dim)) if norms else (None, None)
    for n in norm_pair:
        if n is not None:
            n.weight.data = (1 + 0.3 * torch.randn(head_dim, generator=gen)).to(n.weight.dtype)
    qk = QKTransform(RotaryEmbedding(head_dim, rot_dim, 8192, 10000.0), *norm_pair)  # positions up to ctx + q
    layer = Attention(heads, head_dim, head_dim ** -0.5, kv_heads, qk, sliding_window=window, sinks=sinks)
    if sinks:
        layer.sinks.data = torch.randn(heads, generator=gen)
    return layer


def mixed_step(layer, ctx_lens, q_lens, block_size=16, seed=6):
    """A flat batch: sequence s has ctx_lens[s] cached tokens (random K/V already in the cache) and
    q_lens[s] new ones; metadata as batch_builder makes it, split by context."""
    from atom_core.model_ops.forward_context import AttentionMetadata
    from atom_core.worker.batch_builder import context_split

    gen = torch.Generator().manual_seed(seed)
    kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    per_seq = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(per_seq) + 2, generator=gen).tolist()
    tables, start = [], 0
    for n in per_seq:
        tables.append(perm[start:start + n] + [perm[-1]] * (max(per_seq) - n))
        start += n
    shape = (len(perm), block_size, kv_heads, head_dim)
    layer.k_cache, layer.v_cache = (torch.randn(*shape, generator=gen).to(layer.dtype) for _ in range(2))
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)])
    slots = torch.cat([torch.tensor([tables[s][p // block_size] * block_size + p % block_size
                                     for p in range(c, c + q)]) for s, (c, q) in enumerate(zip(ctx_lens, q_lens))])
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=slots,
                             max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                             **{k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                                for k, v in context_split(q_lens, seq_lens).items()})
    qkv = torch.randn(len(positions), (layer.num_heads + 2 * kv_heads) * head_dim, generator=gen).to(layer.dtype)
    return meta, qkv, positions


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("listed_ids,max_query_len", [([3, 0, 2], None), ([3, 4], 12)])
def test_paged_kernel_attends_only_a_listed_subset(device, splits, listed_ids, max_query_len):
    """launch_paged_attention with a seq_order listing a subset: those rows equal the reference and
    the other rows are left untouched, split-KV too (its merge writes only the listed rows), so
    several launches can fill one output. The second case lists only multi-token sequences, with
    their own longest query as max_query_len (as the backend launches a step's chunks)."""
    from tests.kernels.test_triton_kernels import make_paged_batch, ref_paged_attention

    q_lens = [1, 30, 1, 12, 7]
    batch = make_paged_batch(q_lens, [40, 0, 9, 20, 3], 4, 2, 64, 16, torch.float32, device, seed=8)
    if max_query_len is not None:
        batch.max_query_len = max_query_len
    order = torch.tensor(listed_ids, dtype=torch.int32, device=device)
    out = torch.full_like(batch.query, float("nan"))
    launch_paged_attention(*batch.args(), out=out, num_kv_splits=splits, seq_order=order)
    want = ref_paged_attention(*batch.args())
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    owned = torch.zeros(len(out), dtype=torch.bool, device=device)
    for s in listed_ids:
        owned[starts[s]:starts[s + 1]] = True
    assert rel_err(out[owned], want[owned]) < 1e-5
    assert out[~owned].isnan().all()


def contiguous_prefill_on_the_cpu(monkeypatch) -> None:
    """Backends built from now on take the contiguous prefill path on the CPU too (the Triton kernels
    under the interpreter); the CPU reference path otherwise stays paged."""
    from atom_core.model_ops import attention_backends as ab

    real = ab.PagedMHABackend.__init__

    def init(self, device_type, kernel=None):
        real(self, device_type, kernel)
        self.prefill = pa

    monkeypatch.setattr(ab.PagedMHABackend, "__init__", init)
    monkeypatch.setattr(ab, "_INSTANCES", {})


def split_and_paged_only(layer, meta, qkv, positions):
    """(output, caches) of one step through the Triton backend (the split path), then the output of
    the same step with the paged kernel alone (one launch: no split lists), from the same starting
    caches."""
    import dataclasses

    from atom_core.model_ops.attention_backends import PagedMHABackend
    from atom_core.model_ops.forward_context import set_attention_metadata

    backend = PagedMHABackend("cuda")  # the Triton provider (CPU tensors run under the interpreter)
    caches = layer.k_cache.clone(), layer.v_cache.clone()
    with set_attention_metadata(meta):
        split = backend.forward(layer, qkv, positions)
    split_caches = layer.k_cache, layer.v_cache
    layer.k_cache, layer.v_cache = caches
    single = dataclasses.replace(meta, fresh_seq_ids=None, paged_seq_ids=None, decode_seq_ids=None,
                                 chunk_seq_ids=None)
    with set_attention_metadata(single):
        paged = backend.forward(layer, qkv, positions)
    return split, split_caches, paged


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under the interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("options,kv_splits", [({}, None), ({}, 2), ({"norms": True, "rot_dim": 16}, None),
                                               ({"window": 9, "sinks": True}, 3)])
def test_mixed_step_through_the_backend_equals_the_paged_only_path(monkeypatch, options, kv_splits):
    """One fresh prompt, a chunk with cached context, two decodes and a one-token fresh prompt: the
    split path (paged kernel on seq_order subsets, decodes and chunk apart, + contiguous kernel)
    equals the paged kernel alone, and stores the same cache. kv_splits forces split-KV (its merge
    must leave the fresh rows, the contiguous kernel's, alone)."""
    from atom_core.kernels.triton import attention

    if kv_splits:
        monkeypatch.setattr(attention, "choose_num_kv_splits", lambda *args: kv_splits)
    layer = make_layer(**options)
    meta, qkv, positions = mixed_step(layer, ctx_lens=[0, 20, 40, 9, 0], q_lens=[37, 25, 1, 1, 1])
    assert meta.fresh_seq_ids.tolist() == [0, 4] and meta.paged_seq_ids.tolist() == [1, 2, 3]
    calls = []
    monkeypatch.setattr(pa, "prefill_attention", recording(pa.prefill_attention, calls))
    got, split_caches, want = split_and_paged_only(layer, meta, qkv, positions)
    assert len(calls) == 1
    assert rel_err(got, want) < 1e-5
    assert torch.equal(split_caches[0], layer.k_cache) and torch.equal(split_caches[1], layer.v_cache)


def test_the_backend_takes_the_split_path_on_cuda_only():
    from atom_core.model_ops.attention_backends import PagedMHABackend

    assert PagedMHABackend("cuda").prefill is pa
    assert PagedMHABackend("cpu").prefill is None  # the reference path stays paged


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under the interpreter (TRITON_INTERPRET=1)")
def test_fp8_kv_layers_keep_the_paged_kernel(monkeypatch):
    """An FP8 cache holds codes and the reference attends over them: the step runs the paged kernel
    alone (the contiguous rows hold the exact values)."""
    import dataclasses

    from atom_core.model_ops.attention_backends import PagedMHABackend
    from atom_core.model_ops.forward_context import set_attention_metadata

    layer = make_layer()
    meta, qkv, positions = mixed_step(layer, ctx_lens=[0, 20], q_lens=[30, 5])
    fp8 = torch.float8_e4m3fn
    layer.k_cache, layer.v_cache = layer.k_cache.to(fp8), layer.v_cache.to(fp8)
    layer.kv_spec = dataclasses.replace(layer.kv_spec, dtype=fp8)
    monkeypatch.setattr(pa, "prefill_attention", lambda *a, **kw: pytest.fail("FP8 KV took the contiguous path"))
    with set_attention_metadata(meta):
        out = PagedMHABackend("cuda").forward(layer, qkv, positions)
    assert out.shape == (35, layer.num_heads * layer.head_dim) and not out.isnan().any()


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under the interpreter (TRITON_INTERPRET=1)")
def test_warm_up_compiles_the_split_path(monkeypatch):
    """Warm-up adds to the paged variants the paged prefill tiles launched with a seq_order, the
    K-rows kernel and the contiguous kernel (launched without touching the cache: slots are -1)."""
    from atom_core.kernels.triton.attention import warm_up_variants
    from atom_core.model_ops.attention_backends import PagedMHABackend

    layer = make_layer(norms=True, window=9, sinks=True)
    layer.k_cache, layer.v_cache = torch.zeros(40, 16, 2, 32), torch.zeros(40, 16, 2, 32)
    backend = PagedMHABackend("cuda")
    ran = []
    paged_only = warm_up_variants(layer.k_cache, layer.v_cache, layer.num_heads, layer.dtype, 8, sliding_window=9,
                                  sinks=layer.sinks)
    monkeypatch.setattr(pa, "prefill_attention", recording(pa.prefill_attention, ran))
    assert backend.warm_up([layer], max_tokens=8, threads=1) > paged_only
    assert len(ran) == 1 and ran[0]["sliding_window"] == 9 and ran[0]["sinks"] is layer.sinks
    assert not layer.k_cache.any() and not layer.v_cache.any()


class TestContextSplitMetadata:
    def test_fresh_and_paged_sequences(self):
        from atom_core.worker.batch_builder import context_split

        split = context_split([5, 1, 3, 1, 4], [5, 30, 10, 1, 4])
        assert split["fresh_seq_ids"].tolist() == [0, 3, 4] and split["fresh_max_query_len"] == 5
        assert split["paged_seq_ids"].tolist() == [1, 2] and split["paged_max_query_len"] == 3  # longest first
        assert split["fresh_seq_ids"].dtype == np.int32  # host arrays: the builder copies them with the rest

    def test_no_fresh_sequence_sets_no_fresh_or_paged_fields(self):
        from atom_core.worker.batch_builder import context_split

        assert context_split([3, 2], [10, 4]) == {}
        assert set(context_split([3, 1], [10, 4])) == {  # only a mixed step's kinds
            "decode_seq_ids", "chunk_seq_ids", "chunk_max_query_len"}
        assert "paged_seq_ids" not in context_split([3, 2], [3, 2])

    def test_the_batch_builder_fills_them(self, tiny_llama, monkeypatch):
        """Real engine steps (chunked prompts, decodes): each step's fresh sequences are exactly those
        with nothing computed yet, the rest are paged; some step mixes both."""
        from atom_core import LLMEngine, SamplingParams
        from atom_core.worker import batch_builder, model_runner

        steps = []

        def spy(out, states, *args, **kwargs):
            expect = [i for i, s in enumerate(states) if s.num_computed_tokens == 0]
            flat = batch_builder.build_flat_batch(out, states, *args, **kwargs)
            got = [None if t is None else t.tolist() for t in (flat.attn.fresh_seq_ids, flat.attn.paged_seq_ids)]
            steps.append((expect, got, len(states)))
            # the step's metadata arrives in one copy: views of one buffer, each 16-byte aligned
            attn = flat.attn
            meta = [t for t in (attn.query_start_loc, attn.seq_lens, attn.block_tables, attn.slot_mapping,
                                attn.fresh_seq_ids, attn.paged_seq_ids) if t is not None]
            assert len({t.untyped_storage().data_ptr() for t in meta}) == 1
            assert all(t.storage_offset() * t.element_size() % 16 == 0 for t in meta)
            return flat

        monkeypatch.setattr(model_runner, "build_flat_batch", spy)
        engine = LLMEngine(str(tiny_llama), max_num_batched_tokens=16)
        prompts, params = [[5] * 12, [7] * 30, [9] * 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        engine.generate(prompts, params)
        for expect, (fresh, paged), num_seqs in steps:
            assert (fresh or []) == expect
            assert sorted((fresh or []) + (paged or [])) == (list(range(num_seqs)) if fresh else [])
        assert any(fresh and paged for _, (fresh, paged), _ in steps)


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under the interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("budget", [None, 48])
def test_engine_with_the_split_path_equals_hf_greedy(tiny_llama, monkeypatch, budget):
    """A tiny Llama in float32 with the split path on the CPU (the backend given the Triton prefill
    kernels, interpreted): greedy tokens equal HF's. budget=48 chunks the prompts,
    so steps mix fresh prompts, chunks with context and decodes."""
    import json

    from atom_core import LLMEngine, SamplingParams
    from tests.models.harness import hf_greedy
    from transformers import AutoModelForCausalLM

    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 9, 40, 75)]
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval(), prompts, 8)
    calls = []
    contiguous_prefill_on_the_cpu(monkeypatch)
    monkeypatch.setattr(pa, "prefill_attention", recording(pa.prefill_attention, calls))
    engine = LLMEngine(str(tiny_llama), **({"max_num_batched_tokens": budget} if budget else {}))
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert calls and [o["token_ids"] for o in got] == want


# ---------------------------------------------------------------------------------------------
# offline sm_90 compile


def compile_for_hopper(head_dim: int, group: int, config: pa.PrefillTileConfig, window=False, sinks=False):
    """The attention kernel compiled for sm_90 with Triton's bundled toolchain, bf16, with the
    16-divisibility Triton gives pointers and row strides at launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = pa._prefill_attention_kernel
    group_p = pa.next_pow2(group)
    block_m = max(config.block_m, 16, group_p)
    strides = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh")
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "cu_seqlens_ptr": "*i32",
           "seq_ids_ptr": "*i32", "scale_log2e": "fp32", "num_seqs": "i32", "num_q_blocks": "i32",
           **{s: "i32" for s in strides},
           "window": "i32", "sinks_ptr": "*fp32"}
    consts = dict(NUM_KV_HEADS=8, GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_M=block_m,
                  BLOCK_Q=block_m // group_p, BLOCK_N=config.block_n, DOT_PRECISION="tf32", DOT_IN_FP32=False,
                  HAS_WINDOW=window, HAS_SINKS=sinks)
    aligned = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a in strides}
    src = ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}}, constexprs=consts, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces the compiled kernels")
@pytest.mark.parametrize("head_dim,group,window,sinks", [
    (128, 4, False, False),  # Llama-3-8B, Qwen3-8B
    (128, 2, False, False),  # Qwen3-0.6B
    (128, 1, False, False),
    (64, 8, True, True),  # gpt-oss (window and sinks layers)
    (64, 1, False, False),
])
def test_default_tiles_compile_for_hopper_without_spills(head_dim, group, window, sinks):
    """wgmma for both dots, 16-byte cp.async K/V streams, no local-memory spills, and shared memory
    within the H100's 227 KiB per block."""
    from tests.kernels.sm90_compile import cuobjdump_path, stack_bytes

    if cuobjdump_path() is None:
        pytest.skip("Triton ships no cuobjdump here")
    kernel = compile_for_hopper(head_dim, group, pa.default_tile_config(head_dim), window, sinks)
    assert "wgmma" in kernel.asm["ptx"], "the dots should use Hopper's warpgroup MMA"
    assert "cp.async" in kernel.asm["ptx"], "K/V tiles should stream with async copies"
    assert stack_bytes(kernel) == 0
    assert kernel.metadata.shared <= 227 * 1024


# ---------------------------------------------------------------------------------------------
# GPU (written in a session without one: NOT yet run)

MODEL_HEADS = {"llama-3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}


def sdpa_reference(q, k, v, cu, lens):
    """torch SDPA per sequence (causal, K/V heads repeated for GQA), in q's dtype."""
    import torch.nn.functional as F

    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for s, n in enumerate(lens):
        lo = int(cu[s])
        qs, ks, vs = (t[lo:lo + n].transpose(0, 1) for t in (q, k.repeat_interleave(group, 1),
                                                          v.repeat_interleave(group, 1)))
        out[lo:lo + n] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out


def paged_copy(k, v, block_size=16, seed=0):
    """The rows in a shuffled paged cache with one block table row per (single) sequence."""
    num_blocks = -(-k.shape[0] // block_size)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(k.device, torch.int32)
    shape = (num_blocks, block_size, *k.shape[1:])
    pad = (0, 0, 0, 0, 0, num_blocks * block_size - k.shape[0])
    caches = []
    for rows in (k, v):
        cache = torch.zeros(shape, dtype=rows.dtype, device=rows.device)
        cache[perm.long()] = torch.nn.functional.pad(rows, pad).view(shape)
        caches.append(cache)
    return caches[0], caches[1], perm[None]


@pytest.mark.gpu
@pytest.mark.parametrize("model", MODEL_HEADS)
@pytest.mark.parametrize("lens", [[2048], [8192], [3000, 1, 2047, 3144], [100, 1948]])
def test_model_shapes_match_sdpa_and_the_paged_kernel(model, lens):
    heads, kv_heads, head_dim = MODEL_HEADS[model]
    q, k, v, cu = varlen_inputs(lens, heads, kv_heads, head_dim, torch.bfloat16, "cuda", seed=len(lens))
    ids = torch.arange(len(lens), dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    got = pa.prefill_attention(q, k, v, cu, ids, scale, max(lens))
    assert rel_err(got, sdpa_reference(q, k, v, cu, lens)) < TOL[torch.bfloat16]
    if len(lens) == 1:  # the paged kernel over the same rows in a shuffled block-16 cache
        k_cache, v_cache, table = paged_copy(k, v)
        paged = launch_paged_attention(q, k_cache, v_cache, table, cu, cu[1:], scale, lens[0], lens[0])
        assert rel_err(got, paged) < TOL[torch.bfloat16]
    for config in pa.TILE_CANDIDATES[:4]:  # other tiles agree too (the rest are timed by the bench sweep)
        assert rel_err(pa.prefill_attention(q, k, v, cu, ids, scale, max(lens), config=config), got) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"norms": True}, {"window": 9, "sinks": True}])
def test_mixed_step_on_cuda_equals_the_paged_only_path(options):
    import dataclasses

    layer = make_layer(**options, heads=32, kv_heads=8, head_dim=128, rot_dim=128, dtype=torch.bfloat16).cuda()
    meta, qkv, positions = mixed_step(layer, ctx_lens=[0, 700, 4000, 9, 0], q_lens=[1500, 333, 1, 1, 77])
    meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).cuda() for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})
    layer.k_cache, layer.v_cache = layer.k_cache.cuda(), layer.v_cache.cuda()
    for module in (layer.qk.rotary, layer.qk.q_norm, layer.qk.k_norm):  # QKTransform is not a submodule
        if module is not None:
            module.cuda()
    got, _, want = split_and_paged_only(layer, meta, qkv.cuda(), positions.cuda())
    assert rel_err(got, want) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 48])
def test_engine_on_cuda_with_the_split_path_equals_hf_greedy(tiny_llama, budget):
    import json

    from atom_core import LLMEngine, SamplingParams
    from tests.models.harness import hf_greedy
    from transformers import AutoModelForCausalLM

    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 9, 40, 75, 300)]
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval(), prompts, 8)
    engine = LLMEngine(str(tiny_llama), device="cuda", dtype="float32", num_kv_blocks=512,
                       **({"max_num_batched_tokens": budget} if budget else {}))
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o["token_ids"] for o in got] == want


# ---------------------------------------------------------------------------------------------
# the benchmark (runs on a GPU; here: its arithmetic, its argument errors, a CPU smoke run)


class TestBench:
    def test_causal_flops_count_visible_pairs(self):
        from benchmarks.kernels.prefill_attention_bench import causal_flops

        # Llama-3-8B, 2,048 tokens: 4 * 32 * 128 * 2048 * 2049 / 2 = 34.4 GFLOP (85 us would be 405 TFLOP/s)
        assert causal_flops([2048], 32, 128) == 4 * 32 * 128 * 2048 * 2049 / 2
        assert causal_flops([1, 2], 1, 1) == 4 * (1 + 3)

    def test_bad_arguments_and_no_gpu_are_clear_errors(self, monkeypatch, capsys):
        from benchmarks.kernels import prefill_attention_bench as bench

        for argv, message in ((["--shapes", "llama-3-8b,mixtral"], "unknown shape 'mixtral'"),
                              (["--tokens", "2048,x"], "positive integers"), (["--tokens", "0"], "positive integers"),
                              (["--tokens", "2048", "--seqs", "3"], "divisible by --seqs")):
            with pytest.raises(SystemExit):
                bench.main(argv)
            assert message in capsys.readouterr().err
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main([])

    @pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under the interpreter (TRITON_INTERPRET=1)")
    def test_a_row_runs_on_the_cpu(self, monkeypatch):
        """The bench's own code (cache build, references, sweep bookkeeping) at a tiny shape, with a
        stand-in timer: the GPU session should find no bug in the script itself."""
        from benchmarks.kernels import prefill_attention_bench as bench

        monkeypatch.setitem(bench.SHAPES, "tiny", (4, 2, 32))
        monkeypatch.setattr(pa, "TILE_CANDIDATES", (SMALL_TILES,))

        def one_call(fn):
            fn()
            return 10.0

        row = bench.bench_case("tiny", 40, 2, True, device="cpu", timer=one_call)
        assert row["contiguous_vs_paged_rel_err"] < TOL[torch.bfloat16]
        assert row["paged"]["us"] == 10.0 and row["sdpa_flash"]["tflops"] == bench.causal_flops([20, 20], 4, 32) / 1e7
        assert list(row["sweep"]) == ["m32_n16_w4_s2"]
        assert "err" in bench.format_row(row)
