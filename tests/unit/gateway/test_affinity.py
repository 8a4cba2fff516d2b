"""Image affinity keys (gateway/embedmesh/gateway/affinity.py): the key of a request's first image part as the client
sent it, set per request where the chat body is translated (chat and Responses alike), none for a request without
images, bounded in cost and never failing a request; the gateway's calls to the preprocessor carry it as
``x-embedmesh-affinity`` (chat, streamed chat, Responses; both ways of adding metadata)."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from collections.abc import Iterator
from typing import Any

import blake3
import openai
import pytest

from embedmesh.core import fastpath
from embedmesh.gateway import affinity
from embedmesh.gateway.translate import chat_params
from tests.unit.gateway.conftest import MODEL, FakeInference, Harness

PNG_A = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJ"
         "RU5ErkJggg==")
PNG_B = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/iZk9HQAAAABJ"
         "RU5ErkJggg==")


def expected(url: str, prefix: int = 256 * 1024) -> str:
    """The key as documented: BLAKE3 over the URL's length (8 bytes, little-endian) and its first 256 Ki characters,
    the first 8 bytes of the digest in hex."""
    data = len(url).to_bytes(8, "little") + url[:prefix].encode("utf-8", "surrogatepass")
    return blake3.blake3(data).digest()[:8].hex()


def chat_body(*contents: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def in_request(fn: Any, *args: Any) -> Any:
    """Run ``fn`` in a fresh context, as each request's task starts; return (its result, the header it left)."""

    def run() -> Any:
        out = fn(*args)
        return out, affinity.metadata()

    return contextvars.Context().run(run)


def test_the_key_is_blake3_of_the_url_as_sent_short_and_hex() -> None:
    key = affinity.key_of(PNG_A)
    assert key == expected(PNG_A)
    assert len(key) == 16 and int(key, 16) >= 0
    assert affinity.key_of("https://images.example/cat.png") == expected("https://images.example/cat.png")
    assert affinity.key_of(PNG_A) != affinity.key_of(PNG_B)


def test_a_long_url_is_hashed_over_its_length_and_a_bounded_prefix() -> None:
    prefix = affinity.PREFIX_CHARS
    assert prefix == 256 * 1024
    head = "data:image/png;base64," + "A" * prefix
    long_a, long_b = head + "B" * 1000, head + "C" * 1000
    assert affinity.key_of(long_a) == expected(long_a)
    # Past the prefix only the length counts: the same replica for two such files, by design (a hint, bounded).
    assert affinity.key_of(long_a) == affinity.key_of(long_b)
    assert affinity.key_of(long_a) != affinity.key_of(long_a + "B")
    assert affinity.key_of(long_a) != affinity.key_of("x" + long_a[1:])


def test_an_unhashable_url_gives_no_key_instead_of_an_error() -> None:
    lone = "data:image/png;base64,\ud800"  # not UTF-8: hashed as it is (the preprocessor refuses the URL)
    assert affinity.key_of(lone) == expected(lone)

    class Hostile(str):
        def __getitem__(self, item: Any) -> Any:
            raise MemoryError("no")

    assert affinity.key_of(Hostile("data:image/png;base64,AAAA")) == ""
    _, header = in_request(affinity.remember, Hostile("data:x"))
    assert header == []


def test_chat_sets_the_key_of_the_first_image_part_only() -> None:
    body = chat_body("hello", [text("look"), image(PNG_A), image(PNG_B)], [image(PNG_B)])
    params, header = in_request(chat_params, body)
    assert header == [("x-embedmesh-affinity", expected(PNG_A))]
    assert [p.image.url for m in params.messages for p in m.parts if p.WhichOneof("kind") == "image"] == \
        [PNG_A, PNG_B, PNG_B]  # the translation itself is unchanged
    _, header = in_request(chat_params, chat_body([image(PNG_B)], [image(PNG_A)]))
    assert header == [("x-embedmesh-affinity", expected(PNG_B))]


def test_a_request_without_images_carries_no_header_even_after_one_with_images() -> None:
    def two_requests_in_one_context() -> list[Any]:
        chat_params(chat_body([image(PNG_A)]))
        first = affinity.metadata()
        chat_params(chat_body("just text", [text("more text")]))
        return [first, affinity.metadata(), affinity.current()]

    first, second, current = contextvars.Context().run(two_requests_in_one_context)
    assert first == [("x-embedmesh-affinity", expected(PNG_A))]
    assert second == [] and current == ""
    assert contextvars.Context().run(affinity.metadata) == []  # outside a request: nothing


def test_a_refused_body_sets_nothing() -> None:
    from embedmesh.gateway.errors import ApiError

    def refused() -> list[Any]:
        with pytest.raises(ApiError):
            chat_params({"model": "m", "messages": [{"role": "user", "content": [image(PNG_A),
                                                                                {"type": "image_url"}]}]})
        return affinity.metadata()

    assert contextvars.Context().run(refused) == []


async def test_concurrent_requests_each_see_their_own_key() -> None:
    seen: dict[str, list[tuple[str, str]]] = {}

    async def request(name: str, url: str | None) -> None:
        chat_params(chat_body([image(url)] if url else "text"))
        await asyncio.sleep(0.01)  # the others translate meanwhile
        seen[name] = affinity.metadata()

    await asyncio.gather(request("a", PNG_A), request("b", PNG_B), request("none", None))
    assert seen == {"a": [("x-embedmesh-affinity", expected(PNG_A))],
                    "b": [("x-embedmesh-affinity", expected(PNG_B))], "none": []}


class _Recording(FakeInference):
    """The fake preprocessor, noting the affinity header of every generation call (GenerateInline goes through
    Generate)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str | None] = []

    async def Generate(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
        self.keys.append(dict(context.invocation_metadata()).get(affinity.HEADER))
        async for event in super().Generate(request_iterator, context):
            yield event


class _Harness(Harness):
    """The gateway harness with the recording fake (and the metadata path chosen before its channels open)."""

    def __init__(self, fast: str) -> None:
        self.fake = _Recording()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="affinity-test-loop", daemon=True)
        self._thread.start()
        self._servers = []
        before = os.environ.get(fastpath.ENV)
        os.environ[fastpath.ENV] = fast
        try:
            self.run(self._start())
        finally:
            if before is None:
                del os.environ[fastpath.ENV]
            else:
                os.environ[fastpath.ENV] = before


@pytest.fixture(scope="module", params=["on", "off"])  # metadata straight into each call, or interceptors
def recording(request: pytest.FixtureRequest) -> Iterator[_Harness]:
    h = _Harness(request.param)
    yield h
    h.close()


def test_the_gateways_calls_carry_the_key_of_the_requests_first_image(recording: _Harness) -> None:
    sdk = openai.OpenAI(base_url=f"{recording.url}/v1", api_key="none", max_retries=0, timeout=30)
    fake = recording.fake
    fake.keys.clear()
    sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        text("compare"), image(PNG_A), image(PNG_B)]}])
    sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "no image here"}])
    for _ in sdk.chat.completions.create(model=MODEL, stream=True, messages=[{"role": "user", "content": [
            image(PNG_B)]}]):
        pass
    sdk.responses.create(model=MODEL, store=False, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"}, {"type": "input_image", "image_url": PNG_A}]}])
    sdk.completions.create(model=MODEL, prompt="text only")
    assert fake.keys == [expected(PNG_A), None, expected(PNG_B), expected(PNG_A), None]
