"""A Qwen3.5 vision-language checkpoint directory both engines open: the text model of a preset inside
HF's ForConditionalGeneration config with the vision tower, a tokenizer carrying the image special
tokens at the config's ids and a chat template that places them, the image processor's config, and
(optionally) one set of random weights in the published layout, so vLLM and atom_core route the MoE
tokens the same way (vLLM's dummy loader seeds every tensor alike; ours does not).

- config: the preset's text config as `text_config`; the vision tower and the special token ids are
  transformers' Qwen3.5 defaults (its Qwen3_5MoeConfig documents Qwen/Qwen3.5-35B-A3B), with the
  tower's `out_hidden_size` set to the text model's hidden size (the merger feeds the text model).
- tokenizer: byte-level BPE without merges (ids 0-255 the bytes, later ids "t<id>"), with
  <|endoftext|> (the config's eos), <|im_start|> and <|im_end|> after it, and the vision tokens at the
  config's ids. Benchmarks send token ids and images, so no real words are needed.
- preprocessor_config.json: patch 16, merge 2, temporal patch 2, mean/std 0.5, pixels between
  65,536 and 16,777,216 (the values of Qwen3-VL's published processor): a 1,024 x 1,024 image is
  4,096 patches, 1,024 tokens.
- weights (--weights random): every tensor of the model's state dict, the experts saved per expert as
  transformers saves them (`mlp.experts.<e>.{gate,up,down}_proj.weight`), matrices ~N(0, 0.02) and
  1-D tensors as HF initialises them (read from a tiny model of the same class: norms, biases, the
  DeltaNet's A_log / dt_bias), in shards of about 4 GB with their index; --device cuda draws them on
  the GPU.

Usage: python -m benchmarks.engine.vlm_dir preset:Qwen3.5-35B-A3B DIR [--weights random] [--device cuda]
       [--text-overrides JSON] [--vision-overrides JSON]   (overrides: smaller models for tests)
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from atom_core.loader import resolve_model_files

OUTER = {"qwen3_5_moe_text": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
         "qwen3_5_text": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration")}
PREPROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast",
                "processor_class": "Qwen3VLProcessor"}
# Image parts as either engine hands them to the template: {"type": "image"} or OpenAI's "image_url".
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHARD_BYTES = 4 << 30


def vlm_config(model: str, text_overrides: dict | None = None, vision_overrides: dict | None = None):
    import transformers as tf

    text = resolve_model_files(model).hf_config.to_dict()
    if text.get("model_type") not in OUTER:
        raise SystemExit(f"{model}: a Qwen3.5 text model (model_type qwen3_5_text or qwen3_5_moe_text) is needed, "
                         f"not {text.get('model_type')}")
    config_name, arch = OUTER[text["model_type"]]
    text = {k: v for k, v in {**text, **(text_overrides or {})}.items() if k not in ("architectures",)}
    defaults = getattr(tf, config_name)()
    vision = {**defaults.vision_config.to_dict(), "out_hidden_size": text["hidden_size"], **(vision_overrides or {})}
    config = getattr(tf, config_name)(text_config=text, vision_config=vision,
                                      tie_word_embeddings=text.get("tie_word_embeddings", False))
    config.architectures = [arch]
    return config


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_tokenizer(config, path: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    eos = config.text_config.eos_token_id
    special = {eos: "<|endoftext|>", eos + 1: "<|im_start|>", eos + 2: "<|im_end|>",
               config.vision_start_token_id: "<|vision_start|>", config.vision_end_token_id: "<|vision_end|>",
               config.image_token_id: "<|image_pad|>", config.video_token_id: "<|video_pad|>"}
    chars = _byte_chars()
    vocab = {special.get(i, chars[i] if i < 256 else f"t{i}"): i for i in range(config.text_config.vocab_size)}
    # Byte-level BPE without merges, split as Qwen3.5's tokenizer splits: transformers loads a qwen3_5
    # directory with its own Qwen3_5Tokenizer whatever tokenizer_config names, rebuilding the BPE from
    # tokenizer.json's vocabulary and merges, so text must encode through the byte alphabet alone.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=config.text_config.max_position_embeddings)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(path))


def saved_tensors(model) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor as transformers saves the model: fused experts split per expert."""
    out = []
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        fused = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)", name)
        if fused is None:
            out.append((name, shape))
            continue
        prefix, kind = fused.groups()
        for e in range(shape[0]):
            if kind == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
                out += [(f"{prefix}.{e}.gate_proj.weight", (shape[1] // 2, shape[2])),
                        (f"{prefix}.{e}.up_proj.weight", (shape[1] // 2, shape[2]))]
            else:
                out.append((f"{prefix}.{e}.down_proj.weight", shape[1:]))
    return out


def one_d_init(config) -> dict[str, tuple[float, float]]:
    """HF's initial value of each 1-D tensor kind (layer indices folded): (mean, std) of a tiny model's."""
    import transformers as tf

    text = config.text_config.to_dict()
    small = {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 64, "layer_types": text["layer_types"][:4],
             "eos_token_id": None, "pad_token_id": None}
    if "num_experts" in text:
        small.update(num_experts=2, num_experts_per_tok=1)
    tiny = config.__class__(text_config={**text, **small},
                            vision_config={**config.vision_config.to_dict(), "depth": 1, "hidden_size": 32,
                                           "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64})
    model = getattr(tf, config.architectures[0])(tiny)
    stats = {}
    for name, tensor in model.state_dict().items():
        if tensor.dim() == 1 and tensor.is_floating_point():
            stats.setdefault(_kind(name), []).append(tensor.float())
    return {k: (torch.cat(v).mean().item(), torch.cat(v).std().item()) for k, v in stats.items()}


def _kind(name: str) -> str:
    return re.sub(r"\.\d+\.", ".N.", name)


def write_weights(config, path: Path, device: str, seed: int = 0) -> int:
    import transformers as tf
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = getattr(tf, config.architectures[0])(config)
    init = one_d_init(config)
    generator = torch.Generator(device).manual_seed(seed)
    parts, shard, size, total = [], {}, 0, 0

    def flush() -> None:
        save_file(shard, str(path / f"part-{len(parts)}.safetensors"), metadata={"format": "pt"})
        parts.append(list(shard))

    for name, shape in saved_tensors(model):
        mean, std = init.get(_kind(name), (0.0, 0.02)) if len(shape) == 1 else (0.0, 0.02)
        tensor = torch.randn(shape, generator=generator, device=device) * std + mean
        shard[name] = tensor.to(torch.bfloat16).cpu()
        size, total = size + 2 * tensor.numel(), total + tensor.numel()
        if size >= SHARD_BYTES:
            flush()
            shard, size = {}, 0
    if shard:
        flush()
    weight_map = {}
    for i, keys in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        (path / f"part-{i}.safetensors").rename(path / file)
        weight_map.update(dict.fromkeys(keys, file))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 2 * total}, "weight_map": weight_map}, indent=1))
    return total


def vlm_dir(model: str, path: Path, weights: str | None = None, device: str = "cpu",
            text_overrides: dict | None = None, vision_overrides: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = vlm_config(model, text_overrides, vision_overrides)
    config.save_pretrained(str(path))
    write_tokenizer(config, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=1))
    if weights == "random":
        print(f"{write_weights(config, path, device) / 1e9:.2f} B parameters written")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine.vlm_dir")
    parser.add_argument("model")
    parser.add_argument("dir", type=Path)
    parser.add_argument("--weights", choices=["random"], default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--text-overrides", type=json.loads, default=None)
    parser.add_argument("--vision-overrides", type=json.loads, default=None)
    args = parser.parse_args(argv)
    print(vlm_dir(args.model, args.dir, args.weights, args.device, args.text_overrides, args.vision_overrides))


if __name__ == "__main__":
    main()
