"""End to end: images through the real server (issue 45 item 2), driven by the openai and
anthropic SDKs, on the tiny random Gemma3ForConditionalGeneration with a chat tokenizer.

- an OpenAI image_url (data: URL) and an Anthropic base64 image block give transformers' greedy
  tokens for the prompt the chat template makes; a fetched http URL (a loopback server on the
  allow-list) gives the same answer as the same image inline; the Responses API takes input_image;
- twenty bad-image requests each get a 400 in their route's protocol, whose message says what is
  wrong and names the part; the server still serves afterwards.
"""

from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.e2e.server_process import free_port, start_server, stop_server
from tests.models.test_gemma3_vision_engine import NEW_TOKENS, data_url, encoded, hf_greedy, picture
from tests.models.tiny_models import tiny_vision_chat_model

MODEL = "tiny-gemma3-vision"
MAX_IMAGE_BYTES = 200_000
MAX_PIXELS = 40_000


GOOD = encoded(picture(1))
NOISE = np.random.default_rng(9).integers(0, 256, MAX_IMAGE_BYTES + 10, dtype=np.uint8).tobytes()


class Files(BaseHTTPRequestHandler):
    """The loopback server image URLs are fetched from."""

    def do_GET(self):   # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            time.sleep(2.5)
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.end_headers()
            return
        body = {"/ok.png": GOOD, "/slow.png": GOOD, "/text.png": b"just some text", "/big.png": NOISE}.get(self.path)
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def files():
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Files)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("vision_server_model"))
    return tiny_vision_chat_model(directory), directory


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    srv = start_server(str(tmp_path_factory.mktemp("vision_server") / "server.log"), "--model", checkpoint[1],
                       "--max-model-len", "512", "--dtype", "float32", "--max-num-batched-tokens", "32",
                       "--limit-mm-per-prompt", '{"image": 2}', "--allowed-media-domains", "127.0.0.1",
                       "--media-fetch-timeout-s", "1", "--max-image-bytes", str(MAX_IMAGE_BYTES),
                       "--max-image-pixels", str(MAX_PIXELS), "--served-model-name", MODEL)
    yield srv
    stop_server(srv)


def prompt_ids(directory: str, messages: list[dict]) -> list[int]:
    """The prompt the server's chat route makes (the recipe's render, images expanded)."""
    from deepinfer_recipe import parse_request

    from deepinfer.chat import make_encoder
    from deepinfer.models.loader import load_model_source

    return make_encoder(load_model_source(directory)).encode(parse_request("chat", {"messages": messages})).token_ids


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, *parts]}]


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def token_ids(choice) -> list[int]:
    return [int(entry.token.split(":")[1]) for entry in choice.logprobs.content]


def chat_tokens(oai, messages) -> list[int]:
    reply = oai.chat.completions.create(model=None, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                                        logprobs=True, extra_body={"ignore_eos": True,
                                                                   "return_tokens_as_token_ids": True})
    return token_ids(reply.choices[0])


def test_openai_and_anthropic_images_match_transformers(server, checkpoint, oai, claude, files):
    hf, directory = checkpoint
    messages = user(image_url(data_url(GOOD)), {"type": "text", "text": "w7 w8"})
    reference = hf_greedy(hf, prompt_ids(directory, messages), [picture(1)])
    assert chat_tokens(oai, messages) == reference
    # The same image fetched from an allowed host: the same answer.
    fetched = user(image_url(f"{files}/ok.png"), {"type": "text", "text": "w7 w8"})
    assert chat_tokens(oai, fetched) == reference
    text = oai.chat.completions.create(model=None, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].message.content
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(GOOD).decode()}}
    # This anthropic SDK has no temperature argument; the API field still exists.
    reply = claude.messages.create(model=MODEL, max_tokens=NEW_TOKENS, extra_body={"temperature": 0, "ignore_eos": True},
                                   messages=[{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, block,
                                                                           {"type": "text", "text": "w7 w8"}]}])
    assert reply.content[0].text == text
    # Anthropic's usage counts the prefix-cache hit apart: the blocks across the image were shared.
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(prompt_ids(directory, messages))
    assert usage.cache_read_input_tokens >= 32


