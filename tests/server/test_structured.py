"""Structured outputs: the sampler's bitmask, the engine (LLMEngine, windows and async scheduling
on), and the server's response_format / guided_* / structured_outputs with the OpenAI SDK."""
from __future__ import annotations

import json
import re

import pytest
import torch

from atom_core.loader.model_dir import DEMO_MODEL_DIR
from atom_core.sampling_params import SamplingParams
from atom_core.structured import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "checked": {"type": "boolean"},
                                           "words": {"type": "array", "items": {"type": "string", "enum": ["yes", "no"]},
                                                     "maxItems": 2}},
          "required": ["answer", "checked", "words"], "additionalProperties": False}


def _follows_schema(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"answer", "checked", "words"}
            and type(value["answer"]) is int and type(value["checked"]) is bool
            and len(value["words"]) <= 2 and all(w in ("yes", "no") for w in value["words"]))


def test_bitmask_masks_exactly_the_disallowed_tokens():
    import xgrammar as xgr

    from atom_core.model_ops.sampler import apply_token_bitmask

    vocab = 77
    allowed = torch.rand(3, vocab) < 0.3
    allowed[2] = True  # a row without a grammar
    bitmask = xgr.allocate_token_bitmask(3, vocab)
    words = torch.zeros(3, bitmask.shape[1] * 32, dtype=torch.int64)
    words[:, :vocab] = allowed.long()
    packed = (words.view(3, -1, 32) << torch.arange(32)).sum(-1)
    bitmask.copy_(torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32))
    logits = torch.randn(3, vocab)
    ours = apply_token_bitmask(logits, bitmask)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask)
    assert torch.equal(ours, reference)
    assert torch.equal(ours == float("-inf"), ~allowed)


class TestParams:
    @pytest.mark.parametrize("kwargs,match", [
        ({}, "exactly one of"), ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"json": {"type": "nope"}}, "invalid structured output json"), ({"json": "{not json"}, "not JSON"),
        ({"regex": "(a"}, "invalid structured output regex"), ({"choice": []}, "non-empty list"),
        ({"grammar": "root ::= "}, "invalid structured output grammar"),
    ])
    def test_bad_constraint_is_a_value_error(self, kwargs, match):
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**kwargs)

    def test_min_tokens_is_refused_with_a_grammar(self):
        with pytest.raises(ValueError, match="min_tokens"):
            SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(json_object=True))

    def test_grammar_requests_take_one_token_per_step(self):
        assert not SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")).allows_multi_step


