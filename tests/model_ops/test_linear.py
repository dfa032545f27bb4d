"""Linear layers: parameters from the quant method, packed-shard loading, dtype rules, and the
tensor-parallel slicing (the layout only: no collective exists yet)."""
import pytest
import torch
import torch.nn.functional as F

from atom_core.model_ops.linear import (
    ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear,
    copy_weight,
)
from atom_core.quant import UnquantizedLinearMethod

gen = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=gen)


class TestUnquantized:
    def test_default_method_is_f_linear(self):
        layer = ReplicatedLinear(8, 4, bias=True)
        assert isinstance(layer.quant_method, UnquantizedLinearMethod)
        w, b, x = rand(4, 8), rand(4), rand(3, 8)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=0, atol=0)

    def test_params_dtype_overrides_the_default(self):
        layer = ReplicatedLinear(8, 4, params_dtype=torch.float64)
        assert layer.weight.dtype == torch.float64


class TestPackedShards:
    def test_qkv_shards_land_in_order(self):
        layer = QKVParallelLinear(16, head_dim=4, num_heads=4, num_kv_heads=2)
        q, k, v = rand(16, 16), rand(8, 16), rand(8, 16)
        for shard, t in (("v", v), ("q", q), ("k", k)):
            layer.weight_loader(layer.weight, t, shard)
        assert torch.equal(layer.weight, torch.cat([q, k, v]))

    def test_gate_up_shards_land_in_order(self):
        layer = MergedColumnParallelLinear(8, [6, 6], bias=True)
        gate, up = rand(6, 8), rand(6, 8)
        layer.weight_loader(layer.weight, up, 1)
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.bias, torch.arange(6.0), 1)
        layer.weight_loader(layer.bias, -torch.arange(6.0), 0)
        assert torch.equal(layer.weight, torch.cat([gate, up]))
        assert torch.equal(layer.bias, torch.cat([-torch.arange(6.0), torch.arange(6.0)]))

    def test_wrong_shape_is_an_error(self):
        layer = MergedColumnParallelLinear(8, [6, 6])
        with pytest.raises(ValueError, match=r"shape \(6, 7\) != parameter \(6, 8\)"):
            layer.weight_loader(layer.weight, rand(6, 7), 0)

    def test_plain_layer_refuses_a_shard_id(self):
        layer = ColumnParallelLinear(8, 4, prefix="lm.x")
        with pytest.raises(ValueError, match="'lm.x' has no packed shards"):
            layer.weight_loader(layer.weight, rand(4, 8), 0)


class TestDtypeRules:
    def test_plain_floats_convert(self):
        dst = torch.empty(3, dtype=torch.float32)
        copy_weight(dst, torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
        assert dst.tolist() == [1.0, 2.0, 3.0]

    @pytest.mark.parametrize("dst_dtype,src_dtype", [(torch.int32, torch.float32), (torch.int32, torch.int64),
                                                     (torch.float8_e4m3fn, torch.bfloat16),
                                                     (torch.bfloat16, torch.float8_e4m3fn)])
    def test_other_dtypes_must_match_exactly(self, dst_dtype, src_dtype):
        with pytest.raises(ValueError, match=f"dtype {src_dtype} cannot load into a {dst_dtype} parameter"):
            copy_weight(torch.empty(2, dtype=dst_dtype), torch.zeros(2, dtype=src_dtype))

    def test_exact_integer_bits_are_kept(self):
        dst = torch.empty(2, dtype=torch.int32)
        copy_weight(dst, torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32))
        assert dst.tolist() == [-(2**31), 2**31 - 1]


class TestTensorParallelSlicing:
    """Each rank loads its slice of the whole checkpoint tensor; the slices rebuild the full product."""

    def test_column_ranks_concatenate_to_the_full_output(self):
        w, b, x = rand(8, 6), rand(8), rand(3, 6)
        outs = []
        for rank in range(2):
            layer = ColumnParallelLinear(6, 8, bias=True, tp_size=2, tp_rank=rank)
            layer.weight_loader(layer.weight, w)
            layer.weight_loader(layer.bias, b)
            outs.append(layer(x))
        torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, w, b))

    def test_row_ranks_sum_to_the_full_output(self):
        w, x = rand(4, 8), rand(3, 8)
        partial = []
        for rank in range(2):
            layer = RowParallelLinear(8, 4, tp_size=2, tp_rank=rank)
            layer.weight_loader(layer.weight, w)
            partial.append(layer(x[:, rank * 4:(rank + 1) * 4]))
        torch.testing.assert_close(partial[0] + partial[1], F.linear(x, w))

    def test_row_bias_is_loaded_whole(self):
        layer = RowParallelLinear(8, 4, bias=True, tp_size=2, tp_rank=1)
        layer.weight_loader(layer.bias, torch.arange(4.0))
        assert layer.bias.tolist() == [0.0, 1.0, 2.0, 3.0]

    def test_merged_rank_takes_its_part_of_each_shard(self):
        gate, up = rand(6, 4), rand(6, 4)
        layer = MergedColumnParallelLinear(4, [6, 6], tp_size=2, tp_rank=1)
        layer.weight_loader(layer.weight, gate, 0)
        layer.weight_loader(layer.weight, up, 1)
        assert torch.equal(layer.weight, torch.cat([gate[3:], up[3:]]))

    def test_qkv_replicates_kv_heads_when_ranks_outnumber_them(self):
        head_dim, q, k, v = 2, rand(8, 4), rand(2, 4), rand(2, 4)  # 4 q heads, 1 kv head, 4 ranks
        for rank in range(4):
            layer = QKVParallelLinear(4, head_dim, num_heads=4, num_kv_heads=1, tp_size=4, tp_rank=rank)
            for shard, t in (("q", q), ("k", k), ("v", v)):
                layer.weight_loader(layer.weight, t, shard)
            assert torch.equal(layer.weight, torch.cat([q[rank * 2:(rank + 1) * 2], k, v]))
