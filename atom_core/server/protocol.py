"""OpenAI request models, their translation into SamplingParams, and the OpenAI error body.

Requests are strict: a field this server does not know is a 400 naming it, and fields it knows
but does not implement are accepted only at their no-op value (`best_of: 1`,
`response_format: {"type": "text"}`, ...). A field that would change results
is never silently ignored.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, StrictStr, model_validator

from atom_core.sampling_params import SamplingParams
from atom_core.server.structured_request import (
    ChatTool,
    ConstraintError,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolChoice,
    structured_params,
)

MAX_N = 128
MAX_LOGPROBS = 20  # SamplingParams' limit for logprobs / top_logprobs
SEED_LIMIT = 2**63  # seeds are non-negative 64-bit integers (SamplingParams)


class APIError(Exception):
    """An error the client caused (or a server state it must know about), as HTTP + OpenAI body."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status_code, self.type, self.param, self.code = message, status_code, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sampling_error(e: ValueError) -> APIError:
    """A SamplingParams / validate_request ValueError as a 400 naming the parameter if it can."""
    match = re.match(r"invalid sampling parameter (\w+)=", str(e))
    return APIError(str(e), param=match.group(1) if match else None)


# ---- request models -------------------------------------------------------------------
_MAX_TOKENS_DOC = "The prompt's tokens plus this must fit the model's context (else 400 context_length_exceeded)."


class _Strict(BaseModel):
    # allow_inf_nan=False: Python's JSON parser reads NaN/Infinity, which no range check below would catch.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


