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


def test_under_a_grammar_only_a_written_think_is_reasoning():
    for name in ("qwen3", "deepseek_r1"):
        parser = make_reasoning_parser(name, "<|im_start|>assistant\n<think>\n", constrained=True)
        assert parser.split('{"answer": 579}', final=True) == ("", '{"answer": 579}')
        assert parser.split("<think>adding</think>579", final=True) == ("adding", "579")


class TestServer:
    """`--reasoning-parser qwen3` on the shared demo server. The demo model never thinks, so a
    guided regex writes the <think> block; its plain answers stay content."""

    REGEX = r"<think>[a-z]{3,6}</think>[0-9]{2}"

    def _create(self, server, stream: bool, **kw):
        client = server.openai()
        kw = dict(model=server.model_name, messages=[{"role": "user", "content": "123 + 456"}], temperature=0,
                  max_tokens=30) | kw
        if not stream:
            msg = client.chat.completions.create(**kw).choices[0].message
            return msg.reasoning_content, msg.content
        reasoning = content = ""
        for chunk in client.chat.completions.create(**kw, stream=True):
            if chunk.choices:
                reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                content += chunk.choices[0].delta.content or ""
        return reasoning or None, content

    @pytest.mark.parametrize("stream", [False, True])
    def test_think_block_becomes_reasoning_content(self, demo_tools_server, stream):
        reasoning, content = self._create(demo_tools_server, stream, extra_body={"guided_regex": self.REGEX})
        assert 3 <= len(reasoning) <= 6 and reasoning.isalpha() and content.isdigit() and len(content) == 2

    def test_plain_answer_stays_content(self, demo_tools_server):
        reasoning, content = self._create(demo_tools_server, False, max_tokens=8)
        assert reasoning is None and content.isdigit()
