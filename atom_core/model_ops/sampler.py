"""Token sampling on the logits' device, with no host synchronisation.

Randomness: on CUDA, temperature-only batches use the fused Gumbel-max kernel (see Sampler).
Otherwise unseeded rows draw exponential noise from the device RNG (exponential-race
sampling: argmax(p / E) with E ~ Exp(1) samples from p). When any row has a seed, every row's
noise comes instead from a counter-based hash of (seed, output index, token id), so a seeded
request samples the same tokens alone or in any batch, and after preemption.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atom_core.kernels import kernel_ops

_MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32) on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32  # low 32 bits stay exact even if the int64 product wraps
    return x ^ (x >> 16)


def hashed_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [B, V] that depends only on (seed, position, token id)."""
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    row = mix32(lo ^ mix32(hi ^ mix32(positions & _MASK32)))  # [B]
    cols = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    x = mix32(row[:, None] ^ ((cols * 0x9E3779B1) & _MASK32)[None, :])
    x = mix32(x ^ 0x5BD1E995)
    return -torch.log(unit_interval(x))


def unit_interval(x: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms strictly inside (0, 1): 23 bits + 1/2 are exact in fp32
    (24 bits rounded the top value to 1.0, so E = 0 and p / E let zero-probability tokens win)."""
    return ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


@dataclass
class SamplingBatch:
    """Per-row sampling tensors [B] on the device, plus host-side flags that pick code paths."""

    temperatures: torch.Tensor  # float32; 0 = greedy
    top_ks: torch.Tensor | None  # int64; vocab size = off
    top_ps: torch.Tensor | None  # float32
    min_ps: torch.Tensor | None  # float32
    seeds: torch.Tensor | None  # int64; set when any row is seeded (others get random seeds)
    positions: torch.Tensor | None  # int64 output index of the token being sampled
    all_greedy: bool
    any_greedy: bool
    repetition_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None  # [B, V] bool
    output_counts: torch.Tensor | None = None  # [B, V] float32
    banned_mask: torch.Tensor | None = None  # [B, V] bool: EOS/stop ids before min_tokens, ids not allowed
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # ([2, N] int64 (row, token), [N] float32 bias)
    grammar_bitmask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32 allowed tokens (structured outputs)
    max_num_logprobs: int = -1  # -1: none requested


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] logprob of the chosen token (raw model distribution)
    top_logprobs: torch.Tensor | None = None  # [B, k]
    top_token_ids: torch.Tensor | None = None  # [B, k]


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """logits [B, V] (float32, a copy) plus the requests' sparse logit_bias: values[i] at (row, token) index[:, i]."""
    index, values = bias
    return logits.float().index_put((index[0], index[1]), values, accumulate=True)


def adjusted_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """What both samplers pick from (Sampler, and the RejectionSampler's rows): logits with the penalties,
    logit_bias, the banned ids (min_tokens, allowed_token_ids) and a grammar's mask applied. Each step
    upcasts to float32 where it needs to; with none of them the logits come back as they are."""
    if batch.repetition_penalties is not None or batch.frequency_penalties is not None \
            or batch.presence_penalties is not None:
        logits = apply_penalties(logits.float(), batch)
    if batch.logit_bias is not None:
        logits = apply_logit_bias(logits, batch.logit_bias)
    if batch.banned_mask is not None:
        logits = logits.masked_fill(batch.banned_mask, float("-inf"))
    if batch.grammar_bitmask is not None:
        logits = apply_token_bitmask(logits, batch.grammar_bitmask)
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.repetition_penalties is not None:
        seen = batch.prompt_mask | (batch.output_counts > 0)
        p = batch.repetition_penalties[:, None]
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalised, logits)
    if batch.frequency_penalties is not None:
        logits = logits - batch.frequency_penalties[:, None] * batch.output_counts
    if batch.presence_penalties is not None:
        logits = logits - batch.presence_penalties[:, None] * (batch.output_counts > 0)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf for every token a row's bitmask [B, ceil(V / 32)] int32 does not allow (bit j of word
    w allows token 32 w + j; a row of all ones allows every token). Elementwise on the device, by
    bytes (little-endian: byte k of word w holds tokens 32 w + 8 k ...), so the unpacked
    temporary is one byte per logit, not four."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1  # [B, 4 W, 8]
    allowed = bits.view(bitmask.shape[0], -1)[:, : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) sets with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_ks is not None:
        kth = sorted_logits.gather(1, (vocab - top_ks.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_ps is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_ps).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution a row is sampled from [R, V]: temperature (greedy rows get 1; their
    probabilities are not used), top-k/top-p, then the min-p floor. The rejection sampler
    verifies drafts against the same distribution."""
    temps = torch.where(batch.temperatures > 0, batch.temperatures, torch.ones_like(batch.temperatures))
    logits = logits / temps.unsqueeze(1)
    if batch.top_ks is not None or batch.top_ps is not None:
        logits = apply_top_k_top_p(logits, batch.top_ks, batch.top_ps)
    probs = logits.softmax(dim=-1)
    if batch.min_ps is not None:
        floor = batch.min_ps.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


class Sampler(nn.Module):
    """logits [B, V] (float32, or the model's dtype) + SamplingBatch -> SamplerOutput.

    Two ways to sample. On CUDA, batches whose rows need only a temperature (no top-k/top-p/
    min-p, no seeded rows) go through the fused Triton Gumbel-max kernel, which reads the logits
    once and takes greedy rows as temperature 0. Everything else takes the torch path (`_sample`).

    Noise of the fused path: Philox keyed by `philox_seed`, drawn at construction from a CPU
    generator seeded with torch.initial_seed() (so torch.manual_seed(config.seed) fixes it, and
    the default generator's stream is left alone), and offset by `philox_offset`, a host-side
    count of fused calls: each call gets fresh noise with no device RNG state and no host sync.
    The kernel gives every (offset, row, column) its own Philox counter, so one offset per call
    is enough.
    """

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(torch.initial_seed())
        self.philox_seed = int(torch.randint(0, 2**62, (), generator=gen))  # a CPU tensor: no device sync
        self.philox_offset = 0

    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # Upcasts happen where float32 matters, so model-dtype logits need no full-size copy on
        # the fused path; the results equal those of upcasting first.
        out = SamplerOutput(token_ids=torch.empty(0))
        if batch.max_num_logprobs >= 0:
            raw = logits.log_softmax(dim=-1, dtype=torch.float32)
        logits = adjusted_logits(logits, batch)
        if batch.all_greedy:
            out.token_ids = logits.argmax(dim=-1)
        elif self._can_fuse(logits, batch):
            out.token_ids = self._sample_fused(logits, batch)
        else:
            out.token_ids = self._sample(logits.float(), batch)
        if batch.max_num_logprobs >= 0:
            out.logprobs = raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
            if batch.max_num_logprobs > 0:
                out.top_logprobs, out.top_token_ids = raw.topk(batch.max_num_logprobs, dim=-1)
        return out

    @staticmethod
    def _can_fuse(logits: torch.Tensor, batch: SamplingBatch) -> bool:
        truncated = batch.top_ks is not None or batch.top_ps is not None or batch.min_ps is not None
        return logits.is_cuda and batch.seeds is None and not truncated

    def _sample_fused(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        self.philox_offset += 1
        ops = kernel_ops(logits.device)
        return ops.gumbel_argmax(logits, batch.temperatures, self.philox_seed, self.philox_offset)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.any_greedy:
            greedy = logits.argmax(dim=-1)
        probs = sampling_probs(logits, batch)
        if batch.seeds is not None:
            noise = hashed_exponential(batch.seeds, batch.positions, probs.shape[-1])
        else:
            noise = torch.empty_like(probs).exponential_()
        sampled = (probs / noise).argmax(dim=-1)
        if batch.any_greedy:
            sampled = torch.where(batch.temperatures > 0, sampled, greedy)
        return sampled
