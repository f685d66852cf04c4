"""An image part's URL -> the image file's bytes, under the server's rules (MultiModalConfig).

    data:image/png;base64,...   always (the bytes are in the request); base64 only, as vLLM
    http(s)://host/...          only to --allowed-media-domains (none by default: fetching is
                                off), within --media-fetch-timeout-s and --max-image-bytes, no
                                redirects followed (a redirect could leave the allowed domains)
    file:///path                only under --allowed-local-media-path (unset by default)

Every refusal is a ValueError whose message says what is wrong and, for a setting, which flag
changes it; the chat routes turn it into a 400 naming the image part. Fetching uses httpx,
synchronously: the chat routes prepare a request off the event loop (ServerState.run_off_loop).
"""

from __future__ import annotations

import base64
import binascii
import os
from urllib.parse import unquote, urlsplit

from deepinfer.multimodal.config import MultiModalConfig


class MediaLoader:
    def __init__(self, config: MultiModalConfig) -> None:
        self.config = config

    def load(self, url: object) -> bytes:
        if not isinstance(url, str) or not url:
            raise ValueError("an image part needs a URL (a data: URL with base64 image data, or an http(s) URL)")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url)
        if scheme in ("http", "https"):
            return self._fetch(url)
        if scheme == "file":
            return self._file(url)
        shown = url if len(url) <= 40 else url[:40] + "..."
        raise ValueError(f"image URL {shown!r}: unsupported scheme; use a data: URL (base64) or http(s)")

    def _too_large(self, size: int | str) -> ValueError:
        return ValueError(f"image too large: {size} bytes, over this server's limit of {self.config.max_image_bytes} "
                          "bytes (--max-image-bytes)")

    def _data_url(self, url: str) -> bytes:
        header, sep, payload = url[len("data:"):].partition(",")
        if not sep:
            raise ValueError("a data: URL needs a comma between its media type and its data")
        params = header.split(";")
        media_type = params[0].strip().lower()
        if media_type and not media_type.startswith("image/"):
            raise ValueError(f"a data: URL of media type {media_type!r} is not an image (image/png, image/jpeg, ...)")
        if "base64" not in [p.strip().lower() for p in params[1:]]:
            raise ValueError("a data: URL for an image must be base64-encoded (data:image/png;base64,...)")
        if len(payload) * 3 // 4 > self.config.max_image_bytes + 3:
            raise self._too_large(f"about {len(payload) * 3 // 4}")
        try:
            data = base64.b64decode(payload.strip(), validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"the data: URL's base64 data is invalid: {e}") from None
        if len(data) > self.config.max_image_bytes:
            raise self._too_large(len(data))
        return data

    def _allowed_host(self, host: str) -> bool:
        for domain in self.config.allowed_media_domains:
            domain = domain.lower().strip(".")
            if domain == "*" or host == domain or host.endswith("." + domain):
                return True
        return False

    def _fetch(self, url: str) -> bytes:
        import httpx

        host = (urlsplit(url).hostname or "").lower()
        if not self.config.allowed_media_domains:
            raise ValueError("fetching image URLs is off on this server: send the image as a data: URL "
                             "(base64), or start the server with --allowed-media-domains")
        if not host or not self._allowed_host(host):
            raise ValueError(f"image URL host {host!r} is not in this server's --allowed-media-domains")
        limit, timeout = self.config.max_image_bytes, self.config.media_fetch_timeout_s
        try:
            with httpx.Client(timeout=timeout, follow_redirects=False) as client, client.stream("GET", url) as reply:
                if reply.is_redirect:
                    raise ValueError(f"fetching the image URL got a redirect ({reply.status_code}); redirects are "
                                     "not followed: send the final URL")
                if reply.status_code != 200:
                    raise ValueError(f"fetching the image URL failed: HTTP {reply.status_code}")
                declared = reply.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > limit:
                    raise self._too_large(int(declared))
                body = bytearray()
                for piece in reply.iter_bytes():
                    body += piece
                    if len(body) > limit:
                        raise self._too_large(f"more than {limit}")
                return bytes(body)
        except httpx.TimeoutException:
            raise ValueError(f"fetching the image URL timed out after {timeout:g}s (--media-fetch-timeout-s)") from None
        except httpx.HTTPError as e:
            raise ValueError(f"fetching the image URL failed: {type(e).__name__}: {e}") from None

    def _file(self, url: str) -> bytes:
        root = self.config.allowed_local_media_path
        if not root:
            raise ValueError("file:// image URLs are off on this server (--allowed-local-media-path)")
        path = os.path.realpath(unquote(urlsplit(url).path))
        base = os.path.realpath(root)
        if os.path.commonpath([path, base]) != base:
            raise ValueError("the file:// image URL is outside this server's --allowed-local-media-path")
        try:
            size = os.path.getsize(path)
            if size > self.config.max_image_bytes:
                raise self._too_large(size)
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"cannot read the file:// image: {e.strerror}") from None
