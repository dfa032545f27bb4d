"""The FastAPI app (`build_app`) and the process that serves it (`run_server`).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, POST /start_profile, POST /stop_profile, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (server/lora.py); the Responses API (responses.py), the Anthropic
Messages API (anthropic_messages.py), and vLLM's /tokenize, /detokenize, /version and /ping
(utility_routes.py). With an API key, everything but /health, /metrics, /version and /ping needs
`Authorization: Bearer KEY` (the scheme in any case) or, as Anthropic's clients send it,
`x-api-key: KEY`. Every error is an OpenAI error body, but under /v1/messages Anthropic's.

Lifecycle (`ServerLifecycle`): SIGTERM/SIGINT start a drain: new requests get 503, requests in
flight finish; after `shutdown_timeout` seconds the rest end with an error (a final SSE error
event for streams, a 503 otherwise) and the server exits 0. A second signal stops at once.
A dead engine core makes the server exit 1 after ENGINE_DEAD_EXIT_DELAY_S (in-flight requests
get their 503s first), so a supervisor restarts it; nothing restarts the core in-process.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_core.config import EngineConfig
from atom_core.engine.async_engine import AsyncEngine, EngineDeadError, ServerStoppingError
from atom_core.engine.dp_engine import DataParallelEngine
from atom_core.server.anthropic_messages import MessagesServing, add_messages_routes, anthropic_error_body, is_messages_path
from atom_core.server.chat_output import ChatOptions
from atom_core.server.guards import RequestGuard, ServerState
from atom_core.server.lora import adapter_cards, lora_router, serving_loras
from atom_core.server.media import MediaOptions
from atom_core.server.metrics import CONTENT_TYPE, METRICS_PREFIXES, ServerMetrics
from atom_core.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_error_to_api_error,
)
from atom_core.server.responses import ResponsesServing, add_responses_routes
from atom_core.server.serving import OpenAIServing, engine_error
from atom_core.server.utility_routes import add_utility_routes

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_DELAY_S = 1.5  # a dead core: answer 503 this long, then exit 1
_DRAIN_POLL_S = 0.05
_FAILED_STREAMS_GRACE_S = 5.0  # after the drain timeout: time for the error events to go out


@dataclass(frozen=True)
class ServerOptions:
    """Limits of the HTTP server (the engine's are in EngineConfig)."""

    shutdown_timeout: float = 30.0  # seconds a drain waits for requests in flight
    max_request_bytes: int = 8 * 1024 * 1024  # a larger body gets 413, unparsed
    body_read_timeout: float = 30.0  # seconds to receive a whole request body, else 408
    metrics_prefix: str = "atom"  # "vllm": vLLM's metric names
    media: MediaOptions = field(default_factory=MediaOptions)  # image URLs: sources, limits

    def __post_init__(self) -> None:
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"invalid --shutdown-timeout {self.shutdown_timeout}; expected seconds >= 0")
        if self.max_request_bytes < 1:
            raise ValueError(f"invalid --max-request-bytes {self.max_request_bytes}; expected >= 1")
        if not self.body_read_timeout > 0:
            raise ValueError(f"invalid --body-read-timeout {self.body_read_timeout}; expected seconds > 0")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(f"unknown --metrics-prefix {self.metrics_prefix!r}; expected one of: {', '.join(METRICS_PREFIXES)}")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error of this server (OpenAI's error body)."""

    error: ErrorDetail


_ERRORS = {
    400: {"model": ErrorResponse, "description": "Invalid request (bad JSON, unknown or out-of-range field, too long)."},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (when the server has one)."},
    404: {"model": ErrorResponse, "description": "Unknown model or path."},
    408: {"model": ErrorResponse, "description": "The body did not arrive within --body-read-timeout."},
    413: {"model": ErrorResponse, "description": "The body is over --max-request-bytes."},
    503: {"model": ErrorResponse, "description": "The engine core is dead, or the server is shutting down."},
}


class ServerLifecycle:
    """Drain on a signal, exit on a dead core (see the module docstring). Runs on the loop;
    `stop(exit_code)` is set by run_server to end uvicorn's loop."""

    def __init__(self, engine: AsyncEngine, state: ServerState, options: ServerOptions):
        self.engine, self.state, self.options = engine, state, options
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0
        self.stop = lambda: None
        self._drain_task: asyncio.Task | None = None

    def begin_drain(self) -> None:
        if self.state.draining:
            return
        self.state.draining = True
        logger.warning("draining: %d request(s) in flight, waiting up to %g s", self.state.num_in_flight,
                       self.options.shutdown_timeout)
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        if not await self._wait_idle(self.options.shutdown_timeout):
            n = self.engine.fail_pending(ServerStoppingError(
                f"the server is shutting down and stopped this request after --shutdown-timeout "
                f"{self.options.shutdown_timeout:g} s"))
            logger.warning("drain timed out: stopped %d engine request(s)", n)
            await self._wait_idle(_FAILED_STREAMS_GRACE_S)
        self.stop()

    async def _wait_idle(self, timeout: float) -> bool:
        deadline = self.loop.time() + timeout
        while self.state.num_in_flight and self.loop.time() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        return not self.state.num_in_flight

    def on_engine_dead(self, reason: str) -> None:
        logger.error("%s; exiting with status 1 in %g s", reason, ENGINE_DEAD_EXIT_DELAY_S)
        self.exit_code = 1
        self.loop.call_later(ENGINE_DEAD_EXIT_DELAY_S, self.stop)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None,
              chat_options: ChatOptions | None = None, options: ServerOptions | None = None,
              loras=None) -> FastAPI:
    """The app over a started engine; its lifespan attaches the engine and shuts it down.
    `app.state.lifecycle` is the ServerLifecycle run_server drives. loras: the LoRA registry
    (server/lora.py's serving_loras; built from the engine's config when not given)."""
    options = options or ServerOptions()
    metrics = ServerMetrics(model_name, engine, options.metrics_prefix)
    engine.on_progress = metrics.observe_progress
    loras = loras if loras is not None else serving_loras(engine.config, model_name)
    serving = OpenAIServing(engine, model_name, metrics, chat_options, loras, options.media)
    responses = ResponsesServing(serving)
    state = ServerState(options.max_request_bytes, options.body_read_timeout)
    lifecycle = ServerLifecycle(engine, state, options)
    engine.on_dead.append(lifecycle.on_engine_dead)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        lifecycle.loop = asyncio.get_running_loop()
        engine.attach(lifecycle.loop)
        yield
        responses.close()
        serving.close()
        engine.shutdown()

    app = FastAPI(title="atom_core OpenAI-compatible server", lifespan=lifespan)
    app.state.lifecycle = lifecycle
    app.state.serving = serving  # its hooks (on_chunk_written) are set by the API-overhead benchmark
    app.add_middleware(RequestGuard, state=state)
    _add_error_handlers(app)
    _document_errors(app)
    guarded = APIRouter(dependencies=[Depends(_bearer_auth(api_key))] if api_key else [],
                        responses={k: _ERRORS[k] for k in ((400, 401, 408, 413, 503) if api_key else (400, 408, 413, 503))})

    @guarded.post("/v1/chat/completions", responses={404: _ERRORS[404]})
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @guarded.post("/v1/completions", responses={404: _ERRORS[404]})
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @guarded.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "atom_core",
                "root": str(engine.config.model.model), "max_model_len": engine.info.max_model_len,
                "input_modalities": ["text", "image"] if serving.image_processor is not None else ["text"]}
        return {"object": "list", "data": [card, *adapter_cards(serving.loras, card)]}

    @guarded.post("/start_profile")
    async def start_profile():
        await _core_call(engine.start_profile())
        return {"status": "profiling"}

    @guarded.post("/stop_profile")
    async def stop_profile():
        return {"status": "stopped", "traces": await _core_call(engine.stop_profile())}

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health():
        if not engine.is_healthy:
            return JSONResponse(error_body("engine core process is not running", "server_error", code="engine_dead"), 503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {
        "content": {"text/plain": {"schema": {"type": "string"}}},
        "description": "Prometheus text exposition (format 0.0.4)."}})
    async def prometheus_metrics():
        # From the API process's registry (the core pushes its gauges): never waits on the core.
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    guarded.include_router(lora_router(loras), responses={404: _ERRORS[404]})
    add_responses_routes(guarded, responses)
    add_messages_routes(guarded, MessagesServing(serving))
    add_utility_routes(app, guarded, serving, health)
    app.include_router(guarded)
    return app


