"""Bad configuration and bad requests: each is a ValueError that names the problem, and a bad
request never leaves anything queued or breaks the engine for the next one."""
from __future__ import annotations

import json

import pytest

from atom_core import LLMEngine, SamplingParams
from atom_core.config import EngineConfig
from tests.tiny_models import copy_model_with


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(str(tiny_llama), device="cpu", num_kv_blocks=64, max_model_len=32)


def assert_nothing_queued(engine: LLMEngine) -> None:
    assert engine.is_finished()
    assert not engine.core.scheduler.requests
    assert not engine.outputs.states
    assert engine.core.kv.num_free_blocks == engine.core.kv.num_blocks


class TestEngineConfigValidation:
    @pytest.mark.parametrize("field, value", [
        ("model", ""),
        ("dtype", "float8"),
        ("device", "tpu"),
        ("max_model_len", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("block_size", 0),
        ("block_size", 12),
        ("num_kv_blocks", 0),
        ("gpu_memory_utilization", 0.0),
        ("gpu_memory_utilization", 1.5),
        ("kv_cache_memory_gb", 0.0),
        ("level", 4),
        ("cudagraph_capture_sizes", ()),
        ("cudagraph_capture_sizes", (1, 0)),
        ("load_format", "pt"),
        ("num_scheduler_steps", 0),
    ])
    def test_bad_value_names_the_field_and_its_flag(self, field, value):
        flag = "--" + field.replace("_", "-")
        with pytest.raises(ValueError, match=rf"\b{field}\b.*\({flag}\)"):
            EngineConfig.from_kwargs(**{"model": "some/dir", field: value})

    def test_batched_tokens_below_max_model_len_without_chunking(self):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            EngineConfig.from_kwargs("m", enable_chunked_prefill=False, max_model_len=1024, max_num_batched_tokens=512)

    def test_good_values_pass_and_the_config_is_frozen(self):
        cfg = EngineConfig.from_kwargs("m", dtype="bf16", block_size=32, cudagraph_capture_sizes=[1, 2])
        assert cfg.compile.cudagraph_capture_sizes == (1, 2)
        with pytest.raises(AttributeError):
            cfg.cache.block_size = 8

    def test_options_land_in_their_parts(self):
        cfg = EngineConfig.from_kwargs("m", max_num_seqs=4, block_size=8, level=1, seed=3, torch_profiler_dir="/t")
        assert (cfg.scheduler.max_num_seqs, cfg.cache.block_size, cfg.compile.level) == (4, 8, 1)
        assert (cfg.model.model, cfg.model.seed, cfg.profiler.torch_profiler_dir) == ("m", 3, "/t")
        assert cfg.replace(max_num_seqs=2, level=0).scheduler.max_num_seqs == 2
        assert cfg.parallel.world_size == 1 and cfg.speculative.method is None

    def test_parallel_options_land_in_their_part(self):
        cfg = EngineConfig.from_kwargs("m", tensor_parallel_size=4, enable_expert_parallel=True, nnodes=2,
                                       node_rank=1, master_addr="10.0.0.1", master_port=29500)
        assert cfg.parallel.world_size == 4 and list(cfg.parallel.local_ranks) == [2, 3]

    def test_capture_sizes_are_capped_by_max_num_seqs(self):
        cfg = EngineConfig.from_kwargs("m", max_num_seqs=20, cudagraph_capture_sizes=[32, 1, 16, 4, 4])
        assert cfg.capture_sizes == (1, 4, 16)

    def test_unknown_engine_option_lists_the_known_ones(self):
        with pytest.raises(ValueError, match=r"unknown engine option.*'max_num_seq'.*max_num_seqs"):
            EngineConfig.from_kwargs("m", max_num_seq=4)

    def test_llm_engine_rejects_unknown_options_before_loading(self, tiny_llama):
        with pytest.raises(ValueError, match="unknown engine option.*bogus_knob"):
            LLMEngine(str(tiny_llama), bogus_knob=1)


class TestSamplingParamsValidation:
    @pytest.mark.parametrize("field, value", [
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 2.0),
        ("top_k", 0),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 100),
        ("seed", -1),
        ("seed", 2**63),
        ("stop", [""]),
    ])
    def test_bad_value_names_the_field(self, field, value):
        with pytest.raises(ValueError, match=rf"invalid sampling parameter {field}="):
            SamplingParams(**{field: value})

    def test_a_single_stop_string_is_accepted(self):
        assert SamplingParams(stop="###").stop == ["###"]


