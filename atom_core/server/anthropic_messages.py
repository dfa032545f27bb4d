"""The Anthropic Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request becomes a chat request served by the chat path (template, tool and reasoning
parsers, grammars): content blocks map onto chat messages (tool_use -> the assistant's
tool_calls, tool_result -> tool messages), `tools[].input_schema` onto function parameters,
`tool_choice` auto / any / tool / none onto auto / required / named / none, and
`output_config.format` (json_schema) onto response_format. The output's blocks (OutputBlocks)
become text, tool_use and thinking content blocks (thinking when the server's reasoning
parser separates it; its signature is empty). Errors under /v1/messages have Anthropic's shape.
Usage follows Anthropic's convention: input_tokens excludes the prompt tokens read from the
prefix cache, which are cache_read_input_tokens.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from atom_core.engine.async_engine import EngineDeadError
from atom_core.engine.output_processor import RequestState
from atom_core.server.chat_translation import chat_engine_requests, chat_request, count_prompt_tokens
from atom_core.server.output_blocks import Block, BlockEvent, OutputBlocks, blocks_of, final_message_delta, message_delta
from atom_core.server.protocol import APIError, NonEmptyStr
from atom_core.server.serving import _JSON, SSE_HEADERS, EngineRequest, OpenAIServing, engine_error

MESSAGES_PATH = "/v1/messages"
CHAT_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config.format"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


# ---- request models -------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class TextBlockParam(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # prefix caching is automatic


class ToolUseBlockParam(_Strict):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlockParam(_Strict):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlockParam] = ""
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlockParam(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[Union[TextBlockParam, ToolUseBlockParam, ToolResultBlockParam, ThinkingBlockParam],
                         Field(discriminator="type")]


class MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolParam(_Strict):
    name: NonEmptyStr
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceParam(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: NonEmptyStr | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]  # thinking is the server's --reasoning-parser's to separate, not a budget


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None


class CountTokensRequest(_Strict):
    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingDisabled | None = None
    output_config: OutputConfig | None = None

    def chat_body(self) -> dict:
        messages = [{"role": "system", "content": _joined(self.system)}] if self.system else []
        for message in self.messages:
            messages += _chat_messages(message)
        body: dict = {"model": self.model, "messages": messages}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                               "parameters": t.input_schema}} for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and choice.name is None:
                raise APIError("tool_choice of type 'tool' needs 'name'", param="tool_choice.name")
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                                   else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": self.output_config.format.schema_}}
        return body


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, description="The prompt's tokens plus this must fit the model's context.")
    stop_sequences: list[NonEmptyStr] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    # Accepted for compatibility; they never change results.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def chat_body(self) -> dict:
        body = super().chat_body() | {"max_completion_tokens": self.max_tokens, "temperature": self.temperature,
                                      "top_p": self.top_p, "stop": self.stop_sequences, "top_k": self.top_k}
        return {k: v for k, v in body.items() if v is not None}


def _joined(content: str | list[TextBlockParam]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _chat_messages(message: MessageParam) -> list[dict]:
    """One Anthropic message -> chat messages: a user turn's tool results become tool messages
    (before its text); an assistant turn's tool_use blocks its tool_calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    text = "".join(b.text for b in message.content if isinstance(b, TextBlockParam))
    if message.role == "user":
        tools = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                 for b in message.content if isinstance(b, ToolResultBlockParam)]
        return tools + ([{"role": "user", "content": text}] if text or not tools else [])
    out: dict = {"role": "assistant", "content": text}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.content if isinstance(b, ToolUseBlockParam)]
    if calls:
        out["tool_calls"] = calls
    thinking = "".join(b.thinking for b in message.content if isinstance(b, ThinkingBlockParam))
    if thinking:
        out["reasoning_content"] = thinking
    return [out]


