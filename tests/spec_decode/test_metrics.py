"""Speculative decoding counters on /metrics, from the core's pushed CoreStats."""
from types import SimpleNamespace

from atom_core.engine.core import CoreStats
from atom_core.server.metrics import ServerMetrics


def scrape(stats, prefix="atom") -> str:
    engine = SimpleNamespace(latest_stats=stats, is_healthy=True, num_unfinished=0)
    return ServerMetrics("m", engine, prefix=prefix).render().decode()


def test_counters_named_as_vllms():
    stats = CoreStats(1, 0, 10, 5, 0.0, 0, spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                      spec_decode_num_accepted_tokens=7, spec_decode_accepted_per_position=(4, 2, 1))
    text = scrape(stats)
    assert 'atom_spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'atom_spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'atom_spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'atom_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text
    assert "vllm:spec_decode_num_drafts_total" in scrape(stats, prefix="vllm")


def test_absent_without_speculation():
    assert "spec_decode" not in scrape(CoreStats(1, 0, 10, 5, 0.0, 0))


def test_engine_core_reports_its_counters(tiny_llama):
    from atom_core import LLMEngine, SamplingParams

    engine = LLMEngine(str(tiny_llama), method="ngram", num_speculative_tokens=2, ngram_min=1, ngram_max=2)
    engine.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stats = engine.core.stats()
    counters = engine.spec_decode_stats()
    assert stats.spec_decode_num_drafts == counters["num_drafts"] > 0
    assert stats.spec_decode_num_accepted_tokens == counters["num_accepted_tokens"]
    assert list(stats.spec_decode_accepted_per_position) == counters["accepted_per_position"]
