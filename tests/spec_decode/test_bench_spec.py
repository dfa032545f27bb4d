"""`atomctl bench latency|offline` with speculative decoding report acceptance of the timed runs."""
import json

from typer.testing import CliRunner

from atomctl.main import app

runner = CliRunner()
NGRAM = ["--method", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "1", "--ngram-max", "3"]


def test_latency_on_a_repetitive_workload_reports_acceptance(tiny_llama, tmp_path):
    # n-gram drafts need the random model's output to meet an earlier n-gram: over 12 tokens of the
    # seeded workload it never does, over 32 it does (the timed run's own prompts, seed 0).
    out = tmp_path / "lat.json"
    res = runner.invoke(app, ["bench", "latency", "--model", str(tiny_llama), "--device", "cpu", "--bs", "2",
                              "--input-len", "24", "--prompt-period", "4", "--output-len", "32", "--num-iters", "1",
                              "--num-iters-warmup", "0", *NGRAM, "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    assert "spec decode acceptance rate" in res.output and "mean accepted length" in res.output
    spec = json.loads(out.read_text())["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] >= spec["num_drafts"]


def test_offline_reports_acceptance_and_none_without_speculation(tiny_llama, tmp_path):
    args = ["bench", "offline", "--model", str(tiny_llama), "--device", "cpu", "--num-prompts", "2",
            "--min-input-len", "10", "--max-input-len", "12", "--min-output-len", "6", "--max-output-len", "6"]
    out = tmp_path / "off.json"
    res = runner.invoke(app, [*args, *NGRAM, "--output-json", str(out)])
    assert res.exit_code == 0, res.output
    assert "spec decode acceptance rate" in res.output and "num_drafts" in json.loads(out.read_text())["spec_decode"]
    res = runner.invoke(app, [*args, "--output-json", str(out)])
    assert "spec decode" not in res.output and json.loads(out.read_text())["spec_decode"] is None


def test_bad_prompt_period_is_an_error(tiny_llama):
    res = runner.invoke(app, ["bench", "latency", "--model", str(tiny_llama), "--device", "cpu", "--input-len", "8",
                              "--prompt-period", "9"])
    assert res.exit_code != 0 and "prompt_period" in res.output
