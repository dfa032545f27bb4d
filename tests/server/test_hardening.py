"""Operator limits of `atomctl serve` over real sockets: request size and body-read limits,
tokenization off the event loop and on several threads, vLLM metric names parsed by prometheus_client, and the
bounded SIGTERM drain (in flight finishes, new requests 503, past --shutdown-timeout the rest
end with an error event; exit 0 either way).

Each server's drain test stops it, so it stays last in its class.
"""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MAX_MODEL_LEN, start_server

LIMIT = 1 << 20
LONG = {"max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "temperature": 0}


def sse_events(lines) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def stream_in_thread(srv, results: dict, key, started: threading.Event, body: dict,
                     accepted: threading.Event | None = None):
    def run():
        try:  # 150 s between reads: a queued stream waits for those ahead of it (--max-num-seqs 1) on a loaded box
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=150) as r:
                if accepted is not None:  # response headers: the server took the request in
                    accepted.set()
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
                results[key] = (r.status_code, sse_events(lines))
        except Exception as exc:  # noqa: BLE001 - reported by the test's assertions, not lost with the thread
            results[key] = (None, [repr(exc)])

    t = threading.Thread(target=run)
    t.start()
    return t


def wait_draining(srv, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{srv.url}/health", timeout=5).status_code == 503:
            return
        time.sleep(0.02)
    raise AssertionError("the server did not start draining")


@pytest.fixture(scope="module")
def limited(tiny_llama, tmp_path_factory):
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("serve_limits"), "--max-request-bytes", str(LIMIT),
                       "--body-read-timeout", "1", "--metrics-prefix", "vllm", "--max-num-seqs", "1",
                       "--shutdown-timeout", "120")  # a loaded CI box must not hit it: the drain test checks finishing
    yield srv
    srv.stop()


