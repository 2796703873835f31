"""Image input through the APIs: image parts of OpenAI chat, Responses and Anthropic Messages requests parsed into the
engine's ImageSources (each error a 400 naming the part), rendered as Qwen's <|vision_start|><|image_pad|><|vision_end|>
in place, and served end to end by a real `tinyserve` process on the tiny multimodal checkpoint (tests/checkpoints.py
make_qwen3_5_vl) through the real `openai` and `anthropic` clients.

The tiny model's text is gibberish: the end-to-end tests check plumbing (accepted formats, image tokens counted in
usage and in the prompt ids, the images reaching the model, remote fetching, every refusal naming the part).
"""
from __future__ import annotations

import base64
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from checkpoints import make_qwen3_5_vl
from server_util import ServerProcess, free_port, http, lazy_import, server_config

from tinyserve.anthropic import parse_messages_request
from tinyserve.images import ImageProcessorConfig, ImageSource, image_token_count
from tinyserve.openai_api import parse_chat_request
from tinyserve.protocol import APIError, RemoteImage
from tinyserve.responses import parse_responses_request
from tinyserve.tokenizer import IMAGE_MARKER, MessageError, Tokenizer, content_text
anthropic = lazy_import("anthropic")
openai = lazy_import("openai")

MAX_IMAGES = 2
MAX_PIXELS = 96 * 64                 # the largest test image fits; 128x64 does not
BODY_LIMIT_MB = 0.25                 # also the cap on a fetched image
PAD = "<|image_pad|>"


# ---------------------------------------------------------------------------------------------------------------
# Images made in memory