class TestModelDirectory:
    def test_missing_model_dir(self, tmp_path):
        with pytest.raises(ValueError, match="model directory not found"):
            LLMEngine(str(tmp_path / "nope"), device="cpu")

    def test_dir_without_config_json(self, tmp_path):
        with pytest.raises(ValueError, match="no config.json"):
            LLMEngine(str(tmp_path), device="cpu")

    def test_unknown_architecture_lists_the_supported_ones(self, tiny_llama, tmp_path):
        path = copy_model_with(tiny_llama, tmp_path / "foo", architectures=["FooForCausalLM"])
        with pytest.raises(ValueError, match="FooForCausalLM") as err:
            LLMEngine(str(path), device="cpu")
        assert "LlamaForCausalLM" in str(err.value) and "Qwen3ForCausalLM" in str(err.value)

    @pytest.mark.parametrize("config", [{"architectures": ["FooForCausalLM"]},
                                        {"architectures": ["FooForCausalLM"], "model_type": "foo"}],
                             ids=["no-model_type", "unknown-model_type"])
    def test_unknown_architecture_without_a_known_model_type(self, tmp_path, config):
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError) as err:
            LLMEngine(str(tmp_path), device="cpu")
        message = str(err.value)
        assert "FooForCausalLM" in message and "LlamaForCausalLM" in message and "Qwen3ForCausalLM" in message
        assert "\n" not in message

    def test_max_model_len_beyond_the_model(self, tiny_llama):
        with pytest.raises(ValueError, match="max_position_embeddings"):
            LLMEngine(str(tiny_llama), device="cpu", max_model_len=4096)


class TestBadRequests:
    def test_prompt_longer_than_max_model_len(self, engine):
        with pytest.raises(ValueError, match="max_model_len is 32"):
            engine.generate([list(range(3, 43))], SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="max_model_len"):  # the prompt must leave room for one token
            engine.generate([list(range(3, 35))], SamplingParams(max_tokens=1))
        assert_nothing_queued(engine)

    def test_prompt_plus_max_tokens_over_max_model_len(self, engine):
        with pytest.raises(ValueError, match=r"max_tokens \(20\).*exceeds max_model_len 32"):
            engine.generate([list(range(3, 23))], SamplingParams(max_tokens=20))
        assert_nothing_queued(engine)

    @pytest.mark.parametrize("case", ["negative", "vocab_size", "huge"])
    def test_token_ids_out_of_range(self, engine, case):
        vocab = engine.core.vocab_size
        ids = {"negative": [5, -1, 6], "vocab_size": [3, vocab], "huge": [5, 10**6]}[case]
        with pytest.raises(ValueError, match="out of range"):
            engine.generate([ids], SamplingParams(max_tokens=2))
        assert_nothing_queued(engine)

    @pytest.mark.parametrize("prompt", ["", [], [[]]], ids=["empty-string", "empty-list", "empty-token-list"])
    def test_empty_prompt(self, engine, prompt):
        with pytest.raises(ValueError, match="empty|no prompts"):
            engine.generate(prompt, SamplingParams(max_tokens=2))
        assert_nothing_queued(engine)

    def test_not_a_prompt(self, engine):
        with pytest.raises(ValueError, match="string or a list of token ids"):
            engine.generate([[1, 2.5]], SamplingParams(max_tokens=2))
        assert_nothing_queued(engine)

    def test_params_count_mismatch(self, engine):
        with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
            engine.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])
        assert_nothing_queued(engine)

    @pytest.mark.parametrize("position", [0, 1, 2])
    def test_one_bad_request_in_a_list_queues_nothing(self, engine, position):
        prompts = ["Hello", "world", "again"]
        prompts[position] = list(range(3, 50))  # too long
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request(prompts, SamplingParams(max_tokens=2))
        assert_nothing_queued(engine)

    def test_engine_still_serves_after_bad_requests(self, engine):
        for bad in (list(range(3, 60)), [], [-5]):
            with pytest.raises(ValueError):
                engine.add_request(["Hello", bad], SamplingParams(max_tokens=2))
        out = engine.generate(["Hello", "world"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert [o["num_tokens_output"] for o in out] == [3, 3]
        assert_nothing_queued(engine)


def test_sliding_window_models_run_past_their_window(tmp_path):
    import json

    from atom_core import LLMEngine
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "mistralish", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256)
    (path / "config.json").write_text(json.dumps(cfg))
    assert LLMEngine(str(path), device="cpu", max_model_len=512).max_model_len == 512
