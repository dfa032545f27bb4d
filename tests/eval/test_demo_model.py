"""The shipped demo model (atom_core/demo_model): a complete HF directory that transformers loads,
with the recipe's tokenizer and chat format, and that answers held-out arithmetic greedily."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from atom_core.eval.tasks import TASKS_DIR
from atom_core.loader.model_dir import DEMO_MODEL_DIR

HELDOUT = TASKS_DIR / "atom_arith" / "heldout.jsonl"
FEWSHOT = TASKS_DIR / "atom_arith" / "fewshot.jsonl"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def greedy_answers(model, tokenizer, questions: list[str]) -> list[str]:
    """Greedy replies, prompts batched by token length so that no batch needs padding."""
    prompts = [chat_prompt(tokenizer, q) for q in questions]
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(tokenizer.encode(prompt)), []).append(i)
    answers = [""] * len(prompts)
    for indices in by_length.values():
        ids = tokenizer([prompts[i] for i in indices], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        replies = tokenizer.batch_decode(out[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        for i, reply in zip(indices, replies):
            answers[i] = reply.strip()
    return answers


class TestShippedDirectory:
    def test_has_the_hf_files_within_the_size_budget(self):
        files = {p.name: p.stat().st_size for p in DEMO_MODEL_DIR.iterdir() if p.is_file()}
        assert MODEL_FILES <= set(files)
        assert sum(files.values()) <= 25 * 1024 * 1024

    def test_config_is_a_small_tied_llama_in_bf16(self):
        config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"]
        assert config["tie_word_embeddings"] is True
        assert config["torch_dtype"] == "bfloat16"
        assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA

    def test_generation_config_stops_at_im_end_and_endoftext(self, tokenizer):
        eos = json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())["eos_token_id"]
        assert eos == [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]


class TestTokenizer:
    def test_chat_template_renders_chatml_with_generation_prompt(self, tokenizer):
        assert chat_prompt(tokenizer, "What is 47 + 38?") == \
            "<|im_start|>user\nWhat is 47 + 38?<|im_end|>\n<|im_start|>assistant\n"

    def test_splits_digits_into_single_tokens_and_adds_no_bos(self, tokenizer):
        ids = tokenizer.encode("12345")
        assert [tokenizer.decode([i]) for i in ids] == list("12345")

    def test_round_trips_text(self, tokenizer):
        text = "Tom has 12 apples.\n\n  3 × 4 = 12, ünïcödé 🙂 <|im_end|>"
        assert tokenizer.decode(tokenizer.encode(text)) == text


class TestHeldOutSplit:
    def test_has_1000_questions_whose_labels_point_at_the_answer(self):
        items = read_jsonl(HELDOUT)
        assert len(items) == 1000
        assert all(item["choices"][item["label"]] == item["answer"] for item in items)
        assert all(len(set(item["choices"])) == 4 for item in items)

    def test_few_shot_pool_shares_no_question_with_the_held_out_split(self):
        assert not {i["question"] for i in read_jsonl(FEWSHOT)} & {i["question"] for i in read_jsonl(HELDOUT)}


class TestGreedyAnswers:
    def test_answers_the_readme_question(self, model, tokenizer):
        assert greedy_answers(model, tokenizer, ["What is 12 + 30?"]) == ["42"]

    def test_answers_held_out_questions(self, model, tokenizer):
        items = read_jsonl(HELDOUT)[:32]  # the split is shuffled: every kind of question shows up
        answers = greedy_answers(model, tokenizer, [it["question"] for it in items])
        wrong = [(it["question"], it["answer"], got) for it, got in zip(items, answers) if got != it["answer"]]
        assert len(wrong) <= 1, wrong
