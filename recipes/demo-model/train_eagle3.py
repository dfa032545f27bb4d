"""Train an EAGLE-3 draft head for the frozen demo model, saved in the public checkpoint layout.

The head (spec_decode/eagle3.py has the layout and the inference rule): at position t it reads
g_t = fc(cat(a_t^1, a_t^2, a_t^3)), the residual stream entering three of the model's layers
(eagle_aux_hidden_state_layer_ids), and the embedding of token t+1; one Llama decoder layer whose
q/k/v read cat(input_layernorm(embed), hidden_norm(g)); then norm and lm_head over a draft
vocabulary (the --draft-vocab tokens the model predicts most often on the training documents,
with the d2t / t2d maps). Labels are the frozen model's own greedy tokens (what a draft must
equal to be accepted) on the positions the base recipe trains on.

Training-time test, as EAGLE-3 and SpecForge train: the head is unrolled --steps times; step s
reads its own pre-norm output of step s-1 one position back in place of g, and its attention
sees the step-0 keys up to position p-s plus the keys steps 1..s wrote at p-s+1..p, which is
what the engine's KV holds when it drafts the (s+1)-th token (catch-up rows written from the
target's states, later draft rows from the head's own). Step s's loss has weight 0.8^s.

--self-distill replaces every assistant reply of the chat documents by the model's own greedy
reply (the engine, turn by turn, later turns after the model's earlier replies): the head then
trains on the sequences it drafts at inference, where the next token is always the model's.
--init continues training a saved head (its draft vocabulary kept). The model's hidden states are
computed once (--max-docs documents) before training. Writes --out/{config.json,
model.safetensors, eagle3_metrics.json}. CPU by default.
"""
from __future__ import annotations

import argparse
import copy
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
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

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
    p.add_argument("--layers", type=int, nargs=3, default=[2, 4, 7], help="aux layers (their inputs feed fc)")
    p.add_argument("--draft-vocab", type=int, default=512)
    p.add_argument("--max-docs", type=int, default=4000, help="training documents (hidden states cached once)")
    p.add_argument("--eval-docs", type=int, default=400, help="documents after the training ones, for agreement")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--steps", type=int, default=3, help="training-time-test unroll depth")
    p.add_argument("--max-doc-tokens", type=int, default=160)
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="stop training after this long (0: no cap; a capped run depends on the machine's speed)")
    p.add_argument("--kinds", nargs="+", default=["chat"], help="corpus document kinds to train on")
    p.add_argument("--intermediate-size", type=int, default=512, help="the head's MLP width")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--self-distill", action="store_true", help="train on the model's own greedy replies")
    p.add_argument("--init", type=Path, help="a saved head directory to continue training (its vocabulary kept)")
    return p.parse_args()


def self_distill(docs: list[dict], model_dir: Path, max_tokens: int = 96) -> list[dict]:
    """The chat documents with every assistant reply replaced by the model's greedy one (batched,
    one turn of every document a round); other documents unchanged."""
    from atom_core import LLMEngine, SamplingParams

    from chat_format import render_chat

    engine = LLMEngine(str(model_dir), num_scheduler_steps=1, max_num_seqs=64)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    out = [dict(d, messages=[]) if d["kind"] == "chat" else d for d in docs]
    turn = 0
    while True:
        todo = [(o, d["messages"]) for o, d in zip(out, docs) if d["kind"] == "chat"]
        todo = [(o, m) for o, m in todo if len(m) > turn]
        if not todo:
            return out
        asks = []
        for o, messages in todo:
            if messages[turn]["role"] == "assistant":
                asks.append(o)
            else:
                o["messages"].append(messages[turn])
        prompts = [render_chat(o["messages"], add_generation_prompt=True) for o in asks]
        for o, reply in zip(asks, engine.generate(prompts, params) if prompts else []):
            o["messages"].append({"role": "assistant", "content": reply["text"]})
        turn += 1


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, self.heads, self.kv, self.hd = config.hidden_size, config.num_attention_heads, \
            config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(2 * h, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, h, bias=False)

    def qkv(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.heads // self.kv
        return q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)


class Midlayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps)
        self.hidden_norm = LlamaRMSNorm(h, eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps)
        self.self_attn = Attention(config)
        self.mlp = LlamaMLP(config)


class Head(nn.Module):
    """Parameter names are the checkpoint's (fc, midlayer.*, norm, lm_head)."""

    def __init__(self, config, num_aux: int, draft_vocab: int):
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(num_aux * h, h, bias=False)
        self.midlayer = Midlayer(config)
        self.norm = LlamaRMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)


def shift(x: torch.Tensor, d: int, dim: int) -> torch.Tensor:
    """x moved d rows later along dim (row p holds row p - d; the first d rows are zeros)."""
    if d == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, d))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - d)], dim=dim)


def unroll(head: Head, embeds: torch.Tensor, fused: torch.Tensor, cos, sin, steps: int) -> list[torch.Tensor]:
    """Pre-norm outputs [B, T, H] of each unrolled step; row p of step s predicts token p+2."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    e = layer.input_layernorm(embeds)
    t = embeds.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=embeds.device).tril()
    keys, values, outs, g = [], [], [], fused
    scale = attn.hd ** -0.5
    for s in range(steps):
        normed = layer.hidden_norm(g)
        q, k, v = attn.qkv(torch.cat([e, normed], dim=-1), cos, sin)
        keys.append(k)
        values.append(v)
        # step-0 keys at j <= p - s, then step j's key at p - s + j (j = 1..s), the diagonal ones
        main = (q @ keys[0].transpose(-1, -2)) * scale
        main = main.masked_fill(~shift(causal, s, 0), float("-inf"))
        diag = [((q * shift(keys[j], s - j, 2)).sum(-1, keepdim=True) * scale) for j in range(1, s + 1)]
        weights = torch.softmax(torch.cat([main, *diag], dim=-1), dim=-1)
        out = weights[..., :t] @ values[0]
        for j in range(1, s + 1):
            out = out + weights[..., t + j - 1 : t + j] * shift(values[j], s - j, 2)
        a = attn.o_proj(out.transpose(1, 2).reshape(*embeds.shape[:2], -1))
        hidden = a + g
        x = layer.mlp(layer.post_attention_layernorm(hidden)) + hidden
        outs.append(x)
        g = shift(x, 1, 1)  # the next step's row p reads this step's row p - 1
    return outs


@torch.no_grad()
def cache_batches(model, ids, mask, lengths, layers, batch_size: int, device: str):
    """Documents sorted by length, cut into batches: tokens, the aux states (bf16), the model's
    greedy tokens and which rows p have a trained target token p+2."""
    order = torch.argsort(lengths)
    batches = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        n = int(lengths[idx].max())
        x, m, lens = ids[idx, :n].to(device), mask[idx, :n].to(device), lengths[idx].to(device)
        out = model(input_ids=x, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in layers], dim=-1)  # [i]: the input of layer i
        greedy = out.logits.argmax(dim=-1)  # greedy[t]: the model's token t+1
        real = torch.arange(n, device=device)[None] < lens[:, None]
        trained = torch.zeros_like(m)
        trained[:, : n - 2] = m[:, 2:] & real[:, 2:]
        label = torch.cat([greedy[:, 1:], greedy[:, -1:]], dim=1)  # row p: the model's token p+2
        batches.append((x.cpu(), aux.to(torch.bfloat16).cpu(), label.cpu(), trained.cpu()))
    return batches


def losses(head, model, batch, t2d_index, steps: int, device: str):
    """Per step: (loss, hits, count)."""
    x, aux, label, trained = (t.to(device) for t in batch)
    b, n = x.shape
    positions = torch.arange(n, device=device)[None].expand(b, -1)
    nxt = torch.cat([x[:, 1:], x[:, -1:]], dim=1)  # token p+1 at row p
    embeds = model.model.embed_tokens(nxt)
    cos, sin = model.model.rotary_emb(embeds, position_ids=positions)
    outs = unroll(head, embeds, head.fc(aux.float()), cos, sin, steps)
    draft_label = t2d_index[label]  # -1: outside the draft vocabulary
    result = []
    for s, y in enumerate(outs):
        valid = trained.clone()
        valid[:, :s] = False
        logits = head.lm_head(head.norm(y))
        target = draft_label.masked_fill(~valid, -1)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1).clamp(min=0), reduction="none")
        keep = (target >= 0).reshape(-1).float()
        hits = ((logits.argmax(-1) == draft_label) & (draft_label >= 0) & valid).sum()
        result.append(((ce * keep).sum() / keep.sum().clamp(min=1), hits, valid.sum()))
    return result


def agreement(head, model, batches, t2d_index, steps, device) -> dict:
    head.eval()
    hits, counts = [0] * steps, [0] * steps
    with torch.no_grad():
        for b in batches:
            for s, (_, h, c) in enumerate(losses(head, model, b, t2d_index, steps, device)):
                hits[s], counts[s] = hits[s] + int(h), counts[s] + int(c)
    head.train()
    return {f"step{s + 1}_top1": round(h / max(c, 1), 4) for s, (h, c) in enumerate(zip(hits, counts))}


def warm_start(head: Head, model, used: torch.Tensor, layers) -> None:
    """The model's last block, final norm and head rows; fc reads the highest aux layer."""
    last = model.model.layers[-1]
    h = model.config.hidden_size
    with torch.no_grad():
        width = head.midlayer.mlp.gate_proj.weight.shape[0]  # the first `width` units of the block's MLP
        head.midlayer.mlp.gate_proj.weight.copy_(last.mlp.gate_proj.weight[:width])
        head.midlayer.mlp.up_proj.weight.copy_(last.mlp.up_proj.weight[:width])
        head.midlayer.mlp.down_proj.weight.copy_(last.mlp.down_proj.weight[:, :width])
        head.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        head.midlayer.hidden_norm.weight.copy_(last.input_layernorm.weight)
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(head.midlayer.self_attn, name).weight[:, h:].copy_(getattr(last.self_attn, name).weight)
        head.midlayer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        head.norm.weight.copy_(model.model.norm.weight)
        head.lm_head.weight.copy_(model.lm_head.weight[used])
        head.fc.weight.mul_(0.1)
        head.fc.weight[:, (len(layers) - 1) * h :] += torch.eye(h)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    device = args.device
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    model.requires_grad_(False)
    config = model.config
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    torch.set_num_threads(args.threads)
    docs = [d for d in read_jsonl(args.corpus / "train.jsonl") if d["kind"] in args.kinds]
    docs = docs[: args.max_docs + args.eval_docs]
    if args.self_distill:
        t0 = time.perf_counter()
        docs = self_distill(docs, args.model)
        print(f"replaced the replies of {len(docs)} documents by the model's greedy ones in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
    ids, mask, lengths = encode_documents(docs, tok, args.max_doc_tokens, tok.token_to_id(PAD))
    split = min(args.max_docs, len(ids) - args.eval_docs)
    t0 = time.perf_counter()
    train_batches = cache_batches(model, ids[:split], mask[:split], lengths[:split], args.layers, args.batch_size,
                                  device)
    eval_batches = cache_batches(model, ids[split:], mask[split:], lengths[split:], args.layers, args.batch_size,
                                 device)
    cache_s = time.perf_counter() - t0
    print(f"cached the model's hidden states of {split} + {len(ids) - split} documents in {cache_s:.1f}s", flush=True)

    # The draft vocabulary: the tokens the model predicts most often where a draft is scored.
    vocab = config.vocab_size
    counts = torch.zeros(vocab, dtype=torch.int64)
    for _, _, label, trained in train_batches:
        counts += torch.bincount(label[trained], minlength=vocab)
    used = counts.argsort(descending=True)[: args.draft_vocab].sort().values
    if args.init:  # keep the saved head's draft vocabulary
        from safetensors.torch import load_file

        saved = load_file(str(args.init / "model.safetensors"))
        used = saved["t2d"].nonzero().flatten()
    coverage = float(counts[used].sum() / counts.sum())
    t2d_index = torch.full((vocab,), -1, dtype=torch.int64)
    t2d_index[used] = torch.arange(len(used))
    print(f"draft vocabulary: {len(used)} of {vocab} tokens, covering {coverage:.2%} of the scored labels", flush=True)
    t2d_index = t2d_index.to(device)

    head_cfg = copy.deepcopy(config)
    head_cfg.intermediate_size = args.intermediate_size
    head = Head(head_cfg, len(args.layers), len(used)).to(device)
    if args.init:
        head.load_state_dict({k: v.float() for k, v in saved.items() if k not in ("d2t", "t2d")})
    else:
        warm_start(head, model, used.to(device), args.layers)
    print(f"head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters; before training: "
          f"{agreement(head, model, eval_batches, t2d_index, args.steps, device)}", flush=True)
    decay = [p for p in head.parameters() if p.dim() >= 2]
    no_decay = [p for p in head.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    total = max(1, int(args.epochs * len(train_batches)))
    gen = torch.Generator().manual_seed(args.seed)
    curve, window, step, start = [], [], 0, time.perf_counter()
    out_of_time = lambda: args.max_minutes > 0 and time.perf_counter() - start >= 60 * args.max_minutes  # noqa: E731
    while step < total and not out_of_time():
        for i in torch.randperm(len(train_batches), generator=gen).tolist():
            if step >= total or out_of_time():
                break
            lr = args.lr * min(1.0, (step + 1) / 30) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / total)))
            for group in opt.param_groups:
                group["lr"] = lr
            per_step = losses(head, model, train_batches[i], t2d_index, args.steps, device)
            loss = sum(0.8**s * l for s, (l, _, _) in enumerate(per_step))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            step += 1
            window.append([l.item() for l, _, _ in per_step])
            if step % 25 == 0 or step == total:
                mean = [round(sum(v) / len(window), 4) for v in zip(*window)]
                window = []
                curve.append({"step": step, "loss_per_step": mean, "lr": lr,
                              "elapsed_s": round(time.perf_counter() - start, 1)})
                print(f"step {step:5d}/{total}  loss per step {mean}  lr {lr:.2e}  "
                      f"{time.perf_counter() - start:6.1f}s", flush=True)
    train_s = time.perf_counter() - start
    scores = agreement(head, model, eval_batches, t2d_index, args.steps, device)
    print(f"trained {step} steps in {train_s:.1f}s; held-out agreement with the model's greedy tokens: {scores}")

    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", torch.bfloat16).contiguous() for name, t in head.state_dict().items()}
    tensors["d2t"] = (used - torch.arange(len(used))).contiguous()
    tensors["t2d"] = (t2d_index.cpu() >= 0).contiguous()
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((args.model / "config.json").read_text())
    head_config = {k: raw[k] for k in ("hidden_size", "num_attention_heads",
                                       "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                                       "max_position_embeddings", "rope_parameters", "vocab_size", "bos_token_id",
                                       "eos_token_id", "pad_token_id")}
    head_config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                       intermediate_size=args.intermediate_size,
                       draft_vocab_size=len(used), target_hidden_size=raw["hidden_size"], tie_word_embeddings=False,
                       norm_before_residual=False, eagle_aux_hidden_state_layer_ids=list(args.layers),
                       torch_dtype="bfloat16")
    (args.out / "config.json").write_text(json.dumps(head_config, indent=2, sort_keys=True) + "\n")
    metrics = {"args": {k: str(v) for k, v in vars(args).items()}, "cache_seconds": round(cache_s, 1),
               "train_seconds": round(train_s, 1), "steps": step, "curve": curve, "heldout_agreement": scores,
               "draft_vocab_coverage": round(coverage, 4),
               "num_parameters": sum(p.numel() for p in head.parameters())}
    (args.out / "eagle3_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")


if __name__ == "__main__":
    main()
