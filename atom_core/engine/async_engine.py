"""AsyncEngine: the server's client of an engine core that runs in its own process.

Process and thread layout:

    API process (asyncio loop)                         core process (spawned)
      AsyncEngine.generate() --- in_q: add/abort/rpc --->  run_core(): drain in_q (block when
      per-request asyncio.Queue                            idle), core.step(), put outputs
      OutputProcessor (detokenize, stop strings)
      reader thread <--------- out_q: outputs/replies ---  one message per step

The reader thread only moves messages from out_q onto the event loop
(`loop.call_soon_threadsafe`); everything else (OutputProcessor, request queues, RPC futures)
is touched on the loop thread alone, so nothing here needs a lock. Requests cross as token
ids + SamplingParams, outputs come back as CoreOutput token deltas.

Failure contract: when the core process dies (or its step raises), `is_healthy` turns False,
every pending request and RPC gets EngineDeadError, new ones are refused with it, and the
`on_dead` callbacks run (the server exits non-zero on it, so a supervisor restarts it).

Statistics: the core pushes its gauges (CoreStats) after steps, at most every
_STATS_PERIOD_S unless its running/waiting counts change, and whenever it goes idle; the API
process keeps the latest (`latest_stats`), so /metrics never waits on the core.
"""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

from atom_core.config import EngineConfig
from atom_core.engine.output_processor import CoreOutput, OutputProcessor, RequestState
from atom_core.multimodal.inputs import MultimodalItem
from atom_core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how often the reader notices a dead core, and the idle core a dead parent
_STARTUP_TIMEOUT_S = 600.0
_STATS_PERIOD_S = 0.1  # how often a busy core pushes its gauges to the API process
_LOCKSTEP_IDLE_S = 0.02  # replicas sharing experts: how long an idle one waits between agreements


class EngineDeadError(RuntimeError):
    """The engine core process is gone; no request can be served any more."""

    code = "engine_dead"


class ServerStoppingError(EngineDeadError):
    """The server is shutting down and stopped this request (its drain time ran out)."""

    code = "server_shutting_down"


