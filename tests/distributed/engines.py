"""A DataParallelEngine driven from synchronous tests."""
from __future__ import annotations

import asyncio
import itertools
import threading

from atom_core import SamplingParams
from atom_core.config import EngineConfig


class ThreadedEngine:
    """A started DataParallelEngine with its event loop on a thread of its own; `run(coro)` waits
    at most `timeout_s` (a broken lock-step hangs a collective: fail instead)."""

    def __init__(self, config: EngineConfig, params: SamplingParams, timeout_s: float):
        from atom_core.engine.dp_engine import DataParallelEngine

        self.params, self.timeout_s = params, timeout_s
        self.engine = DataParallelEngine(config)
        self.engine.start()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self._attach())
        self.ids = itertools.count()

    async def _attach(self):
        self.engine.attach(asyncio.get_running_loop())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    async def generate(self, prompt: list[int], started: asyncio.Event | None = None) -> list[int]:
        """Greedy tokens of `prompt`; `started` is set once its first two tokens came back."""
        state = None
        async for state in self.engine.generate(f"r{next(self.ids)}", prompt, self.params):
            if started is not None and len(state.token_ids) >= 2:
                started.set()
        return state.token_ids

    async def generate_all(self, prompts: list[list[int]]) -> list[list[int]]:
        return list(await asyncio.gather(*(self.generate(p) for p in prompts)))

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
