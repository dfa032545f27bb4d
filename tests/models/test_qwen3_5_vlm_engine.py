"""Images through LLMEngine on tiny random Qwen3.5 vision-language models (dense and MoE): greedy tokens
equal HF generate on the same inputs under the engine's settings, chunked prefill splitting an image's
placeholders included; the encoder runs once per image however the prompt is split."""
import pytest
import torch

from atom_core import LLMEngine, SamplingParams
from tests.tiny_vlm import VLMS, build_tiny_vlm, hf_generate, hf_inputs, png_bytes, synthetic_image

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMAGES = {"a": synthetic_image(11, (50, 37)), "b": synthetic_image(12, (64, 48))}
# Messages as parts: an image name or text. The placeholders land at different offsets; one prompt has both
# images, one has none.
CASES = [["What is in the picture?", "a"], ["What is in the picture?", "b"], ["a", "Compare them.", "b"],
         ["No image here."]]
SEED = 1  # a random model whose greedy text answers to a and b differ (HF's, checked below)


def _messages(parts: list[str]) -> list[dict]:
    content = [{"type": "image"} if p in IMAGES else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def _images(parts: list[str]) -> list:
    return [IMAGES[p] for p in parts if p in IMAGES]


@pytest.fixture(scope="module", params=list(VLMS), ids=["dense", "moe"])
def vlm(request, tmp_path_factory):
    import transformers as tf

    arch = request.param
    path = build_tiny_vlm(tmp_path_factory.mktemp(f"tiny_{arch}_vlm_engine"), arch, seed=SEED)
    hf = getattr(tf, VLMS[arch]).from_pretrained(str(path), dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(str(path))
    refs = [hf_generate(hf, hf_inputs(tokenizer, _messages(c), _images(c)), MAX_TOKENS) for c in CASES]
    return path, tokenizer, refs


def _run(engine: LLMEngine, tokenizer) -> list[list[int]]:
    prompts = [tokenizer.apply_chat_template(_messages(c), tokenize=False, add_generation_prompt=True) for c in CASES]
    # PIL images and PNG bytes both
    images = [[png_bytes(im) if i % 2 else im for i, im in enumerate(_images(c))] for c in CASES]
    return [o["token_ids"] for o in engine.generate(prompts, GREEDY, images=images)]


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 40}, {"enable_prefix_caching": True},
                                     {"max_num_seqs": 2}], ids=["defaults", "chunked", "prefix_caching", "two_seqs"])
def test_greedy_equals_hf(vlm, options):
    path, tokenizer, refs = vlm
    engine = LLMEngine(str(path), **options)
    assert _run(engine, tokenizer) == refs
    assert refs[0] != refs[1], "two images gave the same output: the test cannot tell them apart"


def test_chunked_prefill_splits_an_image_and_encodes_it_once(vlm):
    """max_num_batched_tokens 40: image a's placeholders (tokens 5-34) and image b's (48 tokens, from 41)
    cross chunk boundaries; each image is encoded once, in the step its first chunk runs."""
    path, tokenizer, refs = vlm
    engine = LLMEngine(str(path), max_num_batched_tokens=40, max_num_seqs=1)
    runner = engine.core.executor.runner
    calls = []
    encode = runner.model.encode_images
    runner.model.encode_images = lambda items: calls.append([i.length for i in items]) or encode(items)
    prompt = tokenizer.apply_chat_template(_messages(CASES[2]), tokenize=False, add_generation_prompt=True)
    out = engine.generate([prompt], GREEDY, images=[[IMAGES["a"], IMAGES["b"]]])
    assert out[0]["token_ids"] == refs[2]
    assert sorted(n for call in calls for n in call) == [30, 48]
    assert engine.core.scheduler.encoder.num_used > 0  # kept for a later request with the same image


def test_bad_image_requests_are_refused_before_queueing(vlm, tiny_llama):
    path, tokenizer, _ = vlm
    engine = LLMEngine(str(path))
    prompt = engine.image_chat_prompt("What?", 1)
    with pytest.raises(ValueError, match="1 image placeholder"):
        engine.generate([prompt], GREEDY, images=[[IMAGES["a"], IMAGES["b"]]])
    with pytest.raises(ValueError, match="image 0: cannot decode the image"):
        engine.generate([prompt], GREEDY, images=[[b"not an image"]])
    with pytest.raises(ValueError, match="one list of images per prompt"):
        engine.generate([prompt], GREEDY, images=[IMAGES["a"]] * 2)
    assert engine.core.scheduler.num_waiting == 0
    assert len(engine.generate([prompt], GREEDY, images=[[IMAGES["a"]]])[0]["token_ids"]) == MAX_TOKENS
    text_model = LLMEngine(str(tiny_llama), device="cpu")
    with pytest.raises(ValueError, match="takes no images"):
        text_model.generate(["hi"], GREEDY, images=[[IMAGES["a"]]])
    with pytest.raises(ValueError, match="takes no images"):
        text_model.image_chat_prompt("hi")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_hf(vlm):
    """On a GPU: KV sizing profiles the encoder (a largest image beside the dummy step), decode steps
    replay graphs, image steps run eagerly; fp32 greedy tokens equal HF's on the CPU."""
    path, tokenizer, refs = vlm
    engine = LLMEngine(str(path), device="cuda", dtype="float32", max_num_batched_tokens=40)
    assert _run(engine, tokenizer) == refs
