"""vLLM's /tokenize, /detokenize, /version and /ping on the session's demo tools server, with httpx."""
from __future__ import annotations

import httpx
import pytest

import atom_core
from tests.server.conftest import MAX_MODEL_LEN

CHAT = [{"role": "user", "content": "123 + 456"}]


@pytest.fixture(scope="module")
def srv(demo_tools_server):
    return demo_tools_server


def post(srv, path, body):
    return httpx.post(f"{srv.url}{path}", json=body, timeout=60)


def test_tokenize_a_prompt_and_back(srv):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(srv.model_name)
    r = post(srv, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    plain = post(srv, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode("Hello world", add_special_tokens=False) and plain["token_strs"] is None
    assert post(srv, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": "Hello world"}


def test_tokenize_messages_counts_the_chat_prompt(srv):
    r = post(srv, "/tokenize", {"messages": CHAT}).json()
    chat = srv.openai().chat.completions.create(model=srv.model_name, messages=CHAT, max_tokens=1)
    assert r["count"] == chat.usage.prompt_tokens
    without = post(srv, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert without["count"] < r["count"]


def test_version_and_ping(srv):
    assert httpx.get(f"{srv.url}/version", timeout=10).json() == {"version": atom_core.__version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{srv.url}/ping", timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("path, body, status, param, fragment", [
    ("/tokenize", {}, 400, "prompt", "exactly one of"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt", "exactly one of"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", ""),
    ("/tokenize", {"messages": []}, 400, "messages", "at least 1"),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "unsupported"),
    ("/detokenize", {"tokens": []}, 400, "tokens", "at least 1"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", ">= 0"),
    ("/detokenize", {"tokens": [10**7]}, 400, "tokens", "out of range"),
], ids=["neither", "both", "prompt_not_text", "empty_messages", "unknown_model", "unknown_field", "no_tokens",
        "negative_token", "token_out_of_range"])
def test_bad_input_is_a_400_then_the_next_request_works(srv, path, body, status, param, fragment):
    r = post(srv, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert post(srv, "/tokenize", {"prompt": "x"}).status_code == 200
