"""One choice's output as ordered blocks (reasoning, text, tool calls), for the APIs that stream
items rather than chat deltas: OpenAI Responses (output items) and Anthropic Messages (content
blocks).

The blocks are built from the same assistant-message deltas the chat endpoint streams
(ChatOutputParser: `reasoning_content`, `content`, `tool_calls`), so every parser, grammar and
stop-string rule of chat applies unchanged. A block opens when output of another kind starts
and closes when the next one opens or the output ends; the non-streamed answer feeds the whole
message as one delta, so both ways give the same blocks.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from atom_core.engine.output_processor import RequestState
from atom_core.server.serving import EngineRequest

BlockKind = Literal["reasoning", "text", "tool_call"]


@dataclass
class Block:
    kind: BlockKind
    index: int  # position among the choice's blocks
    text: str = ""  # the reasoning, the text, or the call's arguments (JSON text)
    call_id: str = ""
    name: str = ""
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)  # names the block's item across events


class BlockEvent(NamedTuple):
    kind: Literal["open", "delta", "close"]
    block: Block
    delta: str = ""


def message_delta(sub: EngineRequest, state: RequestState) -> dict:
    """The assistant-message delta of one update (the chat stream's, without logprobs)."""
    text, _ = state.take_delta()
    if sub.output is not None:  # the text released so far (stop strings held back), parsed
        return sub.output.delta(state.text[: state.sent_chars], state.finished)
    return {"content": text} if text else {}


def final_message_delta(sub: EngineRequest, state: RequestState) -> dict:
    """A finished choice's whole message as one delta (the non-streamed answer)."""
    if sub.output is not None:
        return sub.output.delta(state.text, True)
    return {"content": state.text} if state.text else {}


class OutputBlocks:
    """Contract: `feed(delta)` with each message delta of one choice, in order, then `close()`
    once; each returns the events it caused. `blocks` holds every block so far, in order."""

    def __init__(self):
        self.blocks: list[Block] = []
        self._open: Block | None = None
        self._calls: dict[int, Block] = {}  # tool_calls index -> its block

    def feed(self, delta: dict) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        for kind, key in (("reasoning", "reasoning_content"), ("text", "content")):
            if delta.get(key):
                if self._open is None or self._open.kind != kind:
                    events += self._start(Block(kind, len(self.blocks)))
                self._open.text += delta[key]
                events.append(BlockEvent("delta", self._open, delta[key]))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if "id" in call:  # a call's first delta carries its id and name
                events += self._start(Block("tool_call", len(self.blocks), call_id=call["id"],
                                            name=function.get("name") or ""))
                self._calls[call["index"]] = self._open
            block = self._calls[call["index"]]
            assert block is self._open, "argument deltas continue the call that is open"
            if function.get("arguments"):
                block.text += function["arguments"]
                events.append(BlockEvent("delta", block, function["arguments"]))
        return events

    def close(self) -> list[BlockEvent]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [BlockEvent("close", block)]

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self.close()
        self.blocks.append(block)
        self._open = block
        return [*events, BlockEvent("open", block)]


def blocks_of(delta: dict) -> list[Block]:
    """The blocks of a whole message (non-streamed)."""
    out = OutputBlocks()
    out.feed(delta)
    out.close()
    return out.blocks
