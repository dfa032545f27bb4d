"""`atomctl serve --method ngram`: the engine core process speculates; outputs equal plain
decoding and /metrics shows the counters."""
import httpx

from tests.server.conftest import MAX_MODEL_LEN, start_server


def test_served_greedy_output_and_metrics(tiny_llama, tmp_path):
    from atom_core import LLMEngine, SamplingParams

    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    plain = LLMEngine(str(tiny_llama), max_model_len=MAX_MODEL_LEN).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]["text"]
    server = start_server(tiny_llama, tmp_path, "--method", "ngram", "--num-speculative-tokens", "3",
                          "--ngram-min", "1", "--ngram-max", "3")
    try:
        body = {"model": server.model_name, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain
        metrics = server.metrics()
        assert metrics["atom_spec_decode_num_drafts_total"] > 0
        assert metrics["atom_spec_decode_num_draft_tokens_total"] >= metrics["atom_spec_decode_num_accepted_tokens_total"]
    finally:
        server.stop()
