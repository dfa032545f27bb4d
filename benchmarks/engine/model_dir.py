"""A model directory any engine can open from a preset or a model path: the model's own directory when it
has a tokenizer, else its config.json plus a word-level tokenizer over its vocabulary (what the peer
tools' vllm_bench.py writes: benchmarks send token ids, so no real words are needed). vLLM, its bench
client and `atomctl serve` then read one config and one tokenizer.

Usage: python -m benchmarks.engine.model_dir preset:Llama-3-8B /tmp/model-llama-3-8b   (prints the directory)
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from atom_core.loader import resolve_model_files


def model_dir(model: str, work: Path) -> Path:
    files = resolve_model_files(model)
    if files.tokenizer_path is not None:
        return files.path
    from tokenizers import Tokenizer, models, pre_tokenizers

    work.mkdir(parents=True, exist_ok=True)
    shutil.copy(files.path / "config.json", work / "config.json")
    vocab = {f"t{i}": i for i in range(files.hf_config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(work / "tokenizer.json"))
    (work / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "eos_token": "t1", "bos_token": "t2"}))
    return work


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m benchmarks.engine.model_dir MODEL DIR")
    print(model_dir(args[0], Path(args[1])))


if __name__ == "__main__":
    main()
