"""The kit the decoder-only families are built from: attention block, gated MLP, the pre-norm
decoder layer, the layer stack and the causal-LM head. A family file owns its decoder layer
(which attention options and which MLP or MoE each layer gets) and nothing else.

Vision-language models use the same stack with one more input: `forward(input_ids, positions,
mm_embeds)`, where `mm_embeds` (a `MultimodalEmbeds`) replaces the token embeddings of the rows
that hold image placeholders with the encoder's outputs. Such a model sets `supports_images` and
implements `encode_images` (and `mrope_positions` when its rotary is multimodal, Qwen3.5's M-RoPE);
see atom_core/multimodal/README.md."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from atom_core.model_ops.activation import SiluAndMul
from atom_core.model_ops.attention import Attention, QKTransform
from atom_core.model_ops.embed_head import LMHead, VocabEmbedding
from atom_core.model_ops.layernorm import RMSNorm
from atom_core.model_ops.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from atom_core.model_ops.rotary import RotaryEmbedding, rope_parameters
from atom_core.multimodal.inputs import MultimodalItem
from atom_core.quant import QuantConfig


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_index(prefix: str) -> int:
    """The decoder layer's index from its prefix, e.g. "model.layers.3" -> 3."""
    return int(prefix.rsplit(".", 1)[-1])


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The window HF applies to layer `layer_idx`: per-layer `layer_types` where the config has
    them (Qwen3), else the global `sliding_window` (Mistral, Mixtral), which Qwen configs
    already null when `use_sliding_window` is false."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return int(window)


def join_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class AttentionOptions:
    """A family's choices for one layer's attention block (HF reads each from its own field)."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    rotary_dim: int | None = None  # None: the whole head
    sliding_window: int | None = None


@dataclass
class MultimodalEmbeds:
    """One step's encoder outputs: embeds[i] replaces the token embedding of flat row rows[i]."""

    rows: torch.Tensor  # [K] int64, on the model's device
    embeds: torch.Tensor  # [K, hidden] in the model dtype


def merge_multimodal_embeds(hidden: torch.Tensor, mm_embeds: MultimodalEmbeds | None) -> torch.Tensor:
    """The embeddings-input seam: token embeddings [T, hidden] with the image rows replaced."""
    if mm_embeds is None:
        return hidden
    return hidden.index_copy(0, mm_embeds.rows, mm_embeds.embeds.to(hidden.dtype))


