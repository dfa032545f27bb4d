"""Requests of other APIs (OpenAI Responses, Anthropic Messages) as chat requests.

Each is translated into a ChatCompletionRequest and served by the chat path (OpenAIServing:
chat template, validation, tool and reasoning parsers, structured outputs), so they cannot
drift from chat. An error found there names the chat field (`messages`, `max_completion_tokens`,
...); `renamed` gives it the field's name in the client's API.
"""
from __future__ import annotations

from fastapi import Request
from pydantic import ValidationError

from atom_core.server.protocol import APIError, ChatCompletionRequest, validation_error_to_api_error
from atom_core.server.serving import EngineRequest, OpenAIServing


def renamed(e: APIError, names: dict[str, str]) -> APIError:
    """`e` with its param (and that name in its message) in the client API's words."""
    if e.param:
        head, dot, rest = e.param.partition(".")
        if head in names:
            new = names[head] + dot + rest
            if e.param in e.message:
                e.message = e.message.replace(e.param, new)
            else:
                e.message = e.message.replace(head, names[head])
            e.param = new
    return e


def chat_request(body: dict, names: dict[str, str]) -> ChatCompletionRequest:
    """The ChatCompletionRequest of a translated body; its validation errors renamed."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise renamed(validation_error_to_api_error(list(e.errors())), names) from None


async def chat_engine_requests(serving: OpenAIServing, req: ChatCompletionRequest, raw: Request,
                               names: dict[str, str]) -> list[EngineRequest]:
    try:
        return await serving.chat_engine_requests(req, raw)
    except APIError as e:
        raise renamed(e, names) from None


async def count_prompt_tokens(serving: OpenAIServing, req: ChatCompletionRequest, names: dict[str, str]) -> int:
    """The prompt length of a chat request (the model checked, the template applied)."""
    try:
        serving._check_model(req.model)
        _, ids = await serving.tokenizer_pool.run(serving._tokenize_chat, req)
    except APIError as e:
        raise renamed(e, names) from None
    return len(ids)
