"""`atomctl bench offline` / `bench latency` on a tiny CPU model, the reference workloads'
exact reproduction, option validation, CUDA-graph padding and KV memory-sizing arithmetic."""
import json

import pytest
import torch
from typer.testing import CliRunner

from atom_core.bench.offline import ThroughputWorkload
from atom_core.worker.graph_sizes import padded_size
from atom_core.worker.memory import MemoryPlan, dummy_step
from atomctl.main import app

runner = CliRunner()


class TestNanoWorkload:
    def test_defaults_reproduce_the_reference_token_counts(self):
        prompts, params = ThroughputWorkload().build()
        assert len(prompts) == 256
        assert sum(p.max_tokens for p in params) == 133_966  # the reference run's output tokens
        assert sum(len(p) for p in prompts) == 142_827
        assert all(100 <= len(p) <= 1024 and max(p) <= 10_000 for p in prompts)
        assert {p.temperature for p in params} == {0.6} and all(p.ignore_eos for p in params)

    def test_a_repeated_run_on_one_engine_gets_no_prefix_hits(self, tiny_llama):
        from atom_core import LLMEngine
        from atom_core.bench.offline import run_throughput

        engine = LLMEngine(str(tiny_llama), num_kv_blocks=256)
        workload = ThroughputWorkload(num_prompts=4, min_input_len=40, max_input_len=60, min_output_len=2,
                                      max_output_len=4)
        run_throughput(engine, workload)
        engine.core.kv.reset_counters()
        run_throughput(engine, workload)  # the same prompts again: every full block was cached
        assert engine.core.kv.num_queried_tokens > 0 and engine.core.kv.num_hit_tokens == 0

    def test_same_seed_same_workload(self):
        a, b = ThroughputWorkload(num_prompts=8).build(), ThroughputWorkload(num_prompts=8).build()
        assert a[0] == b[0] and [p.max_tokens for p in a[1]] == [p.max_tokens for p in b[1]]

    @pytest.mark.parametrize("kw", [dict(num_prompts=0), dict(min_input_len=10, max_input_len=5), dict(min_output_len=0)])
    def test_bad_ranges_rejected(self, kw):
        with pytest.raises(ValueError):
            ThroughputWorkload(**kw)