class SelfAttention(nn.Module):
    """QKV projection; (q/k-norm, RoPE, KV store, paged attention) in the attention op; o_proj."""

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None, options: AttentionOptions,
                 input_size: int | None = None):
        """input_size: the width q/k/v read (default hidden_size; an EAGLE-3 head's layer reads 2H)."""
        super().__init__()
        self.head_dim = head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.qkv_proj = QKVParallelLinear(input_size or config.hidden_size, head_dim, self.num_heads, self.num_kv_heads,
                                          bias=options.qkv_bias, quant_config=quant_config,
                                          prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(self.num_heads * head_dim, config.hidden_size, bias=options.o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        theta, scaling = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(head_dim, options.rotary_dim or head_dim, config.max_position_embeddings,
                                          theta, scaling)
        if options.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        qk = QKTransform(self.rotary_emb, getattr(self, "q_norm", None), getattr(self, "k_norm", None))
        # This rank's heads (all of them at tp 1; kv heads replicated when fewer than ranks).
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5, self.qkv_proj.num_kv_heads, qk,
                              sliding_window=options.sliding_window, prefix=f"{prefix}.attn")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(self.qkv_proj(hidden), positions))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one weight."""

    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str,
                 quant_config: QuantConfig | None = None, bias: bool = False, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; expected silu")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused into
    the next norm. A family's layer builds `self_attn` and the MLP and passes them here; the
    MLP is registered as `mlp_name`, the name its checkpoints use."""

    mlp_name = "mlp"

    def __init__(self, config, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.add_module(self.mlp_name, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return getattr(self, self.mlp_name)(hidden), residual


class DecoderModel(nn.Module):
    """The layer stack. With `keep_aux_hidden_states` each forward also writes the residual
    stream entering the chosen layers into one persistent buffer (a fixed address, so CUDA
    graph and piecewise replays write it too): what an EAGLE-3 head drafts from."""

    def __init__(self, config, prefix: str, quant_config: QuantConfig | None, layer_cls: type[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer_cls(config, f"{prefix}.layers.{i}", quant_config) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.aux_slots: dict[int, int] = {}  # layer index -> its column block in aux_hidden
        self.aux_hidden: torch.Tensor | None = None  # [max tokens, len(aux_slots) * hidden]

    def keep_aux_hidden_states(self, layer_ids: tuple[int, ...], max_tokens: int) -> torch.Tensor:
        """From now on every forward writes, for its first min(tokens, max_tokens) rows, the input
        of layer layer_ids[j] (hidden + residual; the embedding for layer 0) into columns
        [j * H, (j + 1) * H) of the returned buffer. max_tokens must cover a step's real rows
        (graph padding rows past it are not kept)."""
        num_layers, hidden = len(self.layers), self.embed_tokens.weight.shape[1]
        bad = [i for i in layer_ids if not 0 <= i < num_layers]
        if bad or len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"aux hidden state layers {list(layer_ids)}: expected distinct indices in "
                             f"0..{num_layers - 1}")
        self.aux_slots = {i: j for j, i in enumerate(layer_ids)}
        weight = self.embed_tokens.weight
        self.aux_hidden = torch.zeros(max_tokens, len(layer_ids) * hidden, dtype=weight.dtype, device=weight.device)
        return self.aux_hidden

    def _keep_aux(self, slot: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        width = hidden.shape[-1]
        rows = min(hidden.shape[0], self.aux_hidden.shape[0])
        state = hidden[:rows] if residual is None else hidden[:rows] + residual[:rows]
        self.aux_hidden[:rows, slot * width : (slot + 1) * width].copy_(state)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mm_embeds: MultimodalEmbeds | None = None) -> torch.Tensor:
        """positions [T], or [3, T] (temporal, height, width) for a multimodal rotary's image rows."""
        hidden, residual = merge_multimodal_embeds(self.embed_tokens(input_ids), mm_embeds), None
        for i, layer in enumerate(self.layers):
            if i in self.aux_slots:
                self._keep_aux(self.aux_slots[i], hidden, residual)
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """model + lm_head; a family sets `layer_cls`. compute_logits runs on the sampled rows only.

    The loader reads `stacked_params_mapping` ((param, checkpoint name, shard id): checkpoint
    modules packed into one of ours) and `expert_params_mapping` (MoE models), matched by whole
    name components; `skip_checkpoint_weight` names tensors a checkpoint may hold that no
    parameter takes.
    """

    layer_cls: type[nn.Module]
    stacked_params_mapping: list[tuple[str, str, object]] = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]
    expert_params_mapping: list[tuple[str, str, int | None, str]] = []

    def __init__(self, config, prefix: str = "", quant_config: QuantConfig | None = None):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, join_prefix(prefix, "model"), quant_config, self.layer_cls)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def skip_checkpoint_weight(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:  # HF's buffer; ours is computed
            return True
        # Multi-token-prediction (nextn) layers follow the last decoder layer
        # (model.layers.{num_hidden_layers}...); speculative decoding (spec_decode/mtp.py) builds them.
        parts = name.split(".", 3)
        return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
                and int(parts[2]) >= self.config.num_hidden_layers)

    # ---- vision-language models (atom_core/multimodal/README.md) ----
    supports_images = False

    def encode_images(self, items: list[MultimodalItem]) -> list[torch.Tensor]:
        """Each item's encoder output [item.length, hidden] in the model dtype, on the model's device."""
        raise ValueError(f"{type(self).__name__} takes no images")

    def mrope_positions(self, prompt_token_ids: list[int], items: tuple[MultimodalItem, ...]) -> tuple[np.ndarray, int] | None:
        """A multimodal rotary's prompt positions [3, P] and the delta later tokens add to their
        index (position p >= P rotates at p + delta on all three axes); None: positions are indices."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                mm_embeds: MultimodalEmbeds | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, mm_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
