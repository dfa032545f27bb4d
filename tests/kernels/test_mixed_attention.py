"""A mixed step's decodes and chunks in separate paged-attention launches (the CUDA backend's path).

Runs on the CPU under Triton's interpreter (tiny shapes) and on a GPU (the `gpu` case, Llama-3-8B
heads; written in a session without a GPU, NOT yet run there):
    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_mixed_attention.py -q
Without the interpreter the CPU runs the metadata checks.
"""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from atom_core.kernels import triton as tk  # noqa: E402
from atom_core.kernels.triton import attention  # noqa: E402
from tests.kernels.test_prefill_attention import make_layer, mixed_step  # noqa: E402
from tests.kernels.tolerances import INTERPRET, TOL, rel_err  # noqa: E402

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under the interpreter "
                                                             "(TRITON_INTERPRET=1)")
# A fresh prompt, a chunk with cached context, three decodes and a one-token fresh prompt.
CTX_LENS, Q_LENS = [0, 20, 40, 9, 0, 33], [37, 25, 1, 1, 1, 1]
DECODE_IDS, CHUNK_IDS, FRESH_IDS = [2, 5, 3], [1], [0, 4]  # decodes longest first (seq_lens 41, 34, 10)


def split_ids(query_lens, seq_lens) -> dict:
    from atom_core.worker.batch_builder import context_split

    out = context_split(query_lens, seq_lens)
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in out.items()}


class TestContextSplitKinds:
    def test_decodes_only_or_chunks_only_set_no_kinds(self):
        assert split_ids([1, 1, 1], [10, 30, 5]) == {}
        assert split_ids([3, 4], [10, 20]) == {}
        assert "decode_seq_ids" not in split_ids([1, 1, 7], [10, 30, 7])  # decodes + a fresh prompt

    def test_decodes_and_chunks_without_a_fresh_prompt(self):
        assert split_ids([3, 1, 1, 5], [10, 30, 5, 50]) == {
            "decode_seq_ids": [1, 2], "chunk_seq_ids": [3, 0], "chunk_max_query_len": 5}

    def test_decodes_and_chunks_with_fresh_prompts(self):
        """Sequence 3 is a one-token fresh prompt: fresh, not a decode. Fresh/paged fields as before."""
        got = split_ids([5, 1, 3, 1, 4, 1], [5, 30, 10, 1, 4, 40])
        assert got == {"decode_seq_ids": [5, 1], "chunk_seq_ids": [2], "chunk_max_query_len": 3,
                       "fresh_seq_ids": [0, 3, 4], "fresh_max_query_len": 5,
                       "paged_seq_ids": [5, 1, 2], "paged_max_query_len": 3}

    def test_a_one_token_fresh_prompt_is_no_decode(self):
        got = split_ids([1, 1, 2], [1, 9, 7])
        assert got["fresh_seq_ids"] == [0] and got["decode_seq_ids"] == [1] and got["chunk_seq_ids"] == [2]
        assert split_ids([1, 2], [1, 7]).keys() == {"fresh_seq_ids", "fresh_max_query_len", "paged_seq_ids",
                                                    "paged_max_query_len"}

    def test_the_ids_are_int32(self):
        from atom_core.worker.batch_builder import context_split

        got = context_split([3, 1], [10, 4])
        assert got["decode_seq_ids"].dtype == got["chunk_seq_ids"].dtype == np.int32


# ---------------------------------------------------------------------------------------------
# through the backend