def picture(w: int, h: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    """Random RGB pixels encoded as `fmt` (GIF: palette, as GIF files are)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    img = Image.fromarray(pixels)
    if fmt == "GIF":
        img = img.convert("P")
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


PNG = picture(40, 24)
PNG_URL = data_url(PNG)


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def anthropic_image(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": b64(data)}}


# ---------------------------------------------------------------------------------------------------------------
# Rendering: the marker in place, nothing around it; text-only content unchanged

def test_image_marker_goes_where_the_part_was():
    img = image_part(PNG_URL)
    assert content_text([img, text_part("What is this?")], "c") == IMAGE_MARKER + "What is this?"
    assert content_text([text_part("a"), img, text_part("b")], "c") == f"a{IMAGE_MARKER}b"
    assert content_text([text_part("a"), text_part("b"), img], "c") == f"a\nb{IMAGE_MARKER}"
    assert content_text([img, img], "c") == IMAGE_MARKER * 2
    assert content_text([img, "x", "y", img], "c") == f"{IMAGE_MARKER}x\ny{IMAGE_MARKER}"
    # text-only content is joined exactly as before
    assert content_text([text_part("a"), "b", text_part("")], "c") == "a\nb\n"
    assert content_text("plain", "c") == "plain" and content_text(None, "c") is None
    with pytest.raises(MessageError, match="System message cannot contain images") as e:
        content_text([text_part("a"), img], "messages[0].content", images=False)
    assert e.value.param == "messages[0].content[1]"


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory) -> Path:
    folder, _ = make_qwen3_5_vl(tmp_path_factory.mktemp("vl-api"))
    return folder


@pytest.fixture(scope="module")
def vl_tokenizer(vl_folder) -> Tokenizer:
    return Tokenizer.from_folder(vl_folder)


def test_prompt_is_the_official_rendering(vl_tokenizer):
    """The chat route's string content renders as Qwen's template renders the list content itself (tested on keys:
    an image_url part is an image): `<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>What is this?`.
    One pad id per image comes out of the tokenizer."""
    messages = [{"role": "user", "content": [image_part(PNG_URL), text_part("What is this?")]}]
    ours = vl_tokenizer.apply_chat_template(messages)
    assert ours.startswith(f"<|im_start|>user\n{IMAGE_MARKER}What is this?<|im_end|>\n<|im_start|>assistant\n")
    assert ours == vl_tokenizer._template.render(messages=messages, add_generation_prompt=True)
    ids = vl_tokenizer.encode(ours)
    specials = [vl_tokenizer.token_to_id(t) for t in ("<|vision_start|>", PAD, "<|vision_end|>")]
    start = ids.index(specials[0])
    assert ids[start:start + 3] == specials and ids.count(specials[1]) == 1


def test_every_protocol_renders_the_same_prompt(vl_tokenizer):
    """The same text and image sent through chat, Responses and Anthropic Messages: one prompt, one image."""
    from tinyserve.chat import ChatFormat
    chat = parse_chat_request({"messages": [{"role": "user", "content": [
        text_part("Look:"), image_part(PNG_URL), text_part("what is it?")]}]}, "tinyserve")
    resp = parse_responses_request({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Look:"}, {"type": "input_image", "image_url": PNG_URL, "detail": "high"},
        {"type": "input_text", "text": "what is it?"}]}]})
    msgs = parse_messages_request({"max_tokens": 4, "messages": [{"role": "user", "content": [
        text_part("Look:"), anthropic_image(PNG), text_part("what is it?")]}]})
    prompts = [ChatFormat().prompt_ids(r, vl_tokenizer) for r in (chat, resp.chat, msgs.chat)]
    assert prompts[0] == prompts[1] == prompts[2]
    assert vl_tokenizer.decode(prompts[0], skip_special_tokens=False).startswith(
        f"<|im_start|>user\nLook:{IMAGE_MARKER}what is it?<|im_end|>")
    assert chat.images == [ImageSource("messages[0].content[1]", PNG, "image/png")]
    assert resp.chat.images == [ImageSource("input[0].content[1]", PNG, "image/png")]
    assert msgs.chat.images == [ImageSource("messages[0].content[1]", PNG, "image/png")]


def test_text_only_requests_are_unchanged():
    req = parse_chat_request({"messages": [{"role": "user", "content": [text_part("a"), text_part("b")]}]},
                             "tinyserve")
    assert req.messages == [{"role": "user", "content": "a\nb"}] and req.images == []
    msgs = parse_messages_request({"max_tokens": 4, "messages": [{"role": "user", "content": [
        text_part("a"), {"type": "tool_result", "tool_use_id": "t", "content": [text_part("r1"), text_part("r2")]},
        text_part("b")]}]})
    assert msgs.chat.messages == [{"role": "user", "content": "a"},
                                  {"role": "tool", "tool_call_id": "t", "content": "r1\nr2"},
                                  {"role": "user", "content": "b"}] and msgs.chat.images == []
    resp = parse_responses_request({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}]}]})
    assert resp.chat.messages == [{"role": "user", "content": "a\nb"}] and resp.chat.images == []


# ---------------------------------------------------------------------------------------------------------------
# Parsing: sources in prompt order

def test_chat_images_in_prompt_order():
    jpeg = picture(48, 32, "JPEG")
    req = parse_chat_request({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image_part(PNG_URL, detail="low"), text_part("and")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [text_part("now"),
                                     {"type": "image_url", "image_url": data_url(jpeg, "image/jpeg")}]},   # a string
    ]}, "tinyserve")
    assert req.images == [ImageSource("messages[1].content[0]", PNG, "image/png"),
                          ImageSource("messages[3].content[1]", jpeg, "image/jpeg")]
    assert req.messages[1]["content"] == IMAGE_MARKER + "and" and req.messages[3]["content"] == "now" + IMAGE_MARKER


def test_anthropic_images_in_user_turns_and_tool_results():
    gif = picture(40, 24, "GIF")
    req = parse_messages_request({"max_tokens": 4, "messages": [
        {"role": "user", "content": [anthropic_image(PNG), text_part("What is it?")]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [text_part("seen:"), anthropic_image(gif, "image/gif")]},
            {"type": "image", "source": {"type": "url", "url": PNG_URL}}, text_part("and this?")]},
    ]})
    assert req.chat.images == [ImageSource("messages[0].content[0]", PNG, "image/png"),
                               ImageSource("messages[2].content[0].content[1]", gif, "image/gif"),
                               ImageSource("messages[2].content[1]", PNG, "image/png")]
    assert [m["content"] for m in req.chat.messages] == [
        IMAGE_MARKER + "What is it?", "", "seen:" + IMAGE_MARKER, IMAGE_MARKER + "and this?"]


def test_responses_images_in_user_messages_and_tool_outputs():
    req = parse_responses_request({"input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": PNG_URL},
                                     {"type": "input_text", "text": "?"}]},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": PNG_URL}]},
    ]})
    assert [im.param for im in req.chat.images] == ["input[0].content[0]", "input[2].output[0]"]
    assert req.chat.messages[0]["content"] == IMAGE_MARKER + "?" and req.chat.messages[2]["content"] == IMAGE_MARKER


def test_remote_urls_only_when_fetching_is_on():
    url = "https://example.com/cat.png"
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": url}]}]}   # a bare string
    assert parse_chat_request(body, "tinyserve", fetch_image_urls=True).images == \
        [RemoteImage("messages[0].content[0]", url)]
    anth = {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": url}}]}]}
    assert parse_messages_request(anth, fetch_image_urls=True).chat.images == [RemoteImage("messages[0].content[0]",
                                                                                           url)]
    resp = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}
    assert parse_responses_request(resp, fetch_image_urls=True).chat.images == [RemoteImage("input[0].content[0]",
                                                                                            url)]
    for parse in (lambda: parse_chat_request(body, "tinyserve"), lambda: parse_messages_request(anth),
                  lambda: parse_responses_request(resp)):
        with pytest.raises(APIError, match=r"server.fetch_image_urls = false") as e:
            parse()
        assert e.value.status == 400 and e.value.param.endswith("[0].content[0]")


def _user(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


CHAT_ERRORS = [
    # id, messages, param, words
    ("bad-base64", _user(image_part("data:image/png;base64,@@not base64@@")), "messages[0].content[0]",
     "not valid base64"),
    ("unknown-media-type", _user(image_part(data_url(PNG, "image/bmp"))), "messages[0].content[0]",
     "unsupported image media type 'image/bmp'"),
    ("not-an-image-type", _user(image_part("data:text/plain;base64,aGVsbG8=")), "messages[0].content[0]",
     "not an image"),
    ("not-base64-encoded", _user(image_part("data:image/png,rawbytes")), "messages[0].content[0]", "base64"),
    ("http-url", _user(text_part("x"), image_part("http://example.com/a.png")), "messages[0].content[1]",
     "remote image URLs are not fetched (server.fetch_image_urls = false); send the image as a data: URL"),
    ("https-url", _user(image_part("https://example.com/a.png")), "messages[0].content[0]", "fetch_image_urls"),
    ("ftp-url", _user(image_part("ftp://example.com/a.png")), "messages[0].content[0]", "scheme 'ftp'"),
    ("file-url", _user(image_part("file:///etc/passwd")), "messages[0].content[0]", "scheme 'file'"),
    ("no-scheme", _user(image_part("cat.png")), "messages[0].content[0]", "no scheme"),
    ("empty-url", _user(image_part("")), "messages[0].content[0]", "non-empty string"),
    ("no-url", _user({"type": "image_url", "image_url": {"detail": "auto"}}), "messages[0].content[0]",
     "image_url must be"),
    ("system-image", [{"role": "system", "content": [text_part("s"), image_part(PNG_URL)]}] + _user(text_part("u")),
     "messages[0].content[1]", "System message cannot contain images."),
    ("developer-image", [{"role": "developer", "content": [image_part(PNG_URL)]}], "messages[0].content[0]",
     "System message cannot contain images."),
    ("unknown-part", _user({"type": "input_audio", "input_audio": {}}), "messages[0].content[0]",
     "unsupported content part type 'input_audio'"),
]


@pytest.mark.parametrize("messages,param,words", [c[1:] for c in CHAT_ERRORS], ids=[c[0] for c in CHAT_ERRORS])
def test_chat_image_errors(messages, param, words):
    with pytest.raises(APIError) as e:
        parse_chat_request({"messages": messages}, "tinyserve")
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert words in e.value.message and e.value.message.startswith(param)


RESPONSES_ERRORS = [
    ("file-id", [{"role": "user", "content": [{"type": "input_image", "file_id": "file-123"}]}],
     "input[0].content[0]", "file_id is not supported"),
    ("no-image-url", [{"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}],
     "input[0].content[0]", "image_url is required"),
    ("bad-base64", [{"role": "user", "content": [{"type": "input_text", "text": "x"},
                                                 {"type": "input_image", "image_url": "data:image/png;base64,%%"}]}],
     "input[0].content[1]", "not valid base64"),
    ("unknown-media-type", [{"role": "user", "content": [{"type": "input_image",
                                                         "image_url": data_url(PNG, "image/tiff")}]}],
     "input[0].content[0]", "image/tiff"),
    ("http-url", [{"role": "user", "content": [{"type": "input_image", "image_url": "http://example.com/a.png"}]}],
     "input[0].content[0]", "server.fetch_image_urls = false"),
    ("ftp-url", [{"role": "user", "content": [{"type": "input_image", "image_url": "ftp://example.com/a.png"}]}],
     "input[0].content[0]", "scheme 'ftp'"),
    ("image-url-object", [{"role": "user", "content": [{"type": "input_image", "image_url": {"url": PNG_URL}}]}],
     "input[0].content[0]", "must be a non-empty string"),
    ("system-image", [{"role": "system", "content": [{"type": "input_image", "image_url": PNG_URL}]}],
     "input[0].content[0]", "System message cannot contain images."),
    ("developer-image", [{"role": "developer", "content": [{"type": "input_text", "text": "d"},
                                                           {"type": "input_image", "image_url": PNG_URL}]}],
     "input[0].content[1]", "System message cannot contain images."),
    ("assistant-image", [{"role": "assistant", "content": [{"type": "input_image", "image_url": PNG_URL}]}],
     "input[0].content[0].type", "must be one of input_text, output_text"),
    ("input-file", [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
     "input[0].content[0].type", "input_file parts are not supported"),
]


@pytest.mark.parametrize("items,param,words", [c[1:] for c in RESPONSES_ERRORS],
                         ids=[c[0] for c in RESPONSES_ERRORS])
def test_responses_image_errors(items, param, words):
    with pytest.raises(APIError) as e:
        parse_responses_request({"input": items})
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert words in e.value.message


def _source(**source: Any) -> dict[str, Any]:
    return {"type": "image", "source": source}


ANTHROPIC_ERRORS = [
    # id, body (max_tokens added), param, words
    ("bad-base64", {"messages": _user(_source(type="base64", media_type="image/png", data="@@@"))},
     "messages[0].content[0]", "not valid base64"),
    ("unknown-media-type", {"messages": _user(_source(type="base64", media_type="image/bmp", data=b64(PNG)))},
     "messages[0].content[0]", "unsupported image media type 'image/bmp'"),
    ("no-media-type", {"messages": _user(_source(type="base64", data=b64(PNG)))},
     "messages[0].content[0]", "unsupported image media type None"),
    ("data-not-string", {"messages": _user(_source(type="base64", media_type="image/png", data=5))},
     "messages[0].content[0]", "base64 string"),
    ("http-url", {"messages": _user(text_part("x"), _source(type="url", url="https://example.com/a.png"))},
     "messages[0].content[1]", "server.fetch_image_urls = false"),
    ("ftp-url", {"messages": _user(_source(type="url", url="ftp://example.com/a.png"))},
     "messages[0].content[0]", "scheme 'ftp'"),
    ("file-source", {"messages": _user(_source(type="file", file_id="file_1"))},
     "messages[0].content[0]", "file sources"),
    ("no-source", {"messages": _user({"type": "image"})}, "messages[0].content[0]", "source must be"),
    ("in-tool-result", {"messages": _user({"type": "tool_result", "tool_use_id": "t", "content": [
        _source(type="base64", media_type="image/png", data="!")]})},
     "messages[0].content[0].content[0]", "not valid base64"),
    ("in-system", {"system": [text_part("s"), anthropic_image(PNG)], "messages": _user(text_part("u"))},
     "system[1]", "System message cannot contain images."),
    ("in-assistant", {"messages": [{"role": "assistant", "content": [anthropic_image(PNG)]}]},
     "messages[0].content[0].type", "must be one of text, tool_use"),
    ("document", {"messages": _user({"type": "document", "source": {}})}, "messages[0].content[0].type",
     "document blocks are not supported"),
]


@pytest.mark.parametrize("body,param,words", [c[1:] for c in ANTHROPIC_ERRORS], ids=[c[0] for c in ANTHROPIC_ERRORS])
def test_anthropic_image_errors(body, param, words):
    with pytest.raises(APIError) as e:
        parse_messages_request({"max_tokens": 4, **body})
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert words in e.value.message


# ---------------------------------------------------------------------------------------------------------------
# End to end: a real server on the tiny multimodal checkpoint

class _Files(BaseHTTPRequestHandler):
    """Serves FILES by path (a 404 for anything else): the remote images the server fetches."""

    files: dict[str, tuple[bytes, str]] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path not in self.files:
            self.send_error(404)
            return
        data, media_type = self.files[self.path]
        self.send_response(200)
        self.send_header("Content-Type", media_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server with a PNG (right and wrong Content-Type) and a body past the fetch cap."""
    _Files.files = {"/cat.png": (picture(40, 24, seed=7), "image/png"),
                    "/cat.bin": (picture(40, 24, seed=7), "application/octet-stream"),
                    "/huge.png": (b"\x89PNG" + bytes(int(BODY_LIMIT_MB * 1024 * 1024)), "image/png")}
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(vl_folder, tmp_path_factory):
    """Image input on, remote URLs fetched, at most MAX_IMAGES images of MAX_PIXELS each."""
    cfg = server_config(free_port(), {
        "model": {"path": str(vl_folder), "context_length": 2048, "max_images": MAX_IMAGES,
                  "max_image_pixels": MAX_PIXELS},
        "server": {"fetch_image_urls": True, "max_request_body_mb": BODY_LIMIT_MB}})
    proc = ServerProcess(tmp_path_factory.mktemp("image-server"), cfg).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def no_vision(vl_folder, tmp_path_factory):
    """The same checkpoint with model.vision = false (and remote URLs not fetched, the default)."""
    cfg = server_config(free_port(), {"model": {"path": str(vl_folder), "context_length": 2048, "vision": False}})
    proc = ServerProcess(tmp_path_factory.mktemp("no-vision-server"), cfg).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def openai_client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def anthropic_client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def aclient(server) -> anthropic.Anthropic:
    return anthropic_client(server)


@pytest.fixture(scope="module")
def processor(vl_folder) -> ImageProcessorConfig:
    return ImageProcessorConfig.from_folder(vl_folder)


def chat(client: openai.OpenAI, content: list[dict[str, Any]], **kw: Any) -> Any:
    kw.setdefault("max_tokens", 3)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tinyserve", messages=[{"role": "user", "content": content}], **kw)


def text_tokens(tokenizer: Tokenizer, content: list[dict[str, Any]]) -> int:
    """The prompt's length with one pad per image (the template's own rendering)."""
    return len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}])))