class TestLimitedServer:
    def test_body_over_the_limit_is_413(self, limited):
        body = {"prompt": "x" * LIMIT, "max_tokens": 1}
        r = httpx.post(f"{limited.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large" and "--max-request-bytes" in r.json()["error"]["message"]
        with pytest.raises(openai.APIStatusError) as e:
            limited.openai().completions.create(model=limited.model_name, prompt="x" * LIMIT, max_tokens=1)
        assert e.value.status_code == 413

    def test_chunked_body_over_the_limit_is_413(self, limited):
        def chunks():  # no Content-Length: the guard counts what arrives
            for _ in range(LIMIT // 65536 + 2):
                yield b" " * 65536

        r = httpx.post(f"{limited.url}/v1/completions", content=chunks(), timeout=30,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def test_body_under_the_limit_is_served(self, limited):
        r = httpx.post(f"{limited.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1

    def test_body_that_never_completes_is_408(self, limited):
        with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\":")
            start = time.monotonic()
            chunks = []
            while chunk := s.recv(65536):  # headers and body may come in separate packets; the server closes
                chunks.append(chunk)
            reply = b"".join(chunks).decode()
            assert reply.startswith("HTTP/1.1 408"), reply
            assert time.monotonic() - start < 5
            assert "request_timeout" in reply

    def test_health_and_small_requests_answer_while_a_huge_prompt_is_tokenized(self, limited):
        prompt = "hello world 123 + 456 = " * 40000  # ~960 KB, about a second of tokenization
        result = {}

        def big():
            start = time.monotonic()
            result["r"] = httpx.post(f"{limited.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120)
            result["s"] = time.monotonic() - start
            result["end"] = time.monotonic()

        t = threading.Thread(target=big)
        t.start()
        time.sleep(0.2)
        # Tokenized on another thread of the pool: done before the huge prompt is.
        small = httpx.post(f"{limited.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, timeout=60)
        small_end = time.monotonic()
        assert small.status_code == 200, small.text
        latencies = []
        while t.is_alive():
            start = time.monotonic()
            assert httpx.get(f"{limited.url}/health", timeout=10).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
        t.join()
        assert result["r"].status_code == 400 and "max_model_len" in result["r"].json()["error"]["message"]
        assert small_end < result["end"], (result["s"], small_end - result["end"])
        assert len(latencies) >= 3, (result["s"], latencies)
        # 100 ms on an idle machine; CI shares its 2 cores, so allow for scheduling noise.
        assert max(latencies) < 0.5, latencies

    def test_vllm_metric_names_parse(self, limited):
        httpx.post(f"{limited.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}, timeout=30)
        start = time.monotonic()
        text = httpx.get(f"{limited.url}/metrics", timeout=10).text
        assert time.monotonic() - start < 1.0
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["vllm:num_requests_running"].type == "gauge"
        assert families["vllm:kv_cache_usage_perc"].type == "gauge"
        assert families["vllm:time_to_first_token_seconds"].type == "histogram"
        assert families["vllm:request_success"].type == "counter"
        assert families["vllm:num_preemptions"].type == "counter"
        for name in ("vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds",
                     "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                     "vllm:e2e_request_latency_seconds"):
            count = [s for s in families[name].samples if s.name.endswith("_count")]
            assert count and count[0].value >= 1, name
        assert not any(name.startswith("atom_") for name in families)

    @pytest.mark.parametrize("path, body, param, code, fragment", [
        ("/v1/completions", {"prompt": [1, -1]}, "prompt", None, "token ids must be integers >= 0; got -1"),
        ("/v1/completions", {"prompt": [[1, 2], [3, -7]]}, "prompt", None, "got -7"),
        ("/v1/completions", {"prompt": "Hello", "max_tokens": MAX_MODEL_LEN}, "max_tokens", "context_length_exceeded",
         "exceeds max_model_len"),
        ("/v1/completions", {"prompt": "Hello " * MAX_MODEL_LEN, "max_tokens": 1}, "prompt", "context_length_exceeded",
         "max_model_len"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": MAX_MODEL_LEN},
         "max_completion_tokens", "context_length_exceeded", "exceeds max_model_len"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_MODEL_LEN},
         "max_tokens", "context_length_exceeded", "exceeds max_model_len"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "1"}]},
         "messages", None, "'tool' message needs 'content'"),
    ], ids=["negative_token_id", "negative_token_id_nested", "max_tokens_overflow", "prompt_overflow",
            "chat_max_completion_tokens_overflow", "chat_max_tokens_overflow", "tool_message_without_content"])
    def test_clear_errors(self, limited, path, body, param, code, fragment):
        r = httpx.post(f"{limited.url}{path}", json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["code"] == code and fragment in error["message"], error

    def test_sigterm_finishes_streams_and_refuses_new_requests(self, limited):
        results, started = {}, threading.Event()
        # 3 in a row (--max-num-seqs 1): ~3 s idle, < 120 s loaded; long enough that the drain is still
        # under way when the test checks it (200 tokens each sometimes finished first on an idle box)
        body = {"stream": True, **LONG, "max_tokens": 480}
        accepted = [threading.Event() for _ in range(3)]
        threads = [stream_in_thread(limited, results, i, started, {"prompt": f"Hello {i}", **body}, accepted[i])
                   for i in range(3)]
        assert started.wait(30)
        # all three in flight before the signal (on a loaded box a thread may connect late, and a
        # request arriving after SIGTERM is rightly a 503)
        assert all(event.wait(60) for event in accepted)
        limited.proc.send_signal(signal.SIGTERM)
        wait_draining(limited)
        r = httpx.post(f"{limited.url}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(f"{limited.url}/metrics", timeout=10).status_code == 200  # scrapes stay open
        for t in threads:
            t.join(150)
        assert limited.proc.wait(150) == 0, limited.log()
        assert len(results) == 3
        for status, events in results.values():
            assert status == 200 and events[-1] == "[DONE]", (status, events[-1:])
            assert "error" not in events[-2], events[-2]
            assert events[-2]["choices"][0]["finish_reason"] == "length"


class TestShutdownTimeout:
    def test_streams_past_the_timeout_end_with_an_error_event(self, tiny_llama, tmp_path):
        srv = start_server(tiny_llama, tmp_path, "--shutdown-timeout", "0.2", "--max-num-seqs", "1")
        try:
            results, started = {}, threading.Event()
            threads = [stream_in_thread(srv, results, i, started, {"prompt": f"Hello {i}", "stream": True, **LONG})
                       for i in range(4)]
            assert started.wait(30)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(60)
            assert srv.proc.wait(30) == 0, srv.log()
            assert time.monotonic() - t0 < 10
        finally:
            srv.stop()
        stopped = [events for status, events in results.values() if status == 200 and events[-2].get("error")]
        assert stopped, "every stream finished within 0.2 s; the test needs longer streams"
        for events in stopped:
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "server_shutting_down"
            assert "--shutdown-timeout" in events[-2]["error"]["message"]


# ---- without a server -----------------------------------------------------------------
def stub_engine():
    """Only what build_app touches before serving (the OpenAPI document needs no engine)."""
    from types import SimpleNamespace

    return SimpleNamespace(on_dead=[], on_progress=None, tokenizer=None, latest_stats=None, is_healthy=True,
                           num_unfinished=0, config=SimpleNamespace(lora=SimpleNamespace(enable_lora=False)))


class TestOpenAPI:
    def test_documents_error_bodies_and_metrics_as_text(self):
        from fastapi.testclient import TestClient

        from atom_core.server.app import build_app

        doc = TestClient(build_app(stub_engine(), "m", api_key="k")).app.openapi()
        chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
        assert {"400", "401", "404", "413", "503"} <= set(chat) and "422" not in chat
        assert chat["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert "error" in doc["components"]["schemas"]["ErrorResponse"]["properties"]
        assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
        assert not any("422" in op["responses"] for path in doc["paths"].values() for op in path.values())


class TestServerOptions:
    @pytest.mark.parametrize("kwargs, fragment", [
        ({"shutdown_timeout": -1}, "--shutdown-timeout"), ({"max_request_bytes": 0}, "--max-request-bytes"),
        ({"body_read_timeout": 0}, "--body-read-timeout"), ({"metrics_prefix": "tgi"}, "--metrics-prefix"),
    ])
    def test_bad_values_are_rejected(self, kwargs, fragment):
        from atom_core.server.app import ServerOptions

        with pytest.raises(ValueError, match=fragment):
            ServerOptions(**kwargs)

    def test_cli_flags_reach_the_server(self, monkeypatch):
        import typer
        from typer.testing import CliRunner

        import atom_core.server.app as server_app
        from atomctl.serve import register

        seen = {}
        monkeypatch.setattr(server_app, "run_server", lambda config, *a, **k: seen.update(k))
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)
        args = ["serve", "--model", "/m", "--shutdown-timeout", "5", "--max-request-bytes", "1000",
                "--body-read-timeout", "2.5", "--metrics-prefix", "vllm"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert seen["options"] == server_app.ServerOptions(5.0, 1000, 2.5, "vllm")
        result = CliRunner().invoke(app, ["serve", "--model", "/m", "--metrics-prefix", "tgi"])
        assert result.exit_code == 1 and "--metrics-prefix" in result.output
