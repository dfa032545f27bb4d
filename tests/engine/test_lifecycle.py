"""LLMEngine's lifecycle: `shutdown()` (idempotent), `with LLMEngine(...) as llm:`, teardown when an
engine is dropped, so that engines, tensor-parallel ones (gloo on the CPU) among them, can be
created one after another in one process; and `model=` resolved as `--model` is (demo, preset:NAME,
a local directory)."""
from __future__ import annotations

import gc

import pytest
import torch.distributed as dist

from atom_core import LLMEngine, SamplingParams
from atom_core.loader.model_dir import DEMO_MODEL_DIR, PRESET_DIR, resolve_model_path

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7], list(range(10, 30))]
SMALL = dict(kv_cache_memory_gb=0.02)


def _tp_engine(path) -> LLMEngine:
    return LLMEngine(str(path), tensor_parallel_size=2, **SMALL)


def _workers_gone(engine: LLMEngine) -> bool:
    return all(p.poll() is not None for p in engine.core.executor.workers.values())


class TestModelNames:
    def test_demo_is_the_built_in_model_in_python_too(self):
        from atomctl.engine_options import resolve_model_arg

        assert resolve_model_path("demo") == DEMO_MODEL_DIR == resolve_model_path(resolve_model_arg("demo"))
        with LLMEngine(model="demo", num_kv_blocks=64) as llm:
            assert llm.core.files.path == DEMO_MODEL_DIR
            assert llm.generate("12 + 7 =", SamplingParams(temperature=0, max_tokens=4))[0]["text"].strip()

    def test_presets_and_directories(self, tiny_llama):
        assert resolve_model_path("preset:Qwen3-0.6B") == PRESET_DIR / "Qwen3-0.6B"
        assert resolve_model_path(str(tiny_llama)) == tiny_llama

    def test_an_unknown_name_says_demo_and_presets(self):
        with pytest.raises(ValueError, match=r"model directory not found: no/such-model .*'demo'.*preset:NAME.*"
                                             r"Qwen3-0\.6B"):
            LLMEngine("no/such-model")


class TestShutdown:
    def test_context_manager_shuts_down_and_a_closed_engine_refuses_requests(self, tiny_llama):
        with LLMEngine(str(tiny_llama), **SMALL) as llm:
            assert len(llm.generate(PROMPTS, GREEDY)) == 2
        with pytest.raises(RuntimeError, match="was shut down; create a new one"):
            llm.generate(PROMPTS, GREEDY)
        llm.shutdown()  # idempotent

    def test_a_failed_start_leaves_nothing_to_shut_down(self, tiny_llama):
        with pytest.raises(ValueError, match="KV cache too small"):
            LLMEngine(str(tiny_llama), kv_cache_memory_gb=1e-5)
        gc.collect()  # its __del__ ran on a half-built engine without raising


class TestKvCacheTooSmall:
    def test_the_error_names_the_flags_with_their_values(self, tiny_llama):
        with pytest.raises(ValueError) as err:
            LLMEngine(str(tiny_llama), kv_cache_memory_gb=1e-5, max_model_len=256)
        message = str(err.value)
        assert message.startswith("KV cache too small:") and "cannot hold one 256-token sequence" in message
        for flag in ("--kv-cache-memory-gb (now 1e-05)", "--max-model-len (now 256)", "--kv-cache-dtype fp8"):
            assert flag in message


class TestTensorParallelOneAfterAnother:
    """TP=2 engines (one worker process each, gloo) one after another in one process, ended each
    way an engine ends: shutdown(), the last reference dropped, a reference cycle the collector
    must free, and a `with` block. Each leaves its process groups and its worker, so the next one
    starts cleanly and gives the same tokens; while one runs, the next is a clear error. One test:
    every engine start costs a worker process."""

    def test_engines_one_after_another(self, tiny_llama):
        engine = _tp_engine(tiny_llama)
        first = [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        with pytest.raises(RuntimeError, match=r"another tensor-parallel engine is still running here; "
                                               r"call its shutdown\(\)"):
            _tp_engine(tiny_llama)
        engine.shutdown()
        assert not dist.is_initialized() and _workers_gone(engine)
        engine.shutdown()  # idempotent

        engine = _tp_engine(tiny_llama)
        workers = list(engine.core.executor.workers.values())
        del engine  # no shutdown(): the last reference goes
        assert not dist.is_initialized() and all(p.poll() is not None for p in workers)

        engine = _tp_engine(tiny_llama)
        engine.cycle = engine  # only the cyclic collector frees it
        gc.disable()  # and it must not run on its own before the next engine checks
        try:
            del engine
            assert dist.is_initialized()
            with _tp_engine(tiny_llama) as engine:
                assert [o["token_ids"] for o in engine.generate(PROMPTS, GREEDY)] == first
        finally:
            gc.enable()
        assert not dist.is_initialized() and _workers_gone(engine)


class TestDataParallelOneAfterAnother:
    @pytest.mark.slow  # four core processes start
    def test_replicas_start_again_after_shutdown(self, tiny_llama):
        """The async engine's own teardown: shutdown() ends every replica's core process (idempotent),
        and a second data-parallel engine in the same process serves the same tokens."""
        from atom_core.config import EngineConfig
        from tests.distributed.engines import ThreadedEngine

        config = EngineConfig.from_kwargs(str(tiny_llama), data_parallel_size=2, **SMALL)
        outputs = []
        for _ in range(2):
            engine = ThreadedEngine(config, GREEDY, timeout_s=120)
            try:
                outputs.append(engine.run(engine.generate_all(PROMPTS)))
            finally:
                engine.close()
            engine.engine.shutdown()  # idempotent
            assert all(not r.is_healthy and r._proc.exitcode is not None for r in engine.engine.replicas)
        assert outputs[0] == outputs[1] and all(len(ids) == GREEDY.max_tokens for ids in outputs[0])
