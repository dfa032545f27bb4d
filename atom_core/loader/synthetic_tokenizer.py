"""A stand-in tokenizer for presets (config.json only): one word per token id, "t0".."tN".

Presets have no tokenizer, but serving them (and benchmarking the server) needs text that
round-trips: every id decodes to a word, and decoding random ids then encoding the text gives
the same ids back, so a benchmark's prompt lengths are exact and every sampled token streams.
Built once per vocabulary size and cached under ~/.cache/atom_core.
"""
from __future__ import annotations

from pathlib import Path


def synthetic_tokenizer_dir(vocab_size: int, eos_token_id: int | None = None,
                            cache_root: Path | None = None) -> Path:
    root = cache_root or Path.home() / ".cache" / "atom_core"
    path = root / f"synthetic_tokenizer_{vocab_size}_{eos_token_id}"
    if (path / "tokenizer.json").exists():
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = f"t{eos_token_id}" if eos_token_id is not None else None
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, unk_token="t0")
    tmp = path.with_name(path.name + ".tmp")
    fast.save_pretrained(str(tmp))
    tmp.rename(path)  # atomic publish: concurrent builders never see half a directory
    return path
