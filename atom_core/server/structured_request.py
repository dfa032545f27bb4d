"""The request fields that constrain decoding: OpenAI's `response_format`, vLLM's `guided_*`
extras and their `structured_outputs` form, and chat `tools` with `tool_choice`.

`tool_choice: "required"` and a named function are kept by a grammar, as vLLM does: the output
is a JSON array of {"name", "parameters"} objects (required) or the named function's arguments
object, whatever tool-call format the model was trained on. That JSON is parsed directly
(chat_output.py: `required_calls`, the named mode), never by the server's --tool-call-parser, so
a forced call reads the same under every parser.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from atom_core.structured import StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # always enforced: the output follows the schema exactly


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` body field (exactly one of these)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)] | None = None
    grammar: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict, ... reach the chat template as they came

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ConstraintError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def structured_params(req) -> StructuredOutputsParams | None:
    """The one decoding constraint a request asks for (None: none). ConstraintError names the
    field when the request asks for two, or when a schema / regex / grammar does not compile."""
    found: list[tuple[str, dict]] = []
    rf: ResponseFormat | None = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise ConstraintError("response_format", "response_format of type json_schema needs json_schema.schema")
        found.append(("response_format", {"json": rf.json_schema.json_schema}))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            found.append((field, {kind: value}))
    so: StructuredOutputsRequest | None = req.structured_outputs
    if so is not None:
        kwargs = {"json": so.json_, "json_object": bool(so.json_object), "regex": so.regex, "choice": so.choice,
                  "grammar": so.grammar}
        found.append(("structured_outputs", {k: v for k, v in kwargs.items() if v not in (None, False)}))
    found += tool_constraint(req)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ConstraintError(found[1][0], f"only one output constraint per request; got {names}")
    param, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise ConstraintError(param, f"{param}: {e}") from None


def tool_constraint(req) -> list[tuple[str, dict]]:
    """The grammar that `tool_choice: required` or a named function needs ([] for auto / none)."""
    choice = getattr(req, "tool_choice", None)
    tools = getattr(req, "tools", None) or []
    if choice not in (None, "none", "auto") and not tools:  # auto without tools: nothing to call
        raise ConstraintError("tool_choice", f"tool_choice {_choice_name(choice)} needs tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ConstraintError("tools", "tool function names must be unique")
    if isinstance(choice, NamedToolChoice):
        tool = named_tool(tools, choice.function.name)
        return [("tool_choice", {"json": parameters_schema(tool)})]
    if choice == "required":
        items = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": parameters_schema(t)},
                  "required": ["name", "parameters"]} for t in tools]
        schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if getattr(req, "parallel_tool_calls", None) is False:
            schema["maxItems"] = 1
        return [("tool_choice", {"json": schema})]
    return []


def _choice_name(choice) -> str:
    return f"'{choice}'" if isinstance(choice, str) else f"naming '{choice.function.name}'"


def named_tool(tools: list[ChatTool], name: str) -> ChatTool:
    for tool in tools:
        if tool.function.name == name:
            return tool
    raise ConstraintError("tool_choice", f"tool_choice names the function '{name}', which is not in tools")


def parameters_schema(tool: ChatTool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def parse_required_output(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) per call of a `tool_choice: required` output; None if incomplete."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
