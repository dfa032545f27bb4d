"""compressed-tensors (`quant_method: compressed-tensors`, llm-compressor's output).

The config holds `config_groups`, each a scheme (`targets`, `weights`, `input_activations`,
`format`), plus an `ignore` list; a target or ignore entry is a module class name ("Linear"),
an exact module name, or "re:<regex>" matched from the name's start. Schemes run here:

  int-quantized   W8A8 INT8: int8 weights per channel, activations int8 per token (dynamic)
  pack-quantized  W4A16: int4 weights in groups of 32/64/128 (or per channel), symmetric or
                  asymmetric (zero points)
  float-quantized FP8 (FP8_DYNAMIC, FP8): e4m3 weights per channel or per tensor; activations
                  e4m3 per token (dynamic) or per tensor (static input_scale)
  kv_cache_scheme float8 per tensor, static: calibrated self_attn.k_scale / v_scale, which the
                  attention layers load and an FP8 KV cache (--kv-cache-dtype fp8) uses

Anything else (static INT8 activation scales, FP8 weights without FP8 activations, act-order g_idx, sparsity, KV-cache schemes, other
bit widths, MoE experts in any scheme but pack-quantized W4A16 symmetric groups, see quant/int4_moe.py)
fails at start with a message naming it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from atom_core.quant.base import MoELayer, QuantConfig, QuantMethod
from atom_core.quant.fp8 import Fp8ScaledLinearMethod
from atom_core.quant.int4 import CompressedTensorsW4A16Method
from atom_core.quant.int8 import Int8W8A8LinearMethod

# Our fused layers -> the checkpoint modules packed into them (the models' stacked_params_mapping).
PACKED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class QuantArgs:
    """One tensor's quantization (compressed-tensors QuantizationArgs, the fields we read)."""

    num_bits: int
    type: str  # int | float
    symmetric: bool
    strategy: str | None  # tensor | channel | group | token | block
    group_size: int | None
    dynamic: bool
    actorder: str | None

    @classmethod
    def parse(cls, d: dict | None) -> "QuantArgs | None":
        if d is None:
            return None
        return cls(num_bits=int(d.get("num_bits", 8)), type=str(d.get("type", "int")),
                   symmetric=bool(d.get("symmetric", True)), strategy=d.get("strategy"),
                   group_size=d.get("group_size"), dynamic=bool(d.get("dynamic", False)), actorder=d.get("actorder"))

    def describe(self) -> str:
        group = f" group_size={self.group_size}" if self.group_size else ""
        return (f"{self.type}{self.num_bits} {self.strategy}{group} "
                f"{'symmetric' if self.symmetric else 'asymmetric'}{' dynamic' if self.dynamic else ''}")


@dataclass(frozen=True)
class Scheme:
    name: str  # the config group's name
    targets: tuple[str, ...]
    format: str
    weights: QuantArgs | None
    input_activations: QuantArgs | None

    def make_method(self) -> QuantMethod:
        """The linear method for this scheme; ValueError naming what is unsupported."""
        w, a = self.weights, self.input_activations
        if w is None:
            raise self._unsupported("no weight quantization")
        if self.format == "int-quantized":
            if (w.type, w.num_bits, w.strategy, w.symmetric) != ("int", 8, "channel", True):
                raise self._unsupported(f"weights {w.describe()} (expected int8 channel symmetric)")
            if a is None or (a.type, a.num_bits, a.strategy, a.symmetric, a.dynamic) != ("int", 8, "token", True, True):
                acts = "none" if a is None else a.describe()
                raise self._unsupported(f"input activations {acts} (expected int8 token symmetric dynamic)")
            return Int8W8A8LinearMethod()
        if self.format == "pack-quantized":
            if a is not None:
                raise self._unsupported(f"quantized input activations {a.describe()} with packed int4 weights")
            if w.type != "int" or w.num_bits != 4 or w.strategy not in ("group", "channel"):
                raise self._unsupported(f"weights {w.describe()} (expected int4 group or channel)")
            if w.actorder == "group":
                raise self._unsupported("actorder 'group' (weight_g_idx)")
            return CompressedTensorsW4A16Method(w.group_size if w.strategy == "group" else None, w.symmetric)
        if self.format == "float-quantized":
            if (w.type, w.num_bits, w.symmetric) != ("float", 8, True) or w.strategy not in ("tensor", "channel"):
                raise self._unsupported(f"weights {w.describe()} (expected float8 tensor or channel symmetric)")
            fp8_acts = {("float", 8, "token", True, True), ("float", 8, "tensor", True, False)}
            if a is None or (a.type, a.num_bits, a.strategy, a.symmetric, a.dynamic) not in fp8_acts:
                acts = "none" if a is None else a.describe()
                raise self._unsupported(f"input activations {acts} (expected float8 token dynamic or float8 "
                                        f"tensor static)")
            return Fp8ScaledLinearMethod(per_tensor_weight=w.strategy == "tensor", static_input=not a.dynamic)
        raise self._unsupported("format")

    def _unsupported(self, what: str) -> ValueError:
        return ValueError(f"compressed-tensors config group {self.name!r} (format {self.format!r}): unsupported "
                          f"{what}; supported schemes: int-quantized W8A8 (int8 channel weights, dynamic int8 "
                          f"per-token activations), pack-quantized W4A16 (int4 group/channel weights), float-quantized FP8 "
                          f"(float8 tensor/channel weights, float8 dynamic per-token or static per-tensor "
                          f"activations)")


