"""Kimi-K2.5 images over the OpenAI API (`atomctl serve` subprocess, real sockets, the openai SDK): greedy output
of a tiny random Kimi-K2.5 equals transformers' generate (tests/models/test_kimi_k25_engine.py builds the
reference, and runs each engine setting on its own) on one server that combines them: chunked prefill splitting
the images, max_num_seqs 2, prefix caching on (a repeated request reads its image's blocks from the cache);
/v1/models says it takes images."""
from __future__ import annotations

import base64
import io
import json

import pytest

from tests.server.conftest import start_server

MAX_TOKENS = 6


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _openai_messages(parts: list[str]) -> list[dict]:
    from tests.models.test_kimi_k25_engine import IMAGES

    content = [{"type": "image_url", "image_url": {"url": _data_url(IMAGES[p])}} if p in IMAGES
               else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def kimi_and_refs(tmp_path_factory):
    import transformers as tf

    from atom_core.multimodal.processors.kimi_k25 import KimiK25ImageProcessor
    from tests.models.kimi_k25_tiny import build_tiny_kimi
    from tests.models.test_kimi_k25_engine import CASES, _hf_reference

    path = tmp_path_factory.mktemp("tiny_kimi_api")
    hf = build_tiny_kimi(path)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(path))
    processor = KimiK25ImageProcessor(path, json.loads((path / "config.json").read_text()), tokenizer)
    refs = [_hf_reference(hf, tokenizer, processor, c) for c in CASES]
    assert refs[0] != refs[1]
    return path, tokenizer, list(zip(CASES, refs))


@pytest.fixture(scope="module")
def kimi_server(kimi_and_refs, tmp_path_factory):
    srv = start_server(kimi_and_refs[0], tmp_path_factory.mktemp("serve_kimi"), "--max-num-batched-tokens", "32",
                       "--max-num-seqs", "2", "--enable-prefix-caching")
    yield srv
    srv.stop()


def _complete(client, parts):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=_openai_messages(parts),
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})


def test_greedy_over_the_api_equals_transformers(kimi_server, kimi_and_refs):
    _, tokenizer, cases = kimi_and_refs
    client = kimi_server.openai()
    for parts, ref in cases + cases[:1]:  # the first again: its prompt blocks from the prefix cache
        out = _complete(client, parts)
        assert out.choices[0].message.content == tokenizer.decode(ref, skip_special_tokens=True), parts
        assert out.usage.completion_tokens == MAX_TOKENS


def test_concurrent_requests_keep_their_images_apart(kimi_server, kimi_and_refs):
    import concurrent.futures

    _, tokenizer, cases = kimi_and_refs
    client = kimi_server.openai()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda case: _complete(client, case[0]), cases * 2))
    assert [o.choices[0].message.content for o in outs] == [tokenizer.decode(r, skip_special_tokens=True)
                                                              for _, r in cases * 2]


def test_models_lists_image_input(kimi_server):
    assert kimi_server.openai().models.list().data[0].input_modalities == ["text", "image"]
