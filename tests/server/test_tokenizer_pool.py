"""TokenizerPool on the demo model's real (HF fast) tokenizer, without a server: concurrent calls
never share a tokenizer object, tokenize exactly as the original does, and a small prompt does
not wait for a huge one."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from atom_core.loader.model_dir import DEMO_MODEL_DIR
from atom_core.server.tokenizer_pool import TokenizerPool, default_num_threads

HUGE = "hello world 123 + 456 = " * 40000  # ~1 MB: about a second of tokenization


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


def test_concurrent_calls_each_get_their_own_tokenizer(tokenizer):
    pool = TokenizerPool(tokenizer, num_threads=4)
    barrier = threading.Barrier(4, timeout=30)

    def held(tok):
        barrier.wait()  # all four calls are inside at once
        return id(tok)

    async def main():
        return await asyncio.gather(*(pool.run(held) for _ in range(4)))

    ids = asyncio.run(main())
    pool.shutdown()
    assert len(set(ids)) == 4 and id(tokenizer) not in ids


def test_parallel_tokenization_matches_the_original(tokenizer):
    pool = TokenizerPool(tokenizer, num_threads=4)
    texts = [f"{i} + {i * 7} = {i * 8} " * (50 + 37 * i) for i in range(16)]

    async def main():
        return await asyncio.gather(*(pool.run(lambda tok, t=t: tok.encode(t, add_special_tokens=False)) for t in texts))

    assert asyncio.run(main()) == [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    pool.shutdown()


def test_a_small_prompt_does_not_wait_for_a_huge_one(tokenizer):
    pool = TokenizerPool(tokenizer)
    finished: dict[str, float] = {}

    def encode(tok, name, text):
        tok.encode(text, add_special_tokens=False)
        finished[name] = time.monotonic()

    async def main():
        huge = asyncio.ensure_future(pool.run(encode, "huge", HUGE))
        await asyncio.sleep(0.05)  # the huge one is on a thread
        await pool.run(encode, "small", "123 + 456")
        await huge

    asyncio.run(main())
    pool.shutdown()
    assert finished["small"] < finished["huge"], finished


def test_at_least_two_threads_even_on_one_core(monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert default_num_threads() == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert default_num_threads() == 4


def test_a_model_without_a_tokenizer_gets_none():
    pool = TokenizerPool(None, num_threads=2)
    assert asyncio.run(pool.run(lambda tok: tok)) is None
    pool.shutdown()
