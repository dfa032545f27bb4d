"""One streaming request per backend, timed the way vLLM's benchmark_serving times it.

Contract of every request function: it never raises for a server or network problem; it
returns a `RequestOutput` with `success=False` and a readable `error` instead. Times are
`time.perf_counter()` seconds:
  ttft    first token-bearing chunk - request sent
  itl     every gap between consecutive token-bearing chunks (len = chunks - 1)
  latency last token-bearing chunk - request sent (E2EL)
`output_tokens` is the server's `usage.completion_tokens` when it streams one, else None (the
metrics then count tokens by re-tokenizing `generated_text`).

One deliberate difference from vLLM: for the chat API, a chunk whose delta holds only the role
(no text) is not a token. vLLM servers send it right before the first token, so TTFT is the
same, but counting it would add a zero-length gap to ITL.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

from atom_core.bench.names import BACKENDS, Backend  # noqa: F401 - re-exported
_DEFAULT_ENDPOINTS = {"openai-chat": "/v1/chat/completions", "tgi": "/generate_stream"}


@dataclass(frozen=True)
class RequestInput:
    prompt: str
    api_url: str
    prompt_len: int
    output_len: int
    model: str
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    images: tuple[str, ...] = ()  # image URLs sent after the prompt's text (chat backend only)


@dataclass
class RequestOutput:
    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int | None = None
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""


RequestFunc = Callable[[httpx.AsyncClient, RequestInput], Awaitable[RequestOutput]]


def default_endpoint(backend: str) -> str:
    return _DEFAULT_ENDPOINTS.get(backend, "/v1/completions")


def check_endpoint(backend: str, endpoint: str) -> None:
    """Catch the usual mix-up (chat backend on the completions URL or the reverse) up front."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend '{backend}'; expected one of: {', '.join(BACKENDS)}")
    is_chat = endpoint.rstrip("/").endswith("chat/completions")
    if backend == "openai-chat" and not is_chat:
        raise ValueError(f"backend 'openai-chat' needs a chat endpoint (…/chat/completions), got '{endpoint}'")
    if backend in ("openai", "vllm", "atom") and (is_chat or not endpoint.rstrip("/").endswith("completions")):
        raise ValueError(f"backend '{backend}' needs a completions endpoint (…/completions), got '{endpoint}'")


def auth_headers() -> dict[str, str]:
    """Bearer auth from OPENAI_API_KEY (the OpenAI clients' convention), if set."""
    api_key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class _StreamTimer:
    """Turns the arrival times of token-bearing chunks into ttft / itl / latency."""

    def __init__(self, output: RequestOutput) -> None:
        self.output = output
        self.start = time.perf_counter()
        self.last = self.start
        self.num_chunks = 0

    def token_chunk(self) -> None:
        now = time.perf_counter()
        if self.num_chunks == 0:
            self.output.ttft = now - self.start
        else:
            self.output.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1

    def finish(self) -> None:
        if self.num_chunks == 0:
            self.output.error = "never received a token chunk, so there is no TTFT; request counted as failed"
            return
        self.output.success = True
        self.output.latency = self.last - self.start


async def _sse_events(response: httpx.Response):
    """Yield the JSON payload of each `data:` line; stop at [DONE]; skip comments/other fields."""
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _stream_error(event: dict) -> str | None:
    """An error sent inside the stream, OpenAI style: {"error": {...}} or {"object": "error"}."""
    if "error" in event and not event.get("choices"):
        err = event["error"]
        return err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)
    if event.get("object") == "error":
        return event.get("message", json.dumps(event))
    return None


async def _post_stream(client: httpx.AsyncClient, inp: RequestInput, payload: dict, on_event) -> RequestOutput:
    output = RequestOutput(prompt_len=inp.prompt_len)
    timer = _StreamTimer(output)
    try:
        async with client.stream("POST", inp.api_url, json=payload, headers=auth_headers()) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace").strip()
                output.error = f"HTTP {response.status_code}: {body[:500]}"
                return output
            async for event in _sse_events(response):
                if (message := _stream_error(event)) is not None:
                    output.error = f"error in stream: {message}"
                    return output
                on_event(event, output, timer)
        timer.finish()
    except Exception as err:  # noqa: BLE001 - the contract: a failed request is data, not a crash
        output.success = False
        output.error = f"{type(err).__name__}: {err}".strip()
    return output


def _completion_event(event: dict, output: RequestOutput, timer: _StreamTimer) -> None:
    if choices := event.get("choices"):
        # Text may be empty (a special token, or a partial UTF-8 sequence held back): still a token.
        timer.token_chunk()
        output.generated_text += choices[0].get("text") or ""
    if usage := event.get("usage"):
        output.output_tokens = usage.get("completion_tokens")


def _chat_event(event: dict, output: RequestOutput, timer: _StreamTimer) -> None:
    if choices := event.get("choices"):
        delta = choices[0].get("delta") or {}
        text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
        role_only = "role" in delta and not text
        if not role_only:
            timer.token_chunk()
            output.generated_text += text
    if usage := event.get("usage"):
        output.output_tokens = usage.get("completion_tokens")


async def request_openai_completions(client: httpx.AsyncClient, inp: RequestInput) -> RequestOutput:
    return await _openai_stream(client, inp, {"prompt": inp.prompt}, "max_tokens", _completion_event)


async def request_openai_chat(client: httpx.AsyncClient, inp: RequestInput) -> RequestOutput:
    content: str | list = inp.prompt
    if inp.images:  # vLLM's random-mm order: the text, then the images
        content = [{"type": "text", "text": inp.prompt}] + [{"type": "image_url", "image_url": {"url": url}}
                                                            for url in inp.images]
    messages = {"messages": [{"role": "user", "content": content}]}
    return await _openai_stream(client, inp, messages, "max_completion_tokens", _chat_event)


async def _openai_stream(client: httpx.AsyncClient, inp: RequestInput, prompt: dict, max_tokens_key: str,
                         on_event) -> RequestOutput:
    """Both OpenAI endpoints' greedy streaming request with usage; they differ in how the prompt
    and the length cap are named."""
    payload = {
        "model": inp.model,
        **prompt,
        "temperature": 0.0,
        max_tokens_key: inp.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if inp.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(inp.extra_body)
    return await _post_stream(client, inp, payload, on_event)


async def request_tgi(client: httpx.AsyncClient, inp: RequestInput) -> RequestOutput:
    params = {"max_new_tokens": inp.output_len, "do_sample": True, "temperature": 0.01, "top_p": 0.99}
    params.update(inp.extra_body)
    texts: list[str] = []

    def on_event(event: dict, output: RequestOutput, timer: _StreamTimer) -> None:
        timer.token_chunk()
        texts.append((event.get("token") or {}).get("text", ""))
        if event.get("generated_text") is not None:
            output.generated_text = event["generated_text"]
        details = event.get("details") or {}
        if details.get("generated_tokens") is not None:
            output.output_tokens = details["generated_tokens"]

    output = await _post_stream(client, inp, {"inputs": inp.prompt, "parameters": params}, on_event)
    if output.success and not output.generated_text:
        output.generated_text = "".join(texts)
    return output


REQUEST_FUNCS: dict[str, RequestFunc] = {
    "openai": request_openai_completions,
    "vllm": request_openai_completions,
    "atom": request_openai_completions,
    "openai-chat": request_openai_chat,
    "tgi": request_tgi,
}
