"""Train the demo model: a small Llama on the synthetic corpus, then score the held-out split.

Plain PyTorch: AdamW, linear warm-up then cosine decay, bf16 autocast on CUDA, loss on the
assistant's replies of chat documents and on every token of plain-text documents. Each document
is one sequence starting at position 0 (no packing), padded on the right, so training sees
prompts exactly where inference does. The run ends after --steps, or earlier if --max-minutes
runs out: the cosine schedule follows whichever of the two is further along, so a cut-short run
still anneals its learning rate.

Writes an HF model directory (bf16 safetensors, config, generation_config, tokenizer) to --out
and metrics.json (loss curve, accuracy) beside the weights, then reloads the directory with
transformers and prints the held-out exact-match accuracy of greedy `generate`.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from chat_format import ENDOFTEXT, IM_END, PAD, document_segments, render_chat

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, required=True, help="directory with train.jsonl and heldout.jsonl")
    p.add_argument("--tokenizer", type=Path, required=True, help="directory with tokenizer.json")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=7000)
    p.add_argument("--max-minutes", type=float, default=0.0,
                   help="wall-clock cap on the training loop (0: none); a capped run's schedule "
                        "depends on the hardware")
    p.add_argument("--batch-size", type=int, default=None, help="documents per step (default 256; 4 on cpu)")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-doc-tokens", type=int, default=192)
    p.add_argument("--log-every", type=int, default=250)
    p.add_argument("--eval-every", type=int, default=2000)
    p.add_argument("--eval-limit", type=int, default=None,
                   help="held-out questions in the final eval (0: all; default 20 on cpu)")
    p.add_argument("--max-docs", type=int, default=None,
                   help="use only the first N documents (0: all; default 2000 on cpu)")
    # architecture
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    args = p.parse_args()
    # On the CPU the script is a smoke test of the pipeline: small batches, a slice of the data.
    on_cpu = args.device == "cpu"
    if args.batch_size is None:
        args.batch_size = 4 if on_cpu else 256
    if args.eval_limit is None:
        args.eval_limit = 20 if on_cpu else 0
    if args.max_docs is None:
        args.max_docs = 2000 if on_cpu else 0
    return args


def read_jsonl(path: Path, limit: int = 0) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            rows.append(json.loads(line))
            if limit and len(rows) == limit:
                break
    return rows


# ---------------------------------------------------------------- data

def encode_documents(docs: list[dict], tok: Tokenizer, max_tokens: int, pad_id: int):
    """Token ids and loss masks of every document, right-padded into two [num_docs, max_tokens] tensors.

    loss_mask[i, t] is True where token t of document i is a training target.
    """
    segments = [document_segments(d) for d in docs]
    flat = [text for segs in segments for text, _ in segs]
    encoded = iter(tok.encode_batch(flat, add_special_tokens=False))
    rows = []
    for segs in segments:
        ids, mask = [], []
        for _, trained in segs:
            seg_ids = next(encoded).ids
            ids += seg_ids
            mask += [trained] * len(seg_ids)
        if len(ids) <= max_tokens:
            rows.append((ids, mask))
    ids_t = torch.full((len(rows), max_tokens), pad_id, dtype=torch.int64)
    mask_t = torch.zeros((len(rows), max_tokens), dtype=torch.bool)
    lengths = torch.zeros(len(rows), dtype=torch.int64)
    for i, (ids, mask) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        mask_t[i, : len(mask)] = torch.tensor(mask)
        lengths[i] = len(ids)
    print(f"encoded {len(rows)} of {len(docs)} documents (dropped {len(docs) - len(rows)} over {max_tokens} tokens); "
          f"{int(lengths.sum())} tokens, {int(mask_t.sum())} trained, mean length {lengths.float().mean():.1f}")
    return ids_t, mask_t, lengths


def check_segment_encoding(docs: list[dict], tok: Tokenizer) -> None:
    """Encoding a document piece by piece must equal encoding it whole (loss masks rely on it)."""
    for doc in docs:
        segs = document_segments(doc)
        pieces = [i for text, _ in segs for i in tok.encode(text, add_special_tokens=False).ids]
        whole = tok.encode("".join(t for t, _ in segs), add_special_tokens=False).ids
        assert pieces == whole, f"segment encoding differs for {doc}"


# ---------------------------------------------------------------- model and schedule

def make_model(args: argparse.Namespace, vocab_size: int, tok: Tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.token_to_id(IM_END),
        pad_token_id=tok.token_to_id(PAD),
    )
    return LlamaForCausalLM(config)


def lr_factor(step: int, progress: float, warmup_steps: int, min_ratio: float) -> float:
    warm = min(1.0, (step + 1) / warmup_steps)
    return warm * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# ---------------------------------------------------------------- evaluation

def chat_prompt(question: str) -> str:
    return render_chat([{"role": "user", "content": question}], add_generation_prompt=True)


@torch.no_grad()
def exact_match(model, hf_tok, items: list[dict], device: str, batch_size: int = 256) -> dict:
    """Greedy `generate` on each question's chat prompt; accuracy overall and per kind.

    Prompts are batched by token length, so no batch needs padding.
    """
    model.eval()
    eos_ids = [hf_tok.convert_tokens_to_ids(IM_END), hf_tok.convert_tokens_to_ids(ENDOFTEXT)]
    by_length = defaultdict(list)
    for item in items:
        by_length[len(hf_tok.encode(chat_prompt(item["question"])))].append(item)
    correct, total = defaultdict(int), defaultdict(int)
    failures = []
    for group in by_length.values():
        for start in range(0, len(group), batch_size):
            batch = group[start : start + batch_size]
            enc = hf_tok([chat_prompt(it["question"]) for it in batch], return_tensors="pt").to(device)
            out = model.generate(**enc, max_new_tokens=8, do_sample=False, eos_token_id=eos_ids,
                                 pad_token_id=hf_tok.pad_token_id)
            replies = hf_tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            for it, reply in zip(batch, replies):
                ok = reply.strip() == it["answer"]
                correct[it["kind"]] += ok
                total[it["kind"]] += 1
                if not ok and len(failures) < 10:
                    failures.append((it["question"], it["answer"], reply))
    model.train()
    result = {kind: correct[kind] / total[kind] for kind in sorted(total)}
    result["all"] = sum(correct.values()) / sum(total.values())
    result["num_questions"] = sum(total.values())
    result["failures"] = failures
    return result


def format_accuracy(acc: dict) -> str:
    kinds = " ".join(f"{k} {v:.3f}" for k, v in acc.items() if k not in ("all", "num_questions", "failures"))
    return f"exact match {acc['all']:.4f} on {acc['num_questions']} ({kinds})"


# ---------------------------------------------------------------- training

def train(args, model, ids, loss_mask, lengths, hf_tok, heldout) -> list[dict]:
    device = args.device
    use_cuda = device.startswith("cuda")
    model.to(device).train()
    ids, loss_mask, lengths = ids.to(device), loss_mask.to(device), lengths.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=use_cuda)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    order, cursor = torch.randperm(len(ids), generator=gen), 0
    probe = heldout[::5][:200]
    curve, window, start = [], [], time.perf_counter()
    budget_s = args.max_minutes * 60 if args.max_minutes > 0 else math.inf
    step = 0
    for step in range(args.steps):
        elapsed = time.perf_counter() - start
        progress = max(step / args.steps, elapsed / budget_s)
        if progress >= 1.0:
            print(f"stopping at step {step}: the {args.max_minutes} minute budget is spent")
            break
        for group in opt.param_groups:
            group["lr"] = args.lr * lr_factor(step, progress, args.warmup_steps, args.min_lr_ratio)
        if cursor + args.batch_size > len(order):
            order, cursor = torch.randperm(len(ids), generator=gen), 0
        idx = order[cursor : cursor + args.batch_size].to(device)
        cursor += args.batch_size
        seq_len = int(lengths[idx].max())
        x, m = ids[idx, :seq_len], loss_mask[idx, :seq_len]
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=use_cuda):
            logits = model(input_ids=x).logits
        ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                             reduction="none")
        target_mask = m[:, 1:].reshape(-1).float()
        loss = (ce * target_mask).sum() / target_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(loss.detach())
        if (step + 1) % args.log_every == 0 or step == 0:
            mean_loss = torch.stack(window).mean().item()
            window = []
            elapsed = time.perf_counter() - start
            curve.append({"step": step + 1, "loss": round(mean_loss, 4), "lr": opt.param_groups[0]["lr"],
                          "elapsed_s": round(elapsed, 1)})
            print(f"step {step + 1:6d}  loss {mean_loss:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{elapsed:6.1f}s  {elapsed / (step + 1) * 1000:.1f} ms/step", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            acc = exact_match(model, hf_tok, probe, device)
            curve[-1]["probe_exact_match"] = round(acc["all"], 4)
            print(f"  probe {format_accuracy(acc)}", flush=True)
    total_s = time.perf_counter() - start
    print(f"trained {step + 1} steps in {total_s:.1f}s")
    curve.append({"step": step + 1, "train_seconds": round(total_s, 1)})
    return curve


def save(model, args, tok: Tokenizer) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu", dtype=torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = "bfloat16"  # the key older readers look for; transformers 5 writes "dtype"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        eos_token_id=[tok.token_to_id(IM_END), tok.token_to_id(ENDOFTEXT)],
        pad_token_id=tok.token_to_id(PAD),
        bos_token_id=None,
    ).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(args.tokenizer / name, out / name)


def main() -> None:
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    hf_tok = AutoTokenizer.from_pretrained(args.tokenizer)
    docs = read_jsonl(args.corpus / "train.jsonl", args.max_docs)
    heldout = read_jsonl(args.corpus / "heldout.jsonl")
    check_segment_encoding(docs[:500], tok)
    ids, loss_mask, lengths = encode_documents(docs, tok, args.max_doc_tokens, tok.token_to_id(PAD))
    vocab_size = 64 * math.ceil(tok.get_vocab_size() / 64)
    model = make_model(args, vocab_size, tok)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters, vocab {vocab_size}, {model.config.num_hidden_layers} layers, "
          f"hidden {model.config.hidden_size}, "
          f"heads {model.config.num_attention_heads}/{model.config.num_key_value_heads}")
    curve = train(args, model, ids, loss_mask, lengths, hf_tok, heldout)
    save(model, args, tok)

    items = heldout[: args.eval_limit] if args.eval_limit else heldout
    metrics = {"num_parameters": num_params, "args": {k: str(v) for k, v in vars(args).items()}, "curve": curve}
    for dtype in (torch.bfloat16, torch.float32):
        reloaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=dtype).to(args.device)
        t0 = time.perf_counter()
        acc = exact_match(reloaded, AutoTokenizer.from_pretrained(args.out), items, args.device)
        print(f"held-out ({dtype}, reloaded from {args.out}): {format_accuracy(acc)} [{time.perf_counter() - t0:.1f}s]")
        for q, want, got in acc["failures"]:
            print(f"  wrong: {q!r} want {want!r} got {got!r}")
        metrics[f"heldout_{str(dtype).removeprefix('torch.')}"] = acc
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")


if __name__ == "__main__":
    main()
