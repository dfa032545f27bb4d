"""The OpenAI endpoints' work: request -> engine requests -> OpenAI responses or SSE chunks.

One HTTP request becomes `len(prompts) * n` engine requests (choice index = prompt * n + j).
All of them are validated before any is queued, so a bad request never leaves work behind.
A client that goes away cancels the handler; closing the engine generators aborts their
requests in the core, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from atom_core.engine.async_engine import AsyncEngine, EngineDeadError
from atom_core.engine.output_processor import RequestState
from atom_core.lora import LoRARegistry, LoRARequest
from atom_core.multimodal.inputs import MultimodalItem
from atom_core.multimodal.processors import build_image_processor
from atom_core.sampling_params import SamplingParams
from atom_core.server.chat_output import ChatOptions, ChatOutputParser
from atom_core.server.logprobs import LogprobFormatter
from atom_core.server.media import MediaFetcher, MediaOptions
from atom_core.server.metrics import ServerMetrics
from atom_core.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body, sampling_error
from atom_core.server.tokenizer_pool import TokenizerPool

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class EngineRequest:
    """One choice of one prompt, as sent to the engine."""

    index: int  # the choice index in the response
    prompt_index: int
    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams
    output: ChatOutputParser | None = None  # chat: reasoning / tool-call parsing of the text
    arrival_time: float | None = None  # the HTTP request's (perf_counter), stamped by RequestGuard
    mm_items: tuple[MultimodalItem, ...] = ()  # its images (placeholders already in prompt_ids)


_JSON = json.JSONEncoder(separators=(",", ":"))


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else _JSON.encode(data)}\n\n"


class ChoiceEvents:
    """SSE events of one stream that carry one choice each: the envelope (id, object, created,
    model; `choices` last) is encoded once, each event encodes only its choice. The bytes equal
    `sse(head | {"choices": [choice]})`'s, at about half the cost per token."""

    def __init__(self, head: dict):
        encoded = _JSON.encode(head | {"choices": []})
        assert encoded.endswith('"choices":[]}'), "the envelope must end with its choices"
        self._prefix = "data: " + encoded[:-2]

    def event(self, choice: dict) -> str:
        return f"{self._prefix}{_JSON.encode(choice)}]}}\n\n"


def engine_error(e: Exception) -> APIError:
    if isinstance(e, EngineDeadError):  # engine_dead, or server_shutting_down
        return APIError(str(e), 503, "server_error", code=e.code)
    if isinstance(e, ValueError):
        return APIError(str(e))
    return APIError(f"internal error: {type(e).__name__}: {e}", 500, "server_error")


