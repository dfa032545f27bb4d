"""Tiny random HF models (+ a real byte-level BPE tokenizer with a chat template) for tests.

Built with transformers' own classes and `save_pretrained`, so the engine loads exactly what a
user's HF directory holds. Cached per session under a temp dir by the `tiny_model` fixtures.
"""
from __future__ import annotations

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


def build_tokenizer(path: Path, vocab_size: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_tiny_model(path: Path, arch: str = "llama", seed: int = 0, num_layers: int = 2) -> Path:
    """Save a tiny random `arch` (llama | qwen3) model with a tokenizer into `path`."""
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
    else:
        raise ValueError(arch)
    # Bigger-than-init weights so greedy outputs vary with the input instead of repeating one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(str(path))
    GenerationConfig(eos_token_id=eos, pad_token_id=0).save_pretrained(str(path))
    return path
