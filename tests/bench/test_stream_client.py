"""The lean streaming client against canned HTTP answers on a real socket."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from atom_core.bench.stream_client import StreamError, run_streams


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _events(num_tokens: int) -> bytes:
    body = b"".join(_chunk(b'data: {"choices":[{"index":0,"text":" t%d"}]}\n\n' % i) for i in range(num_tokens))
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": num_tokens}}, separators=(",", ":"))
    return body + _chunk(f"data: {usage}\n\n".encode()) + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + _events(3)
_BAD_BODY = b'{"error":{"message":"bad prompt"}}'
BAD = b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(_BAD_BODY), _BAD_BODY)
ERROR_EVENT = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
               + _chunk(b'data: {"error":{"message":"engine died"}}\n\n') + b"0\r\n\r\n")


class CannedServer:
    """Answers every request on a connection with `answer` (reads the request by Content-Length)."""

    def __init__(self, answer: bytes):
        self.answer = answer
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        async def handle(reader, writer):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(self.answer)
                await writer.drain()

        async def main():
            self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            await self.server.serve_forever()

        self.loop.run_until_complete(main())


def test_counts_token_events_and_reads_usage_over_keep_alive():
    server = CannedServer(OK)
    run = run_streams("127.0.0.1", server.port, "/v1/completions", [{"prompt": "x"}] * 4, 2)
    assert len(run.requests) == 4 and run.duration_s > 0
    for r in run.requests:
        assert r.num_events == 3 and r.num_tokens == 3
        assert r.sent <= r.first_event <= r.last_event


@pytest.mark.parametrize("answer, message", [(BAD, "HTTP 400"), (ERROR_EVENT, "engine died")])
def test_an_error_answer_raises(answer, message):
    server = CannedServer(answer)
    with pytest.raises(StreamError, match=message):
        run_streams("127.0.0.1", server.port, "/v1/completions", [{"prompt": "x"}], 1)
