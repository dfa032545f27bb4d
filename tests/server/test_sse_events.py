"""Stream events encode the envelope once (ChoiceEvents) and still equal the plain encoding."""
from __future__ import annotations

import json

import pytest

from atom_core.server.serving import ChoiceEvents, sse

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m\u00e9/\"x\"", "choices": []}


@pytest.mark.parametrize("choice", [
    {"index": 0, "text": "h\u00e9llo \"quoted\" \\ \n", "logprobs": None, "finish_reason": None},
    {"index": 3, "delta": {"content": "\U0001f642"}, "finish_reason": "stop",
     "logprobs": {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]}},
    {"index": 1, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": 1}"}}]},
     "logprobs": None, "finish_reason": None},
])
def test_an_event_equals_the_whole_chunk_encoded(choice):
    event = ChoiceEvents(HEAD).event(choice)
    assert event == sse(HEAD | {"choices": [choice]})
    assert json.loads(event.removeprefix("data: ")) == HEAD | {"choices": [choice]}


def test_an_envelope_whose_choices_are_not_last_is_refused():
    with pytest.raises(AssertionError, match="choices"):
        ChoiceEvents({"choices": [], "id": "x"})
