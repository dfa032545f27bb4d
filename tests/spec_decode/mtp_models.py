"""Tiny checkpoints with a multi-token-prediction (nextn) layer in DeepSeek-V3's layout, for the
MTP tests: HF builds the model with one extra decoder layer, which becomes model.layers.{N}
(N = num_hidden_layers of the saved config) beside random enorm / hnorm / eh_proj /
shared_head tensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.models.test_deepseek import YARN


def build_tiny_deepseek_v3_mtp(path: Path, own_copies: bool = True, seed: int = 0) -> Path:
    """3 decoder layers (layer 0 dense) + a nextn layer 3 with an MLA + MoE block. own_copies:
    the nextn layer carries its own embed_tokens and shared_head.head (random, unlike the
    model's, so a test sees which one is used); otherwise the engine must reuse the model's."""
    import transformers as tf

    from tests.tiny_models import build_tokenizer, randomize_weights

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab, hidden = len(tokenizer), 64
    config = tf.DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=1024, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, eos_token_id=eos, bos_token_id=None, pad_token_id=0,
        q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_interleave=True, rope_parameters=dict(YARN))
    torch.manual_seed(seed)
    model = tf.DeepseekV3ForCausalLM(config)
    randomize_weights(model)
    model.save_pretrained(str(path))
    tf.GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(str(path))
    return append_nextn_tensors(path, 3, own_copies)


def append_nextn_tensors(path: Path, index: int, own_copies: bool = True) -> Path:
    """Turn the saved model's last decoder layer (`index`) into its nextn layer: random enorm /
    hnorm / eh_proj / shared_head tensors beside it (and its own embed_tokens / shared_head.head
    with own_copies), config.json cut to `index` layers (per-layer lists too, as the published
    configs list decoder layers only) with num_nextn_predict_layers 1."""
    from safetensors.torch import load_file, save_file

    raw = json.loads((path / "config.json").read_text())
    vocab, hidden = raw["vocab_size"], raw["hidden_size"]
    weights = load_file(str(path / "model.safetensors"))
    nextn = f"model.layers.{index}."
    weights[nextn + "enorm.weight"] = 1 + 0.2 * torch.randn(hidden)
    weights[nextn + "hnorm.weight"] = 1 + 0.2 * torch.randn(hidden)
    weights[nextn + "shared_head.norm.weight"] = 1 + 0.2 * torch.randn(hidden)
    weights[nextn + "eh_proj.weight"] = 0.15 * torch.randn(hidden, 2 * hidden)
    if own_copies:
        weights[nextn + "embed_tokens.weight"] = 0.15 * torch.randn(vocab, hidden)
        weights[nextn + "shared_head.head.weight"] = 0.15 * torch.randn(vocab, hidden)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    for key, value in raw.items():  # layer_types, mlp_layer_types, indexer_types, ...
        if key.endswith("_types") and isinstance(value, list) and len(value) == raw["num_hidden_layers"]:
            raw[key] = value[:index]
    raw.update(num_hidden_layers=index, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path
