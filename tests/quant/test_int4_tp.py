"""Tensor-parallel slicing of INT4/INT8 weights: each rank's layer loads the whole checkpoint
tensors and must hold exactly its slice (columns for column-parallel layers, whole groups of K
for row-parallel ones), checked through the dequantized weight against the full one. Layers are
built with explicit tp_size/tp_rank (no process group needed to load)."""
import pytest
import torch

from atom_core.model_ops.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from atom_core.quant.int_ops import dequantize_int4, pack_int4
from tests.quant.test_gptq_awq import _awq_pack, _gptq_pack

GROUP = 32


def _rtn(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    # [G, N] as the tools hold them; from 1: GPTQ's v1 format stores zero - 1 and cannot hold 0
    zeros = torch.randint(1, 16, (k // GROUP, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(k // GROUP, n, generator=g) * 0.02 + 0.005).half()
    full = (q.float() - zeros.t().float().repeat_interleave(GROUP, 1)) * scales.t().float().repeat_interleave(GROUP, 1)
    return q, zeros, scales, full


def _tensors(fmt, q, zeros, scales):
    n, k = q.shape
    if fmt == "gptq":
        qweight, qzeros = _gptq_pack(q, zeros)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales,
                "g_idx": torch.arange(k, dtype=torch.int32) // GROUP}
    if fmt == "awq":
        qweight, qzeros = _awq_pack(q, zeros)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    # compressed-tensors: weight_packed [N, K/8]; zero points signed (zero - 8), packed along N
    zp = pack_int4(zeros.t().contiguous().to(torch.uint8), 0)
    return {"weight_packed": pack_int4(q.to(torch.uint8), 1), "weight_scale": scales.t().contiguous(),
            "weight_zero_point": zp, "weight_shape": torch.tensor([n, k])}


def _config(fmt):
    from types import SimpleNamespace

    from atom_core.quant import get_quant_config

    qc = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
          "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
          "ct": {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"g": {
              "targets": ["Linear"], "format": "pack-quantized",
              "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": GROUP}}}},
          }[fmt]
    return get_quant_config(SimpleNamespace(quantization_config=qc))


def _load(layer, tensors, shard_id=None):
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        param = params[name]
        param.weight_loader(param, t, **({} if shard_id is None else {"shard_id": shard_id}))


def _dequant(layer):
    layer.quant_method.process_weights_after_loading(layer)
    return dequantize_int4(layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_group_size, layer.w4_interleave)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
@pytest.mark.parametrize("tp", [1, 2])
def test_row_parallel_takes_whole_groups_of_k(fmt, tp):
    q, zeros, scales, full = _rtn(64, 256, seed=tp)  # the tools pack N in multiples of 32
    for rank in range(tp):
        layer = RowParallelLinear(256, 64, quant_config=_config(fmt), prefix="down_proj", tp_size=tp, tp_rank=rank)
        _load(layer, _tensors(fmt, q, zeros, scales))
        k = 256 // tp
        assert torch.equal(_dequant(layer), full[:, rank * k:(rank + 1) * k])


@pytest.mark.parametrize("fmt", ["gptq", "awq", "ct"])
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_column_parallel_shards(fmt, tp):
    """gate_up: two shards of 64 rows each, split over tp ranks (packed-along-N tensors in words)."""
    parts = [_rtn(64, 128, seed=10 + i) for i in range(2)]
    for rank in range(tp):
        layer = MergedColumnParallelLinear(128, [64, 64], quant_config=_config(fmt), prefix="gate_up_proj",
                                           tp_size=tp, tp_rank=rank)
        for shard, (q, zeros, scales, _) in enumerate(parts):
            _load(layer, _tensors(fmt, q, zeros, scales), shard_id=shard)
        n = 64 // tp
        expected = torch.cat([full[rank * n:(rank + 1) * n] for _, _, _, full in parts])
        assert torch.equal(_dequant(layer), expected)


def test_qkv_shards_load_into_their_rows():
    q_part, k_part, v_part = (_rtn(n, 64, seed=20 + i) for i, n in enumerate((64, 32, 32)))
    layer = QKVParallelLinear(64, 16, 4, 2, quant_config=_config("awq"), prefix="qkv_proj", tp_size=1, tp_rank=0)
    for shard, (q, zeros, scales, _) in zip("qkv", (q_part, k_part, v_part)):
        _load(layer, _tensors("awq", q, zeros, scales), shard_id=shard)
    assert torch.equal(_dequant(layer), torch.cat([q_part[3], k_part[3], v_part[3]]))


def test_row_split_inside_a_group_is_a_clear_error():
    with pytest.raises(ValueError, match="not a multiple of the int4 group size"):
        RowParallelLinear(96, 48, quant_config=_config("gptq"), prefix="down_proj", tp_size=2, tp_rank=0)


def test_int8_row_parallel_slices_k():
    from types import SimpleNamespace

    from atom_core.quant import get_quant_config

    qc = get_quant_config(SimpleNamespace(quantization_config={
        "quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"g": {
            "targets": ["Linear"], "format": "int-quantized",
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True}}}}))
    weight = torch.randint(-128, 128, (16, 64), dtype=torch.int8)
    scale = torch.rand(16, 1)
    layer = RowParallelLinear(64, 16, quant_config=qc, prefix="o_proj", tp_size=2, tp_rank=1)
    _load(layer, {"weight": weight, "weight_scale": scale})
    assert torch.equal(layer.weight, weight[:, 32:]) and torch.equal(layer.weight_scale, scale)


def test_scales_take_the_model_dtype_at_construction():
    """build_model restores the default dtype before loading: the repacked scales must still be
    in the model's dtype (bf16 here), not the loader's float32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = RowParallelLinear(256, 64, quant_config=_config("gptq"), prefix="down_proj", tp_size=1, tp_rank=0)
    finally:
        torch.set_default_dtype(old)
    q, zeros, scales, _ = _rtn(64, 256, seed=0)
    _load(layer, _tensors("gptq", q, zeros, scales))
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.w4_scales.dtype == torch.bfloat16