def matches(target: str, name: str, class_names: tuple[str, ...]) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target in class_names


class CompressedTensorsConfig(QuantConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: list[Scheme], ignore: list[str]):
        self.schemes, self.ignore = schemes, ignore

    @classmethod
    def from_config(cls, qc: dict) -> "CompressedTensorsConfig":
        if not qc.get("config_groups"):
            raise ValueError("compressed-tensors quantization_config has no config_groups")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors quantization_status {status!r} is not supported; "
                             f"expected 'compressed' (save with save_compressed=True)")
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise ValueError(f"compressed-tensors {key} is not supported (got {qc[key]!r})")
        kv = QuantArgs.parse(qc.get("kv_cache_scheme"))
        if kv is not None and (kv.type, kv.num_bits, kv.strategy, kv.dynamic) != ("float", 8, "tensor", False):
            raise ValueError(f"compressed-tensors kv_cache_scheme {kv.describe()} is not supported; float8 tensor "
                             f"static scales (self_attn.k_scale / v_scale) are, used with --kv-cache-dtype fp8")
        schemes = []
        for name, group in qc["config_groups"].items():
            if group.get("output_activations"):
                raise ValueError(f"compressed-tensors config group {name!r}: output activation quantization "
                                 f"is not supported")
            scheme = Scheme(name, tuple(group.get("targets", ())), group.get("format") or qc.get("format"),
                            QuantArgs.parse(group.get("weights")), QuantArgs.parse(group.get("input_activations")))
            scheme.make_method()  # an unsupported scheme fails here, at start
            schemes.append(scheme)
        config = cls(schemes, list(qc.get("ignore") or []))
        if config._scheme_of("lm_head") is not None:  # our LM head is never quantized
            raise ValueError("compressed-tensors with a quantized lm_head is not supported (add lm_head to ignore "
                             "when quantizing)")
        return config

    def _scheme_of(self, name: str) -> Scheme | None:
        """The scheme of checkpoint module `name` (a Linear), or None when it stays unquantized."""
        classes = ("Linear",)
        if any(matches(t, name, classes) for t in self.ignore):
            return None
        hits = [s for s in self.schemes if any(matches(t, name, classes) for t in s.targets)]
        return hits[0] if hits else None

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        if isinstance(layer, MoELayer):
            from atom_core.quant.int4_moe import compressed_tensors_moe_method

            scheme = self._scheme_of(f"{prefix}.0.gate_proj")  # experts are quantized as their first Linear is
            return None if scheme is None else compressed_tensors_moe_method(scheme, prefix)
        head, _, leaf = prefix.rpartition(".")
        names = [f"{head}.{m}" if head else m for m in PACKED_MODULES.get(leaf, (leaf,))]
        schemes = {n: self._scheme_of(n) for n in names}
        if len(set(schemes.values())) > 1:
            raise ValueError(f"{prefix}: the modules fused into this layer are quantized differently "
                             f"({', '.join(f'{n}: {s.name if s else None}' for n, s in schemes.items())})")
        scheme = schemes[names[0]]
        return None if scheme is None else scheme.make_method()
