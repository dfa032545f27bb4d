"""Kimi-K2.5 with images against transformers on a tiny random checkpoint, model-side (no engine): greedy tokens
of a prompt holding two images equal HF generate's on the same ids and pixels, whole-prompt prefill and chunks
that split the image's placeholder run; two different images give different continuations."""
from __future__ import annotations

import json

import pytest
import torch

from atom_core.loader import build_model
from atom_core.loader.model_dir import resolve_model_files
from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
from atom_core.model_ops.kv_spec import allocate_kv_cache, attention_layers, release_kv_cache
from atom_core.models.common import MultimodalEmbeds
from atom_core.models.kimi_k25 import image_patches
from atom_core.multimodal.processors.kimi_k25 import KimiK25ImageProcessor
from tests.models.kimi_k25_tiny import build_tiny_kimi, synthetic_image

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny_kimi")
    hf = build_tiny_kimi(path)
    ours = build_model(resolve_model_files(str(path)).hf_config, path, torch.float32, "cpu")
    tokenizer = tf.AutoTokenizer.from_pretrained(str(path))
    processor = KimiK25ImageProcessor(path, json.loads((path / "config.json").read_text()), tokenizer)
    return hf, ours, tokenizer, processor, path


def _prompt(tokenizer, processor, images):
    content = [{"type": "text", "text": "Look:"}] + [{"type": "image"}] * len(images) + [{"type": "text",
                                                                                        "text": "what is it?"}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                        add_generation_prompt=True)
    return processor.expand(tokenizer(ids)["input_ids"], [processor.preprocess(im) for im in images])


def _hf_greedy(hf, ids, items, patch_size):
    from transformers import GenerationConfig

    pixels = torch.cat([image_patches(item, patch_size, torch.device("cpu")) for item in items])
    grids = torch.tensor([item.data["grid_thw"].tolist() for item in items])
    cfg = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          pixel_values=pixels, image_grid_thw=grids, generation_config=cfg)
    return out[0, len(ids):].tolist()


@torch.inference_mode()
def _our_greedy(model, ids, items, chunk: int, block_size: int = 16) -> list[int]:
    """One sequence: prefill `chunk` tokens a step, each step's image rows taken from one encoder run."""
    layers = attention_layers(model)
    num_blocks = -(-(len(ids) + MAX_TOKENS) // block_size)
    allocate_kv_cache(layers, num_blocks, block_size, "cpu")
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    embeds = model.encode_images(list(items))
    tokens, done, out = list(ids), 0, []
    try:
        while len(out) < MAX_TOKENS:
            n = min(chunk, len(tokens) - done)
            rows, pieces = [], []
            for item, emb in zip(items, embeds):
                first, last = max(done, item.offset), min(done + n, item.end)
                if first < last:
                    rows.extend(range(first - done, last - done))
                    pieces.append(emb[first - item.offset:last - item.offset])
            mm = MultimodalEmbeds(torch.tensor(rows), torch.cat(pieces)) if pieces else None
            meta = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32),
                                     torch.tensor([done + n], dtype=torch.int32), table,
                                     torch.arange(done, done + n, dtype=torch.int64), n, done + n)
            with set_attention_metadata(meta):
                hidden = model(torch.tensor(tokens[done:done + n]), torch.arange(done, done + n), mm)
            done += n
            if done == len(tokens):
                tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
                out.append(tokens[-1])
    finally:
        release_kv_cache(layers)
    return out


@pytest.mark.parametrize("chunk", [1000, 7], ids=["whole_prompt", "chunks_split_the_images"])
def test_greedy_with_two_images_equals_transformers(kimi, chunk):
    hf, ours, tokenizer, processor, _ = kimi
    ids, items = _prompt(tokenizer, processor, [synthetic_image(0, (40, 24)), synthetic_image(1, (90, 70))])
    assert chunk < items[0].length or chunk > len(ids)
    expected = _hf_greedy(hf, ids, items, processor.settings.patch_size)
    assert _our_greedy(ours, ids, items, chunk) == expected


def test_two_images_give_different_continuations(kimi):
    hf, ours, tokenizer, processor, _ = kimi
    outputs = []
    for seed in (2, 3):
        ids, items = _prompt(tokenizer, processor, [synthetic_image(seed, (48, 48))])
        outputs.append(_our_greedy(ours, ids, items, 1000))
        assert outputs[-1] == _hf_greedy(hf, ids, items, processor.settings.patch_size)
    assert outputs[0] != outputs[1]


def test_published_checkpoint_layout_gives_the_same_tokens(kimi, tmp_path):
    """The release's config.json (trust_remote_code names, read without remote code) and tensor names."""
    from tests.models.kimi_k25_tiny import to_published_layout

    hf, _, tokenizer, _, saved = kimi
    path = to_published_layout(saved, tmp_path / "published")
    config = resolve_model_files(str(path)).hf_config
    assert config.architectures == ["KimiK25ForConditionalGeneration"]
    model = build_model(config, path, torch.float32, "cpu")
    processor = KimiK25ImageProcessor(path, json.loads((path / "config.json").read_text()), tokenizer)
    ids, items = _prompt(tokenizer, processor, [synthetic_image(4, (60, 30))])
    assert _our_greedy(model, ids, items, 1000) == _hf_greedy(hf, ids, items, processor.settings.patch_size)


def test_release_quantization_leaves_the_vision_tower_unquantized(kimi):
    """The release quantizes the routed experts to int4 (compressed-tensors, in text_config) and ignores
    the tower and projector by regex; our tower's module names must match those patterns."""
    from atom_core.models.kimi_k25 import KimiK25ForConditionalGeneration
    from atom_core.quant import get_quant_config
    from atom_core.quant.unquantized import UnquantizedLinearMethod

    _, ours, _, _, _ = kimi
    config = ours.config
    config.quantization_config = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 32,
                                                  "strategy": "group", "dynamic": False}}},
        "ignore": ["lm_head", r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                   r"re:.*vision_tower.*", r"re:.*mm_projector.*"]}
    try:
        model = KimiK25ForConditionalGeneration(config, quant_config=get_quant_config(config))
    finally:
        del config.quantization_config
    vision = [m for n, m in model.named_modules() if n.startswith(("vision_tower", "mm_projector"))
              and hasattr(m, "quant_method")]
    assert len(vision) == 4 * 2 + 2 and all(isinstance(m.quant_method, UnquantizedLinearMethod) for m in vision)
    assert not isinstance(model.model.layers[1].mlp.experts.quant_method, UnquantizedLinearMethod)
