"""GrammarManager: the engine core's grammar matchers, one per structured-output request.

Why the core: the matcher must see every sampled token before it can say which tokens may come
next, and the core is where sampled tokens become known (after a step resolves). A request with
a grammar therefore samples one token per step (no multi-step window: SamplingParams.
allows_multi_step), and the core resolves the step in flight before it launches the next one
while such a request runs (EngineCore._needs_known_tokens). Requests without a grammar create
nothing here and the step carries no bitmask.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np

from atom_core.structured.params import JSON_ANY_WHITESPACE, JSON_OBJECT, StructuredOutputsParams, choice_ebnf

logger = logging.getLogger(__name__)


class GrammarManager:
    """Contract: `add` before the request is scheduled (compiles; ValueError for a bad
    constraint); `bitmask_rows` for each step's sampling entries whose tokens are all known;
    `accept` with each request's resolved tokens (returns the ids whose grammar has ended);
    `remove` when a request ends. Single-threaded (the core's thread)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(set(stop_token_ids)))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self.matchers: dict[str, object] = {}
        self._compiled: dict[tuple[str, str], object] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.matchers

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def compile(self, params: StructuredOutputsParams):
        key = params.cache_key()
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(params)
            if len(self._compiled) >= 256:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = compiled
        return compiled

    def _compile(self, params: StructuredOutputsParams):
        kind, compiler = params.kind, self.compiler
        try:
            if kind == "json":
                import json

                return compiler.compile_json_schema(json.dumps(params.json), any_whitespace=JSON_ANY_WHITESPACE)
            if kind == "json_object":
                return compiler.compile_json_schema(JSON_OBJECT, any_whitespace=JSON_ANY_WHITESPACE, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(params.choice))
            return compiler.compile_grammar(params.grammar)
        except RuntimeError as e:
            raise ValueError(f"invalid structured output {kind}: {e}") from None

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        self.matchers[request_id] = self._xgr.GrammarMatcher(self.compile(params))

    def remove(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)

    def bitmask_rows(self, request_ids: list[str]) -> np.ndarray:
        """[len(request_ids), ceil(V / 32)] int32: bit j of word w allows token 32 w + j."""
        bitmask = self._xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        for row, rid in enumerate(request_ids):
            self.matchers[rid].fill_next_token_bitmask(bitmask, row)
        return bitmask.numpy()

    def accept(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance the request's matcher; True when its grammar has ended (the output is complete)."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return False
        for token in token_ids:
            if not matcher.accept_token(token):
                # Only reachable when something else removed every allowed token (a bug): end the
                # request rather than sample from a grammar state that no longer matches.
                logger.error("request %s: sampled token %d is outside its grammar; ending it", request_id, token)
                return True
        return matcher.is_terminated()
