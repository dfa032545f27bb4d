"""The executor stands between the engine core and the per-GPU runner(s).

The core hands it each step's SchedulerOutput and gets ModelRunnerOutputs back; it never calls
a runner directly. One GPU (or the CPU) runs in-process; tensor parallelism runs one worker
process per extra rank behind the same methods (worker/multiproc_executor.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from atom_core.config import EngineConfig, ResolvedModel
from atom_core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """Contract: `launch` enqueues a step and returns a handle without waiting for the device;
    `resolve(handle)` waits for that step's tokens. Steps resolve in launch order; a launched
    step may read the samples of the one launched before it (async scheduling)."""

    num_kv_blocks: int
    num_state_slots: int = 0  # per-sequence state slots (models with linear-attention layers)

    @abstractmethod
    def launch(self, out: SchedulerOutput, previous=None): ...

    @abstractmethod
    def resolve(self, handle) -> ModelRunnerOutput: ...

    @abstractmethod
    def graph_batch_size(self, out: SchedulerOutput) -> int | None:
        """The CUDA-graph size a decode step replays with (None: runs eagerly)."""

    @property
    @abstractmethod
    def startup_breakdown(self) -> dict[str, float]: ...

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.resolve(self.launch(out))

    def shutdown(self) -> None:
        """Release what the executor started (worker processes); idempotent."""


class InProcessExecutor(Executor):
    """One runner in the engine core's own process."""

    def __init__(self, config: EngineConfig, model: ResolvedModel, profiler=None):
        import torch

        from atom_core.worker.model_runner import ModelRunner

        if model.device.type == "cuda" and model.device.index is not None:  # a data-parallel replica's core runs on cuda:N; Triton launches on the current one
            torch.cuda.set_device(model.device)
        self.runner = ModelRunner(config, model, profiler)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.num_state_slots = self.runner.num_state_slots

    def launch(self, out: SchedulerOutput, previous=None):
        return self.runner.launch(out, previous)

    def resolve(self, handle) -> ModelRunnerOutput:
        return self.runner.resolve(handle)

    def graph_batch_size(self, out: SchedulerOutput) -> int | None:
        return self.runner.graph_batch_size(out)

    @property
    def startup_breakdown(self) -> dict[str, float]:
        return self.runner.startup_breakdown

    def shutdown(self) -> None:
        """Free the captured CUDA graphs (their memory pools) now rather than at collection; idempotent."""
        self.runner.release_graphs()