async def _core_call(call):
    try:
        return await call
    except (ValueError, EngineDeadError) as e:
        raise engine_error(e) from None


def _bearer_auth(api_key: str):
    expected = api_key.encode()

    async def check(request: Request) -> None:
        # The scheme is case-insensitive (RFC 7235); the key is compared exactly, in constant time.
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), expected):
            return
        anthropic_key = request.headers.get("x-api-key")  # how Anthropic's SDKs send it
        if anthropic_key is None or not secrets.compare_digest(anthropic_key.strip().encode(), expected):
            raise APIError("invalid or missing API key; send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                           401, code="invalid_api_key")

    return check


def _document_errors(app: FastAPI) -> None:
    """The OpenAPI document lists the statuses the server sends: validation errors are 400
    (not FastAPI's 422) with the OpenAI error body."""
    def openapi():
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            _integer_bounds(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _integer_bounds(node) -> None:
    """FastAPI's OpenAPI model stores every bound as a float: an integer field's bounds go back to
    integers (2**63 - 1 as a float would round to 2**63)."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(key), float) and node[key].is_integer():
                    node[key] = int(node[key])
        for value in node.values():
            _integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _integer_bounds(value)


def _error_response(request: Request, e: APIError, headers=None) -> JSONResponse:
    """OpenAI's error body, or Anthropic's under /v1/messages."""
    body = anthropic_error_body(e.status_code, e.message) if is_messages_path(request.url.path) else e.body()
    return JSONResponse(body, e.status_code, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return _error_response(request, e)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError):
        return _error_response(request, validation_error_to_api_error(list(e.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(request, APIError(str(e.detail), e.status_code, kind), getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("unhandled error in a request")
        return _error_response(request, APIError(f"internal error: {type(e).__name__}: {e}", 500, "server_error"))


# ---- the server process ---------------------------------------------------------------
def run_server(config: EngineConfig, host: str, port: int, model_name: str, api_key: str | None = None,
               access_log: bool = False, chat_options: ChatOptions | None = None,
               options: ServerOptions | None = None) -> int:
    """Bind, start the engine core process, serve until SIGINT/SIGTERM, drain, stop the core.
    Returns the exit status: 0, or 1 when the engine core died."""
    sock = _bind(host, port)  # before the (slow) engine start, so a busy port fails at once
    loras = serving_loras(config, model_name)  # so does a bad --lora-modules adapter
    engine = AsyncEngine(config) if config.parallel.data_parallel_size == 1 else DataParallelEngine(config)
    info = engine.start()
    print(f"serving '{model_name}' (max_model_len {info.max_model_len}, {info.num_kv_blocks} KV blocks) "
          f"at http://{host}:{port}/v1", flush=True)
    try:
        app = build_app(engine, model_name, api_key, chat_options, options, loras)
        server = _DrainingServer(uvicorn.Config(app, log_level="info", access_log=access_log, timeout_keep_alive=30,
                                                timeout_graceful_shutdown=_FAILED_STREAMS_GRACE_S),
                                 app.state.lifecycle)
        # uvicorn re-raises a signal that stopped it; a no-op handler makes that a normal return.
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        engine.shutdown()
        sock.close()
    return app.state.lifecycle.exit_code


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT starts our drain instead of its shutdown."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.stop = self._stop

    def _stop(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        lifecycle = self.lifecycle
        if lifecycle.loop is None or lifecycle.state.draining or self.should_exit:
            super().handle_exit(sig, frame)  # not started yet, or a second signal: stop now
        else:
            lifecycle.loop.call_soon_threadsafe(lifecycle.begin_drain)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
