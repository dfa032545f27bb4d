"""Fixtures for the serving-benchmark tests: locally trained tokenizers and a scripted SSE server.

The fake server streams chunks at known times, so metric values can be computed by hand. It
runs in its own process (this file run as a script), so it never competes with the benchmark
client for the GIL; tests drive it through `FakeServerHandle` (configure / stats).
A prompt may carry a script, e.g. "script:ttft=0.1,itl=0.05" (seconds), and failure markers:
  FAIL500   HTTP 500 with a JSON error body
  FAILMID   two chunks, then the connection is cut mid-stream
  ERRCHUNK  one chunk, then an OpenAI-style {"error": ...} event
  NOCHUNK   a stream with no token chunk at all
Chunks come at t = ttft + k * itl after the request arrived (absolute schedule); the number
of tokens is the request's max_tokens. It records arrivals, payloads and in-flight counts.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TOKEN_TEXT = " tok"
_SCRIPT = re.compile(r"script:([a-z_=0-9.,]+)")


# --- tokenizers -------------------------------------------------------------------------


def _corpus(num_lines: int = 3000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ren", "sa", "tor", "vi", "el", "qu", "an", "dro", "pe", "zu", "ix", "ho"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(800)]
    words += ["tok", "the", "a", "of", "and", "hello", "world", "Ünïcödé", "数据", "🙂"]
    lines = []
    for _ in range(num_lines):
        line = " ".join(rng.choices(words, k=rng.randint(4, 16)))
        lines.append(line.capitalize() + rng.choice([".", "?", "!", ",", ";", "", " 42", " 3.14"]))
    return lines


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="session")
def byte_bpe_dir(tmp_path_factory) -> Path:
    """GPT-2 style: byte-level BPE, no special tokens added to prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    path = tmp_path_factory.mktemp("byte_bpe")
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama_style_dir(tmp_path_factory) -> Path:
    """Llama style: Metaspace BPE that prepends <s> to every prompt, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=specials + byte_tokens)
    tok.train_from_iterator(_corpus(seed=1), trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("llama_style")
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def byte_bpe(byte_bpe_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(byte_bpe_dir)


@pytest.fixture(scope="session")
def llama_style(llama_style_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_style_dir)


# --- fake server ------------------------------------------------------------------------


class FakeServer:
    """Scripted OpenAI-compatible (+ TGI) streaming server; runs in the server process."""

    def __init__(self) -> None:
        self.app = FastAPI()
        self._lock = threading.Lock()
        self.reset()
        self._routes()

    def reset(self) -> None:
        self.ttft_s = 0.02
        self.itl_s = 0.01
        self.send_usage = True
        self.role_chunk_first = True
        self.has_profiler = True
        self.model_entry: dict = {"id": "fake-model", "object": "model"}  # what /v1/models lists
        self.active = 0
        self.max_active = 0
        self.arrivals: list[float] = []  # perf_counter at request arrival, completions/chat/tgi only
        self.payloads: list[dict] = []
        self.profile_calls: list[tuple[str, int]] = []  # (verb, number of requests seen so far)

    # -- bookkeeping
    def _enter(self, payload: dict) -> float:
        now = time.perf_counter()
        with self._lock:
            self.arrivals.append(now)
            self.payloads.append(payload)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        return now

    def _leave(self) -> None:
        with self._lock:
            self.active -= 1

    def _script(self, prompt: str) -> tuple[float, float]:
        values = {"ttft": self.ttft_s, "itl": self.itl_s}
        if match := _SCRIPT.search(prompt):
            for item in match.group(1).split(","):
                key, _, value = item.partition("=")
                values[key] = float(value)
        return values["ttft"], values["itl"]

    async def _stream(self, prompt: str, num_tokens: int, start: float, make_chunk, first=None, last=None):
        """SSE body; `_leave` runs before the final event so counts never exceed the client's."""
        ttft, itl = self._script(prompt)
        left = False
        try:
            if first is not None:
                yield f"data: {json.dumps(first)}\n\n"
            if "FAIL500" in prompt:
                raise AssertionError("handled before streaming")
            if "NOCHUNK" in prompt:
                num_tokens = 0
            for k in range(num_tokens):
                await asyncio.sleep(max(0.0, start + ttft + k * itl - time.perf_counter()))
                if "FAILMID" in prompt and k == 2:
                    raise ConnectionAbortedError("scripted mid-stream failure")
                if "ERRCHUNK" in prompt and k == 1:
                    self._leave()
                    left = True
                    yield 'data: {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}\n\n'
                    return
                yield f"data: {json.dumps(make_chunk(k, k == num_tokens - 1))}\n\n"
            if last is not None and self.send_usage:
                yield f"data: {json.dumps(last(num_tokens))}\n\n"
            self._leave()
            left = True
            yield "data: [DONE]\n\n"
        finally:
            if not left:
                self._leave()

    def _routes(self) -> None:
        app = self.app

        @app.post("/_control/reset")
        async def control_reset(request: Request):
            self.reset()
            for key, value in (await request.json()).items():
                assert hasattr(self, key), f"unknown fake-server setting {key}"
                setattr(self, key, value)
            return {"ok": True}

        @app.get("/_control/stats")
        async def control_stats():
            return {"max_active": self.max_active, "arrivals": self.arrivals, "payloads": self.payloads,
                    "profile_calls": self.profile_calls}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self.model_entry]}

        @app.post("/start_profile")
        @app.post("/stop_profile")
        async def profile(request: Request):
            if not self.has_profiler:
                return JSONResponse({"error": "no profiler"}, status_code=404)
            self.profile_calls.append((request.url.path.strip("/"), len(self.payloads)))
            return {"ok": True}

        def usage(payload):
            def make(n):
                return {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
            return make if payload.get("stream_options", {}).get("include_usage") else None

        def error_500():
            body = {"error": {"message": "scripted failure", "type": "InternalServerError", "code": 500}}
            return JSONResponse(body, status_code=500)

        @app.post("/v1/completions")
        async def completions(request: Request):
            payload = await request.json()
            start = self._enter(payload)
            if "FAIL500" in payload["prompt"]:
                self._leave()
                return error_500()

            def chunk(k, is_last):
                choice = {"index": 0, "text": TOKEN_TEXT, "logprobs": None, "finish_reason": "length" if is_last else None}
                return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}

            body = self._stream(payload["prompt"], payload["max_tokens"], start, chunk, last=usage(payload))
            return StreamingResponse(body, media_type="text/event-stream")

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            payload = await request.json()
            prompt = payload["messages"][-1]["content"]
            start = self._enter(payload)
            if "FAIL500" in prompt:
                self._leave()
                return error_500()

            def chunk(k, is_last):
                choice = {"index": 0, "delta": {"content": TOKEN_TEXT}, "finish_reason": "length" if is_last else None}
                return {"id": "chat-1", "object": "chat.completion.chunk", "choices": [choice]}

            # A vLLM-like role chunk, but sent at once (before "prefill") to show it is not a token.
            role = {"id": "chat-1", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
            first = role if self.role_chunk_first else None
            body = self._stream(prompt, payload["max_completion_tokens"], start, chunk, first=first, last=usage(payload))
            return StreamingResponse(body, media_type="text/event-stream")

        @app.post("/generate_stream")
        async def tgi(request: Request):
            payload = await request.json()
            start = self._enter(payload)
            n = payload["parameters"]["max_new_tokens"]

            def chunk(k, is_last):
                event = {"token": {"id": 1, "text": TOKEN_TEXT, "logprob": 0.0, "special": False},
                         "generated_text": None, "details": None}
                if is_last:
                    event["generated_text"] = TOKEN_TEXT * n
                    event["details"] = {"finish_reason": "length", "generated_tokens": n}
                return event

            return StreamingResponse(self._stream(payload["inputs"], n, start, chunk), media_type="text/event-stream")


class FakeServerHandle:
    """The test side of the fake server: its URL, settings and what it saw."""

    token_text = TOKEN_TEXT  # the text of every streamed token

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def configure(self, **settings) -> None:
        """Reset the server's records, then apply settings (ttft_s, itl_s, send_usage, has_profiler, ...)."""
        httpx.post(self.base_url + "/_control/reset", json=settings).raise_for_status()

    def stats(self) -> dict:
        """max_active, arrivals (server perf_counter s), payloads, profile_calls (verb, requests seen)."""
        return httpx.get(self.base_url + "/_control/stats").json()


@pytest.fixture(scope="session")
def _fake_server_process():
    proc = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "PORT <n>" once listening
        assert line.startswith("PORT "), f"fake server did not start: {line!r}"
        yield FakeServerHandle(f"http://127.0.0.1:{int(line.split()[1])}")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def fake_server(_fake_server_process) -> FakeServerHandle:
    _fake_server_process.configure()
    return _fake_server_process


def _serve_forever() -> None:
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections made before uvicorn runs wait in the backlog
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(fake.app, log_level="critical", lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    _serve_forever()