def assert_healthy(server: ServerProcess) -> None:
    assert http("GET", server.base_url + "/health")[0] == 200


@pytest.mark.parametrize("fmt,media_type,size", [("PNG", "image/png", (40, 24)), ("JPEG", "image/jpeg", (96, 64)),
                                                 ("WEBP", "image/webp", (64, 48)), ("GIF", "image/gif", (56, 40))])
def test_chat_image_formats(client, vl_tokenizer, processor, fmt, media_type, size):
    """Every supported format is decoded; usage.prompt_tokens counts the image's tokens (one pad widened to them)
    and prompt_token_ids hold exactly that many pads."""
    content = [image_part(data_url(picture(*size, fmt), media_type), detail="auto"), text_part("What is this?")]
    r = chat(client, content, extra_body={"return_token_ids": True})
    n = image_token_count(size[1], size[0], processor)
    assert r.usage.prompt_tokens == text_tokens(vl_tokenizer, content) - 1 + n
    assert r.prompt_token_ids.count(vl_tokenizer.token_to_id(PAD)) == n
    assert 1 <= r.usage.completion_tokens <= 3


def test_two_images_in_order_and_streamed(client, vl_tokenizer, processor):
    """Two images in one message, streamed, with n = 2 (both choices see both images)."""
    content = [text_part("Compare"), image_part(data_url(picture(40, 24, seed=1))), text_part("with"),
               image_part(data_url(picture(96, 64, "JPEG", seed=2), "image/jpeg"))]
    expected = text_tokens(vl_tokenizer, content) - 2 + image_token_count(24, 40, processor) + \
        image_token_count(64, 96, processor)
    chunks = list(chat(client, content, n=2, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == expected
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_the_image_reaches_the_model(client):
    """Same text, same size, different pixels: the first token's logprob differs; the same image gives the same."""
    def first_logprob(seed: int) -> float:
        r = chat(client, [image_part(data_url(picture(40, 24, seed=seed))), text_part("Describe it.")],
                 max_tokens=1, logprobs=True)
        return r.choices[0].logprobs.content[0].logprob

    a, b, a_again = first_logprob(11), first_logprob(12), first_logprob(11)
    assert a != b and a == pytest.approx(a_again, abs=1e-4)


def test_responses_input_image(client, vl_tokenizer, processor):
    r = client.responses.create(model="tinyserve", max_output_tokens=3, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": PNG_URL, "detail": "low"}]}])
    content = [text_part("What is this?"), image_part(PNG_URL)]
    assert r.usage.input_tokens == text_tokens(vl_tokenizer, content) - 1 + image_token_count(24, 40, processor)


def test_anthropic_image_blocks_and_count_tokens(aclient, processor):
    """A base64 image block and one inside a tool_result; count_tokens counts the image tokens as usage does."""
    messages = [
        {"role": "user", "content": [anthropic_image(PNG), text_part("What is this?")]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "zoom", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            anthropic_image(picture(64, 48, "WEBP"), "image/webp")]}]},
    ]
    tools = [{"name": "zoom", "description": "Zoom in", "input_schema": {"type": "object", "properties": {}}}]
    r = aclient.messages.create(model="tinyserve", max_tokens=3, messages=messages, tools=tools)
    counted = aclient.messages.count_tokens(model="tinyserve", messages=messages, tools=tools).input_tokens
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == counted
    text_only = aclient.messages.count_tokens(model="tinyserve", tools=tools, messages=[
        {"role": "user", "content": [text_part("What is this?")]}, messages[1],
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": ""}]}]).input_tokens
    images = image_token_count(24, 40, processor) + image_token_count(48, 64, processor)
    assert counted == text_only + 2 * 3 + images - 2      # each image: its markers, its pad widened to its tokens


def test_remote_images_are_fetched(client, processor, image_host):
    """With server.fetch_image_urls the server fetches http(s) URLs; the Content-Type may be wrong (bytes decide)."""
    inline = chat(client, [image_part(data_url(picture(40, 24, seed=7))), text_part("Hi")], max_tokens=2,
                  logprobs=True)
    for path in ("/cat.png", "/cat.bin"):
        fetched = chat(client, [image_part(image_host + path), text_part("Hi")], max_tokens=2, logprobs=True)
        assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
        assert fetched.choices[0].logprobs.content[0].logprob == \
            pytest.approx(inline.choices[0].logprobs.content[0].logprob, abs=1e-4)


def _openai_error(fn: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        fn()
    assert info.value.status_code == 400
    return info.value.body


def test_openai_refusals_name_the_part(server, client, image_host):
    big = data_url(picture(128, 64))                                   # 8192 pixels > MAX_PIXELS
    cases = [
        # content, param, words
        ([text_part("x"), image_part("data:image/png;base64,@@@")], "messages[0].content[1]", "not valid base64"),
        ([image_part(data_url(PNG, "image/bmp"))], "messages[0].content[0]", "unsupported image media type"),
        ([image_part("ftp://example.com/a.png")], "messages[0].content[0]", "scheme 'ftp'"),
        ([image_part(data_url(b"not an image at all"))], "messages[0].content[0]", "cannot decode image"),
        ([image_part(PNG_URL), image_part(big)], "messages[0].content[1]", "model.max_image_pixels"),
        ([image_part(PNG_URL)] * (MAX_IMAGES + 1), f"messages[0].content[{MAX_IMAGES}]", "model.max_images"),
        ([image_part(image_host + "/missing.png")], "messages[0].content[0]", "HTTP 404"),
        ([image_part(image_host + "/huge.png")], "messages[0].content[0]", "server.max_request_body_mb"),
        ([image_part(image_host + "/cat.png")] * (MAX_IMAGES + 1), f"messages[0].content[{MAX_IMAGES}]",
         "model.max_images"),
        ([image_part("http://127.0.0.1:1/refused.png")], "messages[0].content[0]", "cannot fetch the image URL"),
        ([text_part(f"a literal {PAD} typed by the user"), image_part(PNG_URL)], "messages",
         "2 image placeholder token(s) for 1 image(s)"),
    ]
    for content, param, words in cases:
        err = _openai_error(lambda: chat(client, content))
        assert err["param"] == param and words in err["message"], (param, err)
    err = _openai_error(lambda: client.chat.completions.create(model="tinyserve", max_tokens=2, messages=[
        {"role": "system", "content": [image_part(PNG_URL)]}, {"role": "user", "content": "hi"}]))
    assert err["param"] == "messages[0].content[0]" and err["message"].endswith("System message cannot contain images.")
    err = _openai_error(lambda: client.responses.create(model="tinyserve", max_output_tokens=2, input=[
        {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]))
    assert err["param"] == "input[0].content[0]" and "file_id" in err["message"]
    err = _openai_error(lambda: client.responses.create(model="tinyserve", max_output_tokens=2, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": big}]}]))
    assert err["param"] == "input[0].content[0]" and "model.max_image_pixels" in err["message"]
    assert_healthy(server)
    assert chat(client, [image_part(PNG_URL), text_part("still fine")], max_tokens=1).usage.completion_tokens == 1


def test_anthropic_refusals_name_the_part(server, aclient):
    def error(**kw: Any) -> str:
        with pytest.raises(anthropic.BadRequestError) as info:
            aclient.messages.create(model="tinyserve", max_tokens=2, **kw)
        assert info.value.body["error"]["type"] == "invalid_request_error"
        return info.value.body["error"]["message"]

    bad_type = _source(type="base64", media_type="image/bmp", data=b64(PNG))
    assert error(messages=_user(bad_type)).startswith("messages[0].content[0]: unsupported image media type")
    big = anthropic_image(picture(128, 64))
    assert "model.max_image_pixels" in error(messages=_user(text_part("x"), big))
    too_many = error(messages=_user(*[anthropic_image(PNG)] * (MAX_IMAGES + 1)))
    assert too_many.startswith(f"messages[0].content[{MAX_IMAGES}]") and "model.max_images" in too_many
    assert error(system=[text_part("s"), anthropic_image(PNG)], messages=_user(text_part("u"))) == \
        "system[1]: System message cannot contain images."
    tool = error(messages=_user({"type": "tool_result", "tool_use_id": "t", "content": [
        _source(type="base64", media_type="image/png", data=b64(b"garbage"))]}))
    assert tool.startswith("messages[0].content[0].content[0]: cannot decode image")
    with pytest.raises(anthropic.BadRequestError) as info:      # count_tokens prepares the images too
        aclient.messages.count_tokens(model="tinyserve", messages=_user(*[anthropic_image(PNG)] * (MAX_IMAGES + 1)))
    assert "model.max_images" in info.value.body["error"]["message"]
    assert_healthy(server)


@pytest.mark.slow
def test_vision_off_refuses_images(no_vision):
    """model.vision = false: image parts are a 400 naming the part on every route; http URLs are refused first
    (server.fetch_image_urls is off); text still works."""
    client, aclient = openai_client(no_vision), anthropic_client(no_vision)
    no_images = "this model takes no image input (the checkpoint has no vision tower, or model.vision = false)"
    err = _openai_error(lambda: chat(client, [text_part("x"), image_part(PNG_URL)]))
    assert err["param"] == "messages[0].content[1]" and err["message"] == f"messages[0].content[1]: {no_images}"
    err = _openai_error(lambda: chat(client, [image_part("https://example.com/a.png")]))
    assert err["param"] == "messages[0].content[0]" and "server.fetch_image_urls = false" in err["message"]
    err = _openai_error(lambda: client.responses.create(model="tinyserve", max_output_tokens=2, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": PNG_URL}]}]))
    assert err["param"] == "input[0].content[0]" and no_images in err["message"]
    for call in (lambda: aclient.messages.create(model="tinyserve", max_tokens=2, messages=_user(anthropic_image(PNG))),
                 lambda: aclient.messages.count_tokens(model="tinyserve", messages=_user(anthropic_image(PNG)))):
        with pytest.raises(anthropic.BadRequestError) as info:
            call()
        assert info.value.body["error"]["message"] == f"messages[0].content[0]: {no_images}"
    assert chat(client, [text_part("text is fine")], max_tokens=1).usage.completion_tokens == 1
    status, _, raw = http("POST", no_vision.base_url + "/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": PNG_URL}]}]})   # bare-string image_url
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages[0].content[0]"
