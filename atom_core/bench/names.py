"""The benchmark's choice names, in a module without heavy imports (the CLI's --help reads them)."""
from __future__ import annotations

from typing import Literal, get_args

DatasetName = Literal["random", "sharegpt", "custom", "prefix-repetition", "random-mm"]
DATASET_NAMES: tuple[str, ...] = get_args(DatasetName)

Backend = Literal["openai", "vllm", "atom", "openai-chat", "tgi"]
BACKENDS: tuple[str, ...] = get_args(Backend)
