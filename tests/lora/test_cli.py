"""The LoRA flags of atomctl: generate --lora runs the adapter; bad flags exit with a one-line error."""
from __future__ import annotations

from typer.testing import CliRunner

from atomctl.main import app

ARGS = ["--device", "cpu", "--num-kv-blocks", "32", "--max-tokens", "4", "--no-chat"]


def test_generate_with_an_adapter_differs_from_the_base(lora_base, adapters):
    runner = CliRunner()
    common = ["generate", "hello world", "--model", str(lora_base), *ARGS, "--enable-lora", "--max-loras", "2",
              "--max-lora-rank", "8", "--max-cpu-loras", "2", "--lora-modules", f"a={adapters['all8']}", "--json"]
    base = runner.invoke(app, common)
    tuned = runner.invoke(app, [*common, "--lora", "a"])
    assert base.exit_code == 0 and tuned.exit_code == 0, base.output + tuned.output
    assert '"text"' in tuned.output and base.output != tuned.output


def test_bad_lora_flags_fail_cleanly(lora_base, adapters):
    runner = CliRunner()
    cases = [(["--max-loras", "2"], "needs --enable-lora"),
             (["--enable-lora", "--lora", "zzz"], "unknown LoRA adapter 'zzz'"),
             (["--enable-lora", "--lora-modules", "nopath"], "expected NAME=PATH")]
    for extra, match in cases:
        result = runner.invoke(app, ["generate", "hi", "--model", str(lora_base), *ARGS, *extra])
        assert result.exit_code != 0 and match in result.output, result.output
