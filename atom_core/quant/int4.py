"""W4A16 linear methods: int4 weights in groups along K, bf16/fp16/fp32 activations.

Each checkpoint format (compressed-tensors pack-quantized, GPTQ, AWQ) registers its own
tensors under their checkpoint names and layouts, and after loading repacks them into the one
canonical layout of `quant/int_ops.py` (w4_qweight [N, K/8], w4_scales [N, G], w4_zeros [N, G]
or None), stores w4_qweight in the kernel layout (`int_ops.interleave_int4`; w4_interleave says
which) and `apply` hands them to the W4A16 GEMM.

Tensor parallelism: the methods take the per-rank sizes the layer passes. A column-parallel
layer splits N (packed-along-N tensors split in units of 8 columns); a row-parallel one splits K
in whole groups (and whole int32 words), so a rank's K must be a multiple of the group size.
"""
from __future__ import annotations

import torch
from torch import nn

from atom_core.quant.base import QuantMethod, copy_weight, set_weight_attrs
from atom_core.quant.int_ops import INT4_PER_INT32, interleave_for, interleave_int4, pack_int4, unpack_int4, w4a16_gemm

# AWQ's GEMM layout packs 8 output columns per word in this order: nibble i holds column AWQ_ORDER[i].
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _param(layer: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype, loader, **dims) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(param, weight_loader=loader, **{k: v for k, v in dims.items() if v is not None})
    layer.register_parameter(name, param)
    return param


def packed_output_loader(layer: nn.Module):
    """A loader for tensors packed 8 int4 columns per int32 along the output dim (zero points,
    AWQ weights): the layer's packed-shard and tensor-parallel ranges, in words."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # the layer's rank slice counts in the parameter's own (packed) units
            layer.weight_loader(param, loaded)
            return
        dim = param.output_dim
        offset, size, start = layer._shard_range(shard_id, loaded.shape[dim] * INT4_PER_INT32)
        if offset % INT4_PER_INT32 or size % INT4_PER_INT32 or start % INT4_PER_INT32:
            raise ValueError(f"{layer.prefix}: shard {shard_id!r} ({size} outputs at {start}) does not align "
                             f"with the 8 columns an int32 packs; int4 zero points need multiples of 8")
        p = INT4_PER_INT32
        copy_weight(param.data.narrow(dim, offset // p, size // p), loaded.narrow(dim, start // p, size // p))

    return load


def shared_tensor_loader(layer: nn.Module):
    """A loader for per-layer tensors each packed shard repeats (g_idx): every shard's copy is
    loaded (they must agree), sliced to this rank along the input dim."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        layer.weight_loader(param, loaded)

    return load


def _check_group(prefix: str, input_size: int, group_size: int) -> None:
    if input_size % group_size or input_size % INT4_PER_INT32:
        raise ValueError(f"{prefix}: input size {input_size} (per tensor-parallel rank) is not a multiple of the "
                         f"int4 group size {group_size} and of 8; this split of the layer is not supported")


