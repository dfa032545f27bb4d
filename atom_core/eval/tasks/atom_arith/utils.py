"""Data loading and choices for the atom_arith tasks (lm-eval resolves `!function utils.*` here).

The data ships beside this file: heldout.jsonl (the demo model recipe's held-out split, no
overlap with its training corpus) is the test split; fewshot.jsonl (questions drawn like the
training ones) is the few-shot pool.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
IM_END = "<|im_end|>"


def load_atom_arith(**kwargs):
    """The dataset: lm-eval's `json` loader on the shipped files, by absolute path (any cwd works)."""
    import datasets

    return datasets.load_dataset(
        "json",
        data_files={"train": str(DATA_DIR / "fewshot.jsonl"), "test": str(DATA_DIR / "heldout.jsonl")},
    )


def doc_to_choice(doc: dict) -> list[str]:
    """Each numeric choice closed by <|im_end|>, so '1' cannot win over '10' by being a prefix of it."""
    return [choice + IM_END for choice in doc["choices"]]
