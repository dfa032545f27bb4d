"""Images over the OpenAI API (`atomctl serve` subprocess, real sockets, the openai SDK): greedy output of a
tiny random Qwen3.5 vision-language model equals HF generate on the processor's inputs, by default and
with chunked prefill splitting the images under max_num_seqs 2 (prefix caching: these hybrid models turn
it off, tests/engine/test_encoder_cache.py covers the block keys); /v1/models says it takes images."""
from __future__ import annotations

import base64

import pytest
import torch

from tests.server.conftest import start_server
from tests.tiny_vlm import build_tiny_vlm, hf_generate, hf_inputs, png_bytes, synthetic_image

MAX_TOKENS = 6
IMAGES = {"a": synthetic_image(11, (50, 37)), "b": synthetic_image(12, (64, 48))}
CASES = [["What is in the picture?", "a"], ["What is in the picture?", "b"], ["a", "Compare them.", "b"]]


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def openai_messages(parts: list[str]) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": data_url(IMAGES[p])}} if p in IMAGES
               else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def vlm_and_refs(tmp_path_factory):
    import transformers as tf

    path = build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm_api"), "qwen3_5", seed=1)
    hf = tf.Qwen3_5ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(str(path))
    refs = []
    for parts in CASES:
        messages = [{"role": "user", "content": [{"type": "image"} if p in IMAGES else {"type": "text", "text": p}
                                                 for p in parts]}]
        refs.append(hf_generate(hf, hf_inputs(tokenizer, messages, [IMAGES[p] for p in parts if p in IMAGES]),
                                MAX_TOKENS))
    assert refs[0] != refs[1]
    return path, tokenizer, refs


@pytest.fixture(scope="module", params=[(), ("--max-num-batched-tokens", "40", "--max-num-seqs", "2")],
                ids=["defaults", "chunked_two_seqs"])
def vlm_server(request, vlm_and_refs, tmp_path_factory):
    srv = start_server(vlm_and_refs[0], tmp_path_factory.mktemp("serve_vlm"), *request.param)
    yield srv
    srv.stop()


def _complete(client, parts):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=openai_messages(parts),
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})


def test_greedy_over_the_api_equals_hf(vlm_server, vlm_and_refs):
    _, tokenizer, refs = vlm_and_refs
    client = vlm_server.openai()
    for parts, ref in zip(CASES, refs):
        out = _complete(client, parts)
        assert out.choices[0].message.content == tokenizer.decode(ref, skip_special_tokens=True)
        assert out.usage.completion_tokens == MAX_TOKENS


def test_concurrent_requests_keep_their_images_apart(vlm_server, vlm_and_refs):
    import concurrent.futures

    _, tokenizer, refs = vlm_and_refs
    client = vlm_server.openai()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda parts: _complete(client, parts), CASES * 2))
    assert [o.choices[0].message.content for o in outs] == [tokenizer.decode(r, skip_special_tokens=True)
                                                              for r in refs * 2]


def test_models_lists_image_input(vlm_server):
    card = vlm_server.openai().models.list().data[0]
    assert card.input_modalities == ["text", "image"]
