"""ModelRunner: owns the model, the KV cache tensors and the sampler; runs one step.

`execute(batch)` builds the flat batch, runs the forward (eager, compiled, or a CUDA graph
replay for decode-only batches), computes logits only for rows that need them, samples, and
returns plain Python results. The only host-device synchronisation is fetching the sampled
token ids (plus logprobs when a request asked for them).
"""
from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field

import torch

from atom_core.config import EngineConfig
from atom_core.engine.batch_builder import FlatBatch, build_flat_batch, build_sampling_batch
from atom_core.engine.scheduler import ScheduledBatch
from atom_core.kernels import kernel_ops
from atom_core.loader import ModelFiles, init_dummy_weights, load_weights
from atom_core.model_ops.attention import Attention
from atom_core.model_ops.forward_context import set_attention_metadata
from atom_core.model_ops.sampler import Sampler
from atom_core.models.registry import resolve_model_class

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampled: list  # per batch entry: the token, None (prefill chunks that do not sample), or a window's tokens
    logprobs: dict[int, tuple[float, dict[int, float]]] = field(default_factory=dict)  # batch idx -> ...
    prompt_logprobs: dict[int, list] = field(default_factory=dict)  # batch idx -> new entries


@dataclass
class PendingStep:
    """A launched step whose samples may still be on the device."""

    batch: ScheduledBatch
    flat: FlatBatch
    sampled: torch.Tensor | None = None  # [R] on the device
    sampled_host: torch.Tensor | None = None  # pinned host copy, valid after `event`
    sampler_out: object = None
    event: object = None
    row_of: dict = field(default_factory=dict)  # request id -> row of `sampled`
    prompt_logprobs: dict = field(default_factory=dict)


