"""Bad image input over the API gets a clear 400 and the next request still succeeds: corrupt base64, bytes
that are no image, a non-image data: type, an image over --max-media-bytes, a file outside
--allowed-local-media-path (or any file without it), too many images (--limit-mm-per-prompt), an http URL
that fails, is too slow (--media-fetch-timeout) or too large, `detail` other than auto, images to a
text-only model, a host outside --allowed-media-domains (also after a redirect). http(s) and file URLs that are allowed serve the same output as a data: URL."""
from __future__ import annotations

import asyncio
import base64
import http.server
import threading
import time

import httpx
import pytest

from atom_core.server.media import MediaFetcher, MediaOptions
from atom_core.server.protocol import APIError
from tests.server.conftest import start_server
from tests.server.test_images_api import data_url
from tests.tiny_vlm import build_tiny_vlm, png_bytes, synthetic_image

IMAGE = synthetic_image(11, (50, 37))
PNG = png_bytes(IMAGE)
MAX_BYTES = 4 * len(PNG)
BIG = png_bytes(synthetic_image(5, (400, 400)))  # noise compresses badly: well over MAX_BYTES


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path == "/to-ip.png":  # a redirect to the same server under its IP address
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_port}/a.png")
            self.end_headers()
            return
        body = {"/a.png": PNG, "/slow.png": PNG, "/big.png": BIG}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "a.png").write_bytes(PNG)
    (root / "outside.png").write_bytes(PNG)
    return root


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory, media_dir):
    path = build_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm_errors"), "qwen3_5", seed=1)
    srv = start_server(path, tmp_path_factory.mktemp("serve_vlm_errors"),
                       "--allowed-local-media-path", str(media_dir / "allowed"), "--limit-mm-per-prompt",
                       '{"image": 2}', "--media-fetch-timeout", "1", "--max-media-bytes", str(MAX_BYTES))
    yield srv
    srv.stop()


def _post(server, urls: list, detail: str | None = None) -> httpx.Response:
    parts = [{"type": "image_url", "image_url": {"url": u} | ({"detail": detail} if detail else {})} for u in urls]
    body = {"messages": [{"role": "user", "content": parts + [{"type": "text", "text": "What is it?"}]}],
            "max_tokens": 3, "temperature": 0}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


BAD = {
    "corrupt_base64": ("data:image/png;base64,iVBORw0KG!!!", "invalid base64"),
    "not_an_image": ("data:image/png;base64," + base64.b64encode(b"just some text, no pixels").decode(),
                     "cannot decode the image"),
    "text_media_type": ("data:text/plain;base64," + base64.b64encode(PNG).decode(), "is no image"),
    "not_base64_encoded": ("data:image/png,rawbytes", "must be base64"),
    "oversize": ("data:image/png;base64," + base64.b64encode(BIG).decode(), "--max-media-bytes"),
    "unknown_scheme": ("ftp://example.com/a.png", "unsupported image URL"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_data_urls_get_a_400_and_the_next_request_succeeds(vlm_server, name):
    url, message = BAD[name]
    response = _post(vlm_server, [url])
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "messages"
    _text(_post(vlm_server, [data_url(IMAGE)]))


def test_local_files_only_under_the_allowed_path(vlm_server, media_dir):
    expected = _text(_post(vlm_server, [data_url(IMAGE)]))
    assert _text(_post(vlm_server, [f"file://{media_dir / 'allowed' / 'a.png'}"])) == expected
    for outside in (f"file://{media_dir / 'outside.png'}", f"file://{media_dir / 'allowed' / '..' / 'outside.png'}",
                    str(media_dir / "outside.png")):
        response = _post(vlm_server, [outside])
        assert response.status_code == 400 and "outside the allowed local media path" in response.text
    missing = _post(vlm_server, [f"file://{media_dir / 'allowed' / 'nope.png'}"])
    assert missing.status_code == 400 and "cannot read" in missing.text


def test_http_urls_are_fetched_with_limits(vlm_server, image_host):
    expected = _text(_post(vlm_server, [data_url(IMAGE)]))
    assert _text(_post(vlm_server, [f"{image_host}/a.png"])) == expected
    for path, message in (("/missing.png", "HTTP 404"), ("/slow.png", "--media-fetch-timeout"),
                          ("/big.png", "--max-media-bytes")):
        response = _post(vlm_server, [f"{image_host}{path}"])
        assert response.status_code == 400 and message in response.text, response.text
    _text(_post(vlm_server, [f"{image_host}/a.png"]))


def test_allowed_media_domains_hold_for_every_redirect(image_host):
    port = image_host.rsplit(":", 1)[1]
    fetcher = MediaFetcher(MediaOptions(allowed_media_domains=("localhost",)))

    async def fetch(url: str):
        return await fetcher.fetch(0, url)

    assert asyncio.run(fetch(f"http://localhost:{port}/a.png")) == PNG
    for url in (f"http://127.0.0.1:{port}/a.png", f"http://localhost:{port}/to-ip.png"):
        with pytest.raises(APIError, match="image host '127.0.0.1' is not in --allowed-media-domains"):
            asyncio.run(fetch(url))
    assert asyncio.run(MediaFetcher(MediaOptions()).fetch(0, f"http://localhost:{port}/to-ip.png")) == PNG


def test_too_many_images_and_unsupported_detail(vlm_server):
    response = _post(vlm_server, [data_url(IMAGE)] * 3)
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_images"
    assert _post(vlm_server, [data_url(IMAGE)], detail="high").status_code == 400
    assert _post(vlm_server, [data_url(IMAGE)] * 2, detail="auto").status_code == 200


def test_truncating_a_prompt_with_images_is_refused_and_a_long_enough_limit_is_kept(vlm_server):
    parts = [{"type": "image_url", "image_url": {"url": data_url(IMAGE)}}, {"type": "text", "text": "What is it?"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 3, "temperature": 0}
    cut = httpx.post(f"{vlm_server.url}/v1/chat/completions", json=body | {"truncate_prompt_tokens": 4}, timeout=60)
    assert cut.status_code == 400, cut.text
    error = cut.json()["error"]
    assert error["param"] == "truncate_prompt_tokens" and "holds images" in error["message"]
    kept = httpx.post(f"{vlm_server.url}/v1/chat/completions", json=body | {"truncate_prompt_tokens": 4096},
                      timeout=60)
    assert kept.status_code == 200
    assert kept.json()["choices"][0]["message"]["content"] == _text(_post(vlm_server, [data_url(IMAGE)]))


def test_a_text_model_refuses_images_clearly(server):
    response = _post(server, [data_url(IMAGE)])
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "images_not_supported" and "takes no images" in error["message"]
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["input_modalities"] == ["text"]
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
