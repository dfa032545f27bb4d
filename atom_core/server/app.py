"""The FastAPI app (`build_app`) and the process that serves it (`run_server`).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics, POST /start_profile, POST /stop_profile. With an API key, everything but
/health and /metrics needs `Authorization: Bearer KEY` (the scheme in any case). Every error
is an OpenAI error body.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from atom_core.config import EngineConfig
from atom_core.engine.async_engine import AsyncEngine, EngineDeadError
from atom_core.server.metrics import ServerMetrics
from atom_core.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    validation_error_to_api_error,
)
from atom_core.server.serving import OpenAIServing, engine_error

logger = logging.getLogger(__name__)


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app over a started engine; its lifespan attaches the engine and shuts it down."""
    metrics = ServerMetrics(model_name)
    serving = OpenAIServing(engine, model_name, metrics)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.attach(asyncio.get_running_loop())
        yield
        # uvicorn has drained the in-flight requests by now (graceful shutdown).
        engine.shutdown()

    app = FastAPI(title="atom_core OpenAI-compatible server", lifespan=lifespan)
    _add_error_handlers(app)
    guarded = APIRouter(dependencies=[Depends(_bearer_auth(api_key))] if api_key else [])

    @guarded.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @guarded.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @guarded.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "atom_core",
                "root": str(engine.config.model.model), "max_model_len": engine.info.max_model_len}
        return {"object": "list", "data": [card]}

    @guarded.post("/start_profile")
    async def start_profile():
        await _core_call(engine.start_profile())
        return {"status": "profiling"}

    @guarded.post("/stop_profile")
    async def stop_profile():
        return {"status": "stopped", "traces": await _core_call(engine.stop_profile())}

    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            return JSONResponse(error_body("engine core process is not running", "server_error", code="engine_dead"), 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        stats = None
        if engine.is_healthy:
            try:
                stats = await engine.stats()
            except EngineDeadError:
                pass  # rendered as engine_healthy 0
        return PlainTextResponse(metrics.render(stats, engine.num_unfinished), media_type="text/plain; version=0.0.4")

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
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), expected):
            raise APIError("invalid or missing API key; send 'Authorization: Bearer <key>'", 401,
                           code="invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, e: APIError):
        return JSONResponse(e.body(), e.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, e: RequestValidationError):
        err = validation_error_to_api_error(list(e.errors()))
        return JSONResponse(err.body(), err.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, e: Exception):
        logger.exception("unhandled error in a request")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)


# ---- the server process ---------------------------------------------------------------
def run_server(config: EngineConfig, host: str, port: int, model_name: str, api_key: str | None = None,
               access_log: bool = False) -> None:
    """Bind, start the engine core process, serve until SIGINT/SIGTERM, drain, exit cleanly."""
    import uvicorn

    sock = _bind(host, port)  # before the (slow) engine start, so a busy port fails at once
    engine = AsyncEngine(config)
    info = engine.start()
    print(f"serving '{model_name}' (max_model_len {info.max_model_len}, {info.num_kv_blocks} KV blocks) "
          f"at http://{host}:{port}/v1", flush=True)
    try:
        app = build_app(engine, model_name, api_key)
        server = uvicorn.Server(uvicorn.Config(app, log_level="info", access_log=access_log,
                                               timeout_keep_alive=30))
        # uvicorn re-raises the signal that stopped it once it has drained; a no-op handler
        # here makes that a normal return, so the engine is shut down and the exit code is 0.
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.run(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        engine.shutdown()
        sock.close()


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
