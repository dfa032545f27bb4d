"""How adapters are named: --lora-modules in vLLM's forms (several NAME=PATH after one flag, the flag
repeated, JSON objects with base_model_name) and bad entries, and every endpoint's response `model`
echoing the adapter its request named."""
from __future__ import annotations

import json

import httpx
import pytest
from typer.testing import CliRunner

from atom_core.lora import LoRAModule, parse_lora_modules
from atomctl.engine_options import expand_lora_modules
from atomctl.main import app
from tests.server.conftest import start_server

CHAT = [{"role": "user", "content": "hi"}]


class TestParseLoRAModules:
    def test_name_path_and_json_forms(self):
        entries = ["a=/p/a", '{"name": "b", "path": "/p/b"}', '{"name": "c", "path": "/p/c", "base_model_name": "x"}',
                   "d = /p/d=e"]
        assert parse_lora_modules(entries) == [LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b"),
                                               LoRAModule("c", "/p/c", "x"), LoRAModule("d", "/p/d=e")]

    @pytest.mark.parametrize("entry,match", [
        ("nopath", "expected NAME=PATH or a JSON object"),
        ("=/p", "expected NAME=PATH"),
        ("a=", "expected NAME=PATH"),
        ('{"name": "a", "path": ', "not valid JSON"),
        ('{"name": "a"}', "'path' must be a non-empty string"),
        ('{"name": "", "path": "/p"}', "'name' must be a non-empty string"),
        ('{"name": "a", "path": "/p", "rank": 8}', r"unknown key\(s\) 'rank'; expected: name, path, base_model_name"),
        ('{"name": "a", "path": "/p", "base_model_name": 3}', "'base_model_name' must be a non-empty string"),
        ('{"name": "a", "path": 7}', "'path' must be a non-empty string"),
    ])
    def test_bad_entry_names_itself(self, entry, match):
        with pytest.raises(ValueError, match=match):
            parse_lora_modules([entry])

    def test_a_name_twice_is_refused_across_forms(self):
        with pytest.raises(ValueError, match="names 'a' twice"):
            parse_lora_modules(["a=/p", '{"name": "a", "path": "/q"}'])


class TestExpandLoRAModules:
    def test_values_after_one_flag_become_repeated_flags(self):
        args = ["serve", "--lora-modules", "a=/p", "b=/q", '{"name": "c", "path": "/r"}', "--port", "1"]
        assert expand_lora_modules(args) == ["serve", "--lora-modules", "a=/p", "--lora-modules", "b=/q",
                                             "--lora-modules", '{"name": "c", "path": "/r"}', "--port", "1"]

    def test_the_list_ends_at_what_is_not_an_entry(self):
        args = ["generate", "--lora-modules", "a=/p", "x = 1", "b=/q"]  # a prompt ends it
        assert expand_lora_modules(args) == args
        assert expand_lora_modules(["--lora-modules=a=/p", "b=/q", "--", "c=/d"]) == [
            "--lora-modules=a=/p", "--lora-modules", "b=/q", "--", "c=/d"]
        assert expand_lora_modules(["bench", "serve", "--lora-modules", "a,b"]) == ["bench", "serve", "--lora-modules",
                                                                                    "a,b"]


CLI_ARGS = ["--device", "cpu", "--num-kv-blocks", "32", "--max-tokens", "3", "--no-chat", "--json", "--enable-lora",
            "--max-loras", "2"]


def test_cli_takes_vllm_forms_and_refuses_bad_entries(lora_base, adapters):
    runner = CliRunner()
    entries = [f"a={adapters['all8']}", json.dumps({"name": "b", "path": str(adapters["attn4rs"])})]
    texts = {}
    for lora in ("a", "b"):
        result = runner.invoke(app, ["generate", "--model", str(lora_base), *CLI_ARGS, "--lora-modules", *entries,
                                     "--lora", lora, "hello"])
        assert result.exit_code == 0, result.output
        texts[lora] = result.output
    assert texts["a"] != texts["b"]
    bad = runner.invoke(app, ["generate", "--model", str(lora_base), *CLI_ARGS, "--lora-modules", '{"name": "a"}',
                              "hello"])
    assert bad.exit_code != 0 and "'path' must be a non-empty string" in bad.output, bad.output


@pytest.fixture(scope="module")
def named_server(lora_base, adapters, tmp_path_factory):
    """Two adapters after one --lora-modules: NAME=PATH and a JSON object naming its parent."""
    qv = json.dumps({"name": "tuned", "path": str(adapters["attn4rs"]), "base_model_name": "my-base"})
    srv = start_server(lora_base, tmp_path_factory.mktemp("lora_naming"), "--enable-lora", "--max-loras", "2",
                       "--lora-modules", f"all8={adapters['all8']}", qv)
    yield srv
    srv.stop()


def _post(srv, path: str, body: dict) -> httpx.Response:
    response = httpx.post(f"{srv.url}{path}", json=body | {"temperature": 0}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def _stream_models(srv, path: str, body: dict) -> set[str]:
    """The `model` of every SSE event that carries one (Anthropic's nests it under `message`)."""
    models = set()
    for line in _post(srv, path, body | {"stream": True}).text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            event = event.get("message") or event.get("response") or event
            if "model" in event:
                models.add(event["model"])
    return models


def test_models_lists_the_json_entry_with_its_parent(named_server, adapters):
    data = {m["id"]: m for m in httpx.get(f"{named_server.url}/v1/models", timeout=10).json()["data"]}
    assert data["all8"]["parent"] == named_server.model_name
    assert data["tuned"]["parent"] == "my-base" and data["tuned"]["root"] == str(adapters["attn4rs"])


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [5, 17, 33], "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3}),
    ("/v1/messages", {"messages": CHAT, "max_tokens": 3}),
])
def test_response_model_echoes_the_name_the_request_used(named_server, path, body):
    for model in ("all8", "tuned", named_server.model_name):
        request = body | {"model": model}
        assert _post(named_server, path, request).json()["model"] == model
        assert _stream_models(named_server, path, request) == {model}
