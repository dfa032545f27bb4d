"""Train a multi-token-prediction (MTP) layer on top of the frozen demo model.

The layer is DeepSeek-V3's "nextn" layer with a Llama decoder block: at position t it reads the
frozen model's final hidden state h_t (after the final norm, what the model hands its LM head)
and the embedding of token t+1, and predicts token t+2:

    x = eh_proj(cat(enorm(embed(token_{t+1})), hnorm(h_t)))      # eh_proj: [H, 2H]
    y = shared_head.norm(block(x))                               # a Llama decoder block
    logits = head(y)                                             # the model's tied embedding

Drafting k > 1 tokens feeds y back as the next position's hidden state, so the loss also has a
chained term (y_{t-1} in place of h_t, same token and label). Labels are the frozen model's own greedy
tokens (what a draft must match to be accepted), on the positions the base recipe trains on
(assistant replies and plain text). The embedding and head are the model's (not saved: the
engine reuses the model's when a checkpoint has no copies).

Writes --out/mtp.safetensors (tensors `model.layers.{N}.*`, N = num_hidden_layers: the
checkpoint layout of DeepSeek-V3), a config.json with num_nextn_predict_layers 1, and
mtp_metrics.json. CPU by default; the frozen model's hidden states are computed once.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from chat_format import PAD
from train import encode_documents, read_jsonl

DEMO_MODEL = Path(__file__).resolve().parents[2] / "atom_core" / "demo_model"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEMO_MODEL, help="the frozen model directory")
    p.add_argument("--corpus", type=Path, required=True, help="directory with train.jsonl (make_corpus.py)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-docs", type=int, default=4000, help="training documents (hidden states cached once)")
    p.add_argument("--eval-docs", type=int, default=400,
                   help="documents after the training ones, for the agreement score")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--chain-weight", type=float, default=0.5, help="weight of the chained (second draft) loss")
    p.add_argument("--max-doc-tokens", type=int, default=192)
    return p.parse_args()


class MTPLayer(nn.Module):
    """The trainable part; parameter names follow the checkpoint layout (see `state_dict_for_checkpoint`)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = LlamaRMSNorm(h, eps)
        self.hnorm = LlamaRMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = LlamaDecoderLayer(config, layer_idx)
        self.head_norm = LlamaRMSNorm(h, eps)

    def forward(self, embeds, hidden, position_embeddings):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.head_norm(self.block(x, attention_mask=None, position_embeddings=position_embeddings))

    def state_dict_for_checkpoint(self, index: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in self.state_dict().items():
            name = name.replace("block.", "").replace("head_norm.", "shared_head.norm.")
            out[f"model.layers.{index}.{name}"] = t.detach().to("cpu", torch.bfloat16).contiguous()
        return out


@torch.no_grad()
def cache_batches(model, ids, mask, lengths, batch_size: int, device: str):
    """Documents sorted by length, cut into batches; per batch the frozen model's final hidden
    states (bf16) and greedy next tokens, and which positions t have a trained target t+2."""
    order = torch.argsort(lengths)
    batches = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        n = int(lengths[idx].max())
        x, m, lens = ids[idx, :n].to(device), mask[idx, :n].to(device), lengths[idx].to(device)
        out = model.model(input_ids=x)
        hidden = out.last_hidden_state
        greedy = model.lm_head(hidden).argmax(dim=-1)  # greedy[t]: the model's token for position t+1
        real = torch.arange(n, device=device)[None] < lens[:, None]
        # position t: input token t+1 (known), label greedy[t+1] (the model's token t+2)
        step1 = torch.zeros_like(m)
        step1[:, : n - 2] = m[:, 2:] & real[:, 2:]
        batches.append((x.cpu(), hidden.to(torch.bfloat16).cpu(), greedy.cpu(), step1.cpu()))
    return batches


def mtp_losses(mtp, model, batch, device: str):
    """(step-1 loss, step-2 loss, step-1 hits, step-1 count, step-2 hits, step-2 count)."""
    x, hidden, greedy, step1 = (t.to(device) for t in batch)
    n = x.shape[1]
    embed = model.model.embed_tokens
    positions = torch.arange(n, device=device)[None].expand(x.shape[0], -1)
    pe = model.model.rotary_emb(hidden, position_ids=positions)
    nxt = torch.cat([x[:, 1:], x[:, -1:]], dim=1)  # token t+1 at position t
    label = torch.cat([greedy[:, 1:], greedy[:, -1:]], dim=1)  # the model's token t+2
    y1 = mtp(embed(nxt), hidden.float(), pe)
    # Chained, as the engine drafts a second token: position t reads the layer's own output at
    # t-1 (not the model's h_t) with token t+1, and predicts token t+2.
    y2 = mtp(embed(nxt), torch.cat([torch.zeros_like(y1[:, :1]), y1[:, :-1]], dim=1), pe)
    step2 = step1.clone()
    step2[:, 0] = False
    result = []
    for y, m in ((y1, step1), (y2, step2)):
        logits = model.lm_head(y)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1), reduction="none")
        w = m.reshape(-1).float()
        hits = ((logits.argmax(-1) == label) & m).sum()
        result.append(((ce * w).sum() / w.sum().clamp(min=1), hits, m.sum()))
    (l1, h1, c1), (l2, h2, c2) = result
    return l1, l2, h1, c1, h2, c2