NonEmptyUrl = Annotated[StrictStr, Field(min_length=1)]


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: NonEmptyUrl = Field(description="A data:image/...;base64 URL, an http(s) URL (the server fetches it), or a "
                                         "file:// URL under the server's --allowed-local-media-path.")
    detail: Literal["auto"] = "auto"  # low/high would change what the model sees: not implemented, refused


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    # Extra keys (name, tool_call_id, ...) reach the chat template as they came.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Annotated[ContentPart | ImagePart, Field(discriminator="type")]] | None = None

    @model_validator(mode="after")
    def _tool_result_has_content(self):
        if self.role == "tool" and self.content is None:  # templates fail on it with an internal error
            raise _field_error("messages", "a 'tool' message needs 'content' (the tool's result)")
        return self

    @property
    def image_urls(self) -> list[str]:
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)] if isinstance(self.content, list) else []

    def for_template(self, image_part: dict | None = None) -> dict:
        """The message as the chat template reads it: text parts joined into one string, or, when it has
        images, a list of text parts and `image_part` (the model's processor's, processors/base.py) each."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list) and self.image_urls:
            message["content"] = [dict(image_part) if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
                                  for p in self.content]
        elif isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        for call in message.get("tool_calls") or []:
            # OpenAI sends arguments as JSON text; chat templates (Llama 3, Qwen3, ...) expect a dict.
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass  # not JSON: the template gets the text as it came
        return message


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]
NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]
NonEmptyTokenIds = Annotated[TokenIds, Field(min_length=1)]


class _SamplingRequest(_Strict):
    """Fields the chat and completions endpoints share."""

    # The value ranges below are the ones the server accepts (SamplingParams checks the same);
    # a value outside them is a 400 naming the field. tests/server/test_openai_api.py sends
    # every documented bound and the value just past it.
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description=_MAX_TOKENS_DOC)
    temperature: float = Field(1.0, ge=0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, json_schema_extra={"not": {"const": 0}}, description="-1 (off) or >= 1.")
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, description="At most max_tokens; 0 with an output constraint.")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, description="1 is off.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (a decimal string) -> bias in [-100, 100], added to that token's logit.")
    allowed_token_ids: NonEmptyTokenIds | None = Field(None, description=(
        "vLLM's: sample only among these token ids (each below the model's vocabulary size)."))
    truncate_prompt_tokens: int | None = Field(None, ge=1, description=(
        "vLLM's: a longer prompt keeps only its last this many tokens (left truncation)."))
    cache_salt: NonEmptyStr | None = Field(None, description=(
        "vLLM's: requests with different salts (or one without) never share prefix-cache blocks."))
    return_token_ids: bool = Field(False, description=(
        "vLLM's: each choice also carries its output token ids (`token_ids`; streamed: each chunk's new ones) and "
        "the prompt's (`prompt_token_ids`: per choice for completions, on the response or its first chunk for chat)."))
    # Accepted for compatibility; they never change results.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Known but not implemented: only their no-op value passes (see _reject_unsupported).
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="1 or n (no-op values only).")
    # Output constraints (structured outputs); at most one per request.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    _structured = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _reject_lone_surrogates(cls, data: Any) -> Any:
        # JSON allows "\ud800" but it is not text: the tokenizer (and the response encoder)
        # would fail on it mid-request, so it is a 400 naming the field here.
        found = _lone_surrogate(data, [])
        if found is not None:
            param, index = found
            raise _field_error(param, f"{param} is not valid Unicode: a lone surrogate at character {index}")
        return data

    @model_validator(mode="after")
    def _check_values(self):
        max_name, max_tokens = self.output_limit()
        # A limit below 1 is itself the error; SamplingParams reports it under its own name.
        if max_tokens is not None and max_tokens >= 1 and self.min_tokens > max_tokens:
            raise _field_error("min_tokens", f"min_tokens ({self.min_tokens}) must be <= {max_name} ({max_tokens})")
        return self

    def output_limit(self) -> tuple[str, int | None]:
        """The field that caps the output length, and its value."""
        return "max_tokens", self.max_tokens

    @model_validator(mode="after")
    def _reject_unsupported(self):
        if self.best_of not in (None, 1, self.n):
            raise _field_error("best_of", "best_of other than n is not supported")
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "stream_options is only allowed with stream=true")
        return self

    @model_validator(mode="after")
    def _check_constraints(self):
        try:
            self._structured = structured_params(self)
        except ConstraintError as e:
            raise _field_error(e.param, str(e)) from None
        return self

    @model_validator(mode="after")
    def _check_logit_bias(self):
        for key, bias in (self.logit_bias or {}).items():
            if not re.fullmatch(r"[0-9]+", key):
                raise _field_error("logit_bias", f"logit_bias keys are token ids as decimal strings, got {key!r}")
            if not -100 <= bias <= 100:
                raise _field_error("logit_bias", f"logit_bias[{key}] = {bias} is outside [-100, 100]")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        choice: int) -> SamplingParams:
        """SamplingParams for choice `choice` of n: a seeded request gets seed + choice."""
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                seed=None if self.seed is None else (self.seed + choice) % SEED_LIMIT, max_tokens=max_tokens,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [], include_stop_str_in_output=self.include_stop_str_in_output,
                repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens, structured_outputs=self._structured,
                logit_bias={int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None,
                cache_salt=self.cache_salt, allowed_token_ids=self.allowed_token_ids,
            )
        except ValueError as e:
            raise sampling_error(e) from None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description=_MAX_TOKENS_DOC)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Needs logprobs=true.")
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _field_error("top_logprobs", "top_logprobs needs logprobs=true")
        return self

    @property
    def image_urls(self) -> list[str]:
        """Every image part's URL, in message order (the order their placeholders take in the prompt)."""
        return [url for m in self.messages for url in m.image_urls]

    def output_limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().output_limit()

    def to_sampling_params(self, choice: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.max_completion_tokens is None:
            return self.sampling_params(self.max_tokens, logprobs, None, choice)
        try:
            return self.sampling_params(self.max_completion_tokens, logprobs, None, choice)
        except APIError as e:
            if e.param == "max_tokens":
                e.param = "max_completion_tokens"
            raise


class CompletionRequest(_SamplingRequest):
    prompt: NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | NonEmptyTokenIds \
        | Annotated[list[NonEmptyTokenIds], Field(min_length=1)] = Field(
            description="A text, texts, token ids (each below the model's vocabulary size) or lists of them.")
    max_tokens: int | None = Field(16, ge=1, description=_MAX_TOKENS_DOC)  # the OpenAI default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise _field_error("suffix", "suffix is not supported")
        return self

    def _prompt_list(self) -> list:
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a token-id list."""
        return self._prompt_list()

    def to_sampling_params(self, choice: int) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs, choice)


class _FieldError(ValueError):
    """Raised inside validators; pydantic turns it into a validation error at `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _field_error(param: str, message: str) -> _FieldError:
    return _FieldError(param, message)


def _lone_surrogate(value: Any, path: list[str]) -> tuple[str, int] | None:
    """(dotted path, character index) of the first string in a JSON value holding a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return ".".join(path) or "body", e.start
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(key, path) if isinstance(key, str) else None  # a bad key: reported at its parent
        if found is None:
            found = _lone_surrogate(item, [*path, str(key)])
        if found is not None:
            return found
    return None


def validation_error_to_api_error(errors: list[dict]) -> APIError:
    """The first pydantic/FastAPI validation error as a 400 with `param` set."""
    if not errors:
        return APIError("invalid request")
    err = _most_specific(errors)
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    ctx_error = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _FieldError):
        return APIError(str(ctx_error), param=ctx_error.param)
    if err.get("type") == "json_invalid":
        return APIError(f"invalid JSON body: {err.get('msg', '')}".rstrip(": "))
    if err.get("type") == "extra_forbidden":
        return APIError(f"unsupported field '{'.'.join(loc)}'", param=".".join(loc) or None)
    if err.get("type") == "missing" and not loc:
        return APIError("the request body is missing; send a JSON object")
    param = ".".join(_first_field(loc))
    if err.get("type") == "greater_than_equal" and any("constrained-int" in p for p in loc):
        return APIError(f"{param}: token ids must be integers >= 0; got {err.get('input')!r}", param=loc[0])
    expected = _expected_range(err)
    if expected is not None:
        return APIError(f"invalid '{param}': expected {expected}", param=param or None)
    return APIError(f"{param or 'body'}: {err.get('msg', 'invalid value')}", param=param or None)


_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")}


def _expected_range(err: dict) -> str | None:
    """What a value-range error expected, in the words of the OpenAPI document's bounds."""
    kind, ctx, value = err.get("type"), err.get("ctx") or {}, err.get("input")
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        return f"a value {op} {_number(ctx.get(key))}, got {_number(value)}"
    if kind == "string_too_short":
        return "a non-empty string" if ctx.get("min_length") == 1 else f"at least {ctx.get('min_length')} characters"
    if kind == "too_short":
        n = ctx.get("min_length")
        return f"at least {n} item{'' if n == 1 else 's'}, got {len(value) if value else 'an empty list'}"
    if kind == "finite_number":
        return f"a finite number, got {value}"
    return None


def _number(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _most_specific(errors: list[dict]) -> dict:
    """For a union field (prompt: text or token ids), pydantic reports every branch; a branch
    whose shape matched but whose value broke a constraint (a negative token id) says more than
    "Input should be a valid string" from the first branch."""
    first = errors[0]
    field = [p for p in first.get("loc", ()) if p != "body"][:1]
    for err in errors:
        same_field = [p for p in err.get("loc", ()) if p != "body"][:1] == field
        if same_field and not err.get("type", "").endswith("_type"):
            return err
    return first


def _first_field(loc: list[str]) -> list[str]:
    """Drop pydantic's union-branch names (`str`, `list[int]`, ...) from an error location."""
    return [p for p in loc if not (p in ("str", "int") or "[" in p or p.startswith(("function-", "constrained-")))]
