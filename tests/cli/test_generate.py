"""`atomctl generate`: a few subprocess runs of the installed console script, the rest through
Typer's CliRunner on the tiny random Llama (it has a chat template)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from typer.testing import CliRunner

from atomctl.main import app
from tests.tiny_models import copy_model_with

STATS = re.compile(r"^\[(\d+) request\(s\), (\d+) tokens, TTFT [\d.]+ ms, TPOT [\d.]+ ms, [\d.]+ tok/s\]$", re.M)
OUTPUT_KEYS = {"text", "token_ids", "latency", "finish_reason", "num_tokens_input", "num_tokens_output", "ttft", "tpot"}
ATOMCTL = shutil.which("atomctl")


@pytest.fixture(scope="module")
def model(tiny_llama) -> list[str]:
    return ["--model", str(tiny_llama), "--device", "cpu", "--num-kv-blocks", "64"]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy outputs of the library for the prompts the CLI tests use (chat template applied)."""
    from atom_core import LLMEngine, SamplingParams

    engine = LLMEngine(str(tiny_llama), device="cpu", num_kv_blocks=64)
    tok = engine.tokenizer

    def run(prompt: str, chat: bool = True, **kw) -> dict:
        if chat:
            prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return engine.generate([prompt], SamplingParams(temperature=0, **kw))[0]

    return run


def invoke(args: list[str], input: str | None = None):
    return CliRunner().invoke(app, args, input=input)


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert result.stdout == ""


