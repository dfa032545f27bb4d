"""A step's requests decoded together (decode_step) stream exactly what one-by-one decoding does."""
from __future__ import annotations

import random

import pytest

from atom_core.engine.detokenizer import IncrementalDetokenizer, batch_decoder, decode_step
from atom_core.engine.output_processor import CoreOutput, OutputProcessor
from atom_core.sampling_params import SamplingParams
from tests.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def test_a_plain_fast_tokenizer_decodes_in_batches(tok):
    assert batch_decoder(tok) is not None


def test_a_tokenizer_that_overrides_decode_is_decoded_one_by_one(tok):
    class Custom(type(tok)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs)

    custom = Custom.__new__(Custom)
    custom.__dict__.update(tok.__dict__)
    assert batch_decoder(custom) is None


@pytest.mark.parametrize("batched", [True, False])
def test_batched_steps_equal_one_request_at_a_time(tok, batched):
    """Random ids (partial UTF-8 included), several tokens some steps, special tokens kept or skipped."""
    rng = random.Random(0)
    vocab = len(tok)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in range(12)]
    skips = [i % 3 != 0 for i in range(12)]
    batch = [IncrementalDetokenizer(tok, p, s) for p, s in zip(prompts, skips)]
    alone = [IncrementalDetokenizer(tok, p, s) for p, s in zip(prompts, skips)]
    streamed, expected = [""] * 12, [""] * 12
    for _ in range(30):
        for i in range(12):
            ids = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
            batch[i].append(ids)
            expected[i] += alone[i].add_tokens(ids)
        for i, delta in enumerate(decode_step(batch, batch_decoder(tok) if batched else None)):
            streamed[i] += delta
    assert streamed == expected
    assert any(streamed)
    for i in range(12):  # and what is left at the end is the same
        assert batch[i].flush() == alone[i].flush()


def test_two_updates_of_one_request_in_one_batch_stream_each_token_once(tok):
    ids = tok.encode("Hello world! This is a tiny tokenizer")
    proc = OutputProcessor(tok)
    state = proc.new_state("r", None, [ids[0]], SamplingParams(max_tokens=10))
    proc.process([CoreOutput("r", ids[1:3]), CoreOutput("r", ids[3:5])])
    assert state.text == tok.decode(ids[1:5])
