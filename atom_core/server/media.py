"""Image URLs of a chat request -> their bytes, in the API process (the engine core never fetches):
`data:` URLs decoded, `http(s)` URLs fetched with a size and a time limit, `file:` URLs (and bare paths)
read only under the directory the operator allows (--allowed-local-media-path); with
--allowed-media-domains, http(s) URLs (and every redirect they take) only from those hosts. Every refusal is an
APIError (400) naming what was wrong; nothing here decodes the image (multimodal/media.py does).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import httpx

from atom_core.server.protocol import APIError

DEFAULT_LIMIT_PER_PROMPT = 16
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaOptions:
    """The server's media settings (atomctl serve flags of the same names)."""

    allowed_local_media_path: Path | None = None  # None: file URLs are refused
    limit_images_per_prompt: int = DEFAULT_LIMIT_PER_PROMPT
    media_fetch_timeout: float = 10.0  # seconds for one http(s) image, connect to last byte
    max_media_bytes: int = 20 * 1024 * 1024  # one image's encoded bytes, any source
    allowed_media_domains: tuple[str, ...] | None = None  # None: any host; else exact host names

    def __post_init__(self):
        if self.limit_images_per_prompt < 0:
            raise ValueError(f"invalid --limit-mm-per-prompt image={self.limit_images_per_prompt}; expected >= 0")
        if not self.media_fetch_timeout > 0:
            raise ValueError(f"invalid --media-fetch-timeout {self.media_fetch_timeout}; expected > 0")
        if self.max_media_bytes < 1:
            raise ValueError(f"invalid --max-media-bytes {self.max_media_bytes}; expected >= 1")
        if self.allowed_local_media_path is not None:
            path = Path(self.allowed_local_media_path)
            if not path.is_dir():
                raise ValueError(f"--allowed-local-media-path {path} is not a directory")
            object.__setattr__(self, "allowed_local_media_path", path.resolve())
        if self.allowed_media_domains is not None:
            domains = tuple(d.strip().lower() for d in self.allowed_media_domains)
            bad = [d for d in domains if not d or urllib.parse.urlsplit("//" + d).hostname != d]
            if bad or not domains:
                raise ValueError(f"invalid --allowed-media-domains {bad[0] if bad else ''!r}; expected host names "
                                 "such as upload.wikimedia.org (no scheme, port or path)")
            object.__setattr__(self, "allowed_media_domains", domains)


def parse_limit_mm_per_prompt(value: str | None) -> int:
    """vLLM's --limit-mm-per-prompt JSON, e.g. '{"image": 4}' -> 4 (None: the default)."""
    if value is None:
        return DEFAULT_LIMIT_PER_PROMPT
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f'invalid --limit-mm-per-prompt {value!r}: {e}; expected JSON such as {{"image": 4}}') from None
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise ValueError(f'invalid --limit-mm-per-prompt {value!r}: expected {{"image": N}} (images are the only '
                         "modality served)")
    count = limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"invalid --limit-mm-per-prompt image={count!r}; expected an integer >= 0")
    return count


def _error(index: int, message: str) -> APIError:
    return APIError(f"image {index}: {message}", param="messages", code="invalid_image")


