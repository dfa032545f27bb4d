"""Quantization formats, detected once from the checkpoint's `quantization_config`.

Every format is a `QuantConfig` registered in `_QUANT_CONFIGS` under its quant_method name
(compressed-tensors, gptq, awq, fp8, mxfp4), imported on first use; a checkpoint without a
`quantization_config` runs the unquantized methods. `--quantization fp8` quantizes an unquantized
checkpoint at load (_ONLINE_QUANTIZATIONS).
"""
from __future__ import annotations

from atom_core.quant.base import QuantConfig, QuantMethod, set_weight_attrs
from atom_core.quant.unquantized import UnquantizedFusedMoEMethod, UnquantizedLinearMethod

# quant_method name (as in quantization_config / --quantization) -> QuantConfig class, or
# "module:Class" imported on first use, so a checkpoint imports only its own format's module
_QUANT_CONFIGS: dict[str, type[QuantConfig] | str] = {
    "compressed-tensors": "atom_core.quant.compressed_tensors:CompressedTensorsConfig",
    "gptq": "atom_core.quant.gptq:GPTQConfig",
    "awq": "atom_core.quant.awq:AWQConfig",
    "fp8": "atom_core.quant.fp8:Fp8Config",
    "mxfp4": "atom_core.quant.mxfp4:Mxfp4Config",
}


# formats that `--quantization` may apply to an unquantized checkpoint (quantized at load)
_ONLINE_QUANTIZATIONS = frozenset({"fp8"})


def _config_class(method: str) -> type[QuantConfig]:
    entry = _QUANT_CONFIGS[method]
    if isinstance(entry, str):
        import importlib

        module, _, cls = entry.partition(":")
        entry = _QUANT_CONFIGS[method] = getattr(importlib.import_module(module), cls)
    return entry


def supported_quantizations() -> list[str]:
    return sorted(_QUANT_CONFIGS)


def _unsupported(method: str, source: str) -> ValueError:
    supported = ", ".join(supported_quantizations()) or "none (unquantized checkpoints only)"
    return ValueError(f"unsupported quantization {method!r} ({source}); supported: {supported}")


def get_quant_config(hf_config, override: str | None = None) -> QuantConfig | None:
    """The checkpoint's QuantConfig, or None for an unquantized model.

    `override` is `--quantization`: it must name a supported method, and must agree with the
    checkpoint's own `quantization_config` when it has one; on an unquantized checkpoint only
    an online format (fp8) is accepted.
    """
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    method = str(qc.get("quant_method", "")).lower() if qc else None
    if override is not None:
        if override not in _QUANT_CONFIGS:
            raise _unsupported(override, "--quantization")
        if method is not None and method != override:
            raise ValueError(f"--quantization {override!r} does not match the checkpoint's "
                             f"quantization_config quant_method {method!r}")
        if method is None and override not in _ONLINE_QUANTIZATIONS:
            raise ValueError(f"--quantization {override!r} needs a checkpoint quantized in that format (this one has "
                             f"no quantization_config); formats that quantize an unquantized checkpoint at load: "
                             f"{', '.join(sorted(_ONLINE_QUANTIZATIONS))}")
        return _config_class(override).from_config(qc or {})
    if method is None:
        return None
    if method not in _QUANT_CONFIGS:
        raise _unsupported(method or "(no quant_method)", "config.json quantization_config")
    return _config_class(method).from_config(qc)


__all__ = [
    "QuantConfig", "QuantMethod", "UnquantizedFusedMoEMethod", "UnquantizedLinearMethod", "get_quant_config",
    "set_weight_attrs", "supported_quantizations",
]
