"""The server process of `atomctl bench api-overhead`: the real app over a stand-in core.

`python -m atom_core.bench.api_overhead_server --model M --step-ms S [--max-num-seqs N]
[--max-num-batched-tokens T]` binds a free port on 127.0.0.1, starts the engine core (StandInCore:
real scheduler and messages, a fixed step time instead of a model), prints `PORT <n>` once the
core is ready, and serves `build_app`'s app with uvicorn's defaults, as `atomctl serve` does.

One extra route, GET /_bench/latencies, returns and clears, per written chunk, the seconds from its
oldest token leaving the core (Outputs.sent_at) to the chunk's SSE write (the send returned), and
the part of them before the API process's reader thread had the message (the hop: pickling, the
pipe, unpickling).
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import signal
import time

import uvicorn

from atom_core.bench.stand_in_core import StandInCore
from atom_core.config import EngineConfig
from atom_core.engine.async_engine import AsyncEngine
from atom_core.engine.output_processor import RequestState
from atom_core.server.app import ServerOptions, _bind, build_app


class ChunkLatencies:
    """Sampling-to-write seconds per written chunk (of its oldest token), and the hop's part."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.hop_seconds: list[float] = []

    def observe(self, state: RequestState) -> None:
        if state.update_stamps is not None:
            sent, received = state.update_stamps
            self.seconds.append(time.monotonic() - sent)
            self.hop_seconds.append(received - sent)
            state.update_stamps = None

    def take(self) -> dict:
        taken = {"seconds": self.seconds, "hop_seconds": self.hop_seconds}
        self.seconds, self.hop_seconds = [], []
        return taken


def serve(model: str, step_ms: float, max_num_seqs: int, max_num_batched_tokens: int,
          cprofile_path: str | None = None) -> None:
    config = EngineConfig.from_kwargs(model, device="cpu", max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens, num_scheduler_steps=1)
    sock = _bind("127.0.0.1", 0)
    engine = AsyncEngine(config, core_factory=functools.partial(StandInCore, step_s=step_ms / 1000))
    engine.start()
    app = build_app(engine, model, options=ServerOptions(shutdown_timeout=0.0))
    latencies = ChunkLatencies()
    app.state.serving.on_chunk_written = latencies.observe

    @app.get("/_bench/latencies")
    async def take_latencies():
        return latencies.take()

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30))
    # uvicorn re-raises the signal that stopped it; a no-op handler makes that a normal return,
    # so the core stops cleanly and the profile is written.
    signal.signal(signal.SIGTERM, lambda *_: None)
    profiler = cProfile.Profile() if cprofile_path else None
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    try:
        if profiler is not None:
            profiler.enable()
        server.run(sockets=[sock])
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(cprofile_path)
        engine.shutdown()
        sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--step-ms", type=float, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--cprofile", help="Write the event-loop thread's cProfile stats here at exit.")
    args = parser.parse_args()
    serve(args.model, args.step_ms, args.max_num_seqs, args.max_num_batched_tokens, args.cprofile)


if __name__ == "__main__":
    main()
