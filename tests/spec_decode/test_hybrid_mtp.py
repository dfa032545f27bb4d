"""Speculative decoding on a hybrid model (Qwen3-Next: gated DeltaNet + gated attention): its MTP layer
(`mtp.*`, tests/spec_decode/qwen3_next_mtp.py) drafts through the MTP proposer, and greedy output equals
plain decoding token for token. The random MTP layer's drafts are nearly all rejected, so every verify
step rolls the recurrent and conv states back (kv_spec.keep_verified_states); a test without that
rollback shows the output goes wrong, and oracle drafts (the plain continuation, one draft wrong in a
rotating place) exercise every accepted-prefix length."""
import json

import pytest

from atom_core import LLMEngine, SamplingParams
from atom_core.spec_decode.ngram import NgramProposer
from tests.models.harness import random_prompts
from tests.spec_decode.qwen3_next_mtp import build_tiny_qwen3_next_mtp
from tests.tiny_models import build_tiny_model

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPT_LENS = [3, 40, 75]


@pytest.fixture(scope="module")
def next_mtp(tmp_path_factory):
    path = build_tiny_qwen3_next_mtp(tmp_path_factory.mktemp("next_mtp") / "model")
    prompts = random_prompts(_vocab(path), PROMPT_LENS)
    return path, prompts, _tokens(LLMEngine(str(path)), prompts)


def _vocab(path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


def _tokens(engine, prompts):
    return [o["token_ids"] for o in engine.generate(prompts, GREEDY)]


def _all_returned(engine):
    kv = engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_state_slots == kv.num_state_slots


@pytest.mark.parametrize("options", [
    {"num_speculative_tokens": 1},
    {"num_speculative_tokens": 3},
    {"num_speculative_tokens": 3, "max_num_batched_tokens": 16},  # prompt chunks beside verify steps
    {"num_speculative_tokens": 2, "max_num_seqs": 2},
], ids=["k1", "k3", "k3-chunked", "k2-two-seqs"])
def test_mtp_greedy_equals_plain(next_mtp, options):
    path, prompts, plain = next_mtp
    engine = LLMEngine(str(path), method="mtp", **options)
    assert _tokens(engine, prompts) == plain
    stats = engine.spec_decode_stats()
    assert stats["num_drafts"] > 0 and len(stats["accepted_per_position"]) == options["num_speculative_tokens"]
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # rejections happened: rollback ran
    _all_returned(engine)


def test_without_the_rollback_the_output_differs(next_mtp, monkeypatch):
    path, prompts, plain = next_mtp
    monkeypatch.setattr("atom_core.worker.model_runner.keep_verified_states", lambda *args: None)
    assert _tokens(LLMEngine(str(path), method="mtp", num_speculative_tokens=3), prompts) != plain


def test_every_accepted_prefix_length_keeps_the_output(next_mtp, monkeypatch):
    """Drafts from the plain continuation with draft j wrong, j rotating over 0..K (K: all right), so
    verify steps accept 0, 1, 2 or all 3 drafts."""
    path, prompts, plain = next_mtp
    k = 3
    continuation = {tuple(p): out for p, out in zip(prompts, plain)}
    vocab = _vocab(path)

    def oracle(self, states, target=None):
        drafts = []
        for s in states:
            done = len(s.output_token_ids)
            right = list(continuation[tuple(s.prompt_token_ids)][done:done + k])
            wrong_at = done % (k + 1)
            if wrong_at < len(right):
                right[wrong_at] = (right[wrong_at] + 1) % vocab
            drafts.append(right)
        return drafts

    monkeypatch.setattr(NgramProposer, "propose", oracle)
    engine = LLMEngine(str(path), method="ngram", num_speculative_tokens=k, ngram_min=1, ngram_max=2)
    assert _tokens(engine, prompts) == plain
    stats = engine.spec_decode_stats()
    assert all(n > 0 for n in stats["accepted_per_position"]), stats
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    _all_returned(engine)


def test_a_checkpoint_without_the_mtp_layer_fails_at_start(tmp_path):
    path = build_tiny_model(tmp_path / "plain_next", "qwen3_next")
    with pytest.raises(ValueError, match="holds no mtp.fc.weight"):
        LLMEngine(str(path), method="mtp", num_speculative_tokens=1)


def test_draft_models_are_refused_on_hybrids(next_mtp, tmp_path):
    path = next_mtp[0]
    with pytest.raises(ValueError, match="--method draft is not supported for models with linear-attention"):
        LLMEngine(str(path), method="draft", draft_model=str(path), num_speculative_tokens=2)


def test_prompt_chunks_beside_verifies_take_the_chunked_rule(next_mtp, monkeypatch):
    """A verify step that also runs prompt chunks splits the delta rule: the chunks through the
    chunked kernel (a long chunk token by token would serialize it), verifies through the recurrent
    one keeping per-token states; the output stays plain decoding's."""
    from atom_core.model_ops.linear_attention import DeltaNetCore

    path, prompts, plain = next_mtp
    splits = []
    real = DeltaNetCore._split_step

    def counting(layer, meta, qkvgb, has_initial_state, rule_args):
        splits.append((meta.state_recurrent_tokens.numel(), meta.state_chunked_tokens.numel()))
        return real(layer, meta, qkvgb, has_initial_state, rule_args)

    monkeypatch.setattr(DeltaNetCore, "_split_step", staticmethod(counting))
    engine = LLMEngine(str(path), method="mtp", num_speculative_tokens=3, max_num_batched_tokens=16)
    assert _tokens(engine, prompts) == plain
    assert splits and all(r > 0 and c > 1 for r, c in splits), splits
