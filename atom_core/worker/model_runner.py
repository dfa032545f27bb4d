"""ModelRunner: owns the model, the KV cache tensors and the sampler; runs one step.

`launch(out)` updates the worker's request states from the SchedulerOutput, builds the flat
batch, runs the forward (eager or compiled, or a CUDA graph replay: worker/graph_dispatch.py
chooses), computes logits only for rows that need them, samples, and returns without waiting;
`resolve` waits for the samples (the step's one host-device sync, plus logprobs when a request
asked for them) and returns a ModelRunnerOutput. A multi-step decode window is a second
producer of several tokens per request (`_launch_window`).
"""
from __future__ import annotations

import gc
import logging
import os
import random
import time
from dataclasses import dataclass, field

import torch

from atom_core.config import EngineConfig, ResolvedModel, kv_cache_format
from atom_core.kernel_config import building
from atom_core.kernels import kernel_ops
from atom_core.loader import build_model
from atom_core.model_ops.kv_spec import (allocate_kv_cache, allocate_state_cache, attention_layers,
                                         check_attention_supported, finalize_kv_scales, keep_verified_states,
                                         release_kv_cache, set_index_cache_dtype, set_kv_cache_dtype,
                                         state_bytes_per_slot, state_layers, warm_up_attention)
from atom_core.model_ops.sampler import Sampler
from atom_core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from atom_core.spec_decode.factory import build_proposer, check_proposer
from atom_core.spec_decode.proposer import NoProposer
from atom_core.spec_decode.rejection_sampler import RejectionSampler, emitted_tokens
from atom_core.worker.batch_builder import FlatBatch, build_flat_batch, build_sampling_batch
from atom_core.worker.encoder_runner import EncoderRunner
from atom_core.worker.graph_dispatch import GraphDispatcher, graph_sets
from atom_core.worker.input_batch import InputBatch, RequestState
from atom_core.worker.logprobs import emitted_logprobs, sampled_logprobs, token_logprobs
from atom_core.worker.lora_slots import build_lora_slots
from atom_core.worker.memory import check_weights_fit, dummy_step, model_weight_bytes, num_kv_blocks
from atom_core.worker.verify_batch import build_padded_verify_batch, target_hidden, verify_rows

