"""Drive a model built by `build_model` without the engine: a flat batch of every sequence,
prefill in chunks, then decode, greedy. Only the model-side seams are used (kv_spec functions
and the attention metadata), so model tests do not depend on engine internals."""
from __future__ import annotations

import torch

from atom_core.model_ops.forward_context import AttentionMetadata, set_attention_metadata
from atom_core.model_ops.kv_spec import (allocate_kv_cache, allocate_state_cache, attention_layers, release_kv_cache,
                                         release_state_cache, state_layers)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@torch.inference_mode()
def greedy_generate(model, prompts: list[list[int]], max_tokens: int, block_size: int = 16,
                    chunk: int | None = None) -> list[list[int]]:
    """Greedy continuations of every prompt, all sequences in each step's flat batch.

    `chunk` caps the new tokens one sequence feeds per step (chunked prefill); a sequence
    samples once all its known tokens are in the cache.
    """
    layers, stateful = attention_layers(model), state_layers(model)
    blocks_per_seq = -(-(max(map(len, prompts)) + max_tokens) // block_size)
    num_blocks = blocks_per_seq * len(prompts)
    allocate_kv_cache(layers, num_blocks, block_size, "cpu")
    allocate_state_cache(stateful, len(prompts), "cpu")  # sequence s in state row s + 1 (row 0: scratch)
    tables = torch.arange(num_blocks, dtype=torch.int32).view(len(prompts), blocks_per_seq)
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens already in the cache
    outputs: list[list[int]] = [[] for _ in prompts]
    try:
        while any(len(o) < max_tokens for o in outputs):
            ids, positions, slots, qsl, lens, sample_rows, sample_seqs = [], [], [], [0], [], [], []
            for s, seq in enumerate(tokens):
                if len(outputs[s]) >= max_tokens:
                    n = 0
                else:
                    n = len(seq) - done[s] if chunk is None else min(chunk, len(seq) - done[s])
                for pos in range(done[s], done[s] + n):
                    ids.append(seq[pos])
                    positions.append(pos)
                    slots.append(int(tables[s, pos // block_size]) * block_size + pos % block_size)
                done[s] += n
                qsl.append(len(ids))
                lens.append(done[s])
                if n and done[s] == len(seq):
                    sample_rows.append(len(ids) - 1)
                    sample_seqs.append(s)
            meta = AttentionMetadata(_i32(qsl), _i32(lens), tables, torch.tensor(slots, dtype=torch.int64),
                                     max(b - a for a, b in zip(qsl, qsl[1:])), max(lens),
                                     state_slots=_i32(range(1, len(tokens) + 1)))
            with set_attention_metadata(meta):
                hidden = model(torch.tensor(ids), torch.tensor(positions))
            if sample_rows:
                next_ids = model.compute_logits(hidden[sample_rows]).argmax(-1).tolist()
                for s, tok in zip(sample_seqs, next_ids):
                    outputs[s].append(tok)
                    tokens[s].append(tok)
    finally:
        release_kv_cache(layers)
        release_state_cache(stateful)
    return outputs


@torch.inference_mode()
def prompt_logits(model, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [len(prompt), vocab] of one prefill of `prompt`."""
    layers, stateful = attention_layers(model), state_layers(model)
    num_blocks = -(-len(prompt) // block_size)
    allocate_kv_cache(layers, num_blocks, block_size, "cpu")
    allocate_state_cache(stateful, 1, "cpu")
    try:
        n = len(prompt)
        meta = AttentionMetadata(_i32([0, n]), _i32([n]), torch.arange(num_blocks, dtype=torch.int32)[None],
                                 torch.arange(n, dtype=torch.int64), n, n, state_slots=_i32([1]))
        with set_attention_metadata(meta):
            hidden = model(torch.tensor(prompt), torch.arange(n))
        return model.compute_logits(hidden).float()
    finally:
        release_kv_cache(layers)
        release_state_cache(stateful)


def random_prompts(vocab: int, prompt_lens: list[int], shared_prefix: int = 0) -> list[list[int]]:
    """Seeded random prompts of the given lengths (ids from 3 up: no special tokens), each after
    one shared random prefix of `shared_prefix` tokens."""
    g = torch.Generator().manual_seed(1234)
    prefix = torch.randint(3, vocab, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lens]


def assert_same_tokens(outputs: list[dict], ref: list[list[int]], prompt_lens: list[int]) -> None:
    """Each engine output's token ids equal the reference's, naming the first prompt that diverged."""
    for i, (out, expected) in enumerate(zip(outputs, ref)):
        assert out["token_ids"] == expected, f"prompt {i} (len {prompt_lens[i]}) diverged"


def hf_greedy(hf_model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, with no EOS (exactly max_tokens each)."""
    from transformers import GenerationConfig

    hf_model.generation_config.eos_token_id = None
    hf_model.config.eos_token_id = None
    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    outs = []
    for p in prompts:
        ids = hf_model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                generation_config=cfg)
        outs.append(ids[0, len(p):].tolist())
        assert len(outs[-1]) == max_tokens
    return outs


def compiled_equals_eager(path) -> None:
    """Build the model at `path`, compile its decoder layers as the worker does (attention as the
    opaque op, fullgraph), and check greedy tokens against eager over prefill chunks and decode."""
    from transformers import AutoConfig

    from atom_core.loader import build_model
    from atom_core.model_ops.attention import Attention

    model = build_model(AutoConfig.from_pretrained(str(path)), path, torch.float32, "cpu")
    prompts = [[5], list(range(3, 40)), list(range(50, 60))]
    eager = greedy_generate(model, prompts, 6, chunk=16)
    for m in model.modules():
        if isinstance(m, Attention):
            m.use_custom_op = True
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, fullgraph=True)
    assert greedy_generate(model, prompts, 6, chunk=16) == eager
