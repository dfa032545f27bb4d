"""`atomctl generate --image`: a vision-language model answers about an image file as the library does;
bad uses are one-line errors."""
from __future__ import annotations

import json

import pytest

from tests.cli.test_generate import assert_one_line_error, invoke
from tests.tiny_vlm import build_tiny_vlm, png_bytes, synthetic_image


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_vlm")
    path = build_tiny_vlm(root / "model", seed=1)
    (root / "a.png").write_bytes(png_bytes(synthetic_image(11, (50, 37))))
    (root / "b.png").write_bytes(png_bytes(synthetic_image(12, (64, 48))))
    return path, root


def test_image_answers_equal_the_library(vlm):
    from atom_core import LLMEngine, SamplingParams

    path, root = vlm
    args = ["generate", "--model", str(path), "--device", "cpu", "--max-tokens", "5", "--ignore-eos", "--json"]
    result = invoke([*args, "--image", str(root / "a.png"), "What is it?"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout.split("\n[")[0])[0]["token_ids"]
    engine = LLMEngine(str(path), device="cpu")
    prompt = engine.image_chat_prompt("What is it?")
    ref = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                          images=[[root / "a.png"]])[0]["token_ids"]
    assert got == ref
    other = invoke([*args, "--image", str(root / "b.png"), "What is it?"])
    assert json.loads(other.stdout.split("\n[")[0])[0]["token_ids"] != got


def test_bad_image_uses_are_one_line_errors(vlm, tiny_llama, tmp_path):
    path, root = vlm
    base = ["generate", "--device", "cpu", "--max-tokens", "2"]
    assert_one_line_error(invoke([*base, "--model", str(path), "--image", str(root / "nope.png"), "hi"]),
                          "image file not found")
    assert_one_line_error(invoke([*base, "--model", str(path), "--no-chat", "--image", str(root / "a.png"), "hi"]),
                          "--image needs the chat template")
    (tmp_path / "bad.png").write_bytes(b"not an image")
    assert_one_line_error(invoke([*base, "--model", str(path), "--image", str(tmp_path / "bad.png"), "hi"]),
                          "cannot decode the image")
    assert_one_line_error(invoke([*base, "--model", str(tiny_llama), "--image", str(root / "a.png"), "hi"]),
                          "takes no images")
