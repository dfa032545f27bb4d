"""Random PEFT LoRA adapters on the tiny test models, and the HF transformers + PEFT greedy oracle."""
from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, out: Path, rank: int = 8, alpha: float = 16, targets=None, use_rslora: bool = False,
                 seed: int = 0, **config) -> Path:
    """A PEFT adapter of `base` saved at `out`, every A and B random (PEFT's init leaves B zero, which
    would make the adapter a no-op)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ATTENTION + MLP,
                             use_rslora=use_rslora, init_lora_weights=False, lora_dropout=0.0, **config)
    peft_model = get_peft_model(model, peft_config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(str(out))
    return Path(out)


def hf_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of HF transformers (+ PEFT when `adapter` is given), per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    outputs = []
    for prompt in prompts:
        ids = list(prompt)
        with torch.no_grad():  # a plain argmax loop: generate() would stop at (or, with min_new_tokens, ban) EOS
            for _ in range(max_tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        outputs.append(ids[len(prompt):])
    return outputs
