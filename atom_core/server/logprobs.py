"""Engine logprob entries -> the two OpenAI logprobs shapes.

An engine entry is `(logprob of the chosen token, {token_id: logprob} of the top-k)`, or None
(the first prompt token has no logprob). Token strings are single-token decodes, the way
vLLM reports them, so `tokens[i]` and the keys of `top_logprobs[i]` compare equal when the
chosen token is the most likely one (lm-eval's is_greedy relies on that).
"""
from __future__ import annotations


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._strings: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        s = self._strings.get(token_id)
        if s is None:
            if self.tokenizer is None:
                s = f"token_id:{token_id}"
            else:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._strings[token_id] = s
        return s

    def completion(self, token_ids: list[int], entries: list, text_offset: int) -> tuple[dict, int]:
        """The completions shape, offsets continuing from `text_offset`; returns (logprobs, next offset).

        top_logprobs holds the requested top-k plus the chosen token (as vLLM does).
        """
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            s = self.token(token_id)
            out["tokens"].append(s)
            out["text_offset"].append(text_offset)
            text_offset += len(s)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            chosen, top = entry
            out["token_logprobs"].append(chosen)
            tops: dict[str, float] = {}
            for t, lp in sorted(top.items(), key=lambda kv: -kv[1]):
                tops.setdefault(self.token(t), lp)  # two ids can decode alike (partial UTF-8): keep the likelier
            tops.setdefault(s, chosen)
            out["top_logprobs"].append(tops)
        return out, text_offset

    def chat(self, token_ids: list[int], entries: list, num_top: int) -> list[dict]:
        """The chat shape: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
        content = []
        for token_id, (chosen, top) in zip(token_ids, entries):
            s = self.token(token_id)
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[:num_top]
            content.append({
                "token": s, "logprob": chosen, "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": self.token(t), "logprob": lp, "bytes": list(self.token(t).encode("utf-8"))}
                                 for t, lp in ranked],
            })
        return content
