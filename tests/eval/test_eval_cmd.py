"""`atomctl eval` and atom_core.eval: option checks, the missing-lm-eval message, the shipped
lm-eval tasks, and one end-to-end run against an auto-started `atomctl serve`."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import typer
from typer.testing import CliRunner

from atom_core.eval import EvalConfig, LmEvalNotInstalledError, run_eval
from atom_core.eval.runner import endpoint_url, score_rows
from atom_core.eval.tasks import BUILTIN_TAGS, BUILTIN_TASKS, TASKS_DIR
from atom_core.loader.model_dir import DEMO_MODEL_DIR
from atomctl import eval_cmd

HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
HAS_SERVER = importlib.util.find_spec("atom_core.server") is not None
needs_lm_eval = pytest.mark.skipif(not HAS_LM_EVAL, reason="lm-eval is not installed (pip install 'atomctl[eval]')")
INSTALL_HINT = "lm-eval is not installed; pip install 'atomctl[eval]'"


@pytest.fixture(scope="module")
def cli() -> typer.Typer:
    """An app with only the eval command, as atomctl.main registers it."""
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def main():
        pass

    eval_cmd.register(app)
    return app


def invoke(cli, *args: str):
    return CliRunner().invoke(cli, ["eval", *args])


@pytest.fixture
def no_lm_eval(monkeypatch):
    """Make `import lm_eval` fail, as on an install without the eval extra."""
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)


class TestMissingLmEval:
    def test_cli_says_how_to_install_and_exits_1(self, cli, no_lm_eval):
        result = invoke(cli, "--base-url", "http://127.0.0.1:9/v1")
        assert result.exit_code == 1
        assert INSTALL_HINT in result.output

    def test_run_eval_raises_an_import_error_with_the_hint(self, no_lm_eval):
        with pytest.raises(LmEvalNotInstalledError, match="pip install 'atomctl\\[eval\\]'"):
            run_eval(EvalConfig(tasks=("atom_arith_gen",), base_url="http://127.0.0.1:9/v1"))


class TestOptionValidation:
    @pytest.mark.parametrize("args, message", [
        (["--num-fewshot", "-1"], "invalid --num-fewshot -1"),
        (["--limit", "0"], "invalid --limit"),
        (["--limit", "2.5"], "invalid --limit 2.5"),
        (["--num-concurrent", "0"], "invalid --num-concurrent 0"),
        (["--base-url", "localhost:8000"], "invalid --base-url 'localhost:8000'"),
        (["--backend", "vllm"], "unknown backend 'vllm'; expected one of: server, hf"),
        (["--backend", "hf", "--base-url", "http://127.0.0.1:9/v1"], "the hf backend runs transformers on --model"),
        (["--tasks", "atom_arith_gen,,"], "invalid --tasks"),
    ])
    def test_rejects_bad_values_with_a_one_line_error(self, cli, args, message):
        result = invoke(cli, *args)
        assert result.exit_code == 1
        assert message in result.output
        assert "Traceback" not in result.output

    def test_limit_keeps_counts_whole_and_fractions_as_they_are(self):
        assert eval_cmd.parse_limit(20.0) == 20 and isinstance(eval_cmd.parse_limit(20.0), int)
        assert eval_cmd.parse_limit(0.25) == 0.25
        assert eval_cmd.parse_limit(None) is None


class TestEndpointUrl:
    @pytest.mark.parametrize("base", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/",
                                      "http://h:8000/v1/completions", "http://h:8000/v1/chat/completions"])
    def test_any_form_of_the_address_reaches_the_endpoint(self, base):
        assert endpoint_url(base, chat=False) == "http://h:8000/v1/completions"
        assert endpoint_url(base, chat=True) == "http://h:8000/v1/chat/completions"


class TestScoreRows:
    def test_pairs_each_metric_with_its_stderr(self):
        results = {
            "results": {"atom_arith_gen": {"alias": "atom_arith_gen", "exact_match,strict-match": 0.98,
                                           "exact_match_stderr,strict-match": 0.01},
                        "atom_arith_mc": {"alias": "atom_arith_mc", "acc,none": 1.0, "acc_stderr,none": "N/A"}},
            "n-shot": {"atom_arith_gen": 0, "atom_arith_mc": 3},
            "n-samples": {"atom_arith_gen": {"original": 1000, "effective": 20},
                          "atom_arith_mc": {"original": 1000, "effective": 1000}},
        }
        rows = {(r.task, r.metric): r for r in score_rows(results)}
        assert set(rows) == {("atom_arith_gen", "exact_match"), ("atom_arith_mc", "acc")}
        gen, mc = rows["atom_arith_gen", "exact_match"], rows["atom_arith_mc", "acc"]
        assert (gen.value, gen.stderr, gen.filter, gen.num_samples) == (0.98, 0.01, "strict-match", 20)
        assert (mc.stderr, mc.num_fewshot) == (None, 3)


@needs_lm_eval
class TestShippedTasks:
    @pytest.fixture(scope="class")
    @classmethod
    def tasks(cls):
        from lm_eval.tasks import TaskManager

        # Our task folder only: indexing lm-eval's own task configs (thousands) takes seconds and none of
        # them is under test here; run_eval (test_unknown_task_..., TestEndToEnd) loads ours beside them.
        manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
        assert set(BUILTIN_TASKS) | set(BUILTIN_TAGS) <= set(manager.all_tasks)
        if hasattr(manager, "load"):  # lm-eval >= 0.4.10
            return manager.load(list(BUILTIN_TASKS))["tasks"]
        return manager.load_task_or_group(list(BUILTIN_TASKS))

    def test_prompt_is_the_models_chat_template(self, tasks):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
        for task in tasks.values():
            doc = next(iter(task.test_docs()))
            expected = tokenizer.apply_chat_template([{"role": "user", "content": doc["question"]}],
                                                     add_generation_prompt=True, tokenize=False)
            assert task.doc_to_text(doc) == expected

    def test_generation_task_targets_the_answer_and_stops_at_end_of_turn(self, tasks):
        task = tasks["atom_arith_gen"]
        docs = list(task.test_docs())
        assert len(docs) == 1000
        assert task.doc_to_target(docs[0]) == docs[0]["answer"]
        assert task.config.generation_kwargs["until"] == ["<|im_end|>", "\n"]

    def test_multiple_choice_task_closes_each_choice(self, tasks):
        task = tasks["atom_arith_mc"]
        doc = next(iter(task.test_docs()))
        assert task.doc_to_choice(doc) == [c + "<|im_end|>" for c in doc["choices"]]
        assert task.doc_to_target(doc) == doc["label"]

    def test_unknown_task_is_a_value_error_naming_it(self):
        with pytest.raises(ValueError, match="unknown lm-eval task.*no_such_task"):
            run_eval(EvalConfig(tasks=("no_such_task",), base_url="http://127.0.0.1:9/v1"))


@needs_lm_eval
@pytest.mark.skipif(not HAS_SERVER, reason="atom_core.server is not built yet")
@pytest.mark.slow
class TestEndToEnd:
    def test_server_started_for_the_demo_model_meets_the_bar(self, cli, tmp_path):
        result = invoke(cli, "--limit", "20", "--output-path", str(tmp_path), "--serve-args", "--device cpu")
        assert result.exit_code == 0, result.output
        scores = json.loads((tmp_path / "results.json").read_text())["results"]
        assert scores["atom_arith_gen"]["exact_match,strict-match"] >= 0.95
        assert scores["atom_arith_mc"]["acc,none"] >= 0.95
        assert (tmp_path / "samples_atom_arith_gen.jsonl").exists()
