"""What a request's output must match: a JSON schema, any JSON object, a regex, one of a list
of strings, or an EBNF grammar (exactly one of them)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one field is set. `json` is a JSON schema (a dict or its JSON text); the output is
    one JSON value that satisfies it (strict: no properties the schema does not name). `choice`
    is a list of non-empty strings the output must equal one of. ValueError (naming the field)
    when the constraint cannot be compiled; that check needs no tokenizer."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_fields = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(set_fields) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except json.JSONDecodeError as e:
                raise ValueError(f"invalid structured output json: the schema is not JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("invalid structured output json: the schema must be a JSON object")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("invalid structured output choice: it must be a non-empty list of non-empty strings")
        self.grammar_spec()  # compile-checks the constraint (without a tokenizer)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        kind = self.kind
        value: Any = getattr(self, kind)
        return kind, json.dumps(value, sort_keys=True) if not isinstance(value, str) else value

    def grammar_spec(self):
        """The constraint as an `xgrammar.Grammar` (raises ValueError naming the field)."""
        import xgrammar as xgr

        kind = self.kind
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(json.dumps(self.json), any_whitespace=JSON_ANY_WHITESPACE)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema(JSON_OBJECT, any_whitespace=JSON_ANY_WHITESPACE, strict_mode=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_ebnf(self.choice))
            return xgr.Grammar.from_ebnf(self.grammar)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as RuntimeError
            raise ValueError(f"invalid structured output {kind}: {_short(e)}") from None


# Compact JSON (no free whitespace between tokens). With free whitespace a small or unsure
# model can emit spaces and newlines until max_tokens; the values are the same JSON either way.
JSON_ANY_WHITESPACE = False
JSON_OBJECT = '{"type": "object"}'  # json_object: any object (compiled non-strict, so with any keys)


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _short(e: Exception) -> str:
    """xgrammar's messages start with a C++ source location: keep the part a client can act on."""
    text = str(e).strip()
    head, sep, tail = text.partition(": ")
    return tail if sep and (".cc:" in head or ".h:" in head) else text
