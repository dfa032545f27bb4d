"""atom_core's model families through vLLM's model interface: one adapter, parameterised by our class.

`adapter_class(arch)` is `VllmModelAdapter` mixed into the atom_core class the registry
(models/registry.py) names for `arch`, so the module tree, parameter names, kernels and loader
rules are our model's own, and vLLM sees:

- `__init__(*, vllm_config, prefix="")`: our constructor on vLLM's HF config, built under the
  default dtype and device vLLM set, with our quantization detection on that config (the same
  source vLLM's own reads) and our kernel choices (the ATOM_* kernel variables); our tensor-parallel
  group becomes vLLM's (`adopt_tp_group`), so our collectives run over vLLM's ranks and communicators;
  our attention layers are announced to vLLM (plugin/attention.py); on CUDA our decoder layers are
  compiled as our engine compiles them (worker/compile.py: the graph split at attention) unless
  vLLM's compilation is off (`-O0`, `--enforce-eager`), and our piecewise graphs serve the steps
  vLLM runs eagerly (plugin/prefill_graphs.py). vLLM compiles only its own classes: without ours,
  a step past the largest piecewise bucket (a 1,024-token prompt beside the decodes) launches
  each layer's ~11 kernels from Python and the GPU waits on the host.
- `embed_input_ids` (and `get_input_embeddings`, its older name), `forward(input_ids, positions,
  intermediate_tensors=None, inputs_embeds=None)` -> hidden states, `compute_logits(hidden)`.
- `load_weights(weights) -> set[str]`: vLLM's (name, tensor) stream through our loader's name rules
  and parameter loaders, then our quant methods' repacking; returns every parameter's name. With
  vLLM's dummy loader, which never calls it, the repacking runs at the first forward instead.

This module's attributes named after an architecture are those classes (made on first access), so
vLLM's registry imports them lazily as "atom_core.plugin.model_adapter:<architecture>".
"""
from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch
from torch import nn

from atom_core.distributed import adopt_tp_group
from atom_core.kernel_config import building
from atom_core.loader import load_named_tensors, process_weights_after_loading
from atom_core.model_ops.kv_spec import attention_layers, check_attention_supported, finalize_kv_scales, state_layers
from atom_core.models.registry import resolve_model_class, supported_architectures
from atom_core.plugin import kernel_config
from atom_core.quant import get_quant_config

logger = logging.getLogger("vllm.plugins.atom_core")  # under vLLM's logger: printed with vLLM's own lines


def _check_parallelism(parallel_config) -> None:
    """Refuse vLLM's parallel modes our models do not implement (tensor and data parallelism they do)."""
    unsupported = {"pipeline_parallel_size": ("pipeline parallelism", 1),
                   "decode_context_parallel_size": ("decode context parallelism", 1),
                   "enable_expert_parallel": ("expert parallelism", False)}
    for field, (what, default) in unsupported.items():
        value = getattr(parallel_config, field, default)
        if value != default:
            raise ValueError(f"{what} ({field}={value}) is not supported by atom_core's models in vLLM; use "
                             f"{default}, or set ATOM_DISABLE_VLLM_PLUGIN=1 to run vLLM's own model classes")


def _check_lora(vllm_config) -> None:
    """vLLM's LoRA wraps its own layer classes, which our models do not use: refuse it here, before the
    weights load, rather than leave vLLM's "does not support LoRA yet" for a model it does support."""
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ValueError("vLLM's LoRA (--enable-lora) does not run on atom_core's model classes; set "
                         "ATOM_DISABLE_VLLM_PLUGIN=1 to serve adapters with vLLM's own classes, or serve them "
                         "with `atomctl serve --enable-lora`")


def compiles(vllm_config, device: torch.device) -> bool:
    """Whether our decoder layers are compiled in this vLLM: on CUDA (as in our engine, where the CPU
    runs eagerly) unless vLLM runs eagerly or its compilation mode (`-O`, `level` before 0.11) is 0
    or unset (a config vLLM has not resolved)."""
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "mode", None)
    mode = getattr(compilation, "level", None) if mode is None else mode
    compiled = bool(getattr(mode, "value", mode))
    return device.type == "cuda" and not vllm_config.model_config.enforce_eager and compiled


def _adopt_vllm_tp_group() -> None:
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    adopt_tp_group(tuple(group.ranks), group.rank_in_group, group.device_group, group.cpu_group)