@dataclass(frozen=True)
class CoreInfo:
    """What the API process learns from the core at startup (the handshake)."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    eos_token_ids: frozenset[int]
    max_image_tokens: int = 0  # the encoder budget for one image (engine/encoder_cache.py); 0: takes no images


# ---- messages across the process boundary ----------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    mm_items: tuple[MultimodalItem, ...] = ()


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class CallCore:
    """Run a core method between steps; its ValueError comes back as a failed Reply."""

    call_id: int
    method: Literal["stats", "start_profile", "stop_profile"]


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Ready:
    info: CoreInfo


@dataclass(frozen=True)
class StartupError:
    message: str


@dataclass(frozen=True)
class Outputs:
    """One step's CoreOutputs. Pickled as columns (ids, tokens, cached counts, and the few entries
    with anything else): default pickling pays per object for every slotted dataclass of a large
    batch, on the core's and the API process's critical paths each step; a few flat lists pickle
    as a handful of objects whatever the batch size."""

    outputs: list[CoreOutput]
    sent_at: float  # time.monotonic() in the core when the step's tokens were known (one clock per host)

    def __reduce__(self):
        rest = {i: (o.finished, o.finish_reason, o.stop_token_id, o.new_logprobs, o.prompt_logprobs,
                    o.queue_time, o.prefill_time)
                for i, o in enumerate(self.outputs)
                if o.finished or o.new_logprobs or o.prompt_logprobs is not None or o.queue_time is not None}
        columns = ([o.request_id for o in self.outputs], [o.new_token_ids for o in self.outputs],
                   [o.num_cached_tokens for o in self.outputs], rest)
        return _unpack_outputs, (columns, self.sent_at)


def _unpack_outputs(columns: tuple, sent_at: float) -> Outputs:
    request_ids, token_ids, cached, rest = columns
    outputs = [CoreOutput(rid, tokens, False, None, None, [], None, n, None, None)
               for rid, tokens, n in zip(request_ids, token_ids, cached)]
    for i, (finished, reason, stop_id, logprobs, prompt_logprobs, queue_time, prefill_time) in rest.items():
        o = outputs[i]
        o.finished, o.finish_reason, o.stop_token_id, o.new_logprobs = finished, reason, stop_id, logprobs
        o.prompt_logprobs, o.queue_time, o.prefill_time = prompt_logprobs, queue_time, prefill_time
    return Outputs(outputs, sent_at)


@dataclass(frozen=True)
class StatsUpdate:
    stats: object  # CoreStats


@dataclass(frozen=True)
class Reply:
    call_id: int
    ok: bool
    value: object


@dataclass(frozen=True)
class RequestError:
    request_id: str
    message: str


@dataclass(frozen=True)
class Fatal:
    traceback: str


def freeze_startup_objects() -> None:
    """Move everything built so far (imports, the model, KV block objects, tokenizers, the app)
    out of the cyclic collector's reach: a full collection scans every tracked object, and with
    ~350-450k of them each one stalled the process ~0.4 s on the CPU (bench api-overhead: 1.9 s
    of full collections in 11 s of streaming at c256 before, 0.3 s after). They live until exit."""
    gc.collect()
    gc.freeze()


# ---- the core process -----------------------------------------------------------------
def run_core(config: EngineConfig, in_q: mp.Queue, out_q: mp.Queue,
             core_factory: Callable[[EngineConfig], object] | None = None) -> None:
    """Entry point of the core process: build the core, hand back CoreInfo, then loop.

    in_q carries AddRequest, AbortRequests, CallCore and Shutdown; out_q carries Ready or
    StartupError, then Outputs, Reply, RequestError and Fatal. core_factory (picklable) builds
    another EngineCore class, e.g. the API-overhead benchmark's stand-in for the model.
    """
    # Ctrl-C and a SIGTERM to the process group reach the core too; the API process decides
    # when it stops (after draining), and the core exits by itself if that process dies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from atom_core.engine.core import EngineCore
    from atom_core.engine.lockstep import LockstepEngineCore

    lockstep = config.parallel.experts_span_replicas
    try:
        core = (core_factory or (LockstepEngineCore if lockstep else EngineCore))(config)
    except Exception as e:  # noqa: BLE001 - the process boundary: report, the parent raises it
        out_q.put(StartupError(f"{type(e).__name__}: {e}"))
        return
    info = CoreInfo(core.max_model_len, core.vocab_size, core.kv.num_blocks, frozenset(core.files.eos_token_ids),
                    core.scheduler.encoder.capacity if getattr(core, "takes_images", False) else 0)
    freeze_startup_objects()
    out_q.put(Ready(info))
    try:
        (_lockstep_core_loop if lockstep else _core_loop)(core, in_q, out_q)
    except Exception:  # noqa: BLE001 - a failed step ends the core; the API process must know why
        out_q.put(Fatal(traceback.format_exc()))
        raise
    finally:
        core.shutdown()  # tensor-parallel workers end with the core


def _stats_update(core, stats) -> StatsUpdate:
    """The stats to push, with the core's memory read now (pushes are rarer than steps)."""
    return StatsUpdate(dataclasses.replace(stats, memory_bytes=core.memory_bytes()))


def _core_loop(core, in_q: mp.Queue, out_q: mp.Queue) -> None:
    parent = mp.parent_process()
    out_q.put(_stats_update(core, core.stats()))
    last_push, last_counts = 0.0, None
    while True:
        for cmd in _drain(in_q, block=not core.has_unfinished(), parent=parent):
            if isinstance(cmd, Shutdown):
                return
            _handle(core, cmd, out_q)
        if core.has_unfinished():
            outputs = core.step()
            if outputs:
                out_q.put(Outputs(outputs, time.monotonic()))
        stats, now = core.stats(), time.monotonic()
        counts = (stats.num_running, stats.num_waiting)
        if counts != last_counts or now - last_push >= _STATS_PERIOD_S or not core.has_unfinished():
            out_q.put(_stats_update(core, stats))  # after the step's outputs: a client never sees stale counts
            last_push, last_counts = now, counts


