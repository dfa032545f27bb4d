"""vLLM's utility endpoints, with its request and response shapes: POST /tokenize,
POST /detokenize (behind the API key, as the model routes), GET /version, GET and POST /ping
(open, as /health, which /ping answers the same way)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator

import atom_core
from atom_core.server.chat_translation import chat_request
from atom_core.server.protocol import APIError, ChatMessage, NonEmptyTokenIds, _field_error
from atom_core.server.serving import OpenAIServing, _require_tokenizer
from atom_core.server.structured_request import ChatTool


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TokenizeRequest(_Strict):
    """A `prompt` (text) or chat `messages` (the chat template applied), exactly one."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="Default: true for a prompt, false for messages "
                                            "(the template writes them).")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise _field_error("prompt", "send exactly one of 'prompt' (text) or 'messages' (chat)")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: NonEmptyTokenIds


class UtilityServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def tokenize(self, req: TokenizeRequest) -> dict:
        serving = self.serving
        serving._check_model(req.model)
        if req.messages is None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await serving.tokenizer_pool.run(
                lambda tok: _require_tokenizer(tok, "/tokenize").encode(req.prompt, add_special_tokens=special))
        else:
            chat = chat_request({"messages": [m.model_dump(exclude_none=True) for m in req.messages],
                                 "add_generation_prompt": req.add_generation_prompt,
                                 "chat_template_kwargs": req.chat_template_kwargs,
                                 "tools": [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None},
                                {})
            _, ids = await serving.tokenizer_pool.run(serving._tokenize_chat, chat, bool(req.add_special_tokens))
        strs = serving.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": serving.engine.info.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        serving = self.serving
        serving._check_model(req.model)
        vocab_size = serving.engine.info.vocab_size
        for i, token in enumerate(req.tokens):
            if token >= vocab_size:
                raise APIError(f"tokens.{i}: token id {token} is out of range; the vocabulary has {vocab_size} tokens",
                               param="tokens")
        text = await serving.tokenizer_pool.run(lambda tok: _require_tokenizer(tok, "/detokenize").decode(req.tokens))
        return {"prompt": text}


def add_utility_routes(app: FastAPI, router: APIRouter, serving: OpenAIServing, health) -> None:
    """`health`: the /health handler, which /ping answers with."""
    utility = UtilityServing(serving)

    router.add_api_route("/tokenize", utility.tokenize, methods=["POST"])
    router.add_api_route("/detokenize", utility.detokenize, methods=["POST"])

    @app.get("/version")
    async def version():
        return {"version": atom_core.__version__}

    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}")