class VllmModelAdapter:
    """vLLM's model interface over an atom_core ForCausalLM (mixed in before it: see the module doc).

    `atom_model_class` names the atom_core class; it is what tests and logs read to tell our class
    from vLLM's."""

    atom_model_class: type[nn.Module]

    def __init__(self, *, vllm_config, prefix: str = ""):
        model_config = vllm_config.model_config
        _check_parallelism(vllm_config.parallel_config)
        _check_lora(vllm_config)
        _adopt_vllm_tp_group()
        hf_config = model_config.hf_config
        quant_config = get_quant_config(hf_config, model_config.quantization)
        with building(kernel_config()):
            super().__init__(hf_config, prefix=prefix, quant_config=quant_config)
        device = torch.get_default_device()  # vLLM builds the model under its target device
        from atom_core.plugin.attention import register_attention_layers

        self.kv_bindings = register_attention_layers(self, vllm_config, device)
        if compiles(vllm_config, device):
            from atom_core.worker.compile import compile_model

            compile_model(self)  # after the bindings: the custom ops call the backends they set
        self.prefill_graphs = self._prefill_graphs(vllm_config, device)
        self.weights_processed = False  # our quant methods' repacking done (load_weights, or the first forward)
        check_attention_supported(attention_layers(self), model_config.max_model_len, device)
        logger.info("atom_core's %s (%s) runs %s, attention on atom_core's kernels (%s)",
                    self.atom_model_class.__name__, self.atom_model_class.__module__, hf_config.architectures[0],
                    device.type)

    def _prefill_graphs(self, vllm_config, device: torch.device):
        """Our piecewise graphs for the steps vLLM runs eagerly (plugin/prefill_graphs.py), captured at
        vLLM's first graph capture: none when vLLM runs eagerly (--enforce-eager), off CUDA, and for
        hybrid models (their gated attention layers do not replay correctly in pieces yet, as in
        our engine: worker/model_runner.py)."""
        if device.type != "cuda" or vllm_config.model_config.enforce_eager or not self.kv_bindings \
                or state_layers(self):
            return None
        from atom_core.plugin import compat
        from atom_core.plugin.prefill_graphs import PrefillGraphs

        first = self.kv_bindings[0].layer_name
        graphs = PrefillGraphs(functools.partial(self.atom_model_class.forward, self), attention_layers(self),
                               vllm_config.scheduler_config.max_num_batched_tokens, device,
                               lambda: compat.layer_metadata(first))
        for binding in self.kv_bindings:
            binding.prefill_graphs = graphs
        return graphs

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if intermediate_tensors is not None:
            raise ValueError("atom_core's models in vLLM do not run pipeline parallelism (intermediate_tensors)")
        if inputs_embeds is not None:
            raise ValueError("atom_core's models in vLLM take token ids, not inputs_embeds (prompt embeddings, "
                             "multimodal inputs); set ATOM_DISABLE_VLLM_PLUGIN=1 for those")
        if not self.weights_processed:
            # vLLM's dummy loader (--load-format dummy) fills the parameters without load_weights; the first
            # forward is vLLM's profiling run (eager, before any graph), so the repacking happens there.
            process_weights_after_loading(self)
            self.weights_processed = True
        hidden = self.prefill_graphs.run(input_ids, positions) if self.prefill_graphs is not None else None
        return hidden if hidden is not None else super().forward(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states)

    def load_weights(self, weights) -> set[str]:
        names = load_named_tensors(self, weights, f"(vLLM's weights of {self.config.architectures[0]})")
        process_weights_after_loading(self)
        self.weights_processed = True
        finalize_kv_scales(attention_layers(self))  # a checkpoint's scales (the dummy loader's are random)
        return names


@functools.cache
def adapter_class(architecture: str) -> type[nn.Module]:
    """The vLLM model class of `architecture`: VllmModelAdapter over the atom_core class the
    registry names for it (ValueError listing ours for any other)."""
    model_cls = resolve_model_class(SimpleNamespace(architectures=[architecture]))
    return type(architecture, (VllmModelAdapter, model_cls),
                {"atom_model_class": model_cls, "__module__": __name__, "__qualname__": architecture})


def __getattr__(name: str):
    if name in supported_architectures():
        return adapter_class(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
