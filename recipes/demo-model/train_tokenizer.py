"""Train the demo model's byte-level BPE tokenizer on the synthetic corpus.

Digits are split into single tokens before BPE runs, so every number is spelled digit by digit
and the model can learn arithmetic column by column. Writes tokenizer.json and
tokenizer_config.json (with the ChatML chat template) into --out, then checks that
transformers loads it, renders the chat template and round-trips text.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from chat_format import CHAT_TEMPLATE, ENDOFTEXT, IM_END, PAD, SPECIAL_TOKENS, document_plain_text, render_chat

VOCAB_SIZE = 2048  # an upper bound: the synthetic corpus's small vocabulary stops BPE near 900
MAX_LENGTH = 512


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train(corpus: Path, vocab_size: int) -> Tokenizer:
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        with corpus.open(encoding="utf-8") as f:
            for line in f:
                yield document_plain_text(json.loads(line))

    tok.train_from_iterator(texts(), trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [ENDOFTEXT, "<|im_start|>"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def save(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def check(out: Path) -> None:
    """transformers loads the directory, renders chats as the recipe does, and round-trips text."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(out)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert hf.convert_tokens_to_ids(t) == i, f"special token {t} is not id {i}"
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 47 + 38?"}, {"role": "assistant", "content": "85"},
                {"role": "user", "content": "What is 12 × 3?"}]
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == render_chat(messages, add_generation_prompt=True), rendered
    ids = hf.encode("What is 47 + 38?")
    assert hf.bos_token_id is None or ids[0] != hf.bos_token_id, "the tokenizer must not add a BOS token"
    assert [hf.decode([i]) for i in hf.encode("12345")] == list("12345"), "digits must be single tokens"
    for text in [rendered, "Tom has 12 apples and buys 30 more.\n\n  Done! 3 × 4 = 12 ∑ ünïcödé 🙂"]:
        assert hf.decode(hf.encode(text)) == text, f"round trip failed for {text!r}"
    print(f"tokenizer ok: {len(hf)} tokens (the corpus runs out of merges below --vocab-size), "
          f"eos {hf.eos_token!r} = {hf.eos_token_id}, pad {hf.pad_token!r} = {hf.pad_token_id}")
    print(f"chat prompt {rendered!r} -> {len(hf.encode(rendered))} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="directory holding train.jsonl")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()
    tok = train(args.corpus / "train.jsonl", args.vocab_size)
    save(tok, args.out)
    check(args.out)


if __name__ == "__main__":
    main()
