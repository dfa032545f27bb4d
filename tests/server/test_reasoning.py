"""Reasoning parsers on fixed model text (streamed = non-streamed), and `--reasoning-parser`
end to end with the OpenAI SDK on the demo model."""
from __future__ import annotations

import pytest

from atom_core.server.chat_output import ChatOutputParser
from atom_core.server.reasoning import make_reasoning_parser


def _split_streamed(name: str, prompt: str, text: str) -> tuple[str, str]:
    parser = ChatOutputParser(make_reasoning_parser(name, prompt), None, "none")
    reasoning = content = ""
    for end in range(1, len(text) + 1):
        delta = parser.delta(text[:end], final=end == len(text))
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
    return reasoning, content


@pytest.mark.parametrize("name,prompt,text,expected", [
    ("qwen3", "", "<think>\nLet me add.\n</think>\n\nThe sum is 579.", ("\nLet me add.\n", "The sum is 579.")),
    ("qwen3", "", "The sum is 579.", ("", "The sum is 579.")),  # thinking off: no <think>
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Adding.</think>579", ("Adding.", "579")),  # opened by the template
    ("qwen3", "", "<think>still thinking when max_tokens hit", ("still thinking when max_tokens hit", "")),
    ("deepseek_r1", "", "Adding 123 and 456.\n</think>\n\n579", ("Adding 123 and 456.\n", "579")),
    ("deepseek_r1", "", "<think>Adding.</think>579", ("Adding.", "579")),
    ("deepseek_r1", "", "no end tag yet", ("no end tag yet", "")),
    ("gpt_oss", "", "<|channel|>analysis<|message|>Adding 123 and 456.<|end|><|start|>assistant<|channel|>final<|message|>579",
     ("Adding 123 and 456.", "579")),
])
def test_splits_reasoning_streamed_and_not(name, prompt, text, expected):
    message = ChatOutputParser(make_reasoning_parser(name, prompt), None, "none").message(text)
    assert (message["reasoning_content"] or "", message["content"]) == expected
    assert _split_streamed(name, prompt, text) == expected


class TestServer:
    """The demo model writes no </think>: under deepseek_r1 (reasoning from the first token, as
    R1's template opens it) its whole answer is reasoning_content."""

    @pytest.fixture(scope="class")
    def server(self, tmp_path_factory):
        from atom_core.loader.model_dir import DEMO_MODEL_DIR
        from tests.server.conftest import start_server

        srv = start_server(DEMO_MODEL_DIR, tmp_path_factory.mktemp("reasoning"), "--reasoning-parser", "deepseek_r1")
        yield srv
        srv.stop()

    def test_reasoning_content_streamed_and_not(self, server):
        client = server.openai()
        kw = dict(model=server.model_name, messages=[{"role": "user", "content": "123 + 456"}], temperature=0, max_tokens=8)
        msg = client.chat.completions.create(**kw).choices[0].message
        assert msg.reasoning_content and not msg.content
        streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                           for c in client.chat.completions.create(**kw, stream=True) if c.choices)
        assert streamed == msg.reasoning_content

    def test_tools_without_auto_tool_choice_are_a_400(self, server):
        import openai

        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            server.openai().chat.completions.create(model=server.model_name, tools=tools,
                                                    messages=[{"role": "user", "content": "1 + 1"}])
