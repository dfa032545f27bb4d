"""The word-per-id stand-in tokenizer that lets presets be served and benchmarked online."""
import random

from atom_core.bench.serve_bench import load_tokenizer
from atom_core.engine.detokenizer import IncrementalDetokenizer
from atom_core.loader.model_dir import resolve_model_files
from atom_core.loader.synthetic_tokenizer import synthetic_tokenizer_dir


def test_random_ids_round_trip_and_stream(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(synthetic_tokenizer_dir(5000, 7, cache_root=tmp_path)))
    assert len(tok) == 5000 and tok.eos_token_id == 7
    ids = [random.Random(0).randrange(5000) for _ in range(200)]
    assert tok.encode(tok.decode(ids)) == ids  # benchmark prompt lengths stay exact
    detok = IncrementalDetokenizer(tok, ids[:10])
    streamed = "".join(detok.add_tokens([t]) for t in ids[10:20])
    assert streamed.split() == [f"t{t}" for t in ids[10:20]]  # every token streams as text


def test_cached_after_first_build(tmp_path):
    first = synthetic_tokenizer_dir(300, None, cache_root=tmp_path)
    mtime = (first / "tokenizer.json").stat().st_mtime
    assert synthetic_tokenizer_dir(300, None, cache_root=tmp_path) == first
    assert (first / "tokenizer.json").stat().st_mtime == mtime


def test_presets_serve_with_it_and_the_bench_client_finds_it():
    files = resolve_model_files("preset:Llama-3-8B")
    assert files.tokenizer_path is None  # offline LLMEngine still runs on token ids, no detokenizer
    tok = files.serving_tokenizer()
    assert len(tok) == files.hf_config.vocab_size == 128256
    assert load_tokenizer("preset:Llama-3-8B").decode([128000]) == "t128000"


def test_real_models_keep_their_own_tokenizer(tiny_llama):
    assert resolve_model_files(str(tiny_llama)).serving_tokenizer().decode([5]) != "t5"