class TestEngine:
    @pytest.fixture(scope="class")
    @classmethod
    def demo(cls):
        from atom_core import LLMEngine

        return LLMEngine(str(DEMO_MODEL_DIR), device="cpu", kv_cache_memory_gb=0.05, max_model_len=512)

    def _prompt(self, engine, text="123 + 456"):
        return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                    add_generation_prompt=True)

    def test_schema_is_followed_exactly_alongside_free_requests(self, demo):
        """Windows of 8 and async scheduling are on: the free request keeps them apart from the grammar's steps."""
        prompt = self._prompt(demo)
        free, schema, regex, choice = demo.generate([prompt] * 4, [
            SamplingParams(temperature=0, max_tokens=40),
            SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
            SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,6}-[0-9]{3}")),
            SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=["plus", "minus sign"])),
        ])
        assert free["text"].isdigit()  # free, the model answers with digits: no JSON object
        assert _follows_schema(json.loads(schema["text"])), schema["text"]
        assert schema["finish_reason"] == "stop"
        assert re.fullmatch(r"[a-z]{2,6}-[0-9]{3}", regex["text"]), regex["text"]
        assert choice["text"] in ("plus", "minus sign")
        assert demo.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]["text"] == free["text"]

    def test_grammar_end_ends_the_request_under_ignore_eos(self, demo):
        out = demo.generate([self._prompt(demo)], SamplingParams(temperature=0.8, seed=1, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))[0]
        assert out["text"] in ("yes", "no") and out["finish_reason"] == "stop"

    def test_tiny_random_model_follows_the_schema(self, tiny_llama):
        from atom_core import LLMEngine

        engine = LLMEngine(str(tiny_llama), device="cpu", kv_cache_memory_gb=0.05, max_model_len=256,
                           async_scheduling=False, num_scheduler_steps=1)
        engine.generate(["Hello"], SamplingParams(max_tokens=4))
        assert engine.core.grammars is None  # requests without a grammar build nothing
        outs = engine.generate(["Hello world"] * 2, [
            SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
            SamplingParams(temperature=0.7, seed=5, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA))])
        for out in outs:
            if out["finish_reason"] == "stop":
                assert _follows_schema(json.loads(out["text"])), out["text"]
            else:  # a random model may run to max_tokens inside a string: still a prefix of valid JSON
                assert out["text"].startswith('{"answer": ')
        assert not engine.core.grammars.matchers and not engine.core._needs_known_tokens()  # ended: forgotten
        [rid] = engine.add_request(["Hello"], SamplingParams(max_tokens=50, structured_outputs=StructuredOutputsParams(json=SCHEMA)))
        engine.step()
        assert rid in engine.core.grammars
        engine.abort_request(rid)
        assert not engine.core.grammars.matchers

    def test_bad_schema_is_refused_before_queueing(self, demo):
        with pytest.raises(ValueError, match="invalid structured output"):
            demo.generate(["1 + 1"], SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= x")))


@pytest.fixture
def demo_server(demo_tools_server):
    return demo_tools_server


class TestServer:
    def _chat(self, server, stream=False, **kw):
        client = server.openai()
        kw = dict(model=server.model_name, messages=[{"role": "user", "content": "123 + 456"}], temperature=0,
                  max_tokens=80) | kw
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True) if c.choices)

    @pytest.mark.parametrize("stream", [False, True])
    def test_json_schema_is_obeyed_exactly(self, demo_server, stream):
        assert self._chat(demo_server, max_tokens=8) == "469"  # unconstrained: digits
        fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA, "strict": True}}
        text = self._chat(demo_server, stream=stream, response_format=fmt)
        assert _follows_schema(json.loads(text)), text

    def test_json_object(self, demo_server):
        assert isinstance(json.loads(self._chat(demo_server, response_format={"type": "json_object"})), dict)

    @pytest.mark.parametrize("extra,check", [
        ({"guided_choice": ["alpha", "beta gamma"]}, lambda t: t in ("alpha", "beta gamma")),
        ({"guided_regex": r"\d{2}-[A-Z]{3}"}, lambda t: re.fullmatch(r"\d{2}-[A-Z]{3}", t)),
        ({"guided_grammar": 'root ::= "x" ("y" | "z")'}, lambda t: t in ("xy", "xz")),
        ({"structured_outputs": {"choice": ["north", "south"]}}, lambda t: t in ("north", "south")),
    ])
    def test_vllm_extras(self, demo_server, extra, check):
        text = self._chat(demo_server, extra_body=extra)
        assert check(text), text

    def test_completions_endpoint(self, demo_server):
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        out = demo_server.openai().completions.create(model=demo_server.model_name, prompt="1 + 2 =", max_tokens=30,
                                                      temperature=0, extra_body={"guided_json": json.dumps(schema)})
        assert json.loads(out.choices[0].text) in ({"ok": True}, {"ok": False})

    @pytest.mark.parametrize("body,param,match", [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "Unsupported type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "needs json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "Input should be"),
        ({"guided_regex": "(a"}, "guided_regex", "parenthesis"),
        ({"guided_choice": []}, "guided_choice", "at least 1 item"),
        ({"guided_choice": ["a", ""]}, "guided_choice.1", "non-empty string"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one output constraint"),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"yaml": "x"}}, "structured_outputs.yaml", "unsupported field"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens", "structured outputs"),
    ])
    def test_bad_constraint_is_a_400(self, demo_server, body, param, match):
        import httpx

        r = httpx.post(f"{demo_server.url}/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "1 + 1"}], **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and re.search(match, err["message"]), err
