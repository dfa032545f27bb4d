"""TokenizerPool: chat templates and tokenization on a few threads, off the event loop.

A huge prompt takes seconds to tokenize; on one thread it would delay every request behind it,
and on the event loop it would stall /health and every stream. HF fast tokenizers release the
GIL while they encode, so several threads tokenize in parallel.

One tokenizer object must not be shared between those threads: transformers reconfigures the
Rust tokenizer's truncation / padding state inside `encode` (a mutable borrow), which raises
"RuntimeError: Already borrowed" while another thread is encoding with it
(huggingface/tokenizers#537, huggingface/transformers#47085). So each worker gets its own copy,
made once at start-up; the event loop keeps the original for decoding.
"""
from __future__ import annotations

import asyncio
import copy
import os
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")

MAX_TOKENIZER_THREADS = 4


def default_num_threads() -> int:
    # Two even on one core: the OS then shares it, so a small prompt never queues behind a huge one.
    return max(2, min(MAX_TOKENIZER_THREADS, os.cpu_count() or 1))


class TokenizerPool:
    """Contract: `await run(fn, *args)` calls `fn(tokenizer, *args)` on a worker thread with a
    tokenizer no other thread uses meanwhile (None when the model has none); at most
    `num_threads` calls run at once, the rest queue in order. Call from the event loop only."""

    def __init__(self, tokenizer, num_threads: int | None = None):
        self.num_threads = num_threads or default_num_threads()
        # As many copies as threads: a worker always finds a free one.
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(self.num_threads):
            self._free.put(copy.deepcopy(tokenizer) if tokenizer is not None else None)
        self._executor = ThreadPoolExecutor(self.num_threads, thread_name_prefix="atom-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, partial(self._call, fn, args, kwargs))

    def _call(self, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
        tokenizer = self._free.get_nowait()  # never empty: one copy per thread
        try:
            return fn(tokenizer, *args, **kwargs)
        finally:
            self._free.put(tokenizer)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
