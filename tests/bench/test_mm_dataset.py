"""The random-mm dataset (vLLM's): the random dataset's texts plus seeded synthetic images per request, in
vLLM's flag spellings; it needs the chat backend. (A run against a served vision-language model:
tests/server/test_images_api.py.)"""
from __future__ import annotations

import base64
import io

import pytest
from PIL import Image
from typer.testing import CliRunner

from atom_core.bench.datasets import DatasetConfig, sample_random, sample_requests
from atom_core.bench.serve_bench import ServeBenchConfig


def _size(url: str) -> tuple[int, int]:
    assert url.startswith("data:image/jpeg;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    return image.height, image.width


def test_images_per_request_follow_the_flags_and_the_seed(byte_bpe):
    cfg = DatasetConfig(name="random-mm", random_input_len=20, random_output_len=4,
                        random_mm_base_items_per_request=2, random_mm_num_mm_items_range_ratio=0.5,
                        random_mm_limit_mm_per_prompt='{"image": 2}',
                        random_mm_bucket_config="{(16, 24, 1): 0.5, (32, 8, 1): 0.5}")
    requests = sample_requests(cfg, byte_bpe, 24, seed=3)
    counts = [len(r.images) for r in requests]
    assert set(counts) == {1, 2}  # [2 * 0.5, 2 * 1.5] capped at 2
    assert {_size(u) for r in requests for u in r.images} == {(16, 24), (32, 8)}
    texts = sample_random(byte_bpe, 24, 20, 4, seed=3)
    assert [r.prompt for r in requests] == [t.prompt for t in texts]  # text as the random dataset's
    assert [r.images for r in sample_requests(cfg, byte_bpe, 24, seed=3)] == [r.images for r in requests]
    assert [r.images for r in sample_requests(cfg, byte_bpe, 24, seed=4)] != [r.images for r in requests]


@pytest.mark.parametrize("fields, message", [
    ({"random_mm_bucket_config": "{(16, 16, 2): 1.0}"}, "only images"),
    ({"random_mm_bucket_config": "[1, 2]"}, "expected a dict"),
    ({"random_mm_bucket_config": "{(16, 16, 1): 0}"}, "sum to 0"),
    ({"random_mm_limit_mm_per_prompt": '{"video": 1}'}, 'expected {"image": N}'),
    ({"random_mm_base_items_per_request": -1}, "must be >= 0"),
    ({"random_mm_num_mm_items_range_ratio": 1.5}, "in [0, 1]"),
])
def test_bad_flags_are_refused(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        DatasetConfig(name="random-mm", **fields)


def test_needs_the_chat_backend():
    with pytest.raises(ValueError, match="needs --backend openai-chat"):
        ServeBenchConfig(backend="openai", dataset=DatasetConfig(name="random-mm"))
    ServeBenchConfig(backend="openai-chat", dataset=DatasetConfig(name="random-mm"))


def test_cli_flags_reach_the_dataset(monkeypatch):
    import atom_core.bench.serve_bench as serve_bench
    from atomctl.main import app

    seen = {}

    def record(cfg, **_):
        seen["cfg"] = cfg
        raise ValueError("recorded")

    monkeypatch.setattr(serve_bench, "run_benchmark", record)
    result = CliRunner().invoke(app, ["bench", "serve", "--backend", "openai-chat", "--dataset-name", "random-mm",
                                      "--random-mm-base-items-per-request", "3", "--random-mm-num-mm-items-range-ratio",
                                      "0.25", "--random-mm-limit-mm-per-prompt", '{"image": 2}',
                                      "--random-mm-bucket-config", "{(8, 8, 1): 1.0}", "--base-url",
                                      "http://127.0.0.1:9"])
    cfg = seen.get("cfg")
    assert cfg is not None and "recorded" in result.output, result.output
    d = cfg.dataset
    assert (d.random_mm_base_items_per_request, d.random_mm_num_mm_items_range_ratio) == (3, 0.25)
    assert (d.random_mm_limit_mm_per_prompt, d.random_mm_bucket_config) == ('{"image": 2}', "{(8, 8, 1): 1.0}")
