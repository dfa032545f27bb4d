"""The OpenAI Responses API: POST /v1/responses, GET / DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel.

A request becomes a chat request (responses_protocol.py) served by the chat path; its output
(reasoning, text, function calls) becomes output items through OutputBlocks, streamed as the
Responses events (each with its `sequence_number`). Responses with `store` (the default) are
kept in a bounded in-memory LRU (`RESPONSES_STORE_SIZE`), for GET and `previous_response_id`,
which continues that response's conversation (its instructions are not carried over, as
OpenAI does). `background: true` answers at once and runs on; GET polls it, cancel aborts it.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from atom_core.engine.async_engine import EngineDeadError
from atom_core.engine.output_processor import RequestState
from atom_core.server.chat_translation import chat_engine_requests, chat_request
from atom_core.server.output_blocks import Block, BlockEvent, OutputBlocks, blocks_of, final_message_delta, message_delta
from atom_core.server.protocol import APIError
from atom_core.server.responses_protocol import CHAT_NAMES, ResponsesRequest, output_messages
from atom_core.server.serving import _JSON, SSE_HEADERS, EngineRequest, OpenAIServing, engine_error

RESPONSES_STORE_SIZE = 512  # stored responses kept for GET and previous_response_id; the oldest goes first
_ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


@dataclass
class StoredResponse:
    response: dict  # the Response object
    messages: list[dict] | None  # its conversation without instructions (None while in progress)


class ResponseStore:
    """An LRU of stored responses: reading one makes it the newest; past `capacity` the oldest goes."""

    def __init__(self, capacity: int = RESPONSES_STORE_SIZE):
        if capacity < 1:
            raise ValueError(f"invalid responses store size {capacity}; expected >= 1")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(f"no stored response with id '{response_id}' (responses are kept in memory, the latest "
                           f"{self.capacity}, when created with store=true)", 404, "not_found_error", param=param,
                           code="response_not_found")
        self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> StoredResponse:
        entry = self.get(response_id)
        del self._entries[response_id]
        return entry

    def __len__(self) -> int:
        return len(self._entries)


class ResponsesServing:
    """The Responses endpoints over OpenAIServing (runs on the event loop only)."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore | None = None):
        self.serving = serving
        self.store = store or ResponseStore()
        self._background: dict[str, asyncio.Task] = {}

    def close(self) -> None:
        for task in self._background.values():
            task.cancel()

    async def create(self, req: ResponsesRequest, raw: Request):
        if req.background and not req.store:
            raise APIError("background responses need store=true (they are read back with GET)", param="background")
        if req.background and req.stream:
            raise APIError("background responses cannot stream; poll GET /v1/responses/{id}", param="stream")
        history = self._history(req.previous_response_id)
        chat = chat_request(req.chat_body(history), CHAT_NAMES)
        subs = await chat_engine_requests(self.serving, chat, raw, CHAT_NAMES)
        turn = _Turn(f"resp_{uuid.uuid4().hex}", req, history, int(time.time()), self.serving.served_name(subs[0]))
        if req.stream:
            return StreamingResponse(self._events(turn, subs), media_type="text/event-stream", headers=SSE_HEADERS)
        if req.background:
            self.store.put(turn.id, StoredResponse(self._response(turn, "in_progress", []), None))
            self._background[turn.id] = asyncio.create_task(self._run_in_background(turn, subs))
            return JSONResponse(self.store.get(turn.id).response)
        [state] = await self.serving.run_to_end(raw, subs)
        return JSONResponse(self._finish(turn, subs[0], state, blocks_of(final_message_delta(subs[0], state))))

    def retrieve(self, response_id: str) -> dict:
        return self.store.get(response_id).response

    async def cancel(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        task = self._background.get(response_id)
        if task is None:
            raise APIError(f"response '{response_id}' is {entry.response['status']}; only a background response "
                           "in progress can be cancelled", param="response_id")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return self.store.get(response_id).response

    async def delete(self, response_id: str) -> dict:
        self.store.get(response_id)
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.store.pop(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # ---- running ----------------------------------------------------------------------
    def _history(self, previous_id: str | None) -> list[dict]:
        if previous_id is None:
            return []
        entry = self.store.get(previous_id, param="previous_response_id")
        if entry.messages is None:
            raise APIError(f"response '{previous_id}' is still in progress", param="previous_response_id")
        return entry.messages

    async def _run_in_background(self, turn: _Turn, subs: list[EngineRequest]) -> None:
        try:
            [state] = await self.serving._run(subs)
            self._finish(turn, subs[0], state, blocks_of(final_message_delta(subs[0], state)))
        except asyncio.CancelledError:
            self._store(turn, self._response(turn, "cancelled", []), [])
        except APIError as e:
            self._store(turn, self._failed(turn, e), [])
        finally:
            self._background.pop(turn.id, None)

    async def _events(self, turn: _Turn, subs: list[EngineRequest]) -> AsyncIterator[str]:
        events = _Events()
        start = self._response(turn, "in_progress", [])
        yield events.sse("response.created", response=start)
        yield events.sse("response.in_progress", response=start)
        blocks, sub, state = OutputBlocks(), subs[0], None
        try:
            async with aclosing(self.serving._merged(subs)) as updates:
                async for _, state in updates:
                    for event in blocks.feed(message_delta(sub, state)):
                        for out in events.block(event):
                            yield out
            for event in blocks.close():
                for out in events.block(event):
                    yield out
            done = self._finish(turn, sub, state, blocks.blocks)
            yield events.sse("response.completed" if done["status"] == "completed" else "response.incomplete",
                             response=done)
        except (EngineDeadError, ValueError) as e:  # after the 200: the error travels in the stream
            err = engine_error(e)
            yield events.sse("error", code=err.code or err.type, message=err.message, param=err.param)
            yield events.sse("response.failed", response=self._failed(turn, err))

    # ---- response shapes --------------------------------------------------------------
    def _response(self, turn: _Turn, status: str, output: list[dict], **fields) -> dict:
        return {"id": turn.id, "object": "response", "created_at": turn.created, "status": status,
                "model": turn.model, "output": output, "error": None, "incomplete_details": None,
                "usage": None, **turn.req.echo(), **fields}

    def _failed(self, turn: _Turn, err: APIError) -> dict:
        return self._response(turn, "failed", [], error={"code": "server_error", "message": err.message})

    def _finish(self, turn: _Turn, sub: EngineRequest, state: RequestState, blocks: list[Block]) -> dict:
        """The finished Response (stored when asked): its status, output items and usage."""
        status = {"length": "incomplete", "abort": "cancelled"}.get(state.finish_reason, "completed")
        output = [output_item(b, _item_id(b), "incomplete" if status == "incomplete" else "completed") for b in blocks]
        usage = self.serving._usage([sub], [state])
        reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
        num_reasoning = len(self.serving.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        response = self._response(
            turn, status, output, completed_at=int(time.time()),
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            usage={"input_tokens": usage["prompt_tokens"],
                   "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                   "output_tokens": usage["completion_tokens"],
                   "output_tokens_details": {"reasoning_tokens": num_reasoning},
                   "total_tokens": usage["total_tokens"]})
        self._store(turn, response, output_messages(output))
        return response

    def _store(self, turn: _Turn, response: dict, turn_messages: list[dict]) -> None:
        if turn.req.store:
            self.store.put(turn.id, StoredResponse(response, turn.history + turn.req.input_messages() + turn_messages))


@dataclass
class _Turn:
    id: str
    req: ResponsesRequest
    history: list[dict]
    created: int
    model: str  # the name the response gives: the adapter the request ran with, or the base model


def _item_id(block: Block) -> str:
    return f"{_ITEM_PREFIX[block.kind]}_{block.uid}"


def output_item(block: Block, item_id: str, status: str) -> dict:
    if block.kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": block.text}]}
    if block.kind == "text":
        return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                "content": [_part(block)]}
    return {"id": item_id, "type": "function_call", "call_id": block.call_id, "name": block.name,
            "arguments": block.text, "status": status}


def _part(block: Block) -> dict:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": block.text}
    return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}


class _Events:
    """One stream's SSE events, numbered."""

    _DELTA = {"reasoning": "response.reasoning_text.delta", "text": "response.output_text.delta",
              "tool_call": "response.function_call_arguments.delta"}

    def __init__(self):
        self.sequence_number = 0

    def sse(self, type: str, **fields) -> str:
        payload = _JSON.encode({"type": type, "sequence_number": self.sequence_number, **fields})
        self.sequence_number += 1
        return f"event: {type}\ndata: {payload}\n\n"

    def block(self, event: BlockEvent) -> list[str]:
        block, item_id = event.block, _item_id(event.block)
        at = {"output_index": block.index}
        part = {"item_id": item_id, **at, "content_index": 0}
        if event.kind == "open":
            out = [self.sse("response.output_item.added", **at, item=output_item(block, item_id, "in_progress")
                            | ({"content": []} if block.kind != "tool_call" else {}))]
            if block.kind != "tool_call":
                out.append(self.sse("response.content_part.added", **part, part=_part(Block(block.kind, 0))))
            return out
        if event.kind == "delta":
            extra = {} if block.kind == "tool_call" else {"content_index": 0}
            extra |= {"logprobs": []} if block.kind == "text" else {}
            return [self.sse(self._DELTA[block.kind], item_id=item_id, **at, **extra, delta=event.delta)]
        if block.kind == "tool_call":
            out = [self.sse("response.function_call_arguments.done", item_id=item_id, **at, name=block.name,
                            arguments=block.text)]
        else:
            done = "response.reasoning_text.done" if block.kind == "reasoning" else "response.output_text.done"
            extra = {"logprobs": []} if block.kind == "text" else {}
            out = [self.sse(done, **part, **extra, text=block.text),
                   self.sse("response.content_part.done", **part, part=_part(block))]
        return out + [self.sse("response.output_item.done", **at, item=output_item(block, item_id, "completed"))]


def add_responses_routes(router: APIRouter, responses: ResponsesServing) -> None:
    @router.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        return await responses.create(req, raw)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False):
        if stream:
            raise APIError("streaming a stored response again is not supported; GET it without stream", param="stream")
        return responses.retrieve(response_id)

    router.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])
    router.add_api_route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"])