class W4A16LinearMethod(QuantMethod):
    """Base: canonical int4 weights -> `w4a16_gemm`. Subclasses declare the checkpoint tensors
    (`create_weights`) and convert them (`_canonical`). group_size None: one group per row."""

    checkpoint_params: tuple[str, ...] = ()

    def __init__(self, group_size: int | None, symmetric: bool):
        self.group_size, self.symmetric = group_size, symmetric

    def _layer_group(self, layer: nn.Module, input_size: int) -> int:
        group = input_size if self.group_size is None else self.group_size
        _check_group(layer.prefix, input_size, group)
        layer.w4_group_size = group
        return group

    def _canonical(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scales, zeros = self._canonical(layer)
        dtype = layer.w4_params_dtype  # the model dtype at construction (the loader runs under float32)
        for name in self.checkpoint_params:
            if hasattr(layer, name):
                delattr(layer, name)
        layer.w4_interleave = interleave_for(qweight.shape[1] * INT4_PER_INT32)  # the GEMV's layout where K allows
        layer.w4_qweight = nn.Parameter(interleave_int4(qweight.contiguous(), layer.w4_interleave), requires_grad=False)
        layer.w4_scales = nn.Parameter(scales.to(dtype).contiguous(), requires_grad=False)
        layer.w4_zeros = None if zeros is None else nn.Parameter(zeros.contiguous(), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return w4a16_gemm(x, layer.w4_qweight, layer.w4_scales, layer.w4_zeros, layer.w4_group_size, bias,
                          layer.w4_interleave)


class CompressedTensorsW4A16Method(W4A16LinearMethod):
    """compressed-tensors `pack-quantized` (llm-compressor W4A16): weight_packed int32 [N, K/8]
    (already canonical: value q in [-8, 7] stored as q + 8), weight_scale [N, G],
    weight_zero_point int32 [N/8, G] packed along N (asymmetric only), weight_shape int64 [2]."""

    checkpoint_params = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int], weight_loader,
                       params_dtype: torch.dtype | None = None) -> None:
        n, group = sum(output_sizes), self._layer_group(layer, input_size)
        layer.w4_params_dtype = params_dtype or torch.get_default_dtype()
        grouped = self.group_size is not None
        _param(layer, "weight_packed", (n, input_size // INT4_PER_INT32), torch.int32, weight_loader,
               output_dim=0, input_dim=1)
        _param(layer, "weight_scale", (n, input_size // group), params_dtype, weight_loader,
               output_dim=0, input_dim=1 if grouped else None)
        if not self.symmetric:
            if any(s % INT4_PER_INT32 for s in output_sizes):
                raise ValueError(f"{layer.prefix}: asymmetric int4 needs output sizes in multiples of 8 "
                                 f"(zero points pack 8 per int32), got {output_sizes}")
            _param(layer, "weight_zero_point", (n // INT4_PER_INT32, input_size // group), torch.int32,
                   packed_output_loader(layer), output_dim=0, input_dim=1 if grouped else None)
        _param(layer, "weight_shape", (2,), torch.int64, self._shape_loader(layer, input_size, output_sizes))

    @staticmethod
    def _shape_loader(layer: nn.Module, input_size: int, output_sizes: list[int]):
        """weight_shape is the unpacked [N, K] of the checkpoint tensor: check it, keep nothing."""
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            k = input_size * (layer.tp_size if layer.tp_dim == 1 else 1)
            if int(loaded[1]) != k:
                raise ValueError(f"{layer.prefix}: checkpoint weight_shape {loaded.tolist()} has K={int(loaded[1])}, "
                                 f"the layer expects {k}")
            copy_weight(param.data, loaded)
        return load

    def _canonical(self, layer):
        zeros = None
        if not self.symmetric:
            zeros = unpack_int4(layer.weight_zero_point.data, 0, layer.weight_packed.shape[0])
        return layer.weight_packed.data, layer.weight_scale.data, zeros


class GPTQW4A16Method(W4A16LinearMethod):
    """GPTQ (AutoGPTQ / GPTQModel, desc_act false): qweight int32 [K/8, N] packed along K,
    qzeros int32 [G, N/8] packed along N storing zero - 1 (checkpoint_format "gptq"; "gptq_v2"
    stores the zero itself), scales [G, N], g_idx int32 [K] (must be k // group_size)."""

    checkpoint_params = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, group_size: int | None, symmetric: bool, zero_offset: int):
        super().__init__(group_size, symmetric)
        self.zero_offset = zero_offset

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int], weight_loader,
                       params_dtype: torch.dtype | None = None) -> None:
        n, group = sum(output_sizes), self._layer_group(layer, input_size)
        layer.w4_params_dtype = params_dtype or torch.get_default_dtype()
        grouped = self.group_size is not None
        if any(s % INT4_PER_INT32 for s in output_sizes):
            raise ValueError(f"{layer.prefix}: GPTQ zero points pack 8 outputs per int32; output sizes {output_sizes}")
        _param(layer, "qweight", (input_size // INT4_PER_INT32, n), torch.int32, weight_loader,
               output_dim=1, input_dim=0)
        _param(layer, "qzeros", (input_size // group, n // INT4_PER_INT32), torch.int32, packed_output_loader(layer),
               output_dim=1, input_dim=0 if grouped else None)
        _param(layer, "scales", (input_size // group, n), params_dtype, weight_loader,
               output_dim=1, input_dim=0 if grouped else None)
        _param(layer, "g_idx", (input_size,), torch.int32, shared_tensor_loader(layer), input_dim=0)

    def _canonical(self, layer):
        k, n = layer.qweight.shape[0] * INT4_PER_INT32, layer.qweight.shape[1]
        group = layer.w4_group_size
        expected = torch.arange(k, device=layer.g_idx.device, dtype=torch.int32) // group
        expected += layer.tp_rank * (k // group) if (layer.tp_dim == 1 and self.group_size is not None) else 0
        if not torch.equal(layer.g_idx.data, expected):
            raise ValueError(f"{layer.prefix}: GPTQ g_idx is not k // group_size (an act-order checkpoint, "
                             f"desc_act true); only desc_act false is supported")
        qweight = pack_int4(unpack_int4(layer.qweight.data, 0).t(), 1)  # [K/8, N] -> [N, K] -> [N, K/8]
        zeros = (unpack_int4(layer.qzeros.data, 1).to(torch.int32) + self.zero_offset) & 0xF
        return qweight, layer.scales.data.t(), zeros.t().to(torch.uint8)


class AWQW4A16Method(W4A16LinearMethod):
    """AWQ GEMM layout (AutoAWQ `version: gemm`): qweight int32 [K, N/8] and qzeros int32
    [G, N/8], both packed along N in AWQ_ORDER, scales [G, N]; W = (q - zero) * scale."""

    checkpoint_params = ("qweight", "qzeros", "scales")

    def create_weights(self, layer: nn.Module, *, input_size: int, output_sizes: list[int], weight_loader,
                       params_dtype: torch.dtype | None = None) -> None:
        n, group = sum(output_sizes), self._layer_group(layer, input_size)
        layer.w4_params_dtype = params_dtype or torch.get_default_dtype()
        if any(s % INT4_PER_INT32 for s in output_sizes):
            raise ValueError(f"{layer.prefix}: AWQ packs 8 outputs per int32; output sizes {output_sizes}")
        _param(layer, "qweight", (input_size, n // INT4_PER_INT32), torch.int32, packed_output_loader(layer),
               output_dim=1, input_dim=0)
        _param(layer, "qzeros", (input_size // group, n // INT4_PER_INT32), torch.int32, packed_output_loader(layer),
               output_dim=1, input_dim=0)
        _param(layer, "scales", (input_size // group, n), params_dtype, weight_loader, output_dim=1, input_dim=0)

    def _canonical(self, layer):
        qweight = pack_int4(unpack_int4(layer.qweight.data, 1, order=AWQ_ORDER).t(), 1)  # [K, N] -> [N, K/8]
        zeros = unpack_int4(layer.qzeros.data, 1, order=AWQ_ORDER)
        return qweight, layer.scales.data.t(), zeros.t()
