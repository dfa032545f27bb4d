"""The OpenAI Responses API's request (POST /v1/responses), as the OpenAI Python SDK sends it,
and its translation into chat messages.

Strict as the chat models are: an unknown field is a 400 naming it. Input items are messages
(text parts), function calls and their outputs, and reasoning items (an earlier response's
output sent back); a reasoning item's text goes to the next assistant turn as
`reasoning_content`, which chat templates that keep reasoning render.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from atom_core.server.protocol import NonEmptyStr


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class _Replayed(_Strict):
    """An item a client may send back from an earlier response as the SDK dumps it: the output
    fields this server never sets (`caller`, `namespace`, `phase`, ...) arrive as null, which is
    their no-op value; set to anything else they are a 400 as any unknown field."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class TextPart(_Replayed):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # on output_text sent back from an earlier response
    logprobs: list[Any] | None = None


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(_Replayed):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Replayed):
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Replayed):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None


class ReasoningText(_Replayed):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Replayed):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    status: str | None = None


def _item_type(value: Any) -> str:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", "message")


InputItem = Annotated[Union[
    Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
    Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")],
], Discriminator(_item_type)]
_ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(_Strict):
    type: Literal["function"]
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the call's arguments always follow `parameters` when a grammar forces them

    def as_chat(self) -> dict:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: NonEmptyStr


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # always enforced


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: NonEmptyStr | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, description="The prompt's tokens plus this must fit the "
                                          "model's context (else 400 context_length_exceeded).")
    temperature: float | None = Field(None, ge=0, description="0 is greedy.")
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None  # the context is never cut: too long is a 400
    # Accepted for compatibility; they never change results.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key
    service_tier: str | None = None

    def input_messages(self) -> list[dict]:
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        return chat_messages(items)

    def chat_body(self, history: list[dict]) -> dict:
        """The equivalent chat request's body, after `history` (an earlier response's conversation)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict = {"model": self.model, "messages": system + history + self.input_messages(),
                      "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                      "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls}
        if self.tools:
            body["tools"] = [tool.as_chat() for tool in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        return {k: v for k, v in body.items() if v is not None}

    def echo(self) -> dict:
        """The request's settings as a Response object repeats them."""
        tool_choice = self.tool_choice or ("auto" if self.tools else "none")
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": self.previous_response_id, "background": self.background,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or []],
                "truncation": "disabled", "metadata": self.metadata or {}, "user": self.user}


# Chat-request fields as this API names them (for the errors the chat path finds).
CHAT_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
              "response_format": "text.format"}


def chat_messages(items: list) -> list[dict]:
    """Input items -> chat messages: consecutive function calls join the assistant turn before them."""
    messages: list[dict] = []
    reasoning = ""
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning += "".join(part.text for part in item.content or item.summary)
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            continue
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        else:
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if not messages or messages[-1]["role"] != "assistant":
                # "" rather than None: templates concatenate content (the tool calls render apart)
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call)
        if messages[-1]["role"] == "assistant" and reasoning:
            messages[-1]["reasoning_content"], reasoning = reasoning, ""
    return messages


def output_messages(output: list[dict]) -> list[dict]:
    """A Response's output items as the assistant turn of the conversation (for previous_response_id)."""
    return chat_messages(_ITEMS.validate_python(output))