# ---- the installed console script ------------------------------------------------------------
@pytest.mark.skipif(ATOMCTL is None, reason="atomctl console script not installed (pip install -e .)")
class TestSubprocess:
    def test_help_lists_generate(self):
        proc = subprocess.run([ATOMCTL, "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert re.search(r"^\W*generate\b", proc.stdout, re.M), proc.stdout

    def test_generate_streams_text_and_prints_stats(self, model, reference):
        # ignore_eos: the count below must not depend on where the random tiny model samples EOS
        proc = subprocess.run([ATOMCTL, "generate", *model, "--max-tokens", "8", "--ignore-eos", "Hello"],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == reference("Hello", max_tokens=8, ignore_eos=True)["text"] + "\n"
        match = STATS.search(proc.stderr)
        assert match and match.groups() == ("1", "8"), proc.stderr
        assert "Traceback" not in proc.stderr

    def test_debug_shows_the_traceback(self, tmp_path):
        proc = subprocess.run([ATOMCTL, "--debug", "generate", "--model", str(tmp_path / "missing"), "hi"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        assert "Traceback (most recent call last)" in proc.stderr
        assert "model directory not found" in proc.stderr


# ---- CliRunner ---------------------------------------------------------------------------------
class TestOutput:
    def test_streaming_writes_text_as_it_comes(self, model, reference, monkeypatch):
        import sys

        from atom_core import LLMEngine

        expected = reference("Hello", max_tokens=12)["text"] + "\n"
        sizes = []
        real_step = LLMEngine.step

        def step(self):  # how much the CLI had written to stdout after each engine step
            out = real_step(self)
            sys.stdout.flush()
            sizes.append(len(sys.stdout.buffer.getvalue()))
            return out

        monkeypatch.setattr(LLMEngine, "step", step)
        # Single steps stream token by token; windows of 8 (the default) stream per window.
        result = invoke(["generate", *model, "--max-tokens", "12", "--num-scheduler-steps", "1", "Hello"])
        assert result.exit_code == 0, result.output
        assert result.stdout == expected
        assert len(set(s for s in sizes if s)) > 3, f"stdout grew only at the end: {sizes}"

    def test_json_output(self, model, reference):
        result = invoke(["generate", *model, "--max-tokens", "5", "--json", "Hello"])
        assert result.exit_code == 0, result.output
        [out] = json.loads(result.stdout)
        assert OUTPUT_KEYS <= set(out)
        ref = reference("Hello", max_tokens=5)
        assert out["text"] == ref["text"] and out["token_ids"] == ref["token_ids"]
        assert out["num_tokens_output"] == len(out["token_ids"]) <= 5
        assert out["num_tokens_input"] == ref["num_tokens_input"]
        assert out["finish_reason"] in ("length", "stop")
        assert out["latency"] >= out["ttft"] >= 0 and out["tpot"] >= 0
        assert STATS.search(result.stderr)

    def test_sampling_seed_reproduces_a_sampled_answer(self, model, tiny_llama):
        """--sampling-seed is the request's seed: the same seed twice samples the same tokens, which are the
        library's for SamplingParams(seed=...); other seeds sample others."""
        from atom_core import LLMEngine, SamplingParams

        def run(seed: str) -> list[int]:
            result = invoke(["generate", *model, "--max-tokens", "12", "--ignore-eos", "--temperature", "1.0",
                             "--json", "--sampling-seed", seed, "Hello"])
            assert result.exit_code == 0, result.output
            return json.loads(result.stdout)[0]["token_ids"]

        first = run("3")
        assert run("3") == first
        engine = LLMEngine(str(tiny_llama), device="cpu", num_kv_blocks=64)
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                                      tokenize=False)
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
        assert engine.generate([prompt], params)[0]["token_ids"] == first
        assert any(run(seed) != first for seed in ("4", "5"))

    def test_prompts_from_a_file(self, model, tmp_path):
        path = tmp_path / "prompts.txt"
        path.write_text("Hello\n\nThe quick brown fox\nnaïve café 🚀\n")
        result = invoke(["generate", *model, "--max-tokens", "3", "--json", "--file", str(path)])
        assert result.exit_code == 0, result.output
        assert len(json.loads(result.stdout)) == 3  # blank lines skipped

    @pytest.mark.parametrize("args", [[], ["-"]], ids=["piped", "dash"])
    def test_prompts_from_stdin(self, model, reference, args):
        result = invoke(["generate", *model, "--max-tokens", "3", "--json", *args], input="Hello\nworld\n")
        assert result.exit_code == 0, result.output
        outs = json.loads(result.stdout)
        assert [o["token_ids"] for o in outs] == [reference(p, max_tokens=3)["token_ids"] for p in ("Hello", "world")]

    def test_chat_applies_the_template(self, model, reference, tiny_llama):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tiny_llama))
        chat = json.loads(invoke(["generate", *model, "--max-tokens", "2", "--json", "--chat", "Hi"]).stdout)[0]
        plain = json.loads(invoke(["generate", *model, "--max-tokens", "2", "--json", "--no-chat", "Hi"]).stdout)[0]
        templated = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
        assert chat["num_tokens_input"] == len(tok.encode(templated)) > len(tok.encode("Hi"))
        assert plain["num_tokens_input"] == len(tok.encode("Hi"))
        assert chat["token_ids"] == reference("Hi", max_tokens=2)["token_ids"]

    def test_stop(self, model, reference):
        full = reference("Hello", max_tokens=16, ignore_eos=True)["text"]
        stop = next(full[i : i + 2] for i in range(1, len(full) - 1)
                    if full[i : i + 2].isascii() and full[i : i + 2].isprintable() and full.find(full[i : i + 2]) == i)
        result = invoke(["generate", *model, "--max-tokens", "16", "--ignore-eos", "--json", "--stop", stop, "Hello"])
        assert result.exit_code == 0, result.output
        [out] = json.loads(result.stdout)
        assert out["text"] == full[: full.index(stop)] and out["finish_reason"] == "stop"

    def test_multiple_prompts(self, model, reference):
        result = invoke(["generate", *model, "--max-tokens", "4", "--no-chat", "Hello", "world"])
        assert result.exit_code == 0, result.output
        for prompt in ("Hello", "world"):
            text = reference(prompt, chat=False, max_tokens=4)["text"]
            assert f"--- {prompt}\n{text}\n" in result.stdout
        match = STATS.search(result.stderr)
        assert match and match.group(1) == "2"

    def test_multiple_prompts_show_the_users_prompt_not_the_template(self, model, reference):
        result = invoke(["generate", *model, "--max-tokens", "4", "--chat", "Hello", "world"])
        assert result.exit_code == 0, result.output
        for prompt in ("Hello", "world"):
            assert f"--- {prompt}\n{reference(prompt, max_tokens=4)['text']}\n" in result.stdout
        headers = [line for line in result.stdout.splitlines() if line.startswith("--- ")]
        assert headers == ["--- Hello", "--- world"]


class TestErrors:
    def test_missing_model_dir(self, tmp_path):
        result = invoke(["generate", "--model", str(tmp_path / "missing"), "--device", "cpu", "hi"])
        assert_one_line_error(result, "model directory not found")

    def test_unknown_architecture(self, tiny_llama, tmp_path):
        path = copy_model_with(tiny_llama, tmp_path / "foo", architectures=["FooForCausalLM"])
        result = invoke(["generate", "--model", str(path), "--device", "cpu", "hi"])
        assert_one_line_error(result, "FooForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM")

    def test_prompt_too_long(self, model):
        result = invoke(["generate", *model, "--max-model-len", "8", "--no-chat", "--max-tokens", "2",
                         "The quick brown fox jumps over the lazy dog again and again"])
        assert_one_line_error(result, "max_model_len")

    @pytest.mark.parametrize("args, fragment", [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "2"], "top_p"),
        (["--cudagraph-capture-sizes", "x"], "--cudagraph-capture-sizes"),
        (["--block-size", "3"], "block_size"),
    ], ids=["temperature", "top_p", "capture_sizes", "block_size"])
    def test_invalid_values(self, model, args, fragment):
        assert_one_line_error(invoke(["generate", *model, *args, "hi"]), fragment)

    def test_no_prompt(self, model):
        assert_one_line_error(invoke(["generate", *model], input=""), "no prompt given")

    def test_debug_raises_instead(self, tmp_path):
        result = invoke(["--debug", "generate", "--model", str(tmp_path / "missing"), "hi"])
        assert result.exit_code == 1
        assert isinstance(result.exception, ValueError)
        assert "model directory not found" in str(result.exception)
