"""Tiny random HF models (+ a real byte-level BPE tokenizer with a chat template) for tests.

Built with transformers' own classes and `save_pretrained`, so the engine loads exactly what a
user's HF directory holds. Cached per session under a temp dir by the `tiny_model` fixtures.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for tests.",
    "naïve café résumé — 東京 ✓ emoji 🚀 and 😀 multi-byte text",
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ?",
] * 20


def build_tokenizer(path: Path, vocab_size: int = 400, special_tokens: list[str] | None = None,
                    chat_template: str | None = None):
    """A byte-level BPE tokenizer trained on CORPUS with SPECIAL (or `special_tokens`) and CHAT_TEMPLATE
    (or `chat_template`), saved to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens or SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = chat_template or CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def _moe_model(arch: str, common: dict):
    """Tiny MoE models: 8 experts, top-2, three layers so dense and sparse layers mix."""
    import transformers as tf

    common = {**common, "num_hidden_layers": 3}
    if arch == "qwen3_moe":  # layer 1 dense (mlp_only_layers); no renormalisation
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1))
    if arch == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2))
    if arch == "glm4_moe":  # layer 0 dense; 2 groups of 4 experts, 1 kept; half the head rotated
        return tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(
            **common, head_dim=32, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True))
    raise ValueError(arch)


def _hybrid_model(arch: str, common: dict):
    """Tiny hybrid models (models/qwen3_next.py): layers 0-2 gated DeltaNet, layer 3 full attention;
    2 key heads serving 4 value heads; MoE with 4 experts, top-2, a shared expert (layer 1 dense)."""
    import transformers as tf

    hybrid = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    common = {**common, **hybrid}
    if arch == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**common, **moe, mlp_only_layers=[1], norm_topk_prob=True))
    if arch == "qwen3_5":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**common))
    if arch == "qwen3_5_moe":
        common.pop("intermediate_size")
        return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**common, **moe))
    raise ValueError(arch)


HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def copy_model_with(src: Path, dst: Path, file: str = "config.json", **changes) -> Path:
    """A copy of the model directory `src` at `dst` whose JSON `file` has `changes` set."""
    shutil.copytree(src, dst)
    data = json.loads((dst / file).read_text())
    data.update(changes)
    (dst / file).write_text(json.dumps(data))
    return dst


def randomize_weights(model) -> None:
    """Bigger-than-init weights (normal, std 0.15) so greedy outputs vary with the input instead of
    repeating one token; HF initialises norms to 1 and biases to 0, so random 1-D values make a
    skipped one show. Draws from torch's global generator: seed it first."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
        for name, t in model.state_dict().items():  # saved tensors only (not the rotary inv_freq)
            if t.dim() == 1:
                t.copy_(1 + 0.2 * torch.randn_like(t) if "norm" in name else 0.1 * torch.randn_like(t))


def build_tiny_model(path: Path, arch: str = "llama", seed: int = 0, num_layers: int = 2) -> Path:
    """Save a tiny random `arch` (llama | qwen3 | qwen3_moe | mixtral | glm4_moe | qwen3_next | qwen3_5 |
    qwen3_5_moe) model with a tokenizer into `path`."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  eos_token_id=eos, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    if arch == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256}
        model = LlamaForCausalLM(LlamaConfig(**common, rope_scaling=rope, rope_theta=500000.0))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    elif arch in HYBRID_ARCHS:
        model = _hybrid_model(arch, common)
    else:
        model = _moe_model(arch, common)
    randomize_weights(model)
    model.save_pretrained(str(path))
    GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(str(path))
    return path


def save_tiny_vocab_llama(path: Path, num_layers: int = 2) -> Path:
    """A Llama over 12 tokens and no tokenizer, small enough to count every sampling outcome; 1-D
    parameters random around 1, matrices N(0, 0.15)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=64, eos_token_id=None, bos_token_id=None,
                                         pad_token_id=0))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    model.save_pretrained(str(path))
    return path
