"""What the plugin tests on the CPU (test_vllm_plugin.py) and on CUDA (test_vllm_plugin_cuda.py) share: the
tiny models with their HF references, and runs of vllm_driver.py under a vLLM python. Imports nothing
the GPU machine's test environment may lack (no httpx)."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch

from tests.models.harness import hf_greedy, random_prompts
from tests.plugin.conftest import vllm_env

DRIVER = Path(__file__).with_name("vllm_driver.py")
PROMPT_LENS = [1, 9, 40, 130]
MAX_TOKENS = 12
RUN_TIMEOUT_S = 900


def build_models(families, tmp_path_factory) -> dict:
    """family -> (model dir, prompts, HF greedy reference on the CPU in float32): prompts of several
    lengths, then the same lengths after one 100-token shared prefix."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_deepseek import build_tiny_deepseek
    from tests.tiny_models import build_tiny_model

    out = {}
    for family in families:
        path = tmp_path_factory.mktemp(f"plugin_{family}")
        path = build_tiny_deepseek(path, "v2") if family == "deepseek_v2" else build_tiny_model(path, family)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        vocab = hf.config.vocab_size
        prompts = random_prompts(vocab, PROMPT_LENS) + random_prompts(vocab, PROMPT_LENS, shared_prefix=100)
        out[family] = (path, prompts, hf_greedy(hf, prompts, MAX_TOKENS))
    return out


def run_driver(python: Path | str, specs: list[dict], tmp_path: Path, pythonpath: str = "",
               timeout: float = RUN_TIMEOUT_S, **env: str) -> list[dict]:
    """Each spec through vllm_driver.py under `python`, with `pythonpath` after this checkout (where vLLM
    lives when it is not that python's own)."""
    spec_file = tmp_path / "runs.json"
    spec_file.write_text(json.dumps(specs))
    started = time.monotonic()
    result = subprocess.run([str(python), str(DRIVER), str(spec_file)], capture_output=True, text=True,
                            timeout=timeout, env=vllm_env(pythonpath, **env), cwd=tmp_path)
    (tmp_path / "driver.log").write_text(result.stdout + result.stderr)  # kept for a look at vLLM's side
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    print(f"\nvLLM driver: {len(specs)} model(s) in {time.monotonic() - started:.0f} s")
    return [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]


def assert_ours_matched(result: dict, models: dict, family: str, families: dict) -> None:
    """The run built our adapter over atom_core's class, and its greedy tokens equal HF's."""
    architecture, atom_class = families[family]
    assert (result["class"], result["atom_class"]) == (f"atom_core.plugin.model_adapter:{architecture}", atom_class)
    _, prompts, ref = models[family]
    for i, (got, expected) in enumerate(zip(result["token_ids"], ref)):
        assert got == expected, f"{family}: prompt {i} (len {len(prompts[i])}) diverged from HF"
