"""benchmarks/engine/lora_nano.py runs end to end on the CPU (a tiny dummy-weight Llama and two tiny
adapters), so the GPU command cannot fail on a typo; its input errors are one clear line."""
from __future__ import annotations

import importlib.util
import json
import re

import pytest

from benchmarks.engine import lora_nano
from benchmarks.engine.make_lora_adapters import make_adapters
from tests.tiny_models import build_tiny_model

SMALL = ["--num-prompts", "5", "--max-input-len", "24", "--max-output-len", "6"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_nano")
    model = build_tiny_model(root / "model", "llama")
    make_adapters(str(model), root / "loras", 2, 4)
    return model, root / "loras"


def test_adapters_round_robin_generate_every_sampled_token(tiny, tmp_path):
    model, loras = tiny
    out = tmp_path / "nano.json"
    result = lora_nano.main([str(model), str(loras), *SMALL, "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert {"engine", "model", "adapters", "out_tokens", "seconds", "out_tok_s", "startup_s"} <= set(result)
    assert result["engine"] == "atom" and result["adapters"] == 2 and result["lora_rank"] == 4
    requests = lora_nano.build_requests(1000, 5, 24, 6, 2)
    assert requests.loras == [0, 1, 0, 1, 0]
    assert result["out_tokens"] == sum(requests.max_tokens) == 30  # ignore_eos: every request runs to max_tokens
    seconds = result["seconds"]  # rounded to 1 ms in the report: the rate is within that rounding
    assert result["out_tokens"] / (seconds + 5e-4) <= result["out_tok_s"] <= result["out_tokens"] / (seconds - 5e-4)


def test_no_lora_runs_the_base_model_without_an_adapters_directory(tiny):
    model, _ = tiny
    result = lora_nano.main([str(model), "--no-lora", *SMALL])
    assert result["adapters"] == 0 and result["out_tokens"] == 30


def test_workload_is_nano_vllms_for_a_real_vocab():
    requests = lora_nano.build_requests(128256, 256, 1024, 1024, 8)
    assert sum(requests.max_tokens) == 133966  # the reference workload's output tokens (atom_core/bench/offline.py)
    assert requests.loras[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 0]


def test_a_directory_without_adapters_is_a_clear_error(tiny, tmp_path):
    model, _ = tiny
    with pytest.raises(SystemExit, match=f"no PEFT adapter directories .* under {re.escape(str(tmp_path))}$"):
        lora_nano.main([str(model), str(tmp_path), *SMALL])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_says_so(tiny, monkeypatch):
    monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "0")  # restored after: the vLLM path sets it
    model, loras = tiny
    with pytest.raises(SystemExit, match="--engine vllm needs vLLM"):
        lora_nano.main([str(model), str(loras), "--engine", "vllm", *SMALL])
