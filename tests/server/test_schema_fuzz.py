"""Schemathesis against the served OpenAPI document: every operation, old and new, gets generated
requests (valid and invalid) and must answer without a 5xx, in the schema it declares."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

# Generated lengths are what a fuzzed request may ask for; a few tokens keep every 200 cheap.
TOKEN_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "min_tokens": 2, "n": 2,
              "best_of": 2}
# Schemathesis's coverage phase (every field's boundary and wrong-type values, then each method the
# path does not serve) runs on every operation but these two: test_openai_api.py walks their
# documented bounds already, and their wide bodies would take most of the run.
COVERAGE_WALKED = "^/v1/(chat/)?completions$"


@pytest.fixture(scope="module")
def srv(demo_tools_server):
    return demo_tools_server


@pytest.fixture(scope="module")
def served_schema(srv):
    config = schemathesis.Config.from_dict(
        {"operations": [{"include-path-regex": COVERAGE_WALKED, "phases": {"coverage": {"enabled": False}}}]})
    return schemathesis.openapi.from_url(f"{srv.url}/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("served_schema")


def cap_lengths(body):
    """Caps the token-count fields of a JSON body in place; a value of the wrong type or out of
    range stays as drawn (it is the rejection under test)."""
    if isinstance(body, dict):
        for field, cap in TOKEN_CAPS.items():
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                body[field] = cap


@schema.parametrize()
@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_responses_match_the_schema(case, srv):
    cap_lengths(case.body)
    case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)


def test_server_serves_after_the_fuzz_run(srv):
    r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