def _lockstep_core_loop(core, in_q: mp.Queue, out_q: mp.Queue) -> None:
    """The loop of a replica that shares experts with others (engine/lockstep.py): every round it
    takes its commands and calls core.step(), which agrees with the other replicas and runs a
    forward (its own or a dummy one) while any of them has work. While none has, it waits for a
    command at most _LOCKSTEP_IDLE_S before the next (empty) agreement, so a replica that gets a
    request finds the others within that time. Shutdown is agreed too: the replicas leave together."""
    parent = mp.parent_process()
    out_q.put(_stats_update(core, core.stats()))
    last_push, last_counts = 0.0, None
    while not core.stopped:
        idle = core.all_idle and not core.has_unfinished()
        for cmd in _poll(in_q, _LOCKSTEP_IDLE_S if idle else 0.0, parent):
            if isinstance(cmd, Shutdown):
                core.request_stop()
            else:
                _handle(core, cmd, out_q)
        outputs = core.step()
        if outputs:
            out_q.put(Outputs(outputs, time.monotonic()))
        stats, now = core.stats(), time.monotonic()
        counts = (stats.num_running, stats.num_waiting)
        if counts != last_counts or (core.has_unfinished() and now - last_push >= _STATS_PERIOD_S):
            out_q.put(_stats_update(core, stats))
            last_push, last_counts = now, counts


def _poll(in_q: mp.Queue, wait_s: float, parent) -> list:
    """The queued commands, waiting up to wait_s for a first one (Shutdown if the parent died)."""
    if wait_s:
        try:
            return [in_q.get(timeout=wait_s), *_drain(in_q, block=False, parent=parent)]
        except queue.Empty:
            return [Shutdown()] if parent is not None and not parent.is_alive() else []
    return _drain(in_q, block=False, parent=parent)


def _drain(in_q: mp.Queue, block: bool, parent) -> list:
    """All queued commands; when idle, wait for one first (and exit if the parent died)."""
    cmds = []
    while block and not cmds:
        try:
            cmds.append(in_q.get(timeout=_POLL_S))
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return [Shutdown()]
    while True:
        try:
            cmds.append(in_q.get_nowait())
        except queue.Empty:
            return cmds


def _handle(core, cmd, out_q: mp.Queue) -> None:
    if isinstance(cmd, AddRequest):
        try:
            if cmd.mm_items:
                core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.mm_items)
            else:  # text: what every core takes (the API-overhead benchmark's stand-in takes only this)
                core.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params)
        except ValueError as e:  # the API process validates first; this is the safety net
            out_q.put(RequestError(cmd.request_id, str(e)))
    elif isinstance(cmd, AbortRequests):
        core.abort_requests(cmd.request_ids)
    elif isinstance(cmd, CallCore):
        method = {"stats": core.stats, "start_profile": core.start_profile, "stop_profile": core.stop_profile}[cmd.method]
        try:
            value = method()
        except ValueError as e:
            out_q.put(Reply(cmd.call_id, False, str(e)))
        else:
            out_q.put(Reply(cmd.call_id, True, value))
    else:
        raise AssertionError(f"unknown core command {cmd!r}")