logger = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A launched step whose samples may still be on the device."""

    out: SchedulerOutput
    states: list[RequestState]
    flat: FlatBatch
    sampled: torch.Tensor | None = None  # [R] (or [R, steps] for a window) on the device
    sampled_host: torch.Tensor | None = None  # pinned host copy, valid after `event`
    sampler_out: object = None
    event: object = None
    row_of: dict = field(default_factory=dict)  # request id -> flat index of its last sample
    prompt_logprobs: dict = field(default_factory=dict)
    verify: object = None  # verify_batch.VerifyRows of a step that verifies drafts
    verify_logits: torch.Tensor | None = None  # its logit rows, kept when a request wants logprobs
    hidden: torch.Tensor | None = None  # the forward's hidden states, for a proposer that drafts from them


def _to_host_async(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


class ModelRunner:
    """Contract: single-threaded; owns the worker's request states (updated from each
    SchedulerOutput) and never sees the scheduler's objects."""

    def __init__(self, config: EngineConfig, model: ResolvedModel, profiler=None):
        self.config = config
        self.model_info = model
        self.profiler = profiler
        self.device = model.device
        self.dtype = model.dtype
        self.max_model_len = model.max_model_len
        self.block_size = config.cache.block_size
        self.vocab_size = model.vocab_size
        self.eos_token_ids = model.eos_token_ids
        self.rng = random.Random(model.seed)
        torch.manual_seed(model.seed)
        self._check_before_loading()
        self._load_model()
        self._choose_kv_format()
        self._build_step_parts()
        self._compile()
        self._size_and_allocate_kv()
        self._warm_up_kernels()
        self._capture_graphs()

    # ---- setup, in the order __init__ runs it -------------------------------------------
    def _check_before_loading(self) -> None:
        """Refuse a model that cannot fit, or a proposer that cannot work, before loading any weights."""
        config, model = self.config, self.model_info
        if self.device.type == "cuda":
            from atom_core.kernels.triton.common import pin_triton_cache_dir

            pin_triton_cache_dir(self.device.index or 0)
            check_weights_fit(model_weight_bytes(model.hf_config, model.dtype, model.quant_config),
                              torch.cuda.mem_get_info(self.device)[1], config.cache.gpu_memory_utilization,
                              tp_size=config.parallel.tensor_parallel_size, quantized=model.quant_config is not None)
        check_proposer(config.speculative, model)

    def _load_model(self) -> None:
        model = self.model_info
        start = time.perf_counter()
        with building(self.config.kernel):  # layers take their kernel choices as they are built
            self.model = build_model(model.hf_config, model.path, model.dtype, model.device, model.load_format,
                                     model.seed, model.quant_config)
        sched = self.config.scheduler  # LoRA slot tables: before KV sizing, which counts them as weights
        max_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + self.config.speculative.num_draft_tokens))
        self.lora = build_lora_slots(self.config.lora, self.model, model.dtype, model.device, max_tokens)
        self.load_seconds = time.perf_counter() - start

    def _choose_kv_format(self) -> None:
        """Each attention layer's KV dtype and scales, checked against max_model_len on this device."""
        self.attention_layers = attention_layers(self.model)
        set_kv_cache_dtype(self.attention_layers, kv_cache_format(self.config.cache.kv_cache_dtype, self.dtype))
        set_index_cache_dtype(self.attention_layers, self.config.cache.index_cache_dtype)
        finalize_kv_scales(self.attention_layers)
        check_attention_supported(self.attention_layers, self.max_model_len, self.device)
        self._check_state_layers()
        summary = self.model_summary
        logger.info("model loaded in %.1f s: format %s, weights %.2f GiB, KV cache %d bytes/token (this rank)",
                    self.load_seconds, summary["format"], summary["weight_bytes"] / (1 << 30),
                    summary["kv_bytes_per_token"])

    def _check_state_layers(self) -> None:
        """Linear-attention layers (a fixed-size state per sequence, kv_spec.StateSpec): one state slot
        per schedulable sequence; what their state cannot do is refused or turned off here, once."""
        self.state_layers = state_layers(self.model)
        self.num_state_slots = self.config.scheduler.max_num_seqs if self.state_layers else 0
        self.num_step_states = 0
        if not self.state_layers:
            return
        spec = self.config.speculative
        if spec.num_draft_tokens and spec.method not in ("mtp", "ngram"):
            raise ValueError(f"speculative decoding with --method {spec.method} is not supported for models with "
                             "linear-attention layers; use --method mtp (the checkpoint's MTP layer) or ngram")
        # Verify steps keep the state after each of their first K tokens (kv_spec.allocate_state_cache).
        self.num_step_states = spec.num_draft_tokens
        logger.info("%d linear-attention layers: %d state slots of %d bytes each (%d more per slot for verify "
                    "steps)", len(self.state_layers), self.num_state_slots, state_bytes_per_slot(self.state_layers),
                    self.num_step_states)

    def _build_step_parts(self) -> None:
        """Samplers, the proposer (NoProposer without speculative decoding), the request states
        and the graph dispatcher, which runs every forward eagerly until graphs are captured."""
        config = self.config
        if config.profiler.mark_trace:  # before graph capture, so capture traces carry module ranges
            from atom_core.profiling.profiler import mark_modules

            mark_modules(self.model)
        self.sampler = Sampler()
        with building(config.kernel):
            self.proposer = build_proposer(config.speculative, self.model_info, self.block_size,
                                           config.scheduler.max_num_seqs, target_model=self.model,
                                           max_num_tokens=config.scheduler.max_num_batched_tokens)
        self.rejection_sampler = RejectionSampler()
        self.input_batch = InputBatch()
        # vision-language models: the encoder outputs by image hash (None: the model takes no images)
        self.encoder = EncoderRunner(self.model, self.device) if getattr(self.model, "supports_images", False) else None
        self.dispatcher = GraphDispatcher(self.model, self.max_model_len, self.block_size, self.device,
                                          spans_replicas=config.parallel.experts_span_replicas,
                                          profiler=self.profiler)

    def _compile(self) -> None:
        self.compile_seconds = 0.0
        if self.config.use_compile:
            from atom_core.worker.compile import compile_model

            start = time.perf_counter()
            compile_model(self.model)
            self.compile_seconds = time.perf_counter() - start

    def _size_and_allocate_kv(self) -> None:
        """On a GPU sizing runs a max-size dummy step (which compiles, if compiling); the proposer's
        layers share the target's block count."""
        start = time.perf_counter()
        # State pools first: on a GPU the sizing below counts them with the weights.
        self.state_cache = allocate_state_cache(self.state_layers, self.num_state_slots, self.device,
                                                self.num_step_states)
        self.num_kv_blocks = num_kv_blocks(self.config, self.attention_layers + self.proposer.kv_layers(),
                                           self.max_model_len, self.device, self._run_peak_step)
        self.kv_cache = allocate_kv_cache(self.attention_layers, self.num_kv_blocks, self.block_size, self.device)
        self.proposer.allocate_kv(self.num_kv_blocks)
        self.sizing_seconds = time.perf_counter() - start

    def _run_peak_step(self) -> int:
        """A max-size step on a scratch KV cache (for memory profiling); returns the scratch bytes."""
        sched = self.config.scheduler
        out, num_blocks = dummy_step(sched.max_num_batched_tokens, sched.max_num_seqs, self.max_model_len,
                                     self.block_size)
        tensors = allocate_kv_cache(self.attention_layers, num_blocks, self.block_size, self.device)
        # The target alone: a proposer's layers get their KV after sizing (its peak is one MTP
        # layer or a small draft model's, next to the target's; not profiled).
        proposer, self.proposer = self.proposer, NoProposer()
        encoder_cache = self._profile_encoder() if self.encoder is not None else None
        try:
            self.execute(out)
        finally:
            self.proposer = proposer
        del encoder_cache
        self.input_batch.remove(out.req_ids)
        scratch = sum(t.numel() * t.element_size() for t in tensors)
        release_kv_cache(self.attention_layers)
        return scratch

    def _profile_encoder(self) -> torch.Tensor:
        """For a vision-language model, before the dummy step: encode one largest image and hold a
        full encoder-output cache (the scheduler's budget, engine/encoder_cache.py), so the profiled
        peak counts the encoder's activations and the cached outputs a step's forward runs beside."""
        from atom_core.multimodal.inputs import encoder_cache_rows
        from atom_core.multimodal.processors import build_image_processor

        processor = build_image_processor(self.model_info.path, None)
        item = processor.largest_item()
        (embeds,) = self.model.encode_images([item])
        rows = encoder_cache_rows(self.config.scheduler.max_num_batched_tokens, processor.max_tokens_per_image)
        return embeds.new_empty(rows, embeds.shape[-1])

    def _warm_up_kernels(self) -> None:
        """Compile every attention kernel variant now, not inside the first steps that need one
        (a cold Triton cache otherwise costs seconds in the middle of a run)."""
        self.warm_up_seconds = 0.0
        if self.device.type != "cuda":
            return
        start = time.perf_counter()
        longest = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        # Threads: Triton compiles run in subprocesses and release the GIL, so they overlap.
        threads = min(8, os.cpu_count() or 1)
        count = warm_up_attention(self.attention_layers, longest, threads)
        logits = torch.zeros(2, self.vocab_size, dtype=self.dtype, device=self.device)
        kernel_ops(self.device).gumbel_argmax(logits, torch.ones(2, device=self.device), 0, 0)  # the sampler's
        torch.cuda.synchronize()
        self.warm_up_seconds = time.perf_counter() - start
        logger.info("warmed up %d attention kernel variants and the sampler in %.1f s", count, self.warm_up_seconds)

    def _capture_graphs(self) -> None:
        """Full decode graphs (with verify graphs when speculating), the proposer's own graphs in
        their pool, then piecewise graphs: the sets cudagraph_mode asks for (graph_dispatch.py)."""
        config = self.config
        sets = graph_sets(config.use_cuda_graphs, config.compile.cudagraph_mode, self.dispatcher.spans_replicas)
        if sets.full:
            self.dispatcher.capture_decode(config.capture_sizes, self.proposer.num_draft_tokens,
                                           config.parallel.data_parallel_size)
            if config.kernel.mtp_graphs:  # the MTP / EAGLE-3 proposer's own forwards
                self.proposer.capture_graphs(config.capture_sizes, self.dispatcher.capture_forward)
        if sets.piecewise and self.state_layers:
            # The split at the DeltaNet cores works (tests/worker/test_hybrid_piecewise.py); the gated
            # full-attention layers' pieces replay wrong tokens on the CPU graph stand-in, cause not found.
            logger.warning("piecewise CUDA graphs are off for this model (hybrid linear attention): its gated "
                           "attention layers do not yet replay correctly in pieces; decode uses full CUDA graphs")
        elif sets.piecewise:
            self.dispatcher.capture_piecewise(config.piecewise_sizes, self.attention_layers)

    def release_graphs(self) -> None:
        """Free every captured CUDA graph. Before leaving an NCCL group: a live graph that captured
        NCCL kernels makes ncclCommDestroy wait forever (pytorch/pytorch#115388)."""
        self.dispatcher.release()
        self.proposer.release_graphs()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def model_summary(self) -> dict:
        """The weight format (the quant config's description), weight bytes and KV bytes per token, on this rank."""
        qc = self.model_info.quant_config
        fmt = "unquantized" if qc is None else (qc.describe() if hasattr(qc, "describe") else qc.name)
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return {"format": f"{fmt} ({self.dtype})".replace("torch.", ""),
                "weight_bytes": sum(t.numel() * t.element_size() for t in tensors),
                "kv_bytes_per_token": sum(layer.kv_spec.bytes_per_token for layer in self.attention_layers)}

    @property
    def startup_breakdown(self) -> dict[str, float]:
        """Seconds per startup phase (what `start to ready` is made of)."""
        return {
            "load": self.load_seconds,
            "compile_setup": self.compile_seconds,  # importing Dynamo/Inductor; compiling is lazy
            "kv_sizing": self.sizing_seconds,
            "kernel_warm_up": self.warm_up_seconds,
            "graph_capture": self.dispatcher.capture_seconds + self.proposer.graph_capture_seconds,
        }

    # ---- one step -------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Launch and wait: the synchronous step."""
        return self.resolve(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, previous: PendingStep | None = None) -> PendingStep:
        """Enqueue the step on the device and return without waiting for it.

        Input tokens the host does not know yet are gathered on the device from `previous`,
        the step launched just before, whose samples have not reached the host yet.
        """
        states = self.input_batch.update(out)
        if out.finished_req_ids:
            self.proposer.forget(out.finished_req_ids)
        mm_embeds = self._multimodal_inputs(out) if self.encoder is not None else None
        if self.dispatcher.uses_verify_layout(out, states):
            flat = build_padded_verify_batch(out, states, self.dispatcher.verify.query_len, self.block_size,
                                             self.device, bool(self.state_layers))
        else:
            flat = build_flat_batch(out, states, self.block_size, self.device, bool(self.state_layers))
        if flat.placeholder_rows:
            self._fill_placeholders(flat, out, previous)
        flat.mm_embeds = mm_embeds
        self.lora.prepare(flat, states)
        if out.is_window:
            return self._launch_window(out, states, flat)
        hidden = self._forward(flat, out)
        pending = PendingStep(out, states, flat)
        if self.proposer.uses_target_hidden:
            # A graph replay's output buffer is safe until the next launch: speculative steps
            # resolve (and propose) before it (EngineCore._needs_known_tokens).
            pending.hidden = hidden
        if not flat.sample_seq_idx and not flat.prompt_logprob_spans:
            return pending
        rows = hidden if flat.logits_all_rows else hidden[flat.logit_rows]
        logits = self.model.compute_logits(rows)  # model dtype: the sampler upcasts where it matters
        if flat.sample_seq_idx and out.has_drafts:
            self._launch_verify(pending, logits, out, states, flat)
        elif flat.sample_seq_idx:
            sb = self._sampling_batch(out, states, flat)
            # Without prompt logprobs the logit rows are exactly the sampling rows, in order;
            # skipping the list index avoids a host-to-device copy that would sync the stream.
            sample_logits = logits if not flat.prompt_logprob_spans else logits[flat.sample_rows]
            sampled = self.sampler(sample_logits, sb)
            pending.sampled = sampled.token_ids
            pending.sampler_out = sampled
            pending.row_of = {out.req_ids[i]: r for r, i in enumerate(flat.sample_seq_idx)}
            self._record(pending)
        for i, row, first, count in flat.prompt_logprob_spans:  # rare (echo + logprobs): synchronous
            k = states[i].sampling_params.prompt_logprobs
            targets = torch.tensor(states[i].tokens(first, first + count), device=self.device)
            pending.prompt_logprobs[i] = token_logprobs(logits[row : row + count], targets, k)
        return pending

    def _multimodal_inputs(self, out: SchedulerOutput):
        """Images: new requests' multimodal rotary positions, then the step's encoder outputs (the
        encoder runs on the images the scheduler listed; worker/encoder_runner.py)."""
        requests = self.input_batch.requests
        for new in out.new_requests:
            if new.mm_items:
                state = requests[new.req_id]
                rope = self.model.mrope_positions(state.prompt_token_ids, state.mm_items)
                if rope is not None:
                    state.mrope_positions, state.rope_delta = rope
        return self.encoder.step_embeds(out, [requests[rid] for rid in out.req_ids])

    def _launch_window(self, out: SchedulerOutput, states: list[RequestState], flat: FlatBatch) -> PendingStep:
        """A multi-step decode window: out.num_steps forwards, each fed the previous step's
        samples on the device. Rows past their step count keep their last position and store
        no KV; the host drops their samples."""
        sb = self._sampling_batch(out, states, flat)
        num_steps = out.num_steps
        step_counts = [1 + len(extra) for extra in out.extra_tokens]
        attn = flat.attn
        # KV positions from the lengths (the rotary positions may add a multimodal rotary's delta)
        first, first_rope = attn.seq_lens.to(torch.int64) - 1, flat.positions
        counts = torch.tensor(step_counts, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        last = first + counts.to(self.device, non_blocking=True) - 1
        samples = []
        for step in range(num_steps):
            if step:
                wanted = first + step
                positions = torch.minimum(wanted, last)
                block = attn.block_tables.gather(1, (positions // self.block_size).unsqueeze(1)).squeeze(1)
                slots = block.to(torch.int64) * self.block_size + positions % self.block_size
                flat.input_ids = samples[-1]
                flat.positions = first_rope + (positions - first)
                attn.slot_mapping = torch.where(wanted <= last, slots, -1)
                attn.seq_lens = (positions + 1).to(torch.int32)
                attn.max_seq_len += 1
                if sb.positions is not None:
                    sb.positions = sb.positions + 1
            hidden = self._forward(flat, out, inputs_only=step > 0)
            logits = self.model.compute_logits(hidden)
            samples.append(self.sampler(logits, sb).token_ids)
        pending = PendingStep(out, states, flat)
        # [rows, steps]: each row's tokens contiguous for the host; placeholders read the last kept one.
        pending.sampled = torch.stack(samples, dim=1)
        pending.row_of = {rid: r * num_steps + count - 1
                          for r, (rid, count) in enumerate(zip(out.req_ids, step_counts))}
        self._record(pending)
        return pending

    def _launch_verify(self, pending: PendingStep, logits: torch.Tensor, out: SchedulerOutput,
                       states: list[RequestState], flat: FlatBatch) -> None:
        """Speculative decoding: every sampling request's 1 + k rows go through the rejection
        sampler, which keeps the target's distribution (see spec_decode/rejection_sampler.py)."""
        rows = verify_rows(out, states, flat, self.vocab_size, self.eos_token_ids, self.device, self.rng)
        if flat.prompt_logprob_spans:
            logits = logits[torch.tensor(rows.logit_rows, device=logits.device)]
        pending.verify = rows
        pending.sampled = self.rejection_sampler(logits, rows.batch, rows.draft_ids)
        if any(states[i].sampling_params.logprobs is not None for i in flat.sample_seq_idx):
            pending.verify_logits = logits
        self._record(pending)

    def _resolve_verify(self, pending: PendingStep, result: ModelRunnerOutput) -> None:
        rows, seq_idx = pending.verify, pending.flat.sample_seq_idx
        tokens = emitted_tokens(pending.sampled_host.tolist(), rows.first_rows, rows.drafts)
        for i, toks in zip(seq_idx, tokens):
            result.sampled[i] = toks
        if self.state_layers:
            self._keep_verified_states(pending, seq_idx, rows.drafts, tokens)
        if pending.verify_logits is not None:
            result.logprobs.update(emitted_logprobs(pending.verify_logits, rows, tokens, pending.states, seq_idx))

    def _keep_verified_states(self, pending: PendingStep, seq_idx: list[int], drafts: list[list[int]],
                              tokens: list[list[int]]) -> None:
        """Linear-attention layers ran every row of a verifying request into its state; where some
        rows came after the accepted tokens (rejected drafts, or a padded layout's padding), its
        state becomes the one kept after them (the pending token is step 0)."""
        rows_per_request = pending.flat.verify_query_len
        slots, steps = [], []
        for i, draft, toks in zip(seq_idx, drafts, tokens):
            num_rows = rows_per_request or 1 + len(draft)
            if (draft or rows_per_request) and len(toks) < num_rows:  # len(toks) - 1 drafts accepted
                slots.append(pending.states[i].state_slot + 1)
                steps.append(len(toks) - 1)
        keep_verified_states(self.state_layers, slots, steps, self.device)

    def _propose(self, result: ModelRunnerOutput, pending: PendingStep) -> None:
        """Drafts for every request that just gained tokens (its state is up to date now)."""
        target = (target_hidden(pending.out, pending.flat, pending.hidden, pending.states, result.sampled)
                  if pending.hidden is not None else None)
        result.draft_token_ids = self.proposer.draft(result, self.input_batch.requests, target)

    def _record(self, pending: PendingStep) -> None:
        pending.sampled_host = _to_host_async(pending.sampled)
        if self.device.type == "cuda":
            pending.event = torch.cuda.Event()
            pending.event.record()

    def _sampling_batch(self, out: SchedulerOutput, states: list[RequestState], flat: FlatBatch):
        return build_sampling_batch(out, states, flat.sample_seq_idx, self.vocab_size, self.eos_token_ids,
                                    self.device, self.rng)

    def _fill_placeholders(self, flat: FlatBatch, out: SchedulerOutput, previous: PendingStep | None) -> None:
        assert previous is not None and previous.sampled is not None, "placeholder input without a previous step"
        rows = [previous.row_of[out.req_ids[i]] for i in flat.placeholder_seqs]
        # One transfer for both index lists: [0] rows of the previous samples, [1] flat rows to fill.
        index = torch.tensor([rows, flat.placeholder_rows], dtype=torch.int64,
                             pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
        flat.input_ids.index_copy_(0, index[1], previous.sampled.view(-1).index_select(0, index[0]))

    def resolve(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for the step's samples (the step's one host-device sync) and return them."""
        out, flat = pending.out, pending.flat
        result = ModelRunnerOutput(out.req_ids, [[] for _ in out.req_ids], prompt_logprobs=pending.prompt_logprobs)
        if pending.sampled is None:
            if pending.hidden is not None:  # prefill chunks that sample nothing still feed an MTP layer
                self._propose(result, pending)
            return result
        if pending.event is not None:
            pending.event.synchronize()
        if out.is_window:
            for i, (tokens, extra) in enumerate(zip(pending.sampled_host.tolist(), out.extra_tokens)):
                result.sampled[i] = tokens[: 1 + len(extra)]
        elif pending.verify is not None:
            self._resolve_verify(pending, result)
        else:
            for i, tok in zip(flat.sample_seq_idx, pending.sampled_host.tolist()):
                result.sampled[i] = [tok]
            if pending.sampler_out.logprobs is not None:
                result.logprobs.update(sampled_logprobs(pending.sampler_out, pending.states, flat.sample_seq_idx))
        self.input_batch.append_sampled(out.req_ids, result.sampled)
        self._propose(result, pending)
        return result

    @torch.inference_mode()
    def run_dummy_forward(self) -> None:
        """One padding token through the model, its KV written nowhere (slot -1) and its output
        dropped: an idle data-parallel replica joins the MoE collectives of a step the other
        replicas run (engine/lockstep.py). When they agreed to replay a decode graph, this replica
        replays it too, with padding rows only."""
        self.lora.clear()
        self.dispatcher.forward_padding()

    def graph_batch_size(self, out: SchedulerOutput) -> int | None:
        """The captured size a decode batch would replay with, or None when it runs eagerly."""
        return self.dispatcher.graph_batch_size(out)

    def _forward(self, flat: FlatBatch, out: SchedulerOutput, inputs_only: bool = False) -> torch.Tensor:
        """inputs_only: the block tables are those of the last replay (later steps of a window)."""
        return self.dispatcher.forward(flat, out, inputs_only)
