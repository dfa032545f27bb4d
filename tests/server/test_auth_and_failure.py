"""--api-key, and what clients see when the engine core process dies (one keyed server).

The engine-death test kills the module's engine core, so it stays last in the file.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, start_server

KEY = "sk-test-1234"


@pytest.fixture(scope="module")
def keyed_server(tiny_llama, tmp_path_factory):
    srv = start_server(tiny_llama, tmp_path_factory.mktemp("serve_keyed"), api_key=KEY)
    yield srv
    srv.stop()


class TestApiKey:
    @pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1/chat/completions", "/start_profile"])
    def test_missing_or_wrong_key_is_401(self, keyed_server, path):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.post(f"{keyed_server.url}{path}", json={"prompt": "x"}, headers=headers, timeout=10) \
                if path != "/v1/models" else httpx.get(f"{keyed_server.url}{path}", headers=headers, timeout=10)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"

    def test_bearer_scheme_is_case_insensitive(self, keyed_server):
        for scheme in ("bearer", "BEARER", "bEaReR"):
            r = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=10)
            assert r.status_code == 200, (scheme, r.text)
            r = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": f"{scheme} wrong"}, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

    def test_key_is_compared_exactly(self, keyed_server):
        for value in (f"Bearer {KEY.upper()}", f"Bearer {KEY}x", f"Basic {KEY}", f"Bearer{KEY}"):
            r = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": value}, timeout=10)
            assert r.status_code == 401, value

    def test_sdk_with_key_works(self, keyed_server):
        client = keyed_server.openai()
        assert [m.id for m in client.models.list().data] == [keyed_server.model_name]
        resp = client.completions.create(model=keyed_server.model_name, prompt="Hello", max_tokens=3)
        assert resp.usage.completion_tokens >= 1

    def test_sdk_without_key_fails(self, keyed_server):
        import openai as sdk

        client = sdk.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()

    def test_health_and_metrics_stay_open(self, keyed_server):
        assert httpx.get(f"{keyed_server.url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{keyed_server.url}/metrics", timeout=10).status_code == 200


class TestEngineDeath:
    def test_dead_core_fails_health_and_requests(self, keyed_server):
        srv = keyed_server
        outcome: dict = {}
        accepted = threading.Event()

        def long_stream():
            body = {"prompt": "Hello", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=30) as r:
                accepted.set()  # headers sent: from here on an error can only travel inside the stream
                outcome["stream"] = list(r.iter_lines())

        def long_request():
            body = {"prompt": "Hello world", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
            outcome["plain"] = httpx.post(f"{srv.url}/v1/completions", json=body, headers=srv.headers, timeout=30)

        # Both requests must be in flight when the core dies. A tiny model finishes a request in a
        # fraction of a second, so the core is frozen (SIGSTOP) once the plain request runs; the
        # stream then starts against the frozen core and the kill comes after its headers. Should the
        # plain request have finished before the freeze (its 200 reaches the thread at once), the
        # core is thawed and the request sent again.
        core = srv.core_pid()
        for _attempt in range(5):
            plain = threading.Thread(target=long_request)
            plain.start()
            deadline = time.monotonic() + 30
            while not re.search(r"^atom_num_requests_running\S* [1-9]",
                                httpx.get(f"{srv.url}/metrics", timeout=10).text, re.M):
                assert time.monotonic() < deadline, "the plain request never started running"
                time.sleep(0.005)
            os.kill(core, signal.SIGSTOP)
            plain.join(0.5)
            if plain.is_alive():
                break
            os.kill(core, signal.SIGCONT)
        else:
            pytest.fail("the plain request finished before the core could be frozen, five times")
        stream = threading.Thread(target=long_stream)
        stream.start()
        assert accepted.wait(30), "the stream was never accepted"
        threads = [plain, stream]
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a request hung after the engine core died"

        assert outcome["plain"].status_code == 503
        assert outcome["plain"].json()["error"]["code"] == "engine_dead"
        stream = [line for line in outcome["stream"] if line]
        assert '"engine_dead"' in stream[-2] and stream[-1] == "data: [DONE]"  # the error travels in the stream
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        with pytest.raises(openai.InternalServerError):
            srv.openai().completions.create(model=srv.model_name, prompt="Hello", max_tokens=2)
        r = httpx.post(f"{srv.url}/v1/chat/completions", headers=srv.headers, timeout=10,
                       json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert r.status_code == 503
        # Then the API process exits non-zero, so a supervisor restarts the server.
        assert srv.proc.wait(10) == 1, srv.log()
        assert time.monotonic() - killed < 5
        assert "exiting with status 1" in srv.log()
