"""Multi-LoRA under tensor_parallel_size=2 on the CPU (gloo): each rank cuts its shard of every adapter
(column-parallel: B's rows of its outputs, merged q/k/v and gate/up per slice; row-parallel: A's
columns of its inputs, the partial product summed by the layer's all-reduce), and every adapter's
greedy tokens equal HF transformers + PEFT's."""
from __future__ import annotations

import pytest
import torch

from atom_core.engine.llm_engine import LLMEngine
from atom_core.sampling_params import SamplingParams
from tests.lora.adapters import hf_greedy, make_adapter

MAX_TOKENS = 5
PROMPTS = [[5, 17, 33, 80, 120, 7], [200, 3, 3, 91, 44, 12, 8, 150, 61, 9, 27]]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tp_adapters(lora_base, adapters, tmp_path_factory):
    """all8 (every projection: merged q/k/v and gate/up whole, o/down row-parallel) and q/v only at
    rank 4 (a merged qkv with its k slice left alone)."""
    qv = make_adapter(lora_base, tmp_path_factory.mktemp("qv") / "qv4", rank=4, alpha=4,
                      targets=["q_proj", "v_proj"], seed=5)
    return {"all8": adapters["all8"], "qv4": qv}


@pytest.fixture(scope="module")
def tp2_outputs(lora_base, tp_adapters):
    engine = LLMEngine(str(lora_base), tensor_parallel_size=2, kv_cache_memory_gb=0.02, enable_lora=True,
                       max_loras=2, lora_modules=[f"{n}={p}" for n, p in tp_adapters.items()])
    try:
        outputs = {name: [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY, lora=name)]
                   for name in [None, *tp_adapters]}
        jobs = [engine.add_request(PROMPTS[i % 2], GREEDY, lora=name)[0]  # both adapters and the base in one step
                for i, name in enumerate([None, *tp_adapters])]
        done = {}
        while not engine.is_finished():
            done |= {s.request_id: s.as_dict()["token_ids"] for s in engine.step() if s.finished}
        outputs["mixed"] = [done[i] for i in jobs]
    finally:
        engine.shutdown()
    return outputs


@pytest.mark.parametrize("name", [None, "all8", "qv4"])
def test_tp2_adapter_matches_hf_peft(lora_base, tp_adapters, tp2_outputs, name):
    assert tp2_outputs[name] == hf_greedy(lora_base, tp_adapters.get(name), PROMPTS, MAX_TOKENS)


def test_tp2_mixed_step_equals_each_alone(tp_adapters, tp2_outputs):
    alone = [tp2_outputs[name][i % 2] for i, name in enumerate([None, *tp_adapters])]
    assert tp2_outputs["mixed"] == alone
    assert tp2_outputs["all8"] != tp2_outputs[None] and tp2_outputs["qv4"] != tp2_outputs[None]


def _layers(tp_rank: int) -> dict:
    """One of each parallel linear an adapter targets, as rank `tp_rank` of 2 builds it (q/k/v with a
    single kv head, which both ranks keep whole)."""
    from atom_core.model_ops.linear import (
        ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
    )

    tp = dict(tp_size=2, tp_rank=tp_rank)
    return {"qkv": QKVParallelLinear(16, 4, 4, 1, **tp), "gate_up": MergedColumnParallelLinear(16, [12, 12], **tp),
            "column": ColumnParallelLinear(16, 8, **tp), "row": RowParallelLinear(8, 16, **tp)}


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_each_rank_cuts_the_adapter_where_its_layer_cuts_the_weight(tp_rank):
    """An adapter whose B (column-parallel) or A (row-parallel) is a sub-projection's whole weight:
    the rank's shard of it equals the rows / columns its layer loaded of that weight."""
    from atom_core.worker.lora_slots import _shard

    torch.manual_seed(tp_rank)
    for kind, layer in _layers(tp_rank).items():
        shards = {"qkv": [("q", 16), ("k", 4), ("v", 4)], "gate_up": [(0, 12), (1, 12)]}.get(kind, [(None, 8)])
        offset = 0
        for shard, rows in shards:
            weight = torch.randn(16, 8) if kind == "row" else torch.randn(rows, 16)
            layer.weight_loader(layer.weight, weight, shard)
            if kind == "row":
                a, b = _shard(layer, weight, torch.randn(16, 16), shard)  # A [r=16, in=8]
                assert torch.equal(a, layer.weight.data) and b.shape == (16, 16)
                continue
            a, b = _shard(layer, torch.randn(16, 16), weight, shard)  # B [out, r=16]
            loaded = layer.weight.data[offset:offset + b.shape[0]]
            assert torch.equal(b, loaded), (kind, shard)
            offset += b.shape[0]
        assert offset in (0, layer.weight.shape[0]), kind