def agreement(mtp, model, batches, device: str) -> dict:
    mtp.eval()
    h1 = c1 = h2 = c2 = 0
    with torch.no_grad():
        for b in batches:
            _, _, a1, n1, a2, n2 = mtp_losses(mtp, model, b, device)
            h1, c1, h2, c2 = h1 + int(a1), c1 + int(n1), h2 + int(a2), c2 + int(n2)
    mtp.train()
    return {"step1_top1": round(h1 / max(c1, 1), 4), "step2_top1": round(h2 / max(c2, 1), 4), "positions": c1}


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    device = args.device
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    model.requires_grad_(False)
    config = model.config
    config._attn_implementation = "sdpa"  # causal without a mask: right padding never reaches real rows
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    docs = read_jsonl(args.corpus / "train.jsonl", args.max_docs + args.eval_docs)
    ids, mask, lengths = encode_documents(docs, tok, args.max_doc_tokens, tok.token_to_id(PAD))
    split = min(args.max_docs, len(ids) - args.eval_docs)
    t0 = time.perf_counter()
    train_batches = cache_batches(model, ids[:split], mask[:split], lengths[:split], args.batch_size, device)
    eval_batches = cache_batches(model, ids[split:], mask[split:], lengths[split:], args.batch_size, device)
    cache_s = time.perf_counter() - t0
    print(f"cached the frozen model's hidden states of {split} + {len(ids) - split} documents in {cache_s:.1f}s",
          flush=True)

    index = config.num_hidden_layers
    mtp = MTPLayer(config, index).to(device)
    with torch.no_grad():  # warm start: the model's last block and final norm
        mtp.block.load_state_dict(model.model.layers[index - 1].state_dict())
        mtp.head_norm.weight.copy_(model.model.norm.weight)
    print(f"MTP layer: {sum(p.numel() for p in mtp.parameters()) / 1e6:.2f}M trained parameters; before training: "
          f"{agreement(mtp, model, eval_batches, device)}", flush=True)
    decay = [p for p in mtp.parameters() if p.dim() >= 2]
    no_decay = [p for p in mtp.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    total = max(1, int(args.epochs * len(train_batches)))
    gen = torch.Generator().manual_seed(args.seed)
    curve, window, step, start = [], [], 0, time.perf_counter()
    while step < total:
        for i in torch.randperm(len(train_batches), generator=gen).tolist():
            if step >= total:
                break
            lr = args.lr * min(1.0, (step + 1) / 50) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / total)))
            for g in opt.param_groups:
                g["lr"] = lr
            l1, l2, *_ = mtp_losses(mtp, model, train_batches[i], device)
            loss = l1 + args.chain_weight * l2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
            opt.step()
            step += 1
            window.append((l1.item(), l2.item()))
            if step % 50 == 0 or step == total:
                a, b = (sum(v) / len(window) for v in zip(*window))
                window = []
                curve.append({"step": step, "loss_step1": round(a, 4), "loss_step2": round(b, 4), "lr": lr,
                              "elapsed_s": round(time.perf_counter() - start, 1)})
                print(f"step {step:5d}/{total}  loss {a:.4f} (chained {b:.4f})  lr {lr:.2e}  "
                      f"{time.perf_counter() - start:6.1f}s", flush=True)
    train_s = time.perf_counter() - start
    scores = agreement(mtp, model, eval_batches, device)
    print(f"trained {step} steps in {train_s:.1f}s; held-out agreement with the model's greedy tokens: {scores}")

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(mtp.state_dict_for_checkpoint(index), str(args.out / "mtp.safetensors"), metadata={"format": "pt"})
    raw = json.loads((args.model / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (args.out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    metrics = {"args": {k: str(v) for k, v in vars(args).items()}, "cache_seconds": round(cache_s, 1),
               "train_seconds": round(train_s, 1), "steps": step, "curve": curve, "heldout_agreement": scores,
               "num_parameters": sum(p.numel() for p in mtp.parameters())}
    (args.out / "mtp_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")


if __name__ == "__main__":
    main()
