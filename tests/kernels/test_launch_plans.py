"""Launch plans of the attention wrappers (paged attention, qkv_rope_store, prefill attention): made and
validated on the first call with given inputs, reused by the next layers of the step (same metadata tensors, same-shaped
caches), and never reused where a checked property changed. No kernel runs here (CPU, no interpreter):
the plan functions are what the wrappers call before launching."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from atom_core.kernels.triton import attention, common, prefill_attention, qkv_prep  # noqa: E402

H, KH, D, NB, BS = 8, 2, 64, 16, 16


def paged_inputs(num_seqs: int = 3, q_len: int = 1):
    T = num_seqs * q_len
    return dict(
        query=torch.zeros(T, H, D, dtype=torch.bfloat16),
        k_cache=torch.zeros(NB, BS, KH, D, dtype=torch.bfloat16),
        v_cache=torch.zeros(NB, BS, KH, D, dtype=torch.bfloat16),
        block_tables=torch.zeros(num_seqs, 4, dtype=torch.int32),
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32) * q_len,
        seq_lens=torch.full((num_seqs,), 40, dtype=torch.int32),
        out=None, scale=0.125, max_query_len=q_len, max_seq_len=40, num_kv_splits=None, seq_order=None,
        heads_inner=None, sliding_window=None, sinks=None, k_scale=1.0, v_scale=1.0,
    )


def plan(**kw):
    return attention._paged_plan(**kw)


def test_the_layers_of_a_step_share_one_plan():
    attention._PLANS.clear()
    layer0 = paged_inputs()
    first = plan(**layer0)
    # the next layer: its own caches and query (same layouts), the step's metadata tensors
    layer1 = {**layer0, "query": torch.zeros_like(layer0["query"]), "k_cache": torch.zeros_like(layer0["k_cache"]),
              "v_cache": torch.zeros_like(layer0["v_cache"])}
    assert plan(**layer1) is first
    assert first.grid is not None and first.num_listed == 3


def test_new_metadata_or_host_ints_make_a_new_plan():
    attention._PLANS.clear()
    base = paged_inputs()
    first = plan(**base)
    assert plan(**{**base, "seq_lens": base["seq_lens"].clone()}) is not first  # the next step's metadata
    assert plan(**{**base, "max_seq_len": 400}) is not first
    assert plan(**{**base, "scale": 0.5}) is not first


@pytest.mark.parametrize("change,match", [
    (lambda kw: {**kw, "out": torch.zeros(kw["query"].shape, dtype=torch.float16)}, "out must be"),
    (lambda kw: {**kw, "k_cache": torch.zeros(NB, BS, KH, D, dtype=torch.float16)}, "must match"),
    (lambda kw: {**kw, "query": torch.zeros(3, H, D + 8, dtype=torch.bfloat16)}, "does not fit"),
    (lambda kw: {**kw, "k_cache": torch.zeros(NB, BS, KH, 2 * D, dtype=torch.bfloat16)[..., ::2]}, "contiguous"),
])
def test_a_changed_checked_property_is_checked_again(change, match):
    attention._PLANS.clear()
    base = paged_inputs()
    plan(**base)
    with pytest.raises(ValueError, match=match):
        plan(**change(base))


def test_the_memo_is_bounded():
    attention._PLANS.clear()
    for _ in range(attention._MAX_PLANS + 5):
        plan(**paged_inputs())  # new metadata tensors each time
    assert len(attention._PLANS) <= attention._MAX_PLANS


def qkv_inputs(T: int = 5):
    return dict(qkv=torch.zeros(T, (H + 2 * KH) * D, dtype=torch.bfloat16), positions=torch.zeros(T, dtype=torch.int64),
                cos_sin_cache=torch.zeros(64, D, dtype=torch.float32),
                k_cache=torch.zeros(NB, BS, KH, D, dtype=torch.bfloat16),
                v_cache=torch.zeros(NB, BS, KH, D, dtype=torch.bfloat16),
                slot_mapping=torch.zeros(T, dtype=torch.int64))


def qkv_plan_of(monkeypatch, **kw):
    """The plan qkv_rope_store launches with (the launch itself is stubbed out)."""
    seen = {}
    monkeypatch.setattr(common.PlannedLaunch, "__call__", lambda self, tensors, make_call, direct=True: seen.update(
        grid=self.grid, kwargs=make_call()[1]))
    qkv_prep.qkv_rope_store(num_heads=H, **kw)
    return seen


def test_qkv_layers_share_a_plan_and_positions_views_hit_it(monkeypatch):
    qkv_prep._PLANS.clear()
    inputs = qkv_inputs()
    qkv_plan_of(monkeypatch, **inputs)
    assert len(qkv_prep._PLANS) == 1
    static_positions = torch.zeros(64, dtype=torch.int64)
    for _ in range(3):  # piecewise graphs hand each layer a fresh view of the static positions
        seen = qkv_plan_of(monkeypatch, **{**inputs, "positions": static_positions[:5],
                                          "k_cache": torch.zeros_like(inputs["k_cache"])})
    assert len(qkv_prep._PLANS) == 1 and seen["grid"] == (5, 1, 1) and seen["kwargs"]["NUM_KV_HEADS"] == KH


@pytest.mark.parametrize("change,match", [
    (lambda kw: {**kw, "positions": torch.zeros(5, dtype=torch.float32)}, "positions"),
    (lambda kw: {**kw, "positions": torch.zeros(4, dtype=torch.int64)}, "must be \\[5\\]"),
    (lambda kw: {**kw, "cos_sin_cache": torch.zeros(64, D, dtype=torch.bfloat16)}, "cos_sin_cache"),
    (lambda kw: {**kw, "v_cache": torch.zeros(NB, BS, KH + 1, D, dtype=torch.bfloat16)}, "does not hold"),
])
def test_qkv_changed_inputs_are_checked_again(monkeypatch, change, match):
    qkv_prep._PLANS.clear()
    inputs = qkv_inputs()
    qkv_plan_of(monkeypatch, **inputs)
    with pytest.raises(ValueError, match=match):
        qkv_plan_of(monkeypatch, **change(inputs))


def prefill_inputs(T: int = 6):
    return dict(query=torch.zeros(T, H, D, dtype=torch.bfloat16), key=torch.zeros(T, KH, D, dtype=torch.bfloat16),
                value=torch.zeros(T, KH, D, dtype=torch.bfloat16),
                cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int32), seq_ids=torch.tensor([0, 1], dtype=torch.int32),
                scale=0.125, max_query_len=4)


def prefill_launches(monkeypatch, **kw):
    """The grids prefill_attention launches with (the launch itself is stubbed out)."""
    seen = []
    monkeypatch.setattr(common.PlannedLaunch, "__call__",
                        lambda self, tensors, make_call, direct=True: seen.append(self.grid))
    prefill_attention.prefill_attention(**kw)
    return seen


def test_prefill_layers_share_a_plan_that_keeps_its_metadata(monkeypatch):
    prefill_attention._PLANS.clear()
    base = prefill_inputs()
    prefill_launches(monkeypatch, **base)
    layer1 = {**base, "query": torch.zeros_like(base["query"]), "key": torch.zeros_like(base["key"])}
    assert prefill_launches(monkeypatch, **layer1) == [(2 * 1 * KH, 1, 1)]  # 2 sequences x 1 q block x KH
    assert len(prefill_attention._PLANS) == 1
    (plan,) = prefill_attention._PLANS.values()
    assert plan[0][0] is base["cu_seqlens"] and plan[0][1] is base["seq_ids"]  # their ids cannot be reused
    prefill_launches(monkeypatch, **{**base, "seq_ids": torch.tensor([1], dtype=torch.int32)})  # the next step
    assert len(prefill_attention._PLANS) == 2


def test_prefill_changed_inputs_are_checked_again(monkeypatch):
    prefill_attention._PLANS.clear()
    base = prefill_inputs()
    prefill_launches(monkeypatch, **base)
    with pytest.raises(ValueError, match="dtype"):
        prefill_launches(monkeypatch, **{**base, "key": torch.zeros(6, KH, D, dtype=torch.float16),
                                         "value": torch.zeros(6, KH, D, dtype=torch.float16)})