class OpenAIServing:
    """Chat and text completions over an AsyncEngine (runs on the event loop only)."""

    def __init__(self, engine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 chat_options: ChatOptions | None = None, loras: LoRARegistry | None = None,
                 media: MediaOptions | None = None):
        self.chat_options = chat_options or ChatOptions()
        self.media = MediaFetcher(media or MediaOptions())
        info = getattr(engine, "info", None)  # a vision-language model's processor (None: text only)
        self.image_processor = (build_image_processor(engine.model_path, engine.tokenizer)
                                if info is not None and info.max_image_tokens else None)
        self.loras = loras  # the LoRA adapters requests may name as their model (None: --enable-lora off)
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer  # the event loop's (decoding); the pool has its own copies
        self.logprobs = LogprobFormatter(engine.tokenizer)
        # Chat templates and tokenization run off the event loop, on a few threads: a huge prompt
        # must neither stall /health and the streams nor delay other requests' tokenization.
        self.tokenizer_pool = TokenizerPool(engine.tokenizer)
        # Called after a state's chunk went out (the send returned): sampling-to-write timing in the
        # API-overhead benchmark (bench/api_overhead_server.py); None costs one test per chunk.
        self.on_chunk_written: Callable[[RequestState], None] | None = None

    def close(self) -> None:
        self.tokenizer_pool.shutdown()

    # ---- endpoints --------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        subs = await self.chat_engine_requests(req, raw)
        return await self._respond(req, raw, subs, "chat.completion", self._chat_chunks, self._chat_choice)

    async def chat_engine_requests(self, req: ChatCompletionRequest, raw: Request) -> list[EngineRequest]:
        """A chat request's engine requests: model checked, tokenized, validated, with their output
        parsers; nothing queued yet. The Responses and Anthropic Messages endpoints translate
        their requests into a ChatCompletionRequest and come through here too."""
        self._check_model(req.model)
        urls = req.image_urls
        if not urls:
            text, ids = await self.tokenizer_pool.run(self._tokenize_chat, req)
            subs = _stamped(self._engine_requests("chatcmpl", req, [(text, ids)]), raw)
        else:
            text, ids, items = await self._chat_with_images(req, urls)
            subs = _stamped(self._engine_requests("chatcmpl", req, [(text, ids)], items), raw)
        self._add_output_parsers(req, subs)
        return subs

    async def _chat_with_images(self, req: ChatCompletionRequest, urls: list[str]):
        """Fetch (API process, with limits), template, then decode and preprocess on a tokenizer thread."""
        processor = self.image_processor
        if processor is None:
            raise APIError(f"the model '{self.model_name}' takes no images; send text content only",
                           param="messages", code="images_not_supported")
        images = await self.media.fetch_all(urls)
        text, ids = await self.tokenizer_pool.run(self._tokenize_chat, req, image_part=processor.template_part)
        try:
            ids, items = await self.tokenizer_pool.run(lambda _tok: processor.process(ids, images))
        except ValueError as e:
            raise APIError(str(e), param="messages", code="invalid_image") from None
        return text, ids, items

    async def run_to_end(self, raw: Request, subs: list[EngineRequest]) -> list[RequestState]:
        """The finished states of `subs`; a client that leaves first aborts them (499)."""
        return await _unless_disconnected(raw, self._run(subs))

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        prompts = await self.tokenizer_pool.run(lambda tok: [_completion_prompt(tok, p) for p in req.prompts])
        subs = _stamped(self._engine_requests("cmpl", req, prompts), raw)
        return await self._respond(req, raw, subs, "text_completion", self._completion_chunks, self._completion_choice)

    async def _respond(self, req, raw: Request, subs: list, object_name: str, chunks, choice) -> Response:
        """Both endpoints' answer to their engine requests: an SSE stream of `chunks`, or, once all
        have finished, one JSON body of an `object_name` envelope with a `choice` each and the usage."""
        response_id = subs[0].request_id.rsplit("-", 1)[0]
        if req.stream:
            return self._stream(chunks(response_id, req, subs))
        states = await self.run_to_end(raw, subs)
        choices = [choice(sub, state, req) for sub, state in zip(subs, states)]
        envelope = self._envelope(response_id, object_name, choices, self.served_name(subs[0]))
        if req.return_token_ids and object_name == "chat.completion":  # one prompt: vLLM puts its ids on the response
            envelope["prompt_token_ids"] = subs[0].prompt_ids
        return JSONResponse(envelope | {"usage": self._usage(subs, states)})

    # ---- requests ---------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        self.lookup_model(model)

    def lookup_model(self, model: str | None) -> LoRARequest | None:
        """What a request's `model` names: None for the base model (or no name), the adapter's
        LoRARequest for a loaded LoRA adapter; 404 for anything else, listing what is served."""
        if model is None or model == self.model_name:
            return None
        adapter = self.loras.get(model) if self.loras is not None else None
        if adapter is None:
            adapters = [r.lora_name for r in self.loras.requests] if self.loras is not None else []
            served = ", ".join(repr(m) for m in [self.model_name, *adapters])
            raise APIError(f"the model '{model}' does not exist; this server serves {served}",
                           404, param="model", code="model_not_found")
        return adapter

    def _add_output_parsers(self, req: ChatCompletionRequest, subs: list[EngineRequest]) -> None:
        for sub in subs:
            try:
                sub.output = self.chat_options.output_parser(req, sub.prompt_text or "")
            except ValueError as e:
                raise APIError(str(e), param="tool_choice") from None
            if self.chat_options.needs_special_tokens(sub.output):
                sub.params.skip_special_tokens = False  # the parser reads the format's special tokens

    @staticmethod
    def _tokenize_chat(tok, req: ChatCompletionRequest, add_special_tokens: bool = False,
                       image_part: dict | None = None) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a chat request; runs on a tokenizer thread. The template
        writes the special tokens itself, so by default encoding adds none (/tokenize may ask).
        image_part: what an image content part becomes for the template (the model's processor);
        None refuses image parts."""
        tok = _require_tokenizer(tok, "chat completions")
        if not getattr(tok, "chat_template", None):
            raise APIError("this model's tokenizer has no chat template; use /v1/completions")
        if image_part is None and req.image_urls:
            raise APIError("image content parts are served by /v1/chat/completions of a model that takes images",
                           param="messages", code="images_not_supported")
        try:
            text = tok.apply_chat_template([m.for_template(image_part) for m in req.messages], tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt,
                                           tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
                                           **(req.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception, bad kwargs) are the client's
            raise APIError(f"cannot apply the chat template: {type(e).__name__}: {e}", param="messages") from None
        return text, tok.encode(text, add_special_tokens=add_special_tokens)

    def _engine_requests(self, prefix: str, req, prompts: list[tuple[str | None, list[int]]],
                         mm_items: tuple = ()) -> list[EngineRequest]:
        """Build and validate every choice of every prompt; nothing is queued yet. mm_items: the
        (one) prompt's images."""
        try:
            self.engine.check_health()
        except EngineDeadError as e:
            raise engine_error(e) from None
        lora = self.lookup_model(getattr(req, "model", None))
        keep = getattr(req, "truncate_prompt_tokens", None)
        if keep is not None:
            prompts = [_left_truncated(text, ids, keep, bool(mm_items)) for text, ids in prompts]
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        subs = []
        for p, (text, ids) in enumerate(prompts):
            for j in range(req.n):
                index = p * req.n + j
                params = req.to_sampling_params(j)
                if lora is not None:
                    params = dataclasses.replace(params, lora_request=lora)
                try:
                    if mm_items:
                        self.engine.validate_request(ids, params, mm_items)
                    else:
                        self.engine.validate_request(ids, params)
                except ValueError as e:
                    raise self._invalid_request(e, prefix, ids, params, req.output_limit()[0]) from None
                subs.append(EngineRequest(index, p, f"{response_id}-{index}", text, ids, params, mm_items=mm_items))
        return subs

    def _invalid_request(self, e: ValueError, prefix: str, ids: list[int], params: SamplingParams,
                         limit_param: str) -> APIError:
        """A context overflow carries OpenAI's code, and names the output limit the client sent
        (max_tokens or max_completion_tokens) when that caused it."""
        prompt_param = "messages" if prefix == "chatcmpl" else "prompt"
        max_len = self.engine.info.max_model_len
        if len(ids) >= max_len:
            return APIError(str(e), param=prompt_param, code="context_length_exceeded")
        if params.max_tokens is not None and len(ids) + params.max_tokens > max_len:
            return APIError(str(e), param=limit_param, code="context_length_exceeded")
        named = sampling_error(e)  # a sampling parameter the core's check names (logit_bias ids past the vocabulary)
        return named if named.param is not None else APIError(str(e), param=prompt_param)

    # ---- running ----------------------------------------------------------------------
    async def _merged(self, subs: list[EngineRequest]) -> AsyncIterator[tuple[EngineRequest, RequestState]]:
        """Updates of all engine requests as they come; each finished state exactly once."""
        if len(subs) == 1:  # the common case: no task and queue between the engine and the stream
            async with aclosing(self._updates(subs[0])) as updates:
                async for state in updates:
                    yield subs[0], state
            return
        updates: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(sub, updates)) for sub in subs]
        done: set[int] = set()
        try:
            while len(done) < len(subs):
                sub, item = await updates.get()
                if isinstance(item, BaseException):
                    raise item
                if sub.index in done:
                    continue
                if item.finished:
                    done.add(sub.index)
                yield sub, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _pump(self, sub: EngineRequest, updates: asyncio.Queue) -> None:
        try:
            async with aclosing(self._updates(sub)) as gen:
                async for state in gen:
                    updates.put_nowait((sub, state))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which turns it into an error body
            updates.put_nowait((sub, e))

    async def _updates(self, sub: EngineRequest) -> AsyncIterator[RequestState]:
        """One engine request's states; closing early aborts it; its end is counted in the metrics."""
        state = None
        try:
            extra = {"mm_items": sub.mm_items} if sub.mm_items else {}
            async with aclosing(self.engine.generate(sub.request_id, sub.prompt_ids, sub.params, sub.prompt_text,
                                                  sub.arrival_time, **extra)) as gen:
                async for state in gen:
                    yield state
        finally:
            if state is not None:
                self.metrics.observe_finished(state, state.finish_reason if state.finished else "abort")

    async def _run(self, subs: list[EngineRequest]) -> list[RequestState]:
        final: dict[int, RequestState] = {}
        try:
            async for sub, state in self._merged(subs):
                if state.finished:
                    final[sub.index] = state
        except (EngineDeadError, ValueError) as e:
            raise engine_error(e) from None
        return [final[sub.index] for sub in subs]

    def _stream(self, chunks: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(_with_error_event(chunks), media_type="text/event-stream", headers=SSE_HEADERS)

    # ---- response shapes --------------------------------------------------------------
    def served_name(self, sub: EngineRequest) -> str:
        """The `model` a response names: the LoRA adapter its request ran with, else the base model
        (vLLM's echo; read from the request, so unloading the adapter meanwhile changes nothing)."""
        lora = sub.params.lora_request
        return self.model_name if lora is None else lora.lora_name

    @staticmethod
    def _envelope(response_id: str, obj: str, choices: list[dict], model: str) -> dict:
        return {"id": response_id, "object": obj, "created": int(time.time()), "model": model, "choices": choices}

    def _usage(self, subs: list[EngineRequest], states: list[RequestState]) -> dict:
        prompt_tokens = sum({sub.prompt_index: len(sub.prompt_ids) for sub in subs}.values())  # once per prompt
        completion_tokens = sum(len(s.token_ids) for s in states)
        n = max(len(states), 1)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in states)},
            "ttft_s": sum(s.ttft for s in states) / n,
            "tpot_s": sum(s.tpot for s in states) / n,
            "latency_s": sum(s.latency for s in states) / n,
        }

    def _chat_choice(self, sub: EngineRequest, state: RequestState, req: ChatCompletionRequest) -> dict:
        logprobs = None
        if req.logprobs:
            logprobs = {"content": self.logprobs.chat(state.token_ids, state.logprobs, req.top_logprobs or 0)}
        message = sub.output.message(state.text) if sub.output else {"role": "assistant", "content": state.text}
        choice = {"index": sub.index, "message": message, "logprobs": logprobs,
                  "finish_reason": _chat_finish_reason(sub, state), "stop_reason": self._stop_reason(sub, state)}
        if req.return_token_ids:
            choice["token_ids"] = list(state.token_ids)
        return choice

    def _completion_choice(self, sub: EngineRequest, state: RequestState, req: CompletionRequest) -> dict:
        text, ids, entries = state.text, list(state.token_ids), list(state.logprobs)
        if req.echo:
            text = self._prompt_text(sub) + text
            ids = sub.prompt_ids + ids
            entries = (state.prompt_logprobs or [None] * len(sub.prompt_ids)) + entries
        logprobs = self.logprobs.completion(ids, entries, 0)[0] if req.logprobs is not None else None
        choice = {"index": sub.index, "text": text, "logprobs": logprobs, "finish_reason": state.finish_reason,
                  "stop_reason": self._stop_reason(sub, state)}
        if req.return_token_ids:
            choice |= {"token_ids": list(state.token_ids), "prompt_token_ids": sub.prompt_ids}
        return choice

    def _stop_reason(self, sub: EngineRequest, state: RequestState) -> str | int | None:
        """vLLM's stop_reason: the stop string or stop token id that ended the choice; None when it ended
        otherwise (its length, or an end-of-sequence token the request did not list)."""
        reason = state.stop_reason
        if isinstance(reason, int) and (reason not in sub.params.stop_token_ids
                                        or (reason in self.engine.info.eos_token_ids and not sub.params.ignore_eos)):
            return None
        return reason

    def _prompt_text(self, sub: EngineRequest) -> str:
        if sub.prompt_text is not None:
            return sub.prompt_text
        return self.tokenizer.decode(sub.prompt_ids) if self.tokenizer is not None else ""

    # ---- streams ----------------------------------------------------------------------
    async def _chunks(self, response_id: str, obj: str, subs: list[EngineRequest],
                      choice_of: Callable[[EngineRequest, RequestState], dict | None], include_usage: bool,
                      opening: tuple[dict, ...] = (), first: dict | None = None) -> AsyncIterator[str]:
        """One stream's SSE events: the `opening` choices, then choice_of(sub, state) per update
        (None: nothing to send yet), the usage chunk when asked for, and [DONE]. `first`: fields of
        the first opening chunk's envelope (chat's prompt_token_ids)."""
        head = self._envelope(response_id, obj, [], self.served_name(subs[0]))
        events = ChoiceEvents(head)
        for i, choice in enumerate(opening):
            yield sse(head | first | {"choices": [choice]}) if i == 0 and first else events.event(choice)
        final = {}
        async for sub, state in self._merged(subs):
            choice = choice_of(sub, state)
            if choice is None:
                continue
            yield events.event(choice)
            if self.on_chunk_written is not None:
                self.on_chunk_written(state)
            if state.finished:
                final[sub.index] = state
        if include_usage:
            yield sse(head | {"choices": [], "usage": self._usage(subs, [final[s.index] for s in subs])})
        yield sse("[DONE]")

    def _chat_chunks(self, response_id: str, req: ChatCompletionRequest, subs: list[EngineRequest]) -> AsyncIterator[str]:
        opening = tuple({"index": sub.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None} for sub in subs)
        first = {"prompt_token_ids": subs[0].prompt_ids} if req.return_token_ids else None
        return self._chunks(response_id, "chat.completion.chunk", subs, partial(self._chat_delta, req),
                            req.include_usage, opening, first)

    def _chat_delta(self, req: ChatCompletionRequest, sub: EngineRequest, state: RequestState) -> dict | None:
        start = state.sent_tokens
        text, ids = state.take_delta()
        wants_ids = (req.logprobs or req.return_token_ids) and ids  # ids are sent even while their text is held back
        if not text and not state.finished and not wants_ids:
            return None
        logprobs = None
        if req.logprobs:
            entries = state.logprobs[start : start + len(ids)]
            logprobs = {"content": self.logprobs.chat(ids, entries, req.top_logprobs or 0)}
        if sub.output is not None:  # the text released so far (stop strings held back), parsed
            delta = sub.output.delta(state.text[: state.sent_chars], state.finished)
            if not delta and not state.finished and not wants_ids:
                return None  # all of it held back (a marker still arriving)
        else:
            delta = {"content": text} if text else {}
        choice = {"index": sub.index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": _chat_finish_reason(sub, state) if state.finished else None}
        if state.finished:
            choice["stop_reason"] = self._stop_reason(sub, state)
        if req.return_token_ids:
            choice["token_ids"] = ids
        return choice

    def _completion_chunks(self, response_id: str, req: CompletionRequest, subs: list[EngineRequest]) -> AsyncIterator[str]:
        offsets, opened = {}, set()  # choices whose first chunk went out

        def choice_of(sub: EngineRequest, state: RequestState) -> dict | None:
            start = state.sent_tokens
            text, ids = state.take_delta()
            new_ids = ids
            entries = state.logprobs[start : start + len(ids)]
            opening = sub.index not in opened
            if req.echo and opening:  # the prompt goes out with the first token
                text = self._prompt_text(sub) + text
                entries = (state.prompt_logprobs or [None] * len(sub.prompt_ids)) + entries
                ids = sub.prompt_ids + ids
            if not text and not state.finished and not ((req.logprobs is not None or req.return_token_ids) and ids):
                return None
            opened.add(sub.index)
            logprobs = None
            if req.logprobs is not None:
                logprobs, offsets[sub.index] = self.logprobs.completion(ids, entries, offsets.get(sub.index, 0))
            choice = {"index": sub.index, "text": text, "logprobs": logprobs,
                      "finish_reason": state.finish_reason if state.finished else None}
            if state.finished:
                choice["stop_reason"] = self._stop_reason(sub, state)
            if req.return_token_ids:  # the prompt's ids with the choice's first chunk
                choice |= {"token_ids": new_ids} | ({"prompt_token_ids": sub.prompt_ids} if opening else {})
            return choice

        return self._chunks(response_id, "text_completion", subs, choice_of, req.include_usage)


def _require_tokenizer(tok, what: str):
    if tok is None:
        raise APIError(f"{what} need a tokenizer; this model has none (start the server with --tokenizer)")
    return tok


def _completion_prompt(tok, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        return prompt, _require_tokenizer(tok, "text prompts").encode(prompt)
    return None, list(prompt)


def _left_truncated(text: str | None, ids: list[int], keep: int, has_images: bool) -> tuple[str | None, list[int]]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (its text then comes from them:
    None). Image placeholders would lose their place, so a prompt with images that is too long is an error."""
    if len(ids) <= keep:
        return text, ids
    if has_images:
        raise APIError(f"truncate_prompt_tokens={keep} would cut a prompt of {len(ids)} tokens that holds images",
                       param="truncate_prompt_tokens")
    return None, ids[-keep:]


def _chat_finish_reason(sub: EngineRequest, state: RequestState) -> str | None:
    """"tool_calls" when the model chose to call tools (auto or required), as OpenAI reports it."""
    if state.finish_reason == "stop" and sub.output is not None and sub.output.called_tools(state.text):
        return "tool_calls"
    return state.finish_reason


def _stamped(subs: list[EngineRequest], raw: Request) -> list[EngineRequest]:
    arrival = getattr(raw.state, "arrival_time", None)
    for sub in subs:
        sub.arrival_time = arrival
    return subs


async def _with_error_event(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once the 200 and the first bytes are out, an error can only travel inside the stream."""
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except (EngineDeadError, ValueError) as e:
            err = engine_error(e)
            yield sse(error_body(err.message, err.type, err.param, err.code))
            yield sse("[DONE]")


async def _unless_disconnected(raw: Request, work):
    """Await `work`, cancelling it (and so aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise APIError("client disconnected", 499, code="client_disconnected")
    return task.result()


async def _wait_for_disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