class TestStepTimeline:
    @pytest.mark.parametrize("num_scheduler_steps", [1, 4])
    def test_counts_add_up_to_the_workload(self, tiny_llama, num_scheduler_steps):
        """A 64-token budget chunks prompts and mixes them with decodes; with windows a decode-only
        step runs several forwards and each decode several tokens."""
        from atom_core import LLMEngine
        from atom_core.bench.offline import run_throughput

        engine = LLMEngine(str(tiny_llama), num_kv_blocks=256, max_num_batched_tokens=64,
                           num_scheduler_steps=num_scheduler_steps)
        engine.core.kv.reset_counters()
        workload = ThroughputWorkload(num_prompts=8, min_input_len=20, max_input_len=90, min_output_len=3,
                                      max_output_len=20)
        result = run_throughput(engine, workload, step_timeline=True)
        t = result.step_timeline
        assert engine.core.scheduler.num_preemptions == 0  # else recomputed outputs add prompt tokens
        assert t["with_prompt"]["prompt_tokens"] == result.input_tokens - engine.core.kv.num_hit_tokens
        assert t["decode_only"]["prompt_tokens"] == 0
        # a request's first token comes from the step that completes its prompt; every other from a decode
        assert t["total"]["decode_tokens"] == result.output_tokens - result.num_requests
        assert t["with_prompt"]["steps"] >= -(-result.input_tokens // 64) and t["decode_only"]["steps"] > 0
        assert t["with_prompt"]["decodes"] > 0  # some steps mix prompt chunks and decodes
        for field in ("steps", "forwards", "prompt_tokens", "decodes", "decode_tokens"):
            assert t["with_prompt"][field] + t["decode_only"][field] == t["total"][field]
            assert sum(row[field] for row in t["decode_only_by_batch"]) == t["decode_only"][field]
        assert t["with_prompt"]["seconds"] + t["decode_only"]["seconds"] == pytest.approx(t["total"]["seconds"])
        assert 0 < t["total"]["seconds"] <= result.elapsed_s
        if num_scheduler_steps == 1:
            assert t["total"]["decode_tokens"] == t["total"]["decodes"] and t["total"]["forwards"] == t["total"]["steps"]
        else:
            assert t["decode_only"]["forwards"] > t["decode_only"]["steps"]
        assert engine.core.step_timeline is None

    def test_off_by_default(self, tiny_llama):
        from atom_core import LLMEngine
        from atom_core.bench.offline import run_throughput

        engine = LLMEngine(str(tiny_llama), num_kv_blocks=256)
        result = run_throughput(engine, ThroughputWorkload(num_prompts=2, min_input_len=5, max_input_len=9,
                                                           min_output_len=2, max_output_len=3))
        assert result.step_timeline is None and engine.core.step_timeline is None


class TestCommands:
    def test_offline_runs_and_writes_json(self, tiny_llama, tmp_path):
        out = tmp_path / "off.json"
        res = runner.invoke(app, ["bench", "offline", "--model", str(tiny_llama), "--device", "cpu", "--num-prompts", "6",
                                  "--min-input-len", "10", "--max-input-len", "40", "--min-output-len", "4", "--max-output-len", "12",
                                  "--output-json", str(out)])
        assert res.exit_code == 0, res.output
        data = json.loads(out.read_text())
        assert data["num_requests"] == 6 and data["output_throughput"] > 0
        assert 6 * 4 <= data["output_tokens"] <= 6 * 12
        assert "output tok/s" in res.output
        assert data["step_timeline"] is None and "step timeline" not in res.output  # off by default
        assert set(data["startup_breakdown_s"]) == {"load", "compile_setup", "kv_sizing", "kernel_warm_up",
                                                    "graph_capture", "other"}
        assert sum(data["startup_breakdown_s"].values()) == pytest.approx(data["startup_s"])

    def test_workload_seed_draws_another_workload(self, tiny_llama, tmp_path):
        """--workload-seed seeds the prompts and lengths: the same seed twice is one workload, another seed
        another (output tokens and the recorded seed follow ThroughputWorkload.build's draw)."""
        def run(seed: str, name: str) -> dict:
            out = tmp_path / name
            res = runner.invoke(app, ["bench", "offline", "--model", str(tiny_llama), "--device", "cpu",
                                      "--num-prompts", "4", "--min-input-len", "5", "--max-input-len", "30",
                                      "--min-output-len", "2", "--max-output-len", "9", "--workload-seed", seed,
                                      "--output-json", str(out)])
            assert res.exit_code == 0, res.output
            return json.loads(out.read_text())

        first, again, other = run("7", "a.json"), run("7", "b.json"), run("8", "c.json")
        vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]  # run_throughput's id bound
        expected = {seed: sum(p.max_tokens for p in ThroughputWorkload(
            num_prompts=4, min_input_len=5, max_input_len=30, min_output_len=2, max_output_len=9, seed=seed,
            max_token_id=vocab - 1).build()[1]) for seed in (7, 8)}
        assert expected[7] != expected[8]
        assert first["workload"]["seed"] == again["workload"]["seed"] == 7 and other["workload"]["seed"] == 8
        assert first["output_tokens"] == again["output_tokens"] == expected[7]
        assert other["output_tokens"] == expected[8]

    def test_offline_with_multi_step_windows(self, tiny_llama, tmp_path):
        out = tmp_path / "off.json"
        res = runner.invoke(app, ["bench", "offline", "--model", str(tiny_llama), "--device", "cpu", "--num-prompts", "4",
                                  "--min-input-len", "10", "--max-input-len", "20", "--min-output-len", "9", "--max-output-len", "9",
                                  "--num-scheduler-steps", "4", "--output-json", str(out)])
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["output_tokens"] == 4 * 9

    def test_offline_over_two_data_parallel_replicas(self, tiny_llama, tmp_path):
        """-dp 2: two engine cores behind the serving balancer; every request served once, both replicas used."""
        out = tmp_path / "off_dp.json"
        res = runner.invoke(app, ["bench", "offline", "--model", str(tiny_llama), "--device", "cpu", "-dp", "2",
                                  "--num-prompts", "6", "--min-input-len", "10", "--max-input-len", "40",
                                  "--min-output-len", "5", "--max-output-len", "5", "--output-json", str(out)])
        assert res.exit_code == 0, res.output
        data = json.loads(out.read_text())
        assert data["num_requests"] == 6 and data["output_tokens"] == 6 * 5 and data["output_throughput"] > 0
        assert sum(data["requests_per_replica"]) == 6 and min(data["requests_per_replica"]) >= 1
        assert "requests per replica" in res.output and "3 / 3" in res.output  # least outstanding: an even split

    def test_offline_step_timeline_prints_tables_and_writes_json(self, tiny_llama, tmp_path):
        out = tmp_path / "off.json"
        res = runner.invoke(app, ["bench", "offline", "--model", str(tiny_llama), "--device", "cpu", "--num-prompts", "6",
                                  "--min-input-len", "10", "--max-input-len", "40", "--min-output-len", "4", "--max-output-len", "12",
                                  "--step-timeline", "--output-json", str(out)])
        assert res.exit_code == 0, res.output
        data = json.loads(out.read_text())
        timeline = data["step_timeline"]
        assert timeline["total"]["prompt_tokens"] == data["input_tokens"]  # random prompts: no prefix hits
        assert timeline["total"]["decode_tokens"] == data["output_tokens"] - 6
        assert "step timeline" in res.output and "decode-only steps by batch size" in res.output
        assert f"{data['input_tokens']:,}" in res.output  # the prompt tokens of the with-prompt and total rows
        for label in ("with", "decode", "total", "1-8"):
            assert label in res.output
        windows = timeline["decode_only"]["forwards"] != timeline["decode_only"]["steps"]  # default: 8-step windows
        assert windows and "decode windows:" in res.output

    def test_offline_step_timeline_with_data_parallel_replicas_is_a_clear_error(self, tiny_llama):
        res = runner.invoke(app, ["bench", "offline", "--model", str(tiny_llama), "--device", "cpu", "-dp", "2",
                                  "--step-timeline"])
        assert res.exit_code == 1
        assert res.output.strip().startswith("error: --step-timeline") and "--data-parallel-size 2" in res.output
        assert len(res.output.strip().splitlines()) == 1

    def test_latency_with_data_parallel_replicas_is_a_clear_error(self, tiny_llama):
        res = runner.invoke(app, ["bench", "latency", "--model", str(tiny_llama), "--device", "cpu", "-dp", "2"])
        assert res.exit_code != 0 and "data_parallel_size=2" in res.output

    def test_latency_reports_ttft_tpot_e2e(self, tiny_llama, tmp_path):
        out = tmp_path / "lat.json"
        res = runner.invoke(app, ["bench", "latency", "--model", str(tiny_llama), "--device", "cpu", "--bs", "2",
                                  "--input-len", "8", "--output-len", "5", "--num-iters", "2", "--output-json", str(out)])
        assert res.exit_code == 0, res.output
        data = json.loads(out.read_text())
        assert data["batch_size"] == 2 and data["tpot_s"] > 0
        assert data["ttft_s"]["median"] > 0 and data["e2e_s"]["median"] >= data["ttft_s"]["median"]

    @pytest.mark.parametrize("args", [
        ["bench", "latency", "--bs", "0"],
        ["bench", "latency", "--output-len", "0"],
        ["bench", "offline", "--num-prompts", "0"],
        ["bench", "offline", "--min-input-len", "50", "--max-input-len", "10"],
        ["bench", "offline", "--cudagraph-capture-sizes", "1,x"],
        ["bench", "offline", "--level", "7"],
        ["bench", "offline", "--num-scheduler-steps", "0"],
    ])
    def test_bad_options_are_one_line_errors(self, tiny_llama, args):
        res = runner.invoke(app, [*args, "--model", str(tiny_llama), "--device", "cpu"])
        assert res.exit_code == 1
        assert res.output.strip().startswith("error:") and len(res.output.strip().splitlines()) == 1