# ---- serving --------------------------------------------------------------------------
class MessagesServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def count_tokens(self, req: CountTokensRequest) -> dict:
        chat = chat_request(req.chat_body(), CHAT_NAMES)
        return {"input_tokens": await count_prompt_tokens(self.serving, chat, CHAT_NAMES)}

    async def create(self, req: MessagesRequest, raw: Request):
        chat = chat_request(req.chat_body(), CHAT_NAMES)
        subs = await chat_engine_requests(self.serving, chat, raw, CHAT_NAMES)
        message_id = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            return StreamingResponse(self._events(message_id, subs[0]), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        [state] = await self.serving.run_to_end(raw, subs)
        blocks = blocks_of(final_message_delta(subs[0], state))
        return JSONResponse(self._message(message_id, subs[0], [content_block(b) for b in blocks])
                            | _stop(state, blocks) | {"usage": _usage(subs[0], state)})

    def _message(self, message_id: str, sub: EngineRequest, content: list[dict]) -> dict:
        return {"id": message_id, "type": "message", "role": "assistant", "model": self.serving.served_name(sub),
                "content": content, "stop_reason": None, "stop_sequence": None}

    async def _events(self, message_id: str, sub: EngineRequest) -> AsyncIterator[str]:
        blocks, state, started = OutputBlocks(), None, False
        try:
            async with aclosing(self.serving._merged([sub])) as updates:
                async for _, state in updates:
                    if not started:  # the first update knows the prefix-cache hits (usage)
                        started = True
                        usage = _usage(sub, state) | {"output_tokens": 0}
                        yield _sse("message_start", message=self._message(message_id, sub, []) | {"usage": usage})
                        yield _sse("ping")
                    for event in blocks.feed(message_delta(sub, state)):
                        yield _block_event(event)
            for event in blocks.close():
                yield _block_event(event)
            yield _sse("message_delta", delta=_stop(state, blocks.blocks),
                       usage={"output_tokens": len(state.token_ids)})
            yield _sse("message_stop")
        except (EngineDeadError, ValueError) as e:  # after the 200: the error travels in the stream
            err = engine_error(e)
            yield _sse("error", error=anthropic_error_body(err.status_code, err.message)["error"])


def _sse(type: str, **fields) -> str:
    return f"event: {type}\ndata: {_JSON.encode({'type': type, **fields})}\n\n"


def _usage(sub: EngineRequest, state: RequestState) -> dict:
    cached = state.num_cached_tokens
    return {"input_tokens": len(sub.prompt_ids) - cached, "output_tokens": len(state.token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop(state: RequestState, blocks: list[Block]) -> dict:
    reason, sequence = "end_turn", None
    if state.finish_reason == "length":
        reason = "max_tokens"
    elif any(b.kind == "tool_call" for b in blocks):
        reason = "tool_use"
    elif isinstance(state.stop_reason, str):
        reason, sequence = "stop_sequence", state.stop_reason
    return {"stop_reason": reason, "stop_sequence": sequence}


def content_block(block: Block) -> dict:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    try:
        arguments = json.loads(block.text)
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):  # cut by max_tokens: the text as the model wrote it
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": arguments}


_DELTAS = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text"),
           "tool_call": ("input_json_delta", "partial_json")}


def _block_event(event: BlockEvent) -> str:
    block = event.block
    if event.kind == "open":
        start = {"reasoning": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""},
                 "tool_call": {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}}[block.kind]
        return _sse("content_block_start", index=block.index, content_block=start)
    if event.kind == "delta":
        kind, key = _DELTAS[block.kind]
        return _sse("content_block_delta", index=block.index, delta={"type": kind, key: event.delta})
    return _sse("content_block_stop", index=block.index)


def add_messages_routes(router: APIRouter, messages: MessagesServing) -> None:
    @router.post(MESSAGES_PATH)
    async def create_message(req: MessagesRequest, raw: Request):
        return await messages.create(req, raw)

    @router.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens(req: CountTokensRequest):
        return await messages.count_tokens(req)
