"""Images as prompt embeddings through the real mesh (hf worker, SmolLM2) and the openai SDK: scikit-image's bundled
photo of a cat, encoded by EfficientNet-Lite0 and the class-name projector in the preprocessor."""

from __future__ import annotations

import base64
import importlib.metadata
import re
import struct
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MODEL
from tests.support import generate as gen

pytestmark = pytest.mark.e2e

QUESTION = "What animal is in the picture?"
CAT_WORDS = re.compile(r"\b(cat|cats|kitten|kitty|tabby|feline)\b", re.IGNORECASE)


def bundled(name: str) -> bytes:
    dist = importlib.metadata.distribution("scikit-image")
    return Path(str(dist.locate_file(f"skimage/data/{name}"))).read_bytes()


def image_part(data: bytes, media: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{base64.b64encode(data).decode()}"}}


def ask(client: Any, part: dict[str, Any], question: str = QUESTION, max_tokens: int = 12) -> Any:
    return client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": question}]}])


def preprocessor_metric(mesh: Any, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{mesh.extra['metrics_base'] + 1}/metrics", timeout=10).read()
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_cat_picture_is_answered_with_a_cat_and_encoded_once(client: Any, mesh: Any) -> None:
    chelsea = bundled("chelsea.png")
    encodes = preprocessor_metric(mesh, "embedmesh_image_encodes_total")
    hits = preprocessor_metric(mesh, "embedmesh_image_cache_hits_total")
    first = ask(client, image_part(chelsea))
    answer = first.choices[0].message.content
    assert CAT_WORDS.search(answer), answer
    second = ask(client, image_part(chelsea))
    assert second.choices[0].message.content == answer  # greedy, the same rows
    streamed = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12, stream=True,
        messages=[{"role": "user", "content": [image_part(chelsea), {"type": "text", "text": QUESTION}]}])
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer
    assert preprocessor_metric(mesh, "embedmesh_image_encodes_total") - encodes == 1
    assert preprocessor_metric(mesh, "embedmesh_image_cache_hits_total") - hits == 2
    # the image is a handful of rows in the prompt, counted as prompt positions
    by_text = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": QUESTION}]}])
    assert 2 <= first.usage.prompt_tokens - by_text.usage.prompt_tokens <= 16


def test_another_picture_is_not_a_cat(client: Any) -> None:
    """The answer follows the picture: scikit-image's cup of coffee is not a cat."""
    answer = ask(client, image_part(bundled("coffee.png")), "What is in the picture?")
    text = answer.choices[0].message.content
    assert not CAT_WORDS.search(text), text
    assert re.search(r"espresso|coffee", text, re.IGNORECASE), text


def _png_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>'
BAD = [
    ("truncated png", lambda: image_part(bundled("chelsea.png")[:20_000]), "BAD_IMAGE"),
    ("100000x100000 header", lambda: image_part(_png_claiming(100_000, 100_000)), "pixels"),
    ("svg", lambda: image_part(SVG, "image/svg+xml"), "image/svg+xml"),
    ("bad base64", lambda: {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "base64"),
    ("http without hosts", lambda: {"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}},
     "data: URL"),
]


@pytest.mark.parametrize("name,part,words", BAD, ids=[b[0] for b in BAD])
def test_bad_images_are_a_400_naming_the_part(mesh: Any, name: str, part: Any, words: str) -> None:
    r = httpx.post(f"{mesh.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part()]}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1].image_url", error
    assert words in error["message"] or words.lower() == error.get("code"), error


def _grpc_chat(mesh: Any, image: Any, max_tokens: int = 12) -> Any:
    import grpc

    from embedmesh.core.server import channel_options
    from embedmesh.inference.v1 import inference_pb2, inference_pb2_grpc

    params = inference_pb2.ChatParams(model=MODEL, messages=[inference_pb2.ChatMessage(role="user", parts=[
        inference_pb2.ChatContentPart(image=image), inference_pb2.ChatContentPart(text=QUESTION)])])
    params.sampling.max_tokens = max_tokens
    params.sampling.temperature = 0.0
    with grpc.insecure_channel(mesh.preprocessor, options=channel_options()) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        return gen.chat(stub, params, timeout=120)


def test_grpc_raw_image_bytes_give_the_rest_answer(mesh: Any, client: Any) -> None:
    from embedmesh.inference.v1 import inference_pb2

    chelsea = bundled("chelsea.png")
    by_rest = ask(client, image_part(chelsea)).choices[0].message.content
    resp = _grpc_chat(mesh, inference_pb2.ImageInput(data=chelsea))
    assert resp.choices[0].text == by_rest
    assert CAT_WORDS.search(resp.choices[0].text)


def test_the_python_client_sends_image_bytes_and_image_urls_through_generate(mesh: Any, client: Any) -> None:
    from embedmesh_client import Client, EmbedmeshClientError

    chelsea = bundled("chelsea.png")
    by_rest = ask(client, image_part(chelsea)).choices[0].message.content
    with Client(mesh.preprocessor, timeout=120) as c:
        for part in ({"type": "image", "data": chelsea}, image_part(chelsea)):
            messages = [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]
            assert c.chat(MODEL, messages, max_tokens=12, temperature=0).choices[0].text == by_rest
        streamed = "".join(e.text for e in c.stream_chat(MODEL, [{"role": "user", "content": [
            {"type": "image", "data": chelsea}, {"type": "text", "text": QUESTION}]}], max_tokens=12, temperature=0))
        assert streamed == by_rest
        with pytest.raises(EmbedmeshClientError) as info:
            c.chat(MODEL, [{"role": "user", "content": [{"type": "image", "data": chelsea[:20_000]}]}], max_tokens=1)
    assert info.value.field == "messages[0].content[0].image.data"


def test_grpc_bad_image_bytes_name_the_part(mesh: Any) -> None:
    import grpc

    from embedmesh.core.errors import from_rpc_error
    from embedmesh.inference.v1 import inference_pb2

    with pytest.raises(grpc.RpcError) as info:
        _grpc_chat(mesh, inference_pb2.ImageInput(data=SVG))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = from_rpc_error(info.value)
    assert err.field == "messages[0].content[0].image.data" and "SVG" in err.message