class MediaFetcher:
    """Contract: `fetch_all(urls)` on the event loop; http requests run concurrently there, base64 decoding
    and file reads on threads; the first bad URL raises."""

    def __init__(self, options: MediaOptions):
        self.options = options

    def check_count(self, num_images: int) -> None:
        limit = self.options.limit_images_per_prompt
        if num_images > limit:
            raise APIError(f"the request has {num_images} images; at most {limit} per prompt are accepted "
                           "(--limit-mm-per-prompt)", param="messages", code="too_many_images")

    async def fetch_all(self, urls: list[str]) -> list[bytes]:
        self.check_count(len(urls))
        return list(await asyncio.gather(*(self.fetch(i, url) for i, url in enumerate(urls))))

    async def fetch(self, index: int, url: str) -> bytes:
        if url.startswith("data:"):  # base64 of up to --max-media-bytes: off the event loop
            return await asyncio.to_thread(self._data_url, index, url)
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme in ("http", "https"):
            return await self._http(index, url)
        if scheme == "file" or (not scheme and url.startswith("/")):
            return await asyncio.to_thread(self._local_file, index, url)
        raise _error(index, f"unsupported image URL {url[:64]!r}; expected a data:, http(s):// or file:// URL")

    def _data_url(self, index: int, url: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise _error(index, "a data: URL needs a ',' before its data")
        media_type, *params = header.split(";")
        if media_type and not media_type.lower().startswith("image/"):
            raise _error(index, f"a data: URL of type {media_type!r} is no image (expected image/*)")
        if "base64" not in params:
            raise _error(index, "a data: URL must be base64 encoded (data:image/...;base64,...)")
        if len(payload) * 3 // 4 > self.options.max_media_bytes:
            raise self._too_large(index, len(payload) * 3 // 4)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _error(index, f"invalid base64 in the data: URL ({e})") from None

    def _too_large(self, index: int, size: int) -> APIError:
        return _error(index, f"the image is {size} bytes; at most {self.options.max_media_bytes} are accepted "
                             "(--max-media-bytes)")

    def _check_host(self, index: int, url: httpx.URL | str) -> None:
        allowed = self.options.allowed_media_domains
        host = httpx.URL(url).host.lower()
        if allowed is not None and host not in allowed:
            raise _error(index, f"image host {host!r} is not in --allowed-media-domains")

    async def _http(self, index: int, url: str) -> bytes:
        limit = self.options.max_media_bytes

        async def check_redirect(request: httpx.Request) -> None:  # every hop, the first one included
            self._check_host(index, request.url)

        try:
            async with httpx.AsyncClient(timeout=self.options.media_fetch_timeout, follow_redirects=True,
                                         max_redirects=MAX_REDIRECTS,
                                         event_hooks={"request": [check_redirect]}) as client:
                async with asyncio.timeout(self.options.media_fetch_timeout):
                    async with client.stream("GET", url) as response:
                        if response.status_code != 200:
                            raise _error(index, f"fetching {url[:200]} gave HTTP {response.status_code}")
                        declared = response.headers.get("content-length")
                        if declared is not None and declared.isdigit() and int(declared) > limit:
                            raise self._too_large(index, int(declared))
                        chunks, size = [], 0
                        async for chunk in response.aiter_bytes():
                            size += len(chunk)
                            if size > limit:
                                raise self._too_large(index, size)
                            chunks.append(chunk)
                        return b"".join(chunks)
        except TimeoutError:
            raise _error(index, f"fetching {url[:200]} took over {self.options.media_fetch_timeout} s "
                                "(--media-fetch-timeout)") from None
        except httpx.HTTPError as e:
            raise _error(index, f"cannot fetch {url[:200]}: {type(e).__name__}: {e}") from None

    def _local_file(self, index: int, url: str) -> bytes:
        root = self.options.allowed_local_media_path
        if root is None:
            raise _error(index, "local files are not served; start the server with --allowed-local-media-path DIR "
                                "to allow the files under DIR")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme and parts.netloc not in ("", "localhost"):
            raise _error(index, f"file URL host {parts.netloc!r}: only local files (file:///path) are served")
        path = Path(urllib.parse.unquote(parts.path if parts.scheme else url))
        resolved = path.resolve()
        if not resolved.is_relative_to(root):
            raise _error(index, f"{path} is outside the allowed local media path {root}")
        try:
            size = resolved.stat().st_size
            if size > self.options.max_media_bytes:
                raise self._too_large(index, size)
            with open(resolved, "rb") as f:
                return f.read(self.options.max_media_bytes + 1)
        except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
            raise _error(index, f"cannot read {path}: {os.strerror(e.errno) if e.errno else e}") from None
