"""How many routed experts a batch of 32 tokens touches per MoE layer at DeepSeek-V2-Lite shapes
(4 layers, HF transformers model, bf16, CPU) under two dummy initialisations: ours (norms
1 +- 1e-3, the rest +-1e-3, atom_core.loader.weights.init_dummy_weights) and every parameter
uniform +-1e-3. Batch-32 decode cost is bound by the experts read, so this decides the floor.

    python recipes/deepseek/route_spread.py
"""
import json

import torch
import transformers as tf

BATCH, TOP_K = 32, 6


def main() -> None:
    cfg = json.load(open("atom_core/presets/DeepSeek-V2-Lite/config.json"))
    cfg["num_hidden_layers"] = 4
    for key in ("architectures", "auto_map", "torch_dtype", "quantization_config"):
        cfg.pop(key, None)
    config = tf.DeepseekV2Config(**cfg)
    for init in ("ours", "all_uniform"):
        model = tf.DeepseekV2ForCausalLM(config).to(torch.bfloat16).eval()
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                low, high = (1 - 1e-3, 1 + 1e-3) if ("norm" in name and init == "ours") else (-1e-3, 1e-3)
                p.copy_(torch.empty(p.shape).uniform_(low, high, generator=gen).to(p.dtype))
        logits = {}
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: logits.setdefault(i, out))
        ids = torch.randint(0, config.vocab_size, (1, BATCH), generator=gen)
        with torch.no_grad():
            model(ids)
        for i, out in sorted(logits.items()):
            scores = (out if torch.is_tensor(out) else out[0]).reshape(BATCH, -1).float()
            chosen = scores.softmax(-1).topk(TOP_K, -1).indices.unique().numel()
            print(f"{init:12s} layer {i}: router logit std {scores.std().item():.2e}, "
                  f"{chosen} of {config.n_routed_experts} experts touched by {BATCH} tokens")


if __name__ == "__main__":
    main()
