"""EngineCore: scheduler + KV manager + executor, advanced one step() at a time.

The core speaks token ids only; text lives with its consumer (OutputProcessor). It runs
in-process under LLMEngine and in its own process under the server.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from atom_core.config import EngineConfig
from atom_core.engine.kv_cache import KVCacheManager
from atom_core.engine.output_processor import CoreOutput
from atom_core.engine.scheduler import Scheduler
from atom_core.engine.sequence import FinishReason, Sequence
from atom_core.engine.step_timeline import StepTimeline
from atom_core.loader import resolve_model, resolve_model_files
from atom_core.models.registry import model_takes_images
from atom_core.multimodal.inputs import MultimodalItem, check_items
from atom_core.sampling_params import SamplingParams
from atom_core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from atom_core.worker.executor import InProcessExecutor

logger = logging.getLogger(__name__)


@dataclass
class CoreStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_blocks: int
    prefix_hit_rate: float
    num_preemptions: int
    # speculative decoding counters since start (spec_decode.stats.SpecDecodeStats)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_position: tuple[int, ...] = ()
    # what the core's process holds (EngineCore.memory_bytes), filled when the stats are pushed
    memory_bytes: int = 0


def resident_set_bytes() -> int:
    """This process's resident set (Linux /proc; 0 where it is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def validate_request(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                     num_kv_tokens: int | None = None) -> None:
    """Raise ValueError for a request that can never run; nothing is queued then.

    num_kv_tokens: the whole KV cache in tokens; a request needing more would wait forever.
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty")
    if n >= max_model_len:
        raise ValueError(f"prompt has {n} tokens; max_model_len is {max_model_len} (the prompt plus at least one generated token must fit)")
    if params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds max_model_len {max_model_len}"
        )
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
        outside = sorted(t for t in ids if t >= vocab_size)
        if outside:
            raise ValueError(f"invalid sampling parameter {name}=[{outside[0]}, ...]: token ids out of range "
                             f"[0, {vocab_size}): {outside[:5]}")
    needed = min(n + (params.max_tokens or max_model_len), max_model_len)
    if num_kv_tokens is not None and needed > num_kv_tokens:
        raise ValueError(f"request needs KV for {needed} tokens but the whole cache holds {num_kv_tokens}; "
                         "raise the KV cache size or lower max_tokens")


def validate_images(mm_items, num_prompt_tokens: int, architecture: str | None, takes_images: bool,
                    max_image_tokens: int) -> None:
    """ValueError for images the model cannot take: none at all, misplaced placeholders, or one larger
    than the encoder budget (engine/encoder_cache.py)."""
    if not takes_images:
        raise ValueError(f"this model{f' ({architecture})' if architecture else ''} takes no images; send text only")
    check_items(mm_items, num_prompt_tokens)
    for i, item in enumerate(mm_items):
        if item.length > max_image_tokens:
            raise ValueError(f"image {i} takes {item.length} tokens but a step encodes at most {max_image_tokens} "
                             "(the largest of max_num_batched_tokens and the processor's largest image)")


class EngineCore:
    """Scheduler + KV manager + executor. Contract: single-threaded; `step()` advances every
    running request by one step (or one decode window) and returns their new tokens."""

    steps_with_replicas = False  # engine/lockstep.py: replicas that share experts

    def __init__(self, config: EngineConfig):
        start = time.perf_counter()
        if config.parallel.data_parallel_size > 1 and not self.steps_with_replicas:
            raise ValueError(f"data_parallel_size={config.parallel.data_parallel_size}: one engine core is one replica; "
                             "data-parallel replicas run behind `atomctl serve` (LLMEngine runs one)")
        self.config = config
        self.files = resolve_model_files(config.model.model, config.model.tokenizer)
        self.model = resolve_model(config.model, self.files)
        self.max_model_len = self.model.max_model_len
        self.vocab_size = self.model.vocab_size
        self.profiler = self._make_profiler()
        self.executor = self._make_executor()
        self.kv = KVCacheManager(self.executor.num_kv_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching, self.executor.num_state_slots)
        self.takes_images = model_takes_images(self.model.hf_config)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, self.model.eos_token_ids,
                                   config.speculative.num_draft_tokens,
                                   max_loras=config.lora.max_loras if config.lora.enable_lora else 0,
                                   max_image_tokens=self._max_image_tokens())
        self.pending = None  # the launched step not yet resolved (async scheduling)
        self.grammars = None  # GrammarManager, built at the first structured-output request
        self.step_timeline: StepTimeline | None = None  # per-step wall times while one is recorded
        self.startup_seconds = time.perf_counter() - start
        logger.info("engine core ready in %.1f s", self.startup_seconds)

    def _max_image_tokens(self) -> int:
        """The largest image's placeholder count for the model's processor (0: it takes no images). A
        vision-language checkpoint whose processor settings cannot be read serves text only."""
        if not self.takes_images:
            return 0
        from atom_core.multimodal.processors import build_image_processor

        try:
            return build_image_processor(self.files.path, None).max_tokens_per_image
        except ValueError as e:
            logger.warning("images are off for this model, text only: %s", e)
            self.takes_images = False
            return 0

    def _make_executor(self):
        """One rank: the runner in this process; tensor parallel: a worker process per extra rank."""
        from atom_core.distributed.checks import check_parallel

        check_parallel(self.config.parallel, self.model)
        if self.config.parallel.world_size == 1:
            return InProcessExecutor(self.config, self.model, self.profiler)
        if self.config.parallel.node_rank > 0:
            raise ValueError(f"node_rank={self.config.parallel.node_rank} runs only workers: start it with "
                             "`atomctl serve --nnodes N --node-rank R ...`; the engine runs on node 0")
        from atom_core.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(self.config, self.model, self.profiler)

    def shutdown(self) -> None:
        """Stop worker processes (tensor parallel); a no-op for one rank. Idempotent."""
        self.executor.shutdown()

    def _make_profiler(self):
        from atom_core.profiling.profiler import TorchProfiler

        return TorchProfiler(self.config.profiler, self.files.path.name,
                             rank_dir=self.config.profiler.profiler_rank_dir or "rank_0")

    def start_profile(self) -> None:
        """Start the torch profiler; ValueError when no profiler dir is configured."""
        self.profiler.start()

    def stop_profile(self) -> list[str]:
        return self.profiler.stop()

    def start_step_timeline(self) -> None:
        """Record every step resolved from now on (engine/step_timeline.py); restarts a running one."""
        self.step_timeline = StepTimeline()
        self.step_timeline.start({rid: s.num_prompt_tokens for rid, s in self.scheduler.requests.items()})

    def stop_step_timeline(self) -> dict:
        """The timeline's summary (StepTimeline.summary); ValueError when none is running."""
        if self.step_timeline is None:
            raise ValueError("no step timeline is running; call start_step_timeline() first")
        summary, self.step_timeline = self.step_timeline.summary(), None
        return summary

    # ---- requests -------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams,
                         mm_items: tuple[MultimodalItem, ...] = ()) -> None:
        validate_request(prompt_token_ids, params, self.max_model_len, self.vocab_size,
                         self.kv.num_blocks * self.kv.block_size)
        if mm_items:
            validate_images(mm_items, len(prompt_token_ids), self.model.architecture, self.takes_images,
                            self.scheduler.encoder.capacity)
        if params.structured_outputs is not None:
            self._grammar_manager().compile(params.structured_outputs)  # cached for add_request

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    mm_items: tuple[MultimodalItem, ...] = ()) -> None:
        self.validate_request(prompt_token_ids, params, mm_items)
        seq = Sequence(request_id, list(prompt_token_ids), params, mm_items=tuple(mm_items))
        if seq.wants_prompt_logprobs:
            seq.prompt_logprobs = [None]
        self.scheduler.add(seq)
        if params.structured_outputs is not None:
            self.grammars.add(request_id, params.structured_outputs)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)
        if self.grammars:
            self.grammars.remove(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Schedule, run and post-process one step; returns the new tokens per request.

        With async scheduling the step launched here is resolved by the next call, so the CPU
        schedules and builds step N+1 while the device still runs step N.
        """
        if not self.config.scheduler.async_scheduling:
            pending = self._launch_next(None)
            return self._resolve(pending) if pending is not None else []
        previous, self.pending = self.pending, None
        outputs: list[CoreOutput] = []
        if previous is not None and self._needs_known_tokens():
            outputs, previous = self._resolve(previous), None
        self.pending = self._launch_next(previous)
        if previous is not None:
            outputs += self._resolve(previous)
        return outputs

    def _needs_known_tokens(self) -> bool:
        """Penalties read every output token on the host, and speculation drafts from the
        previous step's tokens and learns how many it accepted: such steps cannot run ahead."""
        return bool(self.scheduler.num_speculative_tokens) or any(
            s.sampling_params.has_penalties for s in self.scheduler.running) or bool(self.grammars)

    def _launch_next(self, previous):
        """previous: the (SchedulerOutput, handle) still in flight, whose samples may feed this step."""
        out = self.scheduler.schedule()
        return self._launch(out, previous) if out.req_ids else None

    def _launch(self, out: SchedulerOutput, previous):
        if self.grammars:
            self._add_grammar_bitmask(out)
        previous_handle = previous[1] if previous is not None else None
        if self.profiler.is_active:
            handle = self._profiled_launch(out, previous_handle)
        else:
            handle = self.executor.launch(out, previous_handle)
        self.scheduler.advance(out)
        return out, handle

    def _resolve(self, pending) -> list[CoreOutput]:
        out, handle = pending
        result = self.executor.resolve(handle)
        if self.step_timeline is not None:
            self.step_timeline.record(out)
        requests = self.scheduler.requests
        seqs = [requests.get(rid) for rid in out.req_ids]  # None: ended while the step ran
        for i, entries in result.prompt_logprobs.items():
            if seqs[i] is not None:
                seqs[i].prompt_logprobs.extend(entries)
        for i, entries in result.logprobs.items():
            if seqs[i] is not None:
                seqs[i].output_logprobs.extend(entries)
        self.scheduler.resolve(out, result)
        if self.grammars:
            self._advance_grammars(out, result)
        return [self._output(seq, i, result) for i, seq in enumerate(seqs)
                if seq is not None and result.sampled[i]]

    # ---- structured outputs ---------------------------------------------------------
    def _grammar_manager(self):
        if self.grammars is None:
            from atom_core.structured.manager import GrammarManager

            tokenizer = self.files.serving_tokenizer()
            if tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this model has none (pass --tokenizer)")
            self.grammars = GrammarManager(tokenizer, self.vocab_size, self.model.eos_token_ids)
        return self.grammars

    def _add_grammar_bitmask(self, out: SchedulerOutput) -> None:
        """The allowed tokens of each grammar entry that samples this step. Its tokens are all
        known: while a grammar request runs, the step in flight resolves before the next launch."""
        requests, grammars = self.scheduler.requests, self.grammars
        rows = []
        for rid, n, start in zip(out.req_ids, out.num_scheduled_tokens, out.num_computed_tokens):
            if rid in grammars and start + n >= len(requests[rid].token_ids):
                assert requests[rid].num_placeholders == 0, "a grammar request ran ahead of its tokens"
                rows.append(rid)
        if rows:
            out.grammar_req_ids = rows
            out.grammar_bitmask = grammars.bitmask_rows(rows)

    def _advance_grammars(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """Feed each grammar its request's new tokens; a grammar that has ended ends its request
        (it happens without EOS only under ignore_eos); forget ended requests' matchers."""
        requests, grammars = self.scheduler.requests, self.grammars
        ended = [rid for rid, tokens in zip(out.req_ids, result.sampled)
                 if tokens and rid in grammars and rid in requests and grammars.accept(rid, tokens)]
        if ended:
            self.scheduler.finish_requests(ended, FinishReason.STOP)
        grammars.remove([rid for rid in out.req_ids if rid in grammars and rid not in requests])

    def _profiled_launch(self, out: SchedulerOutput, previous):
        from torch.profiler import record_function

        from atom_core.profiling.conventions import step_range_name

        phase = "decode" if out.is_decode_only else "prefill"
        graph_bs = self.executor.graph_batch_size(out) if phase == "decode" else None
        with record_function(step_range_name(phase, len(out), out.total_tokens, graph_bs)):
            handle = self.executor.launch(out, previous)
            if handle.event is not None:  # keep the step's kernels inside its range
                handle.event.synchronize()
            return handle

    def _output(self, seq: Sequence, i: int, result: ModelRunnerOutput) -> CoreOutput:
        finished = seq.is_finished
        prompt_logprobs = None
        first = seq.num_known_output_tokens == len(result.sampled[i])
        if seq.sampling_params.prompt_logprobs is not None and first:
            prompt_logprobs = list(seq.prompt_logprobs)  # sent once, with the first token(s)
        queue_time = prefill_time = None
        if first and seq.first_scheduled_time is not None:  # durations: perf_counter is per process
            queue_time = seq.first_scheduled_time - seq.arrival_time
            prefill_time = time.perf_counter() - seq.first_scheduled_time
        return CoreOutput(
            seq.request_id,
            result.sampled[i],
            finished,
            seq.finish_reason.value if finished else None,
            seq.stop_token_id,
            result.logprobs.get(i, []),
            prompt_logprobs,
            seq.num_cached_tokens,
            queue_time,
            prefill_time,
        )

    def memory_bytes(self) -> int:
        """The memory the core holds, for soaks that check it stays flat: on a GPU the CUDA caching
        allocator's reserved bytes on the core's device (what a leak grows), on the CPU the process's
        resident set. Read when stats are pushed, not every step."""
        device = self.config.model.torch_device
        if device.type == "cuda":
            import torch  # the config's device above is already a torch.device

            return torch.cuda.memory_reserved(device)
        return resident_set_bytes()

    def stats(self) -> CoreStats:
        spec = self.scheduler.spec_stats
        return CoreStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            prefix_hit_rate=self.kv.prefix_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_accepted_per_position=tuple(spec.accepted_per_position),
        )
