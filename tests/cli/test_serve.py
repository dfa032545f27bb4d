"""`atomctl serve` option handling (the server itself is tested in tests/server)."""
import pytest
import typer
from typer.testing import CliRunner

from atom_core.envs import read_envs


@pytest.fixture
def serve_calls(monkeypatch):
    """Invoke `atomctl serve` with run_server replaced; returns (invoke, the kwargs run_server got)."""
    import atom_core.server.app as server_app
    from atomctl.serve import register

    seen = {}
    monkeypatch.setattr(server_app, "run_server", lambda config, *a, **k: seen.update(k))
    app = typer.Typer()
    register(app)
    app.callback()(lambda: None)

    def invoke(*args):
        result = CliRunner().invoke(app, ["serve", "--model", "/m", *args])
        assert result.exit_code == 0, result.output
        return seen

    return invoke


class TestApiKey:
    def test_no_flag_and_no_env_means_no_key(self, monkeypatch, serve_calls):
        monkeypatch.delenv("ATOM_API_KEY", raising=False)
        assert serve_calls()["api_key"] is None

    def test_env_var_is_used_without_the_flag(self, monkeypatch, serve_calls):
        monkeypatch.setenv("ATOM_API_KEY", "sk-from-env")
        assert serve_calls()["api_key"] == "sk-from-env"

    def test_flag_overrides_env_var(self, monkeypatch, serve_calls):
        monkeypatch.setenv("ATOM_API_KEY", "sk-from-env")
        assert serve_calls("--api-key", "sk-from-flag")["api_key"] == "sk-from-flag"

    def test_env_key_is_read_in_envs_and_kept_out_of_repr(self):
        envs = read_envs({"ATOM_API_KEY": " sk-secret "})
        assert envs.api_key == "sk-secret"
        assert "sk-secret" not in repr(envs)
        assert read_envs({"ATOM_API_KEY": ""}).api_key is None


class TestImpliedReasoningParser:
    """GPT-OSS checkpoints split Harmony's analysis channel into reasoning_content without a flag
    (as vLLM does); the flag still wins, and other families get no parser."""

    @pytest.fixture(scope="class")
    def gpt_oss_dir(self, tmp_path_factory):
        from tests.models.test_gpt_oss import build_tiny_gpt_oss

        return build_tiny_gpt_oss(tmp_path_factory.mktemp("tiny_gpt_oss_serve"))

    def _parser(self, serve_calls_for, model, *args):
        return serve_calls_for(model, *args)["chat_options"].reasoning_parser

    @pytest.fixture
    def serve_calls_for(self, monkeypatch):
        import atom_core.server.app as server_app
        from atomctl.serve import register

        seen = {}
        monkeypatch.setattr(server_app, "run_server", lambda config, *a, **k: seen.update(k))
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)

        def invoke(model, *args):
            result = CliRunner().invoke(app, ["serve", "--model", str(model), *args])
            assert result.exit_code == 0, result.output
            return seen

        return invoke

    def test_gpt_oss_gets_the_harmony_parser(self, serve_calls_for, gpt_oss_dir):
        assert self._parser(serve_calls_for, gpt_oss_dir) == "gpt_oss"

    def test_the_flag_wins(self, serve_calls_for, gpt_oss_dir):
        assert self._parser(serve_calls_for, gpt_oss_dir, "--reasoning-parser", "qwen3") == "qwen3"

    def test_other_families_get_none(self, serve_calls_for):
        assert self._parser(serve_calls_for, "demo") is None

    def test_unreadable_model_leaves_it_to_the_engine(self, serve_calls_for):
        assert self._parser(serve_calls_for, "/no/such/model") is None


class TestServingGraphs:
    """serve's default graphs: full_and_piecewise up to 2,048 tokens where the engine captures graphs
    (mixed prefill + decode steps replay too); an explicit mode or bucket list wins; elsewhere the
    engine's default, and bucket sizes that no piecewise graph would use are refused."""

    @pytest.fixture
    def served(self, monkeypatch):
        from tests.cli.test_engine_options import _serve_config

        return lambda *args: _serve_config(monkeypatch, list(args))

    def _graphs(self, served, *args):
        result, config = served(*args)
        assert result.exit_code == 0, result.output
        return config.compile.cudagraph_mode, config.piecewise_sizes

    def test_a_gpu_server_replays_mixed_steps_up_to_2048_tokens(self, served):
        from atom_core.config import SERVE_PIECEWISE_SIZES

        assert self._graphs(served, "--device", "cuda") == ("full_and_piecewise", SERVE_PIECEWISE_SIZES)

    def test_a_smaller_budget_is_the_largest_bucket(self, served):
        mode, sizes = self._graphs(served, "--device", "cuda", "--max-num-batched-tokens", "1000")
        assert mode == "full_and_piecewise" and sizes[-2:] == (960, 1000)

    def test_an_explicit_mode_wins(self, served):
        assert self._graphs(served, "--device", "cuda", "--cudagraph-mode", "full_decode_only")[0] == "full_decode_only"
        assert self._graphs(served, "--device", "cuda", "--cudagraph-mode", "piecewise")[1][-1] == 512

    def test_sizes_alone_are_the_buckets(self, served):
        assert self._graphs(served, "--device", "cuda", "--piecewise-capture-sizes", "8,16") == (
            "full_and_piecewise", (8, 16))

    @pytest.mark.parametrize("args", [["--device", "cpu"], ["--device", "cuda", "--enforce-eager"],
                                      ["--device", "cuda", "--level", "2"],
                                      ["--device", "cuda", "-dp", "2", "--enable-expert-parallel"]],
                             ids=["cpu", "eager", "level2", "dp-ep"])
    def test_no_graphs_or_replicas_sharing_experts_keep_the_engine_default(self, served, args):
        assert self._graphs(served, *args)[0] == "full_decode_only"

    def test_sizes_where_no_piecewise_graph_is_made_are_an_error(self, served):
        result, config = served("--device", "cpu", "--piecewise-capture-sizes", "8,16")
        assert result.exit_code != 0 and config is None
        assert "--piecewise-capture-sizes" in result.output and "only used with" in result.output