def _to_host_async(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    from atom_core.models.common import head_dim_of

    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * kv_heads * head_dim_of(hf_config)
    return per_token * block_size * torch.finfo(dtype).bits // 8


class ModelRunner:
    """Contract: single-threaded; `execute` never mutates sequences (the scheduler does)."""

    def __init__(self, config: EngineConfig, files: ModelFiles, max_model_len: int, profiler=None):
        self.config = config
        self.files = files
        self.device = config.torch_device
        self.hf_config = files.hf_config
        self.dtype = config.resolve_dtype(_config_dtype(self.hf_config))
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.vocab_size = self.hf_config.vocab_size
        self.rng = random.Random(config.seed)
        torch.manual_seed(config.seed)
        if self.device.type == "cuda":
            from atom_core.kernels.triton.common import pin_triton_cache_dir

            pin_triton_cache_dir(self.device.index or 0)
        start = time.perf_counter()
        self.model = self._load_model()
        self.load_seconds = time.perf_counter() - start
        if config.mark_trace:  # before graph capture, so capture traces carry module ranges
            from atom_core.profiling.profiler import mark_modules

            mark_modules(self.model)
        self.sampler = Sampler()
        self.profiler = profiler
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.graphs = None
        self.compiled = False  # set by compile_model
        self.compile_seconds = 0.0
        if config.use_compile:
            from atom_core.engine.compile import compile_model

            start = time.perf_counter()
            compile_model(self)
            self.compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        self.num_kv_blocks = self._num_kv_blocks()  # on a GPU: a max-size dummy step (compiles, if compiling)
        self.allocate_kv_cache(self.num_kv_blocks)
        self.sizing_seconds = time.perf_counter() - start
        self.warm_up_seconds = self._warm_up_kernels()
        if config.use_cuda_graphs:
            from atom_core.engine.cuda_graph import CUDAGraphRunner

            self.graphs = CUDAGraphRunner(self, config.sorted_capture_sizes)
            self.graphs.capture_all()

    @property
    def startup_breakdown(self) -> dict[str, float]:
        """Seconds per startup phase (what `start to ready` is made of)."""
        return {
            "load": self.load_seconds,
            "compile_setup": self.compile_seconds,  # importing Dynamo/Inductor; compiling is lazy
            "kv_sizing": self.sizing_seconds,
            "kernel_warm_up": self.warm_up_seconds,
            "graph_capture": self.graphs.capture_seconds if self.graphs is not None else 0.0,
        }

    # ---- setup ----------------------------------------------------------------------
    def _load_model(self) -> torch.nn.Module:
        model_cls = resolve_model_class(self.hf_config)
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_cls(self.hf_config)
        finally:
            torch.set_default_dtype(old_dtype)
        if self.config.load_format == "dummy":
            init_dummy_weights(model, self.config.seed)
        else:
            load_weights(model, self.files.path)
        return model.eval()

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = kv_bytes_per_block(self.hf_config, self.block_size, self.dtype)
        if self.device.type == "cuda":
            from atom_core.engine.memory import profile_kv_budget

            budget = profile_kv_budget(self)
        else:
            budget = int(self.config.kv_cache_memory_gb * (1 << 30))
        # More blocks than max_num_seqs full-length sequences can use only serve the prefix cache.
        useful = self.config.max_num_seqs * ((self.max_model_len + self.block_size - 1) // self.block_size)
        num = min(budget // per_block, useful)
        needed = (self.max_model_len + self.block_size - 1) // self.block_size
        if num < needed:
            raise ValueError(
                f"KV cache too small: {num} blocks of {self.block_size} tokens cannot hold one "
                f"{self.max_model_len}-token sequence; raise the memory budget or lower max_model_len"
            )
        logger.info("KV cache: %d blocks x %d tokens = %d tokens", num, self.block_size, num * self.block_size)
        return num

    def _warm_up_kernels(self) -> float:
        """Compile every attention kernel variant now, not inside the first steps that need one
        (a cold Triton cache otherwise costs seconds in the middle of a run)."""
        if self.device.type != "cuda":
            return 0.0
        from atom_core.kernels.triton.attention import warm_up_variants

        start = time.perf_counter()
        layer = self.attention_layers[0]
        longest = min(self.config.max_num_batched_tokens, self.max_model_len)
        # Threads: compiles overlap (8 threads took 2.5 s where one took 11.8 s, cold, on the H100 host).
        threads = min(8, os.cpu_count() or 1)
        count = warm_up_variants(layer.k_cache, layer.v_cache, layer.num_heads, self.dtype, longest, threads=threads)
        logits = torch.zeros(2, self.vocab_size, dtype=self.dtype, device=self.device)
        kernel_ops(self.device).gumbel_argmax(logits, torch.ones(2, device=self.device), 0, 0)  # the sampler's
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        logger.info("warmed up %d attention kernel variants and the sampler in %.1f s", count, seconds)
        return seconds

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One tensor [2, layers, blocks, block_size, kv_heads, head_dim]; layers get views."""
        layer = self.attention_layers[0]
        shape = (2, len(self.attention_layers), num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def release_kv_cache(self) -> None:
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.kv_cache = None

    # ---- one step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Launch and wait: the synchronous step."""
        return self.resolve(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: "PendingStep | None" = None) -> "PendingStep":
        """Enqueue the step on the device and return without waiting for it.

        Input tokens that are still PLACEHOLDERs are gathered on the device from `previous`,
        the step launched just before, whose samples have not reached the host yet.
        """
        flat = build_flat_batch(batch, self.block_size, self.device)
        if flat.placeholder_rows:
            self._fill_placeholders(flat, batch, previous)
        if batch.step_counts is not None:
            return self._launch_window(batch, flat)
        hidden = self._forward(flat, batch)
        pending = PendingStep(batch, flat)
        if not flat.sample_seq_idx and not flat.prompt_logprob_spans:
            return pending
        rows = hidden if flat.logits_all_rows else hidden[flat.logit_rows]
        logits = self.model.compute_logits(rows)  # model dtype: the sampler upcasts where it matters
        if flat.sample_seq_idx:
            sb = self._sampling_batch(batch, flat)
            # Without prompt logprobs the logit rows are exactly the sampling rows, in order;
            # skipping the list index avoids a host-to-device copy that would sync the stream.
            sample_logits = logits if not flat.prompt_logprob_spans else logits[flat.sample_rows]
            out = self.sampler(sample_logits, sb)
            pending.sampled = out.token_ids
            pending.sampler_out = out
            pending.row_of = {batch.seqs[i].request_id: r for r, i in enumerate(flat.sample_seq_idx)}
            pending.sampled_host = _to_host_async(out.token_ids)
            if self.device.type == "cuda":
                pending.event = torch.cuda.Event()
                pending.event.record()
        for i, row, first, count in flat.prompt_logprob_spans:  # rare (echo + logprobs): synchronous
            k = batch.seqs[i].sampling_params.prompt_logprobs
            targets = torch.tensor(batch.seqs[i].token_ids[first : first + count], device=self.device)
            pending.prompt_logprobs[i] = _token_logprobs(logits[row : row + count], targets, k)
        return pending

    def _launch_window(self, batch: ScheduledBatch, flat: FlatBatch) -> "PendingStep":
        """A multi-step decode window: batch.num_steps forwards, each fed the previous step's
        samples on the device. Rows past their step count keep their last position and store
        no KV; the host drops their samples."""
        sb = self._sampling_batch(batch, flat)
        num_steps = batch.num_steps
        attn = flat.attn
        first = flat.positions
        counts = torch.tensor(batch.step_counts, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        last = first + counts.to(self.device, non_blocking=True) - 1
        samples = []
        for step in range(num_steps):
            if step:
                wanted = first + step
                positions = torch.minimum(wanted, last)
                block = attn.block_tables.gather(1, (positions // self.block_size).unsqueeze(1)).squeeze(1)
                slots = block.to(torch.int64) * self.block_size + positions % self.block_size
                flat.input_ids = samples[-1]
                flat.positions = positions
                attn.slot_mapping = torch.where(wanted <= last, slots, -1)
                attn.seq_lens = (positions + 1).to(torch.int32)
                attn.max_seq_len += 1
                if sb.positions is not None:
                    sb.positions = sb.positions + 1
            hidden = self._forward(flat, batch, inputs_only=step > 0)
            logits = self.model.compute_logits(hidden)
            samples.append(self.sampler(logits, sb).token_ids)
        pending = PendingStep(batch, flat)
        # [rows, steps]: each row's tokens contiguous for the host; placeholders read the last kept one.
        pending.sampled = torch.stack(samples, dim=1)
        pending.row_of = {seq.request_id: r * num_steps + count - 1
                          for r, (seq, count) in enumerate(zip(batch.seqs, batch.step_counts))}
        pending.sampled_host = _to_host_async(pending.sampled)
        if self.device.type == "cuda":
            pending.event = torch.cuda.Event()
            pending.event.record()
        return pending

    def _sampling_batch(self, batch: ScheduledBatch, flat: FlatBatch):
        return build_sampling_batch(batch, flat.sample_seq_idx, self.vocab_size, self.files.eos_token_ids,
                                    self.device, self.rng)

    def _fill_placeholders(self, flat: FlatBatch, batch: ScheduledBatch, previous: "PendingStep | None") -> None:
        assert previous is not None and previous.sampled is not None, "placeholder input without a previous step"
        rows = [previous.row_of[batch.seqs[i].request_id] for i in flat.placeholder_seqs]
        # One transfer for both index lists: [0] rows of the previous samples, [1] flat rows to fill.
        index = torch.tensor([rows, flat.placeholder_rows], dtype=torch.int64,
                             pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
        flat.input_ids.index_copy_(0, index[1], previous.sampled.view(-1).index_select(0, index[0]))

    def resolve(self, pending: "PendingStep") -> StepResult:
        """Wait for the step's samples (the step's one host-device sync) and return them."""
        batch, flat = pending.batch, pending.flat
        result = StepResult(sampled=[None] * len(batch), prompt_logprobs=pending.prompt_logprobs)
        if pending.sampled is None:
            return result
        if pending.event is not None:
            pending.event.synchronize()
        if batch.step_counts is not None:
            for i, (tokens, count) in enumerate(zip(pending.sampled_host.tolist(), batch.step_counts)):
                result.sampled[i] = tokens[:count]
            return result
        for i, tok in zip(flat.sample_seq_idx, pending.sampled_host.tolist()):
            result.sampled[i] = tok
        if pending.sampler_out.logprobs is not None:
            self._collect_logprobs(result, batch, flat, pending.sampler_out)
        return result

    def graph_batch_size(self, batch: ScheduledBatch) -> int | None:
        """The captured size a decode batch would replay with, or None when it runs eagerly."""
        if self.graphs is None or not batch.is_decode_only or not self.graphs.can_run(len(batch)):
            return None
        return self.graphs.padded_size(len(batch))

    def _forward(self, flat: FlatBatch, batch: ScheduledBatch, inputs_only: bool = False) -> torch.Tensor:
        """inputs_only: the block tables are those of the last replay (later steps of a window)."""
        if self.graphs is not None and batch.is_decode_only and self.graphs.can_run(len(batch)):
            return self.graphs.replay(flat, inputs_only)
        with set_attention_metadata(flat.attn):
            return self.model(flat.input_ids, flat.positions)

    def _collect_logprobs(self, result: StepResult, batch: ScheduledBatch, flat: FlatBatch, out) -> None:
        chosen = out.logprobs.tolist()
        tops = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
        for r, i in enumerate(flat.sample_seq_idx):
            k = batch.seqs[i].sampling_params.logprobs
            if k is None:
                continue
            top = dict(zip(top_ids[r][:k], tops[r][:k])) if tops is not None and k > 0 else {}
            result.logprobs[i] = (chosen[r], top)


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list:
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if k <= 0:
        return [(c, {}) for c in chosen]
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    return [(c, dict(zip(ids, vals))) for c, ids, vals in zip(chosen, top_ids.tolist(), top_vals.tolist())]


def _config_dtype(hf_config) -> torch.dtype | None:
    dtype = getattr(hf_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None
