"""Quantized tiny checkpoints written by the real llm-compressor, and HF transformers' greedy
tokens for each, in one process.

llm-compressor 0.14 pins transformers <= 5.17 and our environment has a newer one, so this
script runs in its own virtual environment (`llmcompressor_python()` makes it once and keeps it
in a cache folder; it shares the system torch through --system-site-packages). The HF reference
runs there too: transformers 5.17 with the compressed-tensors release that wrote the files.

    python llmcompressor_checkpoints.py OUT_DIR NAME[,NAME...]   (names: see SCHEMES)
writes OUT_DIR/NAME/ (the checkpoint), OUT_DIR/reference.json ({NAME: [[tokens], ...]}) and
OUT_DIR/reference_logits.json ({NAME: [[logits of each step] per prompt]}).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

LLMCOMPRESSOR = "llmcompressor==0.14.0.1"
PROMPT_LENS = [1, 7, 20, 45]
MAX_TOKENS = 12


def _w4(group_size: int | None, symmetric: bool) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric,
               "strategy": "group" if group_size else "channel", "group_size": group_size}
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


# name -> (arch, hidden size, QuantizationModifier kwargs besides targets/ignore)
SCHEMES = {
    "llama-w8a8": ("llama", 64, {"scheme": "W8A8"}),
    "llama-w4a16-g128": ("llama", 128, {"scheme": "W4A16"}),  # the preset: group 128, symmetric
    "llama-w4a16-g64-asym": ("llama", 64, _w4(64, False)),
    "llama-w4a16-channel-asym": ("llama", 64, _w4(None, False)),
    "qwen3-w8a8": ("qwen3", 64, {"scheme": "W8A8"}),
    "qwen3-w4a16-g32-asym": ("qwen3", 64, _w4(32, False)),
    "llama-fp8-dynamic": ("llama", 64, {"scheme": "FP8_DYNAMIC"}),  # float8 channel weights, dynamic per-token acts
    "qwen3-fp8-static": ("qwen3", 64, {"scheme": "FP8"}),  # float8 tensor weights, static per-tensor acts
    "llama-fp8-kv": ("llama", 64, {"scheme": "FP8_DYNAMIC", "kv_cache_scheme": {  # + calibrated KV-cache scales
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}),
}
STATIC_ACTIVATIONS = {"qwen3-fp8-static", "llama-fp8-kv"}  # calibrated on random sequences
# MoE checkpoints (tests/quant/test_w4a16_moe.py), apart so test_compressed_tensors does not make them:
# llm-compressor writes the experts one Linear at a time (experts.N.gate_proj.weight_packed ...)
MOE_SCHEMES = {
    "qwen3moe-w4a16-g32": ("qwen3_moe", 64, _w4(32, True)),
    "qwen3moe-w4a16-g128": ("qwen3_moe", 128, {"scheme": "W4A16"}),
}


def calibration_dataset(vocab: int):
    """Random token sequences for the observers of static activation scales."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(8)]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32 for _ in ids]})


def prompts(vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(99)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def venv_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "atom_core" / f"venv-{LLMCOMPRESSOR.replace('==', '-')}"


def llmcompressor_python() -> str:
    """The python of a virtual environment with llm-compressor (made on first use, ~30 s)."""
    import fcntl

    venv = venv_dir()
    python = venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:  # one maker at a time (parallel test runs)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / "ready").exists():
            return str(python)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--clear", str(venv)], check=True)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", LLMCOMPRESSOR], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"installing {LLMCOMPRESSOR} into {venv} failed:\n{done.stdout}\n{done.stderr}")
        (venv / "ready").write_text(LLMCOMPRESSOR)
    return str(python)


def make_checkpoints(out: Path, names: list[str]) -> dict[str, list[list[int]]]:
    """Run this script in the llm-compressor environment; returns the HF reference tokens."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([llmcompressor_python(), __file__, str(out), ",".join(names)], env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"llm-compressor run failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads((out / "reference.json").read_text())


def _base_model(path: Path, arch: str, hidden: int) -> Path:
    """A tiny random `arch` model (tests/tiny_models.py's recipe) with hidden size `hidden`."""
    import torch
    import transformers as tf

    from tests.tiny_models import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_theta=500000.0))
    elif arch == "qwen3_moe":  # 8 experts of I = hidden, top-2
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, head_dim=32, moe_intermediate_size=hidden,
                                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                                         tie_word_embeddings=True))
    else:
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
        for name, t in model.state_dict().items():
            if t.dim() == 1:
                t.copy_(1 + 0.2 * torch.randn_like(t) if "norm" in name else 0.1 * torch.randn_like(t))
    model.save_pretrained(str(path))
    return path


def main(out: Path, names: list[str]) -> None:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.models.harness import hf_greedy

    reference, logits, bases = {}, {}, {}
    for name in names:
        arch, hidden, kwargs = {**SCHEMES, **MOE_SCHEMES}[name]
        base = bases.get((arch, hidden)) or _base_model(out / f"base-{arch}-{hidden}", arch, hidden)
        bases[(arch, hidden)] = base
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        calibration = {}
        if name in STATIC_ACTIVATIONS:
            calibration = dict(dataset=calibration_dataset(model.config.vocab_size), num_calibration_samples=8,
                               max_seq_length=32)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", ignore=["lm_head"], **kwargs),
                **calibration)
        model.save_pretrained(str(out / name), save_compressed=True)
        AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(out / name))
        hf = AutoModelForCausalLM.from_pretrained(str(out / name), dtype=torch.float32).eval()
        reference[name] = hf_greedy(hf, prompts(hf.config.vocab_size), MAX_TOKENS)
        logits[name] = [_step_logits(hf, p, t) for p, t in zip(prompts(hf.config.vocab_size), reference[name])]
    (out / "reference.json").write_text(json.dumps(reference))
    (out / "reference_logits.json").write_text(json.dumps(logits))


def _step_logits(hf, prompt: list[int], tokens: list[int]) -> list[list[float]]:
    """HF's logits at each greedy step (teacher-forced over its own continuation)."""
    import torch

    with torch.no_grad():
        seq = torch.tensor([prompt + tokens[:-1]])
        return hf(seq).logits[0, len(prompt) - 1:].tolist()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2].split(","))