class TestPositionalModel:
    """vLLM's `serve MODEL` beside --model: either one names the model (and the served name);
    both may be given only when they agree."""

    @pytest.fixture
    def serve(self, monkeypatch):
        import atom_core.server.app as server_app
        from atomctl.serve import register

        seen = {}

        def run_server(config, host, port, served_name, **kwargs):
            seen.update(model=config.model.model, served_name=served_name)

        monkeypatch.setattr(server_app, "run_server", run_server)
        app = typer.Typer()
        register(app)
        app.callback()(lambda: None)

        def invoke(*args):
            seen.clear()
            return CliRunner().invoke(app, ["serve", *args]), dict(seen)

        return invoke

    def test_positional_names_the_model_and_the_served_name(self, serve, tiny_llama):
        result, seen = serve(str(tiny_llama))
        assert result.exit_code == 0, result.output
        assert seen == {"model": str(tiny_llama), "served_name": str(tiny_llama)}

    def test_the_flag_alone_still_works(self, serve, tiny_llama):
        result, seen = serve("--model", str(tiny_llama))
        assert result.exit_code == 0, result.output
        assert seen == {"model": str(tiny_llama), "served_name": str(tiny_llama)}

    def test_positional_demo_is_the_built_in_model(self, serve):
        from atom_core.loader.model_dir import DEMO_MODEL_DIR

        result, seen = serve("demo")
        assert result.exit_code == 0, result.output
        assert seen == {"model": str(DEMO_MODEL_DIR), "served_name": "demo"}

    def test_both_agreeing_is_accepted(self, serve, tiny_llama):
        result, seen = serve(str(tiny_llama), "--model", str(tiny_llama))
        assert result.exit_code == 0, result.output
        assert seen["model"] == str(tiny_llama)

    @pytest.mark.parametrize("flag", ["demo", "/other/model"])
    def test_both_different_is_an_error_naming_both(self, serve, tiny_llama, flag):
        result, seen = serve(str(tiny_llama), "--model", flag)
        assert result.exit_code == 1 and seen == {}
        assert "the model is given twice" in result.output
        assert repr(str(tiny_llama)) in result.output and repr(flag) in result.output


class TestMediaOptions:
    def test_flags_reach_the_server_options(self, serve_calls, tmp_path):
        media = serve_calls("--allowed-local-media-path", str(tmp_path), "--limit-mm-per-prompt", '{"image": 3}',
                            "--media-fetch-timeout", "2.5", "--max-media-bytes", "1000")["options"].media
        assert (media.allowed_local_media_path, media.limit_images_per_prompt) == (tmp_path.resolve(), 3)
        assert (media.media_fetch_timeout, media.max_media_bytes) == (2.5, 1000)
        default = serve_calls()["options"].media
        assert default.allowed_local_media_path is None and default.limit_images_per_prompt == 16
        assert default.allowed_media_domains is None
        media = serve_calls("--allowed-media-domains", "Upload.Example.org", "--allowed-media-domains", "cdn.test")
        assert media["options"].media.allowed_media_domains == ("upload.example.org", "cdn.test")

    @pytest.mark.parametrize("args, fragment", [
        (["--limit-mm-per-prompt", "4"], 'expected {"image": N}'),
        (["--limit-mm-per-prompt", "{bad"], "expected JSON"),
        (["--limit-mm-per-prompt", '{"video": 1}'], "images are the only modality"),
        (["--limit-mm-per-prompt", '{"image": -1}'], "expected an integer >= 0"),
        (["--allowed-local-media-path", "/no/such/dir"], "is not a directory"),
        (["--media-fetch-timeout", "0"], "--media-fetch-timeout"),
        (["--max-media-bytes", "0"], "--max-media-bytes"),
        (["--allowed-media-domains", "https://example.org"], "--allowed-media-domains"),
        (["--allowed-media-domains", "example.org:8080"], "no scheme, port or path"),
    ])
    def test_bad_values_are_one_line_errors(self, monkeypatch, args, fragment):
        import atom_core.server.app as server_app
        from atomctl.main import app

        monkeypatch.setattr(server_app, "run_server", lambda *a, **k: 0)
        result = CliRunner().invoke(app, ["serve", "--model", "/m", *args])
        assert result.exit_code == 1 and fragment in result.stderr, result.output