def test_two_images_and_the_responses_api(server, checkpoint, oai):
    hf, directory = checkpoint
    second = encoded(picture(2), "JPEG")
    messages = user(image_url(data_url(GOOD)), {"type": "text", "text": "w7"},
                    image_url(data_url(second, "image/jpeg")), {"type": "text", "text": "w8"})
    images = [picture(1), Image.open(io.BytesIO(second))]
    assert chat_tokens(oai, messages) == hf_greedy(hf, prompt_ids(directory, messages), images)
    response = oai.responses.create(model=MODEL, max_output_tokens=NEW_TOKENS, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "w5 w6"},
                                     {"type": "input_image", "image_url": data_url(GOOD)}]}])
    assert response.status in ("completed", "incomplete") and response.usage.input_tokens > 16


BAD = encoded(picture(3))
BAD_JPEG = encoded(picture(4), "JPEG")
# (what the request's image part is, the words the 400 must carry)
OPENAI_CASES = {
    "not-an-image": (image_url(data_url(b"hello, this is text")), "not an image"),
    "empty-data": (image_url("data:image/png;base64,"), "not an image: the data is empty"),
    "truncated-png": (image_url(data_url(BAD[:len(BAD) // 2])), "truncated or corrupt PNG"),
    "truncated-jpeg": (image_url(data_url(BAD_JPEG[:len(BAD_JPEG) // 2], "image/jpeg")), "truncated or corrupt JPEG"),
    "too-many-pixels": (image_url(data_url(encoded(picture(5, 300, 200)))), "over the limit of 40000 pixels"),
    "too-many-bytes": (image_url(data_url(NOISE)), f"limit of {MAX_IMAGE_BYTES} bytes"),
    "not-base64": (image_url("data:image/png,rawbytes"), "must be base64-encoded"),
    "bad-base64": (image_url("data:image/png;base64,@@@@"), "base64 data is invalid"),
    "not-image-media-type": (image_url("data:text/plain;base64,aGk="), "is not an image"),
    "domain-not-allowed": (image_url("http://example.com/cat.png"), "not in this server's --allowed-media-domains"),
    "unsupported-scheme": (image_url("ftp://127.0.0.1/cat.png"), "unsupported scheme"),
    "file-url-off": (image_url("file:///etc/hostname"), "file:// image URLs are off"),
    "no-url": (image_url(""), "needs a URL"),
}
FETCH_CASES = {   # paths on the loopback file server
    "fetch-404": ("/missing.png", "HTTP 404"),
    "fetch-timeout": ("/slow.png", "timed out after 1s"),
    "fetch-not-an-image": ("/text.png", "not an image"),
    "fetch-too-large": ("/big.png", "image too large"),
    "fetch-redirect": ("/moved.png", "redirects are not followed"),
}


@pytest.mark.parametrize("case", list(OPENAI_CASES))
def test_bad_images_get_a_400_naming_the_part(server, oai, case):
    part, words = OPENAI_CASES[case]
    with pytest.raises(openai.BadRequestError) as error:
        oai.chat.completions.create(model=None, messages=user(part), max_tokens=2)
    assert words in error.value.message and "messages[0].content[1]" in error.value.message
    assert error.value.body["param"] == "messages[0].content[1]"


@pytest.mark.parametrize("case", list(FETCH_CASES))
def test_bad_fetches_get_a_400(server, oai, files, case):
    path, words = FETCH_CASES[case]
    with pytest.raises(openai.BadRequestError, match=words):
        oai.chat.completions.create(model=None, messages=user(image_url(files + path)), max_tokens=2)


def test_too_many_images_names_the_limit(server, oai):
    parts = [image_url(data_url(GOOD))] * 3
    with pytest.raises(openai.BadRequestError, match=r"3 images, more than this server's limit of 2 "
                                                     r"\(--limit-mm-per-prompt\)"):
        oai.chat.completions.create(model=None, messages=user(*parts), max_tokens=2)


@pytest.mark.parametrize("source, words", [
    ({"type": "base64", "media_type": "image/png", "data": base64.b64encode(b"not a picture").decode()},
     "not an image"),
    ({"type": "file", "file_id": "f1"}, "image source type must be base64 or url"),
], ids=["anthropic-not-an-image", "anthropic-bad-source"])
def test_anthropic_bad_images_get_its_400(server, claude, source, words):
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "w5"}, {"type": "image", "source": source}]}])
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "invalid_request_error"
    assert words in error.value.body["error"]["message"] and "messages[0].content[1]" in error.value.body["error"]["message"]


def test_the_server_still_serves(server, oai):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert len(chat_tokens(oai, user(image_url(data_url(GOOD))))) == NEW_TOKENS
