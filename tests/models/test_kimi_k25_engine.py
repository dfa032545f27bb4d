"""Images through LLMEngine on a tiny random Kimi-K2.5 (MLA + MoE text model, MoonViT tower): greedy tokens equal
transformers' generate under the engine's settings (defaults, which cache prefixes; chunked prefill splitting the
images' placeholders; no prefix caching; max_num_seqs 2); each image is encoded once however the prompt is split;
the prefix cache reuses an image's blocks and never another image's; two images give different outputs.

transformers' side gets the chat template's text with each <|media_pad|> repeated as its processor repeats it,
and our processor's pixels: its own image processor needs torchvision, and tests/multimodal/
test_kimi_k25_processor.py checks those pixels bit-equal to it where torchvision imports."""
from __future__ import annotations

import io
import json

import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from atom_core.models.kimi_k25 import image_patches
from atom_core.multimodal.processors.kimi_k25 import IMAGE_TOKEN, KimiK25ImageProcessor
from tests.models.kimi_k25_tiny import build_tiny_kimi, synthetic_image

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# (height, width): a is 15 placeholder tokens (padded only), b 56 (shrunk to 16 patches a side, then padded)
IMAGES = {"a": synthetic_image(11, (40, 24)), "b": synthetic_image(12, (90, 70))}
CASES = [["What is in the picture?", "a"], ["What is in the picture?", "b"], ["a", "Compare them.", "b"],
         ["No image here."]]


def _messages(parts: list[str]) -> list[dict]:
    content = [{"type": "image"} if p in IMAGES else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def _images(parts: list[str]) -> list:
    return [IMAGES[p] for p in parts if p in IMAGES]


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _hf_reference(hf, tokenizer, processor, parts: list[str]) -> list[int]:
    text = tokenizer.apply_chat_template(_messages(parts), tokenize=False, add_generation_prompt=True)
    processed = [processor.preprocess(im) for im in _images(parts)]
    pieces = text.split(IMAGE_TOKEN)
    assert len(pieces) == len(processed) + 1
    text = pieces[0] + "".join(IMAGE_TOKEN * p.num_tokens + rest for p, rest in zip(processed, pieces[1:]))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    if processed:
        from atom_core.multimodal.inputs import MultimodalItem

        items = [MultimodalItem(0, p.num_tokens, 0, p.data) for p in processed]
        inputs.update(pixel_values=torch.cat([image_patches(i, processor.settings.patch_size, torch.device("cpu"))
                                              for i in items]),
                      image_grid_thw=torch.tensor([p.data["grid_thw"].tolist() for p in processed]))
    with torch.inference_mode():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                          pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny_kimi_engine")
    hf = build_tiny_kimi(path)
    tokenizer = tf.AutoTokenizer.from_pretrained(str(path))
    processor = KimiK25ImageProcessor(path, json.loads((path / "config.json").read_text()), tokenizer)
    refs = [_hf_reference(hf, tokenizer, processor, c) for c in CASES]
    assert refs[0] != refs[1], "two images gave the same output: the test could not tell them apart"
    return path, tokenizer, refs


def _run(engine: LLMEngine, tokenizer) -> list[list[int]]:
    prompts = [tokenizer.apply_chat_template(_messages(c), tokenize=False, add_generation_prompt=True) for c in CASES]
    images = [[_png(im) if i % 2 else im for i, im in enumerate(_images(c))] for c in CASES]  # PIL and bytes
    return [o["token_ids"] for o in engine.generate(prompts, GREEDY, images=images)]


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 32}, {"enable_prefix_caching": False},
                                     {"max_num_seqs": 2}], ids=["defaults", "chunked", "no_prefix_caching", "two_seqs"])
def test_greedy_equals_transformers(kimi, options):
    path, tokenizer, refs = kimi
    assert _run(LLMEngine(str(path), **options), tokenizer) == refs


def test_chunked_prefill_splits_the_images_and_encodes_each_once(kimi):
    """32 tokens a step: image a's 15 placeholders (from token 17) and b's 56 cross chunk boundaries."""
    path, tokenizer, refs = kimi
    engine = LLMEngine(str(path), max_num_batched_tokens=32, max_num_seqs=1)
    model = engine.core.executor.runner.model
    calls, encode = [], model.encode_images
    model.encode_images = lambda items: calls.append([i.length for i in items]) or encode(items)
    prompt = tokenizer.apply_chat_template(_messages(CASES[2]), tokenize=False, add_generation_prompt=True)
    out = engine.generate([prompt], GREEDY, images=[_images(CASES[2])])
    assert out[0]["token_ids"] == refs[2]
    assert sorted(n for call in calls for n in call) == [15, 56]


def test_prefix_cache_reuses_an_image_and_never_confuses_two(kimi):
    """The same image again: its placeholder blocks come from the cache. Another image at the same
    placeholders (the same token ids in the block that holds a's placeholders) hits only the blocks before it."""
    path, tokenizer, refs = kimi
    engine = LLMEngine(str(path), enable_prefix_caching=True)
    kv, block = engine.core.kv, engine.core.kv.block_size
    prompt = tokenizer.apply_chat_template(_messages(CASES[0]), tokenize=False, add_generation_prompt=True)
    first = engine.generate([prompt], GREEDY, images=[[IMAGES["a"]]])
    image_at = tokenizer(prompt)["input_ids"].index(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    hits = kv.num_hit_tokens
    again = engine.generate([prompt], GREEDY, images=[[IMAGES["a"]]])
    assert kv.num_hit_tokens - hits >= (image_at + 15) // block * block  # a's placeholder blocks reused
    hits = kv.num_hit_tokens
    other = engine.generate([prompt], GREEDY, images=[[IMAGES["b"]]])
    assert kv.num_hit_tokens - hits == image_at // block * block
    assert first[0]["token_ids"] == again[0]["token_ids"] == refs[0] and other[0]["token_ids"] == refs[1]


def test_image_chat_prompt_and_image_files(kimi, tmp_path):
    """LLMEngine.image_chat_prompt writes Kimi's media block through the chat template; an image file path
    is read as its bytes (what `atomctl generate --image` sends)."""
    import transformers as tf

    path, tokenizer, _ = kimi
    engine = LLMEngine(str(path))
    prompt = engine.image_chat_prompt("What is in the picture?")
    assert "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>What is in the picture?" in prompt
    (tmp_path / "a.png").write_bytes(_png(IMAGES["a"]))
    out = engine.generate([prompt], GREEDY, images=[[tmp_path / "a.png"]])
    hf = tf.Kimi_K25ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    processor = KimiK25ImageProcessor(path, json.loads((path / "config.json").read_text()), tokenizer)
    assert out[0]["token_ids"] == _hf_reference(hf, tokenizer, processor, ["a", "What is in the picture?"])