# ---- the API-process side -------------------------------------------------------------
class AsyncEngine:
    """Client of a core process. `start()` spawns it and blocks until it is ready;
    `attach(loop)` starts the reader thread; then the async methods run on that loop only.
    """

    def __init__(self, config: EngineConfig, core_factory: Callable[[EngineConfig], object] | None = None):
        self.config = config
        self.core_factory = core_factory  # None: EngineCore (see run_core)
        self.tokenizer = None
        self.model_path = None  # the model directory (its image processor's files)
        self.processor: OutputProcessor | None = None
        self.info: CoreInfo | None = None
        self._ctx = mp.get_context("spawn")
        self._in_q = self._ctx.Queue()
        self._out_q = self._ctx.Queue()
        self._proc: mp.Process | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._dead_reason: str | None = None
        self._stopping = False  # set by shutdown(): the core's exit is expected from then on
        self._refusal: EngineDeadError | None = None  # set by fail_pending()
        self.latest_stats = None  # the core's last pushed CoreStats
        self.on_dead: list[Callable[[str], None]] = []  # run on the loop when the core dies
        # (state, number of new tokens, now) after each step's update of a request (metrics).
        self.on_progress: Callable[[RequestState, int, float], None] | None = None

    # ---- lifecycle --------------------------------------------------------------------
    def start(self, timeout: float = _STARTUP_TIMEOUT_S) -> CoreInfo:
        """Spawn the core, load the tokenizer meanwhile, and wait for the core's handshake."""
        from atom_core.loader import resolve_model_files

        self._proc = self._ctx.Process(target=run_core, args=(self.config, self._in_q, self._out_q, self.core_factory),
                                       name="atom-engine-core", daemon=True)
        self._proc.start()
        try:
            files = resolve_model_files(self.config.model.model, self.config.model.tokenizer)
            self.tokenizer = files.serving_tokenizer()
            self.model_path = files.path
        except Exception:
            self._proc.kill()
            raise
        self.processor = OutputProcessor(self.tokenizer)
        waited = 0.0
        while True:
            try:
                msg = self._out_q.get(timeout=_POLL_S)
                break
            except queue.Empty:
                waited += _POLL_S
                if not self._proc.is_alive():
                    raise RuntimeError(f"engine core process exited during startup (exit code {self._proc.exitcode})") from None
                if waited > timeout:
                    self._proc.kill()
                    raise RuntimeError(f"engine core not ready after {timeout:.0f} s") from None
        if isinstance(msg, StartupError):
            self._proc.join(5)
            raise ValueError(msg.message)
        assert isinstance(msg, Ready), f"unexpected first core message {msg!r}"
        self.info = msg.info
        return self.info

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering core messages to `loop` (call from inside it, once)."""
        assert self.info is not None, "start() the engine before attaching it to a loop"
        freeze_startup_objects()  # the server is built by now
        self._loop = loop
        self._reader = threading.Thread(target=self._read_loop, name="atom-core-reader", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core process (politely, then by force), then the reader thread.

        The reader keeps draining out_q until the core is gone: a core exits only after its
        queue's feeder thread has flushed, which needs a reader on the other end.
        """
        self.request_shutdown()
        if self._proc is not None and self._proc.is_alive():
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout)
        if self._reader is not None:
            self._reader.join(timeout)

    def request_shutdown(self) -> None:
        """Ask the core to stop without waiting (its exit is expected from now on); idempotent."""
        if not self._stopping and self._proc is not None and self._proc.is_alive():
            self._in_q.put(Shutdown())
        self._stopping = True

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_healthy(self) -> bool:
        return self._dead_reason is None and self._proc is not None and self._proc.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    def check_health(self) -> None:
        if self._refusal is not None:
            raise self._refusal
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if not self.is_healthy:
            raise EngineDeadError(f"engine core process is not running (exit code {self._proc.exitcode})")

    # ---- requests ---------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams,
                         mm_items: tuple[MultimodalItem, ...] = ()) -> None:
        """The core's own rules (core.validate_request), checked here before sending."""
        from atom_core.engine.core import validate_images, validate_request

        validate_request(prompt_token_ids, params, self.info.max_model_len, self.info.vocab_size)
        if mm_items:
            validate_images(mm_items, len(prompt_token_ids), None, self.info.max_image_tokens > 0,
                            self.info.max_image_tokens)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, arrival_time: float | None = None,
                       mm_items: tuple[MultimodalItem, ...] = ()) -> AsyncIterator[RequestState]:
        """Yield the request's RequestState each time it advances, the last one finished.

        Raises ValueError (invalid request) before anything is queued, EngineDeadError when
        the core dies. Closing the generator early (client gone) aborts the request.
        arrival_time (time.perf_counter()): when the HTTP request arrived; TTFT and latency count from it.
        """
        self.check_health()
        self.validate_request(prompt_token_ids, params, mm_items)
        assert request_id not in self._queues, f"duplicate request id {request_id}"
        state = self.processor.new_state(request_id, prompt, prompt_token_ids, params)
        if arrival_time is not None:
            state.arrival_time = arrival_time
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._in_q.put(AddRequest(request_id, list(prompt_token_ids), params, tuple(mm_items)))
        try:
            while True:
                item = await q.get()
                while isinstance(item, RequestState) and not q.empty():
                    item = q.get_nowait()  # coalesce: the state object already holds every update
                if isinstance(item, Exception) and not state.finished:
                    raise item
                yield state
                if state.finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not state.finished:
                self.abort(request_id)

    def fail_pending(self, error: EngineDeadError) -> int:
        """End every pending request with `error` (their generators raise it and abort them in
        the core), and refuse new ones with it; returns how many there were."""
        self._refusal = error
        for q in self._queues.values():
            q.put_nowait(error)
        return len(self._queues)

    def abort(self, request_id: str) -> None:
        self.processor.abort(request_id)
        self._queues.pop(request_id, None)
        if self._dead_reason is None:
            self._in_q.put(AbortRequests([request_id]))

    # ---- calls into the core ----------------------------------------------------------
    async def stats(self):
        return await self._call("stats")

    async def start_profile(self) -> None:
        await self._call("start_profile")

    async def stop_profile(self) -> list[str]:
        return await self._call("stop_profile")

    async def _call(self, name: Literal["stats", "start_profile", "stop_profile"]):
        """Run a core method between steps; its ValueError is re-raised here."""
        self.check_health()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._in_q.put(CallCore(call_id, name))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    # ---- messages from the core (reader thread -> loop thread) -------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._out_q.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._proc.is_alive():
                    if not self._stopping:
                        self._post(self._on_dead, f"engine core process died (exit code {self._proc.exitcode})")
                    return
                continue
            except (EOFError, OSError) as e:
                self._post(self._on_dead, f"lost the engine core connection: {e}")
                return
            self._post(self._on_message, msg, time.monotonic())

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed during shutdown; nobody is waiting any more
            pass

    def _on_message(self, msg, received_at: float) -> None:
        """received_at: time.monotonic() when the reader thread had the message."""
        if isinstance(msg, Outputs):
            self._on_outputs(msg.outputs, (msg.sent_at, received_at))
        elif isinstance(msg, StatsUpdate):
            self.latest_stats = msg.stats
        elif isinstance(msg, Reply):
            future = self._calls.get(msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg.value) if msg.ok else future.set_exception(ValueError(msg.value))
        elif isinstance(msg, RequestError):
            self.processor.abort(msg.request_id)
            if (q := self._queues.get(msg.request_id)) is not None:
                q.put_nowait(ValueError(msg.message))
        elif isinstance(msg, Fatal):
            logger.error("engine core failed:\n%s", msg.traceback)
            self._on_dead(f"engine core failed: {msg.traceback.strip().splitlines()[-1]}")

    def _on_outputs(self, outputs: list[CoreOutput], stamps: tuple[float, float]) -> None:
        if self.on_progress is not None:
            before = {o.request_id: len(s.token_ids) for o in outputs if (s := self.processor.states.get(o.request_id))}
        updated, to_abort = self.processor.process(outputs)
        if to_abort:  # stop strings end requests here; the core must stop them too
            self._in_q.put(AbortRequests(to_abort))
        if self.on_progress is not None:
            now = time.perf_counter()
            for state in updated:
                self.on_progress(state, len(state.token_ids) - before.get(state.request_id, 0), now)
        for state in updated:
            if state.update_stamps is None:  # the oldest update not yet written out (timing, see RequestState)
                state.update_stamps = stamps
            if (q := self._queues.get(state.request_id)) is not None:
                q.put_nowait(state)

    def _on_dead(self, reason: str) -> None:
        if self._dead_reason is not None or self._stopping:
            return
        logger.error("%s; failing %d pending request(s)", reason, len(self._queues))
        self._dead_reason = reason
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(reason))
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for callback in self.on_dead:
            callback(reason)
