"""LoRA over the OpenAI API: `atomctl serve --enable-lora` as a real subprocess on the tiny llama."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from atom_core.sampling_params import SamplingParams
from tests.server.conftest import MAX_MODEL_LEN, start_server

PROMPT = [5, 17, 33, 80, 120, 7]


@pytest.fixture(scope="module")
def lora_server(lora_base, adapters, tmp_path_factory):
    srv = start_server(lora_base, tmp_path_factory.mktemp("lora_serve"), "--enable-lora", "--lora-modules",
                       f"all8={adapters['all8']}", "--lora-modules", f"attn4rs={adapters['attn4rs']}",
                       "--max-loras", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(lora_base, adapters):
    from atom_core import LLMEngine

    return LLMEngine(str(lora_base), device="cpu", kv_cache_memory_gb=0.05, max_model_len=MAX_MODEL_LEN,
                     enable_lora=True, lora_modules=[f"{n}={p}" for n, p in adapters.items()], max_loras=3)


def _complete(srv, model: str, prompt=PROMPT) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})


def _expected(reference, lora) -> str:
    return reference.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), lora=lora)[0]["text"]


def test_models_lists_adapters_with_their_parent(lora_server, adapters):
    data = httpx.get(f"{lora_server.url}/v1/models", timeout=10).json()["data"]
    base = lora_server.model_name
    assert [m["id"] for m in data] == [base, "all8", "attn4rs"]
    assert data[1]["parent"] == base and data[1]["root"] == str(adapters["all8"])


def test_completions_and_chat_pick_the_adapter_by_model(lora_server, reference):
    for model, lora in ((lora_server.model_name, None), ("all8", "all8"), ("attn4rs", "attn4rs")):
        response = _complete(lora_server, model)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == _expected(reference, lora)
    chat = httpx.post(f"{lora_server.url}/v1/chat/completions", timeout=60, json={
        "model": "all8", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text


def test_responses_and_messages_pick_the_adapter_by_model(lora_server):
    """The agent APIs name an adapter the same way: each answers what chat completions answers for the same
    turn and model, and echoes the adapter's name."""
    url, turn = lora_server.url, [{"role": "user", "content": "hi"}]
    for model in (lora_server.model_name, "all8"):
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "messages": turn, "max_tokens": 5, "temperature": 0}).json()
        text = chat["choices"][0]["message"]["content"]
        responses = httpx.post(f"{url}/v1/responses", timeout=60, json={
            "model": model, "input": turn, "max_output_tokens": 5, "temperature": 0})
        assert responses.status_code == 200, responses.text
        body = responses.json()
        assert body["model"] == model
        assert "".join(c["text"] for item in body["output"] if item["type"] == "message"
                       for c in item["content"]) == text
        messages = httpx.post(f"{url}/v1/messages", timeout=60, json={
            "model": model, "messages": turn, "max_tokens": 5, "temperature": 0})
        assert messages.status_code == 200, messages.text
        body = messages.json()
        assert body["model"] == model and "".join(b["text"] for b in body["content"] if b["type"] == "text") == text


def test_unknown_model_is_404(lora_server):
    response = _complete(lora_server, "nope")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "'all8'" in error["message"]


def test_load_use_and_unload_at_run_time(lora_server, adapters, reference):
    url = lora_server.url
    ok = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["mlp16"])})
    assert ok.status_code == 200 and "late" in ok.text
    assert _complete(lora_server, "late").json()["choices"][0]["text"] == _expected(reference, "mlp16")
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["mlp16"])})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert gone.status_code == 200
    assert _complete(lora_server, "late").status_code == 404
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_not_found"


def test_bad_adapters_get_400(lora_server, adapters, tmp_path):
    dora = tmp_path / "dora"
    shutil.copytree(adapters["all8"], dora)
    config = json.loads((dora / "adapter_config.json").read_text()) | {"use_dora": True}
    (dora / "adapter_config.json").write_text(json.dumps(config))
    for path, match in ((dora, "DoRA"), (tmp_path / "missing", "not a directory")):
        response = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)})
        assert response.status_code == 400 and match in response.json()["error"]["message"]
    body = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": "x"})
    assert body.status_code == 400  # lora_path missing


def test_a_bad_lora_module_fails_serve_at_start(lora_base, adapters, tmp_path):
    with pytest.raises(AssertionError, match="rank 16 is above --max-lora-rank 8"):
        start_server(lora_base, tmp_path, "--enable-lora", "--lora-modules", f"m={adapters['mlp16']}",
                     "--max-lora-rank", "8")


def test_routes_without_enable_lora_say_so():
    from atom_core.server.app import _add_error_handlers
    from atom_core.server.lora import lora_router

    app = FastAPI()
    _add_error_handlers(app)
    app.include_router(lora_router(None))
    client = TestClient(app)
    for route, body in (("load", {"lora_name": "a", "lora_path": "/x"}), ("unload", {"lora_name": "a"})):
        response = client.post(f"/v1/{route}_lora_adapter", json=body)
        assert response.status_code == 400 and "--enable-lora" in response.json()["error"]["message"]