def record_launches(monkeypatch) -> list[tuple[int, list[int] | None]]:
    """(max_query_len, seq_order) of every paged attention launch the backend makes from now on."""
    launches, real = [], tk.paged_attention
    signature = inspect.signature(real)

    def spy(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        order = bound.get("seq_order")
        launches.append((bound["max_query_len"], None if order is None else order.tolist()))
        return real(*args, **kwargs)

    monkeypatch.setattr(tk, "paged_attention", spy)
    return launches


def one_launch_for_the_context(meta):
    """The step's metadata without the decode/chunk lists: one paged launch for every sequence with
    cached context (as a step holding one kind only)."""
    return dataclasses.replace(meta, decode_seq_ids=None, chunk_seq_ids=None)


def paged_only(meta):
    """The step's metadata without any split: one paged launch for every sequence."""
    return dataclasses.replace(meta, fresh_seq_ids=None, paged_seq_ids=None, decode_seq_ids=None,
                               chunk_seq_ids=None)


def run_step(layer, meta, qkv, positions, caches):
    """(output, caches) of one step through the Triton backend from the given starting caches."""
    from atom_core.model_ops.attention_backends import PagedMHABackend
    from atom_core.model_ops.forward_context import set_attention_metadata

    layer.k_cache, layer.v_cache = caches[0].clone(), caches[1].clone()
    with set_attention_metadata(meta):
        out = PagedMHABackend("cuda").forward(layer, qkv, positions)  # CPU tensors: interpreted
    return out, (layer.k_cache, layer.v_cache)


def fp8_layer(layer):
    fp8 = torch.float8_e4m3fn
    layer.k_cache, layer.v_cache = layer.k_cache.to(fp8), layer.v_cache.to(fp8)
    layer.kv_spec = dataclasses.replace(layer.kv_spec, dtype=fp8)
    return layer


@needs_interpreter
@pytest.mark.parametrize("options,kv_splits", [({}, None), ({}, 2), ({"norms": True, "rot_dim": 16}, None),
                                               ({"window": 9, "sinks": True}, 3)])
def test_split_launches_equal_the_single_launch(monkeypatch, options, kv_splits):
    """The decodes (max_query_len 1, their ids) and the chunk (its longest query, its ids) in launches
    of their own, then the fresh prompts (contiguous), equal one launch for the sequences with context
    and one paged launch for all; the cache is stored alike. kv_splits forces split-KV: each merge must
    write only its launch's rows."""
    if kv_splits:
        monkeypatch.setattr(attention, "choose_num_kv_splits", lambda *args: kv_splits)
    layer = make_layer(**options)
    meta, qkv, positions = mixed_step(layer, CTX_LENS, Q_LENS)
    caches = layer.k_cache, layer.v_cache
    launches = record_launches(monkeypatch)
    got, got_caches = run_step(layer, meta, qkv, positions, caches)
    assert launches == [(1, DECODE_IDS), (25, CHUNK_IDS)]
    launches.clear()
    one, one_caches = run_step(layer, one_launch_for_the_context(meta), qkv, positions, caches)
    assert launches == [(25, [1, 2, 5, 3])]
    launches.clear()
    want, want_caches = run_step(layer, paged_only(meta), qkv, positions, caches)
    assert launches == [(37, None)]
    assert rel_err(got, want) < 1e-5 and rel_err(one, want) < 1e-5
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got_caches, want_caches, one_caches))


@needs_interpreter
def test_fp8_cache_split_launches_equal_the_single_launch(monkeypatch):
    """FP8 KV takes no contiguous path: decodes, chunk and fresh prompts are three paged launches
    (the kernel reads FP8 codes alike in each), equal to the single launch."""
    layer = make_layer()
    meta, qkv, positions = mixed_step(layer, CTX_LENS, Q_LENS)
    fp8_layer(layer)
    caches = layer.k_cache, layer.v_cache
    launches = record_launches(monkeypatch)
    got, _ = run_step(layer, meta, qkv, positions, caches)
    assert launches == [(1, DECODE_IDS), (25, CHUNK_IDS), (37, FRESH_IDS)]
    launches.clear()
    want, _ = run_step(layer, one_launch_for_the_context(meta), qkv, positions, caches)
    assert launches == [(37, None)]
    assert rel_err(got, want) < 1e-5 and not want.isnan().any()


