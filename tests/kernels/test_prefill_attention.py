"""Contiguous prefill attention (kernels/triton/prefill_attention.py) and the split-by-context path.

Runs on the CPU under Triton's interpreter (tiny shapes) and on a GPU (`gpu` cases, Llama-3-8B /
Qwen3 shapes; written in a session without a GPU, NOT yet run there):
    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_prefill_attention.py -q
Without the interpreter the CPU runs the metadata, env and offline sm_90 compile checks.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from atom_core.kernels.triton import prefill_attention as pa  # noqa: E402
from atom_core.kernels.triton.attention import launch_paged_attention  # noqa: E402
from tests.kernels.tolerances import INTERPRET, TOL, rel_err  # noqa: E402

SMALL_TILES = pa.PrefillTileConfig(32, 16, 4, 2)  # several q and key tiles even at interpreter sizes


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


def make_layer(window=None, sinks=False, norms=False, rot_dim=32, heads=4, kv_heads=2, head_dim=32):
    from atom_core.model_ops.attention import Attention, QKTransform
    from atom_core.model_ops.layernorm import RMSNorm
    from atom_core.model_ops.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(5)
    norm_pair = (RMSNorm(head_dim), RMSNorm(head_dim)) if norms else (None, None)
    for n in norm_pair:
        if n is not None:
            n.weight.data = 1 + 0.3 * torch.randn(head_dim, generator=gen)
    qk = QKTransform(RotaryEmbedding(head_dim, rot_dim, 256, 10000.0), *norm_pair)
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
    layer.k_cache, layer.v_cache = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    positions = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)])
    slots = torch.cat([torch.tensor([tables[s][p // block_size] * block_size + p % block_size
                                     for p in range(c, c + q)]) for s, (c, q) in enumerate(zip(ctx_lens, q_lens))])
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             block_tables=torch.tensor(tables, dtype=torch.int32), slot_mapping=slots,
                             max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                             **context_split(q_lens, seq_lens, torch.device("cpu")))
    qkv = torch.randn(len(positions), (layer.num_heads + 2 * kv_heads) * head_dim, generator=gen)
    return meta, qkv, positions


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under the interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("options", [{}, {"norms": True, "rot_dim": 16}, {"window": 9, "sinks": True}])
def test_mixed_step_through_the_backend_equals_the_paged_only_path(monkeypatch, options):
    """One fresh prompt, a chunk with cached context, two decodes and a one-token fresh prompt: the
    split path (paged kernel on a seq_order subset + contiguous kernel) equals the paged kernel
    alone, and stores the same cache."""
    import dataclasses

    from atom_core.model_ops.attention_backends import PagedMHABackend
    from atom_core.model_ops.forward_context import set_attention_metadata

    layer = make_layer(**options)
    meta, qkv, positions = mixed_step(layer, ctx_lens=[0, 20, 40, 9, 0], q_lens=[37, 25, 1, 1, 1])
    assert meta.fresh_seq_ids.tolist() == [0, 4] and meta.paged_seq_ids.tolist() == [1, 2, 3]
    backend = PagedMHABackend("cuda")  # the Triton provider; CPU tensors under the interpreter
    caches = layer.k_cache.clone(), layer.v_cache.clone()
    calls = []
    monkeypatch.setattr(pa, "prefill_attention", lambda *a, _f=pa.prefill_attention, **kw: calls.append(1) or _f(*a, **kw))
    pa.set_prefill_attention_mode("contiguous")
    try:
        with set_attention_metadata(meta):
            got = backend.forward(layer, qkv, positions)
    finally:
        pa.set_prefill_attention_mode("paged")
    split_caches = layer.k_cache, layer.v_cache
    layer.k_cache, layer.v_cache = caches
    with set_attention_metadata(dataclasses.replace(meta, fresh_seq_ids=None, paged_seq_ids=None)):
        want = backend.forward(layer, qkv, positions)
    assert calls == [1]
    assert rel_err(got, want) < 1e-5
    assert torch.equal(split_caches[0], layer.k_cache) and torch.equal(split_caches[1], layer.v_cache)


def test_split_path_is_off_by_default_and_skips_fp8_caches_and_the_cpu(monkeypatch):
    from atom_core.model_ops.attention_backends import PagedMHABackend

    monkeypatch.setattr(pa, "_mode", "paged")
    assert PagedMHABackend("cuda")._contiguous_prefill() is None
    monkeypatch.setattr(pa, "_mode", "contiguous")
    assert PagedMHABackend("cuda")._contiguous_prefill() is pa
    assert PagedMHABackend("cpu")._contiguous_prefill() is None  # the reference path stays paged


class TestContextSplitMetadata:
    def test_fresh_and_paged_sequences(self):
        from atom_core.worker.batch_builder import context_split

        split = context_split([5, 1, 3, 1, 4], [5, 30, 10, 1, 4], torch.device("cpu"))
        assert split["fresh_seq_ids"].tolist() == [0, 3, 4] and split["fresh_max_query_len"] == 5
        assert split["paged_seq_ids"].tolist() == [1, 2] and split["paged_max_query_len"] == 3  # longest first
        assert split["fresh_seq_ids"].dtype == torch.int32

    def test_no_fresh_sequence_keeps_todays_metadata(self):
        from atom_core.worker.batch_builder import context_split

        assert context_split([3, 1], [10, 4], torch.device("cpu")) == {}
        assert "paged_seq_ids" not in context_split([3, 2], [3, 2], torch.device("cpu"))

    def test_the_batch_builder_fills_them(self, tiny_llama, monkeypatch):
        """Real engine steps: two fresh prompts in the first step, then a chunk with context and a decode."""
        from atom_core import LLMEngine, SamplingParams
        from atom_core.worker import batch_builder, model_runner

        seen = []

        def spy(*args, **kwargs):
            flat = batch_builder.build_flat_batch(*args, **kwargs)
            seen.append([None if t is None else t.tolist() for t in (flat.attn.fresh_seq_ids, flat.attn.paged_seq_ids)])
            return flat

        monkeypatch.setattr(model_runner, "build_flat_batch", spy)
        engine = LLMEngine(str(tiny_llama), max_num_batched_tokens=16)
        engine.generate([[5] * 12, [7] * 30], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert seen[0] == [[0, 1], None]  # 12 + the first 4 of 30
        assert seen[1] == [None, None]  # a decode and a chunk with context: today's metadata


class TestSwitch:
    def test_env_var_parses(self):
        from atom_core.envs import read_envs

        assert read_envs({}).prefill_attention == "paged"
        assert read_envs({"ATOM_PREFILL_ATTENTION": " Contiguous "}).prefill_attention == "contiguous"

    def test_env_var_sets_the_mode_at_import_and_bad_values_fail_clearly(self):
        code = "from atom_core.kernels.triton import prefill_attention as p; print(p.prefill_attention_mode())"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ATOM_", "TRITON_INTERPRET"))}
        run = lambda value: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,  # noqa: E731
                                           env={**env, "ATOM_PREFILL_ATTENTION": value})
        assert run("contiguous").stdout.strip() == "contiguous"
        assert run("").stdout.strip() == "paged"
        bad = run("flash")
        assert bad.returncode != 0 and "invalid ATOM_PREFILL_ATTENTION='flash'; expected one of: paged, contiguous" in bad.stderr

    def test_setter_refuses_unknown_modes(self):
        with pytest.raises(ValueError, match="unknown prefill attention 'flash'; expected one of: paged, contiguous"):
            pa.set_prefill_attention_mode("flash")