class TestGraphPadding:
    SIZES = (1, 2, 4, 8, 16, 32)

    @pytest.mark.parametrize("bs,padded", [(1, 1), (3, 4), (4, 4), (5, 8), (17, 32), (32, 32), (33, None)])
    def test_pads_up_to_the_next_captured_size(self, bs, padded):
        assert padded_size(self.SIZES, bs) == padded

    def test_capture_sizes_are_capped_by_max_num_seqs(self):
        from atom_core.config import EngineConfig

        cfg = EngineConfig.from_kwargs("x", max_num_seqs=20, cudagraph_capture_sizes=(1, 8, 16, 32, 8))
        assert cfg.capture_sizes == (1, 8, 16)


class TestMemorySizing:
    @pytest.mark.parametrize("preset, layers", [("Qwen3-0.6B", 28), ("Llama-3-8B", 32)])
    def test_kv_bytes_per_block_for_real_architectures(self, preset, layers):
        from atom_core.loader.model_dir import resolve_model_files
        from atom_core.model_ops.kv_spec import attention_layers, kv_bytes_per_block
        from atom_core.models.registry import resolve_model_class

        hf = resolve_model_files(f"preset:{preset}").hf_config
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):  # the layers' declarations only: no weights allocated
                model = resolve_model_class(hf)(hf)
        finally:
            torch.set_default_dtype(torch.float32)
        # 2 (K,V) x layers x kv_heads x head_dim x bytes x block_size
        assert kv_bytes_per_block(attention_layers(model), 16) == 2 * layers * 8 * 128 * 2 * 16

    def test_budget_subtracts_everything_else(self):
        gib = 1 << 30
        plan = MemoryPlan(total=80 * gib, utilization=0.9, used_by_others=1 * gib, weights=16 * gib,
                          peak_activations=3 * gib, graph_reserve=gib // 2)
        assert plan.kv_budget == int(72 * gib) - 1 * gib - 16 * gib - 3 * gib - gib // 2

    def test_dummy_step_covers_the_token_budget_and_every_sequence(self):
        out, num_blocks = dummy_step(max_num_batched_tokens=300, max_num_seqs=7, max_model_len=4096, block_size=16)
        assert out.total_tokens == 300 and len(out) == 7 and len(out.new_requests) == 7
        blocks = [b for _, ids in out.new_block_ids.values() for b in ids]
        assert len(blocks) == len(set(blocks)) == num_blocks  # scratch blocks never overlap
        # every request computes its whole prompt, so every one samples
        assert all(len(r.prompt_token_ids) == n for r, n in zip(out.new_requests, out.num_scheduled_tokens))