def test_the_cpu_reference_path_keeps_one_launch(monkeypatch):
    from atom_core.kernels import torch_ref
    from atom_core.model_ops.attention_backends import PagedMHABackend
    from atom_core.model_ops.forward_context import set_attention_metadata

    layer = make_layer()
    meta, qkv, positions = mixed_step(layer, CTX_LENS, Q_LENS)
    calls = []
    real = torch_ref.paged_attention
    monkeypatch.setattr(torch_ref, "paged_attention", lambda *a, **kw: calls.append(a[7]) or real(*a, **kw))
    with set_attention_metadata(meta):
        PagedMHABackend("cpu").forward(layer, qkv, positions)
    assert calls == [37]


class KernelSpy:
    """Stands in for a Triton kernel: notes each launch's compile key (constexprs, launch options,
    tensor dtypes), then launches the real kernel."""

    def __init__(self, name: str, kernel, keys: set):
        self.name, self.kernel, self.keys = name, kernel, keys

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            options = tuple(sorted((k, str(v)) for k, v in kwargs.items()
                                   if k.isupper() or k in ("num_warps", "num_stages")))
            dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
            self.keys.add((self.name, options, dtypes))
            return self.kernel[grid](*args, **kwargs)
        return launch


@needs_interpreter
@pytest.mark.parametrize("fp8,both_kinds", [(False, True), (True, True), (True, False)])
def test_warm_up_compiles_every_paged_launch_of_a_mixed_step(monkeypatch, fp8, both_kinds):
    """Each paged kernel and merge variant a mixed step launches (decode tile with a seq_order subset,
    chunk tile with a seq_order, split-KV merges; one launch where the step lists one kind) was
    launched by warm-up first."""
    from atom_core.model_ops.attention_backends import PagedMHABackend

    monkeypatch.setattr(attention, "choose_num_kv_splits", lambda *args: 2)
    layer = make_layer()
    meta, qkv, positions = mixed_step(layer, [0, 20, 40, 9], [6, 5, 1, 1])  # chunk 5, fresh 6: warm-up to 8
    if fp8:
        fp8_layer(layer)
    warm, step = set(), set()
    for name in ("_paged_attention_kernel", "_merge_splits_kernel"):
        monkeypatch.setattr(attention, name, KernelSpy(name, getattr(attention, name), warm))
    PagedMHABackend("cuda").warm_up([layer], max_tokens=8, threads=1)
    for name in ("_paged_attention_kernel", "_merge_splits_kernel"):
        getattr(attention, name).keys = step
    caches = layer.k_cache, layer.v_cache
    run_step(layer, meta if both_kinds else one_launch_for_the_context(meta), qkv, positions, caches)
    assert step and step <= warm


# ---------------------------------------------------------------------------------------------
# GPU (written in a session without one: NOT yet run)


@pytest.mark.gpu
def test_llama3_mixed_step_on_cuda_split_equals_single(monkeypatch):
    """Llama-3-8B heads in bf16: a fresh prompt, a 511-token chunk, five decodes (split-KV on their
    own launch: 5 x 8 programs fill no H100) and a one-token fresh prompt."""
    layer = make_layer(heads=32, kv_heads=8, head_dim=128, rot_dim=128, dtype=torch.bfloat16).cuda()
    meta, qkv, positions = mixed_step(layer, ctx_lens=[0, 700, 4000, 1100, 900, 0, 2500, 30],
                                      q_lens=[1500, 511, 1, 1, 1, 1, 1, 1])
    meta = dataclasses.replace(meta, **{f.name: getattr(meta, f.name).cuda() for f in dataclasses.fields(meta)
                                        if isinstance(getattr(meta, f.name), torch.Tensor)})
    for module in (layer.qk.rotary, layer.qk.q_norm, layer.qk.k_norm):  # QKTransform is not a submodule
        if module is not None:
            module.cuda()
    caches = layer.k_cache.cuda(), layer.v_cache.cuda()
    launches = record_launches(monkeypatch)
    got, _ = run_step(layer, meta, qkv.cuda(), positions.cuda(), caches)
    assert launches[:2] == [(1, [2, 6, 3, 4, 7]), (511, [1])]
    want, _ = run_step(layer, paged_only(meta), qkv.cuda(), positions.cuda(), caches)
    assert rel_err(got, want) < TOL[torch.bfloat16]
