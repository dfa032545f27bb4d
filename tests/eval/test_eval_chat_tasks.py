"""`atomctl eval --apply-chat-template` and the built-in tasks: they switch to their chat form
(the bare question, which the chat template wraps once), instead of being wrapped twice."""
from __future__ import annotations

import importlib.util

import pytest

from atom_core.eval.tasks import TASKS_DIR
from atomctl.eval_cmd import tasks_for_chat

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed")


class TestTasksForChat:
    def test_builtin_generation_tasks_switch_to_their_chat_form(self):
        assert tasks_for_chat(("atom_arith_gen",)) == ("atom_arith_gen_chat",)
        assert tasks_for_chat(("atom_arith", "atom_arith_gen")) == ("atom_arith_gen_chat",)
        assert tasks_for_chat(("gsm8k",)) == ("gsm8k",)

    def test_loglikelihood_task_is_a_clear_error(self):
        with pytest.raises(ValueError, match="atom_arith_mc scores log-likelihoods"):
            tasks_for_chat(("atom_arith_mc",))


@needs_lm_eval
class TestChatTask:
    def test_prompt_is_the_bare_question_and_the_rest_matches_the_text_task(self):
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)  # ours (see test_eval_cmd)
        names = ["atom_arith_gen", "atom_arith_gen_chat"]
        tasks = manager.load(names)["tasks"] if hasattr(manager, "load") else manager.load_task_or_group(names)
        text, chat = tasks["atom_arith_gen"], tasks["atom_arith_gen_chat"]
        doc = next(iter(chat.test_docs()))
        assert chat.doc_to_text(doc) == doc["question"]
        assert "<|im_start|>" in text.doc_to_text(doc)
        assert chat.doc_to_target(doc) == text.doc_to_target(doc)
        assert chat.config.generation_kwargs == text.config.generation_kwargs
        assert chat.config.metric_list == text.config.metric_list
        assert "atom_arith" not in (chat.config.tag or [])  # the tag runs the text tasks only
