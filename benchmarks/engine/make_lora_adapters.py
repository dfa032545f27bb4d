"""Write N random PEFT LoRA adapters for a model's config (a directory or preset:NAME), for the
multi-LoRA benchmarks: rank R on q/k/v/o/gate/up/down of every layer, A and B random (weight values
do not change a dense model's speed), in the adapter_config.json + adapter_model.safetensors layout
PEFT writes.

    python -m benchmarks.engine.make_lora_adapters preset:Llama-3-8B /tmp/loras --num 8 --rank 16
prints the --lora-modules arguments for `atomctl serve`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from atom_core.loader import resolve_model_files
from atom_core.lora.adapter import TARGET_MODULES, _projection_shapes


def make_adapters(model: str, out: Path, num: int, rank: int, dtype: torch.dtype = torch.bfloat16) -> list[Path]:
    hf_config = resolve_model_files(model).hf_config
    shapes = _projection_shapes(hf_config)
    paths = []
    for n in range(num):
        gen = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(hf_config.num_hidden_layers):
            for target in TARGET_MODULES:
                block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{block}.{target}"
                fan_in, fan_out = shapes[target]
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.01).to(dtype)
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).to(dtype)
        path = out / f"lora{n}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
            "bias": "none", "use_rslora": False, "use_dora": False}))
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--num", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    paths = make_adapters(args.model, args.out, args.num, args.rank)
    print(" ".join(f"--lora-modules lora{i}={p}" for i, p in enumerate(paths)))


if __name__ == "__main__":
    main()
